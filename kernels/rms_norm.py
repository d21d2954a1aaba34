"""RMSNorm over the last dim, one program per block of rows: y = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype).

Shapes: x [M, D] (any leading dims flattened, last dim contiguous), w [D] -> y [M, D] in x's dtype.
The statistics are float32, as in transformers; the normalised row is rounded to x's dtype before the weight
multiplies it (transformers' order). One launch replaces the five elementwise/reduction kernels of the torch ops.

`lora_head_norm`: a projection's LoRA expand and the RMSNorm over each of its heads (Qwen3's q_norm / k_norm) in
one pass: y [T, heads * D] (the projection without its delta), shrunk [T, R], B [S, heads * D, R] ->
norm((y + shrunk @ B[slot]^T).to(y.dtype)) [T, heads, D]: the numbers of dense_lora_expand then rms_norm, without
the read-add-write of the projection between them. Rows of no slot (or of a masked slot) get no delta, and their
norm is the plain kernel's bit for bit: a row's sum over D is split across threads the same way whatever the
number of rows in a tile (checked on the GPU by the engine's base-rows test).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 4


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, M, D, eps, stride_xm, stride_ym,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [ROWS]
    normed = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
             (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm of x [..., D] -> [..., D] in the dtype torch would give (x's, promoted with weight's)."""
    D = x.shape[-1]
    flat = x.reshape(-1, D)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(flat.shape, dtype=out_dtype, device=x.device)  # [M, D]
    M = flat.shape[0]
    rms_norm_kernel[(triton.cdiv(M, ROWS_PER_PROGRAM),)](
        flat, weight, y, M, D, eps, flat.stride(0), y.stride(0),
        ROWS=ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return y.view(x.shape)


# tokens per program of lora_head_norm, grid (cdiv(T, HEAD_NORM_TOKENS), heads); tl.dot needs 16 at least
HEAD_NORM_TOKENS = 32


@triton.jit
def lora_head_norm_kernel(y_ptr, s_ptr, b_ptr, w_ptr, out_ptr, row_slot_ptr, slot_mask_ptr, T, D, R, S, eps,
                          stride_ym, stride_sm, stride_sr, stride_bs, stride_bn, stride_br, stride_om,
                          HAS_SLOT_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """out[rows, head] = norm((y + shrunk @ B[slot]^T)[rows, head]) for BLOCK_T token rows and one head."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    offs_r = tl.arange(0, BLOCK_R)  # [BR]
    row_mask = rows < T
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    n = head * D + cols  # [BD] columns of y and rows of B
    y = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_ym + n[None, :], mask=mask, other=0.0)  # [BT, BD]
    slot = tl.load(row_slot_ptr + rows, mask=row_mask, other=-1)  # [BT]
    if HAS_SLOT_MASK:
        weighted = tl.load(slot_mask_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
        slot = tl.where(weighted != 0, slot, -1)
    lo = tl.min(tl.where(slot >= 0, slot, S), axis=0)
    hi = tl.max(slot, axis=0)
    delta = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for s in range(lo, hi + 1):  # a block's rows nearly always share one slot
        shrunk = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sm + offs_r[None, :] * stride_sr,
                         mask=(slot == s)[:, None] & (offs_r < R)[None, :], other=0.0)  # [BT, BR]
        b = tl.load(b_ptr + s * stride_bs + n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=(offs_r < R)[:, None] & col_mask[None, :], other=0.0)  # [BR, BD]
        delta += tl.dot(shrunk.to(b.dtype), b, input_precision="ieee")
    x = (y.to(tl.float32) + delta).to(y.dtype).to(tl.float32)  # the projection with its delta, as stored unfused
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [BT]
    normed = (x * inv[:, None]).to(y.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + n[None, :],
             (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def lora_head_norm(y: torch.Tensor, shrunk: torch.Tensor, B: torch.Tensor, weight: torch.Tensor, eps: float,
                   row_slot: torch.Tensor, slot_mask: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, heads * D] (last dim contiguous), shrunk [T, R] (any strides), B [S, heads * D, R], weight [D],
    row_slot [T] int32 (-1: none), slot_mask [S] or None -> [T, heads, D] (see the module notes)."""
    T, N = y.shape
    D = weight.shape[0]
    S, _, R = B.shape
    if y.stride(-1) != 1 or N % D or B.shape[1] != N or shrunk.shape != (T, R):
        raise ValueError(f"lora_head_norm: y {tuple(y.shape)}, shrunk {tuple(shrunk.shape)}, B {tuple(B.shape)}, "
                         f"head dim {D}")
    out = torch.empty(T, N // D, D, dtype=torch.promote_types(y.dtype, weight.dtype), device=y.device)
    if T == 0:
        return out
    lora_head_norm_kernel[(triton.cdiv(T, HEAD_NORM_TOKENS), N // D)](
        y, shrunk, B, weight, out, row_slot, slot_mask if slot_mask is not None else row_slot, T, D, R, S, eps,
        y.stride(0), shrunk.stride(0), shrunk.stride(1), B.stride(0), B.stride(1), B.stride(2), out.stride(0),
        HAS_SLOT_MASK=slot_mask is not None, BLOCK_T=HEAD_NORM_TOKENS, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_R=max(16, triton.next_power_of_2(R)), num_warps=4)
    return out
