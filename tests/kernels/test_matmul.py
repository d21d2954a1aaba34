"""The batch-invariant linear (kernels/matmul.py) against plain torch, and a row's result against the same row
computed among other rows, alone, shuffled and at another row count: bit for bit (interpreter on the CPU, float32 and
float16; the GPU in bf16 at Qwen3-30B-A3B's widths)."""

from __future__ import annotations

import pytest
import torch

from lora_eval.kernels.matmul import matmul, matmul_ref
from lora_eval.kernels.tiles import MATMUL_TILES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


POINTERS = dict(TMA=False, PERSISTENT=False)  # the kernel's other paths, which must give the same bits
TMA_ONE_A_TILE = dict(TMA=True, PERSISTENT=False)


def _check(M, K, N, dtype, tol, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype)
    y = matmul(x, w, b)
    assert y.shape == (M, N) and y.dtype == dtype
    assert (y.float() - matmul_ref(x, w, b).float()).abs().max().item() < tol
    assert (matmul(x, w).float() - matmul_ref(x, w).float()).abs().max().item() < tol
    # Bit for bit on the CPU too: the interpreter's dot sums every element in one fixed order whatever the rows
    # around it (tests/interpreter_dot.py), so this holds on any CPU; with numpy's BLAS it held on AVX-512
    # machines only (issue 41). On a GPU it is the product's claim (tiles by the weight alone, K never split).
    order = torch.randperm(M, generator=g).to(device)
    assert torch.equal(matmul(x[order], w, b), y[order])  # shuffled
    assert torch.equal(matmul(x[3:4], w, b), y[3:4])  # one row alone (a view 3 rows in: off TMA's alignment)
    more = torch.cat([x, torch.randn(2 * MATMUL_TILES["BLOCK_M"] + 5, K, generator=g).to(device, dtype)])
    assert torch.equal(matmul(more, w, b)[:M], y)  # among more rows, in other tiles of the grid
    for tiles in (POINTERS, TMA_ONE_A_TILE):
        assert torch.equal(matmul(x, w, b, tiles=tiles), y), tiles


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("K", [2 * MATMUL_TILES["BLOCK_K"] + 7, 2 * MATMUL_TILES["BLOCK_K"] + 8],
                         ids=["pointer-loads", "tma"])
@pytest.mark.parametrize("N", [45, 300], ids=["narrow", "wide"])
def test_matches_reference_and_is_batch_invariant(seed, dtype, tol, K, N):
    """Odd sizes: M and N no multiple of their tile, K neither (the tail of the last step masked, or read as zeros
    through TMA). K + 7: rows off 16 bytes, pointer loads; K + 8: TMA where the tiles ask for it. N 45: the narrow
    tiles; 300: the wide ones in float16."""
    _check(MATMUL_TILES["BLOCK_M"] + 9, K, N, dtype, tol, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,N", [(2048, 4096), (4096, 2048), (2048, 512)], ids=["q", "o", "kv"])
def test_gpu_bf16_layer_shapes(seed, K, N):
    _check(1000, K, N, torch.bfloat16, 6e-2, seed)
