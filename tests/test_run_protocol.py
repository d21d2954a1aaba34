"""The run protocol (lora_eval/tasks/run.py) on a task of its own, without a model: a task that sums random numbers
in units. What every task gets from it: the input check before any lock or folder, the lock, the fingerprint of
hashed inputs and options, a complete run returned as saved without loading, a stopped run resumed from its parts
(only the rest computed), another run's folder refused, and one record and one set of files written at the end."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lora_eval.errors import InputError
from lora_eval.results import runfolder
from lora_eval.results.runfolder import Work, read_record, run_inputs
from lora_eval.tasks.run import Hashed, Plan, Run, Task, Units, run_task


@dataclass
class Total:
    total: float
    units: int
    run: dict


class Sums(Task):
    """Rows of numbers from a CSV file, summed in units of `per_unit` rows; `stop_after`: a KeyboardInterrupt once that
    many units are recorded (Ctrl-C)."""

    command = "sums"

    def __init__(self, data: Path, per_unit: int, stop_after: int | None = None):
        self.data, self.per_unit, self.stop_after = data, per_unit, stop_after
        self.calls = dict(load=0, units=[])

    def check(self, run: Run) -> dict:
        if not isinstance(self.per_unit, int) or self.per_unit < 1:
            raise InputError("--per-unit", f"expected a positive integer, found {self.per_unit!r}")
        run.arguments = dict(data=str(self.data), per_unit=self.per_unit)
        return run_inputs(data=self.data)

    def hashed(self) -> list[Hashed]:
        return [Hashed(files={"data": self.data})]

    def plan(self, run: Run) -> Plan:
        with run.phases("read"):
            self.rows = pd.read_csv(self.data)["x"].to_numpy()
        return Plan(dict(per_unit=self.per_unit), phase="read")

    def read(self, out: Path) -> Total:
        return Total(**json.loads((out / "sums.json").read_text()), run=read_record(out))

    def load(self, run: Run) -> Units:
        self.calls["load"] += 1
        n = -(-len(self.rows) // self.per_unit)
        return Units([self.per_unit] * n, "rows", phase="forward")

    def run(self, work: Work, run: Run) -> None:
        for u in work.steps(range(len(work.weights))):
            self.calls["units"].append(u)
            part = self.rows[u * self.per_unit:(u + 1) * self.per_unit]
            work.record(u, pd.DataFrame(dict(unit=[u], total=[float(part.sum())])))
            if self.stop_after is not None and len(self.calls["units"]) == self.stop_after:
                raise KeyboardInterrupt

    def merge(self, frames: dict[int, pd.DataFrame], run: Run) -> Total:
        total = sum(float(f["total"].iloc[0]) for f in frames.values())
        return Total(total, len(frames), run.record(resolved=dict(device="cpu")))

    def files(self, result: Total) -> dict[str, bytes]:
        return {"sums.json": json.dumps(dict(total=result.total, units=result.units)).encode()}


@pytest.fixture(autouse=True)
def sums_is_ours(monkeypatch):
    """A run folder is lora-eval's when its command is one of runfolder.COMMANDS (a new task adds its own there)."""
    monkeypatch.setattr(runfolder, "COMMANDS", (*runfolder.COMMANDS, "sums"))


@pytest.fixture
def data(tmp_path, seed):
    x = np.random.default_rng(seed).normal(size=23)
    path = tmp_path / "data.csv"
    pd.DataFrame(dict(x=x)).to_csv(path, index=False)
    return path, float(pd.read_csv(path)["x"].sum())


def quiet(task, out, **kwargs):
    return run_task(task, out, quiet=True, notice=kwargs.pop("notice", lambda _: None), **kwargs)


def test_a_run_computes_every_unit_once_and_writes_one_record(data, tmp_path):
    path, expected = data
    out = tmp_path / "out"
    task = Sums(path, per_unit=5)
    result = quiet(task, out)
    assert result.total == pytest.approx(expected, rel=1e-12) and result.units == 5
    assert task.calls == dict(load=1, units=[0, 1, 2, 3, 4])
    record = read_record(out)
    assert record["status"] == "complete" and record["command"] == "sums" and record["completed"]["exit_code"] == 0
    assert record["fingerprint"]["options"] == dict(per_unit=5) and set(record["fingerprint"]["files"]) == {"data"}
    assert record["arguments"] == dict(data=str(path), per_unit=5) and record["work"]["units"] == 5
    assert {"read_s", "forward_s", "write_s", "total_s"} <= set(record["timings"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv", "out"]  # no lock or parts left


def test_the_same_run_again_loads_nothing(data, tmp_path):
    path, expected = data
    out = tmp_path / "out"
    quiet(Sums(path, per_unit=5), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = Sums(path, per_unit=5)
    saved = quiet(again, out)
    assert saved.total == pytest.approx(expected, rel=1e-12) and saved.units == 5 and saved.run["work"]["units"] == 5
    assert again.calls == dict(load=0, units=[])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_stopped_run_resumes_with_the_rest_only(data, tmp_path):
    path, expected = data
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        quiet(Sums(path, per_unit=4, stop_after=2), out)
    assert not out.exists() and len(list((tmp_path / "out.partial" / "parts").glob("part-*.parquet"))) >= 1
    notices = []
    resumed = Sums(path, per_unit=4)
    result = quiet(resumed, out, notice=notices.append)
    assert resumed.calls["units"] == [2, 3, 4, 5]
    assert result.total == pytest.approx(expected, rel=1e-12) and result.units == 6
    assert notices and notices[0].startswith("resuming: 2 of 6 sums units already done")
    assert not (tmp_path / "out.partial").exists()


def test_other_inputs_are_refused_and_change_nothing(data, tmp_path):
    path, _ = data
    out = tmp_path / "out"
    quiet(Sums(path, per_unit=5), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError, match="per_unit 5 -> 6"):
        quiet(Sums(path, per_unit=6), out)
    pd.DataFrame(dict(x=[1.0, 2.0])).to_csv(path, index=False)  # the input file changed
    with pytest.raises(InputError, match="data changed"):
        quiet(Sums(path, per_unit=5), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert quiet(Sums(path, per_unit=5), out, overwrite=True).total == 3.0


def test_a_bad_argument_or_an_input_as_out_is_refused_before_anything(data, tmp_path):
    path, _ = data
    for task, out, needle in [(Sums(path, per_unit=0), tmp_path / "out", "--per-unit"),
                              (Sums(path, per_unit=2), path, "--out")]:
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(InputError, match=needle):
            quiet(task, out)
        assert task.calls == dict(load=0, units=[])
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no lock, no folder


def test_in_memory_a_run_writes_nothing(data, tmp_path):
    path, expected = data
    result = quiet(Sums(path, per_unit=7), None)
    assert result.total == pytest.approx(expected, rel=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]

