"""Reading local files: JSON documents, and tensors from safetensors files (one, or shards behind an
index) — or from an in-memory dict with the same interface (TensorDict: random-weight benchmark models).

Every failure (missing, unreadable or truncated file, a folder or dangling link where a file should be, missing or
duplicated key, wrong shape, non-finite weights) becomes an InputError that names the file and the key, never a
stack trace from deep inside safetensors.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import InputError

SHARD_NAME = re.compile(r"[^/\\]+\.safetensors")  # a file name, no folder part (nothing outside the model folder)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def readable_file(path: Path) -> None:
    """Raise an InputError naming `path` and why it cannot be read as a file: missing, a dangling link, a folder,
    or unreadable (permissions); nothing when it can."""
    if path.is_symlink() and not path.exists():
        raise InputError(path, f"a symbolic link to {os.readlink(path)}, which does not exist")
    if not path.exists():
        raise InputError(path, "file not found")
    if path.is_dir():
        raise InputError(path, "a folder where a file is expected")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or an InputError saying why not."""
    readable_file(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(path, f"expected a JSON object, found {type(data).__name__}")
    return data


def check_finite_numbers(value, where, key: str = "") -> None:
    """Refuse a NaN or an infinity anywhere in a parsed JSON document (Python's json reads NaN and Infinity), naming
    its key path: no number a model is built from may be non-finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(where, f"expected a finite number, found {value!r}", key=key or None)
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite_numbers(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite_numbers(v, where, f"{key}[{i}]")


class TensorFiles:
    """Tensors of one or more safetensors files, addressed by key; each file opened once, tensors read lazily."""

    def __init__(self, files: list[Path]):
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self.read_keys: set[str] = set()
        for path in files:
            readable_file(path)
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise InputError(path, f"not a readable safetensors file ({e}); is it truncated?") from None
            self._handles[path] = handle
            for key in keys:
                if key in self._where:  # which copy a reader took would depend on the order of the files
                    raise InputError(path, f"also in {self._where[key]}: a tensor must be in one file only", key=key)
                self._where[key] = path

    @staticmethod
    def in_checkpoint_dir(model_dir: Path) -> bool:
        """Whether `model_dir` has weights to open (`from_checkpoint_dir` says what is wrong with them, if anything):
        a model.safetensors or an index, even a broken link."""
        return any((model_dir / name).exists() or (model_dir / name).is_symlink()
                   for name in ("model.safetensors", "model.safetensors.index.json"))

    @classmethod
    def from_checkpoint_dir(cls, model_dir: Path) -> "TensorFiles":
        """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
        index = model_dir / "model.safetensors.index.json"
        if index.exists() or index.is_symlink():  # (a broken link too: named as such by read_json)
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(index, "expected a non-empty 'weight_map' object", key="weight_map")
            for key, name in weight_map.items():  # a shard is a file of this folder
                if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
                    raise InputError(index, f"expected the name of a .safetensors file in the model folder, found "
                                     f"{name!r}", key=f"weight_map.{key}")
            files = cls([model_dir / name for name in sorted(set(weight_map.values()))])
            for key, name in weight_map.items():
                if files._where.get(key) != model_dir / name:
                    raise InputError(model_dir / name, f"index lists this key in {name} but the file lacks it", key=key)
            for key, path in files._where.items():  # transformers loads only what the index lists
                if key not in weight_map:
                    raise InputError(index, f"lacks '{key}', which the listed shard {path.name} holds (transformers "
                                     "would not load it); is the index out of date?", key="weight_map")
            return files
        single = model_dir / "model.safetensors"
        if not (single.exists() or single.is_symlink()):
            raise InputError(model_dir, "no model.safetensors or model.safetensors.index.json in the checkpoint folder")
        return cls([single])

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> Path:
        return self._where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self._handles[self._where[key]].get_slice(key).get_dtype())

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        """Raise unless `key` exists with `shape` (reads the header only)."""
        if key not in self._where:
            raise InputError(self.describe(), "missing tensor", key=key)
        self.read_keys.add(key)
        if self.shape(key) != tuple(shape):
            raise InputError(self._where[key], f"shape {list(self.shape(key))}, expected {list(shape)}", key=key)

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key`, checked against `shape` and cast to `dtype` (one copy at a time)."""
        if shape is not None:
            self.check(key, shape)
        elif key not in self._where:
            raise InputError(self.describe(), "missing tensor", key=key)
        path = self._where[key]
        self.read_keys.add(key)
        try:
            tensor = self._handles[path].get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise InputError(path, f"cannot read tensor ({e}); is the file truncated?", key=key) from None
        return tensor if dtype is None else tensor.to(dtype)

    def get_rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows start .. start+count of `key` along its first dimension, reading only those bytes."""
        path = self._where[key]
        self.read_keys.add(key)
        try:
            return self._handles[path].get_slice(key)[start:start + count]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise InputError(path, f"cannot read tensor ({e}); is the file truncated?", key=key) from None

    def describe(self) -> str:
        paths = sorted({str(p) for p in self._handles})
        return paths[0] if len(paths) == 1 else f"{Path(paths[0]).parent} (sharded checkpoint)"


class TensorDict:
    """In-memory tensors addressed by key, with TensorFiles' interface, so a model loader reads either source.
    `get` hands back the tensor itself (no copy) unless a cast to another dtype is asked for."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str = "<in-memory tensors>"):
        self.where = where
        self.read_keys: set[str] = set()
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.is_meta:
                raise InputError(where, f"expected a tensor with data, found {type(value).__name__}"
                                 f"{' on the meta device' if isinstance(value, torch.Tensor) else ''}", key=key)
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def file_of(self, key: str) -> str:
        return self.where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        """Raise unless `key` exists with `shape`."""
        if key not in self._tensors:
            raise InputError(self.where, "missing tensor", key=key)
        self.read_keys.add(key)
        if self.shape(key) != tuple(shape):
            raise InputError(self.where, f"shape {list(self.shape(key))}, expected {list(shape)}", key=key)

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key` itself, checked against `shape`; cast (a copy) only when `dtype` differs."""
        if shape is not None:
            self.check(key, shape)
        elif key not in self._tensors:
            raise InputError(self.where, "missing tensor", key=key)
        self.read_keys.add(key)
        tensor = self._tensors[key]
        return tensor if dtype is None else tensor.to(dtype)

    def get_rows(self, key: str, start: int, count: int) -> torch.Tensor:
        """Rows start .. start+count of `key` along its first dimension (a view)."""
        self.read_keys.add(key)
        return self._tensors[key][start:start + count]

    def describe(self) -> str:
        return self.where


# --- a model's weights: floating point and finite ---------------------------------------------------------------


def check_weight(files, key: str, shape: tuple[int, ...]) -> None:
    """Raise unless checkpoint tensor `key` exists with `shape` and a floating-point dtype (headers only): an integer
    or boolean tensor where a weight is expected is refused by name, never cast to numbers it does not hold."""
    files.check(key, shape)
    _floating(files, key, files.dtype(key))


def read_weight(files, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Checkpoint tensor `key` as stored, checked against `shape` and refused unless floating point."""
    tensor = files.get(key, shape)
    _floating(files, key, tensor.dtype)
    return tensor


