"""The RMSNorm, rotary-embedding and fused per-head norm + rotary Triton kernels against their plain-torch
references (interpreter on the CPU: float32 and float16; odd shapes so that masked tails are exercised; outputs
poisoned first where the kernel writes into a given buffer)."""

from __future__ import annotations

import pytest
import torch

from lora_eval.kernels.head_norm_rope import head_norm_rope, head_norm_rope_ref
from lora_eval.kernels.rms_norm import rms_norm, rms_norm_ref
from lora_eval.kernels.rope import rope, rope_ref
from lora_eval.kernels.tiles import POSITIONS_PER_PROGRAM, RMS_NORM_ROWS_PER_PROGRAM, TOKENS_PER_PROGRAM
from lora_eval.models.layers import rope_cos_sin
from tests.kernels.partials import shrink_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1e-6), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm_matches_reference(seed, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    M, D = 3 * 4 + 1, 48  # at 4 rows a program a ragged last program; D not a power of two
    x = (3 * torch.randn(M, D, generator=g) + 0.5).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    ref = rms_norm_ref(x, w, 1e-6)
    for per_program in sorted({RMS_NORM_ROWS_PER_PROGRAM, 4}):
        out = rms_norm(x, w, 1e-6, rows_per_program=per_program)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol), per_program
    heads = rms_norm(x.view(M, 3, 16), w[:16], 1e-6)  # per-head norm over the last dim of a 3D view
    assert torch.allclose(heads.float(), rms_norm_ref(x.view(M, 3, 16), w[:16], 1e-6).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_lora,splits", [(False, 1), (True, 1), (True, 3)], ids=["plain", "lora", "lora-split"])
def test_head_norm_rope_matches_norm_then_rope(seed, dtype, tol, with_lora, splits):
    """Per-head RMSNorm + RoPE in one pass (with the LoRA expand in front) against the expand, rms_norm_ref and
    rope_ref: 2 rows of a length that is not a multiple of the tokens per program, heads not a power of two, a
    half head dim that is not one either; LoRA rows of 3 slots (one masked off) and of none, a program holding two
    slots, the shrink a column view of one [T, R] or of partial sums; rows without a delta equal the plain fused
    kernel bit for bit."""
    g = torch.Generator().manual_seed(seed)
    Bn, L, heads, D, S, R = 2, TOKENS_PER_PROGRAM + 7, 3, 24, 3, 5
    T = Bn * L
    y = (2 * torch.randn(T, heads * D, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.arange(L, device=DEVICE).expand(Bn, L)
    cos, sin = rope_cos_sin(inv_freq.to(DEVICE), positions, dtype)
    plain = head_norm_rope(y, w, 1e-6, cos, sin)
    assert plain.shape == (Bn, heads, L, D) and plain.transpose(1, 2).is_contiguous()  # attention_layout
    if not with_lora:
        ref = head_norm_rope_ref(y, w, 1e-6, cos, sin)
        assert torch.allclose(plain.float(), ref.float(), rtol=tol, atol=tol)
        return
    given, shrunk = shrink_partials(splits, T, R + 2, g)
    given, shrunk = given.to(DEVICE)[..., 1:R + 1], shrunk.to(DEVICE)[:, 1:R + 1]  # column views, as q/k/v's
    B = (0.5 * torch.randn(S, heads * D, R, generator=g)).to(DEVICE, dtype)
    slots = torch.randint(-1, S, (T,), generator=g)
    slots[TOKENS_PER_PROGRAM - 3:TOKENS_PER_PROGRAM + 3] = torch.tensor([0, 0, 0, 1, 1, 1])  # across a program edge
    slot_mask = torch.tensor([True, False, True], device=DEVICE)  # slot 1 has no weights here
    out = head_norm_rope(y, w, 1e-6, cos, sin, lora=(given, B, slots.to(DEVICE, torch.int32), slot_mask))
    groups = [(s, (slots == s).nonzero().squeeze(1).to(DEVICE)) for s in (0, 2)]
    ref = head_norm_rope_ref(y, w, 1e-6, cos, sin, lora=(shrunk, B, groups))
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)
    untouched = ((slots == -1) | (slots == 1)).view(Bn, 1, L, 1).expand_as(out).to(DEVICE)
    # no delta: the plain kernel's numbers, bit for bit (their LoRA rows are masked to zeros, whose products sum to
    # an exact zero in any order: true on any CPU)
    assert torch.equal(out[untouched], plain[untouched])
    assert (out[~untouched].float() - plain[~untouched].float()).abs().max() > 0.05  # the deltas matter


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_matches_reference(seed, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    B, L, heads, D = 2, 2 * 4 + 3, 3, 16  # at 4 positions a program ragged; heads not a power of two
    proj = torch.randn(B * L, heads * D, generator=g).to(DEVICE, dtype)  # a projection's output
    x = proj.view(B, L, heads, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.arange(L, device=DEVICE).expand(B, L)
    cos, sin = rope_cos_sin(inv_freq.to(DEVICE), positions, dtype)
    ref = rope_ref(x.float(), cos.float(), sin.float())
    for per_program in sorted({POSITIONS_PER_PROGRAM, 4}):
        out = rope(x, cos, sin, positions_per_program=per_program)
        assert out.shape == (B, heads, L, D) and out.transpose(1, 2).is_contiguous()  # attention_layout
        assert torch.allclose(out.float(), ref, rtol=tol, atol=tol), per_program
    assert not torch.allclose(out.float(), x.float().transpose(1, 2), atol=1e-2)  # the rotation did something


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_norm_rope_rows_without_lora_equal_the_plain_kernel(seed):
    """Issue #23's class of defect at Qwen3-30B-A3B's k shape (bf16, 4 heads of 128): the LoRA variant expands inside
    the kernel, and the norm's sums then run after a dot; rows without an adapter must still come out as the plain
    kernel gives them, bit for bit (the router's top-k with its expand inside did not: BENCHMARKS-history.md 7).
    The tiny models of the mixed-batch check have heads too small to show a layout's summation order."""
    g = torch.Generator().manual_seed(seed)
    batch, L, heads, D, R, S = 4, 256, 4, 128, 16, 2
    y = torch.randn(batch * L, heads * D, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE, torch.bfloat16)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEVICE) / D))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(L, device=DEVICE).expand(batch, L), torch.bfloat16)
    shrunk = torch.randn(batch * L, R, generator=g).to(DEVICE, torch.bfloat16)
    B = (0.1 * torch.randn(S, heads * D, R, generator=g)).to(DEVICE, torch.bfloat16)
    slots = torch.randint(-1, S, (batch * L,), generator=g)
    slots[: L] = -1  # a whole row without an adapter, and rows of none scattered among adapter rows
    plain = head_norm_rope(y, w, 1e-6, cos, sin)  # [batch, heads, L, D]
    fused = head_norm_rope(y, w, 1e-6, cos, sin, lora=(shrunk, B, slots.to(DEVICE, torch.int32), None))
    none = (slots == -1).to(DEVICE).view(batch, 1, L, 1).expand_as(plain)
    assert not torch.equal(fused, plain)  # the adapters' rows do change
    differ = (fused != plain) & none
    assert not differ.any(), f"{int(differ.sum())} values of rows without an adapter differ from the plain kernel"
