"""Reading local files: JSON documents, and tensors from safetensors files (one, or shards behind an
index) — or from an in-memory dict with the same interface (TensorDict: random-weight benchmark models).

Every failure (missing file, truncated or corrupt file, missing key, wrong shape) becomes an InputError
that names the file and the key, never a stack trace from deep inside safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import InputError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or an InputError saying why not."""
    if not path.is_file():
        raise InputError(path, "file not found")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise InputError(path, f"expected a JSON object, found {type(data).__name__}")
    return data


class TensorFiles:
    """Tensors of one or more safetensors files, addressed by key; each file opened once, tensors read lazily."""

    def __init__(self, files: list[Path]):
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self.read_keys: set[str] = set()
        for path in files:
            if not path.is_file():
                raise InputError(path, "file not found")
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise InputError(path, f"not a readable safetensors file ({e}); is it truncated?") from None
            self._handles[path] = handle
            for key in keys:
                self._where[key] = path

    @classmethod
    def from_checkpoint_dir(cls, model_dir: Path) -> "TensorFiles":
        """`model.safetensors`, or the shards listed by `model.safetensors.index.json`."""
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(index, "expected a non-empty 'weight_map' object", key="weight_map")
            files = cls([model_dir / name for name in sorted(set(weight_map.values()))])
            for key, name in weight_map.items():
                if files._where.get(key) != model_dir / name:
                    raise InputError(model_dir / name, f"index lists this key in {name} but the file lacks it", key=key)
            return files
        single = model_dir / "model.safetensors"
        if not single.is_file():
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
