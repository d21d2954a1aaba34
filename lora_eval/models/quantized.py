"""Quantized checkpoints, dequantised on load to the compute dtype: MXFP4 experts (gpt-oss) and block FP8
(DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8). The one place that knows these formats.

`read_quantization` reads config.json's `quantization_config` (None for a plain checkpoint; whatever we do not
compute is refused by name). `QuantizedFiles` wraps a checkpoint's tensors (TensorFiles or TensorDict) so that a
family's load_weights reads a quantized weight under its plain name, dequantised, one tensor at a time:

  mxfp4  `{name}_blocks` uint8 [..., rows, cols/32, 16] (two E2M1 codes a byte, low nibble first) and
         `{name}_scales` uint8 [..., rows, cols/32] (E8M0: x 2^(s - 127) per 32 values)
         -> `{name}` [..., cols, rows], the transposed layout transformers gives the parameter (gpt-oss experts
         gate_up_proj [E, H, 2I], down_proj [E, I, H]); bit for bit transformers' `convert_moe_packed_tensors`.
  fp8    `{module}.weight` float8_e4m3fn [..., out, in] and `{module}.weight_scale_inv` float32
         [..., ceil(out/bm), ceil(in/bn)] (a fused tensor `{name}` has `{name}_scale_inv`)
         -> `{module}.weight` [..., out, in] = value x the scale of its bm x bn block, the last block of a ragged
         edge smaller (DeepSeek's `weight_dequant`), in float32, then rounded once to the compute dtype.

Which tensors are quantized is read from the files (a tensor with blocks or a scale beside it), so layers kept in
bf16 load as they are; a module that `modules_to_not_convert` names must not be stored quantized. Activations stay
in the compute dtype: the run emulates a trainer that dequantises (w4a16 / w8a16), not a serving engine's w8a8.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedError

METHODS = ("mxfp4", "fp8")
KEY = "quantization_config"
# FP4 E2M1 value of each 4-bit code (transformers' integrations/mxfp4.py FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per E8M0 scale, 16 bytes
E8M0_BIAS = 127
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Quantization:
    """What config.json's quantization_config says: the method, FP8's block [rows, cols], and the module
    patterns left unquantized."""
    method: str
    block: tuple[int, int] | None
    not_converted: tuple[str, ...]
    where: str

    def describe(self, dtype: torch.dtype) -> str:
        """The numerics a run on the dequantised weights emulates."""
        name = str(dtype).removeprefix("torch.")
        if self.method == "mxfp4":
            return f"mxfp4 experts dequantised to {name} (w4a16)"
        return f"block fp8 [{self.block[0]}, {self.block[1]}] dequantised to {name} (w8a16)"

    def converts(self, module: str) -> bool:
        """Whether `module` may be stored quantized: transformers' rules for modules_to_not_convert (a pattern
        matches from the start up to a module boundary, as a regex, or as a suffix)."""
        return not any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p)
                       for p in self.not_converted)


def read_quantization(config: dict, where) -> Quantization | None:
    """config's quantization_config, or None; an UnsupportedError names what we do not compute."""
    quant = config.get(KEY)
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise InputError(where, f"expected an object, found {quant!r}", key=KEY)
    method = quant.get("quant_method")
    if method not in METHODS:
        raise UnsupportedError(where, f"quant_method {method!r} is not supported (mxfp4 and block fp8 are)",
                               key=f"{KEY}.quant_method")
    not_converted = quant.get("modules_to_not_convert") or []
    if not isinstance(not_converted, list) or not all(isinstance(p, str) for p in not_converted):
        raise InputError(where, f"expected a list of module names, found {not_converted!r}",
                         key=f"{KEY}.modules_to_not_convert")
    for pattern in not_converted:
        try:
            re.compile(pattern)
        except re.error as e:
            raise InputError(where, f"{pattern!r} is not a valid pattern ({e})",
                             key=f"{KEY}.modules_to_not_convert") from None
    if method == "mxfp4":
        if config.get("model_type") != "gpt_oss":
            raise UnsupportedError(where, f"mxfp4 is supported for gpt_oss experts only, not for "
                                   f"'{config.get('model_type')}'", key=f"{KEY}.quant_method")
        return Quantization(method, None, tuple(not_converted), str(where))
    return Quantization(method, _fp8_block(quant, where), tuple(not_converted), str(where))


