"""Run folders that never lose, mix or fake a result (lora_eval/runfolder.py), strict inputs, one exit-code contract.

1. bad input, each through the CLI: exit 2, one line naming the file / line / option and what was expected, no
   traceback, no file written or changed, no model loaded;
2. kills with real processes: SIGKILL at random moments during a run of many parts, then a re-run whose tables are
   byte-identical to an uninterrupted run's; SIGINT / SIGTERM exit 130 / 143 and resume the same way;
3. two processes into one --out: one finishes, the other exits 2 at once naming the holder; the lock of a dead
   process is taken over;
4. re-runs: the same inputs recompute nothing and exit with the stored code; other inputs exit 2 and change
   nothing; --overwrite replaces; a kill between the last write and the rename is finished by the next run;
5. dump-reference: the file appears whole, resumes, and defaults prompts without an adapter;
6. every command's help states the exit codes and gives examples (the package's shape: test_layers.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import lora_eval
from lora_eval import Engine, read_run
from lora_eval.cli import cli
from lora_eval.inputs.references import write_reference
from lora_eval.render.files import report_files
from lora_eval.results.runfolder import InputDigests, RunFolder, config_digest, file_digest, weights_digest
from tests.builders import random_sequences, save_random_peft_adapter
from tests.cli_checks import assert_input_error

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 96  # tests.builders' tiny vocabulary
SAMPLES = 160
TABLES = ("summary.csv", "samples.csv", "tokens.parquet", "worst_tokens.parquet")
PART_ENV = {"LORA_EVAL_PART_ITEMS": "2"}  # a part every batch or two: a run of many parts
GATE = '''import os
import time

if os.environ.get("LORA_EVAL_TEST_GATE"):  # the run holding the lock waits before its first batch for the gate file
    from lora_eval.engine.engine import Engine
    original = Engine.start_logprobs

    def gated(self, batch):
        end = time.monotonic() + 600  # bounded: a test that failed before opening the gate leaves no process behind
        while not os.path.exists(os.environ["LORA_EVAL_TEST_GATE"]) and time.monotonic() < end:
            time.sleep(0.01)
        return original(self, batch)

    Engine.start_logprobs = gated
'''


class Artefacts:
    """The good inputs every test copies and edits, and one uninterrupted run of them."""


def reference_frame(seed: int, n: int = SAMPLES) -> pd.DataFrame:
    """A valid reference with random logprobs (what compare reports does not matter here, only that it is exact)."""
    rng = np.random.default_rng(seed)
    ids = random_sequences(n, VOCAB, seed=seed, min_len=8, max_len=48)
    return pd.DataFrame(dict(sample_id=[f"s{i}" for i in range(n)], adapter=[None if i % 2 else "peft" for i in
                                                                              range(n)],
                             input_ids=ids, logprobs=[(-rng.uniform(0, 8, len(x) - 1)).tolist() for x in ids]))


def compare_args(art, out, *extra) -> list[str]:
    return ["compare", "--model", str(art.model), "--adapter", f"peft={art.adapter}", "--reference", str(art.ref),
            "--out", str(out), "--batch-tokens", "64", *map(str, extra)]


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`python -m lora_eval ARGS` in a process of its own (quiet, one thread, small parts)."""
    full_env = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1", **PART_ENV, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "lora_eval", *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); a process still running after `timeout` seconds is killed before the test fails
    (left running, it would slow every test after it)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s (killed); its stderr:\n{err[-5000:]}")
    return proc.returncode, out, err


def parts(out: Path) -> int:
    return len(list(out.with_name(out.name + ".partial").glob("parts/part-*.parquet")))


def wait_for(condition, timeout: float = 120) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.005)
    return False


