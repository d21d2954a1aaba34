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

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .linear import ROWS, linear_ref


ACTIVATIONS = ("silu", "clamped_swiglu")


def activation_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """The expert activation of gate and up [n, I] -> [n, I] (see the module notes)."""
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(alpha * gate))


def _blocked_activation(gate_up: torch.Tensor, I: int, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """activation_ref of gate_up [n, 2I] with gate and up first copied into contiguous whole ROWS-row blocks, so
    that every row goes through the same vectorised CPU code whatever n is (elementwise kernels compute a short
    tail or a strided view with other code, a few ulps apart): the reference stays batch-invariant."""
    n = gate_up.shape[0]
    padded = -(-n // ROWS) * ROWS
    gate = gate_up.new_zeros(padded, I)  # [n', I]
    up = gate_up.new_zeros(padded, I)  # [n', I]
    gate[:n], up[:n] = gate_up[:, :I], gate_up[:, I:]
    return activation_ref(gate, up, activation, alpha, limit)[:n]  # [n, I]


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
        act = _blocked_activation(gate_up, I, activation, alpha, limit)  # [n, I]
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
# A block whose pairs have no adapter adds nothing.
# ---------------------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from .dense_lora import dense_lora_shrink, lora_metadata  # noqa: E402
from .moe_align import moe_align  # noqa: E402

@dataclass(frozen=True)
class MoeConfig:
    """Launch settings of one fused MoE call. `block_m` is shared (one alignment serves both GEMMs); `gate_up`
    and `down` hold each GEMM's BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages. `w_tma`: the expert weights
    load through TMA tensor descriptors; `sorted_act`: the gate_up GEMM writes the activation in block order
    and the down GEMM reads it by block row (through a descriptor too when `w_tma`). Both fall back to
    pointer loads where TMA is not available (before Hopper, or a tensor TMA cannot describe). `expand_first`: the
    GEMMs add the LoRA delta into their accumulators before the main loop instead of after it."""
    block_m: int
    gate_up: dict
    down: dict
    w_tma: bool = False
    sorted_act: bool = False
    expand_first: bool = False

    def tiles(self, gemm: str) -> dict:
        return dict(BLOCK_M=self.block_m, **getattr(self, gemm))


def _tiles(n, k, warps, stages, group_m=8):
    return dict(BLOCK_N=n, BLOCK_K=k, GROUP_M=group_m, num_warps=warps, num_stages=stages)


# By pairs per expert (T * k / E): the fastest per GEMM of the tile x layout sweep on an H100 at Qwen3-30B-A3B
# shapes (benchmarks/moe_tiles.py; BENCHMARKS.md section 1). TMA weights paid from 1024 tokens on (down) and
# 2048 (gate_up); the block-ordered activation from 8192 on. The LoRA expand before the main loop paid with the
# 64-row blocks only (LoRA overhead 1.106 / 1.089 against 1.126 / 1.106 at 1024 tokens, 4 adapters mixed / one;
# within the noise at 4096 and above: benchmarks/moe_lora_variants.py).
CONFIGS = {
    16: MoeConfig(16, gate_up=_tiles(128, 128, 8, 4), down=_tiles(128, 128, 8, 4)),
    64: MoeConfig(64, gate_up=_tiles(64, 64, 4, 3), down=_tiles(128, 64, 4, 4), w_tma=True, expand_first=True),
    256: MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True),
    None: MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True, sorted_act=True),
}


def pick_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> MoeConfig:
    pairs_per_expert = num_tokens * top_k / num_experts
    limit = next((n for n in CONFIGS if n is not None and pairs_per_expert <= n), None)
    config = CONFIGS[limit]
    if dtype == torch.float32:  # 4-byte tiles: halve the K step and the pipeline depth to fit shared memory
        fp32 = {gemm: {**getattr(config, gemm), "BLOCK_K": min(getattr(config, gemm)["BLOCK_K"], 32), "num_stages": 2}
                for gemm in ("gate_up", "down")}
        config = replace(config, **fp32)
    return config


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe `t`: Hopper or later (or the interpreter), unit last stride,
    16-byte aligned base and strides."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))


SHRINK_SMEM = 160 * 1024  # bytes for the LoRA shrink's pipelined tiles: stages x (BLOCK_M + BLOCK_R) x BLOCK_K
SHRINK_WARPS, SHRINK_STAGES = 4, 3


