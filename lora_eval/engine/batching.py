"""Grouping samples into forward batches: bucketed by length under a padded-token budget."""

from __future__ import annotations


def make_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Sample indices in batches: sorted by length, each batch's rows x longest length <= `budget`
    (a sample longer than the budget runs alone). Deterministic for given lengths."""
    return batches_in_order(sorted(range(len(lengths)), key=lambda i: (lengths[i], i)), lengths, budget)


def batches_in_order(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """make_batches's rule (rows x longest length <= budget; a longer row alone) over rows taken in `order` (by
    length there; by chunk of shared-prefix groups, then length, for prefixes.grouped_order)."""
    if budget < 1:
        raise ValueError(f"the token budget must be positive, got {budget}")
    batches, current, longest = [], [], 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and grown * (len(current) + 1) > budget:
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def padding_waste(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of computed positions that are padding."""
    real = sum(lengths)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 0.0 if padded == 0 else 1 - real / padded
