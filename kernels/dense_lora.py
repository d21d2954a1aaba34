"""Dense multi-LoRA: y[rows of slot s] += (x @ A[s]^T) @ B[s]^T, rows grouped by adapter slot.

Shapes: x [T, in], y [T, out], A [S, R, in], B [S, out, R] (the adapter's scaling already folded into B),
groups: (slot, row indices) for each slot present in the batch that has weights here.
"""

from __future__ import annotations

import torch

from .linear import linear_ref


def dense_lora_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Plain-torch segmented shrink/expand; rows outside `groups` are left untouched (bit for bit)."""
    for slot, rows in groups:
        shrunk = linear_ref(x[rows], A[slot])  # [n, R]
        y.index_add_(0, rows, linear_ref(shrunk, B[slot]))  # [n, out]
    return y


def embedding_lora_ref(h: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Embedding LoRA: h[rows] += A[s][ids[rows]] @ B[s]^T with A [S, V, R] (PEFT's lora_embedding_A, transposed)
    and B [S, H, R] (scaling folded in)."""
    for slot, rows in groups:
        h.index_add_(0, rows, linear_ref(A[slot][ids[rows]], B[slot]))  # [n, H]
    return h
