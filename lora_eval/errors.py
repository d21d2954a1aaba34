"""Errors that end a command, and the exit code of each (one contract for every command).

0 pass; 1 a threshold crossed; 2 bad usage or input (InputError: one line naming the file, key or row and what was
expected); 3 an internal error; 130 / 143 interrupted by SIGINT / SIGTERM (Interrupted: the finished parts are kept
and re-running the same command resumes).
"""

from __future__ import annotations

import signal
from pathlib import Path

EXIT_PASS, EXIT_THRESHOLD, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_CODES = """\b
Exit codes: 0 pass, 1 a threshold crossed, 2 bad usage or input (one line naming the file, key or row),
3 an internal error, 130 / 143 interrupted by SIGINT / SIGTERM (re-run the same command to resume)."""


class InputError(Exception):
    """A file, key or argument the user gave is wrong; the message names what and what was expected."""

    def __init__(self, where: str | Path, problem: str, key: str | None = None):
        self.where = str(where)
        self.key = key
        self.problem = problem
        parts = [self.where] + ([key] if key else []) + [problem]
        super().__init__(": ".join(parts))


class UnsupportedError(InputError):
    """The input is well formed but asks for a feature lora-eval does not compute (named in the message)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a run; the message says what was kept and how to resume."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.exit_code = 128 + signum  # 130 for SIGINT, 143 for SIGTERM
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")


class PeerFailed(Exception):
    """Another rank of a multi-process job failed (and says so): this rank stops with the same exit code, printing
    nothing (distributed.py)."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(f"another rank failed (exit code {code})")
