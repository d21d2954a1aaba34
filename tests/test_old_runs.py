"""Run folders written by lora-eval before issue 43 moved the package into layer folders (commit 10ede6b; how:
tests/data/runs-10ede6b/make.py): today's code returns the complete ones as saved, without loading a model, and
finishes the partial ones (a compare and an mmlu stopped after their first unit) from their parts.

The stored fingerprints' package versions are set to this environment's before each test: they name the machine's
packages, not the code's layout, and a run of other versions is rightly refused (test_run_folders.py). Everything else
in the folders is as the old code wrote it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from lora_eval import compare, mmlu, read_run
from lora_eval.engine.engine import Engine, EngineOptions
from lora_eval.results.runfolder import versions

OLD = Path(__file__).parent / "data" / "runs-10ede6b"
OPTIONS = EngineOptions(device="cpu", dtype="float32")
TABLES = {"compare": ["summary.csv", "samples.csv", "gates.csv", "tokens.parquet", "worst_tokens.parquet"],
          "mmlu": ["mmlu_summary.csv", "mmlu_subjects.csv", "mmlu_questions.parquet"]}
EXTRA_VERSIONS = {"compare": (), "mmlu": ("datasets", "tokenizers")}


@pytest.fixture
def runs(tmp_path):
    """A copy of the old folders, with this environment's versions in their fingerprints, run with the thread count
    they were made with (part of a CPU run's fingerprint: EngineOptions.record)."""
    root = tmp_path / "runs"
    shutil.copytree(OLD, root, ignore=shutil.ignore_patterns("make.py"))
    for path in root.glob("*/run.json"):
        record = json.loads(path.read_text())
        record["fingerprint"]["versions"] = versions(*EXTRA_VERSIONS[record["command"]])
        path.write_text(json.dumps(record, indent=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield root
    torch.set_num_threads(threads)


def run(command: str, root: Path, out: Path, notices: list):
    inputs = root / "inputs"
    adapters = {p.name: p for p in sorted((inputs / "adapters").iterdir())}
    common = dict(out=out, options=OPTIONS, quiet=True, notice=notices.append)
    if command == "compare":
        return compare(inputs / "model", adapters, [inputs / "reference.parquet"], batch_tokens=64, **common)
    return mmlu(inputs / "model", adapters, inputs / "mmlu", shots=1, batch_tokens=256, **common)


def tables(folder: Path, command: str) -> dict[str, pd.DataFrame]:
    return {name: pd.read_csv(folder / name) if name.endswith(".csv") else pd.read_parquet(folder / name)
            for name in TABLES[command]}


def assert_same_tables(found: dict, expected: dict) -> None:
    for name, frame in expected.items():
        assert list(found[name].columns) == list(frame.columns), name
        assert len(found[name]) == len(frame) and len(frame), name
        for column in frame.columns:
            a, b = found[name][column], frame[column]
            if pd.api.types.is_float_dtype(b):
                np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-6, atol=1e-9, err_msg=name)
            else:
                assert a.astype(str).tolist() == b.astype(str).tolist(), f"{name}: {column}"


@pytest.mark.parametrize("command", ["compare", "mmlu"])
def test_a_complete_old_run_is_returned_as_saved(runs, command, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a complete run of the same inputs loads no model")

    monkeypatch.setattr(Engine, "load", no_load)
    folder = runs / f"{command}-complete"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = run(command, runs, folder, notices := [])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing rewritten
    saved = read_run(folder)
    assert result.exit_code == saved.exit_code == json.loads(before["run.json"])["completed"]["exit_code"]
    assert_same_tables(tables(folder, command), tables(OLD / f"{command}-complete", command))
    assert any("already" in n for n in notices), notices


@pytest.mark.parametrize("command", ["compare", "mmlu"])
def test_a_partial_old_run_resumes_from_its_parts(runs, command):
    out = runs / f"{command}-partial"
    staged = out.with_name(out.name + ".partial")
    parts = sorted(p.name for p in (staged / "parts").glob("part-*.parquet"))
    assert len(parts) == 1
    result = run(command, runs, out, notices := [])
    assert not staged.exists() and (out / "run.json").exists()
    assert result.run["work"]["resumed_units"] == 1 and result.run["work"]["units"] > 1
    assert any(n.startswith("resuming: 1 of") for n in notices), notices
    assert_same_tables(tables(out, command), tables(OLD / f"{command}-complete", command))