def _fp8_block(quant: dict, where) -> tuple[int, int]:
    """FP8's weight_block_size, after refusing the FP8 variants we do not compute."""
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedError(where, f"fp8 fmt {quant['fmt']!r} is not supported (e4m3 is)", key=f"{KEY}.fmt")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedError(where, f"activation_scheme {quant['activation_scheme']!r} (static input scales) is "
                               "not supported (dynamic is)", key=f"{KEY}.activation_scheme")
    block = quant.get("weight_block_size")
    if block is None:
        raise UnsupportedError(where, "fp8 without weight_block_size (per-tensor or per-channel scales) is not "
                               "supported; block fp8 is", key=f"{KEY}.weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise InputError(where, f"expected [rows, cols] of positive integers, found {block!r}",
                         key=f"{KEY}.weight_block_size")
    return tuple(block)


# --- dequantisation ---------------------------------------------------------------------------------------------


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> [..., rows, G*32] in `dtype`: the E2M1
    value of each nibble (low nibble first) x 2^(scale - 127), computed as transformers does (a table in `dtype`,
    then ldexp), one leading index at a time to bound the temporaries."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)  # [16]
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype, device=blocks.device)  # [..., rows, G, 32]
    flat_out, flat_blocks = out.view(-1, *out.shape[-3:]), blocks.reshape(-1, *blocks.shape[-3:])
    flat_scales = scales.reshape(-1, *scales.shape[-2:])
    for part, packed, scale in zip(flat_out, flat_blocks, flat_scales):  # [rows, G, 32], [rows, G, 16], [rows, G]
        part[..., 0::2] = lut[(packed & 0x0F).int()]
        part[..., 1::2] = lut[(packed >> 4).int()]
        torch.ldexp(part, scale.int().sub_(E8M0_BIAS).unsqueeze(-1), out=part)
    return out.flatten(-2)  # [..., rows, cols]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """weight fp8 [..., out, in], scale_inv [..., ceil(out/bm), ceil(in/bn)] -> [..., out, in] in `dtype`: each
    value x the scale of its fixed bm x bn block (edge blocks partial), in float32, rounded once to `dtype`."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    scale = scale_inv.to(torch.float32).repeat_interleave(bm, dim=-2)[..., :rows, :]  # [..., out, ceil(in/bn)]
    scale = scale.repeat_interleave(bn, dim=-1)[..., :cols]  # [..., out, in]
    return (weight.to(torch.float32) * scale).to(dtype)  # [..., out, in]


# --- reading ----------------------------------------------------------------------------------------------------


