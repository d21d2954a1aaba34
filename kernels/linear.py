"""Batch-invariant linear for the plain-torch path: y = x W^T (+ b), rows computed in fixed 64-row blocks.

A BLAS picks its kernel by the number of rows, so the same row can come out a few ulps different in a
batch of 5 than in a batch of 500. Padding the rows to whole blocks and multiplying block by block makes a
row's result depend only on the row: logprobs do not change with batching or with what else is in a batch.
Shapes: x [..., in], weight [out, in], bias [out] -> [..., out].
"""

from __future__ import annotations

import torch

ROWS = 64


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])  # [M, in]
    M = flat.shape[0]
    blocks = -(-M // ROWS)
    padded = torch.zeros(blocks * ROWS, flat.shape[1], dtype=x.dtype, device=x.device)  # [M', in]
    padded[:M] = flat
    y = torch.matmul(padded.view(blocks, ROWS, -1), weight.T).view(blocks * ROWS, -1)[:M]  # [M, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def pointwise_in_blocks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise op: sigmoid, silu, ...) of x [M, n] for a narrow n, in fixed ROWS-row blocks. torch computes
    the last values of an elementwise op's tensor (its size mod the vector width) on a scalar path a few ulps off the
    vectorised one, so over a [T, 1] tensor the rows at the end of a batch came out otherwise than elsewhere. A block of
    ROWS x n values is a whole number of vectors, and small enough to run on one thread (no split into ranges with
    tails of their own), so every value takes the vector path wherever its row sits."""
    M = x.shape[0]
    blocks = -(-M // ROWS)
    padded = x.new_zeros(blocks * ROWS, *x.shape[1:])  # [M', n]
    padded[:M] = x
    return torch.cat([fn(block) for block in padded.split(ROWS)])[:M]
