"""Run folders: a run's output is complete or absent, written by one process at a time, resumable after any kill.

For `--out OUT` (a folder; for dump-reference one Parquet file):
  OUT.lock      while a run is alive: flock'ed and naming its holder (pid, host, start time, command)
  OUT.partial/  the run while it works: run.json ("status": "partial", the fingerprint, the arguments) and
                parts/part-NNNNNN.parquet, each holding the results of some finished units of work (batches,
                samples), written whole (a temporary name, fsync, rename)
  OUT           the finished run, made by one rename: its files and run.json with "status": "complete" and the
                completion record (a single file keeps its record in its own Parquet metadata)

The fingerprint names what a run's numbers depend on: the contents of the input files, the task's options, the
package versions and the device. Re-running the same command (same fingerprint) into a complete OUT recomputes
nothing; into OUT.partial it computes only the units no part holds, in the same batches, so the finished tables
are byte-identical to an uninterrupted run's. Any other fingerprint, or another command's run, is refused with the
differences named, unless `overwrite`. SIGINT / SIGTERM during the work stop after the current unit, keep the parts
and raise Interrupted (exit 130 / 143).

Parts are written every PART_ITEMS items (samples, rows) or PART_SECONDS seconds, whichever comes first; the
environment variables LORA_EVAL_PART_ITEMS and LORA_EVAL_PART_SECONDS change both (tests use small parts).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import io
import json
import os
import platform
import resource
import secrets
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..distributed import PeerFailed, Ranks, assign, held_signals, together
from ..errors import EXIT_INPUT, EXIT_INTERNAL, InputError, Interrupted
from ..progress import progress

PART_ITEMS = 256
PART_SECONDS = 30.0
SAMPLED_BLOCKS = 256  # blocks of SAMPLED_BLOCK bytes read from each weight file for its fingerprint
SAMPLED_BLOCK = 1 << 16
PACKAGES = ("lora-eval", "torch", "transformers", "peft", "safetensors", "triton", "numpy", "pandas", "pyarrow")
RECORD_KEY = b"lora_eval.run"  # a single-file output's run record, in its Parquet metadata
COMMANDS = ("compare", "mmlu", "diagnose", "dump-reference")  # the `command` of every run record lora-eval writes


# ---- the output path ------------------------------------------------------------------------------------


def check_out(out: str | Path | None, option: str = "--out", single_file: bool = False,
              inputs: dict[str, str | Path | None] | None = None, run: str | Path | None = None) -> Path | None:
    """`out` as a Path, refused (InputError) unless its parent folder exists and is writable, `out` is not
    something else (a file where a folder goes, or the other way round), and neither `out` nor the lock and working
    folder beside it (OUT.lock, OUT.partial) is, holds or lies inside one of the run's `inputs` (what names it, e.g.
    '--model' -> its path; None entries are skipped): nothing a user gave is written to, --overwrite or not.
    `out` (and OUT.lock, OUT.partial) may not be a symbolic link, even to a folder: the run is made by renaming
    OUT.partial onto OUT, which would replace the link, not fill its target, and the lock beside a link would not be
    the lock beside its target (two runs through both would write at once); a fifo, socket or device file is
    refused as not a file. `run`: the run folder of the same command (--out), which a file written beside it
    (--junit) may not be, hold or lie inside, nor its lock or working folder. Writes nothing."""
    if out is None:
        return None
    out = Path(out)
    if not str(out) or out.name in ("", ".", ".."):
        raise InputError(option, f"'{out}' does not name a {'file' if single_file else 'folder'} to write")
    parent = out.absolute().parent
    if not parent.exists():
        raise InputError(option, f"folder {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise InputError(option, f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(option, f"folder {parent} is not writable")
    for path in (out, out.with_name(out.name + ".lock"), out.with_name(out.name + ".partial")):
        if path.is_symlink():
            raise InputError(option, f"{path} is a symbolic link (to {os.readlink(path)}"
                             f"{'' if path.exists() else ', which does not exist'}); lora-eval writes its output by "
                             "renaming onto the path, which would replace the link: give the target path itself")
    if single_file and out.is_dir():
        raise InputError(option, f"{out} is a folder; expected a file name")
    if not single_file and out.exists() and not out.is_dir():
        raise InputError(option, f"{out} exists and is not a folder")
    if single_file and out.exists() and not out.is_file():
        raise InputError(option, f"{out} exists and is not a regular file (a fifo, socket or device); choose a file "
                         "name")
    lock, staging = out.with_name(out.name + ".lock"), out.with_name(out.name + ".partial")
    if lock.exists() and not lock.is_file():
        raise InputError(option, f"{lock} (the run's lock file) exists and is not a regular file; move it away or "
                         "choose another output")
    if staging.exists() and not staging.is_dir():
        raise InputError(option, f"{staging} (the run's working folder) exists and is not a folder; move it away or "
                         "choose another output")
    written = [Path(os.path.realpath(out.with_name(out.name + suffix))) for suffix in ("", ".lock", ".partial")]
    if run is not None:  # a file beside the run (--junit) is none of the run's own paths
        run = Path(run)
        for suffix, what in (("", "the run folder"), (".lock", "the run's lock file"),
                             (".partial", "the run's working folder")):
            theirs = Path(os.path.realpath(run.with_name(run.name + suffix)))
            for target in written:
                if target == theirs or theirs in target.parents or target in theirs.parents:
                    how = "is" if target == theirs else "lies inside" if theirs in target.parents else "holds"
                    raise InputError(option, f"{target if target != written[0] else out} {how} {what} of this "
                                     f"run ({run.with_name(run.name + suffix)}, from --out {run}); choose another "
                                     "path")
    for name, path in (inputs or {}).items():
        if path is None or not str(path):
            continue
        read = Path(os.path.realpath(path))  # (links resolved: a link to an input is that input)
        for target in written:
            if target == read or read in target.parents or target in read.parents:
                how = "is" if target == read else "lies inside" if read in target.parents else "holds"
                raise InputError(option, f"{target if target != written[0] else out} {how} {name} {path}, an input "
                                 "of this run: lora-eval never writes to its inputs; choose another path")
    return out


# What the first KiB of a file lora-eval writes beside a run holds: its reports' and JUnit's name, bench's CSV header
OWN_FILE_MARKS = (b"lora-eval", b"system,batch,case,")


def check_replaceable(out: Path | None, option: str) -> None:
    """A file that a command writes beside its run (--junit, report --out, bench --out) may replace only a file
    lora-eval wrote there (re-running a CI job rewrites its JUnit; the run folder keeps the result): a file of the
    user's at that path is refused, --overwrite or not."""
    if out is None or not out.is_file():
        return
    try:
        with open(out, "rb") as f:
            head = f.read(1024)
    except OSError as e:
        raise InputError(option, f"{out} exists and cannot be read ({e.strerror}); choose another path") from None
    if not any(mark in head for mark in OWN_FILE_MARKS):
        raise InputError(option, f"{out} is a file lora-eval did not write; lora-eval never replaces it: choose "
                         "another path")


