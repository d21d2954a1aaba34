"""The gates of `compare` (issue #28): "adapter applied" and `--max-k2-over-floor`.

One module fixture: the tiny Qwen3-MoE checkpoint (session fixture), three adapters — `good` (PEFT all-linear,
random factors), `zero` (the same files with every lora_B zero) and `nomatch` (targets q_proj but its file holds no
weights: no LoRA weight applies) — and references made by our own engine in this process (float32 CPU, one
thread), so every d is exactly 0 but for the edits a test makes:

1. zero and nomatch fail the applied gate (exit 1, named with the reason in the summary, the verdict line, the
   report, JUnit); good passes; the measured max |lp - base| and the cost of the base re-runs, from run.json;
2. with the static facts out of the way, the logprobs alone still find zero and nomatch not applied;
3. --no-adapter-check: the same run passes, no gate rows, no gate testcases;
4. --max-k2-over-floor: the floor (k2 of ref - sampler over the base rows) and k2 / floor as numbers; an X below
   k2 / floor fails, above passes; without sampler logprobs the check is off and the summary says so; a bad X is a
   one-line usage error;
5. the sample of rows the gate runs again (fixed by sample ids) and the floor's choice of rows, on hand-made data;
6. a run interrupted among the gate's units resumes byte-identical, a re-run recomputes nothing; data parallel
   over two ranks writes the one-process tables byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import lora_eval
from lora_eval import Batch, Engine
from lora_eval.cli import cli
from lora_eval.tasks.compare import GATE_ROWS, GATE_TOKENS, gate_sample
from lora_eval.results.metrics import NOISE_ULPS, sampler_floor
from lora_eval.inputs.references import write_reference
from tests.builders import random_sequences, save_random_peft_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback

compare_module = importlib.import_module("lora_eval.tasks.compare")
ROOT = Path(__file__).resolve().parents[1]
VOCAB = 96  # tests.builders' tiny vocabulary
ROWS_PER_TAG = 12  # more than GATE_ROWS: the row cap bites
TAGS = (None, "good", "zero", "nomatch")
TABLES = ("summary.csv", "samples.csv", "tokens.parquet", "worst_tokens.parquet", "gates.csv")
BASE_NOISE, ADAPTER_NOISE = 0.05, 0.3  # sampler - trainer spread on base rows and on adapter rows


class Artefacts:
    """The model, the adapters, the references and one uninterrupted gated run."""


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def compare_args(art, ref, out, *extra, adapters=("good", "zero", "nomatch")) -> list[str]:
    args = ["compare", "--model", art.model, "--reference", ref, "--out", out, "--batch-tokens", "64", "--quiet"]
    for name in adapters:
        args += ["--adapter", f"{name}={art.adapters[name]}"]
    return [str(a) for a in [*args, *extra]]


def tables(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in TABLES}


def record(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def summary_of(folder: Path) -> pd.DataFrame:
    frame = pd.read_csv(folder / "summary.csv", dtype={"failed": str, "adapter": str})
    return frame.assign(failed=frame["failed"].fillna("")).set_index("adapter")


def gates_of(folder: Path) -> pd.DataFrame:
    frame = pd.read_csv(folder / "gates.csv", dtype={"reason": str, "adapter": str})
    return frame.assign(reason=frame["reason"].fillna("")).set_index("adapter")


def junit_cases(path: Path) -> list[dict]:
    cases = []
    for case in ET.fromstring(path.read_text()).iter("testcase"):
        failure, skipped = case.find("failure"), case.find("skipped")
        cases.append(dict(adapter=case.get("classname").rsplit(".", 1)[1], name=case.get("name"),
                          failure=None if failure is None else failure.get("message"),
                          skipped=None if skipped is None else skipped.get("message")))
    return cases


def by_hash(sample_ids) -> list[str]:
    return sorted(sample_ids, key=lambda s: hashlib.sha256(s.encode()).hexdigest())


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("gates")
    s = session_seed
    a = Artefacts()
    a.root, a.model = root, moe_model
    good = save_random_peft_adapter(moe_model, root / "good", seed=s + 301, r=4, lora_alpha=8,
                                    target_modules="all-linear")
    zero = root / "zero"
    shutil.copytree(good, zero)
    tensors = load_file(zero / "adapter_model.safetensors")
    save_file({k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in tensors.items()},
              str(zero / "adapter_model.safetensors"))
    nomatch = root / "nomatch"
    nomatch.mkdir()
    (nomatch / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"])))
    save_file({}, str(nomatch / "adapter_model.safetensors"))
    a.adapters = {"good": good, "zero": zero, "nomatch": nomatch}

    tags = [t for t in TAGS for _ in range(ROWS_PER_TAG)]
    random.Random(s + 302).shuffle(tags)
    ids = random_sequences(len(tags), VOCAB, seed=s + 303, min_len=5, max_len=24)
    engine = Engine.load(moe_model, a.adapters)
    lps = [lp.numpy().astype(np.float64) for lp in engine.logprobs(Batch(ids, list(tags)))]
    rng = np.random.default_rng(s + 304)
    a.frame = pd.DataFrame(dict(
        sample_id=[f"{t or 'base'}-{i}" for i, t in enumerate(tags)], adapter=list(tags), input_ids=ids,
        logprobs=[lp.tolist() for lp in lps],
        mask=[(rng.random(len(lp)) < 0.7).tolist() for lp in lps],
        sampler_logprobs=[(lp + rng.normal(0, BASE_NOISE if t is None else ADAPTER_NOISE, len(lp))).tolist()
                          for lp, t in zip(lps, tags)]))
    for row in a.frame.itertuples():  # every row scores at least one token
        row.mask[0] = True
    a.plain = write_reference(a.frame.drop(columns="sampler_logprobs"), root / "plain.parquet")
    a.baseline = root / "baseline"
    a.baseline_result = run_cli(*compare_args(a, a.plain, a.baseline, "--junit", root / "junit.xml",
                                              "--max-k2-over-floor", "1"))
    return a


# ---- 1. the adapter applied gate ---------------------------------------------------------------------------


def test_zero_and_unmatched_adapters_fail_the_applied_gate_a_real_one_passes(art):
    result = art.baseline_result
    assert_no_traceback(result)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    summary, gates = summary_of(art.baseline), gates_of(art.baseline)
    assert (summary["k2"] == 0).all()  # the references are the engine's own numbers: only the gate can fail
    assert summary.loc["zero", "failed"] == "adapter not applied: every lora_B is zero"
    assert summary.loc["nomatch", "failed"].startswith("adapter not applied: matched no module of this model")
    assert summary.loc[["base", "good", "overall"], "passed"].all()
    assert not summary.loc[["zero", "nomatch"], "passed"].any()

    assert list(gates.index) == ["good", "zero", "nomatch"]
    assert list(gates["applied"]) == [True, False, False]
    assert gates.loc["zero", "reason"] == "every lora_B is zero"
    assert "matched no module" in gates.loc["nomatch", "reason"]
    # float32 on the CPU: a zero delta leaves the base model's logprobs bit for bit; a real adapter moves them
    assert (gates.loc[["zero", "nomatch"], "max_abs_diff_vs_base"] == 0).all()
    assert gates.loc["good", "max_abs_diff_vs_base"] > 0.05 > 1000 * gates.loc["good", "noise_bound"]

    # which rows: the first GATE_ROWS of each adapter by sha256(sample_id); the bound holds and run.json counts them
    frame = art.frame.set_index("sample_id")
    run = record(art.baseline)
    check = run["gates"]["adapter_check"]
    expected_tokens = 0
    for name in ("good", "zero", "nomatch"):
        own = [sid for sid in by_hash(frame.index) if frame.loc[sid, "adapter"] == name][:GATE_ROWS]
        assert gates.loc[name, "rows_checked"] == len(own) == GATE_ROWS
        assert gates.loc[name, "tokens_checked"] == sum(len(frame.loc[sid, "input_ids"]) - 1 for sid in own)
        expected_tokens += sum(len(frame.loc[sid, "input_ids"]) for sid in own)
        if name != "good":  # their rows' references are the base model's logprobs: the bound's scale
            base_lp = np.concatenate([frame.loc[sid, "logprobs"] for sid in own])
            assert gates.loc[name, "noise_bound"] == pytest.approx(
                NOISE_ULPS * torch.finfo(torch.float32).eps * max(1, np.abs(base_lp).mean()), rel=1e-6)
    assert check["rows"] == 3 * GATE_ROWS and check["tokens"] == expected_tokens <= 3 * GATE_TOKENS
    lengths = sum(len(ids) for ids in art.frame["input_ids"])
    assert run["work"]["computed"] == lengths + check["tokens"]  # the gate's cost: those tokens, once
    print(f"gate cost: {check['tokens']} of {run['work']['computed']} tokens")

    # said on the terminal, in the verdict line, the reports and JUnit
    assert "zero NOT applied: every lora_B is zero" in result.stdout
    assert f"good {gates.loc['good', 'max_abs_diff_vs_base']:.4g} > " in result.stdout
    verdict = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(verdict) == 1, result.stderr
    assert set(verdict[0].removeprefix("FAILED: ").split("; ")) == {
        "zero (adapter not applied: every lora_B is zero)",
        f"nomatch (adapter not applied: {gates.loc['nomatch', 'reason']})"}
    assert verdict[0] in (art.baseline / "report.md").read_text()
    assert "every lora_B is zero" in (art.baseline / "report.html").read_text()
    cases = {(c["adapter"], c["name"]): c for c in junit_cases(art.root / "junit.xml")}
    assert {k for k, c in cases.items() if c["failure"]} == {("zero", "adapter applied"),
                                                           ("nomatch", "adapter applied")}
    assert cases[("zero", "adapter applied")]["failure"] == "zero: adapter not applied: every lora_B is zero"
    assert cases[("good", "adapter applied")]["failure"] is None


def test_the_logprobs_alone_find_an_adapter_that_changes_nothing(art, monkeypatch):
    """Without the static facts (as if the files looked fine), the base re-runs decide: exactly base's numbers."""
    monkeypatch.setattr(compare_module, "unchanged_adapters", lambda adapters: {})
    result = lora_eval.compare(art.model, art.adapters, [art.plain], quiet=True)
    gates = result.gates.set_index("adapter")
    assert list(gates["applied"]) == [True, False, False] and result.exit_code == 1
    for name in ("zero", "nomatch"):
        bound = gates.loc[name, "noise_bound"]
        assert gates.loc[name, "reason"] == (f"its logprobs equal the base model's within the noise (max |lp - base| "
                                             f"0 <= {bound:.3g})")
    assert gates.loc["good", "reason"] == ""


