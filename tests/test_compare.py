"""`lora-eval compare` / `dump-reference` / `demo`: engine logprobs against trainer reference dumps.

One module fixture builds a tiny Qwen3-MoE checkpoint (session fixture), two adapters of different kinds
(PEFT `all-linear`, which PEFT loads with experts as target_parameters, and a hand-written Tinker-style
split 3D shared-outer export that PEFT cannot load) and a trainer reference written by `dump_reference`
for base rows and both adapters. Every other input is that reference with one known edit:

1. the demo end to end (console command in-process), its files and run.json;
2. the metric formulas on hand-made differences, and `group_metrics` honouring the mask;
3. a known shift `delta` of one adapter's reference: k2 = delta^2/2, k1 = -delta, exit 1 naming it;
4. batching: --batch-tokens 64 vs 4096 give the same numbers (within float32 noise), `make_batches`;
5. formats: Parquet, JSONL and .pt (NAME=FILE.pt) give the same engine numbers; sampler_* twins;
6. masks: only masked positions count (checked by hand against tokens.parquet);
7. bad input: exit 2 and one `error: <file>: <key>: <problem>` line, pickles never executed;
8. the Python API equals what the CLI writes;
9. the trainer side itself: `dump_reference` equals the PEFT oracle and the merged-weights oracle.

Seeds are fresh every run (the `seed` / `session_seed` fixtures print them) so a failure can be replayed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from lora_eval.engine.batching import make_batches, padding_waste
from lora_eval.cli import cli
from lora_eval.tasks.compare import compare
from lora_eval.engine.engine import Engine
from lora_eval.errors import InputError
from lora_eval.results.metrics import FRACTION_THRESHOLDS, group_metrics, token_metrics
from lora_eval.inputs.references import read_reference, write_reference
from lora_eval.results.tables import COMPARE_SUMMARY_COLUMNS as SUMMARY_COLUMNS
from lora_eval.tasks.dump_reference import dump_reference
from tests.builders import hf_logprobs, load_hf, peft_oracle, random_sequences, save_random_peft_adapter, \
    write_expert_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback, assert_phases

VOCAB = 96  # tests.builders' tiny vocabulary
ADAPTERS = ("peft", "split")  # sorted: dump_reference runs the PEFT adapter first, then unloads it
SAMPLES_PER_TAG = 5
ORACLE_TOL = 1e-5  # trainer reference vs an independent float32 oracle
DEFAULT_MAX_K2 = 5e-3
METRIC_COLUMNS = ["mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error"] + \
    [f"frac_gt_{t:g}" for t in FRACTION_THRESHOLDS]


# ---- helpers ---------------------------------------------------------------------------------------------


class Artefacts:
    """The good inputs every test copies and edits."""


def run_cli(*args: str):
    """`lora-eval ARGS` in-process; stdout and stderr kept apart (click >= 8.2)."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def compare_cli(art, references, out, *extra, adapters=None):
    adapters = art.adapters if adapters is None else adapters
    args = ["compare", "--model", art.model, "--out", out, "--quiet"]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    for ref in references:
        args += ["--reference", f"{ref[0]}={ref[1]}" if isinstance(ref, tuple) else ref]
    return run_cli(*args, *extra)




def read_summary(path: Path) -> pd.DataFrame:
    frame = pd.read_csv(path, dtype={"failed": str})  # pandas 3 parses floats round-trip exactly
    return frame.assign(failed=frame["failed"].fillna(""))


def by_adapter(summary: pd.DataFrame) -> pd.DataFrame:
    return summary.set_index("adapter")


def tag_of(adapter) -> str:
    return adapter if isinstance(adapter, str) else "base"


def numpy_metrics(d) -> dict[str, float]:
    """The DESIGN.md formulas written out directly in numpy."""
    d = np.asarray(d, dtype=np.float64)
    a = np.abs(d)
    out = dict(mean_abs_diff=np.mean(a), max_abs_diff=np.max(a), k1=np.mean(-d), k2=np.mean(d ** 2 / 2),
               k3=np.mean(np.exp(d) - 1 - d), mult_prob_error=np.mean(np.exp(a)))
    out.update({f"frac_gt_{t:g}": np.mean(a > t) for t in FRACTION_THRESHOLDS})
    return {k: float(v) for k, v in out.items()}


def sorted_tokens(tokens: pd.DataFrame) -> pd.DataFrame:
    return tokens.sort_values(["sample_id", "position"]).reset_index(drop=True)


