"""Qwen3-VL-MoE (qwen3_vl_moe), the text path, against transformers' Qwen3VLMoeForConditionalGeneration + PEFT on
text-only input, float32 on the CPU.

1. base logprobs of tiny checkpoints written by transformers (experts [E, 2I, H] as transformers 5 writes them) and
   of the same weights in the published layout ([E, H, 2I], [E, I, H]) within 1e-5; the multimodal RoPE against
   transformers' rotary embedding (three distinct position streams) and, for text positions, equal to plain RoPE;
   vision-tower keys skipped, other unknown keys refused;
2. the published config gives transformers' parameter names and shapes (the language model's); shrunk (few layers,
   small dims, every structural field kept) it gives transformers' logprobs;
3. adapters made by PEFT on the full model (all-linear, which also puts LoRA on the vision tower: skipped;
   target_parameters on the experts and the router; a regex naming the language model) against PEFT, hand-written
   expert layouts under the trainer's module paths against the merged-weights oracle;
4. the Triton backend against the torch backend in the interpreter; CUDA (gpu marker);
5. `inspect` names the family; what the family does not compute is refused by name (nested keys as text_config.*).
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding

from lora_eval import Engine, InputError, UnsupportedError
from lora_eval.adapters import load_adapter
from lora_eval.models import FAMILIES, load_model
from lora_eval.models.layers import rope_cos_sin
from lora_eval.models.qwen3_vl_moe import mrope_cos_sin
from tests.builders import hf_logprobs, load_hf_model, peft_oracle_any, random_sequences, save_random_model, \
    save_random_model_from_config, save_random_peft_adapter_any, transpose_experts_to_published, \
    write_expert_adapter_vl
from tests.conftest import CPU
from tests.test_adapters import PEFT_EXPERTS, assert_changes, assert_close_to_merged, assert_rows_close, \
    our_ranks_and_scalings, peft_ranks_and_scalings, run_one_adapter, varied_sequences
from tests.test_families import k2, run
from tests.test_models import copy_with_config, engine_logprobs, mixed_length_sequences

VOCAB = 96
TEXT = "model.language_model"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# case -> save_random_model overrides on tests/builders.py's tiny_qwen3_vl_moe_config (6 experts top-2, layer 1 dense)
CASES = {
    "vl": {},
    # norm_topk_prob false: transformers' router renormalises all the same
    "vl_sparse_step_2_tied": dict(decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=True,
                                  attention_bias=True, norm_topk_prob=False),
}

# Published config (../shared/data/model-configs/Qwen3-VL-30B-A3B-Instruct.json), verbatim but for token ids.
PUBLISHED = dict(
    architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", tie_word_embeddings=False,
    text_config=dict(
        attention_bias=False, attention_dropout=0.0, decoder_sparse_step=1, dtype="bfloat16", head_dim=128,
        hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=6144,
        max_position_embeddings=262144, mlp_only_layers=[], model_type="qwen3_vl_moe_text", moe_intermediate_size=768,
        norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
        num_key_value_heads=4, rms_norm_eps=1e-06,
        rope_scaling=dict(mrope_interleaved=True, mrope_section=[24, 20, 20], rope_type="default"),
        rope_theta=5000000, use_cache=True, vocab_size=151936),
    vision_config=dict(
        deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
        in_channels=3, initializer_range=0.02, intermediate_size=4304, model_type="qwen3_vl_moe", num_heads=16,
        num_position_embeddings=2304, out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2),
)


def shrunk() -> dict:
    """Every size shrunk (heads 32 / 4 -> 8 / 1 keeps the group size; mrope sections scaled to head_dim 16), every
    structural field kept; a one-block vision tower."""
    text = dict(PUBLISHED["text_config"], hidden_size=48, intermediate_size=40, moe_intermediate_size=8,
                num_experts=16, num_attention_heads=8, num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
                vocab_size=VOCAB, max_position_embeddings=64,
                rope_scaling=dict(mrope_interleaved=True, mrope_section=[3, 3, 2], rope_type="default"))
    vision = dict(PUBLISHED["vision_config"], deepstack_visual_indexes=[0], depth=1, hidden_size=16,
                  intermediate_size=24, num_heads=2, num_position_embeddings=16, out_hidden_size=48, patch_size=4)
    return dict(PUBLISHED, text_config=text, vision_config=vision)


# --- checkpoints, built once per module -----------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, session_seed):
    """``checkpoint(case)`` -> a CASES checkpoint as transformers writes it; ``checkpoint(case, published=True)`` the
    same weights with the experts in the published layout."""
    built = {}

    def get(case: str, published: bool = False):
        if case not in built:
            built[case] = save_random_model(tmp_path_factory.mktemp(case), "qwen3_vl_moe", seed=session_seed,
                                            **CASES[case])
        if published and (case, "published") not in built:
            built[case, "published"] = transpose_experts_to_published(built[case],
                                                                      tmp_path_factory.mktemp(f"{case}_published"))
        return built[case, "published"] if published else built[case]

    return get


@pytest.fixture(scope="module")
def base_hf(checkpoint):
    return functools.cache(lambda case: load_hf_model(checkpoint(case)))  # each case loaded once


# --- 1. base logprobs, the rope, the checkpoint layouts ------------------------------------------------


@pytest.mark.parametrize("published", [False, True], ids=["transformers_layout", "published_layout"])
@pytest.mark.parametrize("case", list(CASES))
def test_base_logprobs_match_transformers(checkpoint, base_hf, case, published, seed):
    """Within 1e-5, but for the tied case: its lm_head is the N(0, 1) embedding table, so logprobs reach -40, where
    float32 spacing is 3.8e-6 and the two implementations' independent roundings reached 1.14e-5 once (a scan of
    36 seeds: at most 9.5e-6, every one at |logprob| 35-42): there the bound is 4e-5, about 10 ulp."""
    seqs = mixed_length_sequences(seed)
    ours = engine_logprobs(Engine.load(checkpoint(case, published), None, CPU), seqs)
    tol = 4e-5 if CASES[case].get("tie_word_embeddings") else 1e-5
    assert_rows_close(ours, hf_logprobs(base_hf(case), seqs), tol=tol, what="transformers")


def test_published_layout_is_transposed_and_loads_to_the_same_weights(checkpoint):
    """The two checkpoints differ on disk ([E, 2I, H] vs [E, H, 2I]; gate columns first) and load equal, as they do
    in transformers."""
    key = f"{TEXT}.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(checkpoint("vl") / "model.safetensors"), framework="pt") as f:
        ours_layout = f.get_tensor(key)
    with safe_open(str(checkpoint("vl", True) / "model.safetensors"), framework="pt") as f:
        published = f.get_tensor(key)
        assert tuple(f.get_slice(f"{TEXT}.layers.0.mlp.experts.down_proj").get_shape()) == (6, 8, 32)
    assert ours_layout.shape == (6, 16, 32) and published.shape == (6, 32, 16)
    a, b = load_model(checkpoint("vl")), load_model(checkpoint("vl", True))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoint("vl", True), dtype=torch.float32)
    assert torch.equal(hf.model.language_model.layers[0].mlp.experts.gate_up_proj, a.get_parameter(key))


def test_mrope_is_transformers_and_text_positions_give_plain_rope(checkpoint, base_hf, seed):
    """Our mrope against transformers' rotary embedding on three distinct position streams (so the interleaving is
    tested), and bit for bit plain RoPE when the three streams are the text positions."""
    hf_config = base_hf("vl").config.text_config
    rotary = Qwen3VLMoeTextRotaryEmbedding(hf_config)
    ours = load_model(checkpoint("vl"))
    assert torch.equal(ours.inv_freq, rotary.inv_freq)
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 50, (3, 2, 7), generator=generator)  # [3, B, L]
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = mrope_cos_sin(ours.inv_freq, positions, ours.args.mrope_section, torch.float32)
    hf_cos, hf_sin = rotary(x, positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    plain_cos, plain_sin = rope_cos_sin(ours.inv_freq, positions[0], torch.float32)
    assert not torch.equal(cos, plain_cos)  # distinct streams: not plain RoPE
    text = torch.arange(7).expand(3, 2, 7)
    cos, sin = mrope_cos_sin(ours.inv_freq, text, ours.args.mrope_section, torch.float32)
    plain_cos, plain_sin = rope_cos_sin(ours.inv_freq, text[0], torch.float32)
    assert torch.equal(cos, plain_cos) and torch.equal(sin, plain_sin)
    assert torch.equal(cos, rotary(x, text)[0])


def test_parameters_follow_transformers_and_vision_keys_are_skipped(checkpoint, base_hf, tmp_path):
    """Our parameters are the language model's of Qwen3VLMoeForConditionalGeneration, under its names; the checkpoint's
    vision tower is skipped, any other unknown key refused."""
    hf, ours = base_hf("vl"), load_model(checkpoint("vl"))
    hf_text = {n: tuple(p.shape) for n, p in hf.named_parameters() if not n.startswith("model.visual.")}
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == hf_text
    assert ours.args.sparse_layers == tuple(i for i, layer in enumerate(hf.model.language_model.layers)
                                            if hasattr(layer.mlp, "experts")) == (0, 2)
    tensors = load_file(str(checkpoint("vl") / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in tensors)
    other = tmp_path / "other"
    shutil.copytree(checkpoint("vl"), other)
    save_file({**tensors, "model.audio.proj.weight": torch.zeros(2)}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(InputError, match="model.audio.proj.weight"):
        load_model(other)


def test_tied_checkpoint_reads_the_top_level_tie(checkpoint, base_hf):
    """tie_word_embeddings is the top-level field (text_config has its own, true by default, which
    Qwen3VLMoeForConditionalGeneration does not use)."""
    tied = load_model(checkpoint("vl_sparse_step_2_tied"))
    embed = tied.model.language_model.embed_tokens.weight
    assert tied.args.tie_word_embeddings and tied.lm_head.weight.data_ptr() == embed.data_ptr()
    assert json.loads((checkpoint("vl") / "config.json").read_text())["text_config"]["tie_word_embeddings"]
    assert not load_model(checkpoint("vl")).args.tie_word_embeddings


# --- 2. published config --------------------------------------------------------------------------


def test_published_config_has_transformers_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))
    args = FAMILIES["qwen3_vl_moe"].ModelArgs.from_config(PUBLISHED)
    with torch.device("meta"):
        ours = FAMILIES["qwen3_vl_moe"].CausalLM(args)
        hf = Qwen3VLMoeForConditionalGeneration(AutoConfig.from_pretrained(tmp_path))
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == \
        {n: tuple(p.shape) for n, p in hf.named_parameters() if not n.startswith("model.visual.")}
    assert args.mrope_section == (24, 20, 20) and args.norm_topk_prob and len(args.sparse_layers) == 48
    assert not args.tie_word_embeddings and (args.num_experts, args.top_k) == (128, 8)


def test_shrunk_published_config_matches_transformers(tmp_path, seed):
    model_dir = save_random_model_from_config(tmp_path / "published", shrunk(), seed=seed)
    seqs = mixed_length_sequences(seed)
    ours = engine_logprobs(Engine.load(model_dir, None, CPU), seqs)
    assert_rows_close(ours, hf_logprobs(load_hf_model(model_dir), seqs), what="transformers")


# --- 3. adapters ------------------------------------------------------------------------------------

# id -> (LoraConfig kwargs, expected expert layouts, whether PEFT puts LoRA on the vision tower)
PEFT_CASES = {
    # PEFT does not convert qwen3_vl_moe: all-linear is every nn.Linear of the full model, the vision tower's
    # included (skipped by us), no experts and no router
    "all-linear": (dict(r=4, lora_alpha=8, target_modules="all-linear"), set(), True),
    "experts-router": (dict(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERTS + ["mlp.gate.weight"]),
                       PEFT_EXPERTS, False),
    # how trainers keep LoRA off the vision tower: a regex over the language model's module paths
    "language-model-regex": (dict(r=2, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"),
                             set(), False),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_matches_peft(case, checkpoint, base_hf, tmp_path, seed):
    lora_kwargs, layouts, vision = PEFT_CASES[case]
    model_dir = checkpoint("vl")
    adapter_dir = save_random_peft_adapter_any(model_dir, tmp_path / case, seed=seed, **lora_kwargs)
    sequences = varied_sequences(seed + 1)
    engine = Engine.load(model_dir, {"lora": adapter_dir}, CPU)
    ours = run_one_adapter(engine, "lora", sequences)
    oracle = peft_oracle_any(model_dir, adapter_dir)
    assert_rows_close(ours, hf_logprobs(oracle, sequences), what="PEFT")
    assert_changes(ours, hf_logprobs(base_hf("vl"), sequences))
    adapter = engine.adapters[0]
    peft_rs = peft_ranks_and_scalings(oracle)
    assert any(site.startswith("model.visual.") for site, _ in peft_rs) == vision
    assert bool(adapter.skipped) == vision and all(".visual." in k for k in adapter.skipped)
    peft_rs = {key: v for key, v in peft_rs.items() if not key[0].startswith("model.visual.")}
    ours_rs = our_ranks_and_scalings(adapter)
    assert ours_rs.keys() == peft_rs.keys() and all(site.startswith(f"{TEXT}.layers.") for site, _ in ours_rs)
    for target, (rank, scaling) in ours_rs.items():
        assert (rank, scaling) == (peft_rs[target][0], pytest.approx(peft_rs[target][1])), target
    assert adapter.layouts == layouts


@pytest.mark.parametrize("layout", ["per_expert_2d", "peft_target_parameters"])
def test_expert_adapter_matches_merged_oracle(layout, checkpoint, base_hf, tmp_path, seed):
    model_dir = checkpoint("vl", published=True)
    oracle = write_expert_adapter_vl(model_dir, tmp_path / layout, layout=layout, seed=seed, include_router=True)
    engine = Engine.load(model_dir, {"experts": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "experts", sequences)
    assert_close_to_merged(engine, "experts", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(base_hf("vl"), sequences))
    adapter = engine.adapters[0]
    assert {t["site"] for t in adapter.targets if t["kind"] == "gate"} == {f"{TEXT}.layers.{i}.mlp.gate"
                                                                           for i in (0, 2)}


def test_adapter_for_another_model_is_still_refused(checkpoint, tmp_path, seed):
    """Skipping the vision tower does not make other unknown keys pass: an adapter keyed model.layers.* (a text-only
    Qwen3-MoE's paths) is refused by name."""
    model_dir = checkpoint("vl")
    adapter_dir = write_expert_adapter_vl(model_dir, tmp_path / "a", layout="per_expert_2d", seed=seed).adapter_dir
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()},
              str(adapter_dir / "adapter_model.safetensors"))
    with pytest.raises(InputError, match="matches no module of this model"):
        load_adapter(adapter_dir, "a", load_model(model_dir, device="meta"))


