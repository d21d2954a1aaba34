"""Adapters end to end: our per-token logprobs under LoRA adapters against independent oracles.

Every test runs a batch of several sequences of different lengths through ONE ``Engine.logprobs`` call
and compares each row with a reference computed one sequence at a time, in float32, within ``TOL``:

1. adapters written by PEFT itself on the tiny Qwen3-MoE (and on dense Qwen3 / Llama), against PEFT's own
   model (``peft_oracle``); each adapter must also move the logprobs away from the base model, so a
   loader that silently drops weights cannot pass;
2. hand-written MoE expert adapters in the layouts found in the wild (``write_expert_adapter``), against
   the base model with the deltas merged into its weights; the detected layout label is checked too;
3. a pickled ``adapter_model.bin`` gives exactly what the same adapter as safetensors gives;
4. a mixed batch over three adapters of different ranks and targets plus base rows: each row equals that
   row computed alone and its oracle, and base rows equal the no-adapter engine bit for bit;
5. the stacked buffers of that engine: padded to the largest rank per site, zero where a slot has no weight.

Seeds are fresh every run (the ``seed`` / ``session_seed`` fixtures print them) so a failure can be replayed.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft.tuners.lora import LoraLayer, ParamWrapper
from safetensors.torch import load_file

from lora_eval import Batch, Engine
from lora_eval.adapters import load_adapter
from lora_eval.engine.forward import Forward
from lora_eval.models import load_model
from tests.builders import (
    hf_logprobs,
    load_hf,
    peft_oracle,
    save_random_model,
    save_random_peft_adapter,
    write_expert_adapter,
)
from tests.conftest import CPU

TOL = 1e-5  # max abs difference from an oracle, float32
MIN_EFFECT = 1e-4  # an adapter must move some logprob at least this much (10x TOL) from the base model
VOCAB = 96  # tests.builders' tiny vocabulary
N_ROWS = 5


# --- helpers --------------------------------------------------------------------------------------


def varied_sequences(seed: int, n: int = N_ROWS, min_len: int = 2, max_len: int = 24) -> list[list[int]]:
    """``n`` random sequences whose lengths are all different (one of them as short as possible)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.randperm(max_len - min_len, generator=generator)[: n - 1] + min_len + 1).tolist()
    lengths.insert(int(torch.randint(0, n, (1,), generator=generator)), min_len)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def run_one_adapter(engine: Engine, name: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """All ``sequences`` under adapter ``name`` in a single ``logprobs`` call."""
    out = engine.logprobs(Batch(input_ids=sequences, adapters=[name] * len(sequences)))
    assert [lp.dtype for lp in out] == [torch.float32] * len(sequences)
    return out


def max_row_diffs(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    assert len(ours) == len(reference)
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a.shape == b.shape, f"row {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return [(a - b).abs().max().item() for a, b in zip(ours, reference)]


def assert_rows_close(ours, reference, tol: float = TOL, what: str = "oracle") -> None:
    diffs = max_row_diffs(ours, reference)
    bad = {i: d for i, d in enumerate(diffs) if not d <= tol}
    assert not bad, f"rows differ from the {what} by more than {tol}: {bad} (all rows: {diffs})"


def assert_close_to_merged(engine: Engine, name: str, ours, oracle, sequences, out_dir) -> None:
    """ours (the rows of `sequences` under adapter `name`) against the merged-weights oracle. The two compute the same
    model two ways, W x + s B (A x) against (W + s B A) x, float rounding apart; where a router's top-k is a near tie
    that rounding decides, a position takes other experts and its row parts from the oracle by tenths of a nat (seen
    once in CI: DeepSeek-V3, router logits 1.8e-6 apart at one position, 0.89 nats). So a row off by more than TOL
    passes only if the merged weights, run through our own engine, route one of its positions otherwise than the
    adapter does, and at most one row may: anything else fails as before."""
    diffs = max_row_diffs(ours, hf_logprobs(oracle.model, sequences))
    bad = {i: d for i, d in enumerate(diffs) if not d <= TOL}
    if not bad:
        return
    oracle.model.save_pretrained(out_dir)
    merged = Engine.load(out_dir, {}, CPU)
    unexplained = {i: d for i, d in bad.items()
                   if routes(engine, name, sequences[i]) == routes(merged, None, sequences[i])}
    assert not unexplained and len(bad) <= 1, \
        f"rows differ from the merged oracle by more than {TOL}: {bad}, not by a routing tie: {unexplained}"


def routes(engine: Engine, name: str | None, sequence: list[int]) -> list[torch.Tensor]:
    """The experts each position of `sequence` chose at each MoE layer, as a set (sorted) [L, k] per layer."""
    seen = []
    Forward.probe = staticmethod(lambda layer, point, t: point == "router_topk" and seen.append(t.sort(-1).values))
    try:
        engine.logprobs(Batch([sequence], [name]))
    finally:
        Forward.probe = None
    return [t.tolist() for t in seen]


def assert_changes(ours, base) -> None:
    """The adapter must matter, otherwise a comparison with its oracle proves nothing."""
    effect = max(max_row_diffs(ours, base))
    assert effect > MIN_EFFECT, f"adapter moves logprobs by only {effect:.2e} from the base model"


def peft_ranks_and_scalings(peft_model) -> dict[tuple[str, str], tuple[int, float]]:
    """{(site, part): (rank, scaling)} of every LoRA layer PEFT built, named like ``Adapter.targets``."""
    found = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.r:
            continue
        site = name.removeprefix("base_model.model.")
        while site.endswith(".base_layer"):
            site = site.removesuffix(".base_layer")
        if isinstance(module, ParamWrapper) and module.parameter_name in ("gate_up_proj", "down_proj"):
            part = "experts." + module.parameter_name.removesuffix("_proj")
        elif "default" in module.lora_embedding_A:
            part = "embedding"
        else:
            part = "dense"
        found[(site, part)] = (module.r["default"], module.scaling["default"])
    return found


def our_ranks_and_scalings(adapter) -> dict[tuple[str, str], tuple[int, float]]:
    return {(t["site"], t["part"]): (t["rank"], t["scaling"]) for t in adapter.targets if t["rank"] is not None}


# --- module fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_base_hf(moe_model):
    return load_hf(moe_model)


@pytest.fixture(scope="module")
def moe_ours(moe_model):
    """Our model for the MoE checkpoint, shared by tests that build engines from loaded adapters."""
    return load_model(moe_model, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory, session_seed) -> dict:
    """Tiny dense Qwen3 (with q/k norm) and Llama checkpoints."""
    return {
        family: save_random_model(tmp_path_factory.mktemp(family), family, seed=session_seed + offset)
        for offset, family in enumerate(("qwen3", "llama"), start=1)
    }


# --- 1. adapters written by PEFT ------------------------------------------------------------------

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PEFT_EXPERTS = {"PEFT target_parameters"}

# id -> (LoraConfig kwargs, expected expert layout labels)
PEFT_CASES = {
    # PEFT 0.21 on v5 MoE: attention modules + target_parameters router gate.weight and experts gate_up/down,
    # with a rank_pattern doubling gate_up's rank
    "all-linear": (dict(r=4, lora_alpha=8, target_modules="all-linear"), PEFT_EXPERTS),
    "experts-target-parameters": (
        dict(r=3, lora_alpha=5, target_modules=[], target_parameters=EXPERT_PARAMETERS), PEFT_EXPERTS),
    "attention-qkvo": (dict(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), set()),
    "suffix-names": (dict(r=2, lora_alpha=4, target_modules=["self_attn.q_proj", "self_attn.v_proj", "mlp.gate"]),
                     set()),
    "regex": (dict(r=3, lora_alpha=7, target_modules=r".*\.(q_proj|o_proj)"), set()),
    "router-target-parameter": (dict(r=2, lora_alpha=4, target_modules=[], target_parameters=["mlp.gate.weight"]),
                                set()),
    "router-module-name": (dict(r=4, lora_alpha=4, target_modules=["gate"]), set()),
    # PEFT turns gate_proj/up_proj/down_proj into expert target_parameters (and never touches dense layer 1)
    "mlp-names-to-experts": (dict(r=2, lora_alpha=3, target_modules=["gate_proj", "up_proj", "down_proj"]),
                             PEFT_EXPERTS),
    # the dense MLP of layer 1 can only be reached through target_parameters on its Linear weights
    "dense-mlp-layer": (dict(r=3, lora_alpha=6, target_modules=[], target_parameters=[
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight"]), set()),
    "lm_head": (dict(r=4, lora_alpha=8, target_modules=["lm_head"]), set()),
    "embed_tokens": (dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]), set()),
    "modules-to-save-norms": (dict(r=2, lora_alpha=4, target_modules=["v_proj"], modules_to_save=[
        "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm"]), set()),
    "modules-to-save-embed-lm_head-linear": (dict(r=2, lora_alpha=4, target_modules=["k_proj"], modules_to_save=[
        "lm_head", "embed_tokens", "model.layers.1.mlp.down_proj"]), set()),
    "rank-and-alpha-pattern": (dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS,
        rank_pattern={"k_proj": 6, "model.layers.2.self_attn.q_proj": 3, "down_proj": 5},
        alpha_pattern={"v_proj": 1.5, "model.layers.0.self_attn.k_proj": 20}), PEFT_EXPERTS),
    "use_rslora": (dict(r=4, lora_alpha=3, use_rslora=True, target_modules=["q_proj", "o_proj"],
                        target_parameters=EXPERT_PARAMETERS), PEFT_EXPERTS),
    "layers_to_transform": (dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 2]),
                            set()),
    # issue 42: every setting that decides the targets, by PEFT's own rules (layers_pattern picks the layer index,
    # exclude_modules removes one module, target_parameters and modules_to_save ignore layers_to_transform, a
    # module of modules_to_save is no LoRA target, alpha_pattern keyed to one layer's 3D expert parameter)
    "layers-pattern-exclude-modules": (dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], layers_to_transform=[0, 2],
        layers_pattern="layers", exclude_modules=["model.layers.2.self_attn.v_proj"]), set()),
    "layers_to_transform-target-parameters": (dict(
        r=2, lora_alpha=4, target_modules=["q_proj"], layers_to_transform=[1], target_parameters=EXPERT_PARAMETERS,
        alpha_pattern={"model.layers.2.mlp.experts.down_proj": 7}), PEFT_EXPERTS),
    "modules-to-save-layers-and-exclusion": (dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "k_proj"], layers_to_transform=[0],
        modules_to_save=["k_proj", "q_norm"]), set()),
    "layers_to_transform-int": (dict(r=2, lora_alpha=4, target_modules=["o_proj"], layers_to_transform=1), set()),
}