def shifted(frame: pd.DataFrame, adapter: str, delta: float) -> pd.DataFrame:
    """The reference with every logprob of `adapter`'s samples moved by `delta`."""
    frame = frame.copy()
    frame["logprobs"] = [list(np.asarray(lp) + delta) if a == adapter else lp
                         for lp, a in zip(frame["logprobs"], frame["adapter"])]
    return frame


# ---- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("compare")
    s = session_seed
    a = Artefacts()
    a.root, a.model = root, moe_model
    a.peft = save_random_peft_adapter(moe_model, root / "peft", seed=s + 101, r=4, lora_alpha=8,
                                      target_modules="all-linear")
    a.split_oracle = write_expert_adapter(moe_model, root / "split", layout="split_3d", shared_outer=True,
                                          seed=s + 102, rank=4, alpha=6)
    a.adapters = {"peft": a.peft, "split": a.split_oracle.adapter_dir}

    # prompts as input_ids, the tags shuffled so adapters interleave in the file
    tags = [None, *ADAPTERS] * SAMPLES_PER_TAG
    generator = torch.Generator().manual_seed(s + 103)
    tags = [tags[i] for i in torch.randperm(len(tags), generator=generator)]
    sequences = random_sequences(len(tags), VOCAB, seed=s + 104, min_len=5, max_len=24)
    a.prompts = root / "prompts.jsonl"
    a.prompts.write_text("".join(json.dumps(dict(sample_id=f"{tag_of(t)}-{i}", adapter=t, input_ids=ids)) + "\n"
                                 for i, (t, ids) in enumerate(zip(tags, sequences))))
    a.ref_path = root / "reference.parquet"
    dump_reference(moe_model, a.adapters, a.prompts, a.ref_path, quiet=True)
    a.ref = read_reference(a.ref_path)
    a.baseline = compare(moe_model, a.adapters, [a.ref_path], out=root / "baseline", quiet=True)

    # one adapter's reference moved by a known delta (large enough to cross the default k2 threshold)
    rng = np.random.default_rng(s + 105)
    a.shift_adapter = str(rng.choice(ADAPTERS))
    a.delta = float(rng.choice([-1, 1]) * rng.uniform(0.12, 0.3))
    a.shift_path = write_reference(shifted(a.ref, a.shift_adapter, a.delta), root / "shifted.parquet")
    return a


# ---- 1. demo ---------------------------------------------------------------------------------------------


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    # the demo's CPU time (it runs in this process, one thread), not the wall clock: on a machine shared with other
    # jobs the wall clock measures them too (the demo took 3.0 s of CPU, 3.0 s wall when idle, on a 2-core Xeon)
    t0 = time.process_time()
    result = run_cli("demo", "--out", out, "--quiet")
    elapsed = time.process_time() - t0
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert elapsed < 60, f"demo took {elapsed:.1f} s of CPU"

    report = out / "report"
    for name in ("summary.csv", "samples.csv", "tokens.parquet", "report.md", "run.json"):
        assert (report / name).is_file(), name
    summary = read_summary(report / "summary.csv")
    assert list(summary.columns[:len(SUMMARY_COLUMNS)]) == [
        "adapter", "n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3",
        "mult_prob_error", "passed"]
    assert list(summary["adapter"]) == ["base", "peft-all-linear", "tinker-shared-outer", "overall"]
    assert (summary["k2"] < 1e-8).all(), summary[["adapter", "k2"]]
    assert summary["passed"].all()
    rows = by_adapter(summary)
    assert rows.loc["overall", "n_tokens"] == rows.drop("overall")["n_tokens"].sum()
    assert rows.loc["overall", "n_samples"] == rows.drop("overall")["n_samples"].sum()
    assert "PASSED" in (report / "report.md").read_text()

    run = json.loads((report / "run.json").read_text())
    reference = out / "reference.parquet"
    assert run["arguments"]["references"] == [str(reference)]
    assert run["resolved"] == dict(device="cpu", dtype="float32", ranks=1, batch_invariant=False)
    assert run["arguments"]["batch_tokens"] == 4096
    assert set(run["arguments"]["adapters"]) == {"peft-all-linear", "tinker-shared-outer"}
    assert {"lora-eval", "torch", "transformers", "peft", "python"} <= set(run["fingerprint"]["versions"])
    assert run["fingerprint"]["versions"]["torch"] == torch.__version__
    assert_phases(result, report, ["read", "load", "compile", "forward", "metrics", "write"])
    assert run["timings"]["compile_s"] == 0  # no CUDA graphs on the CPU
    for name in ("report.md", "report.html"):  # the reports show the phases known when they were rendered
        text = (report / name).read_text()
        assert "forward_s" in text and "metrics_s" in text and "write_s" not in text and "total_s" not in text
    assert run["status"] == "complete" and run["completed"]["exit_code"] == 0
    assert run["fingerprint"]["files"]["reference 0/reference.parquet"] == \
        "sha256:" + hashlib.sha256(reference.read_bytes()).hexdigest()
    assert run["fingerprint"]["options"]["device"] == "cpu"


