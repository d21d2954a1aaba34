"""Per-head RMSNorm and rotary embedding of a projection in one pass (Qwen3's q_norm / k_norm then RoPE).

Shapes: y [T, heads * D] (the projection's output, its LoRA delta already added; last dim contiguous; T = B * L
tokens in row-major [B, L] order), weight [D], cos / sin [B, L, D] (any strides, last dim contiguous)
-> out [B, heads, L, D] in rope.attention_layout:
  n   = (weight * (y / sqrt(mean(y^2) + eps)).to(y.dtype)).to(y.dtype)   (rms_norm's numbers, per head)
  out = n * cos + rotate_half(n) * sin, rotate_half(n) = [-n2, n1]  (rope's numbers: float32, one rounding)
Replaces the norm's pass and the rope's pass over the projection with one read and one write.

Why the projection's LoRA expand is not folded in here: with the expand inside, the sum of squares is taken over a
tile that was a dot's accumulator, in that dot's register layout, and Triton reduces a tile in the order its layout
gives, so a base row's values would depend on whether the batch holds an adapter row (issue 41; BENCHMARKS-history 16
and 18.2). The expand runs before this kernel instead (dense_lora.dense_lora_expand, in place): every row then goes
through the one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import rms_norm_ref
from .rope import attention_layout, rope_ref
from .tiles import TOKENS_PER_PROGRAM


def head_norm_rope_ref(y, weight, eps, cos, sin) -> torch.Tensor:
    """Plain torch: the norm per head, then rope."""
    B_, L, D = cos.shape
    T = y.shape[0]
    normed = rms_norm_ref(y.view(T, -1, D), weight, eps)  # [T, heads, D]
    return rope_ref(normed.view(B_, L, -1, D), cos, sin)  # [B, heads, L, D]


@triton.jit(do_not_specialize=["T", "L"])
def head_norm_rope_kernel(y_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, T, L, HEADS, eps, stride_ym, stride_cb,
                          stride_cl, stride_sb, stride_sl, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_HALF: tl.constexpr):
    """BLOCK_T tokens of one head (program_id(1)); the two halves of a head's D columns held side by side."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] token rows t = b * L + l
    d = tl.arange(0, BLOCK_HALF)  # [BH]
    row_mask = rows < T
    d_mask = d < HALF
    mask = row_mask[:, None] & d_mask[None, :]
    col1 = head * 2 * HALF + d  # [BH] first-half columns of y
    y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_ym
    y1 = tl.load(y_rows + col1[None, :], mask=mask, other=0.0)  # [BT, BH]
    y2 = tl.load(y_rows + HALF + col1[None, :], mask=mask, other=0.0)
    x1 = y1.to(tl.float32)
    x2 = y2.to(tl.float32)
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


def head_norm_rope(y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                   tokens_per_program: int = TOKENS_PER_PROGRAM) -> torch.Tensor:
    """The Triton counterpart of head_norm_rope_ref: y [T, heads * D] -> [B, heads, L, D]. `tokens_per_program`: the
    grid's tokens per program (TOKENS_PER_PROGRAM)."""
    T, N = y.shape
    B_, L, D = cos.shape
    if (y.stride(-1) != 1 or N % D or D % 2 or weight.shape != (D,) or T != B_ * L or cos.stride(-1) != 1
            or sin.stride(-1) != 1):
        raise ValueError(f"head_norm_rope: y {tuple(y.shape)}, weight {tuple(weight.shape)}, cos {tuple(cos.shape)}")
    heads = N // D
    out = attention_layout(B_, heads, L, D, torch.promote_types(y.dtype, weight.dtype), y.device)
    if T == 0:
        return out
    head_norm_rope_kernel[(triton.cdiv(T, tokens_per_program), heads)](
        y, weight, cos, sin, out, T, L, heads, eps, y.stride(0), cos.stride(0), cos.stride(1), sin.stride(0),
        sin.stride(1), HALF=D // 2, BLOCK_T=tokens_per_program, BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=4)
    return out