def check_peft_adapter(model_dir, adapter_dir, sequences, base_logprobs, expected_layouts=None) -> None:
    """Our logprobs under the adapter vs PEFT's, plus the adapter's effect and its ranks / scalings."""
    engine = Engine.load(model_dir, {"lora": adapter_dir}, CPU)
    ours = run_one_adapter(engine, "lora", sequences)
    oracle = peft_oracle(model_dir, adapter_dir)
    assert_rows_close(ours, hf_logprobs(oracle, sequences))
    assert_changes(ours, base_logprobs)
    adapter = engine.adapters[0]
    ours_rs, peft_rs = our_ranks_and_scalings(adapter), peft_ranks_and_scalings(oracle)
    assert ours_rs.keys() == peft_rs.keys()
    for target, (rank, scaling) in ours_rs.items():
        assert rank == peft_rs[target][0], target
        assert scaling == pytest.approx(peft_rs[target][1]), target
    if expected_layouts is not None:
        assert adapter.layouts == expected_layouts


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_adapter_on_moe_matches_peft(case, moe_model, moe_base_hf, tmp_path, seed):
    lora_kwargs, layouts = PEFT_CASES[case]
    adapter_dir = save_random_peft_adapter(moe_model, tmp_path / case, seed=seed, **lora_kwargs)
    sequences = varied_sequences(seed + 1)
    check_peft_adapter(moe_model, adapter_dir, sequences, hf_logprobs(moe_base_hf, sequences), layouts)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_peft_all_linear_on_dense_models(family, dense_models, tmp_path, seed):
    model_dir = dense_models[family]
    adapter_dir = save_random_peft_adapter(model_dir, tmp_path / "lora", seed=seed, r=4, lora_alpha=8,
                                           target_modules="all-linear")
    sequences = varied_sequences(seed + 1)
    check_peft_adapter(model_dir, adapter_dir, sequences, hf_logprobs(load_hf(model_dir), sequences), set())