# ---- 2. metric formulas ----------------------------------------------------------------------------------


def test_token_metrics_on_known_numbers(seed):
    d = np.array([0.5, -0.25, 0.0, 2.0, -1.5, 0.005, -0.02, 0.2])
    m = token_metrics(d)
    assert m["mean_abs_diff"] == pytest.approx(4.475 / 8, rel=1e-12)
    assert m["max_abs_diff"] == 2.0
    assert m["k1"] == pytest.approx(-0.935 / 8, rel=1e-12)
    assert m["k2"] == pytest.approx(np.sum(d ** 2) / 16, rel=1e-12)
    assert m["frac_gt_0.01"] == 6 / 8 and m["frac_gt_0.1"] == 5 / 8 and m["frac_gt_1"] == 2 / 8
    for name, value in numpy_metrics(d).items():
        assert m[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    assert m["k3"] > 0 and m["mult_prob_error"] > 1

    random_d = np.random.default_rng(seed).normal(0, 0.3, size=257)
    for name, value in numpy_metrics(random_d).items():
        assert token_metrics(random_d)[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    assert all(np.isnan(v) for v in token_metrics(np.array([])).values())


def test_group_metrics_respects_mask(seed):
    rng = np.random.default_rng(seed)
    n = 60
    tokens = pd.DataFrame(dict(adapter=rng.choice(["a", "b", "base"], n), sample_id=rng.choice(list("pqrstu"), n),
                               d=rng.normal(0, 0.2, n), mask=rng.random(n) < 0.6))
    tokens.loc[~tokens["mask"], "d"] = 50.0  # would dominate every metric if counted
    per_adapter = group_metrics(tokens, ["adapter"]).set_index("adapter")
    for adapter, group in tokens[tokens["mask"]].groupby("adapter"):
        row = per_adapter.loc[adapter]
        assert row["n_tokens"] == len(group) and row["n_samples"] == group["sample_id"].nunique()
        for name, value in numpy_metrics(group["d"]).items():
            assert row[name] == pytest.approx(value, rel=1e-12, abs=1e-15), (adapter, name)
    overall = group_metrics(tokens, []).iloc[0]
    assert overall["n_tokens"] == tokens["mask"].sum()
    assert overall["max_abs_diff"] < 50
    assert overall["k2"] == pytest.approx(numpy_metrics(tokens.loc[tokens["mask"], "d"])["k2"], rel=1e-12)
    assert not any(c.startswith("sampler_") for c in overall.index)  # no sampler_d column, no twins


# ---- 3. a known shift ------------------------------------------------------------------------------------


def test_known_shift_cli(art, tmp_path):
    name, delta = art.shift_adapter, art.delta
    result = compare_cli(art, [art.shift_path], tmp_path / "run")
    assert_no_traceback(result)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)

    summary = read_summary(tmp_path / "run" / "summary.csv")
    rows = by_adapter(summary)
    assert rows.loc[name, "k2"] == pytest.approx(delta ** 2 / 2, rel=1e-3)
    assert rows.loc[name, "k1"] == pytest.approx(-delta, rel=1e-3)
    assert rows.loc[name, "mean_abs_diff"] == pytest.approx(abs(delta), rel=1e-3)
    assert rows.loc[name, "k3"] == pytest.approx(np.expm1(delta) - delta, rel=1e-3)
    assert rows.loc[name, "mult_prob_error"] == pytest.approx(np.exp(abs(delta)), rel=1e-4)
    assert rows.loc[name, "frac_gt_0.1"] == 1.0 and rows.loc[name, "frac_gt_1"] == 0.0
    assert not rows.loc[name, "passed"] and rows.loc[name, "failed"] == f"k2 > {DEFAULT_MAX_K2:g}"
    others = [a for a in ("base", *ADAPTERS) if a != name]
    assert rows.loc[others, "passed"].all() and (rows.loc[others, "k2"] < 1e-10).all()
    share = rows.loc[name, "n_tokens"] / rows.loc["overall", "n_tokens"]
    assert rows.loc["overall", "k2"] == pytest.approx(share * delta ** 2 / 2, rel=1e-3)
    overall_fails = rows.loc["overall", "k2"] > DEFAULT_MAX_K2
    assert rows.loc["overall", "passed"] == (not overall_fails)

    table = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "FAIL" in table[name].split() and f"k2 > {DEFAULT_MAX_K2:g}" in table[name]
    for other in others:
        assert "PASS" in table[other].split(), table[other]
    failed_lines = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed_lines) == 1, result.stderr
    named = {entry.split(" (")[0] for entry in failed_lines[0].removeprefix("FAILED: ").split("; ")}
    assert named == {name} | ({"overall"} if overall_fails else set())


