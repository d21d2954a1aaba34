"""Per-head RMSNorm and rotary embedding of a projection in one pass (Qwen3's q_norm / k_norm then RoPE), with
the projection's LoRA expand folded in front when it has one.

Shapes: y [T, heads * D] (the projection's output without its LoRA delta, last dim contiguous; T = B * L tokens
in row-major [B, L] order), weight [D], cos / sin [B, L, D] (any strides, last dim contiguous);
LoRA (optional): shrunk [T, R] or its partial sums [splits, T, R] (any strides), B [S, heads * D, R], row_slot [T]
int32 (-1: none), slot_mask [S] (slots without weights at this site add nothing)
-> out [B, heads, L, D] in rope.attention_layout:
  x   = (y + shrunk @ B[slot]^T).to(y.dtype)                        (LoRA rows; the others x = y)
  n   = (weight * (x / sqrt(mean(x^2) + eps)).to(y.dtype)).to(y.dtype)   (rms_norm's numbers, per head)
  out = n * cos + rotate_half(n) * sin, rotate_half(n) = [-n2, n1]  (rope's numbers: float32, one rounding)
Replaces the expand's read-add-write, the norm's pass and the rope's pass over the projection with one read and
one write. A row's numbers do not depend on whether the batch has adapters: the sum of squares is taken the same
way in every variant, so rows without an adapter equal the base model's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_meta import load_shrunk, partials, row_slots
from .rms_norm import rms_norm_ref
from .rope import attention_layout, rope_ref
from .tiles import TOKENS_PER_PROGRAM


def head_norm_rope_ref(y, weight, eps, cos, sin, lora=None) -> torch.Tensor:
    """Plain torch: the expand (lora = (shrunk, B, groups) with groups [(slot, rows)]), the norm per head, rope."""
    B_, L, D = cos.shape
    T = y.shape[0]
    if lora is not None:
        shrunk, B, groups = lora
        y = y.clone()
        for slot, rows in groups:
            delta = shrunk[rows].to(B.dtype).float() @ B[slot].float().T  # [n, heads * D]
            y[rows] = (y[rows].float() + delta).to(y.dtype)
    normed = rms_norm_ref(y.view(T, -1, D), weight, eps)  # [T, heads, D]
    return rope_ref(normed.view(B_, L, -1, D), cos, sin)  # [B, heads, L, D]


@triton.jit(do_not_specialize=["T", "L"])
def head_norm_rope_kernel(y_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, s_ptr, b_ptr, row_slot_ptr, slot_mask_ptr,
                          T, L, HEADS, R, S, eps, stride_ym, stride_cb, stride_cl, stride_sb, stride_sl,
                          stride_sk, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
                          HALF: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SLOT_MASK: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """BLOCK_T tokens of one head (program_id(1)); the two halves of a head's D columns held side by side."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token rows t = b * L + l
    d = tl.arange(0, BLOCK_HALF)  # [BH]
    row_mask = rows < T
    d_mask = d < HALF
    mask = row_mask[:, None] & d_mask[None, :]
    col1 = head * 2 * HALF + d  # [BH] first-half columns of y and rows of B
    y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_ym
    y1 = tl.load(y_rows + col1[None, :], mask=mask, other=0.0)  # [BT, BH]
    y2 = tl.load(y_rows + HALF + col1[None, :], mask=mask, other=0.0)
    x1 = y1.to(tl.float32)
    x2 = y2.to(tl.float32)
    if HAS_LORA:
        slot, lo, hi = row_slots(row_slot_ptr, slot_mask_ptr, rows, row_mask, S, HAS_SLOT_MASK)  # [BT], lo, hi
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        shrunk = load_shrunk(s_ptr, rows, offs_r, (slot >= 0)[:, None] & r_mask[None, :], stride_sk, stride_sm,
                             stride_sr, SPLITS)  # [BT, BR]: each row's own slot's
        for s in range(lo, hi + 1):  # a block's rows nearly always share one slot
            part = tl.where((slot == s)[:, None], shrunk, 0.0)
            b_tile = b_ptr + s * stride_bs + col1[None, :] * stride_bn + offs_r[:, None] * stride_br  # [BR, BH]
            b_mask = r_mask[:, None] & d_mask[None, :]
            b1 = tl.load(b_tile, mask=b_mask, other=0.0)
            b2 = tl.load(b_tile + HALF * stride_bn, mask=b_mask, other=0.0)
            # the projection is the dot's accumulator: no layout conversion of a separate delta (rows of other
            # slots add exact zeros)
            x1 = tl.dot(part.to(b1.dtype), b1, x1, input_precision="ieee")
            x2 = tl.dot(part.to(b2.dtype), b2, x2, input_precision="ieee")
        x1 = x1.to(y1.dtype).to(tl.float32)  # the projection with its delta, rounded as an unfused expand stores it
        x2 = x2.to(y1.dtype).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # [BT]
    w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    n1 = ((x1 * inv[:, None]).to(y1.dtype).to(tl.float32) * w1[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    n2 = ((x2 * inv[:, None]).to(y1.dtype).to(tl.float32) * w2[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    b = rows // L  # [BT]
    pos = rows % L
    c = cos_ptr + b[:, None].to(tl.int64) * stride_cb + pos[:, None].to(tl.int64) * stride_cl + d[None, :]
    s_ = sin_ptr + b[:, None].to(tl.int64) * stride_sb + pos[:, None].to(tl.int64) * stride_sl + d[None, :]
    cos1 = tl.load(c, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(c + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(s_, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(s_ + HALF, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (((b.to(tl.int64) * L + pos) * HEADS + head)[:, None]) * (2 * HALF) + d[None, :]  # [B, L, h, D]
    tl.store(out, (n1 * cos1 - n2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (n2 * cos2 + n1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)


def head_norm_rope(y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   lora=None, *, tokens_per_program: int = TOKENS_PER_PROGRAM) -> torch.Tensor:
    """The Triton counterpart of head_norm_rope_ref: y [T, heads * D] -> [B, heads, L, D]. `lora` = (shrunk [T, R]
    or its partial sums [splits, T, R] (dense_lora_shrink), B [S, heads * D, R], row_slot [T] int32, slot_mask [S]
    or None) or None. `tokens_per_program`: the grid's tokens per program (TOKENS_PER_PROGRAM; 16 at least)."""
    T, N = y.shape
    B_, L, D = cos.shape
    if (y.stride(-1) != 1 or N % D or D % 2 or weight.shape != (D,) or T != B_ * L or cos.stride(-1) != 1
            or sin.stride(-1) != 1):
        raise ValueError(f"head_norm_rope: y {tuple(y.shape)}, weight {tuple(weight.shape)}, cos {tuple(cos.shape)}")
    heads = N // D
    out = attention_layout(B_, heads, L, D, torch.promote_types(y.dtype, weight.dtype), y.device)
    if T == 0:
        return out
    if lora is not None:
        shrunk, B, row_slot, slot_mask = lora
        R = B.shape[2]
        if B.shape[1] != N:
            raise ValueError(f"head_norm_rope: B {tuple(B.shape)} for y {tuple(y.shape)}")
        parts = partials(shrunk, T, R, "head_norm_rope")
        lora_args = (parts, B, row_slot, slot_mask if slot_mask is not None else row_slot, R, B.shape[0])
        lora_strides = (*parts.stride(), B.stride(0), B.stride(1), B.stride(2))
        splits = parts.shape[0]
    else:
        lora_args, lora_strides, R, splits = (y, y, y, y, 0, 0), (0,) * 6, 0, 1
    s_ptr, b_ptr, row_slot_ptr, mask_ptr, R, S = lora_args
    head_norm_rope_kernel[(triton.cdiv(T, tokens_per_program), heads)](
        y, weight, cos, sin, out, s_ptr, b_ptr, row_slot_ptr, mask_ptr, T, L, heads, R, S, eps, y.stride(0),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), *lora_strides,
        HALF=D // 2, HAS_LORA=lora is not None, HAS_SLOT_MASK=lora is not None and lora[3] is not None, SPLITS=splits,
        BLOCK_T=tokens_per_program, BLOCK_HALF=triton.next_power_of_2(D // 2),
        BLOCK_R=max(16, triton.next_power_of_2(R)), num_warps=4)
    return out
