"""LoRA on every projection of the Gated DeltaNet hybrids: qwen3_next, and qwen3_5_moe both as the vision-language
model (Qwen3_5MoeForConditionalGeneration: keys under `model.language_model.`, PEFT's all-linear also on the vision
tower) and as the text CausalLM that AutoModelForCausalLM builds from the same checkpoint (keys under
`model.layers.`). Float32 on the CPU, rows of 2 to 150 tokens in one batch, within 1e-5 of transformers + PEFT on the
same tiny checkpoint (tests/builders.py save_random_hybrid says why those checkpoints are conditioned as they are):

1. adapters made by get_peft_model for each target kind: all-linear as PEFT resolves it, the linear-attention
   projections, gated attention's double-width q_proj, the router and the experts through target_parameters, the
   shared expert, rank / alpha patterns, layers_to_transform, exclude_modules (a list and a regex: a VL adapter
   leaving out the vision tower), a regex naming the language model, a regex that PEFT widens to every layer on
   qwen3_next, modules_to_save on (zero-centred) norms. Each against PEFT's logprobs; and the targets we resolve
   from the config as it was written (before PEFT rewrote it) against the LoRA layers PEFT built;
2. target_modules "all-linear" written as such: resolved as PEFT resolves it (on qwen3_5_moe neither routed experts
   nor router, so expert LoRA under it is refused, as PEFT would not load it); per-expert 2D expert LoRA as
   trainers export it, against the merged-weights oracle;
3. Tinker's split in_proj_q / in_proj_k / in_proj_v on the fused in_proj_qkv, against the merged-weights oracle; parts
   that do not fit the base's are refused by key;
4. what PEFT cannot target (the depthwise conv1d, A_log, dt_bias) is refused by name; PEFT refuses it too.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from safetensors.torch import load_file, save_file

from lora_eval import Batch, Engine, InputError, UnsupportedError
from lora_eval.adapters import load_adapter
from lora_eval.adapters.load import SPLIT_LAYOUT, read_config
from lora_eval.adapters.targets import Sites, resolve_targets
from lora_eval.engine.forward import Forward
from lora_eval.models import load_model
from tests.builders import hf_logprobs, load_hf, load_hf_model, peft_oracle, peft_oracle_any, save_random_hybrid, \
    save_random_peft_adapter, save_random_peft_adapter_any, write_expert_adapter, write_split_qkv_adapter
from tests.conftest import CPU
from tests.test_adapters import TOL, VOCAB, assert_changes, assert_close_to_merged, \
    our_ranks_and_scalings, peft_ranks_and_scalings, run_one_adapter

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VISION = ["qkv", "attn.proj", "linear_fc1", "linear_fc2"]  # the vision tower's Linear names in PEFT's all-linear
VL = "model.language_model."
# layout -> (family, how the trainer's model is built: the VL model for qwen3_5_moe, or the CausalLM)
LAYOUTS = {"next": ("qwen3_next", "causal"), "vl": ("qwen3_5_moe", "vl"), "text": ("qwen3_5_moe", "causal")}

# id -> (layout, LoraConfig kwargs)
PEFT_CASES = {
    # PEFT converts qwen3_next's all-linear: linear-attention, attention and shared_expert_gate, plus the router and
    # the experts through target_parameters (gate_up_proj at twice the rank); no shared expert or dense MLP
    "next-all-linear": ("next", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "next-linear-attention": ("next", dict(r=3, lora_alpha=5, target_modules=["in_proj_qkvz", "in_proj_ba",
                                                                               "out_proj"])),
    "next-gated-attention": ("next", dict(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "next-router-experts": ("next", dict(r=3, lora_alpha=5, target_modules=[],
                                         target_parameters=EXPERTS + ["mlp.gate.weight"])),
    # on qwen3_next PEFT turns these names into the routed experts' target_parameters: not the shared expert
    "next-shared-expert-names": ("next", dict(r=2, lora_alpha=4, target_modules=[
        "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"])),
    # the shared expert itself: its Linear weights as target_parameters, and its gate
    "next-shared-expert": ("next", dict(r=2, lora_alpha=4, target_modules=["shared_expert_gate"], target_parameters=[
        f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")])),
    "next-patterns-layers": ("next", dict(
        r=2, lora_alpha=4, target_modules=["in_proj_qkvz", "out_proj", "q_proj"], layers_to_transform=[0, 3, 4],
        rank_pattern={"out_proj": 5, "model.layers.3.self_attn.q_proj": 3}, alpha_pattern={"in_proj_qkvz": 7})),
    # PEFT resolves a regex on qwen3_next to the last names it matches: every layer's in_proj_ba
    "next-regex-one-layer": ("next", dict(r=2, lora_alpha=4, target_modules=r".*layers\.0\.linear_attn\.in_proj_ba")),
    "next-norms-to-save": ("next", dict(r=2, lora_alpha=4, target_modules=["in_proj_ba"], modules_to_save=[
        "input_layernorm", "q_norm"])),
    "next-gated-norm-to-save": ("next", dict(r=2, lora_alpha=4, target_modules=["in_proj_ba"],
                                             modules_to_save=["linear_attn.norm"])),
    # no conversion on qwen3_5_moe: every nn.Linear, the vision tower's included (skipped), no experts, no router
    "vl-all-linear": ("vl", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "vl-all-linear-exclude-vision": ("vl", dict(r=2, lora_alpha=4, target_modules="all-linear",
                                                exclude_modules=VISION)),
    "vl-all-linear-exclude-regex": ("vl", dict(r=2, lora_alpha=4, target_modules="all-linear",
                                               exclude_modules=r".*visual.*|.*language_model\.layers\.[12]\..*")),
    "vl-linear-attention": ("vl", dict(r=3, lora_alpha=5, target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                           "in_proj_a", "out_proj"])),
    # as VL trainers keep LoRA off the vision tower: a regex over the language model's paths, which ours lack
    "vl-language-model-regex": ("vl", dict(r=2, lora_alpha=4,
                                           target_modules=r".*language_model.*\.(q_proj|in_proj_qkv)")),
    "vl-router-experts": ("vl", dict(r=3, lora_alpha=5, target_modules=[],
                                     target_parameters=EXPERTS + ["mlp.gate.weight"])),
    "vl-shared-expert": ("vl", dict(r=2, lora_alpha=4, target_modules=[
        "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"])),
    "vl-patterns-layers": ("vl", dict(
        r=2, lora_alpha=4, target_modules=["in_proj_qkv", "in_proj_z", "o_proj"], layers_to_transform=[1, 3],
        rank_pattern={"in_proj_z": 6}, alpha_pattern={f"{VL}layers.3.self_attn.o_proj": 9})),
    "vl-norms-to-save": ("vl", dict(r=2, lora_alpha=4, target_modules=["in_proj_a"], modules_to_save=[
        "post_attention_layernorm", "k_norm", "model.norm"])),
    "vl-gated-norm-to-save": ("vl", dict(r=2, lora_alpha=4, target_modules=["in_proj_a"],
                                         modules_to_save=["linear_attn.norm"])),
    "text-all-linear": ("text", dict(r=4, lora_alpha=8, target_modules="all-linear")),
    "text-attention-experts": ("text", dict(r=2, lora_alpha=3, target_modules=["q_proj", "in_proj_z"],
                                            target_parameters=EXPERTS)),
}


# --- fixtures and helpers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory, session_seed) -> dict:
    return {family: save_random_hybrid(tmp_path_factory.mktemp(family), family, seed=session_seed + i)
            for i, family in enumerate(("qwen3_next", "qwen3_5_moe"))}


@pytest.fixture(scope="module")
def ours(models) -> dict:
    """Our models (their Sites are what the adapters resolve against)."""
    return {family: load_model(path) for family, path in models.items()}


@pytest.fixture(scope="module")
def base_hf(models) -> dict:
    return {family: load_hf(path) for family, path in models.items()}


ROUTER_TIE = 1e-5  # router logits this close at the top-k boundary: float32 rounding decides which expert wins


def assert_rows_close_but_router_ties(engine: Engine, ours, reference, sequences, adapter: str | None = "lora") -> None:
    """assert_rows_close against PEFT (or transformers), where one row may differ by more than TOL only from a position
    on at which one of our routers, under `adapter`, has its k-th and (k+1)-th logits within ROUTER_TIE: two float32 computations
    of one model may pick different experts there (seen: 2.4e-7 apart, layer 4 of Qwen3-Next, 0.14 nats after).
    Anything else fails as before."""
    diffs = [(a - b).abs() for a, b in zip(ours, reference)]
    bad = [i for i, d in enumerate(diffs) if not d.max() <= TOL]
    if not bad:
        return
    assert len(bad) == 1, f"rows {bad} differ from PEFT by more than {TOL}: {[diffs[i].max().item() for i in bad]}"
    row = bad[0]
    first = int((diffs[row] > TOL).nonzero()[0])  # position whose next-token logprob first differs
    ties = set()

    def probe(layer, point, tensor):
        if point == "router_logits":
            top = tensor.float().topk(engine.model.args.top_k + 1, dim=-1).values  # [T, k+1]
            ties.update((top[:, -2] - top[:, -1] < ROUTER_TIE).nonzero().flatten().tolist())

    Forward.probe = staticmethod(probe)
    try:
        engine.logprobs(Batch(input_ids=[sequences[row]], adapters=[adapter]))
    finally:
        Forward.probe = None
    assert any(p <= first for p in ties), (f"row {row} differs from PEFT by {diffs[row].max().item()} from position "
                                           f"{first} on, with no router near-tie at or before it (ties: {sorted(ties)})")


def hybrid_sequences(seed: int) -> list[list[int]]:
    """Five rows: 2 and 150 tokens (three chunks of transformers' delta rule) and three lengths between."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [2, 150] + (torch.randperm(146, generator=generator)[:3] + 3).tolist()
    order = torch.randperm(len(lengths), generator=generator).tolist()
    return [torch.randint(0, VOCAB, (lengths[i],), generator=generator).tolist() for i in order]


def make_peft_adapter(layout: str, model_dir, out_dir, seed: int, **kwargs):
    save = save_random_peft_adapter_any if LAYOUTS[layout][1] == "vl" else save_random_peft_adapter
    return save(model_dir, out_dir, seed=seed, **kwargs)


def load_peft(layout: str, model_dir, adapter_dir):
    return (peft_oracle_any if LAYOUTS[layout][1] == "vl" else peft_oracle)(model_dir, adapter_dir)


def write_config(folder, **fields):
    """An adapter folder holding only adapter_config.json with `fields` (targets are resolved before weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **fields}))
    return folder


def our_targets(folder, model) -> set[str]:
    """What we resolve for the adapter_config.json in `folder`, as load_adapter does: the modules (and `module.param`
    names) PEFT would put LoRA on; names of single experts' projections, which PEFT has no module for on these
    models, left out (per-expert keys load under them: test_per_expert_lora_as_trainers_export_it)."""
    sites = Sites.of(model)
    real = set(sites.linear) | set(sites.embedding) | set(sites.parameter_names()) | set(sites.split_parts())
    return {name for name in resolve_targets(read_config(folder, sites), sites) if name in real}


def peft_targets(peft_model) -> set[str]:
    """The LoRA layers PEFT built, in our names: `module` for a module's LoRA, `module.param` for target_parameters
    (the experts' gate_up_proj / down_proj, a Linear's weight); the vision tower's left out."""
    found = set()
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.r:
            continue
        site = name.removeprefix("base_model.model.").replace(VL, "model.")
        while site.endswith(".base_layer"):
            site = site.removesuffix(".base_layer")
        if not site.startswith("model.visual."):
            found.add(f"{site}.{module.parameter_name}" if isinstance(module, ParamWrapper) else site)
    return found


def peft_in_our_names(peft_model) -> dict:
    return {(site.replace(VL, "model."), part): v for (site, part), v in peft_ranks_and_scalings(peft_model).items()
            if not site.startswith("model.visual.")}


# --- 1. adapters made by PEFT -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_matches_peft(case, models, ours, base_hf, tmp_path, seed):
    layout, kwargs = PEFT_CASES[case]
    family = LAYOUTS[layout][0]
    adapter_dir = make_peft_adapter(layout, models[family], tmp_path / "lora", seed, **kwargs)
    sequences = hybrid_sequences(seed + 1)
    engine = Engine(ours[family], [load_adapter(adapter_dir, "lora", ours[family])])
    got = run_one_adapter(engine, "lora", sequences)
    oracle = load_peft(layout, models[family], adapter_dir)
    assert_rows_close_but_router_ties(engine, got, hf_logprobs(oracle, sequences), sequences)
    assert_changes(got, hf_logprobs(base_hf[family], sequences))
    adapter = engine.adapters[0]
    ours_rs, peft_rs = our_ranks_and_scalings(adapter), peft_in_our_names(oracle)
    assert ours_rs.keys() == peft_rs.keys()
    for target, (rank, scaling) in ours_rs.items():
        assert (rank, scaling) == (peft_rs[target][0], pytest.approx(peft_rs[target][1])), target
    assert bool(adapter.skipped) == ("all-linear" in case and "exclude" not in case and layout == "vl")
    # the config as it was written, before PEFT rewrote it (hand-written configs say that): PEFT's modules
    written = write_config(tmp_path / "written", **kwargs)
    assert our_targets(written, ours[family]) == peft_targets(oracle)
    if "modules_to_save" in kwargs:  # every layer's, the zero-centred ones applied as 1 + w
        assert {site.rsplit(".", 1)[-1] for site in adapter.overrides} == {
            *(p.rsplit(".", 1)[-1] for p in kwargs["modules_to_save"])}


def test_peft_refuses_one_half_of_gate_up_on_qwen3_next_and_so_do_we(models, ours, tmp_path):
    with pytest.raises(ValueError, match="without also targeting up_proj"):
        get_peft_model(load_hf(models["qwen3_next"]), LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    folder = write_config(tmp_path / "a", target_modules=["q_proj", "gate_proj"])
    with pytest.raises(InputError, match="gate_proj without up_proj") as info:
        our_targets(folder, ours["qwen3_next"])
    assert info.value.key == "target_modules"


# --- 2. "all-linear" written as such; per-expert LoRA ---------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_linear_written_as_such_resolves_as_peft(layout, models, ours, tmp_path, seed):
    """A PEFT all-linear adapter whose config says "all-linear" again (as hand-written ones do; PEFT wrote the list
    it resolved, and on qwen3_next its conversion's target_parameters and rank / alpha patterns): PEFT resolves it
    afresh on load, and so do we, to the same modules, ranks and logprobs."""
    family = LAYOUTS[layout][0]
    adapter_dir = make_peft_adapter(layout, models[family], tmp_path / "lora", seed, r=2, lora_alpha=4,
                                    target_modules="all-linear")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config.update(target_modules="all-linear", target_parameters=None, rank_pattern={}, alpha_pattern={})
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    oracle = load_peft(layout, models[family], adapter_dir)
    targets = our_targets(adapter_dir, ours[family])
    assert targets == peft_targets(oracle)
    if family == "qwen3_next":  # experts and router, no shared expert or dense MLP projections
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= targets
        assert not any(".shared_expert." in t or ".layers.1.mlp." in t for t in targets)
    else:  # neither routed experts nor router
        assert not any(".experts" in t or ".mlp.gate" in t for t in targets)
        assert {"model.layers.0.mlp.shared_expert.down_proj", "model.layers.0.linear_attn.in_proj_qkv"} <= targets
    sequences = hybrid_sequences(seed + 1)
    engine = Engine(ours[family], [load_adapter(adapter_dir, "lora", ours[family])])
    assert_rows_close_but_router_ties(engine, run_one_adapter(engine, "lora", sequences),
                                      hf_logprobs(oracle, sequences), sequences)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_per_expert_lora_as_trainers_export_it(family, models, ours, base_hf, tmp_path, seed):
    """Per-expert 2D LoRA (`mlp.experts.{e}.gate_proj`, as Tinker's PEFT exports and transformers 4 trainers write it)
    under target_modules "all-linear": PEFT converts qwen3_next's (so it reaches the experts) and loads the keys into
    its fused LoRA; on qwen3_5_moe "all-linear" reaches no expert, so the keys are refused as PEFT would not load
    them, and load under target_modules naming the projections. Against the merged-weights oracle."""
    oracle = write_expert_adapter(models[family], tmp_path / "experts", layout="per_expert_2d", seed=seed)
    if family == "qwen3_5_moe":
        with pytest.raises(InputError, match="does not target"):
            load_adapter(oracle.adapter_dir, "experts", ours[family])
        config = json.loads((oracle.adapter_dir / "adapter_config.json").read_text())
        config["target_modules"] = ["gate_proj", "up_proj", "down_proj"]
        (oracle.adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    engine = Engine(ours[family], [load_adapter(oracle.adapter_dir, "experts", ours[family])])
    assert engine.adapters[0].layouts == {"per-expert 2D"}
    sequences = hybrid_sequences(seed + 1)
    got = run_one_adapter(engine, "experts", sequences)
    assert_close_to_merged(engine, "experts", got, oracle, sequences, tmp_path / "merged")
    assert_changes(got, hf_logprobs(base_hf[family], sequences))


# --- 3. Tinker's split in_proj_q / k / v --------------------------------------------------------------------

# id -> write_split_qkv_adapter kwargs
SPLIT_CASES = {
    "text-keys": dict(layout="text"),
    "vl-keys-ranks-differ": dict(layout="vl", rank_pattern={"in_proj_k": 2, "in_proj_v": 6}, alpha=5),
    "no-k-all-linear": dict(parts="qv", target_modules="all-linear"),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_qkv_lora_matches_merged_oracle(case, models, ours, base_hf, tmp_path, seed):
    kwargs = SPLIT_CASES[case]
    model = ours["qwen3_5_moe"]
    oracle = write_split_qkv_adapter(models["qwen3_5_moe"], tmp_path / "split", seed=seed, **kwargs)
    adapter = load_adapter(oracle.adapter_dir, "split", model)
    engine = Engine(model, [adapter])
    sequences = hybrid_sequences(seed + 1)
    got = run_one_adapter(engine, "split", sequences)
    assert_close_to_merged(engine, "split", got, oracle, sequences, tmp_path / "merged")
    assert_changes(got, hf_logprobs(base_hf["qwen3_5_moe"], sequences))
    assert adapter.layouts == {SPLIT_LAYOUT}
    parts = kwargs.get("parts", "qkv")
    ranks = {f"in_proj_{p}": kwargs.get("rank_pattern", {}).get(f"in_proj_{p}", 4) for p in parts}
    assert {(t["site"].rsplit(".", 1)[-1], t["layer"], t["rank"]) for t in adapter.targets} == \
        {(name, i, r) for name, r in ranks.items() for i in (0, 1, 2, 4)}
    for t in adapter.targets:
        assert t["scaling"] == pytest.approx(kwargs.get("alpha", 8) / t["rank"])
    A, B = adapter.dense["model.layers.0.linear_attn.in_proj_qkv"]  # [R, H], [2*Hk*K + Hv*V, R]
    key_rows = model.args.linear_num_key_heads * model.args.linear_key_head_dim  # Hk*K: the q part's, the k part's
    assert A.shape == (sum(ranks.values()), model.args.hidden_size)
    assert B.shape == (2 * key_rows + model.args.linear_num_value_heads * model.args.linear_value_head_dim, A.shape[0])
    if "k" not in parts:  # the keys' rows take nothing
        assert not B[key_rows:2 * key_rows].any() and B[:key_rows].any() and B[2 * key_rows:].any()


def test_split_qkv_parts_that_do_not_fit_are_refused_by_key(models, ours, tmp_path, seed):
    """q and k parts have Hk*K rows, v has Hv*V = 2*Hk*K here: a k LoRA B of v's rows is refused naming its key; so
    is LoRA on both the fused projection and its parts, and split parts on qwen3_next (fused in_proj_qkvz, no parts)."""
    args = ours["qwen3_5_moe"].args
    key_rows, value_rows = (args.linear_num_key_heads * args.linear_key_head_dim,
                            args.linear_num_value_heads * args.linear_value_head_dim)
    assert value_rows != key_rows
    adapter_dir = write_split_qkv_adapter(models["qwen3_5_moe"], tmp_path / "split", seed=seed).adapter_dir
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    bad_key = "base_model.model.model.layers.1.linear_attn.in_proj_k.lora_B.weight"
    save_file({**tensors, bad_key: tensors[bad_key.replace("in_proj_k", "in_proj_v")].clone()}, str(path))
    with pytest.raises(InputError, match=rf"shape \[{value_rows}, 4\], expected \[{key_rows}, 4\]") as info:
        load_adapter(adapter_dir, "split", ours["qwen3_5_moe"])
    assert info.value.key == bad_key and not isinstance(info.value, UnsupportedError)

    fused = "base_model.model.model.layers.1.linear_attn.in_proj_qkv"
    save_file({**tensors, f"{fused}.lora_A.weight": torch.randn(4, args.hidden_size),
               f"{fused}.lora_B.weight": torch.randn(2 * key_rows + value_rows, 4)}, str(path))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "target_modules": "all-linear"}))
    with pytest.raises(InputError, match="LoRA on both model.layers.1.linear_attn.in_proj_qkv and its split parts"):
        load_adapter(adapter_dir, "split", ours["qwen3_5_moe"])

    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="entry 'in_proj_q' matches no module"):
        load_adapter(adapter_dir, "split", ours["qwen3_next"])


