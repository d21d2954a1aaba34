"""The suite's `tl.dot` for Triton's interpreter (tests/interpreter_dot.py, installed by tests/conftest.py): each
element summed over K in one fixed order, so that a row's bits never depend on the rows around it, on any CPU.

The interpreter's stock dot is numpy's BLAS, whose order follows the CPU and the rows' places in the tile (issue 41:
the suite's batch-invariance claims failed on AVX2 machines only). The hostile-BLAS test below catches a regression
on any machine: it swaps np.matmul for one whose order over K follows the row count and the row's index (as a BLAS
may), shows that the interpreter's stock dot then gives a row other bits among other rows, and that the installed
dot does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_eval.kernels.matmul import matmul, matmul_ref
from tests import interpreter_dot

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels run compiled, not here")


def hostile_matmul(a, b, dtype=None, **kwargs):
    """np.matmul's result up to rounding, as unfriendly as a BLAS may be: row m's products added one by one in the
    output dtype, starting at k = (5 m + M) mod K, so a row's order changes with its place and the number of rows."""
    assert not kwargs, kwargs
    dtype = np.dtype(dtype) if dtype is not None else np.result_type(a, b)
    a, b = np.asarray(a, dtype), np.asarray(b, dtype)
    M, K = a.shape[-2:]
    products = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N]
    rows = np.arange(M)
    start = (5 * rows + M) % max(K, 1)
    out = np.zeros(products.shape[:-3] + (M, b.shape[-1]), dtype)
    for step in range(K):
        out += products[..., rows, (start + step) % K, :]
    return out


def tree_sum(values: list) -> np.float32:
    """The documented order, one scalar at a time: element i += element i + ceil(n / 2), halving until one is left."""
    values = list(values)
    while len(values) > 1:
        half, r = len(values) // 2, len(values) - len(values) // 2
        values = [np.float32(values[i] + values[i + r]) for i in range(half)] + values[half:r]
    return values[0]


def test_the_interpreter_runs_the_installed_dot():
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpreterBuilder.create_dot, "fixed_order", False)
    assert interpreter.interpreter_builder.create_dot.__func__ is interpreter.InterpreterBuilder.create_dot
    assert interpreter_dot.STOCK_CREATE_DOT is not None and not hasattr(interpreter_dot.STOCK_CREATE_DOT,
                                                                         "fixed_order")


@pytest.mark.parametrize("in_dtype", [np.float32, np.float16])
def test_each_element_is_its_own_row_and_column_in_the_fixed_order(seed, in_dtype):
    """Elements checked against the order written out scalar by scalar; rows shuffled, alone, among rows of zeros
    and in a batch of tiles: the same bits; the sum within float32 rounding of float64's."""
    rng = np.random.default_rng(seed)
    M, K, N = int(rng.integers(5, 40)), int(rng.integers(1, 80)), int(rng.integers(1, 40))
    a = rng.standard_normal((M, K)).astype(in_dtype)
    b = (rng.standard_normal((K, N)) / K ** 0.5).astype(in_dtype)
    acc = rng.standard_normal((M, N)).astype(np.float32)
    out = interpreter_dot.fixed_order_dot(a, b, acc)
    assert out.dtype == np.float32 and out.shape == (M, N)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    for m, n in zip(rng.integers(0, M, 8), rng.integers(0, N, 8)):
        assert out[m, n] == np.float32(tree_sum([np.float32(a32[m, k] * b32[k, n]) for k in range(K)]) + acc[m, n])
    order = rng.permutation(M)
    assert np.array_equal(interpreter_dot.fixed_order_dot(a[order], b, acc[order]), out[order])
    m = int(rng.integers(M))
    assert np.array_equal(interpreter_dot.fixed_order_dot(a[m:m + 1], b, acc[m:m + 1]), out[m:m + 1])
    padded = np.zeros((M + 7, K), in_dtype)
    padded[3:3 + M] = a
    assert np.array_equal(interpreter_dot.fixed_order_dot(padded, b, np.zeros((M + 7, N), np.float32))[3:3 + M],
                          interpreter_dot.fixed_order_dot(a, b, np.zeros((M, N), np.float32)))
    batched = interpreter_dot.fixed_order_dot(np.stack([a[order], a]), np.stack([b, b]), np.stack([acc[order], acc]))
    assert np.array_equal(batched[1], out) and np.array_equal(batched[0], out[order])
    exact = a.astype(np.float64) @ b.astype(np.float64) + acc
    assert np.abs(out - exact).max() < 1e-5 * max(1.0, np.abs(exact).max())


def test_rows_keep_their_bits_under_a_hostile_blas(seed, monkeypatch):
    """kernels/matmul.py (small tiles: several row tiles and K steps, a ragged last one) with np.matmul made hostile:
    a row shuffled, alone, and after more rows keeps its bits through the installed dot; the interpreter's stock dot,
    given the same BLAS, moves them (so a suite that fell back to np.matmul would fail here, on any machine)."""
    monkeypatch.setattr(np, "matmul", hostile_matmul)
    g = torch.Generator().manual_seed(seed)
    tiles = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, TMA=False, PERSISTENT=False)
    M, K, N = 16 + 5, 2 * 32 + 7, 24
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g)
    order = torch.randperm(M, generator=g)
    more = torch.cat([torch.randn(2 * 16 + 5, K, generator=g), x])  # x's rows 5 places further into their tiles

    def same_bits() -> list[bool]:
        y = matmul(x, w, b, tiles=tiles)
        assert (y - matmul_ref(x, w, b)).abs().max().item() < 1e-5
        return [torch.equal(matmul(x[order], w, b, tiles=tiles), y[order]),
                torch.equal(matmul(x[3:4], w, b, tiles=tiles), y[3:4]),
                torch.equal(matmul(more, w, b, tiles=tiles)[-M:], y)]

    assert same_bits() == [True, True, True]
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", interpreter_dot.STOCK_CREATE_DOT)
    assert same_bits() == [False, False, False]  # the stock dot under this BLAS: every comparison sees other bits