def tables(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in TABLES}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def record(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def assert_same_run(folder: Path, baseline: Path) -> None:
    """Byte-identical tables; reports that differ only through the run record (timings)."""
    assert tables(folder) == tables(baseline)
    result = read_run(folder)
    result.run = record(baseline)
    assert report_files(result) == {name: (baseline / name).read_bytes() for name in ("report.md", "report.html")}


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed) -> Artefacts:
    root = tmp_path_factory.mktemp("runs")
    a = Artefacts()
    a.root, a.model = root, moe_model
    a.adapter = save_random_peft_adapter(moe_model, root / "peft", seed=session_seed + 1, r=4, lora_alpha=8,
                                         target_modules="all-linear")
    a.frame = reference_frame(session_seed + 2)
    a.ref = write_reference(a.frame, root / "ref.parquet")
    a.baseline = root / "baseline"
    a.baseline_proc = finish(start(compare_args(a, a.baseline)))
    assert a.baseline_proc[0] == 1, a.baseline_proc  # random logprobs cross the default k2 threshold
    return a


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_rows(art, n: int = 4) -> list[dict]:
    return [dict(sample_id=r.sample_id, adapter=r.adapter, input_ids=list(r.input_ids), logprobs=list(r.logprobs))
            for r in art.frame.head(n).itertuples()]


