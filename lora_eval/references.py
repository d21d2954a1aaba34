"""Trainer reference dumps: read (Parquet, JSONL, serving-engine .pt) and write (Parquet), validated.

One row per sample: sample_id, adapter (None = base model), input_ids, logprobs (len(input_ids) - 1),
optional mask and sampler_logprobs (same length). The format is specified in references/README.md.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .checkpoint import read_jsonl
from .errors import InputError

COLUMNS = ["sample_id", "adapter", "input_ids", "logprobs", "mask", "sampler_logprobs"]
SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("adapter", pa.string()), ("input_ids", pa.list_(pa.int64())),
    ("logprobs", pa.list_(pa.float32())), ("mask", pa.list_(pa.bool_())), ("sampler_logprobs", pa.list_(pa.float32())),
])
BASE = "base"  # how reports name the base model (adapter = None); not allowed as an adapter name


def read_reference(path: str | Path, adapter: str | None = None) -> pd.DataFrame:
    """A validated reference DataFrame with COLUMNS. `adapter`, if given, is whose logprobs these are
    (required for .pt dumps, which carry no adapter column; 'base' means the base model)."""
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
        frame = pd.DataFrame(read_jsonl(path))
    elif suffix == ".pt":
        if adapter is None:
            raise InputError(path, "a .pt dump has no adapter column: give it as NAME=FILE.pt (NAME 'base' for the "
                             "base model)")
        frame = _read_pt(path)
    else:
        raise InputError(path, f"unknown reference format '{suffix}' (expected .parquet, .jsonl or .pt)")
    if adapter is not None:
        frame["adapter"] = None if adapter == BASE else adapter
    return validate(frame, path)


def _read_pt(path: Path) -> pd.DataFrame:
    """Serving-engine dumps: a dict {tokens, training_logprobs, sampling_logprobs?} of per-sample lists or
    2D tensors, or a list of such dicts (one per sample). Never unpickles anything but tensors and containers."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(path, f"refused: not a plain tensor/list dump (loaded with weights_only=True only): "
                         f"{first}") from None
    samples = data if isinstance(data, list) else [data]
    rows = []
    for i, item in enumerate(samples):
        if not isinstance(item, dict) or "tokens" not in item or "training_logprobs" not in item:
            raise InputError(path, "expected a dict (or list of dicts) with 'tokens' and 'training_logprobs'",
                             key=f"sample {i}")
        tokens, train = _rows(item["tokens"]), _rows(item["training_logprobs"])
        sampler = _rows(item["sampling_logprobs"]) if item.get("sampling_logprobs") is not None else None
        if len(tokens) != len(train) or (sampler is not None and len(sampler) != len(tokens)):
            raise InputError(path, f"{len(tokens)} token rows but {len(train)} training_logprobs rows"
                             + (f" and {len(sampler)} sampling_logprobs rows" if sampler is not None else ""))
        for j in range(len(tokens)):
            rows.append(dict(sample_id=f"{path}:{len(rows)}", input_ids=tokens[j], logprobs=train[j],
                             sampler_logprobs=None if sampler is None else sampler[j]))
    return pd.DataFrame(rows)


def _rows(value) -> list[list]:
    """Per-sample lists from a 1D/2D tensor, a list of 1D tensors, or (nested) lists."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    value = [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
    if value and not isinstance(value[0], (list, tuple)):
        value = [value]
    return [list(v) for v in value]


def validate(frame: pd.DataFrame, path: str | Path) -> pd.DataFrame:
    """Normalise types and check every sample; errors name the file and the sample."""
    for column in ("input_ids", "logprobs"):
        if column not in frame.columns:
            raise InputError(path, f"missing required column (columns: {', '.join(map(str, frame.columns))})",
                             key=column)
    frame = frame.copy()
    if "sample_id" not in frame.columns:
        frame["sample_id"] = [str(i) for i in range(len(frame))]
    for column in COLUMNS:
        if column not in frame.columns:
            frame[column] = None
    frame["sample_id"] = frame["sample_id"].astype(str)
    duplicated = frame["sample_id"][frame["sample_id"].duplicated()]
    if len(duplicated):
        raise InputError(path, "sample_id must be unique within a file", key=f"sample {duplicated.iloc[0]}")
    records = []
    for row in frame[COLUMNS].itertuples(index=False):
        where = f"sample {row.sample_id}"
        ids = _list(row.input_ids, path, where, "input_ids")
        if len(ids) < 2 or not all(isinstance(t, int) or (isinstance(t, float) and t.is_integer()) for t in ids):
            raise InputError(path, "input_ids must hold at least 2 integer token ids", key=where)
        ids = [int(t) for t in ids]
        n = len(ids) - 1
        logprobs = _floats(row.logprobs, n, path, where, "logprobs")
        mask = None if _missing(row.mask) else [bool(m) for m in _list(row.mask, path, where, "mask", n)]
        sampler = None if _missing(row.sampler_logprobs) else _floats(row.sampler_logprobs, n, path, where,
                                                                       "sampler_logprobs")
        adapter = None if _missing(row.adapter) else str(row.adapter)
        if adapter == BASE:
            adapter = None
        records.append(dict(sample_id=row.sample_id, adapter=adapter, input_ids=ids, logprobs=logprobs, mask=mask,
                            sampler_logprobs=sampler))
    return pd.DataFrame(records, columns=COLUMNS)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _list(value, path, where, column, length=None) -> list:
    if _missing(value):
        raise InputError(path, f"{column} is missing", key=where)
    values = list(value.tolist() if hasattr(value, "tolist") else value)
    if length is not None and len(values) != length:
        raise InputError(path, f"{column} has {len(values)} entries, expected len(input_ids)-1 = {length}", key=where)
    return values


def _floats(value, length, path, where, column) -> list[float]:
    values = [float(v) for v in _list(value, path, where, column, length)]
    if not all(math.isfinite(v) for v in values):
        raise InputError(path, f"{column} holds a non-finite value", key=where)
    return values


def write_reference(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a reference DataFrame (validated first) as the native Parquet format."""
    path = Path(path)
    frame = validate(frame, path)
    pq.write_table(pa.Table.from_pandas(frame, schema=SCHEMA, preserve_index=False), path)
    return path
