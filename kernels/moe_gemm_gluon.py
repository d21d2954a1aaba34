"""Fused MoE's two grouped GEMMs as persistent Gluon kernels (Hopper), used when the activation is in block order
(MoeConfig.sorted_act, from 8192 tokens on), with their LoRA work: gate_up's expand, down's expand (per-expert B)
or pair shrink (B shared by all experts).

Shapes (BM = 128, the alignment's block rows; P = T * k pairs):
  gate_up: x [T, H], w_gate_up [E, 2I, H] (gate rows, then up rows) -> act [NB * BM, I] in block order,
           act[row] = silu(x[token] @ Wg[e]^T + d_g) * (x[token] @ Wu[e]^T + d_u)   (every row of a block;
           padding rows 0), LoRA delta [d_g, d_u] = shrunk[row or token] @ B[slot, e]^T (rows of no adapter: 0)
  down:    act [NB * BM, I], w_down [E, H, I], topk_weights [P] -> y [P, H] by pair id,
           y[pair] = topk_weights[pair] * (act[row] @ Wd[e]^T + shrunk[row] @ B[slot, e]^T);
           pair shrink: out [P, RS], out[pair] = act[row] @ A[slot, e]^T (moe_sum expands it with the shared B)
fp32 accumulation, one rounding: moe_gemm's numbers, bit for bit on an H100.
One CTA per SM loops over (block, N tile) tiles, a block's N tiles adjacent. Operand tiles fill a ring of
NUM_BUFFERS shared-memory buffers — weights (and down's activation) through TMA with an mbarrier per buffer,
gate_up's gathered token rows through cp.async (one commit group per step) — async wgmma consumes them, and the
next tile's first loads are issued while the current tile's last MMAs drain. LoRA expands start the accumulators
(their operands go through the ring buffer that is free at the tile's start: its last reader retired, its next
load not yet issued); down's pair shrink is one more wgmma per step on N tile 0 of a block, its LoRA A rows riding
in the ring. Epilogues: gate_up's activation tile leaves through a TMA store that overlaps the next tile; down's
routing-weighted rows go out as 16-byte rows by pair id (padding rows skipped), through the weight buffer the tile's
last step leaves free.
Faster than moe_gemm from 8192 tokens (BENCHMARKS-history 1, its ninth and later sessions; 18.2). Gluon does not run
in the Triton interpreter: moe_gemm is the CPU-tested path; the GPU tests check these kernels against it bit for bit and
against the torch references here, and the CPU suite compiles them for sm_90 (tests/kernels/test_sm90_compile.py).
"""

from __future__ import annotations

import torch

from .tiles import (GLUON_BLOCK_K, GLUON_BLOCK_M, GLUON_DOWN_BLOCK_N, GLUON_GATE_UP_BLOCK_N, GLUON_NUM_BUFFERS,
                    GLUON_NUM_WARPS, GLUON_PAIR_SHRINK_WIDE)
from .tma import tma_ready

try:  # Gluon ships with triton 3.6 (triton.experimental); older or partial installs fall back to moe_gemm
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

MAX_EXPAND_RANK = 32  # the LoRA expands' operands (gate and up ranks together) go through a free ring buffer:
# down's [2 * BN, rank] must fit one weight tile; gate_up's registers are full at 32