@pytest.fixture
def no_model(monkeypatch):
    """A refusal must come before any model is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(Engine, "load", refuse)


# ---- 1. bad input ----------------------------------------------------------------------------------------


def edited(rows: list[dict], key: str, value, row: int = 1) -> list[dict]:
    rows = [dict(r) for r in rows]
    rows[row][key] = value(rows[row]) if callable(value) else value
    return rows


BAD_REFERENCES = [  # (name, edit of the good JSONL rows, needles of the one error line)
    ("mask of strings", lambda rows: edited(rows, "mask", lambda r: ["true", "false"] * (len(r["logprobs"]) // 2)
                                            + ["true"] * (len(r["logprobs"]) % 2)),
     ["line 2", "mask must hold booleans", "'true'"]),
    ("mask of 2s", lambda rows: edited(rows, "mask", lambda r: [2] * len(r["logprobs"])),
     ["line 2", "mask must hold booleans", "found 2"]),
    ("mask not a list", lambda rows: edited(rows, "mask", "all"), ["line 2", "mask must be a list"]),
    ("logprobs of strings", lambda rows: edited(rows, "logprobs", lambda r: [str(v) for v in r["logprobs"]]),
     ["line 2", "logprobs must hold numbers", "(str)"]),
    ("logprobs with a null", lambda rows: edited(rows, "logprobs", lambda r: [None] + r["logprobs"][1:]),
     ["line 2", "logprobs must hold numbers", "None"]),
    ("logprobs with NaN", lambda rows: edited(rows, "logprobs", lambda r: [float("nan")] + r["logprobs"][1:]),
     ["line 2", "logprobs must hold finite numbers", "nan"]),
    ("logprobs of booleans", lambda rows: edited(rows, "logprobs", lambda r: [True] * len(r["logprobs"])),
     ["line 2", "logprobs must hold numbers", "(bool)"]),
    ("float token ids", lambda rows: edited(rows, "input_ids", lambda r: [float(t) for t in r["input_ids"]]),
     ["line 2", "input_ids must hold integer token ids", "(float)"]),
    ("token id outside the vocabulary", lambda rows: edited(rows, "input_ids", lambda r: [VOCAB] + r["input_ids"][1:]),
     ["line 2", f"token id {VOCAB} is outside the model's vocabulary [0, {VOCAB})"]),
    ("token id beyond int64", lambda rows: edited(rows, "input_ids", lambda r: r["input_ids"][:1] + [2**70]
                                                  + r["input_ids"][2:]),
     ["line 2", f"token id {2**70} is outside the model's vocabulary [0, {VOCAB})"]),
    ("logprob beyond any float", lambda rows: edited(rows, "logprobs", lambda r: r["logprobs"][:2] + [-10**400]
                                                     + r["logprobs"][3:]),
     ["line 2", "logprobs must hold finite numbers", "at position 2"]),
    ("logprobs with infinity", lambda rows: edited(rows, "logprobs", lambda r: r["logprobs"][:1] + [float("-inf")]
                                                   + r["logprobs"][2:]),
     ["line 2", "logprobs must hold finite numbers", "-inf at position 1"]),
    ("wrong logprobs length", lambda rows: edited(rows, "logprobs", lambda r: r["logprobs"][1:]),
     ["line 2", "logprobs has", "expected len(input_ids)-1"]),
    ("adapter not a name", lambda rows: edited(rows, "adapter", 7), ["line 2", "adapter must be an adapter name"]),
    ("no samples", lambda rows: [], ["no samples"]),
    ("every token masked", lambda rows: [dict(r, mask=[False] * len(r["logprobs"])) for r in rows],
     ["mask leaves no scored token"]),
    ("duplicate sample id", lambda rows: edited(rows, "sample_id", rows[0]["sample_id"]),
     ["line 2", "also used by line 1"]),
]


@pytest.mark.parametrize("name,edit,needles", BAD_REFERENCES, ids=[c[0] for c in BAD_REFERENCES])
def test_bad_reference_is_refused_before_anything(art, tmp_path, no_model, name, edit, needles):
    ref = write_jsonl(tmp_path / "ref.jsonl", edit(jsonl_rows(art)))
    before = snapshot(tmp_path)
    result = run_cli("compare", "--model", art.model, "--adapter", f"peft={art.adapter}", "--reference", ref,
                     "--out", tmp_path / "run")
    assert_input_error(result, str(ref), *needles)
    assert snapshot(tmp_path) == before


def test_non_utf8_line_is_named(art, tmp_path, no_model):
    ref = write_jsonl(tmp_path / "ref.jsonl", jsonl_rows(art))
    lines = ref.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"s', b'"\xff', 1)
    ref.write_bytes(b"\n".join(lines))
    before = snapshot(tmp_path)
    result = run_cli("compare", "--model", art.model, "--adapter", f"peft={art.adapter}", "--reference", ref,
                     "--out", tmp_path / "run")
    assert_input_error(result, str(ref), "line 3", "not UTF-8", "0xff")
    assert snapshot(tmp_path) == before


def test_empty_parquet_reference(art, tmp_path, no_model):
    ref = write_reference(art.frame.head(1), tmp_path / "ref.parquet")
    pd.read_parquet(ref).head(0).to_parquet(ref)
    assert_input_error(run_cli("compare", "--model", art.model, "--reference", ref, "--out", tmp_path / "run"),
                       str(ref), "no samples")


@pytest.mark.parametrize("option,value", [("--max-k2", "-1"), ("--max-k2", "nan"), ("--max-k2", "inf"),
                                          ("--max-mean-abs-diff", "-0.5"), ("--max-mean-abs-diff", "NaN")])
def test_bad_threshold_is_a_usage_error(art, tmp_path, no_model, option, value):
    before = snapshot(tmp_path)
    result = run_cli(*compare_args(art, tmp_path / "run"), option, value)
    assert_input_error(result, option, "expected a finite number >= 0", value)
    assert snapshot(tmp_path) == before


def test_bad_max_drop_is_a_usage_error(tmp_path, no_model):
    for value in ("-1", "nan", "inf"):
        result = run_cli("mmlu", "--model", tmp_path, "--data", tmp_path, "--out", tmp_path / "o", "--max-drop", value)
        assert_input_error(result, "--max-drop", "expected a finite number >= 0")


def test_api_refuses_bad_thresholds(art):
    for bad in (-1.0, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(lora_eval.InputError, match="--max-k2: expected a finite number >= 0"):
            lora_eval.compare(art.model, {"peft": art.adapter}, [art.ref], max_k2=bad)


def test_out_refused_before_the_model_loads(art, tmp_path, no_model, monkeypatch):
    file = tmp_path / "file"
    file.write_text("x")
    before = snapshot(tmp_path)
    assert_input_error(run_cli(*compare_args(art, tmp_path / "missing" / "run")), "--out", "does not exist")
    assert_input_error(run_cli(*compare_args(art, file / "run")), "--out", f"{file} is not a folder")
    assert_input_error(run_cli(*compare_args(art, file)), "--out", "exists and is not a folder")
    assert_input_error(run_cli(*compare_args(art, tmp_path / "run"), "--junit", tmp_path / "no" / "j.xml"),
                       "--junit", "does not exist")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real_access(path, mode))
    assert_input_error(run_cli(*compare_args(art, tmp_path / "run")), "--out", f"folder {tmp_path} is not writable")
    assert snapshot(tmp_path) == before


# ---- 2. kills --------------------------------------------------------------------------------------------


def test_sigkill_at_random_moments_then_resume_is_byte_identical(art, tmp_path, seed):
    """SIGKILL lands at a random moment after this process wrote a part (mid-run, or while it writes the end);
    the run that finally completes has the uninterrupted run's tables, byte for byte."""
    rng = random.Random(seed)
    out = tmp_path / "run"
    forward_s = record(art.baseline)["timings"]["forward_s"]
    killed_mid_run = 0
    for attempt in range(4):
        proc = start(compare_args(art, out))
        already = parts(out)
        assert wait_for(lambda: parts(out) > already or proc.poll() is not None)
        # the first kill as soon as a part is there, most of the run ahead: mid-run however fast or loaded the machine
        # (random moments alone can all land after the end when these runs go faster than the baseline's forward_s,
        # measured under another load); the others at random moments, the end of the run included
        time.sleep(0 if attempt == 0 else rng.uniform(0, forward_s))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed_mid_run += proc.wait() == -signal.SIGKILL and not out.exists()
        finish(proc)
        if out.exists():
            break
    assert killed_mid_run >= 1
    code, stdout, stderr = finish(start(compare_args(art, out)))
    assert code == 1, (stdout, stderr)
    assert_same_run(out, art.baseline)
    assert not out.with_name("run.partial").exists() and not out.with_name("run.lock").exists()


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_and_sigterm_keep_the_parts_and_resume(art, tmp_path, signum, code):
    out = tmp_path / "run"
    proc = start(compare_args(art, out))
    assert wait_for(lambda: parts(out) > 0 or proc.poll() is not None)
    proc.send_signal(signum)
    got, stdout, stderr = finish(proc, timeout=60)
    name = signal.Signals(signum).name
    assert got == code, (stdout, stderr)
    assert f"interrupted by {name} after" in stderr and "run the same command again to resume" in stderr
    assert "Traceback" not in stderr and not out.exists() and parts(out) > 0
    assert_input_error(run_cli("report", out), str(out), "not finished", "run.partial")
    assert_input_error(run_cli("report", out.with_name("run.partial")), "a partial run", "again")
    got, stdout, stderr = finish(start(compare_args(art, out)))
    assert got == 1 and "resuming:" in stderr, stderr
    assert record(out)["work"]["resumed_units"] > 0
    assert_same_run(out, art.baseline)


