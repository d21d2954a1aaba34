"""MMLU's prompts tokenised in a child process while the model loads (`lora-eval mmlu` loading onto a GPU).

In one process, loading the tokenizer (transformers' import and `AutoTokenizer`: ~4 s on the GPU machine) and
encoding the full test split (~2-3 s) came before the weights' load. In a child process they run beside it: a load
beside a child tokenising with half the cores' threads ran as fast as alone, where the same work on a thread of the
loading process had slowed the load by about what it hid (BENCHMARKS-history sections 14 and 15). The child gets
the questions as Parquet files, tokenises them with `mmlu_prompts.tokenize` (the same function the one-process
path calls), and hands back the token ids as .npy files and the rest as JSON; an input error there is raised here
as the same error, with the same message.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np
import pandas as pd

from ...errors import InputError, UnsupportedError
from .prompts import Tokenized, tokenize

ERRORS = {"InputError": InputError, "UnsupportedError": UnsupportedError}


def _stop(process: subprocess.Popen, folder: Path) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    shutil.rmtree(folder, ignore_errors=True)


class TokenizeBeside:
    """Starts the child at construction; `result()` waits for its Tokenized, `cancel()` stops it and removes its
    folder (also on leaving a `with` block, and when the object is dropped or the process exits: an error on the
    way, before `result()`, leaves no child and no folder behind)."""

    def __init__(self, model: str | Path, questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int,
                 max_len: int | None):
        self.dir = Path(tempfile.mkdtemp(prefix="lora-eval-mmlu-"))
        questions.to_parquet(self.dir / "questions.parquet", index=False)
        if dev is not None:
            dev.to_parquet(self.dir / "dev.parquet", index=False)
        (self.dir / "request.json").write_text(json.dumps(dict(model=str(model), shots=shots, max_len=max_len)))
        env = dict(os.environ)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # (torchrun: a child per rank on this host)
        env.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // (2 * local_ranks))))  # half loads
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the child's wall time, once it has ended
        with open(self.dir / "stderr.txt", "wb") as stderr:
            self.process = subprocess.Popen([sys.executable, "-c", f"from {__name__} import main; main()", str(self.dir)],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        self._stop = weakref.finalize(self, _stop, self.process, self.dir)

    def __enter__(self) -> "TokenizeBeside":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def cancel(self) -> None:
        self._stop()  # (once: a finalizer runs at most once)

    def result(self) -> Tokenized:
        """The child's Tokenized, waiting for it; its InputError / UnsupportedError raised again here."""
        code = self.process.wait()
        self.seconds = time.perf_counter() - self.started
        try:
            try:
                answer = json.loads((self.dir / "result.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                tail = (self.dir / "stderr.txt").read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"tokenising the MMLU prompts in a child process failed (exit code {code}):\n"
                                   f"{tail}") from None
            if "error" in answer:
                error = answer["error"]
                raise ERRORS[error["type"]](error["where"], error["problem"], key=error["key"])
            flat = np.load(self.dir / "ids.npy", allow_pickle=False).tolist()
            ends = np.cumsum(np.load(self.dir / "lengths.npy", allow_pickle=False)).tolist()
            ids = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
            return Tokenized(ids=ids, used=answer["used"], candidates=answer["candidates"],
                             candidate_tokens=answer["candidate_tokens"])
        finally:
            self.cancel()


def main() -> None:
    """The child: argv[1] the folder holding request.json and the questions; writes result.json (+ the ids)."""
    folder = Path(sys.argv[1])
    request = json.loads((folder / "request.json").read_text(encoding="utf-8"))
    questions = pd.read_parquet(folder / "questions.parquet")
    dev = pd.read_parquet(folder / "dev.parquet") if (folder / "dev.parquet").is_file() else None
    try:
        tokens = tokenize(request["model"], questions, dev, request["shots"], request["max_len"])
    except InputError as e:  # (UnsupportedError included)
        answer = dict(error=dict(type=type(e).__name__, where=e.where, problem=e.problem, key=e.key))
    else:
        lengths = np.array([len(row) for row in tokens.ids], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(tokens.ids), dtype=np.int64, count=int(lengths.sum()))
        np.save(folder / "ids.npy", flat)
        np.save(folder / "lengths.npy", lengths)
        answer = dict(used=tokens.used, candidates=tokens.candidates, candidate_tokens=tokens.candidate_tokens)
    (folder / "result.json.tmp").write_text(json.dumps(answer), encoding="utf-8")
    os.replace(folder / "result.json.tmp", folder / "result.json")  # whole or absent
