"""`lora-eval diagnose`: where, layer by layer, the engine parts from a reference computation.

One module fixture builds a tiny Qwen3-MoE checkpoint (5 layers, layer 1 dense), two PEFT adapters — `mine`
(all-linear: attention, router and experts, with every v_proj lora_B zeroed) and `emb` (embedding and lm_head LoRA;
PEFT turns its MLP names into the experts' target_parameters) — a reference whose logprobs are the engine's plus
noise of a known size per sample, two rigged copies of the checkpoint: one MoE layer's expert weights perturbed,
or its router negated; and `mine` merged into the weights by PEFT (merge_and_unload), also with that layer's experts
perturbed. Then:

1. rigged experts / router (`--against-model`): that layer is the first divergent one, in both measurements, with
   every error before it exactly 0 and no flips before it; layer by layer, every error after it is 0 too; side B
   runs the same adapters there (the default), so the adapters' rows name that layer too; against the merged
   checkpoint without adapters (`--against-adapters none`), `mine`'s rows agree within float32 rounding (no
   divergent layer), or part at the rigged layer; run.json and the reports say which side B ran; bad combinations
   exit 2;
2. bf16 engine against float32: errors everywhere, growing (free-running), and no first divergent layer;
3. lora_rel_effect: exactly 0 for the zeroed v_proj of every layer, > 0 for every other targeted module;
4. samples: the ones with the largest k2, per adapter, with k2 as the metrics code computes it;
5. the CLI: the run folder's files and exact columns, a second run recomputes nothing, bad input exits 2; a killed
   run resumes to the same files;
6. the probe: seeing intermediates does not change the forward (torch and Triton paths); the rule on hand-made
   numbers.
Seeds are fresh every run (the `seed` / `session_seed` fixtures print them).
"""

from __future__ import annotations

import html
import importlib
import json
import shutil
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lora_eval import Batch, Engine, EngineOptions, InputError, diagnose
from lora_eval.cli import cli
from lora_eval.tasks.diagnose.task import FACTOR, first_divergence, noise_floor
from lora_eval.render.diagnose import diagnose_report_files
from lora_eval.engine.engine import read_adapters
from lora_eval.engine.forward import Forward
from lora_eval.results.metrics import token_metrics
from lora_eval.models import load_model
from lora_eval.tasks.diagnose.one_layer import LayerLoader
from lora_eval.inputs.references import read_reference, write_reference
from lora_eval.results.tables import read_diagnose
from tests.builders import FAMILIES, peft_oracle, random_sequences, save_random_model, save_random_peft_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback, assert_phases
from tests.conftest import CPU, MOE_OVERRIDES

VOCAB = 96
LAYERS = 5  # layer 1 dense (the tiny config's mlp_only_layers)
MOE_LAYERS = [0, 2, 3, 4]
TAGS = (None, "mine", "emb")
PER_TAG = 3
SAMPLES = 2  # diagnosed per adapter
BF16 = EngineOptions(device="cpu", dtype="bfloat16")


class Artefacts:
    """The inputs every test shares."""


