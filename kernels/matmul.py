"""A linear layer whose every output row is computed the same way whatever the number of rows: y = x @ w^T (+ b).

Shapes: x [M, K] (last dim contiguous), w [N, K] (last dim contiguous), b [N] or None -> y [M, N] in x's dtype; the
sum over K in float32, in BLOCK_K steps taken in order, the bias added in float32 before the one rounding.

cuBLAS (F.linear) picks its kernel, tile and split of K by the problem's size, so one row's result moves in its
last bits with the rows around it. Here the tiles are fixed (kernels/tiles.py MATMUL_TILES) and K is never split:
the batch-invariant mode (`--batch-invariant`, issue #23) runs every dense projection through this op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import MATMUL_TILES


def matmul_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in float32, rounded to x's dtype once."""
    y = x.float() @ w.float().T  # [M, N]
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of y; programs in groups of GROUP_M row tiles sharing w's columns."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """y = x @ w^T (+ b) for x [..., K] (leading dims flattened), w [N, K]: [..., N] in x's dtype, batch-invariant
    (module notes). `tiles`: launch settings over MATMUL_TILES (a benchmark's sweep)."""
    t = {**MATMUL_TILES, **(tiles or {})}
    K = x.shape[-1]
    flat = x.reshape(-1, K)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M, N = flat.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)  # [M, N]
    if M:
        grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
        matmul_kernel[grid](
            flat, w, y if b is None else b, y, M, N, K, flat.stride(0), w.stride(0), y.stride(0), HAS_BIAS=b is not None,
            BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], GROUP_M=t["GROUP_M"],
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=t["num_warps"],
            num_stages=t["num_stages"])
    return y.view(*x.shape[:-1], N)
