"""Data parallel over torch.distributed, started by `lora-eval launch` (launch.py: torchrun's launcher, exit codes
kept) or torchrun itself (NCCL on GPUs, gloo on CPUs): which rank computes which units of work, and the few messages
ranks exchange.

    lora-eval launch --nproc-per-node N compare ...                  (--nnodes and --master-addr for more machines)

Every rank reads and checks the same inputs and builds the same list of units (batches, samples). Rank 0 owns the
run folder (lock, staging, resume, the merge and the commit: results/runfolder.py); it shares which units earlier runs
finished, every rank takes its share of the rest (`assign`: token-balanced, deterministic), computes it and writes its
own parts, and rank 0 merges all parts into the files a single process writes. A unit's result does not depend on
which rank computed it (the same batches), so the merged files equal a single process's byte for byte wherever the
engine is batch-invariant.

Expert parallel (engine/expert_parallel.py) runs on the same ranks, its batches in lock-step (Work.steps).

Failures: the phases run inside `together()`, which ends with an exchange of every rank's outcome. An error on any
rank fails every rank with the same exit code; the lowest failing rank prints the one line (naming its rank), the
others exit quietly (PeerFailed). A rank whose work fails marks it in the process group's store, and the others stop
after their current unit instead of finishing their share. SIGINT / SIGTERM (torchrun stops the other workers
when one dies) stop each rank after its current unit, its parts kept.

Once a job's outcome is decided (an exchange found a failure; the run's final exchange, RunFolder.finish; a complete
run found in the folder), SIGTERM stops nothing more: every rank leaves with that outcome. torchrun sends SIGTERM to
the ranks still running as soon as one exits, and a rank exits with 1 when the thresholds are crossed: else rank 0,
still writing its summary, would print "interrupted by SIGTERM" instead of the verdict (exit 143), and after a
failure the failing rank's one line would come with an "interrupted by SIGTERM" line of a peer; a rank a little late
after the last exchange (a loaded machine) is enough (BENCHMARKS-history 18.3). Signals arriving during such a
collective are held until its outcome is known.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import EXIT_INPUT, EXIT_INTERNAL, InputError, Interrupted, PeerFailed

FAILED = "lora_eval/failed"  # store key: set by a rank whose work failed


def close_process_group() -> None:
    """At exit, while Python still runs: the process group torn down in order. Left to the interpreter's teardown,
    a gloo worker may abort (SIGABRT) after its run has finished (seen in CI under load: BENCHMARKS-history 18.3);
    torch asks for destroy_process_group before exit."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Ranks:
    """This process's place in a torchrun job: `rank` of `world`, `local_rank` its GPU on this node."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls) -> "Ranks | None":
        """The job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / PORT), its process group
        initialised once (gloo for the messages, NCCL for GPU tensors where there are GPUs); None for one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
            atexit.register(close_process_group)
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def share(self, value):
        """Rank 0's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def together(self, final: bool = False):
        """Run the block on every rank, then `exchange` the outcomes (Interrupted passes at once: the peers are being
        stopped too). `final`: the job's last exchange (module notes)."""
        error = None
        try:
            yield
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is shared, then raised again by exchange
            error = e
        self.exchange(error, final)

    def exchange(self, error: Exception | None, final: bool = False) -> None:
        """Every rank's outcome to every rank. If any rank failed, every rank raises: the lowest rank with an error
        of its own raises that error (marked with its rank where not every rank failed alike), the others PeerFailed
        with its exit code. A rank that stopped because a peer failed (PeerFailed) only follows. A failure, or a
        `final` exchange, decides the job's outcome: SIGTERM is ignored from then on (module notes)."""
        own = error is not None and not isinstance(error, PeerFailed)
        outcome = None if error is None else (exit_code(error), f"{error}", own)
        outcomes = [None] * self.world
        with held_signals() as held:
            dist.all_gather_object(outcomes, outcome)
            failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
            if failed or final:
                held.conclude()
        if not failed:
            return
        first, (code, _, _) = next(((r, o) for r, o in failed if o[2]), failed[0])
        if self.rank != first or not own:
            raise PeerFailed(code)
        if len(failed) < self.world or len({o for _, o in failed}) > 1:
            error.rank = self.rank  # the CLI names it: "error: rank 1: ..."
        raise error

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def mark_failed(self) -> None:
        """Tell the other ranks that this one's work failed (they stop after their current unit)."""
        _store().set(FAILED, str(self.rank))

    def peer_failed(self) -> bool:
        return _store().check([FAILED])


class held_signals:
    """`with held_signals() as held:` around a collective whose outcome decides what a stop means. Inside, SIGINT and
    SIGTERM are recorded, not handled. On leaving, the handlers in place before are back and the first signal
    recorded is raised again (handled now), unless `held.conclude()` was called inside: the job's outcome is decided
    and this rank leaves with it, so SIGTERM is ignored from then on (set before the block ends: there is no moment
    with the old handler back) and what was recorded is dropped. Signals reach Python's main thread only: elsewhere
    nothing is held."""

    def __init__(self):
        self.signals: list[int] = []
        self.concluded = False
        self._restore: dict = {}

    def __enter__(self) -> "held_signals":
        if threading.current_thread() is threading.main_thread():
            self._restore = {signum: signal.signal(signum, lambda signum, frame: self.signals.append(signum))
                             for signum in (signal.SIGINT, signal.SIGTERM)}
        return self

    def conclude(self) -> None:
        self.concluded = True

    def __exit__(self, kind, error, traceback) -> None:
        if self.concluded and self._restore:
            self._restore[signal.SIGTERM] = signal.SIG_IGN
        for signum, handler in self._restore.items():
            signal.signal(signum, handler)
        if self._restore and self.signals and not self.concluded and kind is None:
            signal.raise_signal(self.signals[0])  # the stop asked for meanwhile, now


def _store():
    return dist.distributed_c10d._get_default_store()


def together(ranks: "Ranks | None", final: bool = False):
    """`ranks.together(final)`, or nothing to share for one process."""
    return contextlib.nullcontext() if ranks is None else ranks.together(final)


def exit_code(error: BaseException) -> int:
    if isinstance(error, PeerFailed):
        return error.code
    if isinstance(error, Interrupted):
        return error.exit_code
    return EXIT_INPUT if isinstance(error, InputError) else EXIT_INTERNAL


def assign(units: list[int], weights: list[int], world: int) -> list[list[int]]:
    """units -> one list per rank: consecutive runs of `units` (in the order given) of about equal weight, each
    rank's within the heaviest unit of the total / world (a unit goes to the rank whose share of the cumulative
    weight holds the unit's middle). Consecutive, so that neighbouring units stay together: a subject's MMLU
    batches, or a compare group's, share their prefixes, which a rank then computes once rather than every rank
    (engine/prefixes.py). The same on every rank for the same units."""
    units = list(units)
    total = sum(weights[u] for u in units)
    shares, before = [[] for _ in range(world)], 0
    for i, unit in enumerate(units):
        middle = before + weights[unit] / 2
        shares[min(world - 1, int(middle * world / total) if total else i * world // len(units))].append(unit)
        before += weights[unit]
    return shares