# --- 4. what PEFT cannot target ------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, key, name", [
    (dict(target_modules=["conv1d"]), "target_modules", "model.layers.0.linear_attn.conv1d (a depthwise convolution)"),
    (dict(target_modules=r".*linear_attn\.(conv1d|out_proj)"), "target_modules", "model.layers.0.linear_attn.conv1d"),
    (dict(target_modules=[], target_parameters=["A_log"]), "target_parameters",
     "model.layers.0.linear_attn.A_log (a 1-D per-head decay parameter)"),
    (dict(target_modules=["q_proj"], target_parameters=["linear_attn.dt_bias"]), "target_parameters",
     "model.layers.0.linear_attn.dt_bias (a 1-D per-head decay bias)"),
])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_what_peft_cannot_target_is_refused_by_name(family, fields, key, name, models, ours, tmp_path):
    """PEFT 0.21 refuses each (the depthwise conv: only a rank that its channels divide; 1-D parameters: never),
    and so do we, before reading any weight, naming the module."""
    with pytest.raises(ValueError, match="groups|only 2d and 3d"):
        get_peft_model(load_hf_model(models[family]), LoraConfig(r=4, **fields))
    with pytest.raises(UnsupportedError) as info:
        load_adapter(write_config(tmp_path / "a", r=4, **fields), "a", ours[family])
    assert info.value.key == key and f"LoRA on {name}" in str(info.value) and "is not supported" in str(info.value)


