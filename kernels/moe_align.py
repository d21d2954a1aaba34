"""MoE alignment: (token, k) pairs sorted into expert groups padded to BLOCK_M, on the device, no host sync.

A counting sort in two Triton launches (plus one memset), so a small batch pays three launches, not the
dozen small torch ops a sort-based version needs:
  1. count: every pair takes its place within its bin (expert, adapter slot) with an atomic add on the
     bin's counter; the returned old value is the pair's rank in the bin.
  2. place: every program rebuilds the bin offsets from the counters (expert groups padded to BLOCK_M,
     within a group the slots in order, no adapter first), writes its pairs to their places, and writes
     the block maps and the padding sentinels of its share of blocks.
The order of pairs inside one bin depends on the atomics, so it varies from run to run; nothing computed
from the alignment does: a GEMM row's value does not depend on which row of the tile it sits in, and a
block's expert and slot range depend on the bin sizes only.

Shapes (P = T * k pairs; NB = min(E, P) + cdiv(P, BLOCK_M), an upper bound on the number of blocks):
  sorted_pairs [NB * BLOCK_M] int32  pair ids (t * k + j) in block order; padding holds P (a sentinel);
                                     entries past num_padded are never read
  block_expert [NB] int32            expert of each block (E beyond the padded count)
  block_slot_lo/hi [NB] int32        smallest / largest adapter slot among a block's pairs (-1: none;
                                     lo = S, hi = -2 past the padded count); only when adapter slots are given
  token_slots [T]                    adapter slot of each token (-1: none), as given; kernels read it
  num_padded [1] int32               pairs after padding, a multiple of BLOCK_M (only blocks below it run)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tiles import ALIGN_BLOCK, ALIGN_BLOCKS


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_slot_lo: torch.Tensor | None  # None without adapter rows
    block_slot_hi: torch.Tensor | None
    token_slots: torch.Tensor | None
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        """Host-known upper bound on the blocks (the launch grid); blocks past num_padded exit at once."""
        return self.block_expert.numel()


@triton.jit
def _bin_of(topk_ids_ptr, token_slots_ptr, pair, mask, top_k, HAS_SLOTS: tl.constexpr):
    """(expert, slot + 1) of each pair, the slot column 0 when there are no adapter slots."""
    e = tl.load(topk_ids_ptr + pair, mask=mask, other=0).to(tl.int32)
    if HAS_SLOTS:
        s = tl.load(token_slots_ptr + pair // top_k, mask=mask, other=-1).to(tl.int32) + 1
    else:
        s = tl.zeros_like(e)
    return e, s


@triton.jit(do_not_specialize=["P"])
def moe_count_kernel(topk_ids_ptr, token_slots_ptr, counts_ptr, rank_ptr, P, top_k, NS,
                     HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """counts[e, s] += 1 per pair; rank[pair] = the counter's old value (the pair's place in its bin)."""
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pair < P
    e, s = _bin_of(topk_ids_ptr, token_slots_ptr, pair, mask, top_k, HAS_SLOTS)
    rank = tl.atomic_add(counts_ptr + e * NS + s, 1, mask=mask)
    tl.store(rank_ptr + pair, rank, mask=mask)


@triton.jit(do_not_specialize=["P", "NB"])
def moe_place_kernel(
    topk_ids_ptr, token_slots_ptr, counts_ptr, rank_ptr, scratch_ptr,
    sorted_pairs_ptr, block_expert_ptr, block_lo_ptr, block_hi_ptr, num_padded_ptr,
    P, top_k, E, NS, NB,
    HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Place BLOCK pairs and write the maps of BLOCKS aligned blocks (see the module notes)."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_s = tl.arange(0, BLOCK_S)
    e_mask = offs_e < E
    bin_mask = e_mask[:, None] & (offs_s < NS)[None, :]
    count = tl.load(counts_ptr + offs_e[:, None] * NS + offs_s[None, :], mask=bin_mask, other=0)  # [BE, BS]
    group = tl.sum(count, 1)  # [BE] pairs per expert
    padded = (group + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BE]
    ends = tl.cumsum(padded, 0)  # [BE] end of each expert's padded group
    starts = ends - padded  # [BE]
    bin_start = starts[:, None] + tl.cumsum(count, 1) - count  # [BE, BS] first place of each bin
    # Register tiles cannot be gathered from: each program keeps its copy of the offsets in its own scratch row.
    scratch = scratch_ptr + pid * (BLOCK_E * BLOCK_S + 2 * BLOCK_E)
    tl.store(scratch + offs_e[:, None] * BLOCK_S + offs_s[None, :], bin_start)
    tl.store(scratch + BLOCK_E * BLOCK_S + offs_e, starts)
    tl.store(scratch + BLOCK_E * BLOCK_S + BLOCK_E + offs_e, group)
    tl.debug_barrier()

    pair = pid * BLOCK + tl.arange(0, BLOCK)
    mask = pair < P
    e, s = _bin_of(topk_ids_ptr, token_slots_ptr, pair, mask, top_k, HAS_SLOTS)
    place = tl.load(scratch + e * BLOCK_S + s, mask=mask, other=0) + tl.load(rank_ptr + pair, mask=mask, other=0)
    tl.store(sorted_pairs_ptr + place, pair, mask=mask)

    total = tl.sum(padded, 0)
    if pid == 0:
        tl.store(num_padded_ptr, total)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)  # [BB]
    b_mask = block < NB
    b_start = block * BLOCK_M  # [BB]
    ends_masked = tl.where(e_mask, ends, 2147483647)  # [BE]
    expert = tl.sum((ends_masked[None, :] <= b_start[:, None]).to(tl.int32), 1)  # [BB] E past the padded count
    tl.store(block_expert_ptr + block, expert, mask=b_mask)
    used = b_mask & (b_start < total)
    e_safe = tl.where(used, expert, 0)
    group_end = tl.load(scratch + BLOCK_E * BLOCK_S + e_safe, mask=used, other=0) + \
        tl.load(scratch + BLOCK_E * BLOCK_S + BLOCK_E + e_safe, mask=used, other=0)  # [BB]
    row = b_start[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [BB, BM]
    tl.store(sorted_pairs_ptr + row, tl.full((BLOCKS, BLOCK_M), 0, tl.int32) + P,
             mask=used[:, None] & (row >= group_end[:, None]))  # the group's padding
    if HAS_SLOTS:
        s_mask = used[:, None] & (offs_s < NS)[None, :]
        first = tl.load(scratch + e_safe[:, None] * BLOCK_S + offs_s[None, :], mask=s_mask, other=0)  # [BB, BS]
        size = tl.load(counts_ptr + e_safe[:, None] * NS + offs_s[None, :], mask=s_mask, other=0)  # [BB, BS]
        hit = s_mask & (size > 0) & (first < b_start[:, None] + BLOCK_M) & (first + size > b_start[:, None])
        slot = offs_s[None, :] - 1  # [1, BS]
        tl.store(block_lo_ptr + block, tl.min(tl.where(hit, slot, NS - 1), 1), mask=b_mask)
        tl.store(block_hi_ptr + block, tl.max(tl.where(hit, slot, -2), 1), mask=b_mask)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              token_slots: torch.Tensor | None = None, num_slots: int = 0) -> MoeAlignment:
    """Align on the device (see the module notes); fixed output sizes, no host sync. Without `token_slots`
    (no adapter rows) the pairs are grouped by expert only and the slot maps are left out."""
    T, k = topk_ids.shape
    P, E, device = T * k, num_experts, topk_ids.device
    has_slots = token_slots is not None
    NS = num_slots + 1 if has_slots else 1  # bins per expert: no adapter, then each slot
    NB = min(E, P) + -(-P // block_m)
    BLOCK_E, BLOCK_S = triton.next_power_of_2(E), triton.next_power_of_2(NS)
    grid = max(triton.cdiv(P, ALIGN_BLOCK), triton.cdiv(NB, ALIGN_BLOCKS))
    ids = topk_ids.reshape(-1).contiguous()  # [P]: the kernels read it by flat index
    token_slots = token_slots.contiguous() if has_slots else None
    slots = token_slots if has_slots else ids
    counts = torch.zeros(E * NS, dtype=torch.int32, device=device)  # [E, NS]
    rank = torch.empty(P, dtype=torch.int32, device=device)  # [P]
    scratch = torch.empty(grid, BLOCK_E * BLOCK_S + 2 * BLOCK_E, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(NB * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(NB, dtype=torch.int32, device=device)
    lo = torch.empty(NB, dtype=torch.int32, device=device) if has_slots else None
    hi = torch.empty(NB, dtype=torch.int32, device=device) if has_slots else None
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    moe_count_kernel[(triton.cdiv(P, ALIGN_BLOCK),)](ids, slots, counts, rank, P, k, NS,
                                                     HAS_SLOTS=has_slots, BLOCK=ALIGN_BLOCK, num_warps=4)
    moe_place_kernel[(grid,)](
        ids, slots, counts, rank, scratch, sorted_pairs, block_expert,
        lo if has_slots else block_expert, hi if has_slots else block_expert, num_padded,
        P, k, E, NS, NB, HAS_SLOTS=has_slots, BLOCK_M=block_m, BLOCK=ALIGN_BLOCK, BLOCKS=ALIGN_BLOCKS,
        BLOCK_E=BLOCK_E, BLOCK_S=BLOCK_S, num_warps=4)
    return MoeAlignment(sorted_pairs=sorted_pairs, block_expert=block_expert, block_slot_lo=lo, block_slot_hi=hi,
                        token_slots=token_slots, num_padded=num_padded, block_m=block_m, num_pairs=P)


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
