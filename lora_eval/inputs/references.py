"""Trainer reference dumps: read (Parquet, JSONL, serving-engine .pt) and write (Parquet), validated.

One row per sample: sample_id, adapter (None = base model), input_ids, logprobs (len(input_ids) - 1),
optional mask and sampler_logprobs (same length). The format is specified in references/README.md.
Every logprob and sampler logprob is finite and at most 0: NaN, +inf and values above 0 are impossible, and -inf
(probability 0) is refused too, since a token of probability 0 cannot have been sampled: a dump holding one is
broken (`_logprobs`). .pt dumps are read with torch.load(weights_only=True) only and never unpickled.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import InputError
from ..names import BASE
from .checks import read_jsonl

COLUMNS = ["sample_id", "adapter", "input_ids", "logprobs", "mask", "sampler_logprobs"]
SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("adapter", pa.string()), ("input_ids", pa.list_(pa.int64())),
    ("logprobs", pa.list_(pa.float32())), ("mask", pa.list_(pa.bool_())), ("sampler_logprobs", pa.list_(pa.float32())),
])


def read_reference(path: str | Path, adapter: str | None = None, vocab_size: int | None = None) -> pd.DataFrame:
    """A validated reference DataFrame with COLUMNS. `adapter`, if given, is whose logprobs these are
    (required for .pt dumps, which carry no adapter column; 'base' means the base model). `vocab_size`: the
    model's, which every token id must fall inside."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "reference file not found")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            frame = pq.read_table(path).to_pandas()
        except (pa.ArrowException, OSError) as e:
            raise InputError(path, f"not a readable Parquet file ({e})") from None
    elif suffix in (".jsonl", ".json"):
        lines = read_jsonl(path)
        frame = pd.DataFrame([row for _, row in lines]).assign(_where=[f"line {n}" for n, _ in lines])
    elif suffix == ".pt":
        if adapter is None:
            raise InputError(path, "a .pt dump has no adapter column: give it as NAME=FILE.pt (NAME 'base' for the "
                             "base model)")
        frame = _read_pt(path)
    else:
        raise InputError(path, f"unknown reference format '{suffix}' (expected .parquet, .jsonl or .pt)")
    if adapter is not None:
        frame["adapter"] = None if adapter == BASE else adapter
    return validate(frame, path, vocab_size)


