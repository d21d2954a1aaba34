"""The one error type for bad user input: the CLI prints it as a single line and exits 2."""

from __future__ import annotations

from pathlib import Path


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
