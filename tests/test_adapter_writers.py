"""Expert adapters as each writer lays them out (lora_eval/adapters/writers.py), against the writer's own math.

Each fixture draws random factors, packs them as the writer does and merges the writer's own per-expert delta into
a tiny transformers model's expert parameters (float32); our engine's logprobs under the adapter must equal that
model's within 1e-5 on the CPU, and move away from the base model (a loader that drops or scrambles the factors
cannot pass). The writers (research: /work/research45/adapter_writers.md):

* PEFT `target_parameters` (ParamWrapper): A [r*E, in], B [out, r*E] with (in, out) read from the parameter
  [E, d1, d2] as (d1, d2) and swapped where did_swap; delta einsum("ore,eri->eoi" if did_swap else "ore,eri->eio")
  (huggingface/peft layer.py ParamWrapper.get_delta_weight, the same at v0.17.0 48f6493f, v0.18.1 e3398fc0,
  v0.19.0 6d5a6f4f, v0.19.1 ba6a1906, 0.21.2). did_swap: never before 0.19.0, `is_transposed` in 0.19.0 (v0.19.0
  layer.py:2202), `not is_transposed` from 0.19.1 (#3165; 0.21.2 layer.py:2437). Qwen3-MoE stores its experts
  [E, out, in], GPT-OSS [E, in, out] (is_transposed). Square (2I == H) and non-square models. Where PEFT 0.21.2
  loads the file (the 0.19.1 layout), PEFT itself is the oracle too.
* Unsloth before unsloth-zoo#1269: B columns expert-slowest, einsum("oer,eri->eio", B.reshape(out, E, r), A)
  (unsloth-zoo tests/test_moe_lora_layout.py, "grouped"), recorded by the #1232 marker `lora_B_layout`.
* Megatron-Bridge@067f987d peft_bridge.py: `_pack_target_parameter_adapter_weights` (:1522-1533) of per-expert
  A [E, r, in], B [E, out, r], config `build_adapter_config_dict` (:1622-1659); per-expert HF names with
  `share_expert_adapters` (groups of identical experts, `_select_expert_adapter_weight`; gate and up share A,
  `_get_fused_adapter_linear_out_slices`); a fully shared [1, ...] A and B on the packed names (PR #6075's
  proposed `collapse_shared_experts`).
* Refused by name: Unsloth's "mixed" marker, trainable_token_indices, a resized vocabulary, a version that
  contradicts the shapes.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from lora_eval import Engine, InputError, UnsupportedError
from lora_eval.adapters import load_adapter
from lora_eval.adapters.writers import BRIDGE_CONFIG_KEYS, Writer
from lora_eval.cli import cli
from lora_eval.models import load_model
from tests.builders import ADAPTER_STRENGTH, hf_logprobs, peft_oracle, save_random_model
from tests.conftest import CPU
from tests.test_adapters import assert_changes, assert_rows_close, run_one_adapter, varied_sequences

RANK, ALPHA = 3, 6
SCALING = ALPHA / RANK
PARAMS = ("gate_up_proj", "down_proj")
PEFT_KEYS = dict(  # what PEFT writes beside the settings (LoraConfig's fields, the ones that matter unset)
    task_type="CAUSAL_LM", base_model_name_or_path="tiny", bias="none", fan_in_fan_out=False, lora_dropout=0.0,
    layers_to_transform=None, layers_pattern=None, rank_pattern={}, alpha_pattern={}, modules_to_save=None,
    use_rslora=False, use_dora=False, init_lora_weights=True, inference_mode=True, exclude_modules=None)


# --- models ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(moe_model, tmp_path_factory, session_seed) -> dict[str, Path]:
    """Qwen3-MoE ([E, out, in] experts) and GPT-OSS ([E, in, out]), each with 2I != H and with 2I == H (gate_up
    square: only the version can tell its orientation)."""
    made = {"qwen3_moe": moe_model}
    for offset, (name, family, size) in enumerate((("qwen3_moe-square", "qwen3_moe", "moe_intermediate_size"),
                                                   ("gpt_oss", "gpt_oss", None),
                                                   ("gpt_oss-square", "gpt_oss", "intermediate_size")), start=7):
        overrides = {size: 16} if size else {}
        made[name] = save_random_model(tmp_path_factory.mktemp(name), family, seed=session_seed + offset,
                                       **overrides)
    return made


def load_oracle(model_dir):
    """transformers' model in float32 with eager attention and experts (the formulas themselves)."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


