"""Batch-invariant linear for the plain-torch path: y = x W^T (+ b), rows computed in fixed 64-row blocks.

A BLAS picks its kernel by the number of rows, so the same row can come out a few ulps different in a
batch of 5 than in a batch of 500. Padding the rows to whole blocks and multiplying block by block makes a
row's result depend only on the row: logprobs do not change with batching or with what else is in a batch.
Shapes: x [..., in], weight [out, in], bias [out] -> [..., out].
"""

from __future__ import annotations

import math

import torch

ROWS = 64
# Elementwise ops (pointwise_in_blocks): torch's vectorised CPU loop steps through a contiguous range two vectors at a
# time, 32 float32 or 64 bfloat16 values under AVX-512, so a range of a multiple of STEP values has no scalar tail; and
# at::parallel_for runs a range of at most its grain size (32768 values) on the calling thread, so a call of at most
# CHUNK values (half that: a margin for kernels that pass a smaller grain) is never split into per-thread ranges.
STEP = 64
CHUNK = 1 << 14


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [M, in]
    M = flat.shape[0]
    blocks = -(-M // ROWS)
    padded = torch.zeros(blocks * ROWS, flat.shape[1], dtype=x.dtype, device=x.device)  # [M', in]
    padded[:M] = flat
    # (torch.matmul folds the blocks into one [M', in] GEMM: with one thread MKL's rows do not depend on M'; with
    # more they do, as it splits the sums by thread for some M' and shapes, e.g. 2048 -> 768 at 2 threads below 512
    # rows: a CPU run of several threads is not batch-invariant in its GEMMs)
    y = torch.matmul(padded.view(blocks, ROWS, -1), weight.T).view(blocks * ROWS, -1)[:M]  # [M, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def pointwise_in_blocks(fn, *xs: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise op: sigmoid, silu, an expert activation of gate and up) of xs (tensors of one shape [M, ...],
    any layout), computed so that every value takes torch's vectorised CPU path, wherever its row sits in the batch.
    torch computes the last values of an elementwise op's range (its size mod the loop's step) on a scalar path a few
    ulps off the vectorised one (sigmoid and silu: 4% of N(0, 9) values differ; exp, cos, sin, rsqrt: none;
    tests/test_batch_invariant.py), and splits a range of more than its grain size (32768 values) over threads, each
    part with a tail of its own at a place that follows the tensor's size (3 threads, silu of 180,224 values: values
    60070, 120143 and 120144 differ). So the rows go zero-padded to whole loop steps (STEP values) in calls of at
    most CHUNK values: no tail, one thread."""
    x = xs[0]
    if x.dim() == 0 or x.numel() == 0:
        return fn(*xs)
    M, n = x.shape[0], x.numel()
    width = n // M  # values per row
    quantum = STEP // math.gcd(width, STEP)  # rows whose values are a whole number of steps
    if quantum * width > CHUNK:  # rows too wide for a call (a dense MLP's I = 18432): the values as rows of a step
        size = -(-n // STEP) * STEP
        flats = [torch.cat([t.reshape(-1), t.new_zeros(size - n)]).view(-1, STEP) for t in xs]  # [n' / STEP, STEP]
        return pointwise_in_blocks(fn, *flats).view(-1)[:n].view(x.shape)
    block = CHUNK // width // quantum * quantum  # rows per call
    if M % quantum == 0 and M <= block and all(t.is_contiguous() for t in xs):
        return fn(*xs)  # one call of whole steps already
    padded = -(-M // quantum) * quantum
    bufs = []
    for t in xs:
        buf = t.new_zeros(padded, *t.shape[1:])  # [M', ...], zeros past M
        buf[:M] = t
        bufs.append(buf)
    if padded <= block:
        return fn(*bufs)[:M]
    return torch.cat([fn(*parts) for parts in zip(*(buf.split(block) for buf in bufs))])[:M]