def run_inputs(model=None, adapters: dict | None = None, **named) -> dict[str, str | Path | None]:
    """The input paths of a run for `check_out(inputs=...)`: `model` (--model), each adapter folder
    (--adapter NAME), and `named` option -> a path or a list of paths (e.g. reference=[...], prompts=...,
    against_model=...: the option's name is '--' + the key with '-' for '_'). A reference given as (NAME, PATH)
    counts by its PATH."""
    found: dict[str, str | Path | None] = {"--model": model}
    found.update({f"--adapter {name}": folder for name, folder in (adapters or {}).items()})
    for key, value in named.items():
        option = "--" + key.replace("_", "-")
        values = value if isinstance(value, (list, tuple)) and not _is_named_path(value) else [value]
        for i, item in enumerate(values):
            path = item[1] if _is_named_path(item) else item
            found[option if len(values) == 1 else f"{option} {i + 1}"] = path
    return found


def _is_named_path(value) -> bool:
    """(NAME, PATH), as compare and diagnose take a reference of a .pt dump."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)


def atomic_write(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: written under a temporary name, flushed to disk, renamed."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_bytes(record: dict) -> bytes:
    return (json.dumps(record, indent=2, default=str) + "\n").encode("utf-8")


# ---- fingerprints ---------------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    """sha256 of the whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def weights_digest(path: Path) -> str:
    """A safetensors file without reading all of it: sha256 over its size, its header (names, dtypes, shapes,
    offsets) and SAMPLED_BLOCKS evenly spaced blocks of its data — two checkpoints of one shape differ in every
    block, so this tells them apart, at 16 MiB read per file instead of gigabytes."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        head = f.read(8)
        header = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + f.read(min(header, size)))
        start = 8 + header
        if size - start <= SAMPLED_BLOCKS * SAMPLED_BLOCK:
            h.update(f.read())
        else:
            step = (size - start - SAMPLED_BLOCK) // (SAMPLED_BLOCKS - 1)
            for i in range(SAMPLED_BLOCKS):
                f.seek(start + i * step)
                h.update(f.read(SAMPLED_BLOCK))
    return f"sampled-sha256:{h.hexdigest()}"


def _model_file_digester(path: Path):
    """How a model folder's file enters the fingerprint: weights sampled, JSON files (config, tokenizer) by content,
    other tokenizer files whole; None for a file that does not (a README, an image)."""
    if path.suffix == ".safetensors":
        return weights_digest
    if path.suffix == ".json":
        return config_digest
    if path.suffix in (".txt", ".model", ".tiktoken", ".jinja") or path.name.startswith("tokenizer"):
        return file_digest
    return None


def _adapter_file_digest(path: Path) -> str:
    """An adapter folder's adapter_* file: whole; adapter_config.json by its content (PEFT writes its sets, e.g.
    target_modules, in a different order each time it saves)."""
    return config_digest(path) if path.suffix == ".json" else file_digest(path)


def config_digest(path: Path) -> str:
    """sha256 of a JSON file's content: keys sorted, and lists of plain values sorted (PEFT's sets); the file's
    bytes when it is not JSON (the adapter loader then says what is wrong)."""
    def canonical(value):
        if isinstance(value, dict):
            return {k: canonical(v) for k, v in value.items()}
        if isinstance(value, list):
            items = [canonical(v) for v in value]
            plain = all(isinstance(v, str) for v in items) or all(isinstance(v, (int, float)) for v in items)
            return sorted(items) if plain else items
        return value

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return file_digest(path)
    text = json.dumps(canonical(data), sort_keys=True, separators=(",", ":"))
    return f"json-sha256:{hashlib.sha256(text.encode()).hexdigest()}"


class InputDigests:
    """The fingerprints of a run's input files: the model folder's (`_model_file_digester`), the adapters'
    (`_adapter_file_digest`) and `files` (name -> path, hashed whole: references, data files, prompts). Each file is
    hashed on a background thread (a pool of at most 4, ended once its jobs are done) from the moment the task knows
    its inputs, while it goes on reading and checking them; `result()` waits for them where the run folder opens.
    File reads and hashlib release the GIL. Hashed in line, the whole-file sha256 of a compare's adapter and
    reference was most of its read phase (H100, 24-layer checkpoint: 1.1 s; BENCHMARKS-history section 13). A
    digest's failure (a file gone since) is raised by `result()`; one the task's own checks find first is never
    raised."""

    def __init__(self, model: str | Path | None = None, adapters: dict[str, str | Path] | None = None,
                 files: dict[str, str | Path] | None = None, prefix: str = ""):
        jobs = []
        if model is not None:
            model_dir = Path(model)
            jobs += [(f"model/{p.name}", digest, p) for p in sorted(model_dir.iterdir())
                     if p.is_file() and (digest := _model_file_digester(p))] if model_dir.is_dir() else []
        for name, folder in (adapters or {}).items():
            if Path(folder).is_dir():
                jobs += [(f"adapter {name}/{p.name}", _adapter_file_digest, p)
                         for p in sorted(Path(folder).glob("adapter_*")) if p.is_file()]
        # a named file that is not a regular file (a fifo would block its thread, and the process's exit, on open) is
        # never opened: its digest fails, which the task's own reading of it reports first
        jobs += [(name, _not_a_file if Path(path).exists() and not Path(path).is_file() else file_digest, Path(path))
                 for name, path in (files or {}).items()]
        self.prefix = prefix
        pool = ThreadPoolExecutor(max_workers=max(1, min(4, len(jobs))), thread_name_prefix="lora-eval-digest")
        self._futures = {name: pool.submit(fn, path) for name, fn, path in jobs}
        pool.shutdown(wait=False)  # its threads finish these jobs, then end (no pool outlives its run)

    def result(self) -> dict[str, str]:
        return {f"{self.prefix}{name}": future.result() for name, future in self._futures.items()}


def _not_a_file(path: Path) -> str:
    raise InputError(path, "not a regular file")


def versions(*extra: str) -> dict[str, str]:
    """Versions of Python and of the packages whose code computes or writes the results."""
    found = {"python": platform.python_version()}
    for package in (*PACKAGES, *extra):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def fingerprint(command: str, files: dict[str, str], options: dict, package_versions: dict) -> dict:
    """What a run's results depend on, in the form run.json keeps (JSON round trip: equal means equal)."""
    return json.loads(json.dumps(dict(command=command, files=files, options=options, versions=package_versions),
                                 default=str))


