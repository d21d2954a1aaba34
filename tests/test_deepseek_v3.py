"""DeepSeek-V3 / Kimi-K2 (lora_eval/models/deepseek_v3.py) against transformers + PEFT, float32 on the CPU.

1. base logprobs of tiny checkpoints written by transformers (per-expert keys, and fused as transformers 5 writes
   them with save_original_format=False) within 1e-5: MLA with q_lora_rank set and null, dense first layers, one and
   two shared experts, n_group 4 / topk_group 2 and n_group 1, random e_score_correction_bias, routed_scaling_factor
   2.5 and 1, norm_topk_prob true and false, YaRN with mscale != mscale_all_dim and the default rope, rope_interleave
   true and false, attention biases; each feature switched on a copy of one checkpoint must both change
   transformers' numbers and keep ours equal to them (so it is computed, not ignored); MTP layers and block FP8;
2. adapters made by PEFT (all-linear: MLA projections, the router through target_parameters and the experts;
   target_parameters on the experts; LoRA on q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj) against PEFT,
   hand-written expert layouts (per-expert 2D with router, fused / split 3D shared-outer) and per-module LoRA on
   shared experts and dense MLPs against merged-weights oracles; mixed batches: rows without adapter equal the base
   model bit for bit;
3. the published DeepSeek-V3 and Kimi-K2-Instruct configs, shrunk (few layers, small dims, every structural field
   kept), give transformers' parameter names and shapes, rope and softmax scale, and its logprobs;
4. the Triton backend against the torch backend in the interpreter; bf16 on CUDA (gpu marker);
5. `inspect` names the family; what it does not support is refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from lora_eval import Engine, InputError, UnsupportedError
from lora_eval.adapters import load_adapter
from lora_eval.models import FAMILIES, deepseek_v3, load_model
from tests.builders import DEEPSEEK_YARN, hf_logprobs, load_hf, random_sequences, save_quantized_copy, \
    save_random_model, save_random_peft_adapter, set_random_correction_bias, write_dense_adapter, \
    write_expert_adapter
from tests.conftest import CPU, eager_on_the_bucket
from tests.test_adapters import PEFT_EXPERTS, assert_changes, assert_close_to_merged, assert_rows_close, \
    check_peft_adapter, run_one_adapter, varied_sequences
from tests.test_families import base_hf, k2, run  # noqa: F401 (base_hf: a fixture)
from tests.test_models import copy_with_config, engine_logprobs, mixed_length_sequences

VOCAB = 96  # tests/builders.py's tiny vocabulary
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MIN_FEATURE_EFFECT = 1e-3  # a config feature must move transformers' logprobs at least this much
# LoRA on the dense parts PEFT 0.21 cannot target here: shared experts, and the dense MLP of layer 0
DENSE_MLP = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]

# case -> save_random_model overrides; all cases share the session seed (same weights where shapes agree)
CASES = {
    # q_lora_rank 16, yarn with mscale, interleaved rope, 4 groups / 2 chosen, scale 2.5, renormalised, layer 0 dense
    "mla": {},
    "q_proj": dict(q_lora_rank=None, norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0), rope_interleave=False,
                   attention_bias=True, rms_norm_eps=0.05),  # the latent norms keep eps 1e-6 (transformers)
    "fused_one_group": dict(fused_experts=True, n_group=1, topk_group=1, first_k_dense_replace=0,
                            num_experts_per_tok=3, rms_norm_eps=0.05),
}

# config.json edits on a copy of the "mla" checkpoint, each switching one feature (same weights)
FEATURES = {
    "no_group_limit": {"topk_group": 4},
    "routed_scaling_factor_1": {"routed_scaling_factor": 1.0},
    "no_renormalisation": {"norm_topk_prob": False},
    "rope_not_interleaved": {"rope_interleave": False},
    "yarn_without_mscale": {"rope_parameters": {k: v for k, v in DEEPSEEK_YARN.items() if "mscale" not in k}},
    "default_rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


# --- checkpoints, built once per module -----------------------------------------------------------


def save_deepseek(out_dir, *, seed: int, **overrides):
    """A tiny random deepseek_v3 checkpoint with random router correction biases."""
    return set_random_correction_bias(save_random_model(out_dir, "deepseek_v3", seed=seed, **overrides), seed=seed + 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, session_seed):
    """``checkpoint(case)`` -> the folder of that CASES checkpoint, written on first use."""
    built = {}

    def get(case: str):
        if case not in built:
            built[case] = save_deepseek(tmp_path_factory.mktemp(case), seed=session_seed, **CASES[case])
        return built[case]

    return get


def max_diff(xs, ys) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


# --- 1. base logprobs and what the config says -----------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_base_logprobs_match_transformers(checkpoint, base_hf, case, seed):
    seqs = mixed_length_sequences(seed)
    ours = engine_logprobs(Engine.load(checkpoint(case), None, CPU), seqs)
    assert_rows_close(ours, hf_logprobs(base_hf(case), seqs), what="transformers")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_is_computed(feature, checkpoint, base_hf, tmp_path, seed):
    """Switching the feature changes transformers' logprobs, and ours follow on both sides of the switch."""
    model_dir = copy_with_config(checkpoint("mla"), tmp_path / feature, **FEATURES[feature])
    seqs = mixed_length_sequences(seed)
    switched = hf_logprobs(load_hf(model_dir), seqs)
    assert max_diff(switched, hf_logprobs(base_hf("mla"), seqs)) > MIN_FEATURE_EFFECT
    assert_rows_close(engine_logprobs(Engine.load(model_dir, None, CPU), seqs), switched, what="transformers")