def moe_gate_up_ref(x: torch.Tensor, w_gate_up: torch.Tensor, align, top_k: int) -> torch.Tensor:
    """Plain torch, block by block: act [NB * BM, I] in block order (rows of no pair zero)."""
    I = w_gate_up.shape[1] // 2
    BM = align.block_m
    act = torch.zeros(align.num_blocks * BM, I, dtype=torch.float32, device=x.device)  # [NB * BM, I]
    for b in range(int(align.num_padded) // BM):
        pairs = align.sorted_pairs[b * BM:(b + 1) * BM].long()  # [BM]
        valid = pairs < align.num_pairs
        gate_up = x[pairs[valid] // top_k].float() @ w_gate_up[int(align.block_expert[b])].float().T  # [n, 2I]
        act[b * BM:(b + 1) * BM][valid] = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
    return act.to(x.dtype)


def moe_down_ref(act: torch.Tensor, w_down: torch.Tensor, align, topk_weights: torch.Tensor) -> torch.Tensor:
    """Plain torch, block by block: y [P, H] (rows of pairs in no block stay zero)."""
    y = torch.zeros(align.num_pairs, w_down.shape[1], dtype=torch.float32, device=act.device)  # [P, H]
    BM = align.block_m
    for b in range(int(align.num_padded) // BM):
        pairs = align.sorted_pairs[b * BM:(b + 1) * BM].long()  # [BM]
        valid = pairs < align.num_pairs
        rows = act[b * BM:(b + 1) * BM][valid].float() @ w_down[int(align.block_expert[b])].float().T  # [n, H]
        y[pairs[valid]] = rows * topk_weights[pairs[valid]].float()[:, None]
    return y.to(act.dtype)


def on_hopper(t: torch.Tensor) -> bool:
    """Whether t lives on a Hopper GPU (wgmma)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def usable(a: torch.Tensor, w: torch.Tensor, block_m: int, gated: bool) -> bool:
    """Whether these kernels can run the GEMM of input a [rows, K] and expert weights w [E, N, K] (gated: gate_up,
    N = 2I): Gluon present, a Hopper GPU (wgmma), 16-bit operands TMA / cp.async can read (contiguous, 16-byte
    aligned), the alignment's 128-row blocks, whole tiles along the outputs and K, a pipeline's worth of steps."""
    if not (HAVE_GLUON and on_hopper(a)):
        return False
    E, N, K = w.shape
    outputs, block_n = (N // 2, GLUON_GATE_UP_BLOCK_N) if gated else (N, GLUON_DOWN_BLOCK_N)
    return (a.dtype in (torch.bfloat16, torch.float16) and w.dtype == a.dtype and block_m == GLUON_BLOCK_M
            and outputs % block_n == 0 and K % GLUON_BLOCK_K == 0 and K // GLUON_BLOCK_K >= GLUON_NUM_BUFFERS - 1
            and a.is_contiguous() and w.is_contiguous() and tma_ready(a) and tma_ready(w))


def pair_shrink_usable(act: torch.Tensor, la: torch.Tensor) -> bool:
    """Whether the down kernel can compute the pair shrink act @ la[slot, e]^T (la [S, Ea, RS, K]): la contiguous in
    act's dtype (a TMA descriptor of its rows), its slots x padded rank within GLUON_PAIR_SHRINK_WIDE."""
    S, _, RS, _ = la.shape
    return (la.dtype == act.dtype and la.is_contiguous() and tma_ready(la)
            and S * max(16, 1 << (RS - 1).bit_length()) <= GLUON_PAIR_SHRINK_WIDE)


if HAVE_GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(block_m, block_n, num_warps):
        """The accumulator layout: one m64nNk16 wgmma per warpgroup, warpgroups stacked along M."""
        warps_m = max(4, min(num_warps, block_m // 16))
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
                                         instr_shape=[16, block_n // (num_warps // warps_m), 16])

    @gluon.jit
    def _ring_barriers(NUM_BUFFERS: gl.constexpr):
        """One initialised mbarrier per buffer of the operand ring."""
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        return bars

    @gluon.jit
    def _schedule(num_padded_ptr, BLOCK_M: gl.constexpr, NUM_N: gl.constexpr):
        """(tiles, this program's first tile, stride between its tiles, its tile count): tiles t = first + i * step."""
        num_tiles = gl.load(num_padded_ptr) // BLOCK_M * NUM_N
        first = gl.program_id(0)
        step = gl.num_programs(0)
        return num_tiles, first, step, gl.cdiv(gl.maximum(num_tiles - first, 0), step)

    @gluon.jit
    def _down_loads(producer, a_desc, w_desc, la_desc, off_m, w_row, la_row, shrink, k, bars, a_bufs, w_bufs,
                    la_bufs, NUM_BUFFERS: gl.constexpr, PAIR_SHRINK: gl.constexpr, pred=True):
        """TMA loads of step k's act tile [BM, BK] and weight tile [BN, BK] into buffer producer % NUM_BUFFERS; on a
        pair-shrink tile also the LoRA A rows [slots, BLOCK_RS, BK] of the tile's expert (la_row: its first row)."""
        index = producer % NUM_BUFFERS
        bar = bars.index(index)
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        if PAIR_SHRINK:  # (a box past the tensor, zero-filled, measured slower than none: 484 against 458 us)
            mbarrier.expect(bar, nbytes, pred=pred & ~shrink)
            mbarrier.expect(bar, nbytes + la_desc.block_type.nbytes, pred=pred & shrink)
            tma.async_copy_global_to_shared(la_desc, [0, la_row, k], bar, la_bufs.index(index), pred & shrink)
        else:
            mbarrier.expect(bar, nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_bufs.index(index), pred)
        return producer + 1

    @gluon.jit
    def _down_mma(consumer, acc, acc_s, use_acc, shrink, bars, a_bufs, w_bufs, la_bufs, NUM_BUFFERS: gl.constexpr,
                  PAIR_SHRINK: gl.constexpr):
        """Wait for buffer consumer % NUM_BUFFERS, retire the previous wgmmas (their buffer is refilled next), issue
        this step's async wgmma acc += act @ w^T and, on a pair-shrink tile, acc_s += act @ la^T."""
        index = consumer % NUM_BUFFERS
        mbarrier.wait(bars.index(index), (consumer // NUM_BUFFERS) & 1)
        a = a_bufs.index(index)
        if PAIR_SHRINK:
            acc, acc_s = warpgroup_mma_wait(0, (acc, acc_s))
            acc = warpgroup_mma(a, w_bufs.index(index).permute((1, 0)), acc, is_async=True, use_acc=use_acc)
            acc_s = warpgroup_mma_init(acc_s)  # the type an async wgmma gives, whether or not one is issued
            if shrink:
                la = la_bufs.index(index)._reinterpret(a.dtype, [acc_s.type.tensor_type.shape[1], a.shape[1]],
                                                      a_bufs.layout)  # [slots, BLOCK_RS, BK] as [WIDE, BK]
                acc_s = warpgroup_mma(a, la.permute((1, 0)), acc_s, is_async=True, use_acc=use_acc)
        else:
            acc = warpgroup_mma_wait(0, (acc, ))
            acc = warpgroup_mma(a, w_bufs.index(index).permute((1, 0)), acc, is_async=True, use_acc=use_acc)
        return consumer + 1, acc, acc_s

    @gluon.jit
    def _down_tile(t, num_tiles, block_expert_ptr, block_hi_ptr, la_expert_rows, NUM_N: gl.constexpr,
                   N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAIR_SHRINK: gl.constexpr):
        """(act row, row of the [E * N, K] weight view, block, N tile, expert, pair shrink, the expert's first LoRA
        A row) of tile t. A block's N tiles are adjacent, their order rotated by the block index so that N tile 0
        (the one that also computes the pair shrink of a block with adapter rows) falls to every program in turn; a
        t past the last tile reads expert 0 (its loads are predicated off)."""
        pid_m = t // NUM_N
        pid_n = (t + pid_m) % NUM_N
        live = t < num_tiles
        e = gl.load(block_expert_ptr + pid_m, mask=live, other=0)
        if PAIR_SHRINK:
            shrink = (pid_n == 0) & (gl.load(block_hi_ptr + pid_m, mask=live, other=-1) >= 0)
        else:
            shrink = pid_n < 0
        return pid_m * BLOCK_M, e * N + pid_n * BLOCK_N, pid_m, pid_n, e, shrink, e * la_expert_rows

    @gluon.jit
    def _pair_shrink_store(acc_s, tile_m, sorted_pairs_ptr, token_slots_ptr, out_ptr, P, top_k, RS, stride_om,
                           BLOCK_M: gl.constexpr, BLOCK_RS: gl.constexpr, WIDE: gl.constexpr, layout: gl.constexpr):
        """Each row's own slot's columns of acc_s [BM, WIDE] (the shrink of every slot side by side) into out
        [P, RS] by pair id: one column per output element, so no sum over slots; rows of no adapter are not
        written (moe_sum reads no shrink for them)."""
        offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BM]
        offs_c = gl.arange(0, WIDE, layout=gl.SliceLayout(0, layout))  # [WIDE]
        pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
        valid = pair < P
        slot = gl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)  # [BM]
        c_rank = offs_c % BLOCK_RS
        mine = gl.expand_dims(slot, 1) == gl.expand_dims(offs_c // BLOCK_RS, 0)  # [BM, WIDE]
        ptrs = out_ptr + gl.expand_dims(pair.to(gl.int64) * stride_om, 1) + gl.expand_dims(c_rank, 0)
        gl.store(ptrs, acc_s.to(out_ptr.dtype.element_ty), mask=mine & gl.expand_dims(c_rank < RS, 0)
                 & gl.expand_dims(valid, 1))

    @gluon.jit
    def _expand_pointers(tile_m, tile_n, e, sorted_pairs_ptr, token_slots_ptr, shrunk_ptr, lb_ptr, P, top_k, R,
                         stride_sm, stride_lbe, stride_lbn, stride_lbr, SHRUNK_BY_TOKEN: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
                         num_warps: gl.constexpr):
        """A LoRA expand's operands for a tile: (each row's slot, whether it is a pair, the rank mask [1, BR], the
        shrink rows' pointers [BM, BR] (by token or by block row), B[0, e]'s pointers [BN, BR] for the N tile)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_R // 8), BLOCK_R // 8], [num_warps, 1], [1, 0])
        offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BM]
        offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))  # [BN]
        offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, layout))  # [BR]
        pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
        valid = pair < P
        slot = gl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)  # [BM]
        if SHRUNK_BY_TOKEN:
            s_rows = (pair // top_k).to(gl.int64)
        else:
            s_rows = offs_m.to(gl.int64)
        s_ptrs = shrunk_ptr + gl.expand_dims(s_rows * stride_sm, 1) + gl.expand_dims(offs_r, 0)  # [BM, BR]
        b_ptrs = lb_ptr + e.to(gl.int64) * stride_lbe + gl.expand_dims(offs_n * stride_lbn, 1) \
            + gl.expand_dims(offs_r * stride_lbr, 0)  # [BN, BR]
        return slot, valid, gl.expand_dims(offs_r < R, 0), s_ptrs, b_ptrs

    @gluon.jit
    def _down_expand(acc, lora_smem, tile_m, tile_n, e, lo, hi, sorted_pairs_ptr, token_slots_ptr, shrunk_ptr, lb_ptr,
                     P, top_k, R, stride_sm, stride_lbs, stride_lbe, stride_lbn, stride_lbr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        """The tile's LoRA delta as the accumulator's starting value (moe_gemm's expand_first): for each adapter
        slot s of the block, its rows' shrink (others 0) @ B[s, e]^T, through lora_smem ([2 * BN, BR]: B's rows of
        the N tile, then the shrink rows by block row)."""
        slot, valid, r_mask, s_ptrs, b_ptrs = _expand_pointers(tile_m, tile_n, e, sorted_pairs_ptr, token_slots_ptr,
                                                               shrunk_ptr, lb_ptr, P, top_k, R, stride_sm, stride_lbe,
                                                               stride_lbn, stride_lbr, False, BLOCK_M, BLOCK_N,
                                                               BLOCK_R, num_warps)
        for s in range(lo, hi + 1):  # a block nearly always holds one slot
            shrunk = gl.load(s_ptrs, mask=gl.expand_dims(valid & (slot == s), 1) & r_mask, other=0.0)
            b = gl.load(b_ptrs + s * stride_lbs, mask=r_mask, other=0.0)
            gl.thread_barrier()  # both warpgroups' MMAs of the previous slot are done with lora_smem
            lora_smem.slice(0, BLOCK_N).store(b)
            lora_smem.slice(BLOCK_N, BLOCK_M).store(shrunk.to(lora_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(lora_smem.slice(BLOCK_N, BLOCK_M), lora_smem.slice(0, BLOCK_N).permute((1, 0)), acc,
                                is_async=True, use_acc=s > lo)
            acc = warpgroup_mma_wait(0, (acc, ))
        return acc

    @gluon.jit
    def _staged_store(half, stage, ptrs, row_mask, layout: gl.constexpr):
        """Store half [BM, BN / 2] to global memory in 16-byte rows through shared memory stage."""
        stage.store(half)
        gl.thread_barrier()
        gl.store(ptrs, stage.load(layout), mask=row_mask)
        gl.thread_barrier()  # every thread's reads done before the buffer is written again

    @gluon.jit(do_not_specialize=["P"])
    def moe_down_kernel(a_desc, w_desc, la_desc, y_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                        weight_ptr, token_slots_ptr, block_lo_ptr, block_hi_ptr, pair_shrunk_ptr, shrunk_ptr, lb_ptr,
                        P, top_k, RS, R, stride_ym, la_expert_rows, stride_psm, stride_sm, stride_lbs, stride_lbe,
                        stride_lbn, stride_lbr, N: gl.constexpr, K: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                        PAIR_SHRINK: gl.constexpr, WIDE: gl.constexpr, HAS_LORA: gl.constexpr,
                        BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        NUM_N: gl.constexpr = N // BLOCK_N
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
        s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, WIDE, num_warps)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte rows
        stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], dtype)
        gl.static_assert(K // BLOCK_K >= NUM_BUFFERS - 1, "the pipeline needs NUM_BUFFERS - 1 steps per tile")
        gl.static_assert(BLOCK_M * BLOCK_N // 2 <= BLOCK_N * BLOCK_K, "an epilogue half fits a weight buffer")
        gl.static_assert(2 * BLOCK_N * BLOCK_R <= BLOCK_N * BLOCK_K, "the LoRA operands fit a weight buffer")
        gl.static_assert(not (HAS_LORA and PAIR_SHRINK), "a per-expert down B, or the pair shrink of a shared one")
        lora_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_R], dtype)

        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
        if PAIR_SHRINK:  # every slot's LoRA A rows side by side: [slots, BLOCK_RS, BK] = [WIDE, BK] per step
            la_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + la_desc.block_type.shape, la_desc.layout)
            BLOCK_RS: gl.constexpr = la_desc.block_type.shape[1]
            gl.static_assert(la_desc.block_type.shape[0] * BLOCK_RS == WIDE, "the slots side by side are WIDE")
        else:
            la_bufs = a_bufs
            BLOCK_RS: gl.constexpr = 16
        bars = _ring_barriers(NUM_BUFFERS)
        num_tiles, first, step, my_tiles = _schedule(num_padded_ptr, BLOCK_M, NUM_N)
        producer = 0
        consumer = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # [BM, BN]
        acc_s = gl.zeros((BLOCK_M, WIDE), dtype=gl.float32, layout=s_layout)  # [BM, WIDE] the pair shrink

        # the first tile's first NUM_BUFFERS - 1 steps
        off_m, w_row, pid_m, pid_n, e, shrink, la_row = _down_tile(first, num_tiles, block_expert_ptr, block_hi_ptr,
                                                                   la_expert_rows, NUM_N, N, BLOCK_M, BLOCK_N,
                                                                   PAIR_SHRINK)
        for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 1), BLOCK_K):
            producer = _down_loads(producer, a_desc, w_desc, la_desc, off_m, w_row, la_row, shrink, kk, bars,
                                    a_bufs, w_bufs, la_bufs, NUM_BUFFERS, PAIR_SHRINK, my_tiles > 0)
        for idx in range(my_tiles):
            if HAS_LORA:  # the block's LoRA delta starts the accumulator (rows of no adapter start from 0); its
                # operands go through the weight buffer the next load fills (free since the last tile's epilogue)
                lo = gl.maximum(gl.load(block_lo_ptr + pid_m), 0)
                hi = gl.load(block_hi_ptr + pid_m)
                lora_smem = w_bufs.index(producer % NUM_BUFFERS)._reinterpret(dtype, [2 * BLOCK_N, BLOCK_R],
                                                                              lora_layout)
                acc = _down_expand(acc, lora_smem, pid_m, pid_n, e, lo, hi, sorted_pairs_ptr, token_slots_ptr,
                                   shrunk_ptr, lb_ptr, P, top_k, R, stride_sm, stride_lbs, stride_lbe, stride_lbn,
                                   stride_lbr, BLOCK_M, BLOCK_N, BLOCK_R, num_warps)
                first_use_acc = hi >= lo
            else:
                first_use_acc = False
            consumer, acc, acc_s = _down_mma(consumer, acc, acc_s, first_use_acc, shrink, bars, a_bufs, w_bufs,
                                             la_bufs, NUM_BUFFERS, PAIR_SHRINK)
            for k in range(BLOCK_K * (NUM_BUFFERS - 1), K, BLOCK_K):
                producer = _down_loads(producer, a_desc, w_desc, la_desc, off_m, w_row, la_row, shrink, k, bars,
                                        a_bufs, w_bufs, la_bufs, NUM_BUFFERS, PAIR_SHRINK)
                consumer, acc, acc_s = _down_mma(consumer, acc, acc_s, True, shrink, bars, a_bufs, w_bufs, la_bufs,
                                                 NUM_BUFFERS, PAIR_SHRINK)
            tile_m = pid_m
            tile_n = pid_n
            tile_shrink = shrink
            # the next tile's first steps load while this tile's last NUM_BUFFERS - 2 MMAs issue
            has_next = idx + 1 < my_tiles
            off_m, w_row, pid_m, pid_n, e, shrink, la_row = _down_tile(first + (idx + 1) * step, num_tiles,
                                                                       block_expert_ptr, block_hi_ptr,
                                                                       la_expert_rows, NUM_N, N, BLOCK_M, BLOCK_N,
                                                                       PAIR_SHRINK)
            for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 2), BLOCK_K):
                producer = _down_loads(producer, a_desc, w_desc, la_desc, off_m, w_row, la_row, shrink, kk, bars,
                                        a_bufs, w_bufs, la_bufs, NUM_BUFFERS, PAIR_SHRINK, has_next)
                consumer, acc, acc_s = _down_mma(consumer, acc, acc_s, True, tile_shrink, bars, a_bufs, w_bufs,
                                                 la_bufs, NUM_BUFFERS, PAIR_SHRINK)
            producer = _down_loads(producer, a_desc, w_desc, la_desc, off_m, w_row, la_row, shrink,
                                    BLOCK_K * (NUM_BUFFERS - 2), bars, a_bufs, w_bufs, la_bufs, NUM_BUFFERS,
                                    PAIR_SHRINK, has_next)
            if PAIR_SHRINK:
                acc, acc_s = warpgroup_mma_wait(0, (acc, acc_s))
                if tile_shrink:
                    _pair_shrink_store(acc_s, tile_m, sorted_pairs_ptr, token_slots_ptr, pair_shrunk_ptr, P, top_k,
                                       RS, stride_psm, BLOCK_M, BLOCK_RS, WIDE, s_layout)
            else:
                acc = warpgroup_mma_wait(0, (acc, ))
            # epilogue: the routing weight in the accumulator's layout (one rounding), then the rows by pair id in
            # two column halves through the weight buffer of this tile's last step (free until the next tile's
            # fourth load): 16-byte row stores, no layout-conversion scratch beside the ring
            rows = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))  # [BM]
            acc_pair = gl.load(sorted_pairs_ptr + rows)  # [BM]
            w = gl.load(weight_ptr + acc_pair, mask=acc_pair < P, other=0.0).to(gl.float32)  # [BM]
            out = (acc * gl.expand_dims(w, 1)).to(dtype)  # [BM, BN]
            left, right = gl.split(gl.permute(gl.reshape(out, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
            stage = w_bufs.index((consumer - 1) % NUM_BUFFERS)._reinterpret(dtype, [BLOCK_M, BLOCK_N // 2],
                                                                             stage_layout)
            offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))  # [BM]
            pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
            offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(0, out_layout))  # [BN / 2]
            ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_ym, 1) + gl.expand_dims(offs_n, 0)
            _staged_store(left, stage, ptrs, gl.expand_dims(pair < P, 1), out_layout)
            _staged_store(right, stage, ptrs + BLOCK_N // 2, gl.expand_dims(pair < P, 1), out_layout)
            fence_async_shared()  # the buffer's next writer is a TMA load
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _gate_up_loads(producer, a_ptrs, a_mask, w_desc, w_row, I, k, bars, a_bufs, g_bufs, u_bufs,
                       NUM_BUFFERS: gl.constexpr, pred=True):
        """Step k into buffer producer % NUM_BUFFERS: the block's gathered token rows by cp.async (one commit group
        per step), the gate and up weight tiles by TMA (the buffer's mbarrier)."""
        index = producer % NUM_BUFFERS
        bar = bars.index(index)
        async_copy.async_copy_global_to_shared(a_bufs.index(index), a_ptrs + k, mask=a_mask & pred)
        async_copy.commit_group()
        mbarrier.expect(bar, 2 * w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, g_bufs.index(index), pred)
        tma.async_copy_global_to_shared(w_desc, [w_row + I, k], bar, u_bufs.index(index), pred)
        return producer + 1

    @gluon.jit
    def _gate_up_mma(consumer, acc_g, acc_u, use_acc, bars, a_bufs, g_bufs, u_bufs, NUM_BUFFERS: gl.constexpr):
        """Wait for step consumer's rows (its cp.async group; every thread's, then visible to the async proxy) and
        weight tiles, retire the previous wgmmas, issue this step's gate and up wgmmas."""
        index = consumer % NUM_BUFFERS
        async_copy.wait_group(NUM_BUFFERS - 2)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(bars.index(index), (consumer // NUM_BUFFERS) & 1)
        acc_g, acc_u = warpgroup_mma_wait(0, (acc_g, acc_u))
        a = a_bufs.index(index)
        acc_g = warpgroup_mma(a, g_bufs.index(index).permute((1, 0)), acc_g, is_async=True, use_acc=use_acc)
        acc_u = warpgroup_mma(a, u_bufs.index(index).permute((1, 0)), acc_u, is_async=True, use_acc=use_acc)
        return consumer + 1, acc_g, acc_u

    @gluon.jit
    def _gate_up_tile(t, num_tiles, x_ptr, sorted_pairs_ptr, block_expert_ptr, P, top_k, stride_xm,
                      NUM_N: gl.constexpr, N2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, a_layout: gl.constexpr):
        """Tile t's block, N tile, gate row of the [E * 2I, H] weight view, and its token rows' pointers and mask
        ([BM, BK] at k = 0; padding rows and a t past the last tile load nothing)."""
        pid_m = t // NUM_N
        pid_n = t % NUM_N
        live = t < num_tiles
        e = gl.load(block_expert_ptr + pid_m, mask=live, other=0)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))  # [BM]
        pair = gl.load(sorted_pairs_ptr + offs_m, mask=live & (offs_m >= 0), other=P)  # [BM]
        rows = (pair // top_k).to(gl.int64)  # [BM] token rows
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))  # [BK]
        a_ptrs = x_ptr + gl.expand_dims(rows * stride_xm, 1) + gl.expand_dims(offs_k, 0)  # [BM, BK]
        a_mask = gl.expand_dims(pair < P, 1) & gl.expand_dims(offs_k >= 0, 0)  # [BM, BK]
        return pid_m, pid_n, e, e * N2 + pid_n * BLOCK_N, a_ptrs, a_mask

    @gluon.jit
    def _gate_up_expand(acc_g, acc_u, s_smem, g_smem, u_smem, tile_m, tile_n, e, lo, hi, sorted_pairs_ptr,
                        token_slots_ptr, shrunk_ptr, lb_ptr, P, top_k, R, I, stride_sm, stride_lbs, stride_lbe,
                        stride_lbn, stride_lbr, SHRUNK_BY_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        """The tile's LoRA delta as the accumulators' starting value (moe_gemm's expand_first): for each adapter
        slot s of the block, shrink rows of slot s (others 0) @ B[s, e]^T for gate and up, through s_smem [BM, BR]
        (the shrink rows), g_smem and u_smem [BN, BR] (gate and up B)."""
        slot, valid, r_mask, s_ptrs, b_ptrs = _expand_pointers(tile_m, tile_n, e, sorted_pairs_ptr, token_slots_ptr,
                                                               shrunk_ptr, lb_ptr, P, top_k, R, stride_sm, stride_lbe,
                                                               stride_lbn, stride_lbr, SHRUNK_BY_TOKEN, BLOCK_M,
                                                               BLOCK_N, BLOCK_R, num_warps)  # b_ptrs: gate rows
        for s in range(lo, hi + 1):  # a block nearly always holds one slot
            shrunk = gl.load(s_ptrs, mask=gl.expand_dims(valid & (slot == s), 1) & r_mask, other=0.0)
            shrunk = shrunk.to(s_smem.dtype)  # a float32 shrink (dense_lora_shrink's) rounds as moe_gemm's does
            b_gate = gl.load(b_ptrs + s * stride_lbs, mask=r_mask, other=0.0)
            b_up = gl.load(b_ptrs + s * stride_lbs + I * stride_lbn, mask=r_mask, other=0.0)
            gl.thread_barrier()  # both warpgroups' MMAs of the previous slot are done with the buffers
            s_smem.store(shrunk)
            g_smem.store(b_gate)
            u_smem.store(b_up)
            fence_async_shared()
            gl.thread_barrier()
            acc_g = warpgroup_mma(s_smem, g_smem.permute((1, 0)), acc_g, is_async=True, use_acc=s > lo)
            acc_u = warpgroup_mma(s_smem, u_smem.permute((1, 0)), acc_u, is_async=True, use_acc=s > lo)
            acc_g, acc_u = warpgroup_mma_wait(0, (acc_g, acc_u))  # the buffers are rewritten by the next slot
        return acc_g, acc_u

    @gluon.jit(do_not_specialize=["P"])
    def moe_gate_up_kernel(x_ptr, w_desc, out_desc, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr,
                           token_slots_ptr, block_lo_ptr, block_hi_ptr, shrunk_ptr, lb_ptr, P, top_k, R, stride_xm,
                           stride_sm, stride_lbs, stride_lbe, stride_lbn, stride_lbr, I: gl.constexpr,
                           K: gl.constexpr, NUM_BUFFERS: gl.constexpr, HAS_LORA: gl.constexpr,
                           SHRUNK_BY_TOKEN: gl.constexpr, BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
        NUM_N: gl.constexpr = I // BLOCK_N
        dtype: gl.constexpr = w_desc.dtype
        acc_layout: gl.constexpr = _wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
        a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte cp.async
        a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        gl.static_assert(K // BLOCK_K >= NUM_BUFFERS - 1, "the pipeline needs NUM_BUFFERS - 1 steps per tile")
        gl.static_assert(BLOCK_R <= BLOCK_K, "the LoRA operands borrow a ring buffer's [BM or BN, BK] tiles")
        lora_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_R], dtype)

        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], a_smem)
        g_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
        out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
        bars = _ring_barriers(NUM_BUFFERS)
        num_tiles, first, step, my_tiles = _schedule(num_padded_ptr, BLOCK_M, NUM_N)
        producer = 0
        consumer = 0
        acc_g = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # [BM, BN]
        acc_u = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # [BM, BN]

        # the first tile's first NUM_BUFFERS - 1 steps
        pid_m, pid_n, e, w_row, a_ptrs, a_mask = _gate_up_tile(first, num_tiles, x_ptr, sorted_pairs_ptr,
                                                            block_expert_ptr, P, top_k, stride_xm, NUM_N, 2 * I,
                                                            BLOCK_M, BLOCK_N, BLOCK_K, a_layout)
        for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 1), BLOCK_K):
            producer = _gate_up_loads(producer, a_ptrs, a_mask, w_desc, w_row, I, kk, bars, a_bufs, g_bufs, u_bufs,
                                      NUM_BUFFERS, my_tiles > 0)
        for idx in range(my_tiles):
            if HAS_LORA:  # the block's LoRA delta starts the accumulators (rows of no adapter start from 0)
                lo = gl.maximum(gl.load(block_lo_ptr + pid_m), 0)
                hi = gl.load(block_hi_ptr + pid_m)
                # its operands go through the ring buffer the next load fills (its last reader, the previous
                # tile's last MMA, is retired; the next load follows the first MMA's barrier), not through out_smem,
                # so that the previous tile's TMA store goes on under this tile
                free = producer % NUM_BUFFERS
                acc_g, acc_u = _gate_up_expand(
                    acc_g, acc_u, a_bufs.index(free)._reinterpret(dtype, [BLOCK_M, BLOCK_R], lora_layout),
                    g_bufs.index(free)._reinterpret(dtype, [BLOCK_N, BLOCK_R], lora_layout),
                    u_bufs.index(free)._reinterpret(dtype, [BLOCK_N, BLOCK_R], lora_layout), pid_m, pid_n, e, lo, hi,
                    sorted_pairs_ptr, token_slots_ptr, shrunk_ptr, lb_ptr, P, top_k, R, I, stride_sm, stride_lbs,
                    stride_lbe, stride_lbn, stride_lbr, SHRUNK_BY_TOKEN, BLOCK_M, BLOCK_N, BLOCK_R, num_warps)
                first_use_acc = hi >= lo
            else:
                first_use_acc = False
            consumer, acc_g, acc_u = _gate_up_mma(consumer, acc_g, acc_u, first_use_acc, bars, a_bufs, g_bufs,
                                                  u_bufs, NUM_BUFFERS)
            for k in range(BLOCK_K * (NUM_BUFFERS - 1), K, BLOCK_K):
                producer = _gate_up_loads(producer, a_ptrs, a_mask, w_desc, w_row, I, k, bars, a_bufs, g_bufs,
                                          u_bufs, NUM_BUFFERS)
                consumer, acc_g, acc_u = _gate_up_mma(consumer, acc_g, acc_u, True, bars, a_bufs, g_bufs, u_bufs,
                                                      NUM_BUFFERS)
            tile_m = pid_m
            tile_n = pid_n
            # the next tile's first steps load while this tile's last NUM_BUFFERS - 2 MMAs issue
            has_next = idx + 1 < my_tiles
            pid_m, pid_n, e, w_row, a_ptrs, a_mask = _gate_up_tile(first + (idx + 1) * step, num_tiles, x_ptr,
                                                                sorted_pairs_ptr, block_expert_ptr, P, top_k,
                                                                stride_xm, NUM_N, 2 * I, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                a_layout)
            for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 2), BLOCK_K):
                producer = _gate_up_loads(producer, a_ptrs, a_mask, w_desc, w_row, I, kk, bars, a_bufs, g_bufs,
                                          u_bufs, NUM_BUFFERS, has_next)
                consumer, acc_g, acc_u = _gate_up_mma(consumer, acc_g, acc_u, True, bars, a_bufs, g_bufs, u_bufs,
                                                      NUM_BUFFERS)
            producer = _gate_up_loads(producer, a_ptrs, a_mask, w_desc, w_row, I, BLOCK_K * (NUM_BUFFERS - 2), bars,
                                      a_bufs, g_bufs, u_bufs, NUM_BUFFERS, has_next)
            acc_g, acc_u = warpgroup_mma_wait(0, (acc_g, acc_u))
            # epilogue (moe_gemm's numbers): silu(gate) * up, one rounding; the tile leaves through a TMA store
            # that overlaps the next tile (waited for before its buffer is written again)
            h = (acc_g / (1.0 + gl.exp(-acc_g)) * acc_u).to(dtype)  # [BM, BN]
            tma.store_wait(0)
            out_smem.store(h)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [tile_m * BLOCK_M, tile_n * BLOCK_N], out_smem)
        tma.store_wait(0)
        async_copy.wait_group(0)
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.invalidate(bars.index(i))