def expert_modules(model):
    return [(i, layer.mlp.experts) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def is_transposed(experts) -> bool:
    return bool(getattr(experts, "is_transposed", False))


def randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float32)


# --- writers --------------------------------------------------------------------------------------


def did_swap(version: str | None, transposed: bool) -> bool:
    """PEFT's flag by version (the module notes); None = PEFT 0.17, which writes no peft_version."""
    if version in (None, "0.17.1", "0.18.1"):
        return False
    return transposed if version == "0.19.0" else not transposed


def peft_factors(param, swap: bool, g, b_order="rank_major"):
    """A PEFT ParamWrapper's (A, B) for the 3D `param` [E, d1, d2] and the delta that writer applies to it: PEFT's
    get_delta_weight; with b_order "grouped_by_expert", Unsloth's pre-#1269 reading of B."""
    E, d1, d2 = param.shape
    in_f, out_f = (d2, d1) if swap else (d1, d2)
    A = randn(g, RANK * E, in_f) / math.sqrt(in_f)
    B = randn(g, out_f, RANK * E) * ADAPTER_STRENGTH / (SCALING * math.sqrt(RANK))
    equation = "ore,eri->eoi" if swap else "ore,eri->eio"
    if b_order == "rank_major":
        delta = torch.einsum(equation, B.reshape(out_f, RANK, E), A.reshape(E, RANK, in_f))
    else:
        delta = torch.einsum(equation.replace("ore", "oer"), B.reshape(out_f, E, RANK), A.reshape(E, RANK, in_f))
    return A, B, SCALING * delta


