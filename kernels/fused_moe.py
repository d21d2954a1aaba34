"""Fused MoE with per-(adapter, expert) LoRA: the math every MoE path must reproduce.

For token t routed to expert e with weight w, under adapter slot s (-1 = none):
  gate_up = W_gu[e] x + b_gu[e] + B_gu[s, e] (A_gu[s, e] x)      (no routing weight, before the activation)
  a       = silu(gate) * up, or with activation "clamped_swiglu" (GPT-OSS), g = min(gate, limit),
            u = clamp(up, -limit, limit): a = (u + 1) * g * sigmoid(alpha * g)
  y[t]   += w * (W_d[e] a + b_d[e] + B_d[s, e] (A_d[s, e] a))
Shapes: x [T, H], topk_ids/topk_weights [T, k], w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I],
optional biases b_gu [E, 2I] and b_d [E, H];
LoRA (ExpertLoRA): gate_up_A [S, Ea, R, H], gate_up_B [S, Eb, 2I, R], down_A [S, Ea, R, I], down_B [S, Eb, H, R]
where an expert dim of 1 is shared by all experts (broadcast), scaling folded into B.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from .linear import linear_ref, pointwise_in_blocks
from .tiles import (ALL_SLOTS_MAX, GEMM_SMEM, MOE_CONFIGS, MOE_SHRINK_SMEM, MOE_SHRINK_TILES, SUM_BLOCKS,
                    SUM_LORA_BLOCKS, MoeConfig)


ACTIVATIONS = ("silu", "clamped_swiglu")


def activation_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """The expert activation of gate and up [n, I] -> [n, I] (see the module notes)."""
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(alpha * gate))


def fused_moe_ref(x, topk_ids, topk_weights, w_gate_up, w_down, lora=None, token_slots=None, *,
                  gate_up_bias=None, down_bias=None, activation="silu", alpha=1.702, limit=7.0) -> torch.Tensor:
    """Plain-torch reference: loop over experts that got tokens, then over adapter slots among those tokens."""
    T, k = topk_ids.shape
    I = w_down.shape[-1]
    out = torch.zeros_like(x)  # [T, H]
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)  # [n] indices into T*k
        tokens = pairs // k  # [n]
        xe = x[tokens]  # [n, H]
        gate_up = linear_ref(xe, w_gate_up[e], None if gate_up_bias is None else gate_up_bias[e])  # [n, 2I]
        groups = _slot_groups(lora, token_slots[tokens]) if lora is not None else []
        for slot, rows in groups:
            A, B = lora.gate_up_A[slot], lora.gate_up_B[slot]
            delta = linear_ref(linear_ref(xe[rows], A[e % A.shape[0]]), B[e % B.shape[0]])  # [m, 2I]
            gate_up.index_add_(0, rows, delta)
        act = pointwise_in_blocks(functools.partial(activation_ref, activation=activation, alpha=alpha, limit=limit),
                                  gate_up[:, :I], gate_up[:, I:])  # [n, I], every value on the vector path
        ye = linear_ref(act, w_down[e], None if down_bias is None else down_bias[e])  # [n, H]
        for slot, rows in groups:
            A, B = lora.down_A[slot], lora.down_B[slot]
            ye.index_add_(0, rows, linear_ref(linear_ref(act[rows], A[e % A.shape[0]]), B[e % B.shape[0]]))  # [m, H]
        out.index_add_(0, tokens, ye * topk_weights.reshape(-1)[pairs, None])
    return out


def _slot_groups(lora, slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, positions) for each adapter slot among `slots` that has expert weights in `lora`."""
    present = torch.unique(slots).tolist()
    return [(s, (slots == s).nonzero().squeeze(1)) for s in present if s in lora.slots]


# ---------------------------------------------------------------------------------------------------------
# Triton: one grouped GEMM kernel over aligned blocks (kernels/moe_align.py), used twice per layer:
#   gate_up: x[pair // k] @ W_gu[e]^T -> gate, up (two accumulators) -> silu(gate) * up -> act [P, I]
#            (MoeConfig.sorted_act: act [NB * BLOCK_M, I] in block order, read by the down GEMM by block row)
#   down:    act[pair] @ W_d[e]^T -> * routing weight -> y [P, H];   out[t] = sum_j y[t * k + j] (fp32, moe_sum)
# LoRA: a small shrink kernel computes x @ A[s, e]^T once per aligned block ([blocks * BLOCK_M, R] in x's dtype);
# the grouped GEMM loads a block's shrink rows and B[s, e] tile before its main loop and adds shrink @ B^T to
# its accumulators after it (MoeConfig.expand_first: before it), for the rows of adapter slot s only (a block
# holds one slot, or a few at a slot boundary inside an expert's pairs).
# A block whose pairs have no adapter adds nothing. Factors shared by all experts skip work: a shared gate_up A
# is one shrink per token (dense_lora_shrink); a shared down B is expanded once per token inside the sum over k,
# out[t] += (sum_j w_j shrink[t, j]) @ B^T, from a shrink stored by pair, and the down GEMM runs without LoRA.
# ---------------------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from . import moe_gemm_gluon  # noqa: E402
from .dense_lora import dense_lora_shrink  # noqa: E402
from .lora_meta import lora_metadata, row_slots  # noqa: E402
from .moe_align import moe_align  # noqa: E402
from .tma import tma_ready  # noqa: E402


def pick_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype = torch.bfloat16,
                table: dict | None = None) -> MoeConfig:
    """The MoeConfig of `table` (MOE_CONFIGS by default: {most pairs per expert, or None for more: MoeConfig}) for
    this many pairs per expert."""
    table = MOE_CONFIGS if table is None else table
    pairs_per_expert = num_tokens * top_k / num_experts
    limit = next((n for n in table if n is not None and pairs_per_expert <= n), None)
    config = table[limit]
    if dtype == torch.float32:  # 4-byte tiles: halve the K step and the pipeline depth to fit shared memory
        fp32 = {gemm: {**getattr(config, gemm), "BLOCK_K": min(getattr(config, gemm)["BLOCK_K"], 32), "num_stages": 2}
                for gemm in ("gate_up", "down")}
        config = replace(config, **fp32)
    return config


