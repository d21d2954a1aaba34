"""`lora-eval launch`: a command on several processes through torchrun's own launcher (torch.distributed.run's
configuration, torch.distributed.launcher's elastic_launch), keeping the exit codes of one process.

torchrun itself exits 1 whenever a worker fails, whatever code the worker returned (so an input error reads as
"a threshold was crossed" in CI), and prints its own report of the failure (a traceback of ChildFailedError, the
agent's log lines) around the worker's one line. Here:
- the worker's code is the job's code: every rank of a job leaves with the same code (distributed.py exchanges the
  outcomes), and where ranks differ the first failure decides; a code of 130 / 143 only where nothing else failed
  (the launcher stops the other workers with SIGTERM once one has failed);
- a worker killed by a signal (the kernel's OOM killer, a segfault) is an internal error: exit 3, one line naming
  the rank and the signal;
- SIGINT / SIGTERM to the launcher go on to the workers (each stops after its current unit, its parts kept); the
  job exits 130 / 143, rank 0 says so;
- the agent's logging is silent (LORA_EVAL_DEBUG=1 shows it), its per-worker log folders are not written.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

from .errors import EXIT_INTERNAL

STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # a worker's code when it was stopped, not failed


def launch(command: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None) -> int:
    """Run `lora-eval COMMAND...` in `nproc_per_node` processes on this node of `nnodes`; return the job's exit
    code (module notes)."""
    options = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes), "--log-dir", os.devnull]
    if nnodes == 1 and master_port is None:  # torchrun --standalone: a rendezvous on a free local port
        options += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    else:
        options += ["--rdzv-backend", "static", "--node-rank", str(node_rank),
                    "--master-addr", master_addr or "127.0.0.1", "--master-port", str(master_port or 29500)]
    if not os.environ.get("LORA_EVAL_DEBUG"):
        _silence_launcher()
    config, program, arguments = config_from_args(parse_args([*options, "--module", "lora_eval", *command]))
    try:
        elastic_launch(config, program)(*arguments)
    except ChildFailedError as e:
        return job_code({rank: failure.exitcode for rank, failure in e.failures.items()},
                        first=e.get_first_failure()[0])
    except SignalException as e:  # this process was asked to stop: the agent has stopped the workers with it
        return 128 + int(e.sigval)
    return 0


def job_code(codes: dict[int, int], first: int) -> int:
    """The exit code of a job from its failed workers' codes (rank -> code; a negative code: killed by that
    signal); `first`: the rank that failed first."""
    killed = {rank: -code for rank, code in codes.items() if code < 0}
    if killed:
        rank = min(killed)
        print(f"error: rank {rank} was killed by {signal.Signals(killed[rank]).name} (out of host memory, a crash "
              "in a library, or a kill from outside); the parts finished are kept: re-run the command to resume",
              file=sys.stderr)
        return EXIT_INTERNAL
    failed = [code for code in codes.values() if code not in STOPPED]
    if not failed:
        return codes[first]
    return codes[first] if codes[first] not in STOPPED else failed[0]


def _silence_launcher() -> None:
    """The agent's loggers (torch.distributed.*) say nothing: each sets its own level as it is created, so every
    one that exists now is turned off, and so is the root of the tree for those made later."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).disabled = True
    logging.getLogger("torch.distributed").disabled = True