@pytest.fixture(scope="module")
def art(tmp_path_factory, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("diagnose")
    s = session_seed
    a = Artefacts()
    a.root = root
    a.model = save_random_model(root / "model", "qwen3_moe", seed=s, num_hidden_layers=LAYERS, **MOE_OVERRIDES)
    a.mine = save_random_peft_adapter(a.model, root / "mine", seed=s + 1, r=4, lora_alpha=8,
                                      target_modules="all-linear")
    weights = load_file(a.mine / "adapter_model.safetensors")
    a.zeroed = sorted(k for k in weights if "v_proj.lora_B" in k)
    save_file({k: torch.zeros_like(v) if k in a.zeroed else v for k, v in weights.items()},
              a.mine / "adapter_model.safetensors")
    a.emb = save_random_peft_adapter(a.model, root / "emb", seed=s + 2, r=4, lora_alpha=8,
                                     target_modules=["embed_tokens", "lm_head", "gate_proj", "up_proj", "down_proj"])
    a.adapters = {"mine": a.mine, "emb": a.emb}

    # the reference: the engine's own float32 logprobs plus noise of a known size per sample
    tags = [t for t in TAGS for _ in range(PER_TAG)]
    sequences = random_sequences(len(tags), VOCAB, seed=s + 3, min_len=16, max_len=32)
    logprobs = Engine.load(a.model, a.adapters, CPU).logprobs(Batch(sequences, tags))
    rng = np.random.default_rng(s + 4)
    a.noise = rng.permutation(np.linspace(0.02, 0.4, len(tags)))
    a.ref = pd.DataFrame(dict(
        sample_id=[f"{t or 'base'}-{i}" for i, t in enumerate(tags)], adapter=tags, input_ids=sequences,
        logprobs=[(lp.numpy() + n * rng.standard_normal(len(lp))).tolist() for lp, n in zip(logprobs, a.noise)],
        mask=[None] * len(tags), sampler_logprobs=[None] * len(tags)))
    a.ref_path = write_reference(a.ref, root / "ref.parquet")
    a.base_ref = write_reference(a.ref[a.ref["adapter"].isna()].reset_index(drop=True), root / "base.parquet")

    # rigged copies of the checkpoint: one MoE layer (not the first) changed
    a.rigged_layer = int(rng.choice(MOE_LAYERS[1:]))

    def experts(k, v):
        return v * 1.5 + 0.05 * torch.randn_like(v) if ".mlp.experts." in k else v

    a.experts_model = _rigged_copy(a.model, root / "experts", a.rigged_layer, experts)
    a.router_model = _rigged_copy(a.model, root / "router", a.rigged_layer,
                                  lambda k, v: -v if k.endswith("mlp.gate.weight") else v)
    # `mine` merged into the weights, as a server runs it (W + s B A, by PEFT), and that with the rigged layer
    a.merged_model = root / "merged"
    peft_oracle(a.model, a.mine).merge_and_unload().save_pretrained(a.merged_model, save_original_format=True)
    a.merged_experts_model = _rigged_copy(a.merged_model, root / "merged-experts", a.rigged_layer, experts)
    return a


def _rigged_copy(model_dir, out_dir, layer: int, change):
    """The checkpoint with `change(key, tensor)` applied to the tensors of decoder layer `layer`."""
    shutil.copytree(model_dir, out_dir)
    path = out_dir / "model.safetensors"
    weights = load_file(path)
    prefix = f"model.layers.{layer}."
    save_file({k: change(k, v).contiguous() if k.startswith(prefix) else v for k, v in weights.items()}, path,
              metadata={"format": "pt"})
    return out_dir


def _errors(result, adapter: str) -> pd.DataFrame:
    layers = result.layers
    return layers[layers["adapter"] == adapter]


def _first(result, adapter: str):
    return result.record["adapters"][adapter]["first_divergent_layer"]


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# ---- 1. rigged checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["free-running", "layer-by-layer"])
def test_perturbed_experts_of_one_layer_are_the_first_divergence(art, layer_by_layer):
    L = art.rigged_layer
    result = diagnose(art.model, {}, [art.base_ref], options=CPU, samples=SAMPLES, against_model=art.experts_model,
                      layer_by_layer=layer_by_layer, quiet=True, notice=lambda s: None)
    assert result.record["measured"] == ("layer by layer on the same inputs" if layer_by_layer else "free-running")
    assert _first(result, "base") == L
    assert result.record["adapters"]["base"]["trigger"]["trigger"] == "drift"
    base = _errors(result, "base")
    before, at, after = base[base["layer"] < L], base[base["layer"] == L].set_index("point"), base[base["layer"] > L]
    assert len(before) and (before["rel_error"] == 0).all(), before  # the same numbers, bit for bit
    assert (before["router_flip_rate"].dropna() == 0).all()
    assert at.loc["attention", "rel_error"] == 0 and at.loc["router", "rel_error"] == 0  # both before the experts
    assert at.loc["moe", "rel_error"] > 0.1 and at.loc["residual", "rel_error"] > 1e-3
    if layer_by_layer:  # each layer on the engine's own input: the error stays where it is made
        assert (after["rel_error"] == 0).all(), after
    else:
        assert (after[after["point"] == "residual"]["rel_error"] > 0).all()


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["free-running", "layer-by-layer"])
def test_a_changed_router_is_the_first_divergence_and_flips_there(art, layer_by_layer):
    L = art.rigged_layer
    result = diagnose(art.model, {}, [art.base_ref], options=CPU, samples=SAMPLES, against_model=art.router_model,
                      layer_by_layer=layer_by_layer, quiet=True, notice=lambda s: None)
    assert _first(result, "base") == L
    base = _errors(result, "base")
    router = base[base["point"] == "router"].set_index("layer")
    assert (router.loc[router.index < L, "router_flip_rate"] == 0).all()
    assert (base[base["layer"] < L]["rel_error"] == 0).all()
    assert router.loc[L, "router_flip_rate"] > 0.5 and router.loc[L, "rel_error"] > 1  # negated logits: |a-b| = 2|b|
    flips = {f["layer"]: f for f in result.record["adapters"]["base"]["router_flips"]}
    assert min(flips) == L and flips[L]["flipped_in"] and flips[L]["flipped_out"]
    assert all(0 <= e < 6 and n > 0 for e, n in flips[L]["flipped_in"] + flips[L]["flipped_out"])


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["free-running", "layer-by-layer"])
def test_against_another_checkpoint_of_the_base_side_b_runs_the_same_adapters(art, layer_by_layer):
    """Side B another checkpoint of the same base (one layer's experts changed, as a quantized release differs) runs
    the same adapters by default: every adapter's rows, as the base's, agree bit for bit up to that layer and part
    there (without their adapters on side B they would part at layer 0)."""
    L = art.rigged_layer
    result = diagnose(art.model, art.adapters, [art.ref_path], options=CPU, samples=1,
                      against_model=art.experts_model, layer_by_layer=layer_by_layer, quiet=True, notice=lambda s: None)
    for tag in ("base", "mine", "emb"):
        entry = result.record["adapters"][tag]
        assert _first(result, tag) == L and entry["trigger"]["trigger"] == "drift", (tag, entry)
        assert all(entry["drift"][str(layer)] == 0 for layer in range(L)), (tag, entry["drift"])
        errors = _errors(result, tag)
        before, at = errors[errors["layer"] < L], errors[errors["layer"] == L].set_index("point")
        assert len(before) and (before["rel_error"] == 0).all() and (before["router_flip_rate"].dropna() == 0).all()
        assert at.loc["attention", "rel_error"] == 0 and at.loc["router", "rel_error"] == 0, (tag, at)
        assert at.loc["moe", "rel_error"] > 0.1 and at.loc["residual", "rel_error"] > 1e-3, (tag, at)
    assert result.record["side_b"]["adapters"] == "same" and result.record["side_b"]["merged_adapter"] is None


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["free-running", "layer-by-layer"])
def test_against_a_merged_checkpoint_side_b_runs_without_adapters(art, layer_by_layer):
    """`--against-adapters none`: side B is `mine` merged into the weights (PEFT's merge_and_unload), run without
    adapters. `mine`'s rows on the engine compute W x + s B (A x), side B (W + s B A) x: equal within float32 rounding,
    so no divergent layer; with one layer's experts changed in the merged checkpoint, that layer. The reference's base
    and `emb` rows are left out: the merged model computes neither."""
    kwargs = dict(options=CPU, samples=SAMPLES, against_adapters="none", layer_by_layer=layer_by_layer, quiet=True,
                  notice=lambda s: None)
    result = diagnose(art.model, {"mine": art.mine}, [art.ref_path], against_model=art.merged_model, **kwargs)
    side_b = result.record["side_b"]
    assert side_b["adapters"] == "none" and side_b["merged_adapter"] == "mine"
    assert f"({2 * PER_TAG} left out)" in side_b["note"]
    assert list(result.record["adapters"]) == ["mine"] and set(result.layers["adapter"]) == {"mine"}
    assert _first(result, "mine") is None, result.record["adapters"]["mine"]
    mine = _errors(result, "mine")
    assert set(mine["layer"]) == set(range(LAYERS))
    assert (mine["rel_error"] < 1e-5).all() and (mine["rel_error"] > 0).any(), mine  # rounding, not 0 and not more
    assert (mine["router_flip_rate"].dropna() == 0).all()

    L = art.rigged_layer
    rigged = diagnose(art.model, {"mine": art.mine}, [art.ref_path], against_model=art.merged_experts_model, **kwargs)
    assert _first(rigged, "mine") == L, rigged.record["adapters"]["mine"]
    mine = _errors(rigged, "mine")
    at = mine[mine["layer"] == L].set_index("point")
    assert (mine[mine["layer"] < L]["rel_error"] < 1e-5).all() and at.loc["attention", "rel_error"] < 1e-5
    assert at.loc["moe", "rel_error"] > 0.1 and at.loc["residual", "rel_error"] > 1e-3