# ---- 3. one writer at a time -----------------------------------------------------------------------------


def test_two_runs_into_one_out(art, tmp_path):
    """Started together: one takes the lock and finishes, the other exits 2 at once naming the holder. The holder
    waits before its first batch until the test opens a gate (sitecustomize), so the loser's exit while the holder
    is still running shows it did not wait, without comparing two processes' clocks."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(GATE)
    path = os.pathsep.join(p for p in (str(tmp_path / "inject"), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "LORA_EVAL_TEST_GATE": str(gate)}
    procs = [start(compare_args(art, out), env), start(compare_args(art, out), env)]
    try:
        assert wait_for(lambda: any(p.poll() is not None for p in procs), timeout=240)
        running = [p for p in procs if p.poll() is None]
        assert len(running) == 1  # the holder waits at the gate: the other one did not wait for it
    finally:
        gate.touch()
    results = [finish(p) for p in procs]
    winner, loser = sorted(results, key=lambda r: r[0])
    assert (winner[0], loser[0]) == (1, 2), results
    assert procs[results.index(winner)] is running[0]
    line = loser[2].strip()
    assert "\n" not in line and line.startswith(f"error: {out}: another lora-eval run is writing here (pid "), line
    assert f"on {socket.gethostname()}, started " in line
    assert_same_run(out, art.baseline)


def test_a_live_holder_is_named_and_a_dead_ones_lock_taken_over(art, tmp_path):
    out = tmp_path / "run"
    lock = tmp_path / "run.lock"
    holder = dict(pid=os.getpid(), host=socket.gethostname(), started="2026-11-25T10:00:00+00:00", command="compare")
    with open(lock, "w") as f:
        f.write(json.dumps(holder))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX)
        assert_input_error(run_cli(*compare_args(art, out)), str(out), f"pid {os.getpid()}", "2026-11-25T10:00:00")
    assert not out.exists() and not out.with_name("run.partial").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps(dict(holder, pid=dead.pid)))
    result = run_cli(*compare_args(art, out))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert f"taking over the lock of a run that is no longer alive (pid {dead.pid}" in result.stderr
    assert not lock.exists()
    assert_same_run(out, art.baseline)
    lock.write_text(json.dumps(dict(holder, host="another-host")))
    assert_input_error(run_cli(*compare_args(art, out)), str(lock), "another host", "delete this file")


# ---- 4. re-runs ------------------------------------------------------------------------------------------


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_same_inputs_recompute_nothing_and_exit_with_the_stored_code(art, tmp_path, no_model):
    out = copy_run(art.baseline, tmp_path / "run")
    before = snapshot(tmp_path)
    result = run_cli(*compare_args(art, out))
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "holds this run already" in result.stderr and "nothing recomputed" in result.stderr
    assert "peft" in result.stdout and "FAIL" in result.stdout
    assert snapshot(tmp_path) == before


def test_other_inputs_are_refused_and_overwrite_replaces(art, tmp_path):
    out = copy_run(art.baseline, tmp_path / "run")
    before = snapshot(tmp_path)
    assert_input_error(run_cli(*compare_args(art, out), "--max-k2", "100"), str(out), "holds a complete compare run",
                       "max_k2 0.005 -> 100.0", "--overwrite")
    other = write_reference(art.frame.assign(logprobs=[[v - 1 for v in lp] for lp in art.frame["logprobs"]]),
                            tmp_path / "other.parquet")
    before[other.name] = snapshot(tmp_path)[other.name]
    args = compare_args(art, out)
    args[args.index(str(art.ref))] = str(other)
    assert_input_error(run_cli(*args), str(out), "reference 0/other.parquet is a new input",
                       "reference 0/ref.parquet is not an input now")
    assert snapshot(tmp_path) == before
    result = run_cli(*compare_args(art, out), "--max-k2", "100", "--overwrite")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert record(out)["arguments"]["max_k2"] == 100 and tables(out) != tables(art.baseline)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.parquet", "run"]


def test_another_commands_run_or_a_foreign_folder_is_never_replaced(art, tmp_path, no_model):
    out = copy_run(art.baseline, tmp_path / "run")
    run = record(out)
    (out / "run.json").write_text(json.dumps(dict(run, command="mmlu", fingerprint=dict(run["fingerprint"],
                                                                                       command="mmlu"))))
    assert_input_error(run_cli(*compare_args(art, out)), str(out), "holds a complete mmlu run",
                       "it is a mmlu run, not a compare run")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for extra in ((), ("--overwrite",)):
        assert_input_error(run_cli(*compare_args(art, foreign), *extra), str(foreign), "not a lora-eval run folder")
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_an_interrupted_run_resumes_in_process_and_other_inputs_leave_it_alone(art, tmp_path, monkeypatch):
    """Ctrl-C in the API (KeyboardInterrupt mid-batch): the CLI exits 130 and keeps the finished batches; a run of
    other inputs refuses the partial folder; the same command finishes it, equal to the uninterrupted run."""
    original, calls = Engine.start_logprobs, []

    def stopping(self, batch):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return original(self, batch)

    out = tmp_path / "run"
    monkeypatch.setattr(Engine, "start_logprobs", stopping)
    result = run_cli(*compare_args(art, out))
    assert result.exit_code == 130 and "interrupted" in result.stderr, (result.stdout, result.stderr)
    monkeypatch.setattr(Engine, "start_logprobs", original)
    assert parts(out) > 0 and not out.exists()
    assert_input_error(run_cli(*compare_args(art, out), "--max-k2", "1"), "run.partial", "unfinished run",
                       "max_k2 0.005 -> 1.0")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a CPU's matrix products split their sums by thread: other last bits
    try:
        assert_input_error(run_cli(*compare_args(art, out)), "run.partial", f"threads {threads} -> {threads + 1}")
    finally:
        torch.set_num_threads(threads)
    result = run_cli(*compare_args(art, out))
    assert result.exit_code == 1 and "resuming: " in result.stderr, result.stderr
    assert 0 < record(out)["work"]["resumed_units"] < record(out)["work"]["units"]
    assert_same_run(out, art.baseline)


def test_a_run_killed_between_its_last_write_and_the_rename_is_finished_by_the_next(art, tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = RunFolder._promote

    def killed(self):
        raise KeyboardInterrupt  # as if SIGKILL came right before the rename

    monkeypatch.setattr(RunFolder, "_promote", killed)
    with pytest.raises(KeyboardInterrupt):
        lora_eval.compare(art.model, {"peft": art.adapter}, [art.ref], out=out, batch_tokens=64, quiet=True)
    staged = out.with_name("run.partial")
    assert not out.exists() and record(staged)["status"] == "complete"
    assert_input_error(run_cli("report", out), "not finished")
    monkeypatch.setattr(RunFolder, "_promote", original)
    monkeypatch.setattr(Engine, "load", lambda *a: pytest.fail("the finished run was computed again"))
    result = lora_eval.compare(art.model, {"peft": art.adapter}, [art.ref], out=out, batch_tokens=64, quiet=True)
    assert not staged.exists() and record(out)["status"] == "complete"
    assert tables(out) == tables(art.baseline)
    pd.testing.assert_frame_equal(result.summary, read_run(art.baseline).summary)


def test_resumed_work_starts_its_progress_at_what_is_done(tmp_path):
    out = tmp_path / "run"
    with RunFolder(out, "compare", {"command": "compare"}, notice=lambda _: None) as folder:
        with folder.work([3, 4, 5, 6], "compare", "tok", quiet=True) as work:
            for unit in (0, 2):
                work.record(unit, pd.DataFrame(dict(value=[unit])))
    notices = []
    with RunFolder(out, "compare", {"command": "compare"}, notice=notices.append) as folder:
        with folder.work([3, 4, 5, 6], "compare", "tok", quiet=True) as work:
            assert work.bar.n == 8 and work.pending(range(4)) == [1, 3]
            assert work.done[2]["value"].tolist() == [2]
    assert notices == [f"resuming: 2 of 4 compare units already done (8 of 18 tok) in {out}.partial"]


def test_overlapped_work_starts_a_unit_before_finishing_the_last(tmp_path, seed):
    """Work.overlapped: unit u+1 is started (queued on the device) before unit u is finished and recorded; every
    pending unit is recorded once, with its own rows; a failing start first records the unit started before it."""
    rng = random.Random(seed)
    n = rng.randrange(4, 9)
    fail_at = rng.randrange(1, n)
    for failing in (False, True):
        events = []

        def start(unit):
            if failing and unit == fail_at:
                raise RuntimeError("start failed")
            events.append(("start", unit))
            return unit * 10

        def finish(unit, handle):
            events.append(("finish", unit))
            return pd.DataFrame(dict(value=[handle]))

        out = tmp_path / f"run-{failing}"
        with RunFolder(out, "compare", {"command": "compare"}, notice=lambda _: None) as folder:
            with folder.work([1] * n, "compare", "tok", quiet=True) as work:
                try:
                    work.overlapped(range(n), start, finish)
                except RuntimeError:
                    assert failing
                done = {u: rows["value"].tolist() for u, rows in work.done.items()}
        last = fail_at if failing else n
        assert done == {u: [u * 10] for u in range(last)}
        expected = [("start", 0)] + [e for u in range(1, last) for e in (("start", u), ("finish", u - 1))]
        assert events == expected + [("finish", last - 1)]


# ---- 5. dump-reference -----------------------------------------------------------------------------------


def prompts_file(art, path: Path, n: int = 6, with_adapter: bool = True) -> Path:
    rows = [dict(sample_id=f"p{i}", input_ids=ids) for i, ids in enumerate(art.frame["input_ids"].head(n))]
    if with_adapter:
        rows = [dict(r, adapter="peft" if i % 2 else None) for i, r in enumerate(rows)]
    return write_jsonl(path, rows)


def dump_args(art, prompts, out, *extra) -> list:
    return ["dump-reference", "--model", art.model, "--adapter", f"peft={art.adapter}", "--prompts", prompts,
            "--out", out, "--quiet", *extra]


def test_dump_reference_resumes_and_writes_whole(art, tmp_path, monkeypatch):
    prompts = prompts_file(art, tmp_path / "prompts.jsonl")
    whole = tmp_path / "whole.parquet"
    assert run_cli(*dump_args(art, prompts, whole)).exit_code == 0
    module = sys.modules["lora_eval.tasks.dump_reference"]
    original, calls = module._sequence_logprobs, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the GPU fell off the bus")
        return original(*args)

    out = tmp_path / "ref.parquet"
    monkeypatch.setattr(module, "_sequence_logprobs", failing)
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 3 and "fell off the bus" in result.stderr
    assert not out.exists() and parts(out) > 0
    monkeypatch.setattr(module, "_sequence_logprobs", original)
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 0 and "resuming: 3 of 6" in result.stderr, result.stderr
    assert out.read_bytes() == whole.read_bytes()
    before = snapshot(tmp_path)
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 0 and "holds this run already" in result.stderr
    assert snapshot(tmp_path) == before
    assert_input_error(run_cli(*dump_args(art, prompts, out, "--dtype", "bfloat16")), str(out),
                       "dtype \"float32\" -> \"bfloat16\"", "--overwrite")
    (tmp_path / "theirs.parquet").write_bytes(b"a file lora-eval did not write")
    assert_input_error(run_cli(*dump_args(art, prompts, tmp_path / "theirs.parquet")), "was not written by lora-eval")


def test_dump_reference_default_adapter(art, tmp_path):
    prompts = prompts_file(art, tmp_path / "prompts.jsonl", with_adapter=False)
    out = tmp_path / "one.parquet"
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 0, result.stderr
    assert "6 prompts without an 'adapter' field run under 'peft', the only --adapter given" in result.stderr
    assert pd.read_parquet(out)["adapter"].tolist() == ["peft"] * 6
    two = dump_args(art, prompts, tmp_path / "two.parquet", "--adapter", f"other={art.adapter}")
    assert_input_error(run_cli(*two), str(prompts), "line 1", "2 adapters were given", "--default-adapter")
    assert_input_error(run_cli(*two, "--default-adapter", "nope"), "--default-adapter", "'nope' is not one of")
    result = run_cli(*two, "--default-adapter", "base")
    assert result.exit_code == 0, result.stderr
    assert pd.read_parquet(tmp_path / "two.parquet")["adapter"].isna().all()
    rows = [dict(r, adapter=None) for r in map(json.loads, prompts.read_text().splitlines())]
    write_jsonl(prompts, rows)
    result = run_cli(*dump_args(art, prompts, tmp_path / "null.parquet", "--overwrite"))
    assert result.exit_code == 0 and pd.read_parquet(tmp_path / "null.parquet")["adapter"].isna().all()


def test_dump_reference_bad_prompts(art, tmp_path, no_model):
    cases = [({"input_ids": [1.0, 2.0]}, "input_ids must be a list of integer token ids"),
             ({"input_ids": [1, VOCAB]}, f"token id {VOCAB} is outside the model's vocabulary"),
             ({"input_ids": [1, 2, 3], "mask": ["yes", "no"]}, "mask must be a list of len(input_ids)-1 = 2 booleans"),
             ({"input_ids": [1, 2], "adapter": "ghost"}, "names adapter 'ghost', which was not given"),
             ({"text": 5}, "text must be a string")]
    for row, needle in cases:
        prompts = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3], "adapter": None}, row])
        before = snapshot(tmp_path)
        assert_input_error(run_cli(*dump_args(art, prompts, tmp_path / "r.parquet")), str(prompts), "line 2", needle)
        assert snapshot(tmp_path) == before


# ---- 6. the commands' help ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["compare", "mmlu", "dump-reference", "report", "inspect", "demo", "bench", "plan"])
def test_every_help_states_the_exit_codes_and_examples(command):
    result = run_cli(command, "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Exit codes: 0 pass, 1 a threshold crossed, 2 bad usage or input" in text and "130 / 143" in text
    assert "Examples:" in text and text.split("Examples:")[1].count("lora-eval ") >= 2


def test_input_digests_name_every_input_and_see_every_change(tmp_path):
    """InputDigests (hashed on background threads) against the digests taken one by one: the model folder's
    weights sampled, its JSON files by content, its other tokenizer files whole, other files left out; an adapter's
    files whole and its config by content; named files whole. A change of one byte in any hashed input changes its
    digest; a file gone before it was hashed is raised by result()."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    model, adapter = tmp_path / "model", tmp_path / "adapter"
    model.mkdir(), adapter.mkdir()
    for folder, name in ((model, "model-00001-of-00002.safetensors"), (model, "model-00002-of-00002.safetensors"),
                         (adapter, "adapter_model.safetensors")):
        save_file({"w": torch.from_numpy(rng.standard_normal((64, 48)).astype(np.float32))}, str(folder / name))
    (model / "config.json").write_text(json.dumps({"b": 1, "a": [3, 1, 2]}))
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"x": 0}}}))
    (model / "tokenizer.model").write_bytes(rng.bytes(500))
    (model / "README.md").write_text("not an input")
    (adapter / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj", "k_proj"], "r": 4}))
    (adapter / "notes.txt").write_text("not an input")
    data = tmp_path / "ref.parquet"
    data.write_bytes(rng.bytes(3000))

    found = InputDigests(model, {"a": adapter}, {"reference 0/ref.parquet": data}).result()
    assert found == {
        "model/config.json": config_digest(model / "config.json"),
        "model/model-00001-of-00002.safetensors": weights_digest(model / "model-00001-of-00002.safetensors"),
        "model/model-00002-of-00002.safetensors": weights_digest(model / "model-00002-of-00002.safetensors"),
        "model/tokenizer.json": config_digest(model / "tokenizer.json"),
        "model/tokenizer.model": file_digest(model / "tokenizer.model"),
        "adapter a/adapter_config.json": config_digest(adapter / "adapter_config.json"),
        "adapter a/adapter_model.safetensors": file_digest(adapter / "adapter_model.safetensors"),
        "reference 0/ref.parquet": file_digest(data)}
    assert len(set(found.values())) == len(found)
    assert InputDigests(model, prefix="against-").result() == {f"against-{k}": v for k, v in found.items()
                                                              if k.startswith("model/")}
    for path in (model / "model-00002-of-00002.safetensors", model / "tokenizer.model",
                 adapter / "adapter_model.safetensors", data):
        raw = bytearray(path.read_bytes())
        at = len(raw) - 1 - int(rng.integers(0, 64))  # in the data, not the header
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))
        changed = InputDigests(model, {"a": adapter}, {"reference 0/ref.parquet": data}).result()
        assert [k for k in found if changed[k] != found[k]] == [k for k in found if k.endswith(path.name)]
        found = changed
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["k_proj", "q_proj"]}))
    assert InputDigests(model, {"a": adapter}, {"reference 0/ref.parquet": data}).result() == found  # PEFT's sets
    with pytest.raises(FileNotFoundError):
        InputDigests(None, None, {"gone": tmp_path / "gone.parquet"}).result()


def test_a_fifo_among_the_inputs_is_never_opened(tmp_path):
    """A named input that is not a regular file (a fifo: opening it blocks until a writer comes) is not opened by its
    digest's thread, which would hold the process's exit; its digest fails instead, naming it."""
    fifo = tmp_path / "ref.parquet"
    os.mkfifo(fifo)
    digests = InputDigests(None, None, {"reference 0/ref.parquet": fifo})
    with pytest.raises(lora_eval.InputError, match="not a regular file"):
        digests.result()