# --- 4. the Triton backend --------------------------------------------------------------------------


def family_adapters(model_dir, root, seed) -> dict:
    """A PEFT all-linear adapter (vision LoRA included, skipped), and a hand-written per-expert one with router
    LoRA."""
    return {
        "peft": save_random_peft_adapter_any(model_dir, root / "peft", seed=seed, r=4, lora_alpha=8,
                                             target_modules="all-linear"),
        "experts": write_expert_adapter_vl(model_dir, root / "experts", layout="per_expert_2d", seed=seed + 1, rank=2,
                                           include_router=True).adapter_dir,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu tests run these kernels compiled")
def test_triton_backend_matches_torch_in_the_interpreter(checkpoint, tmp_path, seed):
    model_dir = checkpoint("vl")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(4, VOCAB, seed=seed, max_len=10)
    tags = ["peft", "experts", None, "peft"]
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    out = run(model_dir, adapters, "triton", "cpu", torch.float32, seqs, tags)
    assert max((a - b).abs().max().item() for a, b in zip(ref, out)) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu_float32(checkpoint, tmp_path, seed):
    """float32 on CUDA against the CPU float32 engine, then bf16 on CUDA on a model stored in bf16 (published expert
    layout) with less peaked routing and next-token distributions (as tests/test_families.py)."""
    seqs = random_sequences(16, VOCAB, seed=seed, max_len=40)
    tags = ["peft", "experts", None, "peft"] * 4
    model_dir = checkpoint("vl")
    adapters = family_adapters(model_dir, tmp_path / "peaked", seed)
    ref = run(model_dir, adapters, "torch", "cpu", torch.float32, seqs, tags)
    fp32 = k2(ref, run(model_dir, adapters, None, "cuda", torch.float32, seqs, tags))

    mild = save_random_model(tmp_path / "mild", "qwen3_vl_moe", seed=seed, dtype=torch.bfloat16, router_gain=2.0,
                             lm_head_gain=0.5, num_experts_per_tok=3)
    mild = transpose_experts_to_published(mild, tmp_path / "mild_published")
    adapters = family_adapters(mild, tmp_path / "mild_adapters", seed)
    ref = run(mild, adapters, "torch", "cpu", torch.float32, seqs, tags)
    bf16 = k2(ref, run(mild, adapters, None, "cuda", torch.bfloat16, seqs, tags))
    floor = k2(ref, run(mild, adapters, "torch", "cpu", torch.bfloat16, seqs, tags))
    print(f"qwen3_vl_moe k2 vs CPU float32: cuda float32 {fp32:.3g}; mild model: cuda bf16 {bf16:.3g}, "
          f"cpu bf16 {floor:.3g}")
    assert fp32 < 1e-8
    assert bf16 < max(1e-4, 2 * floor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_without_adapter_equal_base(checkpoint, tmp_path, seed):
    model_dir = checkpoint("vl")
    adapters = family_adapters(model_dir, tmp_path, seed)
    seqs = random_sequences(8, VOCAB, seed=seed, max_len=40)
    tags = ["peft", None, "experts", None] * 2
    mixed = run(model_dir, adapters, None, "cuda", torch.bfloat16, seqs, tags)
    base = run(model_dir, {}, None, "cuda", torch.bfloat16, seqs, [None] * len(seqs))
    for tag, a, b in zip(tags, mixed, base):
        if tag is None:
            assert torch.equal(a, b)


# --- 5. inspect names the family; refusals ----------------------------------------------------------


def test_inspect_names_the_family(checkpoint, tmp_path, seed):
    from click.testing import CliRunner

    from lora_eval.cli import cli

    model_dir = checkpoint("vl", published=True)
    adapter_dir = save_random_peft_adapter_any(model_dir, tmp_path / "a", seed=seed, r=2, lora_alpha=4,
                                               target_modules="all-linear")
    result = CliRunner().invoke(cli, ["inspect", "--model", str(model_dir), "--adapter", f"a={adapter_dir}"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.splitlines()[0] == "model: qwen3_vl_moe, 3 layers, hidden 32, 6 experts top-2 in 2 layers, " \
                                            "vocab 96"


def edited_text_config(src, dst, **edits):
    config = json.loads((src / "config.json").read_text())
    return copy_with_config(src, dst, text_config={**config["text_config"], **edits})


@pytest.mark.parametrize("edits, error, key", [
    ({"hidden_act": "gelu"}, UnsupportedError, "text_config.hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
     UnsupportedError, "text_config.rope_parameters"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1]}},
     InputError, "text_config.rope_parameters.mrope_section"),
    ({"num_experts_per_tok": 7}, InputError, "text_config.num_experts_per_tok"),
])
def test_unsupported_or_bad_config_is_refused_by_name(edits, error, key, checkpoint, tmp_path):
    model_dir = edited_text_config(checkpoint("vl"), tmp_path / "ckpt", **edits)
    with pytest.raises(error) as info:
        load_model(model_dir)
    assert str(info.value).startswith(f"{model_dir / 'config.json'}: {key}: "), str(info.value)


def test_missing_text_config_is_refused_by_name(checkpoint, tmp_path):
    model_dir = copy_with_config(checkpoint("vl"), tmp_path / "ckpt", text_config=None)
    with pytest.raises(InputError) as info:
        load_model(model_dir)
    assert str(info.value).startswith(f"{model_dir / 'config.json'}: text_config: "), str(info.value)