def _gemm_smem(tiles: dict, gated: bool, lora_cols: int, shrink_cols: int, size: int, stages: int) -> int:
    """Bytes of shared memory of the grouped GEMM at `stages` pipeline stages: (stages - 1) x its pipelined tiles (a
    tile, the weight tiles, the pair shrink's A tile), the expand's operands (a block's shrink rows and B tiles over
    lora_cols ranks; twice for blocks above 16 rows, their layout conversions) and the pair shrink's float32
    [BM, shrink_cols] epilogue. Checked by compiling for sm_90 (tests/kernels/test_sm90_compile.py)."""
    BM, BN, BK = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    weights = 2 if gated else 1
    stage = (BM * BK + weights * BN * BK + BK * shrink_cols) * size
    copies = 1 if BM <= 16 else 2  # measured: 16-row blocks hold the operands once, larger ones twice
    operands = copies * (BM * lora_cols + weights * lora_cols * BN) * size + BM * shrink_cols * 4
    return (stages - 1) * stage + operands


def expand_rank_step(tiles: dict, gated: bool, rank: int, shrink_cols: int, size: int) -> int:
    """The in-GEMM LoRA expand's step over the (padded) rank: all of it when its operands fit beside one pipeline
    stage, else halved until they do, and the expand loops over rank chunks (PEFT's rank 64 per projection on
    gate_up at 128-row blocks: two chunks of 64)."""
    step = rank
    while step > 16 and _gemm_smem(tiles, gated, step, shrink_cols, size, 2) > GEMM_SMEM:
        step //= 2
    return step


def gemm_stages(tiles: dict, gated: bool, lora_cols: int, shrink_cols: int, size: int) -> int:
    """The grouped GEMM's pipeline depth with LoRA work: tiles' num_stages, less while _gemm_smem would not fit
    GEMM_SMEM (the expand's operands share it with the stages: tests/kernels/test_sm90_compile.py compiles ranks 32
    and 64). lora_cols: the expand's rank step (expand_rank_step). Work that fits no depth is refused by name."""
    stages = tiles["num_stages"]
    while stages > 2 and _gemm_smem(tiles, gated, lora_cols, shrink_cols, size, stages) > GEMM_SMEM:
        stages -= 1
    if _gemm_smem(tiles, gated, lora_cols, shrink_cols, size, 2) > GEMM_SMEM:
        what = "gate_up (gate and up ranks together)" if gated else "down"
        raise ValueError(f"fused_moe: the grouped GEMM's {tiles['BLOCK_M']}x{tiles['BLOCK_N']} tiles on {what} with "
                         f"a LoRA expand of {lora_cols} ranks at a time and a pair shrink of {shrink_cols} columns "
                         f"(slots x rank) do not fit the GPU's {GEMM_SMEM} bytes of shared memory")
    return stages


def shrink_block_k(block_m: int, block_r: int, dtype: torch.dtype, stages: int, longest: int) -> int:
    """The LoRA shrink kernel's step over the input features: the longest up to `longest` whose `stages`
    pipelined tiles fit MOE_SHRINK_SMEM."""
    size = 4 if dtype == torch.float32 else 2
    return next((bk for bk in (256, 128, 64, 32) if bk <= longest and stages * (block_m + block_r) * bk * size
                 <= MOE_SHRINK_SMEM), 16)