def test_no_adapter_check_turns_the_gate_off(art, tmp_path):
    out = tmp_path / "run"
    result = run_cli(*compare_args(art, art.plain, out, "--no-adapter-check", "--junit", tmp_path / "j.xml"))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "adapter applied: not checked (--no-adapter-check)" in result.stdout
    assert (out / "gates.csv").read_text().strip() == ",".join(
        ["adapter", "applied", "max_abs_diff_vs_base", "noise_bound", "rows_checked", "tokens_checked", "reason"])
    run = record(out)
    assert run["gates"]["adapter_check"] is None and run["arguments"]["check_adapters"] is False
    assert run["work"]["computed"] == sum(len(ids) for ids in art.frame["input_ids"])  # no base re-run
    assert not [c for c in junit_cases(tmp_path / "j.xml") if c["name"] == "adapter applied"]
    assert lora_eval.read_run(out).passed
    # another gate setting is another run: refused into the gated run's folder
    assert_input_error(run_cli(*compare_args(art, art.plain, art.baseline, "--no-adapter-check")),
                       str(art.baseline), "adapter_check")


# ---- 2. k2 over the sampler's floor ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def floored(art, session_seed):
    """A reference of base and `good` rows with sampler logprobs, good's trainer logprobs moved by delta."""
    rng = np.random.default_rng(session_seed + 305)
    delta = float(rng.choice([-1, 1]) * rng.uniform(0.05, 0.1))
    frame = art.frame[art.frame["adapter"].isna() | (art.frame["adapter"] == "good")].copy()
    frame["logprobs"] = [list(np.asarray(lp) + delta) if a == "good" else lp
                         for lp, a in zip(frame["logprobs"], frame["adapter"])]
    return write_reference(frame, art.root / "floored.parquet"), frame, delta


