"""A `tl.dot` for Triton's interpreter whose every output element is summed over K in one fixed order, whatever
rows and columns surround it: installed by tests/conftest.py wherever the kernels run in the interpreter.

Why: the interpreter's own dot (triton/runtime/interpreter.py, `InterpreterBuilder.create_dot`) is
`np.matmul(a, b) + acc`, i.e. numpy's BLAS (OpenBLAS in numpy's wheel), which picks its kernels by CPU and splits
rows into micro-tiles that do not all sum in the same order. With OpenBLAS's Haswell kernels (chosen on AVX2 CPUs
such as AMD Zen; OPENBLAS_CORETYPE=Haswell forces them on any x86 machine) a row's bits depend on its position
within the [BLOCK_M, BLOCK_K] tile (rows 0-5 and 6-11 of each 12 differ, the tail rows and a single row differ
again) and on the thread count; on AVX-512 machines (SkylakeX kernels) they did not. So the suite's claims that a
row's result does not depend on the rows around it (tests/kernels/test_matmul.py, the batch-invariant mode, rows
without adapter equal to the base model) held in the interpreter on some CPUs only (issue 41).

Here each output element is acc + (a fixed binary tree over K of the products a[m, k] * b[k, n]), computed with
numpy's element-wise multiply and add only: each is one correctly rounded IEEE operation per element, the same on
every CPU and for every array shape, so an element's bits are a function of its own row of `a`, its own column of
`b`, its accumulator and K: bit for bit the same on any machine, whatever the other rows. The tree (element i added
to element i + ceil(K / 2), halving until one is left) is also what keeps the rounding error near BLAS's (log K
additions deep, not K). Integer dots keep numpy's matmul: integer sums are exact in any order.

Cost: the products are materialised ([..., M, K, N] of the accumulator's dtype), a few MB at the kernels' tiles;
the kernel tests spend their time in the interpreter's per-op overhead, not here (tests/kernels: +3% user time).
"""

from __future__ import annotations

import numpy as np

STOCK_CREATE_DOT = None  # the interpreter's own create_dot, kept by install() (tests/kernels/test_interpreter_dot.py)


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b for a [..., M, K], b [..., K, N], acc [..., M, N] (floating), in acc's dtype: the products rounded
    once each, then summed over K in the fixed tree of the module notes, then added to acc."""
    dtype = acc.dtype
    products = np.multiply(a.astype(dtype, copy=False)[..., :, :, None], b.astype(dtype, copy=False)[..., None, :, :])
    k = products.shape[-2]  # [..., M, K, N]
    while k > 1:  # fold the upper half onto the lower: element i += element i + r (the middle one waits when K is odd)
        half, r = k // 2, k - k // 2
        np.add(products[..., :half, :], products[..., r:k, :], out=products[..., :half, :])
        k = r
    total = products[..., 0, :] if products.shape[-2] else np.zeros(acc.shape, dtype)
    return total + acc


def install() -> None:
    """Replace the interpreter's create_dot (for every builder, the one it uses now included) with one that sums
    floating dots in fixed order. Idempotent; fails loudly if Triton's interpreter no longer has the hook, rather
    than letting the suite fall back silently to the machine's BLAS."""
    global STOCK_CREATE_DOT
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "fixed_order", False):
        return
    stock = builder.create_dot  # create_dot(self, a, b, d, input_precision, max_num_imprecise_acc), Triton 3.6

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not np.issubdtype(d.data.dtype, np.floating):
            return stock(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # fp8 operands: as the stock dot does
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        return interpreter.TensorHandle(fixed_order_dot(a_data, b_data, d.data), d.dtype.scalar)

    create_dot.fixed_order = True
    STOCK_CREATE_DOT = stock
    builder.create_dot = create_dot