def test_cli_records_which_adapters_side_b_ran_and_refuses_what_cannot_work(art, tmp_path, monkeypatch):
    """run.json (arguments, resolved, fingerprint), diagnose.json, .md, .html and the terminal say which side B ran;
    a bad value or combination, and adapters that do not fit --against-model's shapes, exit 2 with one line before
    any model loads."""
    L = art.rigged_layer
    common = ["diagnose", "--model", art.model, "--samples", 1, "--device", "cpu", "--quiet"]
    ref = ["--reference", art.ref_path]
    runs = {"same": (art.experts_model, ["--adapter", f"mine={art.mine}", "--adapter", f"emb={art.emb}"]),
            "none": (art.merged_model, ["--adapter", f"mine={art.mine}", "--against-adapters", "none"])}
    for choice, (against, extra) in runs.items():  # "same" as the default: not given
        out = tmp_path / choice
        done = run_cli(*common, *ref, "--out", out, "--against-model", against, *extra)
        assert_no_traceback(done)
        assert done.exit_code == 0, (done.stdout, done.stderr, done.exception)
        run = json.loads((out / "run.json").read_text())
        assert run["arguments"]["against_adapters"] == choice and run["resolved"]["against_adapters"] == choice
        assert run["fingerprint"]["options"]["against_adapters"] == choice
        diagnosis = json.loads((out / "diagnose.json").read_text())
        side_b = diagnosis["side_b"]
        assert side_b["adapters"] == choice and side_b["model"] == str(against)
        line = f"`{against}`, float32 on cpu, torch backend, {side_b['note']}."
        assert line in (out / "diagnose.md").read_text() and html.escape(line) in (out / "diagnose.html").read_text()
        assert side_b["note"] in done.stdout
        firsts = {tag: entry["first_divergent_layer"] for tag, entry in diagnosis["adapters"].items()}
        if choice == "same":
            assert side_b["merged_adapter"] is None and side_b["note"].startswith("with the same adapters as side A")
            assert firsts == {"base": L, "mine": L, "emb": L}
        else:
            assert side_b["merged_adapter"] == "mine" and side_b["note"].startswith("without adapters")
            assert firsts == {"mine": None}

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before its inputs were checked")

    monkeypatch.setattr(Engine, "load", no_load)
    monkeypatch.setattr(LayerLoader, "load", no_load)
    wider = save_random_model(tmp_path / "wider", "qwen3_moe", seed=1, num_hidden_layers=LAYERS,
                              **dict(MOE_OVERRIDES, moe_intermediate_size=12))  # only the experts' width differs
    out = tmp_path / "refused"
    mine = ["--adapter", f"mine={art.mine}"]
    for bad, needles in (
            ([*ref, "--against-model", art.merged_model, *mine, "--against-adapters", "merged"],
             ["--against-adapters", "'merged'", "'same'", "'none'"]),
            ([*ref, *mine, "--against-adapters", "none"], ["--against-adapters", "needs --against-model"]),
            ([*ref, "--against-model", art.merged_model, *mine, "--adapter", f"emb={art.emb}", "--against-adapters",
              "none"], ["--against-adapters", "exactly that one --adapter (given: mine, emb)"]),
            (["--reference", art.base_ref, "--against-model", art.merged_model, *mine, "--against-adapters", "none"],
             [str(art.base_ref), "no sample runs under adapter 'mine'", "the dumps name: base"]),
            ([*ref, "--against-model", wider, *mine, "--adapter", f"emb={art.emb}"],
             [str(art.mine / "adapter_model.safetensors"), "mlp.experts", f"on --against-model {wider}"])):
        assert_input_error(run_cli(*common, "--out", out, *bad), *needles)
        assert not out.exists() and not out.with_name("refused.partial").exists()
    with pytest.raises(InputError, match="--against-adapters: 'merged' is not one of same, none"):
        diagnose(art.model, {"mine": art.mine}, [art.ref_path], against_model=art.merged_model,
                 against_adapters="merged", quiet=True)


