"""MoE router top-k: softmax over the experts' logits in float32, the k largest probabilities and their experts,
renormalised to sum 1 when asked (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE routing).

Shapes: logits [T, E] (any float dtype, last dim contiguous) -> weights [T, k] float32, ids [T, k] int64, by
descending weight; among equal probabilities the lower expert comes first. One launch does what torch does in
three to five (softmax, topk, sum, divide).
A router LoRA's delta is expanded into the logits before (Forward.route): an expand inside this kernel would put
the logits in the dot's layout and sum the softmax in another order, and rows without an adapter would get routing
weights a bit apart from a batch without adapters (issue #23; the cost: BENCHMARKS-history 7 and 18.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import ROUTER_ROWS_PER_PROGRAM


def router_topk_ref(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k], [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit(do_not_specialize=["T"])
def router_topk_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_l, stride_w, stride_i, K: tl.constexpr,
                       RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < E)[None, :]
    raw = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask, other=0.0)
    logits = raw.to(tl.float32)  # [ROWS, BE]
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


def router_topk(logits: torch.Tensor, k: int, renormalize: bool, *,
                rows_per_program: int = ROUTER_ROWS_PER_PROGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton counterpart of router_topk_ref: (weights [T, k] float32, ids [T, k] int64). `rows_per_program`:
    the grid's rows per program (ROUTER_ROWS_PER_PROGRAM)."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    router_topk_kernel[(triton.cdiv(T, rows_per_program),)](
        logits, weights, ids, T, E, logits.stride(0), weights.stride(0), ids.stride(0), K=k, RENORMALIZE=renormalize,
        ROWS=rows_per_program, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    return weights, ids
