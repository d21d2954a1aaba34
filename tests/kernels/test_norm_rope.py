"""The RMSNorm and rotary-embedding Triton kernels against their plain-torch references (interpreter on the CPU:
float32 and float16; odd shapes so that masked tails are exercised; outputs poisoned first where the kernel
writes into a given buffer)."""

from __future__ import annotations

import pytest
import torch

from lora_eval.kernels.rms_norm import ROWS_PER_PROGRAM, rms_norm, rms_norm_ref
from lora_eval.kernels.rope import POSITIONS_PER_PROGRAM, rope, rope_ref
from lora_eval.models.layers import rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1e-6), (torch.float16, 2e-3)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm_matches_reference(seed, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    M, D = 3 * ROWS_PER_PROGRAM + 1, 48  # a ragged last program, D not a power of two
    x = (3 * torch.randn(M, D, generator=g) + 0.5).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(DEVICE, dtype)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)
    heads = rms_norm(x.view(M, 3, 16), w[:16], 1e-6)  # per-head norm over the last dim of a 3D view
    assert torch.allclose(heads.float(), rms_norm_ref(x.view(M, 3, 16), w[:16], 1e-6).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_matches_reference(seed, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    B, L, heads, D = 2, 2 * POSITIONS_PER_PROGRAM + 3, 3, 16  # ragged positions, heads not a power of two
    proj = torch.randn(B * L, heads * D, generator=g).to(DEVICE, dtype)  # a projection's output
    x = proj.view(B, L, heads, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    positions = torch.arange(L, device=DEVICE).expand(B, L)
    cos, sin = rope_cos_sin(inv_freq.to(DEVICE), positions, dtype)
    out = rope(x, cos, sin)
    ref = rope_ref(x.float(), cos.float(), sin.float())
    assert out.shape == (B, heads, L, D) and out.is_contiguous()
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), x.float().transpose(1, 2), atol=1e-2)  # the rotation did something