# ---- 2. bf16 against float32 -------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["free-running", "layer-by-layer"])
def test_bf16_against_float32_has_errors_but_no_divergence(art, layer_by_layer):
    result = diagnose(art.model, art.adapters, [art.ref_path], options=BF16, samples=SAMPLES,
                      against_dtype="float32", layer_by_layer=layer_by_layer, quiet=True, notice=lambda s: None)
    assert result.record["rule"]["floor"] == noise_floor("bfloat16", "float32")
    for adapter in ("base", "mine", "emb"):
        assert _first(result, adapter) is None, result.record["adapters"][adapter]
        errors = _errors(result, adapter)
        assert len(errors) and (errors["rel_error"] > 0).all(), errors
        assert set(errors["layer"]) == set(range(LAYERS))
        drift = result.record["adapters"][adapter]["drift"]
        assert 1e-4 < min(drift.values()) and max(drift.values()) < result.record["rule"]["floor"]
        if not layer_by_layer:  # rounding errors accumulate through the layers
            assert drift[str(LAYERS - 1)] > drift["0"]


# ---- 3. the adapters' effect per module --------------------------------------------------------------------


def test_lora_rel_effect_is_zero_exactly_where_the_adapter_changes_nothing(art):
    result = diagnose(art.model, art.adapters, [art.ref_path], options=CPU, samples=SAMPLES, quiet=True,
                      notice=lambda s: None)
    assert all(_first(result, a) is None for a in ("base", "mine", "emb"))  # the same computation on both sides
    assert (result.layers["rel_error"] == 0).all()
    modules = result.modules
    mine = modules[modules["adapter"] == "mine"]
    zero = mine[mine["module"] == "self_attn.v_proj"]
    assert sorted(zero["layer"]) == list(range(LAYERS)) and len(art.zeroed) == LAYERS
    assert (zero["lora_rel_effect"] == 0).all()
    rest = mine[mine["module"] != "self_attn.v_proj"]
    assert (rest["lora_rel_effect"] > 0.01).all(), rest
    assert {m for m in rest["module"]} == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate",
                                           "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    emb = modules[modules["adapter"] == "emb"]
    assert (emb["lora_rel_effect"] > 0.01).all(), emb
    assert set(emb["module"]) == {"model.embed_tokens", "lm_head", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    for adapter in read_adapters(art.model, art.adapters):  # one row for every module the adapter targets
        targeted = {*adapter.dense, *adapter.embedding, *adapter.overrides}
        targeted |= {f"{site}.{part}_proj" for site, f in adapter.experts.items() for part in ("gate_up", "down")
                     if getattr(f, part) is not None}
        rows = modules[modules["adapter"] == adapter.name]
        found = {site if pd.isna(layer) else f"model.layers.{int(layer)}.{site}"
                 for layer, site in zip(rows["layer"], rows["module"])}
        assert found == targeted


# ---- 4. which samples ----------------------------------------------------------------------------------------


def test_the_samples_are_those_with_the_largest_k2_per_adapter(art):
    tags = [a if isinstance(a, str) else None for a in art.ref["adapter"]]
    logprobs = Engine.load(art.model, art.adapters, CPU).logprobs(Batch(list(art.ref["input_ids"]), tags))
    stored = read_reference(art.ref_path)["logprobs"]  # float32, as written
    k2 = [token_metrics(np.asarray(ref, dtype=np.float64) - lp.numpy().astype(np.float64))["k2"]
          for ref, lp in zip(stored, logprobs)]
    result = diagnose(art.model, art.adapters, [art.ref_path], options=CPU, samples=SAMPLES, quiet=True,
                      notice=lambda s: None)
    for tag in ("base", "mine", "emb"):
        theirs = [i for i, t in enumerate(tags) if (t or "base") == tag]
        best = sorted(theirs, key=lambda i: -k2[i])[:SAMPLES]
        chosen = result.record["adapters"][tag]["samples"]
        assert [c["sample_id"] for c in chosen] == [art.ref["sample_id"][i] for i in best]
        assert [c["k2"] for c in chosen] == pytest.approx([k2[i] for i in best], rel=1e-12)
        assert [c["tokens"] for c in chosen] == [len(art.ref["input_ids"][i]) for i in best]


# ---- 5. the command line -------------------------------------------------------------------------------------


def test_cli_writes_the_run_folder_reuses_it_and_refuses_bad_input(art, tmp_path):
    out = tmp_path / "run"
    args = ["diagnose", "--model", art.model, "--adapter", f"mine={art.mine}", "--adapter", f"emb={art.emb}",
            "--reference", art.ref_path, "--out", out, "--samples", 1, "--device", "cpu", "--dtype", "bfloat16",
            "--quiet"]
    first = run_cli(*args)
    assert_no_traceback(first)
    assert first.exit_code == 0, (first.stdout, first.stderr, first.exception)
    assert "first_divergent_layer" in first.stdout and "diagnose.html" in first.stdout
    assert_phases(first, out, ["read", "load", "k2", "compare", "effects", "metrics", "write"])
    assert sorted(p.name for p in out.iterdir()) == ["diagnose.html", "diagnose.json", "diagnose.md", "layers.csv",
                                                     "modules.csv", "run.json"]
    assert not out.with_name("run.partial").exists() and not out.with_name("run.lock").exists()
    layers, modules = pd.read_csv(out / "layers.csv"), pd.read_csv(out / "modules.csv")
    assert list(layers.columns) == ["adapter", "layer", "point", "rel_error", "router_flip_rate"]
    assert list(modules.columns) == ["adapter", "layer", "module", "lora_rel_effect"]
    assert set(layers["point"]) == {"attention", "router", "moe", "residual"}
    assert layers[layers["point"] != "router"]["router_flip_rate"].isna().all()
    assert layers[layers["point"] == "router"]["router_flip_rate"].notna().all()
    assert list(pd.unique(layers["adapter"])) == ["base", "mine", "emb"]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["command"] == "diagnose" and run["completed"]["exit_code"] == 0
    diagnosis = json.loads((out / "diagnose.json").read_text())
    assert diagnosis["measured"] == "free-running" and set(diagnosis["adapters"]) == {"base", "mine", "emb"}
    assert all("first_divergent_layer" in entry for entry in diagnosis["adapters"].values())
    page = (out / "diagnose.html").read_text()
    assert page.count("</svg>") == 3 and "<script" not in page  # a figure per adapter, inline
    assert "http" not in page  # nothing fetched from elsewhere (the inline figures need no XML namespace)
    assert "First divergent layer" in (out / "diagnose.md").read_text()
    saved = read_diagnose(out)
    pd.testing.assert_frame_equal(saved.layers, layers, check_dtype=False)
    assert saved.record == diagnosis and saved.run == run
    for name, data in diagnose_report_files(saved).items():  # the reports come from the saved files alone
        assert data == (out / name).read_bytes(), name
    for fmt, name in (("html", "diagnose.html"), ("md", "diagnose.md")):  # lora-eval report renders them too
        rendered = run_cli("report", out, "--format", fmt)
        assert rendered.exit_code == 0 and rendered.stdout_bytes == (out / name).read_bytes(), (fmt, rendered.stderr)

    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    again = run_cli(*args)
    assert again.exit_code == 0, (again.stdout, again.stderr)
    assert "holds this run already" in again.stderr and "first_divergent_layer" in again.stdout
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before

    helped = run_cli("diagnose", "--help")
    text = " ".join(helped.stdout.split())
    assert helped.exit_code == 0 and "Exit codes: 0 pass" in text
    assert text.split("Examples:")[1].count("lora-eval ") == 4

    missing = tmp_path / "missing.parquet"
    bad = [{art.ref_path: missing, out: tmp_path / "other"}.get(a, a) for a in args]
    assert_input_error(run_cli(*bad), str(missing), "not found")
    assert not (tmp_path / "other").exists()


def test_a_killed_run_resumes_to_the_same_files(art, tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_EVAL_PART_ITEMS", "1")  # a part after every unit of work
    kwargs = dict(options=CPU, samples=SAMPLES, layer_by_layer=True, quiet=True, notice=lambda s: None)
    whole = tmp_path / "whole"
    diagnose(art.model, art.adapters, [art.ref_path], out=whole, **kwargs)
    task = importlib.import_module("lora_eval.tasks.diagnose.task")
    effects, calls = task._effects, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return effects(*args)

    monkeypatch.setattr(task, "_effects", failing)
    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="killed"):
        diagnose(art.model, art.adapters, [art.ref_path], out=out, **kwargs)
    assert not out.exists() and len(list(out.with_name("resumed.partial").glob("parts/*.parquet"))) > 3
    monkeypatch.setattr(task, "_effects", effects)
    said = []
    diagnose(art.model, art.adapters, [art.ref_path], out=out, **{**kwargs, "notice": said.append})
    assert any(line.startswith("resuming:") for line in said)
    for name in ("layers.csv", "modules.csv", "diagnose.json", "diagnose.md"):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


# ---- 6. the probe, one layer at a time, and the rule ---------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_layer_at_a_time_equals_the_whole_model_in_every_family(family, tmp_path, seed):
    """Layer i alone (only its weights read, through the family's loader) on the whole model's input to it gives the
    whole model's numbers at every point, bit for bit: layer by layer measures each layer's own error."""
    model_dir = save_random_model(tmp_path, family, seed=seed)
    ids = random_sequences(1, VOCAB, seed=seed + 1, min_len=6, max_len=12)[0]
    whole = {}
    fwd = Forward("torch", [len(ids)])
    fwd.probe = lambda i, p, t: whole.setdefault((i, p), t.clone())
    with torch.inference_mode():
        load_model(model_dir)(torch.tensor([ids]), fwd)
    loader = LayerLoader(model_dir, torch.float32, "cpu")
    for layer in range(loader.num_layers):
        one, alone = loader.load(layer), {}
        fwd = Forward("torch", [len(ids)])
        fwd.probe = lambda i, p, t: alone.setdefault((i, p), t.clone()) if i == layer else None
        one.run(whole[(layer, "input")], fwd)
        assert alone.keys() == {k for k in whole if k[0] == layer}
        for key, value in alone.items():
            assert torch.equal(value, whole[key]), key
        assert sum(p.numel() for p in one.model.parameters()) < \
            sum(p.numel() for n, p in load_model(model_dir, device="meta").named_parameters()
                if f"layers.{layer}." in n) + 4 * loader.args.hidden_size  # its own weights, and one-row ends





def test_a_probe_sees_every_point_and_changes_nothing(art, seed):
    engine = Engine.load(art.model, art.adapters, CPU)
    ids = random_sequences(1, VOCAB, seed=seed, min_len=9, max_len=20)[0]
    T = len(ids)
    slots = torch.zeros(T, dtype=torch.long)  # adapter 'mine'
    seen = []

    def forward(probe):
        fwd = Forward("torch", [T], engine.stack, slots)
        fwd.probe = probe
        with torch.inference_mode():
            return engine.model(torch.tensor([ids]), fwd)

    plain = forward(None)
    probed = forward(lambda layer, point, t: seen.append((layer, point, tuple(t.shape))))
    assert torch.equal(plain, probed)
    H, E, k = 32, 6, 2
    for layer in range(LAYERS):
        mine = [(p, shape) for i, p, shape in seen if i == layer]
        expected = [("input", (T, H)), ("attention", (T, H))]
        if layer in MOE_LAYERS:
            expected += [("router_logits", (T, E)), ("router_topk", (T, k)), ("moe", (T, H))]
        assert mine == expected + [("residual", (T, H))]


def test_on_the_triton_path_the_probe_changes_nothing_and_sees_the_torch_numbers(art, seed):
    """The fused sums (o_proj + residual, MoE + residual, router LoRA inside the top-k) are observed apart and kept:
    the forward is bit for bit the unprobed one (Triton kernels through the interpreter on the CPU)."""
    ids = random_sequences(1, VOCAB, seed=seed, min_len=6, max_len=12)[0]
    T = len(ids)

    def forward(engine, probe):
        fwd = Forward(engine.backend, [T], engine.stack, torch.zeros(T, dtype=torch.long))  # adapter 'mine'
        fwd.probe = probe
        with torch.inference_mode():
            return engine.model(torch.tensor([ids]), fwd)

    triton, oracle = (Engine.load(art.model, art.adapters, replace(CPU, backend=b)) for b in ("triton", "torch"))
    seen, expected = {}, {}
    # the same rows in the same batch twice: equal on any CPU (the same operations on the same operands)
    assert torch.equal(forward(triton, None), forward(triton, lambda i, p, t: seen.setdefault((i, p), t.clone())))
    forward(oracle, lambda i, p, t: expected.setdefault((i, p), t.clone()))
    assert seen.keys() == expected.keys()
    for (layer, point), want in expected.items():
        got = seen[(layer, point)]
        if point == "router_topk":
            assert torch.equal(got.sort(1).values, want.sort(1).values)
        else:
            assert float((got - want).norm() / want.norm()) < 1e-5, (layer, point)


def test_the_rule_on_known_numbers(seed):
    rng = np.random.default_rng(seed)
    floor = noise_floor("bfloat16", "float32")
    assert floor == 16 * torch.finfo(torch.bfloat16).eps and noise_floor("float32") == 1e-5
    smooth = {i: 0.004 * 1.3 ** i * rng.uniform(0.9, 1.1) for i in range(12)}  # bf16-like growth, under the floor
    assert first_divergence(smooth, {i: 0.02 for i in range(12)}, floor) is None
    step = int(rng.integers(3, 12))
    assert first_divergence(smooth, {}, 1e-5)["layer"] == 0  # under a float32 floor, bf16-sized errors diverge
    big = {i: 0.05 * 1.5 ** i for i in range(12)}  # past the floor: steps of less than FACTOR are growth
    assert first_divergence(big, {}, floor) is None
    big[step] = big[step - 1] * FACTOR * 1.01
    found = first_divergence(big, {}, floor)
    assert found == dict(layer=step, trigger="drift", value=big[step], band=FACTOR * big[step - 1])
    flips = {i: 0.0 for i in range(12)}
    flips[step] = 0.3
    found = first_divergence(smooth, flips, floor)
    assert found["layer"] == step and found["trigger"] == "new_flips"
    assert first_divergence({0: 0.0, 1: 0.0, 2: 2e-5}, {}, 1e-5)["layer"] == 2
