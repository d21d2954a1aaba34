"""Fused MoE's two grouped GEMMs as persistent Gluon kernels (Hopper), used when the activation is in block order
(MoeConfig.sorted_act, from 8192 tokens on): gate_up with or without its LoRA expand, down without LoRA work.

Shapes (BM = 128, the alignment's block rows; P = T * k pairs):
  gate_up: x [T, H], w_gate_up [E, 2I, H] (gate rows, then up rows) -> act [NB * BM, I] in block order,
           act[row] = silu(x[token] @ Wg[e]^T + d_g) * (x[token] @ Wu[e]^T + d_u)   (every row of a block;
           padding rows 0), LoRA delta [d_g, d_u] = shrunk[row or token] @ B[slot, e]^T (rows of no adapter: 0)
  down:    act [NB * BM, I], w_down [E, H, I], topk_weights [P] -> y [P, H] by pair id,
           y[pair] = topk_weights[pair] * (act[row] @ Wd[e]^T)
fp32 accumulation, one rounding: moe_gemm's numbers, bit for bit on an H100.
One CTA per SM loops over (block, N tile) tiles, a block's N tiles adjacent. Operand tiles fill a ring of
NUM_BUFFERS shared-memory buffers — weights (and down's activation) through TMA with an mbarrier per buffer,
gate_up's gathered token rows through cp.async (one commit group per step) — async wgmma consumes them, and the
next tile's first loads are issued while the current tile's last MMAs drain. Epilogues: gate_up's activation tile
leaves through a TMA store that overlaps the next tile; down's routing-weighted rows go out as 16-byte rows by pair
id (padding rows skipped).
H100, Qwen3-30B-A3B shapes (benchmarks/gluon_moe_gemm.py, BENCHMARKS.md section 1): gate_up 809 against moe_gemm's
843 us, down 418 against 453 at 8192 tokens. Gluon does not run in the Triton interpreter: moe_gemm is the
CPU-tested path; the GPU tests check these kernels against it bit for bit and against the torch references here,
and the CPU suite compiles them for sm_90 (tests/kernels/test_sm90_compile.py).
"""

from __future__ import annotations

import torch

from .tma import tma_ready

