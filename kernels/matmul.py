"""A linear layer whose every output row is computed the same way whatever the number of rows: y = x @ w^T (+ b).

Shapes: x [M, K] (last dim contiguous), w [N, K] (last dim contiguous), b [N] or None -> y [M, N] in x's dtype; the
sum over K in float32, in BLOCK_K steps taken in order, the bias added in float32 before the one rounding.

cuBLAS (F.linear) picks its kernel, tile and split of K by the problem's size, so one row's result moves in its
last bits with the rows around it. Here the tiles follow the weight alone (kernels/tiles.py MATMUL_TILES) and K is
never split: the batch-invariant mode (`--batch-invariant`, issue #23) runs every dense projection through this op.
x and w load through TMA descriptors where the shapes allow it, on a persistent grid (one program per SM); the
pointer loads and the one-program-a-tile grid give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .tiles import MATMUL_NARROW, MATMUL_TILES
from .tma import tma_ready


def matmul_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in float32, rounded to x's dtype once."""
    y = x.float() @ w.float().T  # [M, N]
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """BLOCK_M x BLOCK_N tiles of y, programs in groups of GROUP_M row tiles sharing w's columns; each program takes
    tiles pid, pid + programs, ... (a persistent grid of one program per SM; every tile is computed the same way
    whichever program takes it). TMA: x_ptr / w_ptr are tensor descriptors (blocks [BLOCK_M, BLOCK_K] /
    [BLOCK_N, BLOCK_K]; rows, columns and features past the edges read as zeros)."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        group = tile // (GROUP_M * num_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * num_n)) % size_m
        pid_n = (tile % (GROUP_M * num_n)) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        m_mask, n_mask = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BM, BN]
        for k0 in range(0, K, BLOCK_K):
            if TMA:
                a = x_ptr.load([pid_m * BLOCK_M, k0])  # [BM, BK]
                w = w_ptr.load([pid_n * BLOCK_N, k0]).T  # [BK, BN]
            else:
                k_mask = offs_k < K - k0
                a = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
                w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None],
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def _programs(device: torch.device, tiles: int, persistent: bool) -> int:
    """One program per tile, or (persistent) at most one per SM; the interpreter runs programs one after another."""
    if not persistent:
        return tiles
    return min(tiles, torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1)


def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """y = x @ w^T (+ b) for x [..., K] (leading dims flattened), w [N, K]: [..., N] in x's dtype, batch-invariant
    (module notes). `tiles`: launch settings over MATMUL_TILES (a benchmark's sweep)."""
    K, N = x.shape[-1], w.shape[0]
    narrow = N < 256 or x.dtype == torch.float32  # (by the weight alone: every batch gets the same tiles)
    t = {**MATMUL_TILES, **(MATMUL_NARROW if narrow else {}), **(tiles or {})}
    flat = x.reshape(-1, K)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M = flat.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)  # [M, N]
    if M:
        # TMA by the shapes alone, so that every batch takes the same path: a view of x off 16 bytes is copied
        tma = t["TMA"] and tma_ready(w) and K * flat.element_size() % 16 == 0
        flat = flat.clone() if tma and not tma_ready(flat) else flat
        x_arg = TensorDescriptor.from_tensor(flat, [t["BLOCK_M"], t["BLOCK_K"]]) if tma else flat
        w_arg = TensorDescriptor.from_tensor(w, [t["BLOCK_N"], t["BLOCK_K"]]) if tma else w
        grid = (_programs(x.device, triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]), t["PERSISTENT"]),)
        matmul_kernel[grid](
            x_arg, w_arg, y if b is None else b, y, M, N, K, flat.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=b is not None, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
            GROUP_M=t["GROUP_M"], DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", TMA=tma,
            num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y.view(*x.shape[:-1], N)