# The per-block LoRA shrink computes a block's adapter slots side by side in one pass over K (BLOCK_S * BLOCK_R
# columns, each row keeping its own slot's) while that is at most ALL_SLOTS_MAX wide, else one pass per slot; a
# block of one slot (most blocks at large M) always takes the one narrow pass.
# H100, Qwen3-30B-A3B shapes, 4 adapters (benchmarks/moe_lora_variants.py): LoRA overhead 1.071-1.117 against
# 1.085-1.126 one pass per slot. The same side-by-side trick for the expand measured slower at every M
# (1.076-1.405 against 1.071-1.117): blocks of large M hold one or two slots, and the wide dot costs more there.
ALL_SLOTS_MAX = 128


def shrink_block_k(block_m: int, block_r: int, dtype: torch.dtype) -> int:
    """The LoRA shrink kernel's step over the input features: as long as fits SHRINK_SMEM (at most 256), so
    that the few latency-bound K iterations per slot stay few."""
    size = 4 if dtype == torch.float32 else 2
    return next((bk for bk in (256, 128, 64, 32) if SHRINK_STAGES * (block_m + block_r) * bk * size <= SHRINK_SMEM),
                16)


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
def _lora_expand(acc, acc_up, first, first_b, first_b_up, shrunk_ptrs, lb_ptr, slot, valid, lo, hi, e, offs_n, n_mask,
                 r_mask, N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr, GATED: tl.constexpr,
                 BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The block's LoRA delta into its accumulators: the first slot's shrink rows and B tiles as loaded before the
    main loop, further slots (a block at a slot boundary) loaded here. Rows of no adapter add exact zeros."""
    if hi >= lo:
        acc = tl.dot(first.to(first_b.dtype), first_b, acc, input_precision=DOT_PRECISION)
        if GATED:
            acc_up = tl.dot(first.to(first_b.dtype), first_b_up, acc_up, input_precision=DOT_PRECISION)
        for s in range(lo + 1, hi + 1):
            shrunk = tl.load(shrunk_ptrs, mask=(valid & (slot == s))[:, None] & r_mask[None, :], other=0.0)
            lb = lb_ptr + s * stride_lbs + e * stride_lbe
            acc = _expand(acc, shrunk, lb, offs_n, n_mask, R, stride_lbn, stride_lbr, BLOCK_R, DOT_PRECISION)
            if GATED:
                acc_up = _expand(acc_up, shrunk, lb + N * stride_lbn, offs_n, n_mask, R, stride_lbn, stride_lbr,
                                 BLOCK_R, DOT_PRECISION)
    return acc, acc_up


@triton.jit
def moe_lora_shrink_kernel(
    a_ptr, la_ptr, shrunk_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, token_slots_ptr, block_lo_ptr,
    block_hi_ptr, K, P, R, top_k,
    stride_am, stride_ak, stride_las, stride_lae, stride_lar, stride_lak, stride_sm,
    ROWS_ARE_TOKENS: tl.constexpr, A_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_K_WIDE: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, ALL_SLOTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """shrunk[block rows] = a[rows] @ A[slot of the row, e]^T for one aligned block; blocks without an adapter are
    skipped (their rows are never read). ALL_SLOTS: a block with several slots computes them side by side in one
    pass over K (BLOCK_S * BLOCK_R columns) and each row keeps its own slot's; else (and for a block of one slot,
    the common case at large M) one pass per slot in the block. One program per aligned block: slicing blocks
    into 16-64-row programs measured slower (benchmarks/moe_lora_variants.py, BENCHMARKS.md section 1)."""
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
    tl.store(shrunk_ptr + offs_m[:, None] * stride_sm + offs_r[None, :], acc.to(shrunk_ptr.dtype.element_ty),
             mask=(offs_r < R)[None, :])


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, topk_weight_ptr,
    shrunk_ptr, lb_ptr, token_slots_ptr, block_lo_ptr, block_hi_ptr, bias_ptr,
    N, K, P, R, top_k, num_blocks, alpha, limit,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_sm, stride_lbs, stride_lbe, stride_lbn, stride_lbr, stride_be,
    GATED: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr,
    A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, EXPAND_FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, SHRUNK_BY_TOKEN: tl.constexpr,
):
    """out[pair, n] for the pairs of one aligned block and BLOCK_N output columns (see module notes).
    GATED: w rows [0, N) are gate and [N, 2N) up; the output is silu(gate) * up (CLAMPED_SWIGLU: GPT-OSS's form).
    HAS_BIAS: bias [E, N] (GATED: [E, 2N]) added before the activation / the routing weight.
    SHRUNK_BY_TOKEN: the LoRA shrink is indexed by token row (A shared by all experts) instead of by block row.
    EXPAND_FIRST: the LoRA delta goes into the accumulators before the main loop instead of after it.
    A_SORTED: a's rows are block rows (a written in block order by OUT_SORTED, every row of a run block written).
    W_TMA / A_TMA: w_ptr / a_ptr are tensor descriptors (blocks [1, BLOCK_N, BLOCK_K] / [BLOCK_M, BLOCK_K])."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
                                       hi, e, offs_n, n_mask, r_mask, N, R, stride_lbs, stride_lbe, stride_lbn,
                                       stride_lbr, GATED, BLOCK_R, DOT_PRECISION)
    e32 = e.to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        if A_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            a_ptrs += BLOCK_K * stride_ak
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
                                   e, offs_n, n_mask, r_mask, N, R, stride_lbs, stride_lbe, stride_lbn, stride_lbr,
                                   GATED, BLOCK_R, DOT_PRECISION)
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
    if OUT_SORTED:  # every row of the block, padding included, so that A_SORTED reads only written rows
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:
        out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


