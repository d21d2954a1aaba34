"""GPT-OSS end to end: our model code and adapter loading against transformers (+ PEFT) in float32.

The checkpoint is a tiny random GPT-OSS written by transformers (tests/builders.py `tiny_gpt_oss_config`): 3
layers, sliding window 5 on layers 0 and 2 (the test sequences are up to 30 tokens, so the window matters), yarn
rope, attention sinks, biased router and experts, and swiglu_limit 1 so both clamps of the activation bite. The
oracle is transformers' own GptOssForCausalLM with eager attention and eager experts, one sequence at a time.

1. base logprobs within 1e-5; sinks, window and clamps each change the result (so the match means something);
   experts are stored de-interleaved and transposed exactly; batching does not change a row;
2. PEFT adapters (`all-linear` = attention on GPT-OSS, `target_parameters` on the experts, the router) within
   1e-5 of transformers + PEFT — the target_parameters gate_up delta has interleaved gate/up columns;
3. hand-written expert adapters (per-expert 2D, fused 3D with [gate; up] rows, fused 3D with interleaved rows,
   router LoRA) within 1e-5 of the merged-weights oracle, merged here straight into transformers' transposed,
   interleaved parameters; `gate_up_layout` is required for fused gate_up LoRA, and the wrong one is caught;
4. the Triton backend (through the interpreter on CPU) against the torch backend; GPU tests in bf16;
5. the CLI: `inspect` names the family, and dump-reference + compare agree with --gate-up-layout.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from lora_eval import Batch, Engine, InputError, UnsupportedError
from lora_eval.adapters import load_adapter
from lora_eval.cli import cli
from lora_eval.kernels.fused_moe import activation_ref
from lora_eval.models import load_model
from lora_eval.tasks.dump_reference import merged_copy
from tests.builders import ADAPTER_STRENGTH, hf_logprobs, random_sequences, save_random_model, \
    save_random_peft_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback
from tests.conftest import CPU
from tests.test_families import assert_bf16_like_cpu, k2

VOCAB = 96
TOL = 1e-5  # max abs logprob difference from a float32 oracle
MIN_EFFECT = 1e-3  # a feature or an adapter must move some logprob at least this much
WINDOW = 5  # tiny_gpt_oss_config's sliding window
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# --- helpers --------------------------------------------------------------------------------------------


def sequences(seed: int, n: int = 5) -> list[list[int]]:
    """Mixed lengths from 2 tokens to well past the sliding window."""
    return random_sequences(n - 2, VOCAB, seed=seed, min_len=2, max_len=12) + \
        random_sequences(2, VOCAB, seed=seed + 1, min_len=3 * WINDOW + 1, max_len=30)


def hf_eager(model_dir):
    """transformers' GPT-OSS in float32 with its eager attention and eager experts (the formulas themselves)."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def run(engine: Engine, seqs, tag=None) -> list[torch.Tensor]:
    return engine.logprobs(Batch(seqs, [tag] * len(seqs)))


def max_diff(xs, ys) -> float:
    assert [x.shape for x in xs] == [y.shape for y in ys]
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def assert_close(ours, ref, tol=TOL, what="oracle"):
    diff = max_diff(ours, ref)
    print(f"max |diff| from the {what}: {diff:.3g}")
    assert diff <= tol, f"max abs diff from the {what}: {diff:.3g} > {tol}"


def assert_changes(ours, base, what="adapter"):
    effect = max_diff(ours, base)
    assert effect > MIN_EFFECT, f"the {what} moves logprobs by only {effect:.2e}"



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, session_seed) -> Path:
    return save_random_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=session_seed)


@pytest.fixture(scope="module")
def base_ref(model_dir):
    """seed -> the eager transformers logprobs of sequences(seed)."""
    hf = hf_eager(model_dir)
    return lambda seed: hf_logprobs(hf, sequences(seed))


# --- 1. the base model ----------------------------------------------------------------------------------