def write(out_dir: Path, tensors: dict, config: dict) -> Path:
    out_dir.mkdir(parents=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def peft_keys(i: int) -> dict[str, str]:
    """ParamWrapper nesting on transformers 5 experts: gate_up_proj inner (base_layer), down_proj outer."""
    x = f"base_model.model.model.layers.{i}.mlp.experts"
    return {"gate_up_proj": f"{x}.base_layer", "down_proj": x}


def peft_config(version, params=PARAMS, **extra) -> dict:
    config = dict(peft_type="LORA", r=RANK, lora_alpha=ALPHA, target_modules=None,
                  target_parameters=[f"mlp.experts.{p}" for p in params], **PEFT_KEYS, **extra)
    if version is not None:
        config["peft_version"] = version
    return config


@torch.no_grad()
def write_peft(model_dir, out_dir, *, version, seed, file_version="same", b_order="rank_major", extra=None,
               params=PARAMS):
    """The adapter PEFT `version` writes (Unsloth's B order with b_order "grouped_by_expert"), with `file_version`
    in its config ("same": `version`); returns (dir, merged oracle)."""
    oracle, g = load_oracle(model_dir), torch.Generator().manual_seed(seed)
    tensors = {}
    for i, experts in expert_modules(oracle):
        for param in params:
            weight = getattr(experts, param)
            A, B, delta = peft_factors(weight, did_swap(version, is_transposed(experts)), g, b_order)
            weight += delta
            tensors[f"{peft_keys(i)[param]}.lora_A.weight"], tensors[f"{peft_keys(i)[param]}.lora_B.weight"] = A, B
    config = peft_config(version if file_version == "same" else file_version, params, **(extra or {}))
    return write(Path(out_dir), tensors, config), oracle


def bridge_pack(lora_a, lora_b):
    """Megatron-Bridge@067f987d peft_bridge.py:1528-1531, `_pack_target_parameter_adapter_weights`."""
    packed_lora_a = torch.cat([chunk.transpose(0, 1).contiguous() for chunk in lora_b], dim=0)
    packed_lora_b = torch.cat([chunk.transpose(0, 1).contiguous() for chunk in lora_a], dim=1)
    return packed_lora_a, packed_lora_b


def bridge_config(target_modules, target_parameters=None) -> dict:
    """build_adapter_config_dict (peft_bridge.py:1638-1658) for a LoRA of dim RANK, alpha ALPHA."""
    config = dict(peft_type="LORA", auto_mapping=None, base_model_name_or_path="tiny", bias="none",
                  fan_in_fan_out=False, inference_mode=True, init_lora_weights=True, lora_alpha=ALPHA,
                  lora_dropout=0.0, modules_to_save=None, r=RANK, rank_pattern={}, alpha_pattern={},
                  target_modules=target_modules, task_type="CAUSAL_LM", use_dora=False, use_rslora=False)
    assert set(config) == BRIDGE_CONFIG_KEYS
    if target_parameters:
        config["target_parameters"] = target_parameters
    return config


def megatron_factors(experts, param, g, n_a=None, n_b=None):
    """Megatron's per-expert linear_in A [n_a, r, in] and linear_out B [n_b, out, r] for the HF `param` (in and out
    the projection's own), and the per-expert delta [E, out, in]."""
    weight = getattr(experts, param)
    E = weight.shape[0]
    out_f, in_f = (weight.shape[2], weight.shape[1]) if is_transposed(experts) else weight.shape[1:]
    A = randn(g, n_a or E, RANK, in_f) / math.sqrt(in_f)
    B = randn(g, n_b or E, out_f, RANK) * ADAPTER_STRENGTH / (SCALING * math.sqrt(RANK))
    return A, B, SCALING * (B @ A)


def merge_true_delta(experts, param, delta):
    """Add a per-expert delta [E|1, out, in] to the transformers parameter, as it stores it."""
    weight = getattr(experts, param)
    weight += delta.transpose(1, 2) if is_transposed(experts) else delta


@torch.no_grad()
def write_bridge_packed(model_dir, out_dir, *, seed):
    oracle, g = load_oracle(model_dir), torch.Generator().manual_seed(seed)
    tensors = {}
    for i, experts in expert_modules(oracle):
        for param in PARAMS:
            A, B, delta = megatron_factors(experts, param, g)
            merge_true_delta(experts, param, delta)
            packed_a, packed_b = bridge_pack(A, B)
            # Bridge's depth per parent from the sorted target names: down_proj -> experts, gate_up_proj -> base_layer
            tensors[f"{peft_keys(i)[param]}.lora_A.weight"], tensors[f"{peft_keys(i)[param]}.lora_B.weight"] = \
                packed_a, packed_b
    targets = [f"model.layers.{i}.mlp.experts.{p}" for i, _ in expert_modules(oracle) for p in sorted(PARAMS)]
    return write(Path(out_dir), tensors, bridge_config([], targets)), oracle


# --- checks ---------------------------------------------------------------------------------------


def check_exact(model_dir, adapter_dir, oracle, seed, peft_too=False) -> Engine:
    engine = Engine.load(model_dir, {"w": adapter_dir}, CPU)
    seqs = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "w", seqs)
    assert_rows_close(ours, hf_logprobs(oracle, seqs), what="writer's merged delta")
    assert_changes(ours, hf_logprobs(load_oracle(model_dir), seqs))
    if peft_too:
        assert_rows_close(ours, hf_logprobs(peft_oracle(model_dir, adapter_dir), seqs), what="PEFT 0.21.2")
    return engine


# (model, PEFT version that wrote the file): every combination reads exactly
PEFT_CASES = [(m, v) for m in ("qwen3_moe", "gpt_oss") for v in (None, "0.18.1", "0.19.0", "0.19.1", "0.21.2")] + \
    [(m, v) for m in ("qwen3_moe-square", "gpt_oss-square") for v in ("0.18.1", "0.19.0", "0.19.1")]