def test_conv1d_lora_weights_are_refused_by_key(models, ours, tmp_path, seed):
    adapter_dir = save_random_peft_adapter(models["qwen3_next"], tmp_path / "a", seed=seed, r=2, lora_alpha=4,
                                           target_modules=["out_proj"])
    path = adapter_dir / "adapter_model.safetensors"
    key = "base_model.model.model.layers.2.linear_attn.conv1d.lora_A.weight"
    save_file({**load_file(str(path)), key: torch.randn(2, 1, 4), key.replace("lora_A", "lora_B"): torch.randn(8, 2)},
              str(path))  # (any shapes: refused by name before shapes are checked)
    with pytest.raises(UnsupportedError, match=r"LoRA on model\.layers\.2\.linear_attn\.conv1d \(a depthwise") as info:
        load_adapter(adapter_dir, "a", ours["qwen3_next"])
    assert info.value.key == key


def test_vision_tower_names_in_a_list_need_not_match(models, ours, tmp_path):
    """A VL trainer's list naming vision modules (which ours leaves out: ADAPTER_SKIPPED_MODULES) resolves to its
    language-model entries; another name that matches nothing is still refused."""
    folder = write_config(tmp_path / "a", target_modules=["linear_fc1", "qkv", "in_proj_z"])
    assert our_targets(folder, ours["qwen3_5_moe"]) == {f"model.layers.{i}.linear_attn.in_proj_z" for i in (0, 1, 2, 4)}
    folder = write_config(tmp_path / "b", target_modules=["in_proj_zz", "qkv"])
    with pytest.raises(InputError, match="entry 'in_proj_zz' matches no module"):
        our_targets(folder, ours["qwen3_5_moe"])
