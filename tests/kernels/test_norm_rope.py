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
def test_head_norm_rope_matches_norm_then_rope(seed, dtype, tol):
    """Per-head RMSNorm + RoPE in one pass against rms_norm_ref and rope_ref: 2 rows of a length that is not a
    multiple of the tokens per program, heads not a power of two, a half head dim that is not one either."""
    g = torch.Generator().manual_seed(seed)
    Bn, L, heads, D = 2, TOKENS_PER_PROGRAM + 7, 3, 24
    T = Bn * L
    y = (2 * torch.randn(T, heads * D, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.arange(L, device=DEVICE).expand(Bn, L)
    cos, sin = rope_cos_sin(inv_freq.to(DEVICE), positions, dtype)
    out = head_norm_rope(y, w, 1e-6, cos, sin)
    assert out.shape == (Bn, heads, L, D) and out.transpose(1, 2).is_contiguous()  # attention_layout
    ref = head_norm_rope_ref(y, w, 1e-6, cos, sin)
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), y.view(Bn, L, heads, D).transpose(1, 2).float(), atol=1e-2)


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
