"""GLM-4.5 / 4.5-Air (glm4_moe) against transformers + PEFT, float32 on the CPU.

1. base logprobs of tiny checkpoints written by transformers within 1e-5: partial rotary with and without q/k norm,
   q/k/v biases, dense first layers, shared experts, sigmoid routing with a (random) correction bias over n_group > 1
   groups, routed_scaling_factor; per-expert (published) and fused (transformers 5) expert keys; what each feature
   changes in transformers' own numbers; MTP-layer keys of the releases skipped, other unknown keys refused;
2. the published configs give transformers' parameter names and shapes; shrunk (few layers, small dims, every
   structural field kept) they give transformers' logprobs;
3. adapters made by PEFT (all-linear: attention, router and routed experts; target_parameters) against PEFT,
   hand-written expert layouts and per-module shared-expert / dense-MLP LoRA against the merged-weights oracle;
4. the Triton backend against the torch backend in the interpreter; CUDA (gpu marker);
5. `inspect` names the family; what the family does not compute is refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lora_eval import Engine, InputError, UnsupportedError
from lora_eval.models import FAMILIES, load_model
from lora_eval.models.glm4_moe import rotary_dim
from tests.builders import hf_logprobs, load_hf, random_sequences, save_random_model, \
    save_random_model_from_config, save_random_peft_adapter, set_random_correction_bias, write_dense_adapter, \
    write_expert_adapter
from tests.conftest import CPU
from tests.test_adapters import PEFT_EXPERTS, assert_changes, assert_close_to_merged, assert_rows_close, \
    check_peft_adapter, run_one_adapter, varied_sequences
from tests.test_families import assert_bf16_like_cpu, base_hf, k2, run  # noqa: F401 (base_hf: a fixture)
from tests.test_models import copy_with_config, engine_logprobs, mixed_length_sequences

VOCAB = 96
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHARED = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]

# case -> save_random_model overrides on tests/builders.py's tiny_glm4_moe_config (GLM-4.5-like: q/k norm, q/k/v
# biases, partial rotary 0.5, 8 experts in 2 groups of which 1 is eligible, 1 shared expert, layer 0 dense)
CASES = {
    "glm4_5": {},
    "glm4_5_fused_checkpoint": {"fused_experts": True},
    # GLM-4.5-Air-like: no q/k norm; partial_rotary_factor left to its default (0.5); two dense layers, two shared
    # experts, no renormalisation, one group
    "air": dict(use_qk_norm=False, partial_rotary_factor=None, first_k_dense_replace=2, n_shared_experts=2,
                norm_topk_prob=False, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    # RoPE over the whole head with q/k norm (the fused norm + RoPE path), no biases, 4 groups, top-3 of 2 groups
    "full_rotary": dict(partial_rotary_factor=1.0, attention_bias=False, n_group=4, topk_group=2,
                        num_experts_per_tok=3),
}

# Published configs (../shared/data/model-configs/GLM-4.5.json, GLM-4.5-Air.json), verbatim but for token ids.
GLM_COMMON = dict(architectures=["Glm4MoeForCausalLM"], attention_bias=True, attention_dropout=0.0, head_dim=128,
                  hidden_act="silu", partial_rotary_factor=0.5, initializer_range=0.02, max_position_embeddings=131072,
                  model_type="glm4_moe", norm_topk_prob=True, num_attention_heads=96, n_group=1, topk_group=1,
                  n_shared_experts=1, num_experts_per_tok=8, num_key_value_heads=8, rms_norm_eps=1e-05,
                  rope_scaling=None, rope_theta=1000000, num_nextn_predict_layers=1, tie_word_embeddings=False,
                  torch_dtype="bfloat16", use_cache=True, vocab_size=151552)
PUBLISHED = {
    "GLM-4.5": dict(GLM_COMMON, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                    n_routed_experts=160, routed_scaling_factor=2.5, first_k_dense_replace=3, num_hidden_layers=92,
                    use_qk_norm=True),
    "GLM-4.5-Air": dict(GLM_COMMON, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                        n_routed_experts=128, routed_scaling_factor=1.0, first_k_dense_replace=1, num_hidden_layers=46,
                        use_qk_norm=False, transformers_version="4.54.0"),
}
# every size shrunk, every structural field kept (heads 96 / 8 -> 12 / 1 keeps the group size)
SHRINK = dict(hidden_size=48, intermediate_size=40, moe_intermediate_size=8, n_routed_experts=16,
              num_attention_heads=12, num_key_value_heads=1, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64)


def shrunk(name: str) -> dict:
    config = dict(PUBLISHED[name], **SHRINK)
    config["num_hidden_layers"] = config["first_k_dense_replace"] + 2
    return config


# --- checkpoints, built once per module -----------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, session_seed):
    """``checkpoint(case)`` -> the folder of that CASES checkpoint (random correction biases), written on first use."""
    built = {}

    def get(case: str):
        if case not in built:
            overrides = {k: v for k, v in CASES[case].items() if v is not None}
            path = save_random_model(tmp_path_factory.mktemp(case), "glm4_moe", seed=session_seed, **overrides)
            if CASES[case].get("partial_rotary_factor", 0.5) is None:  # leave it to the config's default
                config = json.loads((path / "config.json").read_text())
                config["rope_parameters"].pop("partial_rotary_factor")
                (path / "config.json").write_text(json.dumps(config))
            built[case] = set_random_correction_bias(path, seed=session_seed + 1)
        return built[case]

    return get


# --- 1. base logprobs and what the config says -----------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_base_logprobs_match_transformers(checkpoint, base_hf, case, seed):
    seqs = mixed_length_sequences(seed)
    ours = engine_logprobs(Engine.load(checkpoint(case), None, CPU), seqs)
    assert_rows_close(ours, hf_logprobs(base_hf(case), seqs), what="transformers")


def test_partial_rotary_and_correction_bias_are_in_force(checkpoint, base_hf, tmp_path, seed):
    """Each changes transformers' numbers (so the cases above test ours), and we follow: the rotary dims as
    transformers' inv_freq, the bias as stored; without the bias we still match transformers."""
    seqs = mixed_length_sequences(seed)
    reference = hf_logprobs(base_hf("glm4_5"), seqs)
    path = checkpoint("glm4_5")
    config = json.loads((path / "config.json").read_text())
    full = copy_with_config(path, tmp_path / "full", rope_parameters={**config["rope_parameters"],
                                                                      "partial_rotary_factor": 1.0})
    unbiased = set_random_correction_bias(copy_with_config(path, tmp_path / "unbiased"), seed=0, scale=0.0)
    for variant in (full, unbiased):
        hf = load_hf(variant)
        theirs = hf_logprobs(hf, seqs)
        assert max((a - b).abs().max().item() for a, b in zip(theirs, reference)) > 1e-3
        assert_rows_close(engine_logprobs(Engine.load(variant, None, CPU), seqs), theirs, what="transformers")
    ours, hf = load_model(path), base_hf("glm4_5")
    assert rotary_dim(8, ours.args.rope) == 4
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    bias = ours.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0.05
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)