SUM_BLOCK_H = 1024  # columns per program of the sum over k


@triton.jit
def moe_sum_kernel(y_ptr, out_ptr, H, top_k, stride_yt, stride_yj, stride_ot, BLOCK_H: tl.constexpr):
    """out[t] = sum_j y[t, j] in fp32, stored in out's dtype: one read of y, one write of out."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):
        acc += tl.load(y_ptr + t * stride_yt + j * stride_yj + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(y: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H] in y's dtype, summed over k in fp32 (the j order fixed: deterministic)."""
    T, k, H = y.shape
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    moe_sum_kernel[(T, triton.cdiv(H, SUM_BLOCK_H))](y, out, H, k, y.stride(0), y.stride(1), out.stride(0),
                                                     BLOCK_H=SUM_BLOCK_H, num_warps=4)
    return out


def _expert_stride(t: torch.Tensor) -> int:
    """Stride of a stacked factor's expert dim; 0 when it is 1 (one factor shared by all experts)."""
    return t.stride(1) if t.shape[1] > 1 else 0


def moe_gemm(a, w, out, align, *, gated, rows_are_tokens, top_k, topk_weights=None, lora_A=None, lora_B=None,
             token_shrunk=None, bias=None, activation="silu", alpha=1.702, limit=7.0, config, w_tma=False,
             a_tma=False, a_sorted=False, out_sorted=False, expand_first=False):
    """Launch the grouped GEMM (and, with LoRA, its shrink) over every aligned block. Grids come from
    host-known sizes only, so the launches can be captured in a CUDA graph. `token_shrunk` [T, R]: the
    shrink already done per token (an A shared by all experts), so no per-pair shrink runs. `config`: one GEMM's
    tiles (MoeConfig.tiles). Layout: `w_tma` / `a_tma` load w / a through TMA descriptors (see tma_ready; a_tma
    needs a_sorted), `a_sorted` reads a's rows by block row, `out_sorted` writes out's rows by block row.
    `expand_first`: the LoRA delta starts the accumulators (MoeConfig.expand_first)."""
    assert a_sorted or not a_tma, "a TMA descriptor reads a by block row: a_tma needs a_sorted"
    N = w.shape[1] // 2 if gated else w.shape[1]
    K = w.shape[2]
    BM = config["BLOCK_M"]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 stays fp32; 16-bit inputs ignore it
    if token_shrunk is not None:
        R = token_shrunk.shape[1]
        BLOCK_R = max(16, triton.next_power_of_2(R))
        lora = (token_shrunk, lora_B, token_shrunk.stride(0), lora_B.stride(0), _expert_stride(lora_B),
                lora_B.stride(2), lora_B.stride(3))
    elif lora_A is not None:
        R = lora_A.shape[2]
        BLOCK_R = max(16, triton.next_power_of_2(R))
        # [blocks*BM, R] in a's dtype: the expand rounds the shrink to the weights' dtype anyway
        shrunk = torch.empty(align.num_blocks * BM, R, dtype=a.dtype, device=a.device)
        BLOCK_S = triton.next_power_of_2(lora_A.shape[0])  # adapter slots, padded
        all_slots = BLOCK_S * BLOCK_R <= ALL_SLOTS_MAX
        moe_lora_shrink_kernel[(align.num_blocks,)](
            a, lora_A, shrunk, align.sorted_pairs, align.block_expert, align.num_padded, align.token_slots,
            align.block_slot_lo, align.block_slot_hi, K, align.num_pairs, R, top_k,
            a.stride(0), a.stride(1), lora_A.stride(0), _expert_stride(lora_A), lora_A.stride(2), lora_A.stride(3),
            shrunk.stride(0), ROWS_ARE_TOKENS=rows_are_tokens, A_SORTED=a_sorted, BLOCK_R=BLOCK_R, BLOCK_M=BM,
            BLOCK_K=shrink_block_k(BM, BLOCK_R, a.dtype),
            BLOCK_K_WIDE=shrink_block_k(BM, BLOCK_S * BLOCK_R if all_slots else BLOCK_R, a.dtype),
            DOT_PRECISION=precision, ALL_SLOTS=all_slots, BLOCK_S=BLOCK_S, num_warps=SHRINK_WARPS,
            num_stages=SHRINK_STAGES)
        lora = (shrunk, lora_B, shrunk.stride(0), lora_B.stride(0), _expert_stride(lora_B), lora_B.stride(2),
                lora_B.stride(3))
    else:
        R, BLOCK_R = 0, 16
        lora = (a, a, 0, 0, 0, 0, 0)
    shrunk, lb, *lora_strides = lora
    grid = (align.num_blocks * triton.cdiv(N, config["BLOCK_N"]),)
    w_arg = TensorDescriptor.from_tensor(w, [1, config["BLOCK_N"], config["BLOCK_K"]]) if w_tma else w
    a_arg = TensorDescriptor.from_tensor(a, [BM, config["BLOCK_K"]]) if a_tma else a
    moe_gemm_kernel[grid](
        a_arg, w_arg, out, align.sorted_pairs, align.block_expert, align.num_padded,
        topk_weights if topk_weights is not None else a,
        shrunk, lb, *(t if t is not None else a for t in (align.token_slots, align.block_slot_lo, align.block_slot_hi)),
        bias if bias is not None else a,
        N, K, align.num_pairs, R, top_k, align.num_blocks, alpha, limit,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        *lora_strides, bias.stride(0) if bias is not None else 0,
        GATED=gated, ROWS_ARE_TOKENS=rows_are_tokens, W_TMA=w_tma, A_TMA=a_tma, A_SORTED=a_sorted,
        OUT_SORTED=out_sorted, MUL_WEIGHT=topk_weights is not None,
        HAS_LORA=lora_B is not None, HAS_BIAS=bias is not None, CLAMPED_SWIGLU=activation == "clamped_swiglu",
        BLOCK_R=BLOCK_R, DOT_PRECISION=precision, SHRUNK_BY_TOKEN=token_shrunk is not None,
        EXPAND_FIRST=expand_first, **config,
    )
    return out