@pytest.mark.parametrize("model,version", PEFT_CASES, ids=[f"{m}-{v or '0.17'}" for m, v in PEFT_CASES])
def test_peft_target_parameters_by_writer_version(model, version, models, tmp_path, seed):
    adapter_dir, oracle = write_peft(models[model], tmp_path / "a", version=version, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = check_exact(models[model], adapter_dir, oracle, seed, peft_too=version == "0.19.1")
    assert not [w for w in caught if "AMBIGUOUS" in str(w.message)]  # a version or the shapes decide
    decisions = engine.adapters[0].decisions
    swapped = did_swap(version, model.startswith("gpt_oss")) == model.startswith("gpt_oss")
    assert [d.split(":")[0] for d in decisions] == list(PARAMS)
    assert all(("swapped" if swapped else "standard") in d for d in decisions), decisions
    assert all("expert-fastest (PEFT's packing" in d for d in decisions), decisions


def test_version_decides_the_square_parameter(models, tmp_path, seed):
    """gate_up is square here: a 0.18 file read as 0.19.1 (its version edited) differs, so the version matters (the
    file has no down_proj LoRA, whose shapes would refuse the edit)."""
    model_dir = models["qwen3_moe-square"]
    adapter_dir, oracle = write_peft(model_dir, tmp_path / "a", version="0.18.1", seed=seed, file_version="0.19.1",
                                     params=("gate_up_proj",))
    engine = Engine.load(model_dir, {"w": adapter_dir}, CPU)
    seqs = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "w", seqs)
    assert_changes(ours, hf_logprobs(oracle, seqs))  # every gate_up delta transposed: far from the writer's model


def test_square_without_version_reads_standard_and_warns(models, tmp_path, seed):
    model_dir = models["qwen3_moe-square"]
    adapter_dir, oracle = write_peft(model_dir, tmp_path / "a", version="0.19.1", seed=seed, file_version=None)
    with pytest.warns(UserWarning, match="AMBIGUOUS: a square expert parameter and no peft_version"):
        engine = check_exact(model_dir, adapter_dir, oracle, seed)
    gate_up, down = engine.adapters[0].decisions
    assert gate_up.startswith("gate_up_proj: AMBIGUOUS") and "read as PEFT >=0.19.1's standard" in gate_up
    assert down.startswith("down_proj: standard, decided by the shapes")


def test_a_version_that_contradicts_the_shapes_is_refused(models, tmp_path, seed):
    model_dir = models["qwen3_moe"]
    adapter_dir, _ = write_peft(model_dir, tmp_path / "a", version="0.19.0", seed=seed, file_version="0.19.1")
    with pytest.raises(InputError, match=r"peft_version: the shapes are PEFT's swapped layout \(A on the output "
                                         r"side\), but peft_version 0.19.1 \(PEFT >=0.19.1 swaps where not "
                                         r"is_transposed\) writes standard on this model"):
        load_adapter(adapter_dir, "w", load_model(model_dir, device="meta"))


def test_peft_versions_read():
    path = Path("adapter_config.json")
    for version, behaviours in (("0.17.0", ("0.18",)), ("0.18.1", ("0.18",)), ("0.18.2.dev0@5356277d0",
                                ("0.18", "0.19.0")), ("0.19.0", ("0.19.0",)), ("0.19.1.dev0@UNKNOWN",
                                ("0.19.0", "0.19.1")), ("0.19.1", ("0.19.1",)), ("0.21.2", ("0.19.1",))):
        assert Writer.read(path, {"peft_version": version}).behaviours == behaviours, version
    with pytest.raises(InputError, match="peft_version: expected a PEFT version"):
        Writer.read(path, {"peft_version": "latest"})


# --- Unsloth --------------------------------------------------------------------------------------


def unsloth_marker(layout: str, E: int) -> dict:
    """unsloth-zoo #1232's marker (tests/test_moe_lora_layout.py, test_layout_marker_is_written_to_adapter_config)."""
    return dict(lora_B_layout=layout, unsloth_fused_expert_lora=dict(lora_A_layout="grouped_by_expert", parameters={
        p: dict(lora_B_layout=layout, num_experts=E) for p in PARAMS}))


@pytest.mark.parametrize("model,version", [("qwen3_moe", "0.21.2"), ("gpt_oss", "0.19.0")])
def test_unsloth_grouped_by_expert_with_its_marker(model, version, models, tmp_path, seed):
    E = expert_modules(load_oracle(models[model]))[0][1].gate_up_proj.shape[0]
    adapter_dir, oracle = write_peft(models[model], tmp_path / "a", version=version, seed=seed,
                                     b_order="grouped_by_expert", extra=unsloth_marker("grouped_by_expert", E))
    engine = check_exact(models[model], adapter_dir, oracle, seed)
    assert all("expert-slowest (Unsloth's lora_B_layout marker)" in d for d in engine.adapters[0].decisions)