def test_known_shift_mean_abs_diff_threshold(art, tmp_path):
    name, delta = art.shift_adapter, art.delta
    limit = abs(delta) / 2
    result = compare_cli(art, [art.shift_path], tmp_path / "run", "--max-mean-abs-diff", str(limit))
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    rows = by_adapter(read_summary(tmp_path / "run" / "summary.csv"))
    assert rows.loc[name, "failed"] == f"k2 > {DEFAULT_MAX_K2:g}; mean_abs_diff > {limit:g}"
    assert rows.loc[[a for a in ("base", *ADAPTERS) if a != name], "passed"].all()
    assert f"mean_abs_diff > {limit:g}" in result.stderr and name in result.stderr

    # the mean |d| threshold alone (no k2 threshold) fails the same adapter and only it
    api = by_adapter(compare(art.model, art.adapters, [art.shift_path], max_k2=None, max_mean_abs_diff=limit,
                             quiet=True).summary)
    assert api.loc[name, "failed"] == f"mean_abs_diff > {limit:g}"
    assert set(api.index[~api["passed"]]) - {"overall"} == {name}


# ---- 4. batching -----------------------------------------------------------------------------------------


def test_batch_tokens_does_not_change_the_numbers(art, tmp_path):
    """The CPU path is batch-invariant (fixed-size GEMM blocks, attention per row): --batch-tokens 64 and
    4096 give bitwise-equal per-token logprobs and therefore identical metrics."""
    lengths = [len(ids) for ids in art.ref["input_ids"]]
    cli_result = compare_cli(art, [art.shift_path], tmp_path / "run", "--batch-tokens", "64")
    assert cli_result.exit_code == 1, (cli_result.stdout, cli_result.stderr, cli_result.exception)  # the shift
    run64 = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run64["arguments"]["batch_tokens"] == 64
    assert run64["batches"] == len(make_batches(lengths, 64)) > 1
    assert run64["padding_waste"] == pytest.approx(padding_waste(lengths, make_batches(lengths, 64)))
    large = compare(art.model, art.adapters, [art.shift_path], batch_tokens=4096, quiet=True)
    assert large.run["batches"] == 1
    large_summary = large.summary

    small = sorted_tokens(pd.read_parquet(tmp_path / "run" / "tokens.parquet"))
    large = sorted_tokens(large.tokens)
    same = ["sample_id", "adapter", "position", "token_id", "ref", "mask", "engine", "d"]
    pd.testing.assert_frame_equal(small[same], large[same], check_exact=True, check_dtype=False)

    s64, s4096 = by_adapter(read_summary(tmp_path / "run" / "summary.csv")), by_adapter(large_summary)
    columns = ["n_samples", "n_tokens", "passed", "failed", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3",
               "mult_prob_error"]
    pd.testing.assert_frame_equal(s64[columns], s4096[columns], check_exact=True, check_dtype=False)