@pytest.mark.parametrize("case", ["glm4_5", "air", "full_rotary"])
def test_layers_routing_and_parameters_follow_transformers(checkpoint, base_hf, case):
    hf, ours = base_hf(case), load_model(checkpoint(case))
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert ours.args.sparse_layers == hf_sparse and hf_sparse and hf_sparse[0] > 0
    gate = hf.model.layers[hf_sparse[0]].mlp.gate
    assert (ours.args.n_group, ours.args.topk_group, ours.args.norm_topk_prob, ours.args.routed_scaling_factor) == \
        (gate.num_group, gate.topk_group, gate.norm_topk_prob, gate.routed_scaling_factor)
    hf_tensors = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    hf_tensors.update({n: tuple(b.shape) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == hf_tensors


def test_mtp_layer_keys_are_skipped_and_other_keys_refused(checkpoint, tmp_path):
    """Releases store the multi-token-prediction module as layer num_hidden_layers (GLM-4.5: model.layers.92.*):
    no weight of the causal LM, skipped as transformers skips it; a key past it is still refused."""
    path = checkpoint("glm4_5")
    tensors = load_file(str(path / "model.safetensors"))
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(32, 64),
             "model.layers.3.self_attn.q_proj.weight": torch.zeros(32, 32)}
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    save_file({**tensors, **extra}, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    base = load_model(path)
    for (name, p), (_, q) in zip(base.named_parameters(), load_model(mtp).named_parameters()):
        assert torch.equal(p, q), name
    other = tmp_path / "other"
    shutil.copytree(path, other)
    save_file({**tensors, "model.layers.4.eh_proj.weight": torch.zeros(2)}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(InputError, match="model.layers.4.eh_proj.weight"):
        load_model(other)
    no_mtp = copy_with_config(mtp, tmp_path / "no_mtp", num_nextn_predict_layers=0)
    with pytest.raises(InputError, match="model.layers.3."):
        load_model(no_mtp)


# --- 2. published configs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_has_transformers_shapes(name, tmp_path):
    """Our model for the real config has transformers' parameter names and shapes (both on the meta device; the
    correction biases are buffers there), and what the config leaves implicit takes transformers' values."""
    config = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = FAMILIES["glm4_moe"].ModelArgs.from_config(config)
    with torch.device("meta"):
        ours = FAMILIES["glm4_moe"].CausalLM(args)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    hf_tensors = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    hf_tensors.update({n: tuple(b.shape) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == hf_tensors
    assert tuple(ours.inv_freq.shape) == tuple(hf.model.rotary_emb.inv_freq.shape) == (32,)  # 64 of 128 dims
    dense = config["first_k_dense_replace"]
    assert args.sparse_layers == tuple(range(dense, config["num_hidden_layers"]))
    assert args.qk_norm == config["use_qk_norm"] and args.attention_bias
    assert args.skipped_key_prefixes == (f"model.layers.{config['num_hidden_layers']}.",)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shrunk_published_config_matches_transformers(name, tmp_path, seed):
    model_dir = set_random_correction_bias(save_random_model_from_config(tmp_path, shrunk(name), seed=seed), seed=seed)
    seqs = mixed_length_sequences(seed)
    ours = engine_logprobs(Engine.load(model_dir, None, CPU), seqs)
    assert_rows_close(ours, hf_logprobs(load_hf(model_dir), seqs), what="transformers")


# --- 3. adapters ------------------------------------------------------------------------------------

# id -> (LoraConfig kwargs, expected expert layouts)
PEFT_CASES = {
    # PEFT converts all-linear on glm4_moe: attention + target_parameters router (gate.weight) and routed experts
    "all-linear": (dict(r=4, lora_alpha=8, target_modules="all-linear"), PEFT_EXPERTS),
    "experts-router": (dict(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERTS + ["mlp.gate.weight"]),
                       PEFT_EXPERTS),
    "attention-rslora": (dict(r=2, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"]), set()),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_matches_peft(case, checkpoint, base_hf, tmp_path, seed):
    lora_kwargs, layouts = PEFT_CASES[case]
    model_dir = checkpoint("glm4_5")
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / case, seed=seed, **lora_kwargs)
    sequences = varied_sequences(seed + 1)
    check_peft_adapter(model_dir, adapter_dir, sequences, hf_logprobs(base_hf("glm4_5"), sequences), layouts)


@pytest.mark.parametrize("layout", ["per_expert_2d", "split_3d"])
def test_expert_adapter_matches_merged_oracle(layout, checkpoint, base_hf, tmp_path, seed):
    model_dir = checkpoint("glm4_5")
    shared_outer = layout == "split_3d"
    oracle = write_expert_adapter(model_dir, tmp_path / layout, layout=layout, seed=seed, include_router=True,
                                  shared_outer=shared_outer)
    engine = Engine.load(model_dir, {"experts": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "experts", sequences)
    assert_close_to_merged(engine, "experts", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(base_hf("glm4_5"), sequences))
    adapter = engine.adapters[0]
    assert adapter.layouts == {"shared-outer 3D" if shared_outer else "per-expert 2D"}
    assert {t["site"] for t in adapter.targets if t["kind"] == "gate"} == {"model.layers.1.mlp.gate",
                                                                           "model.layers.2.mlp.gate"}


def test_shared_expert_and_dense_mlp_lora_matches_merged_oracle(checkpoint, base_hf, tmp_path, seed):
    """Per-module LoRA on the shared experts (dense sites, not experts) and on the dense MLP of layer 0, as trainers
    export it (PEFT 0.21 cannot target them on this family)."""
    model_dir = checkpoint("glm4_5")
    oracle = write_dense_adapter(model_dir, tmp_path / "dense", seed=seed,
                                 modules=SHARED + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    engine = Engine.load(model_dir, {"dense": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "dense", sequences)
    assert_close_to_merged(engine, "dense", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(base_hf("glm4_5"), sequences))
    adapter = engine.adapters[0]
    assert not adapter.experts
    assert set(adapter.dense) == {f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2)
                                  for p in ("gate_proj", "up_proj", "down_proj")} | \
        {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert {t["kind"] for t in adapter.targets} == {"shared_experts.gate_proj", "shared_experts.up_proj",
                                                    "shared_experts.down_proj", "gate_proj", "up_proj", "down_proj"}


# --- 4. the Triton backend --------------------------------------------------------------------------


def family_adapters(model_dir, root, seed) -> dict:
    """A PEFT all-linear adapter (router LoRA included), a hand-written per-expert one with router LoRA, and
    per-module LoRA on the shared experts."""
    return {
        "peft": save_random_peft_adapter(model_dir, root / "peft", seed=seed, r=4, lora_alpha=8,
                                         target_modules="all-linear"),
        "experts": write_expert_adapter(model_dir, root / "experts", layout="per_expert_2d", seed=seed + 1, rank=2,
                                        include_router=True).adapter_dir,
        "shared": write_dense_adapter(model_dir, root / "shared", modules=SHARED, seed=seed + 2).adapter_dir,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu tests run these kernels compiled")
@pytest.mark.parametrize("case", ["glm4_5", "full_rotary"])
def test_triton_backend_matches_torch_in_the_interpreter(case, checkpoint, tmp_path, seed):
    """Partial rotary (Triton rope on the rotary dims), the fused norm + RoPE (full rotary), q/k/v biases, the
    float32 router with LoRA, fused MoE-LoRA and shared-expert LoRA, float32 in the interpreter, against torch."""
    model_dir = checkpoint(case)
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(5, VOCAB, seed=seed, max_len=10)
    tags = ["peft", "experts", None, "shared", "peft"]
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    out = run(model_dir, adapters, "triton", "cpu", torch.float32, seqs, tags)
    assert max((a - b).abs().max().item() for a, b in zip(ref, out)) < 1e-4


def test_rows_without_adapter_equal_base_in_mixed_batches(checkpoint, tmp_path, seed):
    model_dir = checkpoint("glm4_5")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(6, VOCAB, seed=seed, max_len=12)
    tags = ["peft", None, "experts", None, "shared", None]
    mixed = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    base = run(model_dir, {}, "torch", "cpu", torch.float32, seqs, [None] * len(seqs))
    for tag, a, b in zip(tags, mixed, base):
        assert torch.equal(a, b) if tag is None else not torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu_float32(checkpoint, tmp_path, seed):
    """float32 on CUDA against the CPU float32 engine, then bf16 on CUDA on a model stored in bf16 with less peaked
    routing and next-token distributions (as tests/test_families.py)."""
    seqs = random_sequences(16, VOCAB, seed=seed, max_len=40)
    tags = ["peft", "experts", None, "shared"] * 4
    model_dir = checkpoint("glm4_5")
    adapters = family_adapters(model_dir, tmp_path / "peaked", seed)
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    fp32 = k2(ref, run(model_dir, adapters, None, "cuda", torch.float32, seqs, tags))

    mild = save_random_model(tmp_path / "mild", "glm4_moe", seed=seed, dtype=torch.bfloat16, router_gain=2.0,
                             lm_head_gain=0.5, num_experts_per_tok=3)
    mild = set_random_correction_bias(mild, seed=seed)
    adapters = family_adapters(mild, tmp_path / "mild_adapters", seed)
    ref = run(mild, adapters, "torch", "cpu", torch.float32, seqs, tags)
    gpu = run(mild, adapters, None, "cuda", torch.bfloat16, seqs, tags)
    cpu = run(mild, adapters, "torch", "cpu", torch.bfloat16, seqs, tags)
    print(f"glm4_moe k2 vs CPU float32: cuda float32 {fp32:.3g}")
    assert fp32 < 1e-8
    assert_bf16_like_cpu("glm4_moe", ref, gpu, cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_without_adapter_equal_base(checkpoint, tmp_path, seed):
    model_dir = checkpoint("glm4_5")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(8, VOCAB, seed=seed, max_len=40)
    tags = ["peft", None, "experts", None, "shared", None, "peft", None]
    mixed = run(model_dir, adapters, None, "cuda", torch.bfloat16, seqs, tags)
    base = run(model_dir, {}, None, "cuda", torch.bfloat16, seqs, [None] * len(seqs))
    for tag, a, b in zip(tags, mixed, base):
        if tag is None:
            assert torch.equal(a, b)


# --- 5. inspect names the family; refusals ----------------------------------------------------------


def test_inspect_names_the_family(checkpoint, tmp_path, seed):
    from click.testing import CliRunner

    from lora_eval.cli import cli

    model_dir = checkpoint("glm4_5")
    shared = write_dense_adapter(model_dir, tmp_path / "s", modules=SHARED, seed=seed).adapter_dir
    result = CliRunner().invoke(cli, ["inspect", "--model", str(model_dir), "--adapter", f"s={shared}"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.splitlines()[0] == "model: glm4_moe, 3 layers, hidden 32, 8 experts top-2 in 2 layers, " \
                                            "vocab 96"
    assert "shared_experts.up_proj" in result.stdout


@pytest.mark.parametrize("edits, error, key", [
    ({"hidden_act": "gelu"}, UnsupportedError, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5}}, UnsupportedError, "rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.375}},
     InputError, "partial_rotary_factor"),
    ({"n_group": 3}, InputError, "n_group"),
    ({"topk_group": 3}, InputError, "topk_group"),
])
def test_unsupported_or_bad_config_is_refused_by_name(edits, error, key, checkpoint, tmp_path):
    model_dir = copy_with_config(checkpoint("glm4_5"), tmp_path / "ckpt", **edits)
    with pytest.raises(error) as info:
        load_model(model_dir)
    assert str(info.value).startswith(f"{model_dir / 'config.json'}: {key}: "), str(info.value)