def fused_moe(x, topk_ids, topk_weights, w_gate_up, w_down, lora=None, token_slots=None, config=None,
              lora_meta=None, *, gate_up_bias=None, down_bias=None, activation="silu", alpha=1.702, limit=7.0):
    """Triton fused MoE (+ LoRA): same math and arguments as fused_moe_ref; [T, H] in x's dtype. `config`: a
    MoeConfig (pick_config's by default). `lora_meta`: the batch's rows grouped by slot (dense_lora.lora_metadata
    of token_slots), computed here when not given."""
    T, k = topk_ids.shape
    E, H, I = w_down.shape
    config = config or pick_config(T, k, E, x.dtype)
    BM = config.block_m
    num_slots = lora.gate_up_A.shape[0] if lora is not None else 0
    align = moe_align(topk_ids, E, BM, token_slots if lora is not None else None, num_slots)
    act_rows = align.num_blocks * BM if config.sorted_act else T * k
    act = torch.empty(act_rows, I, dtype=x.dtype, device=x.device)  # [P, I], or [NB * BM, I] in block order
    token_shrunk = None
    if lora is not None and lora.gate_up_A.shape[1] == 1:  # gate_up A shared by all experts: shrink per token
        meta = lora_meta if lora_meta is not None else lora_metadata(token_slots, num_slots)
        token_shrunk = dense_lora_shrink(x, lora.gate_up_A[:, 0], meta)  # [T, R]
    moe_gemm(x, w_gate_up, act, align, gated=True, rows_are_tokens=True, top_k=k,
             lora_A=lora.gate_up_A if lora is not None else None, lora_B=lora.gate_up_B if lora is not None else None,
             token_shrunk=token_shrunk, bias=gate_up_bias, activation=activation, alpha=alpha, limit=limit,
             config=config.tiles("gate_up"), w_tma=config.w_tma and tma_ready(w_gate_up),
             out_sorted=config.sorted_act, expand_first=config.expand_first)
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [P, H]
    moe_gemm(act, w_down, y, align, gated=False, rows_are_tokens=False, top_k=k,
             topk_weights=topk_weights.reshape(-1), lora_A=lora.down_A if lora is not None else None,
             lora_B=lora.down_B if lora is not None else None, bias=down_bias, config=config.tiles("down"),
             w_tma=config.w_tma and tma_ready(w_down), a_sorted=config.sorted_act,
             a_tma=config.sorted_act and config.w_tma and tma_ready(act), expand_first=config.expand_first)
    return moe_sum(y.view(T, k, H))  # [T, H]