def test_make_batches_respects_budget_and_covers_every_index(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        lengths = [int(x) for x in rng.integers(1, 120, size=int(rng.integers(0, 60)))]
        budget = int(rng.integers(1, 600))
        batches = make_batches(lengths, budget)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        for b in batches:
            assert b, batches
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget, (lengths, budget, b)
        assert make_batches(lengths, budget) == batches  # deterministic
    assert make_batches([3, 3, 3, 3], 12) == [[0, 1, 2, 3]]
    assert make_batches([50, 5], 10) == [[1], [0]]  # longer than the budget: alone
    with pytest.raises(ValueError):
        make_batches([3], 0)


# ---- 5. formats ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_sampler(art, session_seed):
    """The reference with sampler logprobs (reference + noise), as Parquet, JSONL and one .pt per adapter."""
    rng = np.random.default_rng(session_seed + 201)
    frame = art.ref.copy()
    frame["sampler_logprobs"] = [np.float32(np.asarray(lp) + rng.normal(0, 0.03, len(lp))).astype(float).tolist()
                                 for lp in frame["logprobs"]]
    root = art.root / "formats"
    root.mkdir()
    paths = dict(parquet=write_reference(frame, root / "ref.parquet"), jsonl=root / "ref.jsonl")
    paths["jsonl"].write_text("".join(json.dumps(dict(sample_id=r.sample_id, adapter=r.adapter,
                                                      input_ids=list(r.input_ids), logprobs=list(r.logprobs),
                                                      sampler_logprobs=list(r.sampler_logprobs))) + "\n"
                                      for r in frame.itertuples()))
    pt_refs, pt_ids = [], {}  # (name, path) pairs; .pt sample id -> original sample id
    for tag in ("base", *ADAPTERS):
        rows = frame[[tag_of(a) == tag for a in frame["adapter"]]]
        path = root / f"{tag}.pt"
        torch.save(dict(tokens=[list(ids) for ids in rows["input_ids"]],
                        training_logprobs=[list(lp) for lp in rows["logprobs"]],
                        sampling_logprobs=[list(lp) for lp in rows["sampler_logprobs"]]), path)
        pt_refs.append((tag, path))
        pt_ids.update({f"{path}:{j}": sid for j, sid in enumerate(rows["sample_id"])})
    return frame, paths, pt_refs, pt_ids


def test_formats_give_the_same_numbers(art, with_sampler, tmp_path):
    frame, paths, pt_refs, pt_ids = with_sampler
    # batch_tokens=1: every sample runs alone, so the engine numbers cannot depend on file order
    results = {fmt: compare(art.model, art.adapters, [path], batch_tokens=1, quiet=True)
               for fmt, path in paths.items()}
    results["pt"] = compare(art.model, art.adapters, pt_refs, batch_tokens=1, quiet=True)
    cli_result = compare_cli(art, pt_refs, tmp_path / "cli", "--batch-tokens", "1")
    assert cli_result.exit_code == 0, (cli_result.stdout, cli_result.stderr, cli_result.exception)
    cli_tokens = pd.read_parquet(tmp_path / "cli" / "tokens.parquet")

    tables = {fmt: r.tokens for fmt, r in results.items()} | {"pt-cli": cli_tokens}
    for fmt in ("pt", "pt-cli"):
        assert set(tables[fmt]["sample_id"]) == set(pt_ids)
        tables[fmt] = tables[fmt].assign(sample_id=tables[fmt]["sample_id"].map(pt_ids))
    columns = ["sample_id", "adapter", "position", "token_id", "ref", "engine", "sampler", "mask"]
    expected = sorted_tokens(tables["parquet"])[columns]
    assert len(expected) == sum(len(ids) - 1 for ids in frame["input_ids"])
    for fmt, table in tables.items():
        got = sorted_tokens(table)[columns]
        pd.testing.assert_frame_equal(got, expected, check_exact=True, check_dtype=False, obj=fmt)

    parquet_summary = by_adapter(results["parquet"].summary)
    for fmt in ("jsonl", "pt"):  # same numbers, possibly summed in another order
        other = by_adapter(results[fmt].summary).loc[parquet_summary.index]
        for column in parquet_summary.columns.drop(["passed", "failed"]):
            expected_values = parquet_summary[column].to_numpy()
            assert other[column].to_numpy() == pytest.approx(expected_values, rel=1e-9), (fmt, column)


def test_sampler_twins(art, with_sampler):
    frame, paths, _, _ = with_sampler
    summary = by_adapter(compare(art.model, art.adapters, [paths["parquet"]], quiet=True).summary)
    assert {f"sampler_{m}" for m in METRIC_COLUMNS} <= set(summary.columns)
    for adapter in summary.index:
        rows = frame if adapter == "overall" else frame[[tag_of(a) == adapter for a in frame["adapter"]]]
        ref = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in rows["logprobs"]])
        sampler = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in rows["sampler_logprobs"]])
        d = ref - sampler
        assert summary.loc[adapter, "sampler_k2"] == pytest.approx(np.mean(d ** 2 / 2), rel=1e-9)
        for name, value in numpy_metrics(d).items():
            assert summary.loc[adapter, f"sampler_{name}"] == pytest.approx(value, rel=1e-9, abs=1e-15), name
    # without sampler logprobs there are no twins
    assert not any(c.startswith("sampler_") for c in art.baseline.summary.columns)