def load_tensor(files, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                stored: tuple[int, ...] | None = None, to_ours=None) -> torch.Tensor:
    """Checkpoint tensor `key` as a parameter of `shape`, in `dtype` on `device`: stored with shape `stored` (default:
    `shape`) and brought into our layout by `to_ours` (then made contiguous). On the meta device only checked (headers:
    check_weight), nothing read."""
    if device.type == "meta":
        check_weight(files, key, stored or shape)
        return torch.empty(shape, dtype=dtype, device=device)
    tensor = read_weight(files, key, stored or shape)
    if to_ours is None:
        return tensor.to(device=device, dtype=dtype)
    return to_ours(tensor).to(device=device, dtype=dtype).contiguous()


def _floating(files, key: str, dtype: torch.dtype | None) -> None:
    if dtype is None or not dtype.is_floating_point:
        found = "a dtype lora-eval does not read" if dtype is None else f"dtype {str(dtype).removeprefix('torch.')}"
        raise InputError(files.file_of(key), f"{found}, expected floating-point weights", key=key)


def check_finite(weights: dict[str, torch.Tensor], files) -> None:
    """Refuse a model whose loaded `weights` ({parameter name: tensor in the compute dtype, on its device}) hold a
    NaN or an infinity, naming the checkpoint file and key. One min/max reduction per tensor where it lies (on the
    GPU after upload) and one host sync per device for them all; only when one fails are the checkpoint's tensors of
    that layer read again on the CPU to name the culprit. A weight finite on disk but not in the compute dtype (beyond
    float16's range) or once dequantised (a scale out of range) is named by its parameter."""
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        if tensor.is_meta or not tensor.numel() or not tensor.is_floating_point():
            continue
        low, high = torch.aminmax(tensor.detach())  # NaN propagates into both; an infinity is an extreme
        flags.setdefault(tensor.device, []).append((name, torch.isfinite(low) & torch.isfinite(high)))
    for group in flags.values():
        ok = torch.stack([flag for _, flag in group])  # [tensors] on the device
        if bool(ok.all()):
            continue
        bad = next(name for (name, _), good in zip(group, ok.tolist()) if not good)
        _name_culprit(files, bad, weights[bad].dtype)


LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _name_culprit(files, name: str, dtype: torch.dtype) -> None:
    """Raise the InputError for parameter `name`, found non-finite: the first checkpoint tensor read for its layer
    (or outside every layer) that holds a NaN or an infinity, else the parameter itself."""
    layer = LAYER.search(name)
    stored = getattr(files, "stored", files)  # quantized parts as stored: a scale named, not the weight it scales
    for key in sorted(files.read_keys or files.keys()):  # (none read: another loader read the weights)
        m = LAYER.search(key)
        if (m[1] if m else None) != (layer[1] if layer else None):
            continue
        tensor = stored.get(key)
        if not tensor.is_floating_point():
            continue  # packed data, E8M0 scales: out of range only once dequantised (below)
        bad = ~torch.isfinite(tensor.float())  # (float8 has no isfinite)
        if bool(bad.any()):
            index = [int(i) for i in bad.nonzero()[0]]
            raise InputError(stored.file_of(key), f"{float(tensor[tuple(index)])} at index {index}: model weights "
                             f"must be finite numbers ({int(bad.sum())} non-finite values)", key=key)
    raise InputError(files.describe(), f"finite on disk but not once read in {str(dtype).removeprefix('torch.')} "
                     "(values beyond its range, or quantization scales out of range): model weights must be finite "
                     "numbers", key=name)