def test_unsloth_without_marker_reads_as_peft_and_mixed_is_refused(models, tmp_path, seed):
    model_dir = models["qwen3_moe"]
    adapter_dir, oracle = write_peft(model_dir, tmp_path / "a", version="0.21.2", seed=seed,
                                     b_order="grouped_by_expert")
    engine = Engine.load(model_dir, {"w": adapter_dir}, CPU)
    seqs = varied_sequences(seed + 1)
    assert_changes(run_one_adapter(engine, "w", seqs), hf_logprobs(oracle, seqs))  # read as PEFT: not the same
    assert "without the #1232 marker" not in " ".join(engine.adapters[0].decisions)
    assert all("an Unsloth adapter trained before unsloth-zoo#1269 reads as PEFT" in d
               for d in engine.adapters[0].decisions)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    marker = unsloth_marker("grouped_by_expert", 4)
    marker["unsloth_fused_expert_lora"]["parameters"]["down_proj"]["lora_B_layout"] = "mixed"
    del marker["lora_B_layout"]  # Unsloth writes no flat key when a parameter is mixed
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, **marker}))
    with pytest.raises(UnsupportedError, match="unsloth_fused_expert_lora: lora_B_layout \"mixed\" for down_proj"):
        load_adapter(adapter_dir, "w", load_model(model_dir, device="meta"))


# --- Megatron-Bridge ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_moe-square", "gpt_oss"])
def test_megatron_bridge_packed_target_parameters(model, models, tmp_path, seed):
    adapter_dir, oracle = write_bridge_packed(models[model], tmp_path / "a", seed=seed)
    engine = check_exact(models[model], adapter_dir, oracle, seed)
    assert all("Megatron-Bridge's config fingerprint" in d and "expert-slowest (Megatron-Bridge's packing)" in d
               for d in engine.adapters[0].decisions)


@torch.no_grad()
def test_megatron_bridge_per_expert_names_share_expert_adapters(models, tmp_path, seed):
    """EP = 2: experts e and e' of one EP rank get the same A and B (gate and up: one A, B split in halves)."""
    model_dir = models["qwen3_moe"]
    oracle, g = load_oracle(model_dir), torch.Generator().manual_seed(seed)
    tensors = {}
    for i, experts in expert_modules(oracle):
        E, ep = experts.gate_up_proj.shape[0], 2
        for param, names in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            A, B, _ = megatron_factors(experts, param, g, n_a=ep, n_b=ep)  # one adapter per EP rank
            rank_of = torch.arange(E) // (E // ep)  # _select_expert_adapter_weight
            merge_true_delta(experts, param, SCALING * (B[rank_of] @ A[rank_of]))
            for e in range(E):
                for half, name in zip(B[rank_of[e]].chunk(len(names)), names):
                    x = f"base_model.model.model.layers.{i}.mlp.experts.{e}.{name}"
                    tensors[f"{x}.lora_A.weight"], tensors[f"{x}.lora_B.weight"] = A[rank_of[e]].clone(), half.clone()
    adapter_dir = write(tmp_path / "a", tensors, bridge_config(["gate_proj", "up_proj", "down_proj"]))
    engine = check_exact(model_dir, adapter_dir, oracle, seed)
    assert engine.adapters[0].layouts == {"per-expert 2D"}


@torch.no_grad()
def test_fully_shared_expert_adapter_on_packed_names(models, tmp_path, seed):
    """A [1, r, in] and B [1, out, r] on experts.gate_up_proj / down_proj: one LoRA for every expert (the form
    Megatron-Bridge PR #6075 proposed, `collapse_shared_experts`; not merged upstream)."""
    model_dir = models["qwen3_moe"]
    oracle, g = load_oracle(model_dir), torch.Generator().manual_seed(seed)
    tensors = {}
    for i, experts in expert_modules(oracle):
        for param in PARAMS:
            A, B, delta = megatron_factors(experts, param, g, n_a=1, n_b=1)
            merge_true_delta(experts, param, delta)
            x = f"base_model.model.model.layers.{i}.mlp.experts.{param}"
            tensors[f"{x}.lora_A.weight"], tensors[f"{x}.lora_B.weight"] = A, B
    adapter_dir = write(tmp_path / "a", tensors, bridge_config(list(PARAMS)))
    engine = check_exact(model_dir, adapter_dir, oracle, seed)
    assert engine.adapters[0].layouts == {"shared-outer 3D"}