# --- 2. hand-written expert layouts ---------------------------------------------------------------

# id -> (write_expert_adapter kwargs, expected layout label)
EXPERT_CASES = {
    "per-expert-2d-qwen": (dict(layout="per_expert_2d"), "per-expert 2D"),
    "per-expert-2d-mixtral-router": (dict(layout="per_expert_2d", names="mixtral", include_router=True),
                                     "per-expert 2D"),
    "fused-3d-rank3-alpha5": (dict(layout="fused_3d", rank=3, alpha=5), "fused 3D"),
    "fused-3d-shared-outer": (dict(layout="fused_3d", shared_outer=True, include_router=True), "shared-outer 3D"),
    "split-3d": (dict(layout="split_3d", rank=2, alpha=7), "fused 3D"),
    "split-3d-shared-outer-one-layer": (dict(layout="split_3d", shared_outer=True, layers=[2]), "shared-outer 3D"),
    "peft-target-parameters-router": (dict(layout="peft_target_parameters", include_router=True),
                                      "PEFT target_parameters"),
    "peft-target-parameters-one-layer": (dict(layout="peft_target_parameters", layers=[0], rank=5, alpha=3),
                                         "PEFT target_parameters"),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_expert_layout_matches_merged_oracle(case, moe_model, moe_base_hf, tmp_path, seed):
    kwargs, label = EXPERT_CASES[case]
    oracle = write_expert_adapter(moe_model, tmp_path / case, seed=seed, **kwargs)
    engine = Engine.load(moe_model, {"experts": oracle.adapter_dir}, CPU)
    sequences = varied_sequences(seed + 1)
    ours = run_one_adapter(engine, "experts", sequences)
    assert_close_to_merged(engine, "experts", ours, oracle, sequences, tmp_path / "merged")
    assert_changes(ours, hf_logprobs(moe_base_hf, sequences))

    adapter = engine.adapters[0]
    assert adapter.layouts == {label}
    rank, alpha = kwargs.get("rank", 4), kwargs.get("alpha", 8)
    expert_targets = [t for t in adapter.targets if t["kind"] == "experts"]
    assert {t["layer"] for t in expert_targets} == set(kwargs.get("layers", [0, 2]))
    assert [t["rank"] for t in expert_targets] == [rank] * len(expert_targets)
    assert [t["scaling"] for t in expert_targets] == pytest.approx([alpha / rank] * len(expert_targets))
    routers = {t["site"] for t in adapter.targets if t["kind"] == "gate"}
    assert routers == ({f"model.layers.{i}.mlp.gate" for i in (0, 2)} if kwargs.get("include_router") else set())


# --- 3. pickled adapter_model.bin -----------------------------------------------------------------


def to_bin(adapter_dir, out_dir):
    """A copy of the adapter with its safetensors turned into a torch.save'd plain dict."""
    shutil.copytree(adapter_dir, out_dir)
    tensors = load_file(str(out_dir / "adapter_model.safetensors"))
    torch.save(dict(tensors), out_dir / "adapter_model.bin")
    (out_dir / "adapter_model.safetensors").unlink()
    return out_dir


@pytest.mark.parametrize("source", ["peft-all-linear", "hand-written-split-3d"])
def test_bin_adapter_equals_safetensors(source, moe_model, tmp_path, seed):
    if source == "peft-all-linear":
        st_dir = save_random_peft_adapter(moe_model, tmp_path / "st", seed=seed, r=2, lora_alpha=4,
                                          target_modules="all-linear", modules_to_save=["q_norm"])
        oracle_model = peft_oracle(moe_model, st_dir)
    else:
        merged = write_expert_adapter(moe_model, tmp_path / "st", layout="split_3d", seed=seed, include_router=True)
        st_dir, oracle_model = merged.adapter_dir, merged.model
    bin_dir = to_bin(st_dir, tmp_path / "bin")
    engine = Engine.load(moe_model, {"st": st_dir, "bin": bin_dir}, CPU)
    assert engine.adapters[1].weights_file.name == "adapter_model.bin"
    sequences = varied_sequences(seed + 1)
    from_st, from_bin = run_one_adapter(engine, "st", sequences), run_one_adapter(engine, "bin", sequences)
    assert all(torch.equal(a, b) for a, b in zip(from_bin, from_st)), max_row_diffs(from_bin, from_st)
    assert_rows_close(from_bin, hf_logprobs(oracle_model, sequences))


# --- 4. mixed batch over three adapters -----------------------------------------------------------


@pytest.fixture(scope="module")
def three_adapters(moe_model, moe_ours, tmp_path_factory, session_seed):
    """Three adapters of ranks 2 / 4 / 8 with different targets, loaded into one model; with their oracles."""
    root = tmp_path_factory.mktemp("three_adapters")
    all_linear = save_random_peft_adapter(moe_model, root / "all_linear", seed=session_seed + 11, r=2,
                                          lora_alpha=4, target_modules="all-linear")
    split = write_expert_adapter(moe_model, root / "split", layout="split_3d", shared_outer=True,
                                 seed=session_seed + 12, rank=4, alpha=6)
    edges = save_random_peft_adapter(moe_model, root / "edges", seed=session_seed + 13, r=8, lora_alpha=12,
                                     target_modules=["embed_tokens", "lm_head", "q_proj"])
    dirs = {"all_linear": all_linear, "split": split.adapter_dir, "edges": edges}
    adapters = [load_adapter(path, name, moe_ours) for name, path in dirs.items()]
    oracles = {"all_linear": peft_oracle(moe_model, all_linear), "split": split.model,
               "edges": peft_oracle(moe_model, edges)}
    return adapters, oracles


def test_mixed_batch_rows_match_alone_oracle_and_base(moe_ours, three_adapters, seed):
    adapters, oracles = three_adapters
    engine = Engine(moe_ours, adapters)
    generator = torch.Generator().manual_seed(seed)
    tags = [a.name for a in adapters for _ in range(3)] + [None] * 4
    tags = [tags[i] for i in torch.randperm(len(tags), generator=generator)]
    sequences = varied_sequences(seed + 1, n=len(tags))

    mixed = engine.logprobs(Batch(input_ids=sequences, adapters=tags))
    assert [lp.shape[0] for lp in mixed] == [len(s) - 1 for s in sequences]

    alone_engines = {a.name: Engine(moe_ours, [a]) for a in adapters}
    base_engine = Engine(moe_ours)
    for i, (tag, seq) in enumerate(zip(tags, sequences)):
        if tag is None:
            continue
        alone = alone_engines[tag].logprobs(Batch(input_ids=[seq], adapters=[tag]))
        assert_rows_close([mixed[i]], alone, what=f"row computed alone (row {i}, adapter {tag})")
        assert_rows_close([mixed[i]], hf_logprobs(oracles[tag], [seq]), what=f"oracle (row {i}, adapter {tag})")
        assert_changes([mixed[i]], base_engine.logprobs(Batch(input_ids=[seq], adapters=[None])))

    base = base_engine.logprobs(Batch(input_ids=sequences, adapters=[None] * len(sequences)))
    base_rows = [i for i, tag in enumerate(tags) if tag is None]
    not_equal = {i: max_row_diffs([mixed[i]], [base[i]])[0] for i in base_rows if not torch.equal(mixed[i], base[i])}
    assert not not_equal, f"base rows in the mixed batch differ from the no-adapter engine: {not_equal}"


# --- 5. stacked buffers ---------------------------------------------------------------------------


def check_stacked(stacked: torch.Tensor, slots, factors: dict[int, torch.Tensor], rank_dim: int, what: str):
    """``stacked`` [S, ...]: slot s holds ``factors[s]`` zero-padded along ``rank_dim`` (of the factor, which
    may broadcast over a leading expert dim of 1); every other slot is zero; the rank is the max over slots."""
    assert set(slots) == set(factors), f"{what}: slots {sorted(slots)}, expected {sorted(factors)}"
    assert stacked.shape[1 + rank_dim] == max(f.shape[rank_dim] for f in factors.values()), what
    for s in range(stacked.shape[0]):
        if s not in factors:
            assert not stacked[s].any(), f"{what}: slot {s} has no weight here but its buffer is not zero"
            continue
        f = factors[s]
        r = f.shape[rank_dim]
        index = [slice(None)] * f.dim()
        index[rank_dim] = slice(0, r)
        kept = stacked[s][tuple(index)]
        assert torch.equal(kept, f.expand_as(kept)), f"{what}: slot {s} does not hold its adapter's factor"
        index[rank_dim] = slice(r, None)
        assert not stacked[s][tuple(index)].any(), f"{what}: slot {s} is not zero beyond its rank {r}"


def test_stack_pads_to_max_rank_and_zeroes_missing_slots(moe_ours, three_adapters):
    adapters, _ = three_adapters
    stack = Engine(moe_ours, adapters).stack
    assert stack.names == ["all_linear", "split", "edges"]

    dense_sites = {site for a in adapters for site in a.dense}
    assert set(stack.dense) == dense_sites
    assert {"lm_head", "model.layers.0.self_attn.q_proj", "model.layers.2.mlp.gate"} <= dense_sites
    for site, lora in stack.dense.items():
        have = {s: a.dense[site] for s, a in enumerate(adapters) if site in a.dense}
        check_stacked(lora.A, lora.slots, {s: f[0] for s, f in have.items()}, 0, f"{site} A")
        check_stacked(lora.B, lora.slots, {s: f[1] for s, f in have.items()}, 1, f"{site} B")
    q_proj = stack.dense["model.layers.1.self_attn.q_proj"]
    assert q_proj.A.shape[1] == 8 and q_proj.slots == {0, 2}  # ranks 2 and 8; the split adapter has none
    assert stack.dense["model.layers.1.self_attn.k_proj"].A.shape[1] == 2

    assert set(stack.embedding) == {"model.embed_tokens"}
    embed = stack.embedding["model.embed_tokens"]
    assert embed.slots == {2}
    check_stacked(embed.A, embed.slots, {2: adapters[2].embedding["model.embed_tokens"][0]}, 1, "embedding A")
    check_stacked(embed.B, embed.slots, {2: adapters[2].embedding["model.embed_tokens"][1]}, 1, "embedding B")

    assert set(stack.experts) == {"model.layers.0.mlp.experts", "model.layers.2.mlp.experts"}
    for site, lora in stack.experts.items():
        have = {s: a.experts[site] for s, a in enumerate(adapters) if site in a.experts}
        assert set(have) == {0, 1}
        for part in ("gate_up", "down"):
            factors = {s: getattr(f, part) for s, f in have.items()}
            A, B = getattr(lora, f"{part}_A"), getattr(lora, f"{part}_B")
            assert A.shape[1] == B.shape[1] == 6  # per-expert factors in slot 0: the expert dim is E
            check_stacked(A, lora.slots, {s: f[0] for s, f in factors.items()}, 1, f"{site} {part} A")
            check_stacked(B, lora.slots, {s: f[1] for s, f in factors.items()}, 2, f"{site} {part} B")
        # all-linear: gate_up at 2 * r = 4; split 3D rank 4 with gate and up joined block-diagonally: 8
        assert lora.gate_up_A.shape[2] == 8 and lora.down_A.shape[2] == 4
