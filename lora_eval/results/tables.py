"""Results: each task's tables (DataFrames first) and run record, the table files of a run folder, and reading a
complete run folder back.

A compare run folder holds summary.csv, samples.csv, tokens.parquet, worst_tokens.parquet, gates.csv (the adapter
applied gate, one row per adapter; only its header with --no-adapter-check), report.md, report.html and run.json;
an mmlu run folder mmlu_questions.parquet, mmlu_subjects.csv, mmlu_summary.csv, mmlu.md, report.html and run.json.
run.json is the run record: the command, its arguments, the fingerprint (runfolder.py), versions, timings, and
"status": "complete" once the run has finished. A folder without that status is refused. Its timings are the
phases of `Phases` (seconds): data / read / tokenize (the inputs), load, compile (CUDA-graph capture, Triton's
compiles), forward, metrics, write (encoding the tables and rendering the reports) and total_s, from the task's start
to its files.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ..errors import EXIT_PASS, EXIT_THRESHOLD, InputError
from .metrics import GATE_COLUMNS
from .routing import ROUTING_COLUMNS
from .runfolder import read_record

WORST_PER_ADAPTER = 5  # worst tokens listed per adapter
COMPARE_SUMMARY_COLUMNS = ["adapter", "n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3",
                           "mult_prob_error", "passed"]
WORST_COLUMNS = ["adapter", "sample_id", "position", "token_id", "token", "context", "ref", "engine", "d", "sampler"]
QUESTION_COLUMNS = ["subject", "category", "question_index", "model", "answer", "prediction", "correct",
                    "lp_A", "lp_B", "lp_C", "lp_D"]
SUBJECT_COLUMNS = ["subject", "category", "model", "questions", "correct", "accuracy", "delta", "delta_low",
                   "delta_high"]
MMLU_SUMMARY_COLUMNS = ["model", "group", "questions", "accuracy", "delta", "delta_low", "delta_high", "passed"]


# The phases of a run, in the order run.json lists them (a task records those it has): reading the inputs (MMLU's
# data files; compare's references, validated; and their fingerprints for the run folder), tokenising, loading
# (tokenizer, adapters, the model to the device), CUDA-graph capture and its warm-up, the forward passes (less the
# capture; diagnose's k2 pass, layer comparison and adapter effects), the metrics, and encoding and writing the files.
PHASES = ("data", "read", "tokenize", "load", "compile", "forward", "k2", "compare", "effects", "metrics", "write")
WRITTEN_AFTER_REPORTS = ("write_s", "total_s")  # known only once the reports are rendered: run.json alone has them


class Phases:
    """Where a run's time goes: `with phases("load"): ...` adds the block's seconds to load_s (a phase may come
    back, e.g. adapters read before the run folder's lock and the model after it); `timings()` gives them in PHASES
    order and total_s, the seconds since the task began."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(seconds, 0.0)

    def captured(self, graph_stats: dict | None, compiled_s: float = 0.0) -> None:
        """The CUDA-graph captures (with their warm-up: Triton compiles) and Triton's compiles in eager forwards
        (`compiled_s`, runners/compile_clock.py) happen inside the forwards: their seconds, as the engine's graph
        runner counts them (`capture_s` of Engine.graph_stats()) and as the clock does, move from forward to
        compile; 0 on the CPU (nothing compiles, no graphs)."""
        seconds = compiled_s + (float(graph_stats.get("capture_s", 0.0)) if graph_stats else 0.0)
        seconds = min(seconds, self.seconds.get("forward", 0.0))
        self.seconds["forward"] = self.seconds.get("forward", 0.0) - seconds
        self.add("compile", seconds)

    def timings(self) -> dict[str, float]:
        order = [p for p in PHASES if p in self.seconds] + [p for p in self.seconds if p not in PHASES]
        return {**{f"{p}_s": self.seconds[p] for p in order}, "total_s": time.perf_counter() - self.start}


class Verdict:
    """A result's verdict, from its summary's `passed` column: every row passed, and the exit code that says so."""

    summary: pd.DataFrame

    @property
    def passed(self) -> bool:
        return bool(self.summary["passed"].all())

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.passed else EXIT_THRESHOLD


def no_gates() -> pd.DataFrame:
    """The gates table of a run without the adapter applied gate: its columns, no row."""
    return pd.DataFrame({c: pd.Series(dtype=bool if c == "applied" else object) for c in GATE_COLUMNS})


@dataclass
class CompareResult(Verdict):
    summary: pd.DataFrame  # one row per adapter ('base' for the base model) plus 'overall'
    samples: pd.DataFrame  # one row per sample
    tokens: pd.DataFrame  # one row per predicted token
    run: dict = field(default_factory=dict)  # the run record (run.json)
    worst: pd.DataFrame = field(default_factory=pd.DataFrame)  # worst tokens per adapter, decoded with context
    gates: pd.DataFrame = field(default_factory=no_gates)  # the adapter applied gate: one row per adapter
    # routing agreement with the references' routed experts, per adapter and MoE layer (results/routing.py); empty
    # when they carry none
    routing: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ROUTING_COLUMNS))

    @property
    def passed(self) -> bool:
        """Every summary row passed and every adapter was applied (an adapter without reference rows has no
        summary row, but its gate still counts)."""
        return bool(self.summary["passed"].all()) and bool(self.gates["applied"].all())