def test_base_logprobs_match_transformers(model_dir, base_ref, seed):
    seqs = sequences(seed)
    assert max(map(len, seqs)) > 3 * WINDOW
    engine = Engine.load(model_dir, None, CPU)
    assert_close(run(engine, seqs), base_ref(seed))
    hf = hf_eager(model_dir)
    torch.testing.assert_close(engine.model.inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert engine.model.args.rope_scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert engine.model.args.rope_scale > 1.05  # yarn's attention factor for factor 4
    assert [layer.self_attn.window for layer in engine.model.model.layers] == [WINDOW, None, WINDOW]


@pytest.mark.parametrize("feature", ["sinks", "sliding window", "activation clamps"])
def test_each_gpt_oss_feature_changes_the_result(model_dir, feature, seed):
    """Turning a feature off in our model moves the logprobs, so matching transformers covers it."""
    seqs = sequences(seed)
    model = load_model(model_dir)
    full = run(Engine(model), seqs)
    for layer in model.model.layers:
        if feature == "sinks":
            layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: no sink in the denominator
        elif feature == "sliding window":
            layer.self_attn.window = None
        else:
            layer.mlp.experts.swiglu_limit = 1e4
    assert_changes(run(Engine(model), seqs), full, feature)


def test_activation_equals_transformers_apply_gate(model_dir, seed):
    """Our clamped SwiGLU on de-interleaved gate/up equals transformers' `_apply_gate` on interleaved columns,
    on values well beyond the clamp limit."""
    experts = load_model(model_dir).model.layers[0].mlp.experts
    theirs = hf_eager(model_dir).model.layers[0].mlp.experts
    assert isinstance(theirs, GptOssExperts) and theirs.limit == experts.swiglu_limit == 1.0
    gate_up = 4 * torch.randn(64, 2 * experts.intermediate_size, generator=torch.Generator().manual_seed(seed))
    I = experts.intermediate_size
    assert (gate_up.abs() > 1).float().mean() > 0.5
    ours = activation_ref(gate_up[:, 0::2], gate_up[:, 1::2], experts.activation, experts.swiglu_alpha,
                          experts.swiglu_limit)  # [n, I]
    torch.testing.assert_close(ours, theirs._apply_gate(gate_up), rtol=0, atol=0)
    assert ours.shape == (64, I)


def test_experts_are_deinterleaved_and_transposed_at_load(model_dir):
    model = load_model(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for i, layer in enumerate(model.model.layers):
            experts, key = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
            disk_gu, disk_gu_bias = f.get_tensor(f"{key}.gate_up_proj"), f.get_tensor(f"{key}.gate_up_proj_bias")
            E, H, two_i = disk_gu.shape
            assert tuple(experts.gate_up_proj.shape) == (E, two_i, H)
            assert torch.equal(experts.gate_up_proj[:, : two_i // 2], disk_gu[:, :, 0::2].transpose(1, 2))
            assert torch.equal(experts.gate_up_proj[:, two_i // 2:], disk_gu[:, :, 1::2].transpose(1, 2))
            assert torch.equal(experts.gate_up_proj_bias, torch.cat([disk_gu_bias[:, 0::2], disk_gu_bias[:, 1::2]], 1))
            assert torch.equal(experts.down_proj, f.get_tensor(f"{key}.down_proj").transpose(1, 2))
            assert torch.equal(experts.down_proj_bias, f.get_tensor(f"{key}.down_proj_bias"))


def test_batching_does_not_change_rows(model_dir, seed):
    engine = Engine.load(model_dir, None, CPU)
    seqs = sequences(seed)
    batched = run(engine, seqs)
    for seq, row in zip(seqs, batched):
        assert torch.equal(run(engine, [seq])[0], row)


def test_meta_load_and_refusals(model_dir, tmp_path):
    meta = load_model(model_dir, device="meta")
    assert all(p.is_meta for p in meta.parameters()) and meta.args.sparse_layers == (0, 1, 2)

    def edited(name, **edits):
        folder = shutil.copytree(model_dir, tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        config.update(edits)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    with pytest.raises(UnsupportedError, match="quant_method 'bitsandbytes'"):  # MXFP4: tests/test_quantized.py
        load_model(edited("bnb", quantization_config={"quant_method": "bitsandbytes"}))
    with pytest.raises(InputError, match="layer_types"):
        load_model(edited("layers", layer_types=["full_attention"]))
    with pytest.raises(InputError, match="gate_up_proj"):  # a bigger expert than stored, caught from shapes only
        load_model(edited("bigger", intermediate_size=12), device="meta")


# gpt-oss-20b's published config.json (../shared/data/model-configs/), verbatim but for token ids
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, experts_per_token=4,
    head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096, initializer_range=0.02,
    intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
    quantization_config=dict(modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                     "model.embed_tokens", "lm_head"], quant_method="mxfp4"),
    rms_norm_eps=1e-05, rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0,
                                          original_max_position_embeddings=4096, rope_type="yarn", truncate=False),
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    use_cache=True, vocab_size=201088)


def test_published_gpt_oss_20b_config():
    """The real config (MXFP4 experts: read, tests/test_quantized.py): its legacy rope_scaling gives transformers'
    YaRN."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lora_eval.models import family_and_args, gpt_oss

    assert family_and_args(GPT_OSS_20B, "c.json")[1] == gpt_oss.ModelArgs.from_config(GPT_OSS_20B, "c.json")
    config = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    args = gpt_oss.ModelArgs.from_config(config)
    assert (args.num_experts, args.top_k, args.intermediate_size, args.sliding_window) == (32, 4, 2880, 128)
    assert args.layer_types[:2] == ("sliding_attention", "full_attention") and args.swiglu_limit == 7.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**config))
    torch.testing.assert_close(gpt_oss.rope_inv_freq(args.head_dim, args.rope), inv_freq, rtol=1e-6, atol=0)
    assert args.rope_scale == pytest.approx(scale, rel=1e-12)
    no_rope = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}  # transformers' defaults
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**no_rope))
    args = gpt_oss.ModelArgs.from_config(no_rope)
    torch.testing.assert_close(gpt_oss.rope_inv_freq(args.head_dim, args.rope), inv_freq, rtol=1e-6, atol=0)
    assert args.rope_scale == pytest.approx(scale, rel=1e-12)


# --- 2. adapters written by PEFT ------------------------------------------------------------------------

PEFT_CASES = {
    # PEFT's all-linear on GPT-OSS: q/k/v/o only (router and experts are not nn.Linear)
    "all-linear": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "experts-target-parameters": dict(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERT_PARAMETERS),
    "router-target-parameter": dict(r=2, lora_alpha=4, target_modules=[], target_parameters=["mlp.router.weight"]),
    "all-linear-experts-router": dict(r=2, lora_alpha=6, target_modules="all-linear",
                                      target_parameters=EXPERT_PARAMETERS + ["mlp.router.weight"],
                                      rank_pattern={"down_proj": 5}),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_matches_peft(case, model_dir, base_ref, tmp_path, seed):
    kwargs = PEFT_CASES[case]
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / case, seed=seed, **kwargs)
    seqs = sequences(seed + 1)
    engine = Engine.load(model_dir, {"lora": adapter_dir}, CPU)
    ours = run(engine, seqs, "lora")
    oracle = PeftModel.from_pretrained(hf_eager(model_dir), adapter_dir).eval()
    assert_close(ours, hf_logprobs(oracle, seqs), what="PEFT oracle")
    assert_changes(ours, base_ref(seed + 1))
    adapter = engine.adapters[0]
    assert adapter.layouts == ({"PEFT target_parameters"} if "experts" in case else set())
    if case == "all-linear-experts-router":
        ranks = {t["part"]: t["rank"] for t in adapter.targets if t["layer"] == 0 and t["kind"] != "q_proj"}
        assert ranks == {"experts.gate_up": 2, "experts.down": 5, "dense": 2}


# --- 3. hand-written expert adapters --------------------------------------------------------------------

HAND_LAYOUTS = ("per_expert_2d", "fused_concatenated", "fused_interleaved")


def write_expert_adapter(model_dir, out_dir, *, layout, seed, rank=4, alpha=8, shared_outer=False,
                         include_router=False):
    """Hand-write LoRA on every layer's experts in `layout` and return (adapter dir, merged oracle): the eager
    transformers model with each delta merged into its own parameters — gate_up_proj [E, H, 2I] with gate in the
    even and up in the odd columns, down_proj [E, I, H] — independently of our loader."""
    model = hf_eager(model_dir)
    g = torch.Generator().manual_seed(seed)
    scaling = alpha / rank

    def pair(n_a, n_b, out_dim, in_dim):  # A [n_a, r, in], B [n_b, out, r]; s * B @ A ~ ADAPTER_STRENGTH / sqrt(in)
        a = torch.randn(n_a, rank, in_dim, generator=g) / in_dim**0.5
        return a, torch.randn(n_b, out_dim, rank, generator=g) * ADAPTER_STRENGTH / (scaling * rank**0.5)

    tensors = {}

    def put(module, a, b):
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a.contiguous(), b.contiguous()

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts, prefix = layer.mlp.experts, f"base_model.model.model.layers.{i}.mlp"
            E, H, two_i = experts.gate_up_proj.shape
            I, n_outer = two_i // 2, 1 if shared_outer else E
            gate_a, gate_b = pair(n_outer, E, I, H)
            up_a, up_b = pair(n_outer, E, I, H)
            if layout != "per_expert_2d":
                up_a = gate_a  # one fused projection: one A
            down_a, down_b = pair(E, n_outer, H, I)
            if layout == "per_expert_2d":
                for e in range(E):
                    put(f"{prefix}.experts.{e}.gate_proj", gate_a[e], gate_b[e])
                    put(f"{prefix}.experts.{e}.up_proj", up_a[e], up_b[e])
                    put(f"{prefix}.experts.{e}.down_proj", down_a[e], down_b[e])
            else:
                rows = torch.cat([gate_b, up_b], 1) if layout == "fused_concatenated" else \
                    torch.stack([gate_b, up_b], 2).reshape(E, two_i, rank)  # gate0, up0, gate1, up1, ...
                put(f"{prefix}.experts.gate_up_proj", gate_a, rows)
                put(f"{prefix}.experts.down_proj", down_a, down_b)
            experts.gate_up_proj[:, :, 0::2] += scaling * (gate_b @ gate_a).transpose(1, 2)
            experts.gate_up_proj[:, :, 1::2] += scaling * (up_b @ up_a).transpose(1, 2)
            experts.down_proj += scaling * (down_b @ down_a).transpose(1, 2)
            if include_router:
                router_a, router_b = pair(1, 1, E, H)
                put(f"{prefix}.router", router_a[0], router_b[0])
                layer.mlp.router.weight += scaling * (router_b[0] @ router_a[0])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha,
                  target_modules=["experts", "router"] if include_router else ["experts"])
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir, model


HAND_CASES = {  # id -> (writer kwargs, gate_up_layout given to the loader)
    "per-expert-2d-router": (dict(layout="per_expert_2d", include_router=True), None),
    "fused-concatenated-shared-outer": (dict(layout="fused_concatenated", shared_outer=True, rank=3, alpha=5),
                                        "concatenated"),
    "fused-interleaved-router": (dict(layout="fused_interleaved", include_router=True), "interleaved"),
}


@pytest.mark.parametrize("case", list(HAND_CASES))
def test_hand_written_adapter_matches_merged_oracle(case, model_dir, base_ref, tmp_path, seed):
    kwargs, gate_up_layout = HAND_CASES[case]
    adapter_dir, oracle = write_expert_adapter(model_dir, tmp_path / case, seed=seed, **kwargs)
    seqs = sequences(seed + 1)
    expected = hf_logprobs(oracle, seqs)
    engine = Engine.load(model_dir, {"hand": adapter_dir}, replace(CPU, gate_up_layout=gate_up_layout))
    ours = run(engine, seqs, "hand")
    assert_close(ours, expected, what="merged oracle")
    assert_changes(ours, base_ref(seed + 1))
    adapter = engine.adapters[0]
    assert adapter.layouts == {"per-expert 2D" if kwargs["layout"] == "per_expert_2d" else
                               "shared-outer 3D" if kwargs.get("shared_outer") else "fused 3D"}
    assert {t["site"] for t in adapter.targets if t["kind"] == "router"} == \
        ({f"model.layers.{i}.mlp.router" for i in range(3)} if kwargs.get("include_router") else set())
    # the trainer side (dump-reference) merges our parsed adapter into transformers' layout: the same numbers
    assert_close(hf_logprobs(merged_copy(hf_eager(model_dir), adapter), seqs), expected, what="merged oracle")
    if gate_up_layout is not None:
        other = "concatenated" if gate_up_layout == "interleaved" else "interleaved"
        wrong = run(Engine.load(model_dir, {"hand": adapter_dir}, replace(CPU, gate_up_layout=other)), seqs, "hand")
        assert_changes(wrong, expected, f"gate_up_layout {other} instead of {gate_up_layout}")
        with pytest.raises(InputError, match="--gate-up-layout") as info:
            load_adapter(adapter_dir, "hand", engine.model)
        assert "mlp.experts.gate_up_proj.lora_B.weight" in str(info.value)
    with pytest.raises(InputError, match="'rows' is not one of interleaved, concatenated"):
        load_adapter(adapter_dir, "hand", engine.model, gate_up_layout="rows")


# --- 4. Triton backend and GPU --------------------------------------------------------------------------


def make_mixed_adapters(model_dir, root, seed):
    """A PEFT all-linear adapter with expert and router target_parameters, and a hand-written fused expert one."""
    return {
        "peft": save_random_peft_adapter(model_dir, root / "peft", seed=seed + 1, r=4, lora_alpha=8,
                                         target_modules="all-linear",
                                         target_parameters=EXPERT_PARAMETERS + ["mlp.router.weight"]),
        "hand": write_expert_adapter(model_dir, root / "hand", layout="fused_interleaved", shared_outer=True,
                                     seed=seed + 2, rank=2)[0],
    }


@pytest.fixture(scope="module")
def mixed_adapters(model_dir, tmp_path_factory, session_seed):
    return make_mixed_adapters(model_dir, tmp_path_factory.mktemp("gpt_oss_adapters"), session_seed)


def run_on(model_dir, adapters, backend, device, dtype, seqs, tags):
    model = load_model(model_dir, dtype=dtype, device=device)
    adapters = [load_adapter(p, n, model, gate_up_layout="interleaved") for n, p in adapters.items()]
    return Engine(model, adapters, backend=backend).logprobs(Batch(seqs, tags))


def test_mixed_batch_rows_equal_rows_alone(model_dir, mixed_adapters, seed):
    """Two adapters and base rows in one batch (torch backend): every row equals that row run alone, bit for
    bit, and base rows equal the engine without adapters."""
    seqs = sequences(seed, n=6)
    tags = ["peft", None, "hand", "hand", None, "peft"]
    mixed = run_on(model_dir, mixed_adapters, "torch", "cpu", torch.float32, seqs, tags)
    for seq, tag, row in zip(seqs, tags, mixed):
        assert torch.equal(run_on(model_dir, mixed_adapters, "torch", "cpu", torch.float32, [seq], [tag])[0], row)
        if tag is None:
            assert torch.equal(run_on(model_dir, {}, "torch", "cpu", torch.float32, [seq], [None])[0], row)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu tests run the kernels compiled")
def test_triton_backend_matches_torch_in_the_interpreter(model_dir, mixed_adapters, seed):
    seqs = random_sequences(5, VOCAB, seed=seed, min_len=2, max_len=3 * WINDOW)
    tags = ["peft", "hand", None, "peft", "hand"]
    ref = run_on(model_dir, mixed_adapters, "torch", "cpu", torch.float32, seqs, tags)
    out = run_on(model_dir, mixed_adapters, "triton", "cpu", torch.float32, seqs, tags)
    assert_close(out, ref, 1e-4, "torch backend")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu_float32(model_dir, mixed_adapters, seed, tmp_path):
    """float32 on CUDA against the CPU engine (k2 < 1e-8); then bf16 on CUDA as for the other families
    (tests/test_families.py assert_bf16_like_cpu) on a model stored in bf16 with milder routing and next-token
    distributions (router gain 2, lm_head gain 0.5). On the deliberately peaked test model even the CPU's bf16
    run is 3e-4 to 2e-3 from float32 (routing flips), too noisy a yardstick."""
    seqs = random_sequences(12, VOCAB, seed=seed, max_len=40)
    tags = ["peft", "hand", None] * 4
    ref = run_on(model_dir, mixed_adapters, "torch", "cpu", torch.float32, seqs, tags)
    fp32 = k2(ref, run_on(model_dir, mixed_adapters, None, "cuda", torch.float32, seqs, tags))
    mild = save_random_model(tmp_path / "mild", "gpt_oss", seed=seed, dtype=torch.bfloat16, router_gain=2.0,
                             lm_head_gain=0.5)
    adapters = make_mixed_adapters(mild, tmp_path / "mild_adapters", seed)
    ref = run_on(mild, adapters, "torch", "cpu", torch.float32, seqs, tags)
    gpu = run_on(mild, adapters, None, "cuda", torch.bfloat16, seqs, tags)
    cpu = run_on(mild, adapters, "torch", "cpu", torch.bfloat16, seqs, tags)
    print(f"gpt_oss k2 vs CPU float32: cuda float32 {fp32:.3g}")
    assert fp32 < 1e-8
    assert_bf16_like_cpu("gpt_oss", ref, gpu, cpu)


# --- 5. CLI ---------------------------------------------------------------------------------------------


def cli_run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_inspect_dump_reference_and_compare(model_dir, mixed_adapters, tmp_path, seed):
    adapter_args = [x for name, path in mixed_adapters.items() for x in ("--adapter", f"{name}={path}")]
    result = cli_run("inspect", "--model", model_dir, *adapter_args, "--gate-up-layout", "interleaved")
    assert_no_traceback(result)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("model: gpt_oss, 3 layers, hidden 32, 6 experts top-2 in 3 layers"), result.stdout
    assert "adapter hand: layout shared-outer 3D" in result.stdout
    assert "adapter peft: layout PEFT target_parameters" in result.stdout

    missing = cli_run("inspect", "--model", model_dir, *adapter_args)
    assert_input_error(missing, "--gate-up-layout", "gate_up_proj.lora_B.weight")

    prompts = tmp_path / "prompts.jsonl"
    seqs = sequences(seed, n=6)
    prompts.write_text("".join(json.dumps(dict(input_ids=ids, adapter=[None, "peft", "hand"][i % 3])) + "\n"
                               for i, ids in enumerate(seqs)))
    ref = tmp_path / "ref.parquet"
    dumped = cli_run("dump-reference", "--model", model_dir, *adapter_args, "--prompts", prompts, "--out", ref,
                     "--gate-up-layout", "interleaved", "--quiet")
    assert dumped.exit_code == 0, (dumped.output, dumped.exception)
    compared = cli_run("compare", "--model", model_dir, *adapter_args, "--reference", ref, "--out", tmp_path / "run",
                       "--gate-up-layout", "interleaved", "--max-k2", "1e-10", "--quiet")
    assert compared.exit_code == 0, (compared.output, compared.exception)
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert set(summary["adapter"]) == {"base", "peft", "hand", "overall"}
    assert summary["max_abs_diff"].max() < TOL, summary