def differences(stored: dict, current: dict) -> list[str]:
    """What differs between two fingerprints, in words: 'file model/config.json changed', 'batch_tokens 1 -> 2'."""
    found = []
    if stored.get("command") != current.get("command"):
        found.append(f"it is a {stored.get('command')} run, not a {current.get('command')} run")
    old, new = stored.get("files") or {}, current.get("files") or {}
    for name in sorted(set(old) | set(new)):
        if name not in new:
            found.append(f"{name} is not an input now")
        elif name not in old:
            found.append(f"{name} is a new input")
        elif old[name] != new[name]:
            found.append(f"{name} changed")
    for section in ("options", "versions"):
        old, new = stored.get(section) or {}, current.get(section) or {}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                found.append(f"{key} {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}")
    return found


def _said(found: list[str]) -> str:
    return "; ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- the lock -------------------------------------------------------------------------------------------


class Lock:
    """One writer per output: an flock on OUT.lock, whose content names the holder. The kernel drops the flock when
    its process dies, so a lock file a dead process left behind is taken over (with a one-line notice); a live
    holder makes the second run stop at once (InputError naming pid, host and start time)."""

    def __init__(self, path: Path, out: Path, command: str):
        self.path, self.out, self.command = path, out, command
        self.fd: int | None = None

    def acquire(self, notice) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # a folder of that name, a file we may not write
                raise InputError(self.path, f"cannot be opened as the run's lock file ({e.strerror}); move it away or "
                                 "choose another output") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = _read_holder(fd)
                for _ in range(20):  # the holder writes its record right after it takes the lock
                    if holder:
                        break
                    time.sleep(0.05)
                    holder = _read_holder(fd)
                os.close(fd)
                raise InputError(self.out, f"another lora-eval run is writing here ({_holder_text(holder)}); wait "
                                 f"for it to finish or choose another output") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file as we opened it: lock the new one
        previous = _read_holder(fd)
        if previous and "pid" not in previous:  # a file of that name that no lora-eval run wrote: not ours to empty
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise InputError(self.path, "exists and is not a lora-eval lock file; lora-eval does not replace it: move "
                             "it away or choose another output")
        if previous:
            if previous.get("host") not in (None, socket.gethostname()):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise InputError(self.path, f"left by a run on another host ({_holder_text(previous)}); if that run "
                                 "is gone, delete this file")
            notice(f"note: taking over the lock of a run that is no longer alive ({_holder_text(previous)})")
        record = dict(pid=os.getpid(), host=socket.gethostname(), started=now(), command=self.command)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"holder": "unreadable lock file"}
    return data if isinstance(data, dict) else {}