@dataclass
class MmluResult(Verdict):
    questions: pd.DataFrame  # one row per (model, test question)
    subjects: pd.DataFrame  # one row per (subject, model)
    summary: pd.DataFrame  # one row per (model, group)
    run: dict = field(default_factory=dict)  # the run record (run.json)


# ---- the files ------------------------------------------------------------------------------------------


def _csv(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode("utf-8")


def _parquet(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def table_files(result: CompareResult | MmluResult) -> dict[str, bytes]:
    """The run folder's table files of a result, as bytes (the same tables give the same bytes)."""
    if isinstance(result, CompareResult):
        return {"summary.csv": _csv(result.summary), "samples.csv": _csv(result.samples),
                "tokens.parquet": _parquet(result.tokens), "worst_tokens.parquet": _parquet(result.worst),
                "gates.csv": _csv(result.gates),
                **({"routing.csv": _csv(result.routing)} if len(result.routing) else {})}
    return {"mmlu_questions.parquet": _parquet(result.questions), "mmlu_subjects.csv": _csv(result.subjects),
            "mmlu_summary.csv": _csv(result.summary)}


# ---- reading a run folder back --------------------------------------------------------------------------


def complete_record(run_dir: str | Path, commands: tuple[str, ...] = ("compare", "mmlu")) -> dict:
    """run.json of a complete run folder of one of `commands`; InputError for anything else, saying how to finish a
    partial run."""
    run_dir = Path(run_dir)
    partial = run_dir.with_name(run_dir.name + ".partial")
    if not run_dir.exists():
        if partial.is_dir():
            raise InputError(run_dir, f"the run is not finished: its parts are in {partial}; run the command that "
                             "started it again to resume")
        raise InputError(run_dir, "run folder not found")
    if not run_dir.is_dir():
        raise InputError(run_dir, "not a run folder (a file)")
    record = read_record(run_dir)
    if record.get("status") != "complete":
        raise InputError(run_dir, "a partial run (no completion record in run.json): run the command that started "
                         "it again (its arguments are in run.json) to resume it")
    if record.get("command") not in commands:
        raise InputError(run_dir / "run.json", f"a {record.get('command')!r} run, expected a run of "
                         f"{' or '.join(commands)}", key="command")
    return record


def read_run(run_dir: str | Path) -> CompareResult | MmluResult:
    """A complete compare run folder as a CompareResult, an mmlu one as an MmluResult: tables and run.json as saved."""
    run_dir = Path(run_dir)
    record = complete_record(run_dir)
    if record["command"] == "compare":
        summary = _require(_read_csv(run_dir / "summary.csv", ["adapter", "failed"]), run_dir / "summary.csv",
                           COMPARE_SUMMARY_COLUMNS)
        samples = _require(_read_csv(run_dir / "samples.csv", ["adapter", "sample_id"]), run_dir / "samples.csv",
                           ["adapter", "sample_id"])
        tokens = _require(_read_parquet(run_dir / "tokens.parquet"), run_dir / "tokens.parquet",
                          ["adapter", "sample_id", "position", "d", "mask"])
        worst = _require(_read_parquet(run_dir / "worst_tokens.parquet"), run_dir / "worst_tokens.parquet",
                         WORST_COLUMNS)
        gates = _require(_read_csv(run_dir / "gates.csv", ["adapter", "reason"]), run_dir / "gates.csv", GATE_COLUMNS)
        gates["applied"] = gates["applied"].astype(bool)
        for frame in (tokens, worst):
            for column in ("adapter", "sample_id", "token", "context"):
                if column in frame:
                    frame[column] = frame[column].astype(object)
        routing = _require(_read_csv(run_dir / "routing.csv", ["adapter"]), run_dir / "routing.csv", ROUTING_COLUMNS) \
            if (run_dir / "routing.csv").is_file() else pd.DataFrame(columns=ROUTING_COLUMNS)
        return CompareResult(summary=summary, samples=samples, tokens=tokens, run=record, worst=worst, gates=gates,
                             routing=routing)
    summary = _require(_read_csv(run_dir / "mmlu_summary.csv", ["model", "group"]), run_dir / "mmlu_summary.csv",
                       MMLU_SUMMARY_COLUMNS)
    subjects = _require(_read_csv(run_dir / "mmlu_subjects.csv", ["subject", "category", "model"]),
                        run_dir / "mmlu_subjects.csv", SUBJECT_COLUMNS)
    questions = _require(_read_parquet(run_dir / "mmlu_questions.parquet"), run_dir / "mmlu_questions.parquet",
                         QUESTION_COLUMNS)
    for column in ("model", "subject", "category", "answer", "prediction"):
        questions[column] = questions[column].astype(object)
    return MmluResult(questions=questions, subjects=subjects, summary=summary, run=record)


def _require(frame: pd.DataFrame, path: Path, columns: list[str]) -> pd.DataFrame:
    """A saved table with the columns the reports read, or an error naming the first missing one."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(path, "missing column (was this file written by lora-eval?)", key=missing[0])
    return frame


def _read_csv(path: Path, text: list[str]) -> pd.DataFrame:
    """A saved table as written: `text` columns as exact strings ('' stays '', 'NA' stays 'NA'), empty cells of
    the other columns as NaN (how to_csv writes NaN); float columns round-trip exactly."""
    if not path.is_file():
        raise InputError(path, "file missing from the run folder")
    try:
        header = pd.read_csv(path, nrows=0).columns
        frame = pd.read_csv(path, dtype={c: str for c in text if c in header}, keep_default_na=False,
                            na_values={c: [""] for c in header if c not in text})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise InputError(path, f"not a readable CSV file ({e})") from None
    for column in text:
        if column in frame:
            frame[column] = frame[column].astype(object)
    return frame


def _read_parquet(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise InputError(path, "file missing from the run folder")
    try:
        return pd.read_parquet(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(path, f"not a readable Parquet file ({e})") from None


# ---- diagnose ------------------------------------------------------------------------------------------------

DIAGNOSE_LAYER_COLUMNS = ["adapter", "layer", "point", "rel_error", "router_flip_rate"]
DIAGNOSE_MODULE_COLUMNS = ["adapter", "layer", "module", "lora_rel_effect"]
DIAGNOSE_POINTS = ["attention", "router", "moe", "residual"]  # per decoder layer, in this order


@dataclass
class DiagnoseResult:
    """`lora-eval diagnose`: where the engine parts from a reference computation, layer by layer."""

    layers: pd.DataFrame  # one row per (adapter or 'base', layer, point): rel_error, router_flip_rate (router only)
    modules: pd.DataFrame  # one row per (adapter, targeted module): lora_rel_effect = ‖ΔW x‖ / ‖W x‖
    record: dict = field(default_factory=dict)  # diagnose.json: per adapter first_divergent_layer, how measured, ...
    run: dict = field(default_factory=dict)  # the run record (run.json)

    exit_code = EXIT_PASS  # a diagnosis has no threshold to cross


def diagnose_table_files(result: DiagnoseResult) -> dict[str, bytes]:
    """layers.csv, modules.csv and diagnose.json of a diagnose run folder."""
    diagnosis = (json.dumps(result.record, indent=2, default=str) + "\n").encode("utf-8")
    return {"layers.csv": _csv(result.layers), "modules.csv": _csv(result.modules), "diagnose.json": diagnosis}


def read_diagnose(run_dir: str | Path) -> DiagnoseResult:
    """A complete diagnose run folder as a DiagnoseResult: its tables, diagnose.json and run.json as saved."""
    run_dir = Path(run_dir)
    record = complete_record(run_dir, ("diagnose",))
    layers = _require(_read_csv(run_dir / "layers.csv", ["adapter", "point"]), run_dir / "layers.csv",
                      DIAGNOSE_LAYER_COLUMNS)
    modules = _require(_read_csv(run_dir / "modules.csv", ["adapter", "module"]), run_dir / "modules.csv",
                       DIAGNOSE_MODULE_COLUMNS)
    modules["layer"] = modules["layer"].astype("Int64")  # empty outside the decoder layers
    path = run_dir / "diagnose.json"
    if not path.is_file():
        raise InputError(path, "file missing from the run folder")
    try:
        diagnosis = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not valid JSON ({e})") from None
    return DiagnoseResult(layers=layers, modules=modules, record=diagnosis, run=record)