def test_correction_bias_is_computed(checkpoint, base_hf, tmp_path, seed):
    """The random e_score_correction_bias changes which experts win (against zero biases, same weights)."""
    zero = set_random_correction_bias(copy_with_config(checkpoint("mla"), tmp_path / "zero"), seed=0, scale=0.0)
    seqs = mixed_length_sequences(seed)
    zero_hf = hf_logprobs(load_hf(zero), seqs)
    assert max_diff(zero_hf, hf_logprobs(base_hf("mla"), seqs)) > MIN_FEATURE_EFFECT
    assert_rows_close(engine_logprobs(Engine.load(zero, None, CPU), seqs), zero_hf, what="transformers")
    bias = load_model(checkpoint("mla")).model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_layers_and_router_follow_transformers(checkpoint, base_hf, case):
    hf, ours = base_hf(case), load_model(checkpoint(case))
    hf_sparse = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert ours.args.sparse_layers == hf_sparse and hf_sparse
    router = hf.model.layers[hf_sparse[0]].mlp.gate
    assert (ours.args.n_group, ours.args.topk_group, ours.args.norm_topk_prob, ours.args.routed_scaling_factor) == \
        (router.num_group, router.topk_group, router.norm_topk_prob, router.routed_scaling_factor)
    assert ours.args.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert ours.args.rope_scale == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    hf_state = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == hf_state


