"""Our model code against transformers: base log-probabilities, dtypes, meta loading and refusals.

Every checkpoint is a tiny random one written by ``tests/builders.py`` from the session's fresh seed and
built once per module. The oracle is the transformers model of the same folder, run in float32 one
sequence at a time; our engine runs all sequences of a case in one right-padded batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lora_eval import Batch, Engine, InputError, UnsupportedError
from lora_eval.models import load_model
from tests.builders import hf_logprobs, load_hf, random_sequences, save_random_model, save_random_peft_adapter
from tests.conftest import CPU, MOE_OVERRIDES

VOCAB = 96  # tests/builders.py's tiny vocabulary
FP32_TOL = 1e-5  # max abs logprob difference, ours vs transformers, both float32
# Tied models use the embedding (std 1, not 1/sqrt(H)) as lm_head: logprobs reach about -45, and transformers'
# own float32 result is then ~1e-5 away from its float64 one, so 1e-5 would test rounding noise.
TIED_FP32_TOL = 3e-5
# Mean abs logprob difference of a reduced-precision engine vs our float32 one, over LOW_PRECISION_ROWS rows.
# Over 150 seeds with 16 rows: bf16 median 0.017, max 0.045; fp16 median 0.002, max 0.013. The tail comes
# from tokens whose top-k experts flip under reduced precision, so many rows keep the mean stable.
LOW_PRECISION_MEAN_TOL = {"bfloat16": 0.06, "float16": 0.02}
LOW_PRECISION_ROWS = 24

# A llama3 rope with a short original context, so that its low-frequency scaling changes the rotations
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16, "rope_theta": 10000.0,
}
SMALL_SHARD = "20KB"  # the tiny MoE checkpoint is ~130 KB in float32, so this gives several shards

# case name -> (family, save_random_model overrides). transformers 5 takes rope settings as rope_parameters
# (a legacy rope_scaling kwarg is folded into it) and writes them under that key in config.json.
CASES = {
    "qwen3_moe": ("qwen3_moe", dict(MOE_OVERRIDES)),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", {**MOE_OVERRIDES, "norm_topk_prob": False}),
    "qwen3_moe_sparse_step_2": ("qwen3_moe", {**MOE_OVERRIDES, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    "qwen3_moe_tied": ("qwen3_moe", {**MOE_OVERRIDES, "tie_word_embeddings": True}),
    "qwen3_moe_sharded": ("qwen3_moe", {**MOE_OVERRIDES, "max_shard_size": SMALL_SHARD}),
    "qwen3_moe_attention_bias": ("qwen3_moe", {**MOE_OVERRIDES, "attention_bias": True}),
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_rope_llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "llama_mlp_bias": ("llama", {"mlp_bias": True}),
}


# --- helpers ------------------------------------------------------------------------------------


def mixed_length_sequences(seed: int) -> list[list[int]]:
    """Short rows (from 2 tokens) and long rows together, so the engine must right-pad."""
    short = random_sequences(3, VOCAB, seed=seed, min_len=2, max_len=8)
    long = random_sequences(2, VOCAB, seed=seed + 1, min_len=16, max_len=24)
    return [long[0], *short, long[1]]


def engine_logprobs(engine: Engine, seqs: list[list[int]]) -> list[torch.Tensor]:
    """All of ``seqs`` in one batch on the base model."""
    return engine.logprobs(Batch(input_ids=seqs, adapters=[None] * len(seqs)))


def assert_rows_close(ours: list[torch.Tensor], ref: list[torch.Tensor], seqs: list[list[int]], tol: float):
    assert len(ours) == len(ref) == len(seqs)
    for i, (a, b, seq) in enumerate(zip(ours, ref, seqs)):
        assert a.dtype == torch.float32 and a.shape == (len(seq) - 1,), f"row {i}: {a.dtype} {tuple(a.shape)}"
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"row {i} (length {len(seq)}): max abs diff {diff:.3g} > {tol}"


def max_abs_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def mean_abs_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return torch.cat([x - y for x, y in zip(xs, ys)]).abs().mean().item()


def copy_with_config(src: Path, dst: Path, **edits) -> Path:
    """A copy of checkpoint ``src`` whose config.json has ``edits`` applied (a value of None removes the key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# --- checkpoints, built once per module ---------------------------------------------------------



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, session_seed):
    """``checkpoint(case)`` -> the folder of that CASES checkpoint, written on first use.

    All cases share the session seed, so e.g. llama and llama_rope_llama3 have identical weights."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            family, overrides = CASES[case]
            built[case] = save_random_model(tmp_path_factory.mktemp(case), family, seed=session_seed, **overrides)
        return built[case]

    return get


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, session_seed) -> Path:
    """A tiny Qwen3-MoE checkpoint stored in bfloat16."""
    return save_random_model(tmp_path_factory.mktemp("qwen3_moe_bf16"), "qwen3_moe", seed=session_seed + 1,
                             dtype=torch.bfloat16, **MOE_OVERRIDES)


# --- 1. base logprobs equal transformers' -------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_base_logprobs_match_transformers(checkpoint, case, seed):
    model_dir = checkpoint(case)
    seqs = mixed_length_sequences(seed)
    ref = hf_logprobs(load_hf(model_dir), seqs)
    ours = engine_logprobs(Engine.load(model_dir, None, CPU), seqs)
    assert_rows_close(ours, ref, seqs, TIED_FP32_TOL if CASES[case][1].get("tie_word_embeddings") else FP32_TOL)


def test_batching_does_not_change_rows(checkpoint, seed):
    """Each row of a right-padded batch equals the same row run alone, bit for bit: the CPU path computes
    GEMMs in fixed row blocks and attention per row, so padding and batch mates cannot change a row."""
    engine = Engine.load(checkpoint("qwen3_moe"), None, CPU)
    seqs = mixed_length_sequences(seed)
    batched = engine_logprobs(engine, seqs)
    alone = [engine_logprobs(engine, [seq])[0] for seq in seqs]
    assert_rows_close(batched, alone, seqs, 0.0)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_no_norm_topk", "qwen3_moe_sparse_step_2"])
def test_sparse_layers_and_router_settings_match_transformers(checkpoint, case):
    model_dir = checkpoint(case)
    hf = load_hf(model_dir)
    ours = load_model(model_dir)
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert hf_sparse and len(hf_sparse) < len(hf.model.layers), "each case mixes sparse and dense layers"
    assert ours.args.sparse_layers == hf_sparse
    assert ours.args.norm_topk_prob == hf.config.norm_topk_prob
    assert (ours.args.num_experts, ours.args.top_k) == (6, 2)


def test_llama3_rope_is_used_by_oracle_and_by_us(checkpoint, seed):
    """The llama3 case differs from default rope (same weights), in transformers and in ours alike."""
    scaled_dir, default_dir = checkpoint("llama_rope_llama3"), checkpoint("llama")
    config = json.loads((scaled_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    hf_scaled, hf_default = load_hf(scaled_dir), load_hf(default_dir)
    ours = load_model(scaled_dir)
    torch.testing.assert_close(ours.inv_freq, hf_scaled.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    assert (ours.inv_freq - load_model(default_dir).inv_freq).abs().max() > 1e-2

    seqs = mixed_length_sequences(seed)
    ref_scaled, ref_default = hf_logprobs(hf_scaled, seqs), hf_logprobs(hf_default, seqs)
    assert max_abs_diff(ref_scaled, ref_default) > 1e-2, "the oracle ignored the llama3 rope settings"
    assert max_abs_diff(engine_logprobs(Engine.load(scaled_dir, None, CPU), seqs), ref_default) > 1e-2


def test_sharded_checkpoint_has_several_shards(checkpoint):
    model_dir = checkpoint("qwen3_moe_sharded")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3
    assert all((model_dir / name).is_file() for name in shards)
    assert not (model_dir / "model.safetensors").exists()


def test_tied_checkpoint_stores_no_lm_head(checkpoint):
    """The tied case really is tied: no lm_head on disk, and our lm_head equals the embedding."""
    model_dir = checkpoint("qwen3_moe_tied")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    model = load_model(model_dir)
    assert model.args.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


# --- 2. and 3. a bfloat16 checkpoint ------------------------------------------------------------


def test_bf16_checkpoint_loaded_in_float32_matches_transformers(bf16_checkpoint, seed):
    seqs = mixed_length_sequences(seed)
    ref = hf_logprobs(load_hf(bf16_checkpoint), seqs)
    ours = engine_logprobs(Engine.load(bf16_checkpoint, None, CPU), seqs)
    assert_rows_close(ours, ref, seqs, FP32_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_engine_is_close_to_float32(bf16_checkpoint, dtype, seed):
    seqs = random_sequences(LOW_PRECISION_ROWS, VOCAB, seed=seed, min_len=2, max_len=24)
    full = engine_logprobs(Engine.load(bf16_checkpoint, None, CPU), seqs)
    low = engine_logprobs(Engine.load(bf16_checkpoint, None, replace(CPU, dtype=dtype)), seqs)
    assert all(row.dtype == torch.float32 for row in low)
    assert all(torch.isfinite(row).all() for row in low)
    diff = mean_abs_diff(low, full)
    assert diff < LOW_PRECISION_MEAN_TOL[dtype], f"{dtype}: mean abs diff {diff:.3g}"
    assert diff > 0, f"{dtype} run gave float32's numbers exactly: was it computed in {dtype}?"


def test_bf16_load_keeps_bf16_and_fuses_experts(bf16_checkpoint):
    low = load_model(bf16_checkpoint, dtype=torch.bfloat16)
    full = load_model(bf16_checkpoint, dtype=torch.float32)
    assert next(low.parameters()).dtype == torch.bfloat16
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    low_bytes = sum(p.numel() * p.element_size() for p in low.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    assert 2 * low_bytes == full_bytes

    args = low.args
    E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
    assert args.sparse_layers, "the MoE checkpoint has no sparse layers"
    with safe_open(str(bf16_checkpoint / "model.safetensors"), framework="pt") as f:
        for i in args.sparse_layers:
            experts = low.model.layers[i].mlp.experts
            assert tuple(experts.gate_up_proj.shape) == (E, 2 * I, H)
            assert tuple(experts.down_proj.shape) == (E, H, I)
            for e in range(E):
                key = f"model.layers.{i}.mlp.experts.{e}"
                # bf16 -> bf16 is exact: gate rows first, then up rows
                assert torch.equal(experts.gate_up_proj[e, :I], f.get_tensor(f"{key}.gate_proj.weight"))
                assert torch.equal(experts.gate_up_proj[e, I:], f.get_tensor(f"{key}.up_proj.weight"))
                assert torch.equal(experts.down_proj[e], f.get_tensor(f"{key}.down_proj.weight"))
    torch.testing.assert_close(full.model.layers[args.sparse_layers[0]].mlp.experts.gate_up_proj,
                               low.model.layers[args.sparse_layers[0]].mlp.experts.gate_up_proj.float(),
                               rtol=0, atol=0)


def test_projections_of_one_input_share_one_buffer(checkpoint, seed):
    """q / k / v (with biases) and a dense MLP's gate / up are row views of one buffer holding the checkpoint's
    tensors; the Triton backend computes each group in one GEMM and matches the torch backend (which multiplies
    each view alone); a member whose weight is replaced afterwards leaves the group and gets its own GEMM."""
    folder = checkpoint("llama_attention_bias")
    model = load_model(folder)
    layer = model.model.layers[0]
    attention = layer.self_attn
    members = [attention.q_proj, attention.k_proj, attention.v_proj]
    group = members[0].group
    assert group is not None and all(m.group is group for m in members)
    assert group.sites == tuple(m.site for m in members) and group.serves(members)
    assert layer.mlp.gate_proj.group is layer.mlp.up_proj.group is not None
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        prefix = "model.layers.0.self_attn"
        expected_w = torch.cat([f.get_tensor(f"{prefix}.{n}_proj.weight") for n in "qkv"]).float()
        expected_b = torch.cat([f.get_tensor(f"{prefix}.{n}_proj.bias") for n in "qkv"]).float()
    assert torch.equal(group.weight, expected_w) and torch.equal(group.bias, expected_b)
    start = 0
    for m in members:  # views of the buffer, not copies
        assert m.weight.data_ptr() == group.weight[start].data_ptr()
        assert m.bias.data_ptr() == group.bias[start:].data_ptr()
        start += m.out_features

    seqs = mixed_length_sequences(seed)
    torch_out = engine_logprobs(Engine(model, [], backend="torch"), seqs)
    triton_out = engine_logprobs(Engine(model, [], backend="triton"), seqs)
    assert max_abs_diff(triton_out, torch_out) <= FP32_TOL
    replaced = attention.k_proj.weight.detach().clone()
    replaced[0] += 1.0  # a different k: the group must not keep multiplying the buffer's rows
    attention.k_proj.weight = torch.nn.Parameter(replaced, requires_grad=False)
    assert not group.serves(members)
    torch_changed = engine_logprobs(Engine(model, [], backend="torch"), seqs)
    assert max_abs_diff(torch_changed, torch_out) > 1e-3
    assert max_abs_diff(engine_logprobs(Engine(model, [], backend="triton"), seqs), torch_changed) <= FP32_TOL


# --- 4. meta device -----------------------------------------------------------------------------


def _no_tensor_reads(self, key, *args, **kwargs):
    raise AssertionError(f"a meta load read tensor {key}")


def test_meta_load_reads_no_tensor(moe_model, monkeypatch):
    reference = load_model(moe_model)
    monkeypatch.setattr("lora_eval.models.checkpoint.TensorFiles.get", _no_tensor_reads)
    meta = load_model(moe_model, device="meta")
    assert meta.args == reference.args
    shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    assert {name: tuple(p.shape) for name, p in meta.named_parameters()} == shapes
    assert all(p.is_meta for p in meta.parameters())


def test_loading_imports_no_compiler(moe_model, tmp_path, session_seed):
    """A fresh process loading a checkpoint and an adapter does not import torch's compiler stack (torch._dynamo
    and sympy: 4 s of a process's first load on the GPU machine, through torch.cat and torch.arange on meta
    tensors); the names are listed so that a failure says which came in."""
    adapter = save_random_peft_adapter(moe_model, tmp_path / "a", seed=session_seed, r=2, lora_alpha=4,
                                       target_modules="all-linear")
    code = ("import sys; from lora_eval import Engine, EngineOptions; "
            f"Engine.load({str(moe_model)!r}, {{'a': {str(adapter)!r}}}, EngineOptions(device='cpu')); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sympy' or m.startswith('torch._dynamo')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout[:500]


def test_meta_load_still_checks_shapes(moe_model, tmp_path, monkeypatch):
    """config.json describing bigger experts than stored is caught without reading any tensor."""
    bigger = MOE_OVERRIDES["moe_intermediate_size"] + 4
    model_dir = copy_with_config(moe_model, tmp_path / "ckpt", moe_intermediate_size=bigger)
    monkeypatch.setattr("lora_eval.models.checkpoint.TensorFiles.get", _no_tensor_reads)
    with pytest.raises(InputError) as info:
        load_model(model_dir, device="meta")
    assert ".mlp.experts." in str(info.value) and "shape" in str(info.value)


# --- 5. unsupported configurations are refused by name ------------------------------------------


def test_unsupported_architecture_is_refused_by_name(moe_model, tmp_path):
    model_dir = copy_with_config(moe_model, tmp_path / "ckpt", model_type="deepseek_v2",
                                 architectures=["DeepseekV2ForCausalLM"])
    for load in (lambda: load_model(model_dir), lambda: Engine.load(model_dir, None, CPU)):
        with pytest.raises(UnsupportedError) as info:
            load()
        message = str(info.value)
        assert "deepseek_v2" in message
        assert message.startswith(f"{model_dir / 'config.json'}: model_type: "), message


@pytest.mark.parametrize("rope_key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_refused_by_name(checkpoint, tmp_path, rope_key):
    """A yarn rope, written the transformers 5 way (rope_parameters) or the legacy way (rope_scaling)."""
    if rope_key == "rope_parameters":
        edits = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "rope_theta": 10000.0}}
    else:
        edits = {"rope_parameters": None, "rope_theta": 10000.0,
                 "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    model_dir = copy_with_config(checkpoint("llama"), tmp_path / "ckpt", **edits)
    with pytest.raises(UnsupportedError) as info:
        load_model(model_dir)
    assert "yarn" in str(info.value) and "config.json" in str(info.value)


# --- 6. engine input validation -----------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_engine(moe_model, tmp_path_factory, session_seed) -> Engine:
    """The session MoE model with two small PEFT adapters, 'alpha' and 'beta'."""
    adapters = {
        name: save_random_peft_adapter(moe_model, tmp_path_factory.mktemp(name), seed=session_seed + k,
                                       r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
        for k, name in enumerate(["alpha", "beta"])
    }
    return Engine.load(moe_model, adapters, CPU)


@pytest.mark.parametrize("bad_token", [VOCAB, VOCAB + 7, -1])
def test_token_outside_vocabulary_names_the_row(adapter_engine, seed, bad_token):
    seqs = random_sequences(3, VOCAB, seed=seed)
    seqs[1][len(seqs[1]) // 2] = bad_token
    with pytest.raises(InputError) as info:
        adapter_engine.logprobs(Batch(input_ids=seqs, adapters=[None, "alpha", None]))
    message = str(info.value)
    assert message.startswith("row 1: "), message
    assert str(bad_token) in message and str(VOCAB) in message


@pytest.mark.parametrize("length", [0, 1])
def test_too_short_sequence_names_the_row(adapter_engine, seed, length):
    seqs = random_sequences(3, VOCAB, seed=seed)
    seqs[2] = seqs[2][:length]
    with pytest.raises(InputError) as info:
        adapter_engine.logprobs(Batch(input_ids=seqs, adapters=[None] * 3))
    assert str(info.value).startswith("row 2: "), str(info.value)


def test_unknown_adapter_names_it_and_the_known_ones(adapter_engine, seed):
    seqs = random_sequences(2, VOCAB, seed=seed)
    with pytest.raises(InputError) as info:
        adapter_engine.logprobs(Batch(input_ids=seqs, adapters=["beta", "gamma"]))
    message = str(info.value)
    assert message.startswith("row 1: "), message
    assert "gamma" in message and "alpha" in message and "beta" in message


def test_adapter_engine_base_rows_equal_transformers(adapter_engine, moe_model, seed):
    """The engine used for the rejections above still runs, and its base rows are the base model's."""
    seqs = mixed_length_sequences(seed)
    tags = [None, "alpha", None, "beta", None]
    ours = adapter_engine.logprobs(Batch(input_ids=seqs, adapters=tags))
    ref = hf_logprobs(load_hf(moe_model), seqs)
    base_rows = [i for i, tag in enumerate(tags) if tag is None]
    assert_rows_close([ours[i] for i in base_rows], [ref[i] for i in base_rows],
                      [seqs[i] for i in base_rows], FP32_TOL)
    adapted = max((ours[i] - ref[i]).abs().max().item() for i, tag in enumerate(tags) if tag is not None)
    assert adapted > 1e-3, "adapter rows gave the base model's numbers"
