"""The run protocol, written once for every task (compare, mmlu, diagnose, dump-reference), on one process or N ranks.

    check      every rank checks the arguments (Task.check); one line says what is wrong (distributed.together)
    lock       the run folder's lock, before any input is read: the loser of a race stops at once
    hash       the input files' digests start on threads (Task.hashed; results.runfolder.InputDigests)
    plan       meanwhile the inputs are read and checked, the work planned (Task.plan)
    open       the fingerprint (inputs' digests, options, versions) against what OUT holds: a complete run of the same
               fingerprint is returned as saved (Task.read); a partial one is resumed; another is refused
    load       the model, once the run folder is this run's (Task.load), leaving the units of work to run
    work       the units, resumable parts of the run folder, shared out over data-parallel ranks (Task.run)
    merge      on rank 0: every unit's rows -> the result (Task.merge), its run record, its files (Task.files),
               committed in one rename; the other ranks return the run as committed

A task supplies what is its own: its arguments, inputs, units, how a unit becomes rows and how rows become its
tables. Results are written only here (results/runfolder.py does the writing).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..distributed import Ranks, together
from ..errors import EXIT_PASS
from ..results.runfolder import InputDigests, RunFolder, Work, check_out, fingerprint, now, versions
from ..results.tables import Phases, Verdict
from ..runners.compile_clock import COMPILE_CLOCK


@dataclass
class Hashed:
    """Input files whose digests enter the fingerprint (results.runfolder.InputDigests): a model folder's files,
    adapter folders' (name -> folder), named files hashed whole (name -> path); `prefix` goes before every name."""

    model: str | Path | None = None
    adapters: dict | None = None
    files: dict | None = None
    prefix: str = ""


@dataclass
class Plan:
    """What a task's planning leaves for the fingerprint: its options (those its results depend on), the packages
    beyond the usual ones whose versions count (`versions`), the phase the wait for the digests is timed in, and
    input files known only once the inputs are read (`hashed`: e.g. an MMLU folder's files)."""

    options: dict
    versions: tuple[str, ...] = ()
    phase: str | None = None
    hashed: list[Hashed] = field(default_factory=list)


@dataclass
class Units:
    """The work a task's load leaves to run: one weight per unit (tokens or rows, for the progress bar: `unit` names
    them), the phase that times it (None: the task times its own steps), and whether ranks run the units in
    lockstep (expert parallel: every rank takes part in every forward)."""

    weights: list[int]
    unit: str
    phase: str | None = "forward"
    lockstep: bool = False


@dataclass
class Run:
    """What the protocol gives a task while it runs: the phases' clock, the ranks, the run folder and its record,
    where notices go and whether progress is shown."""

    phases: Phases
    ranks: Ranks | None
    notice: object
    quiet: bool
    folder: RunFolder | None = None
    work: Work | None = None
    arguments: dict = field(default_factory=dict)

    def record(self, resolved: dict, **fields) -> dict:
        """The finished run's record (run.json): the arguments, what they `resolved` to (device, dtype, ...), the
        phases so far, the work's counts and the task's `fields`."""
        return self.folder.run_record(arguments=self.arguments, resolved=resolved, timings=self.phases.timings(),
                                      work=self.work.stats(), **fields)