def test_router_stays_float32_in_bf16(checkpoint):
    model = load_model(checkpoint("mla"), dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    fp32 = load_model(checkpoint("mla")).model.layers[1].mlp.gate.weight
    assert torch.equal(moe.gate.weight, fp32)


def test_fused_and_per_expert_checkpoints_load_alike(checkpoint, tmp_path, session_seed):
    per_expert = save_deepseek(tmp_path / "per_expert", seed=session_seed, **{
        k: v for k, v in CASES["fused_one_group"].items() if k != "fused_experts"})
    keys = set(load_file(str(per_expert / "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in set(load_file(str(checkpoint("fused_one_group") /
                                                                         "model.safetensors")))
    a, b = load_model(per_expert), load_model(checkpoint("fused_one_group"))
    for (name, p), (name_b, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert name == name_b and torch.equal(p, q), name


def test_mtp_layers_are_passed_over(checkpoint, tmp_path):
    """Published checkpoints hold the multi-token-prediction module as layer num_hidden_layers
    (num_nextn_predict_layers of them): not a weight of the causal LM; with num_nextn_predict_layers 0 it is
    refused as a stray key."""
    model_dir = copy_with_config(checkpoint("mla"), tmp_path / "mtp", num_nextn_predict_layers=1)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(32, 64), "model.layers.3.enorm.weight":
                    torch.ones(32), "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(8, 32)})
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model(model_dir)
    assert len(loaded.model.layers) == 3
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(InputError, match="not a weight"):
        load_model(model_dir)


def test_fp8_checkpoint_matches_transformers(checkpoint, tmp_path, seed):
    """Block FP8 as DeepSeek releases it (router and lm_head kept plain, experts per expert in fp8), dequantised
    on load, against transformers on the values the fp8 checkpoint encodes."""
    quant_dir, plain_dir, quantized = save_quantized_copy(checkpoint("mla"), tmp_path / "fp8", tmp_path / "plain",
                                                          "fp8", ["model.layers.*.mlp.gate", "lm_head"])
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in quantized
    assert "model.layers.1.self_attn.kv_b_proj.weight" in quantized
    assert "model.layers.1.mlp.gate.weight" not in quantized and "lm_head.weight" not in quantized
    engine = Engine.load(quant_dir, None, CPU)
    assert engine.model.args.quantization == "block fp8 [128, 128] dequantised to float32 (w8a16)"
    seqs = mixed_length_sequences(seed)
    assert_rows_close(engine_logprobs(engine, seqs), hf_logprobs(load_hf(plain_dir), seqs), what="transformers")


# --- 2. adapters ------------------------------------------------------------------------------------

# id -> (case, LoraConfig kwargs, expected expert layouts)
PEFT_CASES = {
    # PEFT converts all-linear on deepseek_v3: the MLA projections + target_parameters on the router and experts
    "mla-all-linear": ("mla", dict(r=4, lora_alpha=8, target_modules="all-linear"), PEFT_EXPERTS),
    "q_proj-all-linear": ("q_proj", dict(r=3, lora_alpha=7, target_modules="all-linear"), PEFT_EXPERTS),
    "mla-latent-projections": ("mla", dict(r=2, lora_alpha=5, target_modules=[
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]), set()),
    "mla-experts": ("mla", dict(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERTS), PEFT_EXPERTS),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_matches_peft(case, checkpoint, base_hf, tmp_path, seed):
    model_case, lora_kwargs, layouts = PEFT_CASES[case]
    model_dir = checkpoint(model_case)
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / case, seed=seed, **lora_kwargs)
    sequences = varied_sequences(seed + 1)
    check_peft_adapter(model_dir, adapter_dir, sequences, hf_logprobs(base_hf(model_case), sequences), layouts)


def test_peft_all_linear_targets(checkpoint, tmp_path, seed):
    """What PEFT's all-linear puts LoRA on here: every MLA projection of every layer, the routers (float32
    weights, through target_parameters) and the routed experts; not the shared experts nor layer 0's dense MLP."""
    adapter_dir = save_random_peft_adapter(checkpoint("mla"), tmp_path / "a", seed=seed, r=2, lora_alpha=4,
                                           target_modules="all-linear")
    adapter = load_adapter(adapter_dir, "a", load_model(checkpoint("mla"), device="meta"))
    attention = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert set(adapter.dense) == {f"model.layers.{i}.self_attn.{m}" for i in range(3) for m in attention} | \
        {f"model.layers.{i}.mlp.gate" for i in (1, 2)}
    assert set(adapter.experts) == {f"model.layers.{i}.mlp.experts" for i in (1, 2)}


# id -> write_expert_adapter kwargs, and the layout it must be read as
EXPERT_CASES = {
    "per-expert-2d-router": (dict(layout="per_expert_2d", include_router=True), "per-expert 2D"),
    "fused-3d": (dict(layout="fused_3d", rank=3, alpha=5), "fused 3D"),
    "fused-3d-shared-outer": (dict(layout="fused_3d", shared_outer=True), "shared-outer 3D"),
    "split-3d-shared-outer": (dict(layout="split_3d", shared_outer=True, rank=2, alpha=7), "shared-outer 3D"),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_layout_matches_merged_oracle(case, checkpoint, base_hf, tmp_path, seed):
    kwargs, layout = EXPERT_CASES[case]
    model_dir = checkpoint("mla")
    oracle = write_expert_adapter(model_dir, tmp_path / case, seed=seed, **kwargs)
    engine = Engine.load(model_dir, {"experts": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "experts", sequences)
    assert_close_to_merged(engine, "experts", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(base_hf("mla"), sequences))
    adapter = engine.adapters[0]
    assert adapter.layouts == {layout}
    assert {t["layer"] for t in adapter.targets if t["kind"] == "experts"} == {1, 2}
    assert {t["site"] for t in adapter.targets if t["kind"] == "gate"} == \
        ({"model.layers.1.mlp.gate", "model.layers.2.mlp.gate"} if kwargs.get("include_router") else set())


@pytest.mark.parametrize("case", ["mla", "q_proj"])
def test_shared_expert_and_dense_mlp_lora_match_merged_oracle(case, checkpoint, base_hf, tmp_path, seed):
    """Per-module LoRA on the shared experts and the dense MLP of layer 0 (as trainers other than PEFT export it):
    dense LoRA sites, against the merged-weights oracle."""
    model_dir = checkpoint(case)
    oracle = write_dense_adapter(model_dir, tmp_path / "dense", modules=DENSE_MLP, seed=seed, rank=3, alpha=5)
    engine = Engine.load(model_dir, {"dense": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "dense", sequences)
    assert_close_to_merged(engine, "dense", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(base_hf(case), sequences))
    adapter = engine.adapters[0]
    assert not adapter.experts
    assert set(adapter.dense) == {f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2)
                                  for p in ("gate_proj", "up_proj", "down_proj")} | \
        {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert {t["kind"] for t in adapter.targets} == {"gate_proj", "up_proj", "down_proj", "shared_experts.gate_proj",
                                                    "shared_experts.up_proj", "shared_experts.down_proj"}


def family_adapters(model_dir, root, seed) -> dict:
    """PEFT all-linear (MLA, router, experts), a hand-written per-expert one with router LoRA, and per-module LoRA
    on the shared experts and the dense MLP."""
    return {
        "peft": save_random_peft_adapter(model_dir, root / "peft", seed=seed, r=4, lora_alpha=8,
                                         target_modules="all-linear"),
        "experts": write_expert_adapter(model_dir, root / "experts", layout="per_expert_2d", seed=seed + 1, rank=2,
                                        include_router=True).adapter_dir,
        "dense": write_dense_adapter(model_dir, root / "dense", modules=DENSE_MLP, seed=seed + 2,
                                     rank=3).adapter_dir,
    }


def test_mixed_batch_rows_match_alone_and_base(checkpoint, base_hf, tmp_path, seed):
    """One batch of all three adapters and base rows: adapter rows as when run alone, base rows the base model's
    bit for bit (torch backend)."""
    model_dir = checkpoint("mla")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(8, VOCAB, seed=seed, max_len=20)
    tags = ["peft", None, "experts", "dense", None, "dense", "peft", "experts"]
    mixed = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    base = run(model_dir, {}, "torch", "cpu", torch.float32, seqs, [None] * len(seqs))
    for name in adapters:
        rows = [i for i, t in enumerate(tags) if t == name]
        alone = run(model_dir, {name: adapters[name]}, "torch", "cpu", torch.float32, [seqs[i] for i in rows],
                    [name] * len(rows))
        assert_rows_close([mixed[i] for i in rows], alone, what=f"{name} alone")
        assert_changes([mixed[i] for i in rows], [base[i] for i in rows])
    for tag, a, b in zip(tags, mixed, base):
        if tag is None:
            assert torch.equal(a, b)


# --- 3. published configs -------------------------------------------------------------------------

# Published configs (../shared/data/model-configs/), verbatim but for token ids and auto_map / dtype / version
PUBLISHED = {
    "DeepSeek-V3": dict(
        architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0, ep_size=1,
        first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, initializer_range=0.02, intermediate_size=18432,
        kv_lora_rank=512, max_position_embeddings=163840, model_type="deepseek_v3", moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
        num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                 weight_block_size=[128, 128]),
        rms_norm_eps=1e-06, rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                              original_max_position_embeddings=4096, type="yarn"),
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False,
        topk_group=4, topk_method="noaux_tc", use_cache=True, v_head_dim=128, vocab_size=129280),
    "Kimi-K2-Instruct": dict(
        architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001,
        first_k_dense_replace=1, hidden_act="silu", hidden_size=7168, initializer_range=0.02, intermediate_size=18432,
        kv_lora_rank=512, max_position_embeddings=131072, model_type="kimi_k2", moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=1, n_routed_experts=384, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=64, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=64,
        num_nextn_predict_layers=0, pretraining_tp=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                 weight_block_size=[128, 128]),
        rms_norm_eps=1e-06, rope_theta=50000.0, routed_scaling_factor=2.827,
        rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=32.0, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False, topk_group=1, topk_method="noaux_tc",
        use_cache=True, v_head_dim=128, vocab_size=163840),
}
NOT_FOR_TRANSFORMERS = ("model_type", "quantization_config", "architectures")  # kimi_k2 is not a transformers type


def shrunk(config: dict) -> dict:
    """The config with few layers (its dense ones + 2 MoE) and small dims; every structural field kept: groups and
    top-k as published (2 experts per group), rope scaling, scaling factor, q_lora_rank set or null."""
    small = dict(config, num_hidden_layers=config["first_k_dense_replace"] + 2, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=16, n_routed_experts=2 * config["n_group"] * max(1, 8 // config["n_group"]),
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, vocab_size=VOCAB)
    if config["q_lora_rank"] is not None:
        small["q_lora_rank"] = 24
    return small


def hf_config(config: dict) -> DeepseekV3Config:
    return DeepseekV3Config(**{k: v for k, v in config.items() if k not in NOT_FOR_TRANSFORMERS})


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_has_transformers_shapes(name):
    """Our model for the (shrunk) real config: transformers' parameter and buffer names and shapes (both on the meta
    device), its rope and softmax scale, and the real config's sizes read right."""
    config = shrunk(PUBLISHED[name])
    family = FAMILIES[config["model_type"]]
    assert family is deepseek_v3
    args = family.ModelArgs.from_config(config)
    with torch.device("meta"):
        ours = family.CausalLM(args)
        hf = DeepseekV3ForCausalLM(hf_config(config))
    assert {n: tuple(t.shape) for n, t in ours.state_dict().items()} == \
        {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    hf_rope = DeepseekV3RotaryEmbedding(hf_config(config))
    assert torch.equal(deepseek_v3.rope_inv_freq(args.head_dim, args.rope), hf_rope.inv_freq)
    assert args.rope_scale == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert args.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    real = family.ModelArgs.from_config(PUBLISHED[name])
    assert (real.num_experts, real.top_k, real.n_group, real.topk_group, real.sparse_layers[0], real.head_dim,
            real.v_head_dim) == (PUBLISHED[name]["n_routed_experts"], 8, PUBLISHED[name]["n_group"],
                                 PUBLISHED[name]["topk_group"], PUBLISHED[name]["first_k_dense_replace"], 192, 128)
    assert real.skipped_key_prefixes == tuple(f"model.layers.{61 + i}."
                                              for i in range(PUBLISHED[name]["num_nextn_predict_layers"]))


def test_published_configs_leave_out_nothing_we_need():
    """Fields a config may leave out take DeepseekV3Config's defaults (transformers' model of the same config)."""
    config = {k: v for k, v in shrunk(PUBLISHED["DeepSeek-V3"]).items()
              if k not in ("rope_interleave", "norm_topk_prob", "n_shared_experts", "attention_bias", "rms_norm_eps",
                           "num_nextn_predict_layers", "hidden_act", "topk_method", "scoring_func")}
    args = deepseek_v3.ModelArgs.from_config(config)
    hf = hf_config(config)
    assert (args.rope_interleave, args.norm_topk_prob, args.n_shared_experts, args.attention_bias, args.rms_norm_eps,
            args.num_mtp_layers) == (hf.rope_interleave, hf.norm_topk_prob, hf.n_shared_experts, hf.attention_bias,
                                     hf.rms_norm_eps, hf.num_nextn_predict_layers)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_logprobs_match_transformers(name, tmp_path, seed):
    """A random checkpoint of the shrunk real config (Kimi-K2's yarn has beta_fast == beta_slow; DeepSeek-V3's
    routes 8 of 16 experts from 4 of 8 groups), read under its own model_type."""
    config = {k: v for k, v in shrunk(PUBLISHED[name]).items() if k not in NOT_FOR_TRANSFORMERS}
    model_dir = save_deepseek(tmp_path / "hf", seed=seed, **config)
    ours_dir = copy_with_config(model_dir, tmp_path / "ours", model_type=PUBLISHED[name]["model_type"])
    seqs = mixed_length_sequences(seed)
    assert_rows_close(engine_logprobs(Engine.load(ours_dir, None, CPU), seqs), hf_logprobs(load_hf(model_dir), seqs),
                      what="transformers")


# --- 4. the Triton backend --------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu tests run these kernels compiled")
def test_triton_backend_matches_torch_in_the_interpreter(checkpoint, tmp_path, seed):
    """The family's forward through every Triton kernel it uses (fused MoE-LoRA over the routed experts, dense LoRA
    on the MLA projections, the shared experts and the router, rope, fused logprobs) with the router in torch,
    float32 in the interpreter, against the torch backend; rows without adapter equal the base model's."""
    model_dir = checkpoint("mla")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(5, VOCAB, seed=seed, max_len=10)
    tags = ["peft", "experts", None, "dense", "peft"]
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    out = run(model_dir, adapters, "triton", "cpu", torch.float32, seqs, tags)
    assert max_diff(ref, out) < 1e-4
    base = run(model_dir, {}, "triton", "cpu", torch.float32, seqs, [None] * len(seqs))
    # Bit for bit on any CPU: the adapter rows change the other tokens' routing, so row 2's tokens sit elsewhere in
    # the experts' blocks; the suite's interpreter dot sums in a fixed order whatever the rows around (numpy's BLAS
    # did not on AVX2 machines: issue 41), and the dense GEMMs see the same batch shape in both runs.
    assert torch.equal(out[2], base[2])


def abs_diffs(ref, out) -> torch.Tensor:
    return torch.cat([a - b for a, b in zip(ref, out)]).abs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["mla", "q_proj"])
def test_cuda_engine_matches_cpu_float32(case, checkpoint, tmp_path, seed):
    """float32 on CUDA against the CPU float32 engine (the kernels, no precision excuse), then bf16 on CUDA against
    the same model's bf16 run of the CPU engine, both measured from the CPU float32 run, on a model stored in bf16
    with less peaked routing and next-token distributions (top-3; router gain 2, lm_head gain 0.5).

    Sigmoid group routing flips a few tokens' experts under bf16 (group choice, correction bias, scale 2.5), and
    one flip can move a logprob by ~1: k2 (a mean of squares) then varies 10x between two bf16 runs of equal quality
    (H100, 20 seeds: CUDA / CPU k2 ratio 0.56-10; 90th percentile of |d| 0.84-1.13, mean |d| 0.83-1.39). So the
    bulk is compared (90th percentile and mean of |d|), and k2 only against a loose bound; a wrong kernel or a lost
    LoRA moves a whole adapter's rows (a quarter of the tokens) by 0.1-1."""
    seqs = random_sequences(48, VOCAB, seed=seed, max_len=40)
    tags = ["peft", "experts", None, "dense"] * 12
    model_dir = checkpoint(case)
    adapters = family_adapters(model_dir, tmp_path / "peaked", seed)
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    fp32 = k2(ref, run(model_dir, adapters, None, "cuda", torch.float32, seqs, tags))

    mild = save_deepseek(tmp_path / "mild", seed=seed, dtype=torch.bfloat16, router_gain=2.0, lm_head_gain=0.5,
                         **{**CASES[case], "num_experts_per_tok": 3})
    adapters = family_adapters(mild, tmp_path / "mild_adapters", seed)
    ref = run(mild, adapters, "torch", "cpu", torch.float32, seqs, tags)
    cuda = abs_diffs(ref, run(mild, adapters, None, "cuda", torch.bfloat16, seqs, tags))
    cpu = abs_diffs(ref, run(mild, adapters, "torch", "cpu", torch.bfloat16, seqs, tags))
    q90 = cuda.quantile(0.9).item(), cpu.quantile(0.9).item()
    mean = cuda.mean().item(), cpu.mean().item()
    bf16 = (cuda * cuda / 2).mean().item()
    print(f"deepseek_v3 {case} vs CPU float32: cuda float32 k2 {fp32:.3g}; mild model bf16, cuda / cpu: |d| q90 "
          f"{q90[0]:.3g} / {q90[1]:.3g}, mean {mean[0]:.3g} / {mean[1]:.3g}; cuda k2 {bf16:.3g}")
    assert fp32 < 1e-8
    assert q90[0] < 1.5 * q90[1] and mean[0] < 2 * mean[1]
    assert bf16 < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["mla", "q_proj"])
def test_cuda_rows_without_adapter_equal_base(case, checkpoint, tmp_path, seed):
    model_dir = checkpoint(case)
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(8, VOCAB, seed=seed, max_len=40)
    tags = ["peft", None, "experts", None, "dense", None, "peft", None]
    mixed = run(model_dir, adapters, None, "cuda", torch.bfloat16, seqs, tags)
    base = run(model_dir, {}, None, "cuda", torch.bfloat16, seqs, [None] * len(seqs))
    for tag, a, b in zip(tags, mixed, base):
        if tag is None:
            assert torch.equal(a, b)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager(checkpoint, tmp_path, seed):
    """The captured forward (sigmoid group router in torch included) replays bit for bit what the eager Triton
    forward computes on the same padded batch, with LoRA rows and without (tests/test_graphs_gpu.py's check)."""
    model_dir = checkpoint("mla")
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
    adapters = family_adapters(model_dir, tmp_path, seed)
    e = Engine(model, [load_adapter(p, n, model) for n, p in adapters.items()])
    seqs = random_sequences(4, VOCAB, seed=seed, min_len=20, max_len=40)
    for tags in (["peft", None, "experts", "dense"], [None] * 4):
        slots = [e._slot(t, i) for i, t in enumerate(tags)]
        hidden, length = e._forward(seqs, slots)[:2]
        rows = hidden.shape[0] // length
        eager = eager_on_the_bucket(e, seqs, slots, rows, length)
        assert torch.equal(hidden, eager), f"tags {tags}: max |d| {(hidden.float() - eager.float()).abs().max()}"
    stats = e.graph_stats()
    assert stats["graphs"] == 2 and stats["replays"] == 2 and stats["eager_batches"] == 0

# --- 5. inspect names the family; refusals ----------------------------------------------------------


def test_inspect_names_the_family(checkpoint, tmp_path, seed):
    from click.testing import CliRunner

    from lora_eval.cli import cli

    model_dir = checkpoint("mla")
    peft = save_random_peft_adapter(model_dir, tmp_path / "a", seed=seed, r=2, lora_alpha=4,
                                    target_modules="all-linear")
    dense = write_dense_adapter(model_dir, tmp_path / "b", modules=DENSE_MLP, seed=seed, rank=2).adapter_dir
    result = CliRunner().invoke(cli, ["inspect", "--model", str(model_dir), "--adapter", f"a={peft}",
                                      "--adapter", f"b={dense}"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.splitlines()[0] == "model: deepseek_v3, 3 layers, hidden 32, 8 experts top-2 in 2 layers, " \
                                            "vocab 96"
    for kind in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts",
                 "shared_experts.up_proj"):
        assert kind in result.stdout, kind


# edits on a copy of the "mla" checkpoint -> the config key named in the refusal, and the error's class
REFUSED = {
    "softmax_scoring": ({"scoring_func": "softmax"}, "scoring_func", UnsupportedError),
    "greedy_topk": ({"topk_method": "group_limited_greedy"}, "topk_method", UnsupportedError),
    "moe_layer_freq": ({"moe_layer_freq": 2}, "moe_layer_freq", UnsupportedError),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act", UnsupportedError),
    "kv_heads": ({"num_key_value_heads": 2}, "num_key_value_heads", UnsupportedError),
    "no_shared_experts": ({"n_shared_experts": 0}, "n_shared_experts", UnsupportedError),
    "dynamic_rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                     "rope_parameters", UnsupportedError),
    "partial_yarn": ({"rope_parameters": {**DEEPSEEK_YARN, "partial_rotary_factor": 0.5}}, "rope_parameters",
                     UnsupportedError),
    "uneven_groups": ({"n_group": 3}, "n_group", InputError),
    "too_many_groups": ({"topk_group": 5}, "topk_group", InputError),
    "top_k_beyond_groups": ({"num_experts_per_tok": 5}, "num_experts_per_tok", InputError),
    "odd_rope_dims": ({"qk_rope_head_dim": 7}, "qk_rope_head_dim", InputError),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_by_name(case, checkpoint, tmp_path):
    edits, key, error = REFUSED[case]
    model_dir = copy_with_config(checkpoint("mla"), tmp_path / "ckpt", **edits)
    with pytest.raises(error) as info:
        load_model(model_dir)
    assert str(info.value).startswith(f"{model_dir / 'config.json'}: {key}: "), str(info.value)


def test_config_that_does_not_match_the_weights_is_refused(checkpoint, tmp_path):
    """All layers MoE on a checkpoint whose layer 0 is dense: its MLP weights are not ours (nor the experts there)."""
    model_dir = copy_with_config(checkpoint("mla"), tmp_path / "ckpt", first_k_dense_replace=0)
    with pytest.raises(InputError, match="missing tensor|not a weight"):
        load_model(model_dir)


def test_deepseek_v2_is_refused_by_model_type(checkpoint, tmp_path):
    model_dir = copy_with_config(checkpoint("mla"), tmp_path / "ckpt", model_type="deepseek_v2")
    with pytest.raises(UnsupportedError, match="'deepseek_v2'.*supported model types: .*deepseek_v3"):
        load_model(model_dir)