def test_k2_over_floor_fails_above_and_passes_below(art, floored, tmp_path):
    ref, frame, delta = floored
    base = frame[frame["adapter"].isna()]
    def stored(values, mask):  # as the reference file holds them: float32
        return np.asarray(values, dtype=np.float32).astype(np.float64)[np.asarray(mask)]

    d = np.concatenate([stored(lp, m) - stored(s, m) for lp, s, m in
                        zip(base["logprobs"], base["sampler_logprobs"], base["mask"])])
    floor = float(np.mean(d * d / 2))  # k2 of ref - sampler over the base rows' masked tokens
    assert floor == pytest.approx(BASE_NOISE ** 2 / 2, rel=0.5)
    ratio = (delta ** 2 / 2) / floor
    for x, code in ((ratio / 2, 1), (ratio * 2, 0)):
        out = tmp_path / f"x{x:g}"
        result = run_cli(*compare_args(art, ref, out, "--max-k2-over-floor", f"{x:g}", "--junit", out.with_suffix(
            ".xml"), adapters=("good",)))
        assert result.exit_code == code, (result.stdout, result.stderr)
        summary = summary_of(out)
        assert list(summary["k2_floor"]) == [pytest.approx(floor, rel=1e-9)] * len(summary)
        assert summary.loc["good", "k2"] == pytest.approx(delta ** 2 / 2, rel=1e-4)
        assert summary.loc["good", "k2_over_floor"] == summary.loc["good", "k2"] / summary.loc["good", "k2_floor"]
        assert summary.loc["good", "k2_over_floor"] == pytest.approx(ratio, rel=1e-4)
        assert summary.loc["base", "k2_over_floor"] == 0 and summary.loc["base", "passed"]
        assert record(out)["gates"]["k2_over_floor"] == dict(
            k2_floor=summary.loc["good", "k2_floor"], source="base rows", rows=len(base),
            tokens=int(sum(np.sum(m) for m in base["mask"])), limit=float(f"{x:g}"))
        assert f"k2 over floor: floor {floor:.4g} (k2 of ref - sampler over {len(base)} base rows" in result.stdout
        failing = {c["adapter"] for c in junit_cases(out.with_suffix(".xml")) if c["failure"]}
        if code:
            assert summary.loc["good", "failed"] == f"k2 > {x:g} x floor {floor:.4g}"
            assert f"good (k2 > {x:g} x floor" in result.stderr
            assert "good" in failing
        else:
            assert summary["passed"].all() and not failing


