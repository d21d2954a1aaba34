"""Rotary position embedding (rotate-half convention), written straight into the layout attention reads.

Shapes: x [B, L, heads, D] (a view of a projection's output [B*L, heads*D]), cos/sin [B, L, D] (any strides)
-> out [B, heads, L, D] (memory in [B, L, heads, D] order: attention_layout): out = x * cos + rotate_half(x) * sin
with rotate_half(x) = [-x2, x1]. Float32 math, one rounding at the end. One launch replaces the chunk/cat/mul/add
kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import POSITIONS_PER_PROGRAM


def attention_layout(B: int, heads: int, L: int, D: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An empty [B, heads, L, D] tensor whose memory is in [B, L, heads, D] order: cuDNN's attention writes its
    output in q's order, so the [B*L, heads*D] view of that output (o_proj's input) needs no transpose copy
    (BENCHMARKS-history 3, "q and k written in [B, L, heads, D] memory order")."""
    return torch.empty(B, L, heads, D, dtype=dtype, device=device).transpose(1, 2)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch: x [B, L, heads, D] -> [B, heads, L, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos[:, :, None] + rotated * sin[:, :, None]).transpose(1, 2)


@triton.jit(do_not_specialize=["L"])
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, L, HEADS,
                stride_xb, stride_xl, stride_xh, stride_cb, stride_cl, stride_sb, stride_sl,
                POSITIONS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    b = tl.program_id(1)
    pos = tl.program_id(0) * POSITIONS + tl.arange(0, POSITIONS)  # [P]
    heads = tl.arange(0, BLOCK_H)  # [BH]
    d = tl.arange(0, HALF)  # [D/2]
    pmask = pos < L
    mask = pmask[:, None, None] & (heads < HEADS)[None, :, None]  # [P, BH, 1]
    x = x_ptr + b.to(tl.int64) * stride_xb + pos[:, None, None].to(tl.int64) * stride_xl + \
        heads[None, :, None] * stride_xh + d[None, None, :]  # [P, BH, D/2]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos_ptr + b.to(tl.int64) * stride_cb + pos[:, None].to(tl.int64) * stride_cl + d[None, :]  # [P, D/2]
    s = sin_ptr + b.to(tl.int64) * stride_sb + pos[:, None].to(tl.int64) * stride_sl + d[None, :]
    cos1 = tl.load(c, mask=pmask[:, None], other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(c + HALF, mask=pmask[:, None], other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(s, mask=pmask[:, None], other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(s + HALF, mask=pmask[:, None], other=0.0).to(tl.float32)[:, None, :]
    out = out_ptr + ((b.to(tl.int64) * L + pos[:, None, None]) * HEADS + heads[None, :, None]) * (2 * HALF) + \
        d[None, None, :]  # [P, BH, D/2] in [B, L, heads, D] memory
    tl.store(out, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         positions_per_program: int = POSITIONS_PER_PROGRAM) -> torch.Tensor:
    """Triton rope of x [B, L, heads, D] (last dim contiguous) -> [B, heads, L, D] (attention_layout).
    `positions_per_program`: the grid's positions per program (POSITIONS_PER_PROGRAM)."""
    B, L, heads, D = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope needs a contiguous last dim")
    out = attention_layout(B, heads, L, D, x.dtype, x.device)
    rope_kernel[(triton.cdiv(L, positions_per_program), B)](
        x, cos, sin, out, L, heads, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1), POSITIONS=positions_per_program, BLOCK_H=triton.next_power_of_2(heads),
        HALF=D // 2, num_warps=4)
    return out