class Task:
    """A task, as the protocol runs it. `command` names it in run folders; a `single_file` task writes one file
    (dump-reference) instead of a folder. `engine`: the engine whose graph captures and compiles are moved from the
    forward phase to the compile phase (None where the task times its own steps). A task that is not `distributed`
runs in one process (its check refuses ranks)."""

    command: str = ""
    single_file: bool = False
    distributed: bool = True
    engine = None

    def check(self, run: Run) -> dict:
        """The arguments checked (InputError naming the option), `run.arguments` set for the run record; returns
        the run's input paths (results.runfolder.run_inputs), which OUT may not be."""
        raise NotImplementedError

    def check_out(self, out: Path | None) -> None:
        """Refuse an `out` the task cannot write, once results.runfolder.check_out has passed it."""

    def hashed(self) -> list[Hashed]:
        """The input files known from the arguments, hashed from the moment the lock is taken."""
        raise NotImplementedError

    def plan(self, run: Run) -> Plan:
        """Under the lock: the inputs read and checked against each other, the work planned."""
        raise NotImplementedError

    def read(self, out: Path):
        """A complete run as it was saved."""
        raise NotImplementedError

    def cancel(self) -> None:
        """A complete run was found: stop what `plan` started (a child process) and load nothing."""

    def load(self, run: Run) -> Units:
        """The model (and what needs it), once the run folder is this run's."""
        raise NotImplementedError

    def run(self, work: Work, run: Run) -> None:
        """Every pending unit computed and recorded (`work.overlapped`, `work.steps` with `work.record`)."""
        raise NotImplementedError

    def merge(self, frames: dict[int, pd.DataFrame], run: Run):
        """Every unit's rows -> the result, its run record from `run.record(...)`."""
        raise NotImplementedError

    def files(self, result) -> dict[str, bytes] | bytes:
        """The result's files (name -> bytes), or a single-file task's bytes."""
        raise NotImplementedError

    def completed(self, result) -> dict:
        """What run.json's "completed" says beside the time."""
        if isinstance(result, Verdict):
            return dict(passed=result.passed, exit_code=result.exit_code)
        return dict(exit_code=EXIT_PASS)


def run_task(task: Task, out: str | Path | None, *, overwrite: bool = False, quiet: bool = False, notice=print):
    """`task` through the protocol of the module notes; returns its result (a complete run's as saved)."""
    run = Run(phases=Phases(), ranks=Ranks.from_env() if task.distributed else None, notice=notice, quiet=quiet)
    with together(run.ranks):  # every rank checks the same inputs; one line says what is wrong
        out = check_out(out, single_file=task.single_file, inputs=task.check(run))
        task.check_out(out)
    with RunFolder(out, task.command, overwrite=overwrite, single_file=task.single_file, notice=notice,
                   ranks=run.ranks) as folder:  # the lock, first
        run.folder = folder
        with together(run.ranks):
            digests = [InputDigests(h.model, h.adapters, h.files, h.prefix) for h in task.hashed()]
            plan = task.plan(run)
            digests += [InputDigests(h.model, h.adapters, h.files, h.prefix) for h in plan.hashed]
            with run.phases(plan.phase) if plan.phase else nullcontext():
                files = {name: digest for d in digests for name, digest in d.result().items()}
                package_versions = versions(*plan.versions)
        folder.open(fingerprint(task.command, files, plan.options, package_versions), dict(arguments=run.arguments))
        if folder.stored is not None:
            task.cancel()
            return task.read(out)
        units = task.load(run)
        compiled = COMPILE_CLOCK.seconds  # Triton's compile seconds so far (runners/compile_clock.py)
        with run.phases(units.phase) if units.phase else nullcontext():
            with folder.work(units.weights, task.command, units.unit, quiet, lockstep=units.lockstep) as work:
                run.work = work
                task.run(work, run)
        if task.engine is not None:
            run.phases.captured(task.engine.graph_stats(), COMPILE_CLOCK.seconds - compiled)
        return folder.finish(work, lambda frames: _merge(task, frames, run), lambda: task.read(out))


def _merge(task: Task, frames: dict[int, pd.DataFrame], run: Run):
    result = task.merge(frames, run)
    if task.single_file:
        run.folder.commit_file(task.files(result))
        return result
    result.run["completed"] = dict(at=now(), **task.completed(result))
    with run.phases("write"):  # (the reports show the phases before this one: results.tables.WRITTEN_AFTER_REPORTS)
        written = task.files(result)
    result.run["timings"] = run.phases.timings()
    run.folder.commit(written, result.run)
    return result

