"""LoRA plumbing shared by the ops that apply adapter deltas (dense_lora.py, fused_moe.py): the
batch's rows grouped by adapter slot (LoraMeta, lora_metadata), each row's slot inside a kernel (row_slots), and a
shrink's partial sums, read on the device (load_shrunk) and checked on the host (partials).

Metadata (T token rows, S adapter slots; computed on the device, no host sync):
  token_slots [T] int           adapter slot of each row, -1 = none
  LoraMeta.sorted_rows [T]      int32 row ids ordered by slot (stable); the -1 rows come first
  LoraMeta.slot_start [S+1]     int32 slot s owns sorted_rows[slot_start[s] : slot_start[s + 1]]
  LoraMeta.slot_count [S]       int32 slot_start[s + 1] - slot_start[s]
  LoraMeta.row_slot [T]         int32 token_slots as given
  shrunk [splits, T, R] float32 x @ A[s]^T as `splits` partial sums over consecutive ranges of `in` (the
                                consumers add them in order); the consumers also take a [T, R] shrink (one partial)
  slot_mask [S] (optional)      nonzero: the slot has weights at this site; rows of the others are skipped
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class LoraMeta:
    sorted_rows: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    row_slot: torch.Tensor
    num_slots: int

    @property
    def num_rows(self) -> int:
        return self.sorted_rows.numel()


def lora_metadata(token_slots: torch.Tensor, num_slots: int) -> LoraMeta:
    """Rows grouped by adapter slot, on the device of `token_slots`, without a host sync (see the module notes)."""
    slots = token_slots.long()  # [T]
    sorted_slots, order = torch.sort(slots, stable=True)  # [T], [T]
    bounds = torch.arange(num_slots + 1, device=slots.device)  # [S+1]
    slot_start = torch.searchsorted(sorted_slots, bounds)  # [S+1] first sorted position with slot >= s
    return LoraMeta(sorted_rows=order.to(torch.int32), slot_start=slot_start.to(torch.int32),
                    slot_count=(slot_start[1:] - slot_start[:-1]).to(torch.int32),
                    row_slot=slots.to(torch.int32), num_slots=num_slots)


@triton.jit
def load_shrunk(s_ptr, rows, offs_r, mask, stride_split, stride_sm, stride_sr, SPLITS: tl.constexpr):
    """[rows, BLOCK_R] float32: the shrink of `rows`, its SPLITS partial sums (dense_lora_shrink) added in order;
    masked elements 0."""
    ptrs = s_ptr + rows[:, None].to(tl.int64) * stride_sm + offs_r[None, :] * stride_sr
    acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, SPLITS):
        acc += tl.load(ptrs + k * stride_split, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def row_slots(row_slot_ptr, slot_mask_ptr, rows, row_mask, S, HAS_SLOT_MASK: tl.constexpr):
    """For kernels that tile rows in their own order (not grouped by slot): each row's slot, -1 for none or for a
    slot masked off at this site, and the smallest / largest slot among them (lo > hi: no row has one)."""
    slot = tl.load(row_slot_ptr + rows, mask=row_mask, other=-1)
    if HAS_SLOT_MASK:
        weighted = tl.load(slot_mask_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
        slot = tl.where(weighted != 0, slot, -1)
    return slot, tl.min(tl.where(slot >= 0, slot, S), axis=0), tl.max(slot, axis=0)


def partials(shrunk: torch.Tensor, T: int, R: int, who: str) -> torch.Tensor:
    """A consumer's view of a shrink: [splits, T, R] as given, or a [T, R] shrink as one partial."""
    parts = shrunk[None] if shrunk.dim() == 2 else shrunk
    if parts.dim() != 3 or parts.shape[1:] != (T, R):
        raise ValueError(f"{who}: shrunk {tuple(shrunk.shape)}, expected [T, R] or [splits, T, R] with T = {T}, "
                         f"R = {R}")
    return parts
