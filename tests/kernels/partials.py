"""Shrink outputs as the dense-LoRA consumers take them: [T, R], or partial sums [splits, T, R] over ranges of
the input features (kernels/dense_lora.dense_lora_shrink) that every consumer adds in order."""

from __future__ import annotations

import torch


def shrink_partials(splits: int, T: int, R: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(what to hand the consumer, the [T, R] float32 shrink it stands for): one split is a plain [T, R] shrink;
    more are random float32 partials [splits, T, R] and their sum in the consumers' order ((p0 + p1) + p2 ...)."""
    parts = torch.randn(splits, T, R, generator=g)
    if splits == 1:
        return parts[0], parts[0]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return parts, total