try:  # Gluon ships with triton 3.6 (triton.experimental); older or partial installs fall back to moe_gemm
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BLOCK_M, BLOCK_K, NUM_BUFFERS, NUM_WARPS = 128, 64, 4, 8  # BLOCK_M: the alignment's block rows
GATE_UP_BLOCK_N, DOWN_BLOCK_N = 128, 256  # gate_up holds two accumulators (gate, up)
MAX_EXPAND_RANK = 32  # gate_up's LoRA operands borrow its output tile's shared memory: [4 * BM, rank] must fit


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
    outputs, block_n = (N // 2, GATE_UP_BLOCK_N) if gated else (N, DOWN_BLOCK_N)
    return (a.dtype in (torch.bfloat16, torch.float16) and w.dtype == a.dtype and block_m == BLOCK_M
            and outputs % block_n == 0 and K % BLOCK_K == 0 and K // BLOCK_K >= NUM_BUFFERS - 1
            and a.is_contiguous() and w.is_contiguous() and tma_ready(a) and tma_ready(w))


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
    def _down_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr,
                    pred=True):
        """TMA loads of step k's act tile [BM, BK] and weight tile [BN, BK] into buffer producer % NUM_BUFFERS."""
        index = producer % NUM_BUFFERS
        bar = bars.index(index)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_bufs.index(index), pred)
        return producer + 1

    @gluon.jit
    def _down_mma(consumer, acc, use_acc, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr):
        """Wait for buffer consumer % NUM_BUFFERS, retire the previous wgmma (its buffer is refilled next), issue
        this step's async wgmma acc += act @ w^T."""
        index = consumer % NUM_BUFFERS
        mbarrier.wait(bars.index(index), (consumer // NUM_BUFFERS) & 1)
        acc = warpgroup_mma_wait(0, (acc, ))
        acc = warpgroup_mma(a_bufs.index(index), w_bufs.index(index).permute((1, 0)), acc, is_async=True,
                            use_acc=use_acc)
        return consumer + 1, acc

    @gluon.jit
    def _down_tile(t, num_tiles, block_expert_ptr, NUM_N: gl.constexpr, N: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """(act row, row of the [E * N, K] weight view, block, N tile) of tile t (a block's N tiles adjacent); a
        t past the last tile reads expert 0 (its loads are predicated off)."""
        pid_m = t // NUM_N
        pid_n = t % NUM_N
        e = gl.load(block_expert_ptr + pid_m, mask=t < num_tiles, other=0)
        return pid_m * BLOCK_M, e * N + pid_n * BLOCK_N, pid_m, pid_n

    @gluon.jit
    def moe_down_kernel(a_desc, w_desc, y_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, weight_ptr, P,
                        stride_ym, N: gl.constexpr, K: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                        num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        NUM_N: gl.constexpr = N // BLOCK_N
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # 16-byte rows
        gl.static_assert(K // BLOCK_K >= NUM_BUFFERS - 1, "the pipeline needs NUM_BUFFERS - 1 steps per tile")

        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS] + w_desc.block_type.shape, w_desc.layout)
        bars = _ring_barriers(NUM_BUFFERS)
        num_tiles, first, step, my_tiles = _schedule(num_padded_ptr, BLOCK_M, NUM_N)
        producer = 0
        consumer = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # [BM, BN]

        # the first tile's first NUM_BUFFERS - 1 steps
        off_m, w_row, pid_m, pid_n = _down_tile(first, num_tiles, block_expert_ptr, NUM_N, N, BLOCK_M, BLOCK_N)
        for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 1), BLOCK_K):
            producer = _down_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs, NUM_BUFFERS,
                                    my_tiles > 0)
        for idx in range(my_tiles):
            consumer, acc = _down_mma(consumer, acc, False, bars, a_bufs, w_bufs, NUM_BUFFERS)
            for k in range(BLOCK_K * (NUM_BUFFERS - 1), K, BLOCK_K):
                producer = _down_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs,
                                        NUM_BUFFERS)
                consumer, acc = _down_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
            tile_m = pid_m
            tile_n = pid_n
            # the next tile's first steps load while this tile's last NUM_BUFFERS - 2 MMAs issue
            has_next = idx + 1 < my_tiles
            off_m, w_row, pid_m, pid_n = _down_tile(first + (idx + 1) * step, num_tiles, block_expert_ptr, NUM_N, N,
                                               BLOCK_M, BLOCK_N)
            for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 2), BLOCK_K):
                producer = _down_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs,
                                        NUM_BUFFERS, has_next)
                consumer, acc = _down_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
            producer = _down_loads(producer, a_desc, w_desc, off_m, w_row, BLOCK_K * (NUM_BUFFERS - 2), bars,
                                    a_bufs, w_bufs, NUM_BUFFERS, has_next)
            acc = warpgroup_mma_wait(0, (acc, ))
            # epilogue: the routing weight in the accumulator's layout (one rounding), rows stored by pair id
            rows = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))  # [BM]
            acc_pair = gl.load(sorted_pairs_ptr + rows)  # [BM]
            w = gl.load(weight_ptr + acc_pair, mask=acc_pair < P, other=0.0).to(gl.float32)  # [BM]
            out = gl.convert_layout((acc * gl.expand_dims(w, 1)).to(dtype), out_layout)  # [BM, BN]
            offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))  # [BM]
            offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))  # [BN]
            pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
            ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_ym, 1) + gl.expand_dims(offs_n, 0)
            gl.store(ptrs, out, mask=gl.expand_dims(pair < P, 1))
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
    def _gate_up_expand(acc_g, acc_u, lora_smem, tile_m, tile_n, e, lo, hi, sorted_pairs_ptr, token_slots_ptr,
                        shrunk_ptr, lb_ptr, P, top_k, R, I, stride_sm, stride_lbs, stride_lbe, stride_lbn, stride_lbr,
                        SHRUNK_BY_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_R: gl.constexpr, num_warps: gl.constexpr):
        """The tile's LoRA delta as the accumulators' starting value (moe_gemm's expand_first): for each adapter
        slot s of the block, shrink rows of slot s (others 0) @ B[s, e]^T for gate and up, through lora_smem
        ([4 * BM, BR], BM = BN: the shrink rows, gate B, up B)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_R // 8), BLOCK_R // 8], [num_warps, 1], [1, 0])
        offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # [BM]
        offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))  # [BN]
        offs_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, layout))  # [BR]
        r_mask = gl.expand_dims(offs_r < R, 0)  # [1, BR]
        pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
        valid = pair < P
        slot = gl.load(token_slots_ptr + pair // top_k, mask=valid, other=-1)  # [BM]
        if SHRUNK_BY_TOKEN:
            s_rows = (pair // top_k).to(gl.int64)
        else:
            s_rows = offs_m.to(gl.int64)
        s_ptrs = shrunk_ptr + gl.expand_dims(s_rows * stride_sm, 1) + gl.expand_dims(offs_r, 0)  # [BM, BR]
        b_ptrs = lb_ptr + e.to(gl.int64) * stride_lbe + gl.expand_dims(offs_n * stride_lbn, 1) \
            + gl.expand_dims(offs_r * stride_lbr, 0)  # [BN, BR] at slot 0, gate rows
        for s in range(lo, hi + 1):  # a block nearly always holds one slot
            shrunk = gl.load(s_ptrs, mask=gl.expand_dims(valid & (slot == s), 1) & r_mask, other=0.0)
            shrunk = shrunk.to(lora_smem.dtype)  # a float32 shrink (dense_lora_shrink's) rounds as moe_gemm's does
            b_gate = gl.load(b_ptrs + s * stride_lbs, mask=r_mask, other=0.0)
            b_up = gl.load(b_ptrs + s * stride_lbs + I * stride_lbn, mask=r_mask, other=0.0)
            lora_smem.slice(0, BLOCK_M).store(shrunk)
            lora_smem.slice(BLOCK_M, BLOCK_N).store(b_gate)
            lora_smem.slice(BLOCK_M + BLOCK_N, BLOCK_N).store(b_up)
            fence_async_shared()
            gl.thread_barrier()
            a = lora_smem.slice(0, BLOCK_M)
            acc_g = warpgroup_mma(a, lora_smem.slice(BLOCK_M, BLOCK_N).permute((1, 0)), acc_g, is_async=True,
                                  use_acc=s > lo)
            acc_u = warpgroup_mma(a, lora_smem.slice(BLOCK_M + BLOCK_N, BLOCK_N).permute((1, 0)), acc_u,
                                  is_async=True, use_acc=s > lo)
            acc_g, acc_u = warpgroup_mma_wait(0, (acc_g, acc_u))  # lora_smem is rewritten by the next slot
        return acc_g, acc_u

    @gluon.jit
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
        gl.static_assert(BLOCK_M == BLOCK_N and BLOCK_R <= 32, "the LoRA operands borrow out_smem as [4 * BM, BR]")

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
                tma.store_wait(0)  # the previous tile's store has left out_smem, which lends the LoRA operands room
                lora_smem = out_smem._reinterpret(dtype, [4 * BLOCK_M, BLOCK_R], gl.NVMMASharedLayout.
                                                  get_default_for([4 * BLOCK_M, BLOCK_R], dtype))
                acc_g, acc_u = _gate_up_expand(acc_g, acc_u, lora_smem, pid_m, pid_n, e, lo, hi, sorted_pairs_ptr,
                                               token_slots_ptr, shrunk_ptr, lb_ptr, P, top_k, R, I, stride_sm,
                                               stride_lbs, stride_lbe, stride_lbn, stride_lbr, SHRUNK_BY_TOKEN,
                                               BLOCK_M, BLOCK_N, BLOCK_R, num_warps)
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


def moe_down_gluon(act: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, align,
                   topk_weights: torch.Tensor) -> torch.Tensor:
    """Launch the persistent down GEMM (module notes; needs usable(act, w_down, align.block_m, gated=False)). The
    grid comes from host-known sizes only, so the launch can be captured in a CUDA graph."""
    E, N, K = w_down.shape
    dt = _dtype(act)
    a_desc = TensorDescriptor.from_tensor(act, [BLOCK_M, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dt))
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * N, K), [DOWN_BLOCK_N, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([DOWN_BLOCK_N, BLOCK_K], dt))
    grid = (min(_num_sms(act), align.num_blocks * (N // DOWN_BLOCK_N)),)
    moe_down_kernel[grid](a_desc, w_desc, y, align.sorted_pairs, align.block_expert, align.num_padded, topk_weights,
                          align.num_pairs, y.stride(0), N=N, K=K, NUM_BUFFERS=NUM_BUFFERS, num_warps=NUM_WARPS)
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
    w_desc = TensorDescriptor.from_tensor(w_gate_up.view(E * N2, K), [GATE_UP_BLOCK_N, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([GATE_UP_BLOCK_N, BLOCK_K], dt))
    out_desc = TensorDescriptor.from_tensor(act, [BLOCK_M, GATE_UP_BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, GATE_UP_BLOCK_N], dt))
    grid = (min(_num_sms(x), align.num_blocks * (I // GATE_UP_BLOCK_N)),)
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
                             NUM_BUFFERS=NUM_BUFFERS, HAS_LORA=lora is not None, SHRUNK_BY_TOKEN=by_token,
                             BLOCK_R=max(16, 1 << (R - 1).bit_length()), num_warps=NUM_WARPS)
    return act
