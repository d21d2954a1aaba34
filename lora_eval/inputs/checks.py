"""Checks of what the user gives, made before any model is loaded: adapter names, thresholds, JSONL lines, the
model's config. Each refusal is an InputError naming the file, line or option and what was expected."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import InputError
from ..models import check_folder_vocab, family_and_args
from ..models.checkpoint import read_json
from ..names import BASE, OVERALL


def adapter_names(adapters: dict | None) -> dict[str, Path]:
    """{name: folder} with names that reports can use ('base' and 'overall' are theirs)."""
    adapters = dict(adapters or {})
    for name, folder in adapters.items():
        if not isinstance(name, str) or not name:
            raise InputError("--adapter", f"expected a non-empty adapter name, found {name!r}")
        if name in (BASE, OVERALL):
            raise InputError("--adapter", f"'{name}' is reserved for reports; choose another adapter name")
        if not isinstance(folder, (str, Path)):
            raise InputError("--adapter", f"expected a folder for adapter '{name}', found {type(folder).__name__}")
    return {name: Path(folder) for name, folder in adapters.items()}


def threshold(value, option: str) -> float | None:
    """A threshold: None (off) or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(option, f"expected a finite number >= 0, found {value!r}")
    return float(value)


def temperature_option(value, option: str = "--temperature") -> float | None:
    """A sampling temperature: None (not given) or a finite number above 0."""
    if value is not None and threshold(value, option) == 0:
        raise InputError(option, "expected a finite number above 0, found 0")
    return None if value is None else float(value)


def positive_int(value, option: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(option, f"expected an integer >= {low}, found {value!r}")
    return value


def model_config(model_dir: str | Path) -> tuple[dict, object]:
    """The model's config.json and its ModelArgs (family, sizes, vocabulary) checked, and the weight files, where
    present, opened (headers only): each readable, and the vocabulary config.json gives the one the weights have
    (before any token id is checked against it)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(model_dir, "model folder not found")
    path = model_dir / "config.json"
    config = read_json(path)
    args = family_and_args(config, path)[1]
    check_folder_vocab(model_dir, args)
    return config, args


def check_lengths(lengths, sample_ids, max_len: int | None, where) -> None:
    """Refuse the first sample longer than the model's max_position_embeddings (`max_len`, ModelArgs'; None: the
    config names none): one line naming `where` (the reference or prompts file), the sample and both lengths.
    Why refuse rather than compute: the config says the model was trained for at most max_len positions, so a
    reference of a longer sample cannot come from a trainer that used this config; past it RoPE extrapolates (a
    yarn or llama3 rope is even defined relative to a pre-training length) and whatever we compute matches nothing
    the user can trust. `lengths` and `sample_ids`: parallel sequences (token counts, ids)."""
    if max_len is None:
        return
    for length, sample_id in zip(lengths, sample_ids):
        if int(length) > max_len:
            raise InputError(where, f"{int(length)} tokens, more than the model's max_position_embeddings "
                             f"({max_len}, config.json): positions past it are not what the model was trained on",
                             key=f"sample_id {sample_id}")


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, JSON object) of every non-empty line; an InputError names the line that is not UTF-8, not JSON
    or not an object. NaN and Infinity (which Python's json writes) parse, for the column checks to refuse by name."""
    rows = []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(path, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                             key=f"line {n}") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(path, f"not valid JSON ({e})", key=f"line {n}") from None
        if not isinstance(row, dict):
            raise InputError(path, f"expected a JSON object, found {type(row).__name__}", key=f"line {n}")
        rows.append((n, row))
    return rows