def test_pt_dict_of_per_sample_tensors(art, tmp_path):
    """Serving-engine dumps often hold ragged samples as lists of 1D tensors; they must read like lists."""
    rows = art.ref[art.ref["adapter"] == "peft"]
    as_lists, as_tensors = tmp_path / "lists.pt", tmp_path / "tensors.pt"
    torch.save(dict(tokens=[list(ids) for ids in rows["input_ids"]],
                    training_logprobs=[list(lp) for lp in rows["logprobs"]]), as_lists)
    torch.save(dict(tokens=[torch.tensor(ids) for ids in rows["input_ids"]],
                    training_logprobs=[torch.tensor(lp) for lp in rows["logprobs"]]), as_tensors)
    expected = read_reference(as_lists, adapter="peft")
    got = read_reference(as_tensors, adapter="peft")
    assert list(got["input_ids"]) == list(expected["input_ids"])
    assert list(got["logprobs"]) == list(expected["logprobs"])



def test_pt_dumps_with_the_same_file_name(art, tmp_path):
    """Serving dumps are often all called e.g. `logprobs.pt`, one folder per adapter; the sample ids that
    lora-eval makes up for them must not collide across files."""
    refs = []
    for tag in ("base", "peft"):
        rows = art.ref[[tag_of(a) == tag for a in art.ref["adapter"]]]
        path = tmp_path / tag / "logprobs.pt"
        path.parent.mkdir()
        torch.save(dict(tokens=[list(ids) for ids in rows["input_ids"]],
                        training_logprobs=[list(lp) for lp in rows["logprobs"]]), path)
        refs.append((tag, path))
    result = compare_cli(art, refs, tmp_path / "run")
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    summary = by_adapter(read_summary(tmp_path / "run" / "summary.csv"))
    assert summary.loc["overall", "n_samples"] == 2 * SAMPLES_PER_TAG

# ---- 6. masks --------------------------------------------------------------------------------------------


