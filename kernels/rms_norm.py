"""RMSNorm over the last dim, one program per block of rows: y = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype), or
with `unit_offset` (Qwen3-Next's and Qwen3.5's zero-centred norm) y = (x / sqrt(mean(x^2) + eps) * (1 + w)).to(x.dtype),
every step in float32.

Shapes: x [M, D] (any leading dims flattened, last dim contiguous), w [D] -> y [M, D] in x's dtype.
The statistics are float32, as in transformers; the normalised row is rounded to x's dtype before the weight
multiplies it (transformers' order). One launch replaces the five elementwise/reduction kernels of the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import RMS_NORM_ROWS_PER_PROGRAM


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


@triton.jit(do_not_specialize=["M"])
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, D, eps, stride_xm, stride_ym,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [ROWS]
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        normed = xf * inv[:, None]
        w = w + 1.0
    else:
        normed = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
             (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, *,
             rows_per_program: int = RMS_NORM_ROWS_PER_PROGRAM) -> torch.Tensor:
    """Triton RMSNorm of x [..., D] -> [..., D] in the dtype torch would give (x's, promoted with weight's; x's with
    `unit_offset`). `rows_per_program`: the grid's rows per program (RMS_NORM_ROWS_PER_PROGRAM)."""
    D = x.shape[-1]
    flat = x.reshape(-1, D)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out_dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(flat.shape, dtype=out_dtype, device=x.device)  # [M, D]
    M = flat.shape[0]
    rms_norm_kernel[(triton.cdiv(M, rows_per_program),)](
        flat, weight, y, M, D, eps, flat.stride(0), y.stride(0),
        ROWS=rows_per_program, BLOCK_D=triton.next_power_of_2(D), UNIT_OFFSET=unit_offset, num_warps=4)
    return y.view(x.shape)