def _num_sms(t: torch.Tensor) -> int:
    """Persistent programs: one per SM (one off CUDA, where a launch is only a compile check)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 1


def _dtype(t: torch.Tensor):
    return gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16


def moe_down_gluon(act: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, align, top_k: int,
                   topk_weights: torch.Tensor, lora=None, pair_shrink=None) -> torch.Tensor:
    """Launch the persistent down GEMM (module notes; needs usable(act, w_down, align.block_m, gated=False)) into
    y [P, H] by pair id. The grid comes from host-known sizes only, so the launch can be captured in a CUDA graph.
    `lora` = (shrunk [NB * BM, R] by block row (moe_lora_shrink), B [S, E, H, R]): the LoRA delta
    shrunk @ B[slot, e]^T added before the routing weight (R up to MAX_EXPAND_RANK). `pair_shrink` = (la
    [S, Ea, RS, K], out [P, RS]) (needs pair_shrink_usable), for a down B shared by all experts: N tile 0 of each
    block with adapter rows also writes its rows' down LoRA shrink act @ la[slot, e]^T by pair id (moe_gemm's
    pair_shrink; rows of no adapter are left unwritten)."""
    assert lora is None or pair_shrink is None, "a per-expert down B, or the pair shrink of a shared one"
    E, N, K = w_down.shape
    dt = _dtype(act)
    a_box, w_box = [GLUON_BLOCK_M, GLUON_BLOCK_K], [GLUON_DOWN_BLOCK_N, GLUON_BLOCK_K]
    a_desc = TensorDescriptor.from_tensor(act, a_box, gl.NVMMASharedLayout.get_default_for(a_box, dt))
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * N, K), w_box, gl.NVMMASharedLayout.get_default_for(w_box, dt))
    grid = (min(_num_sms(act), align.num_blocks * (N // GLUON_DOWN_BLOCK_N)),)
    la_desc, pair_shrunk, RS, shrink_strides = a_desc, act, 0, (0, 0)
    if pair_shrink is not None:
        la, pair_shrunk = pair_shrink
        S, Ea, RS, _ = la.shape
        BLOCK_RS = max(16, 1 << (RS - 1).bit_length())
        box = [GLUON_PAIR_SHRINK_WIDE // BLOCK_RS, BLOCK_RS, GLUON_BLOCK_K]  # every slot's rows of one expert
        la_desc = TensorDescriptor.from_tensor(la.view(S, Ea * RS, K), box,
                                               gl.NVMMASharedLayout.get_default_for(box, dt))
        shrink_strides = (RS if Ea > 1 else 0, pair_shrunk.stride(0))
    shrunk, B, R, expand_strides = act, act, 0, (0, 0, 0, 0, 0)
    if lora is not None:
        shrunk, B = lora
        assert B.shape[1] == E, "a per-expert down B (one shared by all experts takes the pair shrink)"
        R = B.shape[3]
        expand_strides = (shrunk.stride(0), B.stride(0), B.stride(1), B.stride(2), B.stride(3))
    slotted = lora is not None or pair_shrink is not None
    slots, lo, hi = (align.token_slots, align.block_slot_lo, align.block_slot_hi) if slotted else (act, act, act)
    moe_down_kernel[grid](a_desc, w_desc, la_desc, y, align.sorted_pairs, align.block_expert, align.num_padded,
                          topk_weights, slots, lo, hi, pair_shrunk, shrunk, B, align.num_pairs, top_k, RS, R,
                          y.stride(0), shrink_strides[0], shrink_strides[1], *expand_strides, N=N, K=K,
                          NUM_BUFFERS=GLUON_NUM_BUFFERS, PAIR_SHRINK=pair_shrink is not None,
                          WIDE=GLUON_PAIR_SHRINK_WIDE, HAS_LORA=lora is not None,
                          BLOCK_R=max(16, 1 << (R - 1).bit_length()), num_warps=GLUON_NUM_WARPS)
    return y


def moe_gate_up_gluon(x: torch.Tensor, w_gate_up: torch.Tensor, act: torch.Tensor, align, top_k: int,
                      lora=None) -> torch.Tensor:
    """Launch the persistent gate_up GEMM (module notes; needs usable(x, w_gate_up, align.block_m, gated=True))
    into act [NB * BM, I] in block order. `lora` = (shrunk, B, by_token): the LoRA delta
    shrunk @ B[slot, e]^T added before the activation, shrunk [NB * BM, R] by block row (moe_lora_shrink) or with
    by_token [T, R] by token (a gate_up A shared by all experts), B [S, Eb, 2I, R] (Eb = 1: shared)."""
    E, N2, K = w_gate_up.shape
    I = N2 // 2
    dt = _dtype(x)
    w_box, out_box = [GLUON_GATE_UP_BLOCK_N, GLUON_BLOCK_K], [GLUON_BLOCK_M, GLUON_GATE_UP_BLOCK_N]
    w_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * N2, K), w_box,
                                          gl.NVMMASharedLayout.get_default_for(w_box, dt))
    out_desc = TensorDescriptor.from_tensor(act, out_box, gl.NVMMASharedLayout.get_default_for(out_box, dt))
    grid = (min(_num_sms(x), align.num_blocks * (I // GLUON_GATE_UP_BLOCK_N)),)
    if lora is not None:
        shrunk, B, by_token = lora
        R = B.shape[3]
        lora_args = (align.token_slots, align.block_slot_lo, align.block_slot_hi, shrunk, B, R)
        strides = (shrunk.stride(0), B.stride(0), B.stride(1) if B.shape[1] > 1 else 0, B.stride(2), B.stride(3))
    else:
        by_token, R = False, 0
        lora_args = (x, x, x, x, x, 0)
        strides = (0, 0, 0, 0, 0)
    slots, lo, hi, shrunk, B, R = lora_args
    moe_gate_up_kernel[grid](x, w_desc, out_desc, align.sorted_pairs, align.block_expert, align.num_padded, slots, lo,
                             hi, shrunk, B, align.num_pairs, top_k, R, x.stride(0), *strides, I=I, K=K,
                             NUM_BUFFERS=GLUON_NUM_BUFFERS, HAS_LORA=lora is not None, SHRUNK_BY_TOKEN=by_token,
                             BLOCK_R=max(16, 1 << (R - 1).bit_length()), num_warps=GLUON_NUM_WARPS)
    return act