def test_mask_last_half(art, tmp_path, seed):
    rng = np.random.default_rng(seed)
    frame = art.ref.copy()
    masks, logprobs = [], []
    for lp in frame["logprobs"]:
        n = len(lp)
        mask = np.arange(n) >= n // 2
        # masked-out positions move by 3 nats (would fail everything if counted), counted ones by small noise
        noise = rng.uniform(-0.05, 0.05, n)
        logprobs.append(list(np.minimum(np.asarray(lp) + np.where(mask, noise, -3.0), 0.0)))
        masks.append(list(mask))
    frame["logprobs"], frame["mask"] = logprobs, masks
    path = write_reference(frame, tmp_path / "masked.parquet")
    result = compare_cli(art, [path], tmp_path / "run")
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)

    summary = by_adapter(read_summary(tmp_path / "run" / "summary.csv"))
    tokens = pd.read_parquet(tmp_path / "run" / "tokens.parquet")
    samples = pd.read_csv(tmp_path / "run" / "samples.csv", dtype={"sample_id": str}).set_index("sample_id")
    assert len(tokens) == sum(len(lp) for lp in frame["logprobs"])  # every token listed, mask column says which count
    for row in frame.itertuples():
        n = len(row.logprobs)
        sample_tokens = tokens[tokens["sample_id"] == row.sample_id].sort_values("position")
        assert list(sample_tokens["mask"]) == row.mask
        assert samples.loc[row.sample_id, "n_tokens"] == n - n // 2
    for adapter in ("base", *ADAPTERS, "overall"):
        rows = frame if adapter == "overall" else frame[[tag_of(a) == adapter for a in frame["adapter"]]]
        assert summary.loc[adapter, "n_tokens"] == sum(len(lp) - len(lp) // 2 for lp in rows["logprobs"])
        counted = tokens[tokens["mask"] & ((tokens["adapter"] == adapter) | (adapter == "overall"))]
        d = counted["ref"].to_numpy() - counted["engine"].to_numpy()
        for name, value in numpy_metrics(d).items():
            assert summary.loc[adapter, name] == pytest.approx(value, rel=1e-9, abs=1e-15), (adapter, name)
        assert summary.loc[adapter, "max_abs_diff"] < 0.051
        assert summary.loc[adapter, "k2"] == pytest.approx(np.mean(d ** 2 / 2), rel=1e-9)
    baseline = by_adapter(art.baseline.summary)
    assert baseline.loc["overall", "n_tokens"] == len(tokens) > summary.loc["overall", "n_tokens"]
    assert summary["passed"].all()


def test_adapter_with_every_token_masked_keeps_its_summary_row(art, tmp_path):
    """'One row per adapter': an adapter none of whose tokens count must not vanish from the report."""
    frame = art.ref.copy()
    frame["mask"] = [[False] * len(lp) if a == "split" else None for lp, a in zip(frame["logprobs"], frame["adapter"])]
    path = write_reference(frame, tmp_path / "all_masked.parquet")
    summary = compare(art.model, art.adapters, [path], quiet=True).summary
    assert set(summary["adapter"]) == {"base", *ADAPTERS, "overall"}, summary[["adapter", "n_tokens", "passed"]]
    assert by_adapter(summary).loc["split", "n_tokens"] == 0


# ---- 7. bad input ----------------------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs code that writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('executed')",)


def _pickled_pt(path: Path, marker: Path) -> Path:
    torch.save(dict(tokens=[[1, 2, 3]], training_logprobs=[[-1.0, -2.0]], extra=_Payload(marker)), path)
    return path


def test_pickled_pt_refused_without_executing(art, tmp_path):
    control_marker = tmp_path / "control_marker"  # the payload is live: an unsafe load runs it
    torch.load(_pickled_pt(tmp_path / "control.pt", control_marker), weights_only=False)
    assert control_marker.read_text() == "executed"

    marker = tmp_path / "marker"
    path = _pickled_pt(tmp_path / "evil.pt", marker)
    line = assert_input_error(compare_cli(art, [("base", path)], tmp_path / "run"), str(path))
    assert "refused" in line
    assert not marker.exists(), "unpickling ran code from the reference file"


def test_token_id_outside_vocabulary(art, tmp_path, seed):
    frame = art.ref.copy()
    row = int(np.random.default_rng(seed).integers(len(frame)))
    sample = frame.loc[row, "sample_id"]
    ids = list(frame.loc[row, "input_ids"])
    ids[-1] = VOCAB
    frame.at[row, "input_ids"] = ids
    path = write_reference(frame, tmp_path / "vocab.parquet")
    assert_input_error(compare_cli(art, [path], tmp_path / "run"), f"{path}: row {row} (sample {sample}): ", str(VOCAB))


def test_logprobs_length_mismatch(art, tmp_path):
    path = tmp_path / "length.jsonl"
    lines = []
    for i, r in enumerate(art.ref.itertuples()):
        logprobs = list(r.logprobs) + ([-1.5] if i == 2 else [])
        lines.append(json.dumps(dict(sample_id=r.sample_id, adapter=r.adapter, input_ids=list(r.input_ids),
                                     logprobs=logprobs)))
    path.write_text("\n".join(lines) + "\n")
    sample = art.ref["sample_id"].iloc[2]
    n = len(art.ref["input_ids"].iloc[2]) - 1
    assert_input_error(compare_cli(art, [path], tmp_path / "run"), f"{path}: line 3 (sample {sample}): ", "logprobs",
                       str(n + 1), str(n))


def test_unknown_adapter_in_reference(art, tmp_path):
    frame = art.ref.copy()
    frame.loc[frame.index[-1], "adapter"] = "ghost"
    path = write_reference(frame, tmp_path / "ghost.parquet")
    line = assert_input_error(compare_cli(art, [path], tmp_path / "run"), str(path), "'ghost'")
    assert "known adapters: peft, split" in line


def test_unknown_adapter_in_prompts(art, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(art.prompts.read_text() + json.dumps(dict(sample_id="x", adapter="ghost",
                                                                  input_ids=[1, 2, 3])) + "\n")
    args = ["dump-reference", "--model", art.model, "--prompts", prompts, "--out", tmp_path / "ref.parquet", "--quiet"]
    for name, path in art.adapters.items():
        args += ["--adapter", f"{name}={path}"]
    line = assert_input_error(run_cli(*args), str(prompts), "'ghost'")
    assert "peft, split" in line
    assert not (tmp_path / "ref.parquet").exists()


def test_pt_without_name(art, tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(dict(tokens=[[1, 2, 3]], training_logprobs=[[-1.0, -2.0]]), path)
    assert_input_error(compare_cli(art, [path], tmp_path / "run"), str(path), "NAME=")


@pytest.mark.parametrize("reserved", ["base", "overall"])
def test_reserved_adapter_name(art, tmp_path, reserved):
    adapters = {reserved: art.peft}
    assert_input_error(compare_cli(art, [art.ref_path], tmp_path / "run", adapters=adapters), "--adapter",
                       f"'{reserved}'", "reserved")
    with pytest.raises(InputError, match=f"'{reserved}' is reserved"):
        compare(art.model, adapters, [art.ref_path], quiet=True)
    assert not (tmp_path / "run").exists()


# ---- 8. API equals CLI -----------------------------------------------------------------------------------


def test_api_equals_cli(art, tmp_path):
    result = compare_cli(art, [art.ref_path], tmp_path / "run")
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    written = read_summary(tmp_path / "run" / "summary.csv")
    api = art.baseline.summary.reset_index(drop=True)
    assert list(written.columns) == list(api.columns)
    assert set(written["adapter"]) == {"base", *ADAPTERS, "overall"} and written["adapter"].iloc[-1] == "overall"
    for column in api.columns:
        if column in ("adapter", "failed"):
            assert list(written[column]) == list(api[column]), column
        else:  # float repr round-trips, and the engine is deterministic for the same batches
            np.testing.assert_array_equal(written[column].to_numpy(), api[column].to_numpy(), err_msg=column)
    samples = pd.read_csv(tmp_path / "run" / "samples.csv", dtype={"sample_id": str})
    np.testing.assert_array_equal(samples["k2"].to_numpy(), art.baseline.samples["k2"].to_numpy())
    # the baseline (trainer vs engine on the same weights) passes, at float32 noise
    assert art.baseline.passed and (api["max_abs_diff"] < 1e-4).all() and (api["k2"] < 1e-9).all()


# ---- 9. the trainer side ---------------------------------------------------------------------------------


def test_dump_reference_matches_independent_oracles(art):
    """dump_reference's numbers against oracles built without lora_eval: PEFT's own model for the PEFT
    adapter, the base model with the deltas merged for the hand-written split 3D export. 'peft' sorts before
    'split', so the split rows are computed after the PEFT adapter was loaded and unloaded again."""
    oracles = {"base": load_hf(art.model), "peft": peft_oracle(art.model, art.peft), "split": art.split_oracle.model}
    base = oracles["base"]
    for tag, oracle in oracles.items():
        rows = art.ref[[tag_of(a) == tag for a in art.ref["adapter"]]]
        assert len(rows) == SAMPLES_PER_TAG
        sequences = [list(ids) for ids in rows["input_ids"]]
        expected = hf_logprobs(oracle, sequences)
        dumped = [torch.tensor(lp, dtype=torch.float32) for lp in rows["logprobs"]]
        worst = max((e - d).abs().max().item() for e, d in zip(expected, dumped))
        assert worst <= ORACLE_TOL, (tag, worst)
        if tag != "base":  # the adapter must matter, or the comparison proves nothing
            effect = max((e - b).abs().max().item() for e, b in zip(expected, hf_logprobs(base, sequences)))
            assert effect > 1e-2, (tag, effect)


def test_graph_options(art, tmp_path, monkeypatch):
    """The CUDA-graph options reach Engine.load; on the CPU no graph is made (run.json says so); a bad value is a
    usage error."""
    seen = []
    original = Engine.load

    def load(model, adapters, options):
        seen.append(options)
        return original(model, adapters, options)

    monkeypatch.setattr(Engine, "load", load)
    result = compare_cli(art, [art.shift_path], tmp_path / "run", "--no-cuda-graphs")
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)  # the known shift, not the option
    assert seen[-1].cuda_graphs is False
    assert json.loads((tmp_path / "run" / "run.json").read_text())["cuda_graphs"] is None
    result = compare_cli(art, [art.shift_path], tmp_path / "run2", "--graph-buckets", "4", "--max-graph-memory", "1.5")
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert seen[-1].cuda_graphs is True
    assert (seen[-1].graph_buckets, seen[-1].max_graph_memory) == (4, int(1.5 * 2**30))
    bad = compare_cli(art, [art.shift_path], tmp_path / "run3", "--graph-buckets", "-1")
    assert bad.exit_code == 2 and "--graph-buckets" in bad.stderr and "Traceback" not in bad.stderr


def test_out_that_is_a_file_is_refused_before_the_run(art, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    assert_input_error(compare_cli(art, [art.shift_path], taken), "--out", "not a folder")


def test_an_unexpected_failure_is_one_line_and_exit_3(art, tmp_path, monkeypatch):
    """Exit 1 means "a threshold was crossed": a failure we do not check for must not look like that."""
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure deep inside")

    monkeypatch.setattr(Engine, "load", broken)
    result = compare_cli(art, [art.shift_path], tmp_path / "run")
    assert result.exit_code == 3, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "RuntimeError: simulated failure deep inside" in result.stderr
    assert "Traceback" not in result.stderr