def test_without_sampler_logprobs_the_floor_check_is_off(art):
    summary = summary_of(art.baseline)
    assert summary["k2_floor"].isna().all() and summary["k2_over_floor"].isna().all()
    assert "k2 over floor: off (the references carry no sampler logprobs)" in art.baseline_result.stdout
    assert "k2 over floor: off" in (art.baseline / "report.md").read_text()
    floor_cases = [c for c in junit_cases(art.root / "junit.xml") if c["name"] == "k2 <= 1 x floor"]
    assert len(floor_cases) == len(summary)
    assert all(c["skipped"] == "off: the references carry no sampler logprobs" and c["failure"] is None
               for c in floor_cases)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "many"])
def test_a_bad_max_k2_over_floor_is_a_usage_error(art, tmp_path, value, monkeypatch):
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    result = run_cli(*compare_args(art, art.plain, tmp_path / "run", "--max-k2-over-floor", value))
    assert_input_error(result, "--max-k2-over-floor", "expected a finite number >= 0", value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(lora_eval.InputError, match="--max-k2-over-floor: expected a finite number >= 0"):
        lora_eval.compare(art.model, art.adapters, [art.plain], max_k2_over_floor=float(value) if value != "many"
                          else value)
    with pytest.raises(lora_eval.InputError, match="check_adapters: expected True or False"):
        lora_eval.compare(art.model, art.adapters, [art.plain], check_adapters="yes")


# ---- 3. the pure parts ----------------------------------------------------------------------------------


def test_floor_rows_base_first_then_every_row(seed):
    rng = np.random.default_rng(seed)
    n = 300
    tokens = pd.DataFrame(dict(adapter=rng.choice(["base", "a"], n), sample_id=rng.choice(list("pqrstuvw"), n),
                               mask=rng.random(n) < 0.7, sampler_d=rng.normal(0, 0.1, n)))
    tokens.loc[rng.random(n) < 0.2, "sampler_d"] = np.nan  # rows without sampler logprobs
    use = tokens["mask"] & tokens["sampler_d"].notna()
    base = tokens[use & (tokens["adapter"] == "base")]
    floor = sampler_floor(tokens)
    assert floor == dict(k2_floor=pytest.approx(float(np.mean(base["sampler_d"] ** 2 / 2)), rel=1e-12),
                         source="base rows", rows=base["sample_id"].nunique(), tokens=len(base))
    adapters_only = tokens[tokens["adapter"] == "a"]
    fallback = sampler_floor(adapters_only)
    assert fallback["source"] == "all rows" and fallback["tokens"] == int((use & (tokens["adapter"] == "a")).sum())
    assert sampler_floor(tokens.assign(sampler_d=np.nan)) == dict(k2_floor=None, source=None, rows=0, tokens=0)


def test_gate_sample_is_fixed_by_sample_ids_and_bounded(seed):
    rng = random.Random(seed)
    n = 60
    frame = pd.DataFrame(dict(sample_id=[f"id{rng.randrange(10**9)}-{i}" for i in range(n)],
                              adapter=[rng.choice([None, "a", "b"]) for _ in range(n)],
                              input_ids=[[0] * rng.randrange(2, 200) for _ in range(n)]))
    max_rows, max_tokens = rng.randrange(1, 6), rng.randrange(150, 600)
    chosen = gate_sample(frame, ["a", "b", "c"], max_rows, max_tokens)
    shuffled = frame.sample(frac=1, random_state=seed).reset_index(drop=True)
    again = gate_sample(shuffled, ["a", "b", "c"], max_rows, max_tokens)
    ids = {a: sorted(frame["sample_id"].iloc[rows]) for a, rows in chosen.items()}
    assert ids == {a: sorted(shuffled["sample_id"].iloc[rows]) for a, rows in again.items()}
    assert "c" not in chosen  # no rows: nothing to run
    for adapter, rows in chosen.items():
        lengths = [len(frame["input_ids"].iat[i]) for i in rows]
        assert all(frame["adapter"].iat[i] == adapter for i in rows)
        assert len(rows) <= max_rows and sum(lengths) <= max_tokens or len(rows) == 1
    assert gate_sample(frame, ["a"], 3, 1) == {"a": [min(
        (i for i in range(n) if frame["adapter"].iat[i] == "a"),
        key=lambda i: (len(frame["input_ids"].iat[i]), hashlib.sha256(frame["sample_id"].iat[i].encode()).digest()))]}


# ---- 4. run folders: resume, reuse, data parallel -------------------------------------------------------


def test_a_run_interrupted_among_the_gate_units_resumes_byte_identical(art, tmp_path, monkeypatch, seed):
    baseline_units = record(art.baseline)["work"]["units"]
    main_units = record(art.baseline)["batches"]
    assert baseline_units > main_units + 1  # the gate's base re-runs are units of their own
    stop_at = random.Random(seed).randrange(main_units + 1, baseline_units)  # a gate unit
    original, calls = Engine.start_logprobs, []

    def stopping(self, batch):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(self, batch)

    monkeypatch.setenv("LORA_EVAL_PART_ITEMS", "1")
    monkeypatch.setattr(Engine, "start_logprobs", stopping)
    out = tmp_path / "run"
    args = compare_args(art, art.plain, out, "--max-k2-over-floor", "1")
    assert run_cli(*args).exit_code == 130 and not out.exists()
    monkeypatch.setattr(Engine, "start_logprobs", original)
    result = run_cli(*args)
    assert result.exit_code == 1 and "resuming: " in result.stderr, result.stderr
    assert record(out)["work"]["resumed_units"] == stop_at - 1
    assert tables(out) == tables(art.baseline)
    # the same command again: nothing recomputed, the stored verdict and gates
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("the finished run was computed again"))
    again = run_cli(*args)
    assert again.exit_code == 1 and "zero NOT applied: every lora_B is zero" in again.stdout


def test_data_parallel_writes_the_one_process_tables(art, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1", "LORA_EVAL_PART_ITEMS": "1"}
    proc = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", "lora-eval",
                           *compare_args(art, art.plain, out, "--max-k2-over-floor", "1")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    verdict = [line for line in proc.stderr.splitlines() if line.startswith("FAILED: ")]  # rank 0's, once
    assert proc.returncode != 0 and len(verdict) == 1, proc.stderr[-3000:]
    assert "zero (adapter not applied: every lora_B is zero)" in verdict[0] and "nomatch (" in verdict[0]
    assert tables(out) == tables(art.baseline)
    work = record(out)["work"]
    assert len(work["ranks"]) == 2 and all(r["computed"] > 0 for r in work["ranks"])
    assert work["computed"] == record(art.baseline)["work"]["computed"]