def _holder_text(holder: dict) -> str:
    if not holder:
        return "holder not recorded yet"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}, "
            f"{holder.get('command')}")


# ---- the run folder -------------------------------------------------------------------------------------


class RunFolder:
    """The output of one run (`out` a folder, or one file with `single_file`); `None` for a run kept in memory
    only (no lock, no parts, nothing written). Use as a context manager. Entering takes the lock, first of all: a
    task enters before it reads any input, so that the loser of a race stops at once. `open(fingerprint, record)`
    then looks at what `out` holds, once the task has read and checked its inputs: `stored` is the record of a
    complete run of the same fingerprint (nothing to compute), else the run starts or resumes. The working folder
    (OUT.partial) is made only when the work starts (`work`), after the model has loaded: a run refused for its
    inputs leaves nothing behind, and one that fails before finishing any unit takes back the folder it made. A run
    refused for its inputs during the work (an InputError, e.g. weights found non-finite as a model loads, or
    logprobs that overflow) takes back its working folder, finished parts included: the same command would fail the
    same way, and the corrected one has another fingerprint, which those parts would block (resume is for
    interrupted and crashed runs, whose parts the same command finishes).
    (Given at construction, `fingerprint` is opened on entering.) `record` (arguments and the like) goes into
    run.json. With data-parallel `ranks` (distributed.py), rank 0 does all of that and tells the others; every rank
    writes parts."""

    def __init__(self, out: Path | None, command: str, fingerprint: dict | None = None, record: dict | None = None,
                 *, overwrite: bool = False, single_file: bool = False, notice=print, ranks: Ranks | None = None):
        self.out, self.command, self.fingerprint = out, command, fingerprint
        self.record = dict(record or {})
        self.overwrite, self.single_file, self.notice, self.ranks = overwrite, single_file, notice, ranks
        self.leads = ranks is None or ranks.leads
        self.stored: dict | None = None
        self._staging_made = False  # whether this run made OUT.partial (see __exit__)
        self._working = False  # whether this run works in OUT.partial (its fingerprint's: see __exit__)
        if out is not None:
            self.staging = out.with_name(out.name + ".partial")
            self.parts_dir = self.staging / "parts"
            self._lock = Lock(out.with_name(out.name + ".lock"), out, command)

    def __enter__(self) -> "RunFolder":
        with together(self.ranks):
            if self.out is None and self.ranks is not None:
                raise InputError("--out", "a data-parallel run needs a run folder: its ranks hand their work over "
                                 "through it")
            if self.out is not None and self.leads:
                self._lock.acquire(self.notice)
        if self.fingerprint is not None:
            try:
                self.open(self.fingerprint, self.record)
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def open(self, fingerprint: dict, record: dict | None = None) -> None:
        """Look at what `out` holds for a run of `fingerprint` (`stored`, a partial run to resume, or nothing) and
        refuse what this run may not replace; makes no folder."""
        self.fingerprint, self.record = fingerprint, dict(record or self.record)
        with together(self.ranks):
            if self.out is not None and self.leads:
                self._clean_leftovers()
                self._look()
        if self.ranks is not None:
            with held_signals() as held:
                self.stored = self.ranks.share(self.stored)
                if self.stored is not None:  # a complete run: every rank reports it and leaves (distributed.py)
                    held.conclude()

    def __exit__(self, kind=None, error=None, traceback=None) -> None:
        if self.out is None or not self.leads:
            return
        # a failed run takes back the working folder when it holds nothing to resume: it made it and finished no
        # unit, or its inputs were refused during the work (here or on another rank), whose parts no command finishes
        refused = isinstance(error, InputError) or (isinstance(error, PeerFailed) and error.code == EXIT_INPUT)
        try:
            if error is not None and ((refused and self._working) or (
                    self._staging_made and not any(self.parts_dir.glob("part-*.parquet")))):
                try:
                    status = json.loads((self.staging / "run.json").read_text(encoding="utf-8")).get("status")
                except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                    status = None
                if status == "partial":  # (a complete one waits for its rename: the next run finishes it)
                    shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._lock.release()

    # -- what is there --

    def _look(self) -> None:
        """Set `stored`, or note what the staging folder holds: nothing, a run to resume (same fingerprint), or one
        to discard (another fingerprint, with overwrite, or without a finished unit). `overwrite` replaces what OUT
        holds when lora-eval wrote it; a partial run of this very fingerprint is resumed either way."""
        staged = self._staged_record()
        if staged is not None and staged.get("fingerprint") != self.fingerprint:
            found = _said(differences(staged.get("fingerprint") or {}, self.fingerprint))
            done = len(list(self.parts_dir.glob("part-*.parquet")))
            if done and not self.overwrite:
                raise InputError(self.staging, f"holds an unfinished run of other inputs or options ({found}; {done} "
                                 f"parts of finished work); re-run the command that started it to finish it (its "
                                 f"arguments are in {self.staging / 'run.json'}), or --overwrite to discard it")
            if not done:
                self.notice(f"note: replacing {self.staging}, an unfinished run of other inputs that finished no unit "
                            f"of work ({found})")
            shutil.rmtree(self.staging)
            staged = None
        if staged is not None and staged.get("status") == "complete":  # killed between the last write and the rename
            self._promote()
            self._reuse(staged)
            return
        if self.out.exists() and not (self.out.is_dir() and not any(self.out.iterdir())):
            stored = self._stored_record()
            found = differences(stored.get("fingerprint") or {}, self.fingerprint)
            if not self.overwrite:
                if not found:
                    self._reuse(stored)
                    return
                what = "run" if self.single_file else f"{stored.get('command')} run"
                raise InputError(self.out, f"holds a complete {what} of other inputs or options ({_said(found)}); "
                                 "--overwrite replaces it, or choose another output")

    def _ensure_staging(self) -> None:
        """The working folder, made when the work starts (kept where a run of this fingerprint made it before)."""
        if not self.staging.is_dir():
            self._start_staging()
            self._staging_made = True

    def _reuse(self, record: dict) -> None:
        self.stored = record
        self.notice(f"{self.out} holds this run already (same inputs and options): nothing recomputed; --overwrite "
                    "runs it again")

    def _staged_record(self) -> dict | None:
        if not self.staging.is_dir():
            return None
        try:
            record = json.loads((self.staging / "run.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if not isinstance(record, dict) or record.get("command") not in COMMANDS:
            raise InputError(self.staging, "is not the working folder of a lora-eval run (no readable run.json of "
                             "ours); lora-eval does not remove it: move it away or choose another output")
        return record

    def _stored_record(self) -> dict:
        """The record of the complete run at `out`; InputError when `out` holds something lora-eval did not write
        (never replaced, --overwrite or not)."""
        if self.single_file:
            try:
                record = json.loads((pq.read_schema(self.out).metadata or {})[RECORD_KEY])
            except (pa.ArrowException, OSError, KeyError, UnicodeDecodeError, json.JSONDecodeError):
                record = None
            if not isinstance(record, dict) or record.get("command") != self.command:
                raise InputError(self.out, f"exists and was not written by lora-eval {self.command}; lora-eval does "
                                 "not replace it (--overwrite or not): choose another file, or move it away")
            return record
        record = read_record(self.out, required=False)
        if record is None or record.get("command") not in COMMANDS:
            raise InputError(self.out, "exists and is not a lora-eval run folder (no run.json of ours); lora-eval "
                             "does not replace it: choose another --out")
        if record.get("status") != "complete" or "fingerprint" not in record:
            if not self.overwrite:
                raise InputError(self.out, "holds an incomplete run or one written by an earlier lora-eval (no "
                                 "completion record in run.json); --overwrite replaces it")
            return {}
        return record

    def _clean_leftovers(self) -> None:
        """Temporary names a killed run left (we hold the lock: nobody else is writing them)."""
        parent = self.out.parent
        for path in parent.glob(f"{self.out.name}.partial.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)
        if self.out.exists():
            for path in parent.glob(f"{self.out.name}.replaced-*"):
                shutil.rmtree(path, ignore_errors=True)
        for path in self.staging.glob("**/*.tmp-*") if self.staging.is_dir() else ():
            path.unlink()

    def _start_staging(self) -> None:
        tmp = self.out.with_name(f"{self.out.name}.partial.tmp-{os.getpid()}")
        (tmp / "parts").mkdir(parents=True)
        record = dict(command=self.command, status="partial", started=now(), **self.record,
                      fingerprint=self.fingerprint)
        atomic_write(tmp / "run.json", json_bytes(record))
        os.rename(tmp, self.staging)
        _fsync_dir(self.staging.parent)

    # -- the work --

    def work(self, weights: list[int], desc: str, unit: str, quiet: bool = False, lockstep: bool = False) -> "Work":
        """The units of this run's work (weights: progress per unit, e.g. tokens of a batch), with the units
        finished before read back from the parts; with data-parallel ranks, this rank's share of the rest, in
        `lockstep` with the other ranks where their forwards exchange data (expert parallel)."""
        if self.out is not None and self.leads:
            self._ensure_staging()
            self._working = True
        done = read_parts(self.parts_dir, self.notice) if self.out is not None and self.leads else {}
        mine = None
        if self.ranks is not None:
            finished = self.ranks.share(sorted(done))
            done = done if self.leads else dict.fromkeys(finished)
            pending = [u for u in range(len(weights)) if u not in done]
            mine = set(assign(pending, weights, self.ranks.world)[self.ranks.rank])
        return Work(self, weights, done, desc, unit, quiet, mine, lockstep and self.ranks is not None)

    def finish(self, work: "Work", merge, reread):
        """The run's end: `merge(every unit's rows)` builds the result and commits it. With data-parallel ranks,
        rank 0 merges every rank's parts while the others wait, and they return the run as committed (`reread()`)."""
        with together(self.ranks, final=True):  # the job's last exchange: then every rank reports and leaves
            result = merge(work.results()) if self.leads else None
        return result if self.leads else reread()

    # -- the end --

    def run_record(self, **fields) -> dict:
        """The finished run's record (run.json): the command, "status": "complete", `fields`, the fingerprint."""
        return dict(command=self.command, status="complete", **fields, fingerprint=self.fingerprint)

    def commit(self, files: dict[str, bytes], record: dict) -> None:
        """Write the finished run's files and its record as run.json, then make OUT appear."""
        if self.out is None:
            return
        self._ensure_staging()
        for name, data in files.items():
            atomic_write(self.staging / name, data)
        atomic_write(self.staging / "run.json", json_bytes(record))
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        self._promote()

    def commit_file(self, data: bytes) -> None:
        """A single-file output: `data` (which carries its own record) replaces OUT in one rename."""
        if self.out is None:
            return
        self._ensure_staging()
        atomic_write(self.staging / self.out.name, data)
        os.replace(self.staging / self.out.name, self.out)
        _fsync_dir(self.out.parent)
        shutil.rmtree(self.staging)

    def _promote(self) -> None:
        """staging -> OUT in one rename (an empty OUT folder, or the run `overwrite` replaces, goes first)."""
        old = None
        if self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()
        elif self.out.exists():
            old = self.out.with_name(f"{self.out.name}.replaced-{os.getpid()}")
            os.rename(self.out, old)
        os.rename(self.staging, self.out)
        _fsync_dir(self.out.parent)
        if old is not None:
            shutil.rmtree(old)

    def resume_hint(self) -> str:
        if self.out is None:
            return "nothing was kept (no output given)"
        if not any(self.parts_dir.glob("part-*.parquet")):
            return "no unit of work was finished; run the same command again to start over"
        return f"finished parts are kept in {self.staging}; run the same command again to resume"


def read_record(folder: Path, required: bool = True) -> dict | None:
    """A run folder's run.json as a dict (None when absent and not `required`)."""
    path = folder / "run.json"
    if not path.is_file():
        if required:
            raise InputError(folder, "not a run folder (no run.json)")
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise InputError(path, f"expected a JSON object, found {type(record).__name__}")
    return record


# ---- parts ----------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident host memory so far, in MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def peak_memory() -> dict:
    """This process's peak host memory and, where it used a GPU, the peak of torch's allocations on its device
    (MiB; None without CUDA): the figures a run record keeps."""
    device = round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_initialized() else None
    return dict(peak_rss_mb=peak_rss_mb(), peak_device_mb=device)


def read_parts(parts_dir: Path, notice) -> dict[int, pd.DataFrame]:
    """unit -> its rows, from every part a run left. A part that cannot be read (the disk lost it) is dropped
    with a notice: its units are computed again."""
    done = {}
    for path in sorted(parts_dir.glob("part-*.parquet")):
        try:
            frame = pq.read_table(path).to_pandas()
        except (pa.ArrowException, OSError) as e:
            notice(f"note: dropping unreadable part {path} ({e}); its work is done again")
            path.unlink()
            continue
        for unit, rows in frame.groupby("_unit", sort=False):
            done[int(unit)] = rows.drop(columns="_unit").reset_index(drop=True)
    return done


class Work:
    """The units of a run's work. `pending(units)` lists those no part holds (of this rank's share, `mine`, under
    data parallel); `record(unit, rows)` keeps a unit's result (a DataFrame), writing a part every PART_ITEMS rows or
    PART_SECONDS seconds; `results()` gives every unit's rows. Inside `with`: a progress bar that starts at the
    resumed amount, and SIGINT / SIGTERM ask for a stop after the current unit (a second signal stops at once),
    which writes the pending rows as a part and raises Interrupted. Under data parallel, leaving the `with` block
    exchanges every rank's outcome (distributed.py), and a rank stops early when another one's work failed."""

    def __init__(self, folder: RunFolder, weights: list[int], done: dict[int, pd.DataFrame], desc: str, unit: str,
                 quiet: bool, mine: set[int] | None = None, lockstep: bool = False):
        self.folder, self.weights, self.done, self.mine = folder, list(weights), dict(done), mine
        self.lockstep = lockstep
        self.ranks = folder.ranks
        self.desc, self.unit, self.quiet = desc, unit, quiet or not folder.leads
        self.part_items = int(os.environ.get("LORA_EVAL_PART_ITEMS", PART_ITEMS))
        self.part_seconds = float(os.environ.get("LORA_EVAL_PART_SECONDS", PART_SECONDS))
        self.resumed_units = len(self.done)
        self.computed = 0  # weight of the units computed by this process
        self.per_rank: list[dict] | None = None  # under data parallel: every rank's computed and parts_s
        self.parts_s = 0.0  # time spent writing parts
        self._pending: dict[int, pd.DataFrame] = {}
        self._last_flush = time.monotonic()
        self._stop: int | None = None
        self._handlers: dict = {}
        self._parts = 0
        self._name = f"{os.getpid()}-{secrets.token_hex(3)}"  # this process's parts: part-NAME-SEQ.parquet

    def __enter__(self) -> "Work":
        done = sum(self.weights[u] for u in self.done if u < len(self.weights))
        if self.done and self.folder.leads:
            self.folder.notice(f"resuming: {len(self.done)} of {len(self.weights)} {self.desc} units already done "
                               f"({done:,} of {sum(self.weights):,} {self.unit}) in {self.folder.staging}")
        share = sum(self.weights) if self.mine is None else done + sum(self.weights[u] for u in self.mine)
        self.bar = progress(share, self.desc, self.unit, self.quiet, initial=done)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._handlers[signum] = signal.signal(signum, self._ask_stop)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.flush()  # also after an error: the finished units are kept for a re-run
        finally:
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)
            self.bar.close()
        if self.ranks is None or (error is not None and not isinstance(error, Exception)) or \
                isinstance(error, Interrupted):
            return  # one process, or a stop the peers are getting too
        if error is not None and not isinstance(error, PeerFailed):
            self.ranks.mark_failed()
        self.ranks.exchange(error)
        self.per_rank = self.ranks.gather(dict(computed=self.computed, parts_s=round(self.parts_s, 4),
                                               **peak_memory()))

    def _ask_stop(self, signum, frame) -> None:
        if self._stop is not None:  # a second signal: stop now (the finished parts are on disk)
            raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}; {self.folder.resume_hint()}")
        self._stop = signum

    def pending(self, units) -> list[int]:
        return [u for u in units if u not in self.done and (self.mine is None or u in self.mine)]

    def steps(self, units):
        """This rank's pending units, one per step. In lock-step (expert parallel), every rank takes as many steps as
        the busiest one — None where it has no unit left (run a stand-in batch) — and a stop is decided together."""
        mine = self.pending(units)
        if not self.lockstep:
            yield from mine
            return
        for i in range(max(self.ranks.gather(len(mine)))):
            asked = [s for s in self.ranks.gather((self._stop, self.ranks.peer_failed())) if any(s)]
            if asked:
                self.flush()
                signum = next((s for s, _ in asked if s is not None), None)
                if signum is None:
                    raise PeerFailed(EXIT_INTERNAL)
                raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}; "
                                  f"{self.folder.resume_hint()}")
            yield mine[i] if i < len(mine) else None

    def overlapped(self, units, start, finish) -> None:
        """Every pending unit (`steps`) in two halves: start(unit) queues its work and returns a handle (start(None):
        a lock-step rank's stand-in step), finish(unit, handle) waits for it and returns the rows to record. A unit
        finishes after the next one has started, so that the device computes one unit while the host records the
        last and prepares the next. A unit started but not finished when a stop or an error comes is not recorded
        (a resumed run computes it); one started before a failing start is finished and recorded first."""
        def settle(held):  # (unit, handle) of the unit started before, if any; a stand-in step records nothing
            if held is not None and held[0] is not None:
                self.record(held[0], finish(*held))

        held = None
        for unit in self.steps(units):
            try:
                started = (unit, start(unit))
            finally:  # the unit before is recorded whether this start worked or not
                settle(held)
            held = started
        settle(held)

    def record(self, unit: int, rows: pd.DataFrame) -> None:
        self.done[unit] = rows
        self._pending[unit] = rows
        self.computed += self.weights[unit]
        self.bar.update(self.weights[unit])
        items = sum(len(r) for r in self._pending.values())
        if items >= self.part_items or time.monotonic() - self._last_flush >= self.part_seconds:
            self.flush()
        if self.lockstep:
            return  # stops are decided together, in steps()
        if self._stop is not None:
            self.flush()
            finished = sum(self.weights[u] for u in self.done)
            raise Interrupted(self._stop, f"interrupted by {signal.Signals(self._stop).name} after {finished:,} of "
                              f"{sum(self.weights):,} {self.unit}; {self.folder.resume_hint()}")
        if self.ranks is not None and self.ranks.peer_failed():
            raise PeerFailed(EXIT_INTERNAL)  # the failing rank's code comes with the exchange

    def flush(self) -> None:
        """Write the rows recorded since the last part as one part."""
        if not self._pending or self.folder.out is None:
            self._pending = {}
            return
        t0 = time.perf_counter()
        frame = pd.concat([rows.assign(_unit=unit) for unit, rows in self._pending.items()], ignore_index=True)
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buffer)
        atomic_write(self.folder.parts_dir / f"part-{self._name}-{self._parts:05d}.parquet", buffer.getvalue())
        self._parts += 1
        self._pending = {}
        self._last_flush = time.monotonic()
        self.parts_s += time.perf_counter() - t0

    def results(self) -> dict[int, pd.DataFrame]:
        """Every unit's rows (under data parallel: rank 0 reads what every rank wrote)."""
        if self.ranks is not None:
            self.done = read_parts(self.folder.parts_dir, self.folder.notice)
        missing = [u for u in range(len(self.weights)) if u not in self.done]
        if missing:
            raise RuntimeError(f"{len(missing)} units of work were not done (first: {missing[0]})")
        return self.done

    def stats(self) -> dict:
        """For the run record: units, those done before this run, the amount (e.g. tokens) this run computed, the
        time spent writing parts and the process's peak host and device memory (under data parallel: the first two
        summed over the ranks, each rank's figures beside)."""
        stats = dict(units=len(self.weights), resumed_units=self.resumed_units, computed=self.computed,
                     parts_s=round(self.parts_s, 4), **peak_memory())
        if self.per_rank is not None:
            stats.update(computed=sum(r["computed"] for r in self.per_rank),
                         parts_s=round(sum(r["parts_s"] for r in self.per_rank), 4), ranks=self.per_rank)
        return stats