@triton.jit
def _shrink(a_ptr, rows, row_mask, la_ptr, K, R, stride_am, stride_ak, stride_lar, stride_lak,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: rows of a @ A^T for one (slot, expert) factor A [R, K] at la_ptr."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=row_mask[:, None] & (kk[None, :] < K), other=0.0)
        la = tl.load(la_ptr + offs_r[None, :] * stride_lar + kk[:, None] * stride_lak,
                     mask=(offs_r[None, :] < R) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(a, la, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _shrink_side_by_side(a_ptr, rows, valid, slot, lo, hi, la_ptr, K, R, stride_am, stride_ak, stride_las, stride_lar,
                         stride_lak, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_M, BLOCK_R] fp32: each row's own slot's a @ A[slot]^T, slots lo..hi computed side by side in one
    pass over K (column c of the wide product: slot c // BLOCK_R, rank c % BLOCK_R); A of slot s at
    la_ptr + s * stride_las."""
    offs_c = tl.arange(0, BLOCK_S * BLOCK_R)
    c_slot = offs_c // BLOCK_R
    c_rank = offs_c % BLOCK_R
    c_mask = (c_slot >= lo) & (c_slot <= hi) & (c_rank < R)
    la_cols = la_ptr + c_slot.to(tl.int64) * stride_las + c_rank * stride_lar  # [BS*BR]
    offs_k = tl.arange(0, BLOCK_K)
    wide = tl.zeros((BLOCK_M, BLOCK_S * BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        la = tl.load(la_cols[None, :] + kk[:, None] * stride_lak, mask=c_mask[None, :] & (kk[:, None] < K), other=0.0)
        wide += tl.dot(a, la, input_precision=DOT_PRECISION)
    wide = tl.where(c_slot[None, :] == slot[:, None], wide, 0.0)  # a row's own slot only (exact zeros else)
    return tl.sum(tl.reshape(wide, (BLOCK_M, BLOCK_S, BLOCK_R)), axis=1)  # [BM, BR]


@triton.jit
def _expand(acc, shrunk, lb_ptr, offs_n, n_mask, R, stride_lbn, stride_lbr, BLOCK_R: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """acc += shrunk @ B^T for B [N, R] at lb_ptr (columns offs_n)."""
    offs_r = tl.arange(0, BLOCK_R)
    lb = tl.load(lb_ptr + offs_r[:, None] * stride_lbr + offs_n[None, :] * stride_lbn,
                 mask=(offs_r[:, None] < R) & n_mask[None, :], other=0.0)
    return acc + tl.dot(shrunk.to(lb.dtype), lb, input_precision=DOT_PRECISION)


@triton.jit
def _expand_chunk(acc, acc_up, shrunk_ptrs, lb_ptr, slot, valid, s, r0, e, offs_n, n_mask, N, R, stride_lbs,
                  stride_lbe, stride_lbn, stride_lbr, GATED: tl.constexpr, BLOCK_R: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """acc (and acc_up) += the shrink columns r0 .. r0 + BLOCK_R of slot s's rows @ those of B[s, e] (rows of
    other slots add exact zeros)."""
    offs_r = tl.arange(0, BLOCK_R)
    shrunk = tl.load(shrunk_ptrs + r0, mask=(valid & (slot == s))[:, None] & (offs_r < R - r0)[None, :], other=0.0)
    lb = lb_ptr + s * stride_lbs + e * stride_lbe + r0 * stride_lbr
    acc = _expand(acc, shrunk, lb, offs_n, n_mask, R - r0, stride_lbn, stride_lbr, BLOCK_R, DOT_PRECISION)
    if GATED:
        acc_up = _expand(acc_up, shrunk, lb + N * stride_lbn, offs_n, n_mask, R - r0, stride_lbn, stride_lbr, BLOCK_R,
                         DOT_PRECISION)
    return acc, acc_up


@triton.jit
def _lora_expand(acc, acc_up, first, first_b, first_b_up, shrunk_ptrs, lb_ptr, slot, valid, lo, hi, e, offs_n, n_mask,
                 N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr, GATED: tl.constexpr, BLOCK_R: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """The block's LoRA delta into its accumulators, BLOCK_R ranks at a time (expand_rank_step): the first slot's
    first chunk of shrink rows and B tiles as loaded before the main loop; its further chunks and further slots
    (a block at a slot boundary) loaded here. Rows of no adapter add exact zeros."""
    if hi >= lo:
        acc = tl.dot(first.to(first_b.dtype), first_b, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(first.to(first_b.dtype), first_b_up, acc_up, input_precision=DOT_PRECISION)
        for r0 in range(BLOCK_R, R, BLOCK_R):
            acc, acc_up = _expand_chunk(acc, acc_up, shrunk_ptrs, lb_ptr, slot, valid, lo, r0, e, offs_n, n_mask, N,
                                        R, stride_lbs, stride_lbe, stride_lbn, stride_lbr, GATED, BLOCK_R,
                                        DOT_PRECISION)
        for s in range(lo + 1, hi + 1):
            for r0 in range(0, R, BLOCK_R):
                acc, acc_up = _expand_chunk(acc, acc_up, shrunk_ptrs, lb_ptr, slot, valid, s, r0, e, offs_n, n_mask,
                                            N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr, GATED, BLOCK_R,
                                            DOT_PRECISION)
    return acc, acc_up


@triton.jit(do_not_specialize=["P"])
def moe_lora_shrink_kernel(
    a_ptr, la_ptr, shrunk_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, token_slots_ptr, block_lo_ptr,
    block_hi_ptr, K, P, R, top_k,
    stride_am, stride_ak, stride_las, stride_lae, stride_lar, stride_lak, stride_sm,
    ROWS_ARE_TOKENS: tl.constexpr, A_SORTED: tl.constexpr, BY_PAIR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_K_WIDE: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ALL_SLOTS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """shrunk[block rows] (BY_PAIR: shrunk[pairs]) = a[rows] @ A[slot of the row, e]^T for one aligned block;
    blocks without an adapter are skipped (their rows are never read). ALL_SLOTS: a block with several slots
    computes them side by side in one pass over K (BLOCK_S * BLOCK_R columns) and each row keeps its own slot's;
    else (and for a block of one slot, the common case at large M) one pass per slot in the block. One program
    per aligned block: slicing blocks into 16-64-row programs measured slower (BENCHMARKS-history.md section 1)."""
    pid_m = tl.program_id(0)
    hi = tl.load(block_hi_ptr + pid_m)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr) or hi < 0:
        return
    lo = tl.maximum(tl.load(block_lo_ptr + pid_m), 0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    valid = pair < P
    rows = ((pair // top_k) if ROWS_ARE_TOKENS else pair).to(tl.int64)
    if A_SORTED:
        rows = offs_m.to(tl.int64)
    slot = tl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)
    if ALL_SLOTS:
        if hi > lo:
            acc = _shrink_side_by_side(a_ptr, rows, valid, slot, lo, hi, la_ptr + e * stride_lae, K, R, stride_am,
                                       stride_ak, stride_las, stride_lar, stride_lak, BLOCK_M, BLOCK_K_WIDE, BLOCK_R,
                                       BLOCK_S, DOT_PRECISION)
        else:
            acc = _shrink(a_ptr, rows, valid & (slot == lo), la_ptr + lo * stride_las + e * stride_lae, K, R,
                          stride_am, stride_ak, stride_lar, stride_lak, BLOCK_M, BLOCK_K, BLOCK_R, DOT_PRECISION)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(lo, hi + 1):  # each row picks up its own adapter's shrink
            acc += _shrink(a_ptr, rows, valid & (slot == s), la_ptr + s * stride_las + e * stride_lae, K, R,
                           stride_am, stride_ak, stride_lar, stride_lak, BLOCK_M, BLOCK_K, BLOCK_R, DOT_PRECISION)
    offs_r = tl.arange(0, BLOCK_R)
    if BY_PAIR:
        tl.store(shrunk_ptr + pair.to(tl.int64)[:, None] * stride_sm + offs_r[None, :],
                 acc.to(shrunk_ptr.dtype.element_ty), mask=valid[:, None] & (offs_r < R)[None, :])
    else:
        tl.store(shrunk_ptr + offs_m[:, None] * stride_sm + offs_r[None, :], acc.to(shrunk_ptr.dtype.element_ty),
                 mask=(offs_r < R)[None, :])


@triton.jit
def _moe_tile(
    a_ptr, w_ptr, out_ptr, routing, lora, bias_ptr, pair_shrink, pid_m, pid_n, e, N, K, P, R, RS, top_k, swiglu,
    a_strides, w_strides, out_strides, lora_strides, stride_be, shrink_strides,
    GATED: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr,
    A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, EXPAND_FIRST: tl.constexpr, SHRINK: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_RS: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SHRUNK_BY_TOKEN: tl.constexpr,
):
    """The first TILE_M rows (TILE_M <= BLOCK_M) of aligned block pid_m, output columns of N tile pid_n (the
    argument groups as moe_gemm_kernel's). SHRINK: also the LoRA shrink a @ la[slot, e]^T of the block's rows over
    the same a tiles (all the block's slots side by side, BLOCK_S * BLOCK_RS columns), stored by pair id into
    pair_shrunk."""
    sorted_pairs_ptr, _, _, topk_weight_ptr = routing
    shrunk_ptr, lb_ptr, token_slots_ptr, block_lo_ptr, block_hi_ptr = lora
    la_ptr, pair_shrunk_ptr = pair_shrink
    alpha, limit = swiglu
    stride_am, stride_ak = a_strides
    stride_we, stride_wn, stride_wk = w_strides
    stride_om, stride_on = out_strides
    stride_sm, stride_lbs, stride_lbe, stride_lbn, stride_lbr = lora_strides
    stride_las, stride_lae, stride_lar, stride_lak, stride_psm = shrink_strides
    offs_m = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    valid = pair < P
    rows = (pair // top_k) if ROWS_ARE_TOKENS else pair
    rows = rows.to(tl.int64)
    if A_SORTED:
        rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if not A_TMA:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not W_TMA:
        w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:  # the first slot's operands load before the main loop, so that their latency hides behind it
        lo = tl.maximum(tl.load(block_lo_ptr + pid_m), 0)
        hi = tl.load(block_hi_ptr + pid_m)
        slot = tl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        shrunk_rows = (pair // top_k).to(tl.int64) if SHRUNK_BY_TOKEN else offs_m.to(tl.int64)
        shrunk_ptrs = shrunk_ptr + shrunk_rows[:, None] * stride_sm + offs_r[None, :]
        lb_ptrs = lb_ptr + e * stride_lbe + offs_r[:, None] * stride_lbr + offs_n[None, :] * stride_lbn
        lb_mask = (hi >= lo) & r_mask[:, None] & n_mask[None, :]
        first = tl.load(shrunk_ptrs, mask=(valid & (slot == lo))[:, None] & r_mask[None, :], other=0.0)
        first_b = tl.load(lb_ptrs + lo * stride_lbs, mask=lb_mask, other=0.0)
        first_b_up = first_b
        if GATED:
            first_b_up = tl.load(lb_ptrs + lo * stride_lbs + N * stride_lbn, mask=lb_mask, other=0.0)
        if EXPAND_FIRST:  # the delta is the accumulators' starting value
            acc, acc_up = _lora_expand(acc, acc_up, first, first_b, first_b_up, shrunk_ptrs, lb_ptr, slot, valid, lo,
                                       hi, e, offs_n, n_mask, N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr,
                                       GATED, BLOCK_R, DOT_PRECISION)
    if SHRINK:  # column c of the side-by-side shrink: slot c // BLOCK_RS, rank c % BLOCK_RS
        s_lo = tl.maximum(tl.load(block_lo_ptr + pid_m), 0)
        s_hi = tl.load(block_hi_ptr + pid_m)
        s_slot = tl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)
        offs_c = tl.arange(0, BLOCK_S * BLOCK_RS)
        c_slot = offs_c // BLOCK_RS
        c_rank = offs_c % BLOCK_RS
        c_mask = (c_slot >= s_lo) & (c_slot <= s_hi) & (c_rank < RS)
        la_ptrs = la_ptr + c_slot.to(tl.int64)[None, :] * stride_las + e * stride_lae + c_rank[None, :] * stride_lar \
            + offs_k[:, None] * stride_lak  # [BK, BS*BRS]
        wide = tl.zeros((TILE_M, BLOCK_S * BLOCK_RS), dtype=tl.float32)
    e32 = e.to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        if A_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
        if SHRINK:
            la = tl.load(la_ptrs, mask=k_mask[:, None] & c_mask[None, :], other=0.0)
            wide += tl.dot(a, la, input_precision=DOT_PRECISION)
            la_ptrs += BLOCK_K * stride_lak
        if W_TMA:
            w = w_ptr.load([e32, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            if W_TMA:
                w_up = w_ptr.load([e32, N + pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        if not W_TMA:
            w_ptrs += BLOCK_K * stride_wk
    if HAS_LORA and not EXPAND_FIRST:  # the delta added to the main loop's sums
        acc, acc_up = _lora_expand(acc, acc_up, first, first_b, first_b_up, shrunk_ptrs, lb_ptr, slot, valid, lo, hi,
                                   e, offs_n, n_mask, N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr, GATED,
                                   BLOCK_R, DOT_PRECISION)
    if SHRINK:  # each row keeps its own slot's columns (exact zeros for rows of no adapter)
        wide = tl.where(c_slot[None, :] == s_slot[:, None], wide, 0.0)
        pair_shrunk = tl.sum(tl.reshape(wide, (TILE_M, BLOCK_S, BLOCK_RS)), axis=1)  # [TILE_M, BRS]
        offs_rs = tl.arange(0, BLOCK_RS)
        tl.store(pair_shrunk_ptr + pair.to(tl.int64)[:, None] * stride_psm + offs_rs[None, :],
                 pair_shrunk.to(pair_shrunk_ptr.dtype.element_ty), mask=valid[:, None] & (offs_rs < RS)[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if CLAMPED_SWIGLU:
            g = tl.minimum(acc, limit)
            acc = (tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    if OUT_SORTED:  # every row of the tile, padding included, so that A_SORTED reads only written rows
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:
        out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["P", "num_blocks"])
def moe_gemm_kernel(
    a_ptr, a_half_ptr, w_ptr, out_ptr, routing, lora, bias_ptr, pair_shrink, N, K, P, R, RS, top_k, num_blocks,
    swiglu, a_strides, w_strides, out_strides, lora_strides, stride_be, shrink_strides,
    GATED: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr,
    A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, EXPAND_FIRST: tl.constexpr, HALF_TAIL: tl.constexpr,
    PAIR_SHRINK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_RS: tl.constexpr, BLOCK_S: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SHRUNK_BY_TOKEN: tl.constexpr,
):
    """out[pair, n] for the pairs of one aligned block and BLOCK_N output columns (see module notes). Argument groups
    (tuples): routing (sorted_pairs, block_expert, num_padded, topk_weight pointers); lora (shrunk, lb, token_slots,
    block_lo, block_hi pointers); pair_shrink (la, pair_shrunk pointers); swiglu (alpha, limit); a_strides (m, k);
    w_strides (e, n, k); out_strides (m, n); lora_strides (shrunk m; lb s, e, n, r); shrink_strides (la s, e, r, k;
    pair_shrunk m).
    GATED: w rows [0, N) are gate and [N, 2N) up; the output is silu(gate) * up (CLAMPED_SWIGLU: GPT-OSS's form).
    HAS_BIAS: bias [E, N] (GATED: [E, 2N]) added before the activation / the routing weight.
    SHRUNK_BY_TOKEN: the LoRA shrink is indexed by token row (A shared by all experts) instead of by block row.
    EXPAND_FIRST: the LoRA delta goes into the accumulators before the main loop instead of after it.
    HALF_TAIL: a block whose pairs all sit in its first BLOCK_M // 2 rows (an expert group's last block; the
    padding follows the pairs) computes those rows only (a_half_ptr: a's descriptor of half-height blocks).
    PAIR_SHRINK: N tile 0 of each block with adapter rows also computes their LoRA shrink a @ la[slot, e]^T
    (la [S, Ea, RS, K]) from the a tiles it loads anyway, into pair_shrunk [P, RS] by pair id (the down GEMM with a
    down B shared by all experts: moe_sum expands it); the other tiles do not wait for it.
    A_SORTED: a's rows are block rows (a written in block order by OUT_SORTED, every computed row written).
    W_TMA / A_TMA: w_ptr / a_ptr are tensor descriptors (blocks [1, BLOCK_N, BLOCK_K] / [BLOCK_M, BLOCK_K])."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, _ = routing
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    # a switched-off feature's flag is a constexpr, so that its branches below are not compiled (a plain `= False`
    # would be a tensor: the compiler builds both sides of `if flag:`)
    if HALF_TAIL:
        half = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= P
    else:
        half: tl.constexpr = False
    if PAIR_SHRINK:
        shrink = (pid_n == 0) & (tl.load(lora[4] + pid_m) >= 0)  # the block's last slot (block_hi): an adapter row
    else:
        shrink: tl.constexpr = False
    # one tile variant per (half, shrink): each a compile-time instance of the tile (its height and the shrink are
    # constexprs); the variants a switched-off feature cannot reach are not compiled
    for HALF in tl.static_range(2 if HALF_TAIL else 1):
        if half == (HALF == 1):
            for SHRINK in tl.static_range(2 if PAIR_SHRINK else 1):
                if shrink == (SHRINK == 1):
                    _moe_tile(a_half_ptr if HALF else a_ptr, w_ptr, out_ptr, routing, lora, bias_ptr, pair_shrink,
                              pid_m, pid_n, e, N, K, P, R, RS, top_k, swiglu, a_strides, w_strides, out_strides,
                              lora_strides, stride_be, shrink_strides, GATED, ROWS_ARE_TOKENS, MUL_WEIGHT, HAS_LORA,
                              HAS_BIAS, CLAMPED_SWIGLU, W_TMA, A_TMA, A_SORTED, OUT_SORTED, EXPAND_FIRST, SHRINK == 1,
                              BLOCK_M, BLOCK_M // (1 + HALF), BLOCK_N, BLOCK_K, BLOCK_R, BLOCK_RS, BLOCK_S,
                              DOT_PRECISION, SHRUNK_BY_TOKEN)


@triton.jit(do_not_specialize=["T"])
def moe_sum_kernel(y_ptr, out_ptr, s_ptr, w_ptr, b_ptr, row_slot_ptr, res_ptr, T, H, R, S,
                   stride_yt, stride_yj, stride_ot, stride_st, stride_sj, stride_wt, stride_wj, stride_bs, stride_bh,
                   stride_br, stride_rt,
                   TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[t] = sum_j y[t, j] in fp32 (j in order), stored in out's dtype: one read of y, one write of out.
    HAS_LORA: plus (sum_j w[t, j] shrunk[t, j]) @ B[slot of t]^T, the down expand of a B shared by all experts
    (rows of no adapter add exact zeros). HAS_RESIDUAL: that sum rounded to out's dtype, then added to res[t] in
    fp32 and rounded again (torch's res + sum)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < H)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: all k loads in flight at once
        acc += tl.load(y_ptr + rows64 * stride_yt + j * stride_yj + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    if HAS_LORA:
        slot, lo, hi = row_slots(row_slot_ptr, row_slot_ptr, rows, row_mask, S, False)  # [BT], lo, hi
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        if hi >= lo:
            shrunk = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for i in tl.static_range(TOP_K):  # the routing weights go on the shrink: sum_j w_j B (A_j a_j) = B sum_j
                w = tl.load(w_ptr + rows64 * stride_wt + i * stride_wj, mask=row_mask[:, None],
                            other=0.0).to(tl.float32)  # [BT, 1]
                part = tl.load(s_ptr + rows64 * stride_st + i * stride_sj + offs_r[None, :],
                               mask=(slot >= 0)[:, None] & r_mask[None, :], other=0.0)  # [BT, BR]
                shrunk += w * part.to(tl.float32)
            delta = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)  # apart from acc, which keeps the loads' layout
            for s in range(lo, hi + 1):  # a tile's tokens nearly always share one slot
                b = tl.load(b_ptr + s * stride_bs + cols[None, :] * stride_bh + offs_r[:, None] * stride_br,
                            mask=r_mask[:, None] & (cols < H)[None, :], other=0.0)  # [BR, BH]
                mine = tl.where((slot == s)[:, None], shrunk, 0.0)  # rows of other slots add exact zeros
                delta = tl.dot(mine.to(b.dtype), b, delta, input_precision=DOT_PRECISION)
            acc += delta
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows64 * stride_rt + cols[None, :], mask=mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64 * stride_ot + cols[None, :], out, mask=mask)


def moe_sum(y: torch.Tensor, lora=None, residual: torch.Tensor | None = None, *,
            blocks: dict | None = None) -> torch.Tensor:
    """[T, k, H] -> [T, H] in y's dtype, summed over k in fp32 (the j order fixed: deterministic). `lora`:
    (shrunk [T, k, R], topk_weights [T, k], token_slots [T], B [S, H, R]): adds each token's down expand of a B
    shared by all experts, sum_j w_j shrunk[t, j] @ B[slot]^T (token slot -1: nothing). `residual` [T, H] (y's
    dtype, last dim contiguous): returns residual + that sum, bit for bit torch's add of the two. `blocks`: launch
    settings over SUM_BLOCKS (one token per program) without `lora`, over SUM_LORA_BLOCKS with it."""
    T, k, H = y.shape
    if residual is not None and (residual.shape != (T, H) or residual.dtype != y.dtype or residual.stride(-1) != 1):
        raise ValueError(f"moe_sum: residual {tuple(residual.shape)} {residual.dtype} for a sum {(T, H)} {y.dtype}")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    res = (residual, residual.stride(0)) if residual is not None else (y, 0)
    if lora is None:
        blocks = {**SUM_BLOCKS, **(blocks or {})}
        moe_sum_kernel[(T, triton.cdiv(H, blocks["BLOCK_H"]))](
            y, out, y, y, y, y, res[0], T, H, 0, 0, y.stride(0), y.stride(1), out.stride(0), 0, 0, 0, 0, 0, 0, 0,
            res[1], TOP_K=k, HAS_LORA=False, HAS_RESIDUAL=residual is not None, BLOCK_T=1, BLOCK_R=16,
            DOT_PRECISION="ieee", **blocks)
        return out
    shrunk, weights, slots, B = lora
    S, R = B.shape[0], B.shape[2]
    blocks = {**SUM_LORA_BLOCKS, **(blocks or {})}
    grid = (triton.cdiv(T, blocks["BLOCK_T"]), triton.cdiv(H, blocks["BLOCK_H"]))
    moe_sum_kernel[grid](
        y, out, shrunk, weights, B, slots, res[0], T, H, R, S, y.stride(0), y.stride(1), out.stride(0),
        shrunk.stride(0), shrunk.stride(1), weights.stride(0), weights.stride(1), B.stride(0), B.stride(1),
        B.stride(2), res[1], TOP_K=k, HAS_LORA=True, HAS_RESIDUAL=residual is not None,
        BLOCK_R=max(16, triton.next_power_of_2(R)), DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",
        **blocks)
    return out


def _expert_stride(t: torch.Tensor) -> int:
    """Stride of a stacked factor's expert dim; 0 when it is 1 (one factor shared by all experts)."""
    return t.stride(1) if t.shape[1] > 1 else 0


def moe_lora_shrink(a, lora_A, align, *, rows_are_tokens, top_k, a_sorted=False, by_pair=False,
                    tiles=None, all_slots_max=ALL_SLOTS_MAX) -> torch.Tensor:
    """The per-block LoRA shrink a[rows] @ lora_A[slot, e]^T of every aligned block with adapter rows, in a's
    dtype (the expand rounds it to that anyway: same numbers, half the bytes): [blocks * BLOCK_M, R] by block
    row, or with `by_pair` [P, R] by pair id. Rows of blocks without an adapter are left unwritten. `tiles`:
    launch settings over MOE_SHRINK_TILES (MoeConfig.shrink_tiles); `all_slots_max`: the widest pass over a block's
    slots side by side (MoeConfig.all_slots_max)."""
    tiles = {**MOE_SHRINK_TILES, **(tiles or {})}
    R = lora_A.shape[2]
    BLOCK_R = max(16, triton.next_power_of_2(R))
    BM = align.block_m
    rows = align.num_pairs if by_pair else align.num_blocks * BM
    shrunk = torch.empty(rows, R, dtype=a.dtype, device=a.device)
    BLOCK_S = triton.next_power_of_2(lora_A.shape[0])  # adapter slots, padded
    all_slots = BLOCK_S * BLOCK_R <= all_slots_max
    moe_lora_shrink_kernel[(align.num_blocks,)](
        a, lora_A, shrunk, align.sorted_pairs, align.block_expert, align.num_padded, align.token_slots,
        align.block_slot_lo, align.block_slot_hi, a.shape[1], align.num_pairs, R, top_k,
        a.stride(0), a.stride(1), lora_A.stride(0), _expert_stride(lora_A), lora_A.stride(2), lora_A.stride(3),
        shrunk.stride(0), ROWS_ARE_TOKENS=rows_are_tokens, A_SORTED=a_sorted, BY_PAIR=by_pair, BLOCK_R=BLOCK_R,
        BLOCK_M=BM, BLOCK_K=shrink_block_k(BM, BLOCK_R, a.dtype, tiles["num_stages"], tiles["BLOCK_K"]),
        BLOCK_K_WIDE=shrink_block_k(BM, BLOCK_S * BLOCK_R if all_slots else BLOCK_R, a.dtype, tiles["num_stages"],
                                    tiles["BLOCK_K"]),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", ALL_SLOTS=all_slots, BLOCK_S=BLOCK_S,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    return shrunk


def moe_gemm(a, w, out, align, *, gated, rows_are_tokens, top_k, topk_weights=None, lora_B=None, shrunk=None,
             shrunk_by_token=False, bias=None, activation="silu", alpha=1.702, limit=7.0, config, w_tma=False,
             a_tma=False, a_sorted=False, out_sorted=False, expand_first=False, half_tail=False, pair_shrink=None):
    """Launch the grouped GEMM over every aligned block. Grids come from host-known sizes only, so the launches
    can be captured in a CUDA graph. LoRA: `lora_B` [S, Eb, N (gated: 2N), R] and the shrink `shrunk`, by block
    row [blocks * BLOCK_M, R] (moe_lora_shrink) or with `shrunk_by_token` by token [T, R] (an A shared by all
    experts: dense_lora_shrink); the expand steps over R in chunks where all of it would not fit shared memory
    (expand_rank_step). `pair_shrink` (not gated, no lora_B): (la [S, Ea, RS, K], out [P, RS]): N tile 0
    of each block also writes its rows' shrink a @ la[slot, e]^T by pair id (the adapter slots side by side: needs
    S * RS within ALL_SLOTS_MAX after padding). `config`: one GEMM's tiles (MoeConfig.tiles). Layout: `w_tma` /
    `a_tma` load w / a through TMA descriptors (see tma_ready; a_tma needs a_sorted), `a_sorted` reads a's rows by
    block row, `out_sorted` writes out's rows by block row. `expand_first`: the LoRA delta starts the accumulators
    (MoeConfig.expand_first); `half_tail`: blocks with pairs in their first half only compute that half
    (MoeConfig.half_tail; needs BLOCK_M >= 32 on a GPU)."""
    assert a_sorted or not a_tma, "a TMA descriptor reads a by block row: a_tma needs a_sorted"
    N = w.shape[1] // 2 if gated else w.shape[1]
    K = w.shape[2]
    BM = config["BLOCK_M"]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 stays fp32; 16-bit inputs ignore it
    if lora_B is not None:
        R = shrunk.shape[1]
        lora_args = (shrunk, lora_B, shrunk.stride(0), lora_B.stride(0), _expert_stride(lora_B), lora_B.stride(2),
                     lora_B.stride(3))
    else:
        R = 0
        lora_args = (a, a, 0, 0, 0, 0, 0)
    shrunk, lb, *lora_strides = lora_args
    if pair_shrink is not None:
        assert not gated and lora_B is None, "the pair shrink rides on the down GEMM without a LoRA expand"
        la, pair_shrunk = pair_shrink
        RS, BLOCK_S = la.shape[2], triton.next_power_of_2(la.shape[0])
        shrink_args = (la, pair_shrunk, RS, la.stride(0), _expert_stride(la), la.stride(2), la.stride(3),
                       pair_shrunk.stride(0))
    else:
        RS, BLOCK_S = 0, 1
        shrink_args = (a, a, 0, 0, 0, 0, 0, 0)
    BLOCK_RS = max(16, triton.next_power_of_2(RS))
    BLOCK_R = max(16, triton.next_power_of_2(R))
    if lora_B is not None or pair_shrink is not None:
        shrink_cols = BLOCK_S * BLOCK_RS if pair_shrink is not None else 0
        if lora_B is not None:  # the expand's rank step: all of it, or chunks where its operands would not fit
            BLOCK_R = expand_rank_step(config, gated, BLOCK_R, shrink_cols, a.element_size())
        config = dict(config, num_stages=gemm_stages(config, gated, BLOCK_R if lora_B is not None else 0, shrink_cols,
                                                     a.element_size()))
    grid = (align.num_blocks * triton.cdiv(N, config["BLOCK_N"]),)
    w_arg = TensorDescriptor.from_tensor(w, [1, config["BLOCK_N"], config["BLOCK_K"]]) if w_tma else w
    a_arg = TensorDescriptor.from_tensor(a, [BM, config["BLOCK_K"]]) if a_tma else a
    a_half = TensorDescriptor.from_tensor(a, [BM // 2, config["BLOCK_K"]]) if a_tma and half_tail else a_arg
    routing = (align.sorted_pairs, align.block_expert, align.num_padded,
               topk_weights if topk_weights is not None else a)
    lora = (shrunk, lb, *(t if t is not None else a for t in (align.token_slots, align.block_slot_lo,
                                                              align.block_slot_hi)))
    moe_gemm_kernel[grid](
        a_arg, a_half, w_arg, out, routing, lora, bias if bias is not None else a, tuple(shrink_args[:2]),
        N, K, align.num_pairs, R, shrink_args[2], top_k, align.num_blocks, (alpha, limit),
        (a.stride(0), a.stride(1)), (w.stride(0), w.stride(1), w.stride(2)), (out.stride(0), out.stride(1)),
        tuple(lora_strides), bias.stride(0) if bias is not None else 0, tuple(shrink_args[3:]),
        GATED=gated, ROWS_ARE_TOKENS=rows_are_tokens, W_TMA=w_tma, A_TMA=a_tma, A_SORTED=a_sorted,
        OUT_SORTED=out_sorted, MUL_WEIGHT=topk_weights is not None,
        HAS_LORA=lora_B is not None, HAS_BIAS=bias is not None, CLAMPED_SWIGLU=activation == "clamped_swiglu",
        BLOCK_R=BLOCK_R, DOT_PRECISION=precision, SHRUNK_BY_TOKEN=shrunk_by_token,
        EXPAND_FIRST=expand_first, HALF_TAIL=half_tail, PAIR_SHRINK=pair_shrink is not None, BLOCK_RS=BLOCK_RS,
        BLOCK_S=BLOCK_S, **config,
    )
    return out


def fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, lora=None, token_slots=None, config=None,
              lora_meta=None, *, gate_up_bias=None, down_bias=None, activation="silu", alpha=1.702, limit=7.0,
              residual=None):
    """Triton fused MoE (+ LoRA): same math and arguments as fused_moe_ref; [T, H] in x's dtype. `config`: a
    MoeConfig (pick_config's by default). `lora_meta`: the batch's rows grouped by slot (lora_meta.lora_metadata
    of token_slots), computed here when not given. `residual` [T, H]: returns residual + the layer's output,
    added inside the sum over k (moe_sum)."""
    # the kernels read these by flat index: a strided view (a column of a wider tensor, as expert parallel's received
    # (expert, slot) pairs are) would be misread, out of bounds; contiguous() is the tensor itself when it already is
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    token_slots = token_slots.contiguous() if token_slots is not None else None
    T, k = topk_ids.shape
    E, H, I = w_down.shape
    config = config or pick_config(T, k, E, x.dtype)
    BM = config.block_m
    num_slots = lora.gate_up_A.shape[0] if lora is not None else 0
    align = moe_align(topk_ids, E, BM, token_slots if lora is not None else None, num_slots)
    act_rows = align.num_blocks * BM if config.sorted_act else T * k
    act = torch.empty(act_rows, I, dtype=x.dtype, device=x.device)  # [P, I], or [NB * BM, I] in block order
    gate_up_lora, down_lora, sum_lora = {}, {}, None
    if lora is not None:
        if lora.gate_up_A.shape[1] == 1:  # gate_up A shared by all experts: shrink per token
            meta = lora_meta if lora_meta is not None else lora_metadata(token_slots, num_slots)
            shrunk = dense_lora_shrink(x, lora.gate_up_A[:, 0], meta, splits=1)[0]  # [T, R]: the GEMMs take one
            gate_up_lora = dict(shrunk=shrunk, shrunk_by_token=True)
        else:
            gate_up_lora = dict(shrunk=moe_lora_shrink(x, lora.gate_up_A, align, rows_are_tokens=True, top_k=k,
                                                       tiles=config.shrink_tiles("gate_up"),
                                                       all_slots_max=config.all_slots_max))
        gate_up_lora["lora_B"] = lora.gate_up_B
    if (config.gluon and config.sorted_act and gate_up_bias is None and activation == "silu"
            and moe_gemm_gluon.usable(x, w_gate_up, BM, gated=True)
            and (not gate_up_lora or lora.gate_up_B.shape[3] <= moe_gemm_gluon.MAX_EXPAND_RANK)):
        gluon_lora = (gate_up_lora["shrunk"], gate_up_lora["lora_B"], gate_up_lora.get("shrunk_by_token", False)) \
            if gate_up_lora else None
        moe_gemm_gluon.moe_gate_up_gluon(x, w_gate_up, act, align, k, gluon_lora)
    else:
        moe_gemm(x, w_gate_up, act, align, gated=True, rows_are_tokens=True, top_k=k, bias=gate_up_bias,
                 activation=activation, alpha=alpha, limit=limit, config=config.tiles("gate_up"),
                 w_tma=config.w_tma and tma_ready(w_gate_up), out_sorted=config.sorted_act,
                 expand_first=config.expand_first, half_tail=config.half_tail, **gate_up_lora)
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [P, H]
    if lora is not None:
        R_down = lora.down_A.shape[2]
        if lora.down_B.shape[1] == 1:  # down B shared by all experts: its expand goes into the sum over k
            side_by_side = triton.next_power_of_2(num_slots) * max(16, triton.next_power_of_2(R_down))
            if config.pair_shrink and side_by_side <= config.all_slots_max:
                shrunk = torch.empty(T * k, R_down, dtype=x.dtype, device=x.device)  # [P, R]: by the down GEMM
                down_lora = dict(pair_shrink=(lora.down_A, shrunk))
            else:
                shrunk = moe_lora_shrink(act, lora.down_A, align, rows_are_tokens=False, top_k=k,
                                         a_sorted=config.sorted_act, by_pair=True, tiles=config.shrink_tiles("down"),
                                         all_slots_max=config.all_slots_max)  # [P, R]
            sum_lora = (shrunk.view(T, k, R_down), topk_weights, token_slots, lora.down_B[:, 0])
        else:
            shrunk = moe_lora_shrink(act, lora.down_A, align, rows_are_tokens=False, top_k=k,
                                     a_sorted=config.sorted_act, tiles=config.shrink_tiles("down"),
                                     all_slots_max=config.all_slots_max)  # [blocks * BM, R]
            down_lora = dict(lora_B=lora.down_B, shrunk=shrunk)
    pair_shrink = down_lora.get("pair_shrink")
    expand = (down_lora["shrunk"], down_lora["lora_B"]) if "lora_B" in down_lora else None
    if (config.gluon and config.sorted_act and down_bias is None and moe_gemm_gluon.usable(act, w_down, BM, gated=False)
            and (pair_shrink is None or moe_gemm_gluon.pair_shrink_usable(act, pair_shrink[0]))
            and (expand is None or expand[1].shape[3] <= moe_gemm_gluon.MAX_EXPAND_RANK)):
        moe_gemm_gluon.moe_down_gluon(act, w_down, y, align, k, topk_weights.reshape(-1), expand, pair_shrink)
    else:
        moe_gemm(act, w_down, y, align, gated=False, rows_are_tokens=False, top_k=k,
                 topk_weights=topk_weights.reshape(-1), bias=down_bias, config=config.tiles("down"),
                 w_tma=config.w_tma and tma_ready(w_down), a_sorted=config.sorted_act,
                 a_tma=config.sorted_act and config.w_tma and tma_ready(act), expand_first=config.expand_first,
                 half_tail=config.half_tail, **down_lora)
    return moe_sum(y.view(T, k, H), sum_lora, residual)  # [T, H]