def _read_pt(path: Path) -> pd.DataFrame:
    """Serving-engine dumps: a dict {tokens, training_logprobs, sampling_logprobs?} of per-sample lists or
    2D tensors, or a list of such dicts (one per sample). Never unpickles anything but tensors and containers."""
    if path.stat().st_size == 0:
        raise InputError(path, "empty file (expected a torch.save of tensors, lists and dicts)")
    try:
        with warnings.catch_warnings():  # (torch warns about pickle protocols on its way to refusing)
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's own text advises weights_only=False: never, for a file we were given
        raise InputError(path, "refused: not a plain tensor file (a torch.save of tensors, lists and dicts only); "
                         "it holds other Python objects or is no torch file, and lora-eval never unpickles it"
                         ) from None
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    except (RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(path, f"not a readable torch file (truncated or corrupt: {first[:120]})") from None
    samples = data if isinstance(data, list) else [data]
    rows = []
    for i, item in enumerate(samples):
        if not isinstance(item, dict) or "tokens" not in item or "training_logprobs" not in item:
            raise InputError(path, "expected a dict (or list of dicts) with 'tokens' and 'training_logprobs'",
                             key=f"sample {i}")
        where = f"sample {i}" if isinstance(data, list) else None
        tokens = _rows(item["tokens"], "tokens", path, where)
        train = _rows(item["training_logprobs"], "training_logprobs", path, where)
        sampler = _rows(item["sampling_logprobs"], "sampling_logprobs", path, where) \
            if item.get("sampling_logprobs") is not None else None
        if len(tokens) != len(train) or (sampler is not None and len(sampler) != len(tokens)):
            raise InputError(path, f"{len(tokens)} token rows but {len(train)} training_logprobs rows"
                             + (f" and {len(sampler)} sampling_logprobs rows" if sampler is not None else ""))
        for j in range(len(tokens)):
            rows.append(dict(sample_id=f"{path}:{len(rows)}", input_ids=tokens[j], logprobs=train[j],
                             sampler_logprobs=None if sampler is None else sampler[j], _where=f"sample {len(rows)}"))
    return pd.DataFrame(rows)


def _rows(value, key: str, path: Path, where: str | None) -> list[list]:
    """Per-sample lists from one of the documented forms (references/README.md): a 1D tensor (one sample), a 2D
    tensor (samples x positions, all of one length: no padding), or a list of 1D tensors or of per-sample lists (a
    flat list of numbers: one sample). Anything else is refused naming the key (and the dict of a list of dicts);
    the values themselves are checked by `validate`."""
    def bad(problem):
        return InputError(path, f"{key} {problem}", key=where)

    if isinstance(value, torch.Tensor):
        if value.dim() not in (1, 2):
            raise bad(f"is a {value.dim()}-D tensor; expected a 1-D (one sample) or 2-D (samples x positions) tensor")
        if value.numel() == 0:
            raise bad(f"is an empty tensor (shape {list(value.shape)})")
        if value.dim() == 2:
            _refuse_padding(value, key, bad)
        return [value.tolist()] if value.dim() == 1 else value.tolist()
    if not isinstance(value, (list, tuple)):
        raise bad(f"must be a tensor or a list, found {type(value).__name__} {str(value)[:40]}")
    if not value:
        raise bad("is empty (no sample)")
    sequences = [isinstance(v, (torch.Tensor, list, tuple)) for v in value]
    if not any(sequences):
        return [list(value)]  # a flat list: one sample
    if not all(sequences):
        j = sequences.index(False)
        raise bad(f"mixes samples (tensors or lists) and single values (row {j}: {type(value[j]).__name__}); "
                  "expected a list of 1-D tensors or of per-sample lists")
    rows = []
    for j, v in enumerate(value):
        if isinstance(v, torch.Tensor) and v.dim() != 1:
            raise bad(f"row {j} is a {v.dim()}-D tensor; expected one sample as a 1-D tensor")
        rows.append(v.tolist() if isinstance(v, torch.Tensor) else list(v))
    return rows


def _refuse_padding(value: torch.Tensor, key: str, bad) -> None:
    """A 2D tensor holds samples of one length. Serving engines pad ragged samples into one (token id -1, logprob
    0.0): read as data, the padding would be scored as tokens. A negative token id, or a row ending in two or more
    logprobs of exactly 0.0, is refused, pointing at the unpadded form. (One final 0.0 is left alone: a float32
    log-softmax gives exactly 0.0 for a token of near-certain probability; two such at the very end of a row is what
    padding looks like.)"""
    if value.is_floating_point():
        ends = torch.nonzero((value[:, -2:] == 0).all(dim=1)) if value.shape[1] >= 2 else value.new_zeros(0, 1)
        what = "ends with logprobs of exactly 0.0"
    else:
        ends = torch.nonzero(value < 0)  # [k, 2]
        what = "holds a negative token id"
    if len(ends):
        raise bad(f"row {int(ends[0, 0])} {what}: padding, as serving engines pad samples of different lengths "
                  "into one 2-D tensor; lora-eval reads a 2-D tensor as samples of one length only: give the samples "
                  "as a list of 1-D tensors (one per sample, unpadded)")


def validate(frame: pd.DataFrame, path: str | Path, vocab_size: int | None = None) -> pd.DataFrame:
    """Check every sample strictly and normalise it to Python lists; errors name the file, the line (JSONL) or row,
    the sample and the column. `vocab_size`: token ids must lie in [0, vocab_size)."""
    if len(frame) == 0:
        raise InputError(path, "no samples")
    for column in ("input_ids", "logprobs"):
        if column not in frame.columns:
            raise InputError(path, f"missing required column (columns: {', '.join(map(str, frame.columns))})",
                             key=column)
    frame = frame.copy()
    if "_where" not in frame.columns:
        frame["_where"] = [f"row {i}" for i in range(len(frame))]
    if "sample_id" not in frame.columns:
        frame["sample_id"] = [str(i) for i in range(len(frame))]
    for column in COLUMNS:
        if column not in frame.columns:
            frame[column] = None
    records, seen, scored = [], {}, 0
    for values in frame[[*COLUMNS, "_where"]].itertuples(index=False, name=None):
        row = dict(zip([*COLUMNS, "origin"], values))
        sample_id, origin = row["sample_id"], row["origin"]
        if isinstance(sample_id, (bool, np.bool_)) or not isinstance(sample_id, (str, int, np.integer)):
            raise InputError(path, f"sample_id must be a string or an integer, found {sample_id!r}", key=origin)
        sample_id = str(sample_id)
        where = f"{origin} (sample {sample_id})"
        if sample_id in seen:
            raise InputError(path, f"sample_id is also used by {seen[sample_id]}; it must be unique within a file",
                             key=where)
        seen[sample_id] = origin
        ids = _checked(row["input_ids"], "input_ids", "integer token ids", _is_int, path, where)
        if len(ids) < 2:
            raise InputError(path, f"input_ids must hold at least 2 token ids, found {len(ids)}", key=where)
        if vocab_size is not None:
            bad = _first_outside(ids, vocab_size)
            if bad is not None:
                raise InputError(path, f"input_ids: token id {bad} is outside the model's vocabulary "
                                 f"[0, {vocab_size})", key=where)
        n = len(ids) - 1
        logprobs = _logprobs(row["logprobs"], "logprobs", n, path, where)
        mask = None
        if not _missing(row["mask"]):
            mask = [bool(m) for m in _checked(row["mask"], "mask", "booleans (true/false or 0/1)", _is_bool, path,
                                              where, n)]
        scored += n if mask is None else sum(mask)
        sampler = row["sampler_logprobs"]
        sampler = None if _missing(sampler) else _logprobs(sampler, "sampler_logprobs", n, path, where)
        adapter = row["adapter"]
        if _missing(adapter) or adapter == BASE:
            adapter = None
        elif not isinstance(adapter, str) or not adapter:
            raise InputError(path, f"adapter must be an adapter name or null, found {adapter!r}", key=where)
        records.append(dict(sample_id=sample_id, adapter=adapter, input_ids=ids, logprobs=logprobs, mask=mask,
                            sampler_logprobs=sampler))
    if scored == 0:
        raise InputError(path, "the mask leaves no scored token in any sample (every value is false)", key="mask")
    return pd.DataFrame(records, columns=COLUMNS)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_)) or (_is_int(v) and v in (0, 1))