class QuantizedFiles:
    """A checkpoint's tensors with every quantized weight read under its plain name, dequantised to `dtype` on
    `device` (the packed bytes travel, not the wide values); every other key passes through to `files`.
    `quantized` collects the plain names served dequantised (checked on the meta device, or read)."""

    def __init__(self, files, quant: Quantization, dtype: torch.dtype, device: torch.device):
        self.files, self.quant, self.compute_dtype, self.device = files, quant, dtype, torch.device(device)
        self.quantized: set[str] = set()

    @property
    def read_keys(self) -> set[str]:
        return self.files.read_keys

    @property
    def stored(self):
        """The tensors as stored (packed data and scales under their own keys), for naming a bad one."""
        return self.files

    def keys(self) -> list[str]:
        return self.files.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.files or self._parts(key) is not None

    def file_of(self, key: str):
        parts = self._parts(key)
        return self.files.file_of(parts[0] if parts else key)

    def describe(self) -> str:
        return self.files.describe()

    def dtype(self, key: str) -> torch.dtype | None:
        """The dtype `key` is read in: the compute dtype where it is stored quantized, else as stored."""
        return self.compute_dtype if self._parts(key) is not None else self.files.dtype(key)

    def numerics(self) -> str | None:
        """What the run emulates (Quantization.describe), or None where no tensor was stored quantized."""
        return self.quant.describe(self.compute_dtype) if self.quantized else None

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        """Raise unless `key` exists with `shape`, its packed parts and scales matching (headers only)."""
        parts = self._parts(key)
        if parts is None:
            return self.files.check(key, shape)
        for part, part_shape, dtypes in zip(parts, self._stored_shapes(key, tuple(shape)), self._stored_dtypes()):
            self.files.check(part, part_shape)
            if self.files.dtype(part) not in dtypes:
                raise InputError(self.files.file_of(part), f"dtype {self.files.dtype(part)}, expected "
                                 f"{' or '.join(map(str, dtypes))} for {self.quant.method}", key=part)
        self.quantized.add(key)

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key` (dequantised when stored quantized), checked against `shape`, cast to `dtype`."""
        parts = self._parts(key)
        if parts is None:
            return self.files.get(key, shape, dtype)
        self.check(key, shape if shape is not None else self._plain_shape(parts[0]))
        data, scales = (self.files.get(part).to(self.device) for part in parts)
        if self.quant.method == "mxfp4":
            out = dequantize_mxfp4(data, scales, self.compute_dtype).transpose(-1, -2)  # [..., cols, rows], a view
        else:
            out = dequantize_fp8(data, scales, self.quant.block, self.compute_dtype)  # [..., out, in]
        return out if dtype is None else out.to(dtype)

    def _parts(self, key: str) -> tuple[str, str] | None:
        """(packed data, scales): the keys holding `key` quantized, or None where it is stored plain."""
        if self.quant.method == "mxfp4":
            parts = (f"{key}_blocks", f"{key}_scales")
            quantized = any(p in self.files for p in parts)
        else:
            scale = key.removesuffix(".weight") + ".weight_scale_inv" if key.endswith(".weight") else f"{key}_scale_inv"
            parts = (key, scale)
            quantized = scale in self.files or (key in self.files and self.files.dtype(key) == FP8_DTYPE)
        if not quantized:
            return None
        module = key.rsplit(".", 1)[0]
        if not self.quant.converts(module):
            raise InputError(self.files.file_of(next(p for p in parts if p in self.files)),
                             f"stored quantized, but {KEY}.modules_to_not_convert names module '{module}'", key=key)
        return parts

    def _stored_shapes(self, key: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of `key`'s packed data and scales, for its plain shape."""
        if len(shape) < 2:
            raise InputError(self.files.describe(), f"a {len(shape)}-D tensor cannot be stored in "
                             f"{self.quant.method}", key=key)
        *lead, a, b = shape
        if self.quant.method == "mxfp4":  # plain [..., cols, rows], stored as rows of 32-value blocks
            if a % MXFP4_BLOCK:
                raise InputError(self.files.describe(), f"{a} columns do not split into {MXFP4_BLOCK}-value mxfp4 "
                                 "blocks", key=key)
            groups = a // MXFP4_BLOCK
            return (*lead, b, groups, MXFP4_BLOCK // 2), (*lead, b, groups)
        bm, bn = self.quant.block
        return tuple(shape), (*lead, math.ceil(a / bm), math.ceil(b / bn))

    def _stored_dtypes(self) -> tuple[tuple[torch.dtype, ...], tuple[torch.dtype, ...]]:
        if self.quant.method == "mxfp4":
            return (torch.uint8,), (torch.uint8,)
        return (FP8_DTYPE,), (torch.float32, torch.bfloat16, torch.float16)

    def _plain_shape(self, data_key: str) -> tuple[int, ...]:
        """`key`'s plain shape from its packed data's shape on disk."""
        if data_key not in self.files:
            raise InputError(self.files.describe(), "missing tensor", key=data_key)
        stored = self.files.shape(data_key)
        if self.quant.method == "mxfp4":
            if len(stored) < 3:
                raise InputError(self.files.file_of(data_key), f"shape {list(stored)}, expected [..., rows, "
                                 f"cols/{MXFP4_BLOCK}, {MXFP4_BLOCK // 2}]", key=data_key)
            return (*stored[:-3], stored[-2] * MXFP4_BLOCK, stored[-3])
        return stored
