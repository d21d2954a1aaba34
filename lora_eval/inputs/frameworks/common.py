"""What the framework readers share: the Format a file is read as (for messages and `inspect`), the one way a .pt
file is opened (torch.load(weights_only=True)), and the per-sample array helpers."""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...errors import InputError

EXPORTS = "references/README.md"  # where the export snippets for refused files are documented


@dataclass(frozen=True)
class Format:
    """How a file was read. `temperature_key`: the framework setting that holds the temperature its writer applied
    but did not record (the file then needs read_reference's `temperature`); `adapter_column`: whether the file
    names the adapter of each sample (else the CLI's NAME=FILE does); `compared`: the side that `logprobs` holds
    (the trainer's, or the sampler's when the file carries no trainer side)."""

    name: str
    follows: str
    temperature_key: str | None = None
    adapter_column: bool = False
    compared: str = "trainer"
    keys: tuple[tuple[str, str], ...] = ()  # (our column, the file's key) where they differ, for messages

    def sampler_only(self) -> Format:
        """The format of a file that carries the sampler side alone: `logprobs` holds it."""
        keys = dict(self.keys)
        keys["logprobs"] = keys.pop("sampler_logprobs", "sampler_logprobs")
        return replace(self, compared="sampler", keys=tuple(keys.items()))

    def names(self) -> dict[str, str]:
        return dict(self.keys)


class NotPlain(Exception):
    """torch.load(weights_only=True) refused the file: it pickles the Python object `global_name` (module.name)."""

    def __init__(self, global_name: str):
        self.global_name = global_name
        super().__init__(global_name)


def load_torch(path: Path):
    """A torch.save file of tensors, lists, dicts and plain values, loaded on the CPU with weights_only=True: nothing
    else is ever unpickled. NotPlain when it holds another object (the caller says which framework writes such)."""
    try:
        with warnings.catch_warnings():  # (torch warns about pickle protocols on its way to refusing)
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's own text advises weights_only=False: never, for a file we were given
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        raise NotPlain(found.group(1) if found else "") from None
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    except (RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(path, f"not a readable torch file (truncated or corrupt: {first[:120]})") from None


def numbers(value, key: str, path: Path, where: str) -> np.ndarray:
    """A per-token 1D array (a list, a tuple or a tensor) as numpy; anything else refused naming the key."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        pass
    elif isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value, dtype=object if any(v is None for v in value) else None)
        except (ValueError, OverflowError):
            raise InputError(path, f"{key} must be a list of numbers", key=where) from None
    else:
        raise InputError(path, f"{key} must be a list or a tensor, found {type(value).__name__} {value!r:.40}",
                         key=where)
    if value.ndim != 1:
        raise InputError(path, f"{key} must be 1-D (one value per token), found shape {list(value.shape)}", key=where)
    if value.dtype.kind not in "biuf":
        bad = next((v for v in value if isinstance(v, (bool, str)) or not isinstance(v, (int, float))), None)
        raise InputError(path, f"{key} must hold numbers, found {bad!r:.40}", key=where)
    return value


def length(value, key: str, path: Path, where: str, at_least: int = 0) -> int:
    """A non-negative integer count (a plain int, or a length-1 list or tensor holding one)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < at_least:
        raise InputError(path, f"{key} must be an integer >= {at_least}, found {value!r:.40}", key=where)
    return int(value)


def routes(value, key: str, path: Path, where: str) -> np.ndarray | None:
    """Routed experts [rows, layers, top_k] as an int array (None stays None); the shape is checked by the caller."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value) if isinstance(value, (np.ndarray, list)) else None
    if array is None or array.ndim != 3 or array.dtype.kind not in "iu":
        shape = list(array.shape) if array is not None else type(value).__name__
        raise InputError(path, f"{key} must be an integer array [positions, layers, top_k], found {shape}", key=where)
    return array