ARRAY_KINDS = {_is_int: "iu", _is_number: "iuf", _is_bool: "b"}  # numpy dtype kinds that need no look at values


def _checked(value, column: str, what: str, accepts, path, where, length: int | None = None) -> list:
    """`value` (a list, or an array from Parquet / .pt) as a list whose every entry `accepts`."""
    if _missing(value):
        raise InputError(path, f"{column} is missing", key=where)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise InputError(path, f"{column} must be a list of {what}, found {type(value).__name__} {value!r:.40}",
                         key=where)
    if length is not None and len(value) != length:
        raise InputError(path, f"{column} has {len(value)} entries, expected len(input_ids)-1 = {length}", key=where)
    if getattr(getattr(value, "dtype", None), "kind", "O") not in ARRAY_KINDS[accepts]:  # look at every value
        bad = next(((i, v) for i, v in enumerate(value) if not accepts(v)), None)
        if bad is not None:
            raise InputError(path, f"{column} must hold {what}, found {bad[1]!r} ({type(bad[1]).__name__}) at "
                             f"position {bad[0]}", key=where)
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _logprobs(value, column: str, length: int, path, where) -> list[float]:
    """A column of log-probabilities as floats. Each is log p of a token that was sampled or scored, so it is
    finite (p > 0: a token of probability 0 cannot have been sampled, and a dump that holds -inf for one is broken)
    and at most 0 (p <= 1; log_softmax in any float precision never rounds above 0). NaN, +inf,
    -inf and values above 0 are refused, naming the position."""
    values = _checked(value, column, "numbers", _is_number, path, where, length)
    try:
        array = np.asarray(values, dtype=np.float64)  # [length]: ints and floats alike (checked above)
    except OverflowError:  # an integer beyond any float
        array = np.array([v if abs(v) < 1e308 else math.inf if v > 0 else -math.inf for v in values], dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(array) & (array <= 0)))
    if len(bad):
        i = int(bad[0])
        if np.isneginf(array[i]):
            why = "a log-probability of -inf (probability 0: that token cannot have been sampled; a broken dump)"
        elif np.isfinite(array[i]):
            why = "a log-probability above 0 (probability above 1: impossible)"
        else:
            why = "not a finite number"
        raise InputError(path, f"{column} must hold finite numbers <= 0 (log-probabilities), found "
                         f"{str(values[i])[:40]} at position {i}: {why}", key=where)
    return array.tolist()


def _first_outside(ids: list[int], vocab_size: int) -> int | None:
    """The first token id outside [0, vocab_size), or None (vectorised; Python's ints may exceed int64)."""
    try:
        array = np.asarray(ids, dtype=np.int64)  # [n]
    except OverflowError:
        return next((t for t in ids if not 0 <= t < vocab_size), None)
    outside = np.flatnonzero((array < 0) | (array >= vocab_size))
    return ids[int(outside[0])] if len(outside) else None


def reference_bytes(frame: pd.DataFrame, where: str | Path, metadata: dict[bytes, bytes] | None = None) -> bytes:
    """A reference DataFrame (validated first) in the native Parquet format, with `metadata` in its schema."""
    table = pa.Table.from_pandas(validate(frame, where), schema=SCHEMA, preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def write_reference(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a reference DataFrame (validated first) as the native Parquet format."""
    path = Path(path)
    path.write_bytes(reference_bytes(frame, path))
    return path


def reference_arg(ref) -> str:
    """A reference as given to compare or diagnose, for run.json's arguments: PATH, or NAME=PATH for an (adapter
    name, path) pair."""
    return f"{ref[0]}={ref[1]}" if isinstance(ref, tuple) else str(ref)


def reference_inputs(references) -> dict[str, str]:
    """The reference files under their names in a run's fingerprint: 'reference {i}/{file name}' -> path."""
    paths = [ref[1] if isinstance(ref, tuple) else ref for ref in references]
    return {f"reference {i}/{Path(path).name}": path for i, path in enumerate(paths)}