def test_bridge_fingerprint_with_standard_shapes_is_refused(models, tmp_path, seed):
    model_dir = models["qwen3_moe"]
    adapter_dir, _ = write_peft(model_dir, tmp_path / "a", version="0.21.2", seed=seed)
    targets = json.loads((adapter_dir / "adapter_config.json").read_text())["target_parameters"]
    (adapter_dir / "adapter_config.json").write_text(json.dumps(bridge_config([], targets)))
    with pytest.raises(InputError, match=r"PEFT's standard layout .* but Megatron-Bridge's export \(its config's "
                                         r"key set\) writes swapped"):
        load_adapter(adapter_dir, "w", load_model(model_dir, device="meta"))


# --- added tokens ---------------------------------------------------------------------------------


def test_added_tokens_are_refused_by_name(models, tmp_path, seed):
    model_dir = models["qwen3_moe"]
    meta = load_model(model_dir, device="meta")
    V, H = meta.args.vocab_size, meta.args.hidden_size
    g = torch.Generator().manual_seed(seed)
    x = "base_model.model.model.embed_tokens"
    trainable = write(tmp_path / "t", {f"{x}.token_adapter.trainable_tokens_delta": randn(g, 2, H)},
                      dict(peft_type="LORA", r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"],
                           trainable_token_indices=[3, 7]))
    with pytest.raises(UnsupportedError, match=r"trainable_token_indices: trainable tokens \(rows of embed_tokens "
                                               r"/ lm_head replaced\) is not supported"):
        load_adapter(trainable, "w", meta)
    resized = write(tmp_path / "r", {f"{x}.weight": randn(g, V + 4, H), "base_model.model.lm_head.weight":
                                     randn(g, V + 4, H)},
                    dict(peft_type="LORA", r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"],
                         modules_to_save=["embed_tokens", "lm_head"]))
    with pytest.raises(UnsupportedError, match=f"{V + 4} rows for the model's {V}: the adapter adds 4 tokens, and "
                                               "lora-eval does not resize the model's vocabulary"):
        load_adapter(resized, "w", meta)


# --- inspect --------------------------------------------------------------------------------------


def test_inspect_says_how_the_writer_was_read(models, tmp_path, seed):
    model_dir = models["qwen3_moe"]
    adapter_dir, _ = write_bridge_packed(model_dir, tmp_path / "bridge", seed=seed)
    result = CliRunner().invoke(cli, ["inspect", "--model", str(model_dir), "--adapter", f"b={adapter_dir}"])
    assert result.exit_code == 0, result.output
    assert "writer: no peft_version (PEFT <0.18 or another writer); Megatron-Bridge's config fingerprint" in \
        result.output
    assert "  read: gate_up_proj: Megatron-Bridge's config fingerprint (no peft_version, its exact key set): " \
        "swapped; B columns expert-slowest (Megatron-Bridge's packing)" in result.output


@torch.no_grad()
def test_bridge_split_shared_outer_export_is_refused_by_name(models, tmp_path, seed):
    """experts_shared_outer_loras: the shared linear_in once as [1, r, H] under experts.gate_proj, each expert's
    linear_out under experts.{e}.gate_proj (peft_bridge.py `_stream_shared_outer_adapter_weights`, 067f987d)."""
    model_dir = models["qwen3_moe"]
    meta = load_model(model_dir, device="meta")
    H, I, E = meta.args.hidden_size, meta.args.moe_intermediate_size, meta.args.num_experts
    g = torch.Generator().manual_seed(seed)
    x = "base_model.model.model.layers.0.mlp.experts"
    tensors = {f"{x}.gate_proj.lora_A.weight": randn(g, 1, RANK, H)}
    tensors.update({f"{x}.{e}.gate_proj.lora_B.weight": randn(g, I, RANK) for e in range(E)})
    adapter_dir = write(tmp_path / "a", tensors, bridge_config(["gate_proj"]))
    with pytest.raises(UnsupportedError, match=r"gate_proj.lora_A.weight: a shared factor \[1, ...\] whose partner "
                                               "is stored per expert .Megatron-Bridge's experts_shared_outer_loras"):
        load_adapter(adapter_dir, "w", meta)
