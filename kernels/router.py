"""MoE router top-k: softmax over the experts' logits in float32, the k largest probabilities and their experts,
renormalised to sum 1 when asked (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE routing).

Shapes: logits [T, E] (any float dtype, last dim contiguous) -> weights [T, k] float32, ids [T, k] int64, by
descending weight; among equal probabilities the lower expert comes first. One launch does what torch does in
three to five (softmax, topk, sum, divide); torch's topk alone costs ~30 us at T = 4096, E = 128 on an H100.
With the router's LoRA (`lora` = (shrunk [T, R] or [splits, T, R], B [S, E, R], row_slot [T] int32, slot_mask [S]
or None), as in dense_lora.py) the logits first get their rows' delta, rounded into the logits' dtype as an
in-place expand would leave them: the expand costs no pass of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dense_lora import load_shrunk, partials, row_slots

ROWS_PER_PROGRAM = 16


def router_topk_ref(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k], [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, s_ptr, b_ptr, row_slot_ptr, slot_mask_ptr, T, E, R, S,
                       stride_l, stride_w, stride_i, stride_sk, stride_sm, stride_sr, stride_bs, stride_be,
                       stride_br, K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LORA: tl.constexpr,
                       HAS_SLOT_MASK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < E)[None, :]
    raw = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask, other=0.0)
    logits = raw.to(tl.float32)  # [ROWS, BE]
    if HAS_LORA:
        slot, lo, hi = row_slots(row_slot_ptr, slot_mask_ptr, rows, row_mask, S, HAS_SLOT_MASK)  # [ROWS], lo, hi
        offs_r = tl.arange(0, BLOCK_R)
        shrunk = load_shrunk(s_ptr, rows, offs_r, (slot >= 0)[:, None] & (offs_r < R)[None, :], stride_sk,
                             stride_sm, stride_sr, SPLITS)  # [ROWS, BR]: each row's own slot's
        for s in range(lo, hi + 1):
            part = tl.where((slot == s)[:, None], shrunk, 0.0)
            b = tl.load(b_ptr + s * stride_bs + cols[None, :] * stride_be + offs_r[:, None] * stride_br,
                        mask=(offs_r < R)[:, None] & (cols < E)[None, :], other=0.0)  # [BR, BE]
            logits = tl.dot(part.to(b.dtype), b, logits, input_precision="ieee")  # other slots' rows add zeros
        logits = logits.to(raw.dtype).to(tl.float32)  # as an in-place expand stores the logits
    logits = tl.where(mask, logits, float("-inf"))
    logits = tl.where(row_mask[:, None], logits, 0.0)  # rows past T: finite (never stored)
    top = tl.max(logits, axis=1)  # [ROWS]
    p = tl.exp(logits - top[:, None])
    p = p / tl.sum(p, axis=1)[:, None]  # softmax, as torch: exp(x - max) / sum
    p = tl.where((cols < E)[None, :], p, -2.0)  # padding columns below any probability
    slot = tl.arange(0, BLOCK_K)  # [BK]
    weights = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=1)  # [ROWS]
        pick = tl.argmax(p, axis=1, tie_break_left=True)  # [ROWS]
        weights = tl.where(slot[None, :] == j, best[:, None], weights)
        ids = tl.where(slot[None, :] == j, pick[:, None], ids)
        p = tl.where(cols[None, :] == pick[:, None], -1.0, p)  # taken: below any probability left
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # the padding slots hold 0
    out_mask = row_mask[:, None] & (slot < K)[None, :]
    tl.store(weights_ptr + rows[:, None].to(tl.int64) * stride_w + slot[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + rows[:, None].to(tl.int64) * stride_i + slot[None, :], ids.to(tl.int64), mask=out_mask)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton counterpart of router_topk_ref (of the logits plus their LoRA delta when `lora` is given, see
    the module notes): (weights [T, k] float32, ids [T, k] int64)."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    if lora is not None:
        shrunk, B, row_slot, slot_mask = lora
        R = B.shape[2]
        if B.shape[1] != E:
            raise ValueError(f"router_topk: B {tuple(B.shape)} for logits {(T, E)}")
        parts = partials(shrunk, T, R, "router_topk")
        lora_args = (parts, B, row_slot, slot_mask if slot_mask is not None else row_slot, R, B.shape[0],
                     logits.stride(0), weights.stride(0), ids.stride(0), *parts.stride(), B.stride(0), B.stride(1),
                     B.stride(2))
        splits = parts.shape[0]
    else:
        R, splits = 0, 1
        lora_args = (logits, logits, logits, logits, 0, 0, logits.stride(0), weights.stride(0), ids.stride(0),
                     0, 0, 0, 0, 0, 0)
    router_topk_kernel[(triton.cdiv(T, ROWS_PER_PROGRAM),)](
        logits, weights, ids, *lora_args[:4], T, E, *lora_args[4:],
        K=k, RENORMALIZE=renormalize, ROWS=ROWS_PER_PROGRAM, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(k), HAS_LORA=lora is not None,
        HAS_SLOT_MASK=lora is not None and lora[3] is not None, SPLITS=splits,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        num_warps=4)
    return weights, ids
