"""MoE alignment: (token, k) pairs sorted into expert groups padded to BLOCK_M, on the device, no host sync.

Within an expert the pairs are ordered by adapter slot (-1, no adapter, first), so a block of BLOCK_M pairs
nearly always holds one adapter, and the base GEMM pays no padding beyond one partial block per expert.
Shapes (P = T * k pairs; NB = min(E, P) + cdiv(P, BLOCK_M), an upper bound on the number of blocks):
  sorted_pairs [NB * BLOCK_M] int32  pair ids (t * k + j) in block order; padding holds P (a sentinel)
  block_expert [NB] int32            expert of each block (E beyond the padded count)
  block_slot_lo/hi [NB] int32        smallest / largest adapter slot among a block's pairs (-1: none; -2 empty)
  pair_slot [P] int32                adapter slot of each pair (-1: none)
  (the three slot maps only when adapter slots are given)
  num_padded [1] int32               pairs after padding, a multiple of BLOCK_M (only blocks below it run)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_slot_lo: torch.Tensor | None  # None without adapter rows
    block_slot_hi: torch.Tensor | None
    pair_slot: torch.Tensor | None
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        """Host-known upper bound on the blocks (the launch grid); blocks past num_padded exit at once."""
        return self.block_expert.numel()


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              token_slots: torch.Tensor | None = None, num_slots: int = 0) -> MoeAlignment:
    """Torch ops on the device (a sort, searchsorted and scatters; no host sync, fixed output sizes). Without
    `token_slots` (no adapter rows) the slot maps are left out: only the LoRA kernels read them."""
    T, k = topk_ids.shape
    P, E, device = T * k, num_experts, topk_ids.device
    expert = topk_ids.reshape(-1)  # [P]
    if token_slots is None:
        order = torch.sort(expert, stable=True).indices  # [P]
    else:
        pair_slot = token_slots.long().repeat_interleave(k)  # [P]
        order = torch.sort(expert * (num_slots + 1) + pair_slot, stable=True).indices  # [P] expert, then slot
    sorted_expert = expert[order]  # [P]
    bounds = torch.searchsorted(sorted_expert, torch.arange(E + 1, device=device, dtype=sorted_expert.dtype))
    counts = bounds[1:] - bounds[:-1]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E]
    dest = (ends - padded - bounds[:-1])[sorted_expert] + torch.arange(P, device=device)  # [P] slot in block order
    NB = min(E, P) + -(-P // block_m)
    sorted_pairs = torch.full((NB * block_m,), P, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, NB * block_m, block_m, device=device, dtype=ends.dtype)  # [NB]
    align = MoeAlignment(sorted_pairs=sorted_pairs,
                         block_expert=torch.searchsorted(ends, block_start, right=True).to(torch.int32),  # E: unused
                         block_slot_lo=None, block_slot_hi=None, pair_slot=None,
                         num_padded=ends[-1:].to(torch.int32), block_m=block_m, num_pairs=P)
    if token_slots is not None:
        block, sorted_slot = dest // block_m, pair_slot[order]  # [P], [P]
        lo = torch.full((NB,), num_slots, dtype=torch.long, device=device).scatter_reduce_(0, block, sorted_slot, "amin")
        hi = torch.full((NB,), -2, dtype=torch.long, device=device).scatter_reduce_(0, block, sorted_slot, "amax")
        align.block_slot_lo, align.block_slot_hi = lo.to(torch.int32), hi.to(torch.int32)
        align.pair_slot = pair_slot.to(torch.int32)
    return align


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  token_slots: torch.Tensor | None = None) -> list[tuple[int, list[int]]]:
    """Plain-Python reference: the (expert, pair ids) of every padded group, pairs ordered by (slot, pair id)."""
    T, k = topk_ids.shape
    slots = [-1] * T if token_slots is None else token_slots.tolist()
    groups = []
    for e in range(num_experts):
        pairs = [p for p in range(T * k) if topk_ids.reshape(-1)[p].item() == e]
        pairs.sort(key=lambda p: (slots[p // k], p))
        if pairs:
            groups.append((e, pairs))
    return groups
