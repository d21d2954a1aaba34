"""MoE alignment: (token, k) pairs sorted into expert groups padded to BLOCK_M, on the device, no host sync,
in one Triton launch (the same work as ~40 small torch ops, which cost more than the GEMMs at small M).

Within an expert the pairs are ordered by adapter slot (-1, no adapter, first), so a block of BLOCK_M pairs
nearly always holds one adapter, and the base GEMM pays no padding beyond one partial block per expert.
Shapes (P = T * k pairs; NB = min(E, P) + cdiv(P, BLOCK_M), an upper bound on the number of blocks):
  sorted_pairs [NB * BLOCK_M] int32  pair ids (t * k + j) in block order; padding holds P (a sentinel)
  block_expert [NB] int32            expert of each block (E beyond the padded count)
  block_slot_lo/hi [NB] int32        smallest / largest adapter slot among a block's pairs (-1: none)
  pair_slot [P] int32                adapter slot of each pair (-1: none)
  num_padded [1] int32               pairs after padding, a multiple of BLOCK_M (only blocks below it run)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_slot_lo: torch.Tensor
    block_slot_hi: torch.Tensor
    pair_slot: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        """Host-known upper bound on the blocks (the launch grid); blocks past num_padded exit at once."""
        return self.block_expert.numel()


@triton.jit
def moe_align_kernel(
    topk_ids_ptr, token_slots_ptr, sorted_pairs_ptr, block_expert_ptr, block_lo_ptr, block_hi_ptr, pair_slot_ptr,
    num_padded_ptr, scratch_ptr, P, top_k, num_blocks,
    E: tl.constexpr, S: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr,
    EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: a counting sort of the pairs by key = expert * (S + 1) + slot + 1 (histograms, then
    atomic cursors per key), each expert's group padded to BLOCK_M. Within one (expert, slot) the order of
    pairs is arbitrary; it cannot change any result, since a row's GEMM output does not depend on its block."""
    offs = tl.arange(0, CHUNK)
    key_counts = tl.zeros((KEYS,), dtype=tl.int32)
    expert_counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, P, CHUNK):
        p = start + offs
        m = p < P
        e = tl.load(topk_ids_ptr + p, mask=m, other=0).to(tl.int32)
        if HAS_SLOTS:
            slot = tl.load(token_slots_ptr + p // top_k, mask=m, other=-1).to(tl.int32)
        else:
            slot = tl.full((CHUNK,), -1, tl.int32)
        tl.store(pair_slot_ptr + p, slot, mask=m)
        key_counts += tl.histogram(tl.where(m, e * (S + 1) + slot + 1, KEYS - 1), KEYS)  # bin KEYS-1: no key
        expert_counts += tl.histogram(tl.where(m, e, EXPERTS - 1), EXPERTS)  # bin EXPERTS-1: no expert
    ex = tl.arange(0, EXPERTS)
    counts = tl.where(ex < E, expert_counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # [EXPERTS] end of each expert's padded group
    tl.store(scratch_ptr + ex, ends - padded)  # padded start of each expert
    tl.store(scratch_ptr + EXPERTS + ex, tl.cumsum(counts, 0) - counts)  # pairs of the experts before it
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    keys = tl.arange(0, KEYS)
    live = keys < E * (S + 1)
    kc = tl.where(live, key_counts, 0)
    key_expert = tl.where(live, keys // (S + 1), 0)
    cursor = tl.load(scratch_ptr + key_expert) + (tl.cumsum(kc, 0) - kc) - tl.load(scratch_ptr + EXPERTS + key_expert)
    tl.store(scratch_ptr + 2 * EXPERTS + keys, cursor)  # first position of each key
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        q = start + offs
        tl.store(sorted_pairs_ptr + q, tl.full((CHUNK,), P, tl.int32), mask=q < num_blocks * BLOCK_M)
    for start in range(0, num_blocks, CHUNK):
        b = start + offs
        mb = b < num_blocks
        owner = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & (ex < E)[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=mb)  # E: past the padded count
        tl.store(block_lo_ptr + b, tl.full((CHUNK,), S, tl.int32), mask=mb)
        tl.store(block_hi_ptr + b, tl.full((CHUNK,), -2, tl.int32), mask=mb)
    tl.debug_barrier()
    for start in range(0, P, CHUNK):
        p = start + offs
        m = p < P
        e = tl.load(topk_ids_ptr + p, mask=m, other=0).to(tl.int32)
        slot = tl.load(pair_slot_ptr + p, mask=m, other=-1)
        pos = tl.atomic_add(scratch_ptr + 2 * EXPERTS + e * (S + 1) + slot + 1, tl.full((CHUNK,), 1, tl.int32),
                            mask=m)
        tl.store(sorted_pairs_ptr + pos, p, mask=m)
        tl.atomic_min(block_lo_ptr + pos // BLOCK_M, slot, mask=m)
        tl.atomic_max(block_hi_ptr + pos // BLOCK_M, slot, mask=m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              token_slots: torch.Tensor | None = None, num_slots: int = 0) -> MoeAlignment:
    """Launch the alignment (one small program; no host sync, fixed output sizes: graph-safe)."""
    T, k = topk_ids.shape
    P, E, device = T * k, num_experts, topk_ids.device
    NB = min(E, P) + -(-P // block_m)
    experts = triton.next_power_of_2(E + 1)
    keys = triton.next_power_of_2(E * (num_slots + 1) + 1)
    i32 = dict(dtype=torch.int32, device=device)
    align = MoeAlignment(
        sorted_pairs=torch.empty(NB * block_m, **i32), block_expert=torch.empty(NB, **i32),
        block_slot_lo=torch.empty(NB, **i32), block_slot_hi=torch.empty(NB, **i32), pair_slot=torch.empty(P, **i32),
        num_padded=torch.empty(1, **i32), block_m=block_m, num_pairs=P)
    scratch = torch.empty(2 * experts + keys, **i32)
    topk_ids = topk_ids.reshape(-1).contiguous()
    moe_align_kernel[(1,)](
        topk_ids, token_slots if token_slots is not None else topk_ids, align.sorted_pairs, align.block_expert,
        align.block_slot_lo, align.block_slot_hi, align.pair_slot, align.num_padded, scratch, P, k, NB,
        E=E, S=num_slots, HAS_SLOTS=token_slots is not None, BLOCK_M=block_m, KEYS=keys, EXPERTS=experts,
        CHUNK=1024, num_warps=8)
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
