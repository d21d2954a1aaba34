"""The MoE down GEMM as a persistent Gluon kernel (Hopper): the base path of fused_moe's down projection when the
activation is in block order (MoeConfig.sorted_act) and the GEMM has no LoRA work and no bias.

Shapes: act [NB * BM, I] in block order (row r of aligned block r // BM), w_down [E, H, I], topk_weights [P],
y [P, H] by pair id:  y[pair] = (topk_weights[pair] * (act[row] @ W_d[e]^T)).to(y.dtype)  (fp32 accumulation, one
rounding: the same numbers as moe_gemm's, bit for bit on an H100).
One CTA per SM loops over (block, N tile) tiles: act and weight tiles go through TMA into a ring of NUM_BUFFERS
shared-memory buffers (one mbarrier each), async wgmma consumes them, and the next tile's first loads are issued
while the current tile's last MMAs drain. The epilogue scales by the routing weight in the accumulator's layout,
converts through shared memory to 16-byte rows and stores them by pair id (padding rows skipped).
H100, Qwen3-30B-A3B shapes (benchmarks/gluon_down_gemm.py): 433 against moe_gemm's 467 us at 8192 tokens, 802
against 859 at 16384 (BENCHMARKS.md section 1). Gluon does not run in the Triton interpreter: moe_gemm is the
CPU-tested path, and the GPU tests check this kernel against it and against moe_down_ref.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with triton 3.6 (triton.experimental); older or partial installs fall back to moe_gemm
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BLOCK_N, BLOCK_K, NUM_BUFFERS, NUM_WARPS = 256, 64, 4, 8  # BLOCK_M is the alignment's (128)
BLOCK_M = 128


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


def usable(act: torch.Tensor, w_down: torch.Tensor, block_m: int) -> bool:
    """Whether this kernel can run the down GEMM: Gluon present, a Hopper GPU (wgmma), 16-bit operands, the
    alignment's 128-row blocks, whole tiles along H and I and a pipeline's worth of steps."""
    if not (HAVE_GLUON and act.is_cuda and torch.cuda.get_device_capability(act.device)[0] == 9):
        return False
    E, H, I = w_down.shape
    return (act.dtype in (torch.bfloat16, torch.float16) and w_down.dtype == act.dtype and block_m == BLOCK_M
            and H % BLOCK_N == 0 and I % BLOCK_K == 0 and I // BLOCK_K >= NUM_BUFFERS - 1
            and act.is_contiguous() and w_down.is_contiguous())


if HAVE_GLUON:

    @gluon.constexpr_function
    def _wgmma_layout(block_m, block_n, num_warps):
        """The accumulator layout: one m64nNk16 wgmma per warpgroup, warpgroups stacked along M."""
        warps_m = max(4, min(num_warps, block_m // 16))
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
                                         instr_shape=[16, block_n // (num_warps // warps_m), 16])

    @gluon.jit
    def _issue_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr,
                     pred=True):
        """TMA loads of step k's act tile [BM, BK] and weight tile [BN, BK] into buffer producer % NUM_BUFFERS."""
        index = producer % NUM_BUFFERS
        bar = bars.index(index)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_bufs.index(index), pred)
        return producer + 1

    @gluon.jit
    def _issue_mma(consumer, acc, use_acc, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr):
        """Wait for buffer consumer % NUM_BUFFERS, retire the previous wgmma (its buffer is refilled next), issue
        this step's async wgmma acc += act @ w^T."""
        index = consumer % NUM_BUFFERS
        mbarrier.wait(bars.index(index), (consumer // NUM_BUFFERS) & 1)
        acc = warpgroup_mma_wait(0, (acc, ))
        acc = warpgroup_mma(a_bufs.index(index), w_bufs.index(index).permute((1, 0)), acc, is_async=True,
                            use_acc=use_acc)
        return consumer + 1, acc

    @gluon.jit
    def _tile(t, num_tiles, block_expert_ptr, NUM_N: gl.constexpr, N: gl.constexpr, BLOCK_M: gl.constexpr,
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
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUFFERS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        num_tiles = gl.load(num_padded_ptr) // BLOCK_M * NUM_N
        first = gl.program_id(0)
        step = gl.num_programs(0)
        my_tiles = gl.cdiv(gl.maximum(num_tiles - first, 0), step)
        producer = 0
        consumer = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # [BM, BN]

        # the first tile's first NUM_BUFFERS - 1 steps
        off_m, w_row, pid_m, pid_n = _tile(first, num_tiles, block_expert_ptr, NUM_N, N, BLOCK_M, BLOCK_N)
        for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 1), BLOCK_K):
            producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs, NUM_BUFFERS,
                                    my_tiles > 0)
        for idx in range(my_tiles):
            consumer, acc = _issue_mma(consumer, acc, False, bars, a_bufs, w_bufs, NUM_BUFFERS)
            for k in range(BLOCK_K * (NUM_BUFFERS - 1), K, BLOCK_K):
                producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs,
                                        NUM_BUFFERS)
                consumer, acc = _issue_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
            tile_m = pid_m
            tile_n = pid_n
            # the next tile's first steps load while this tile's last NUM_BUFFERS - 2 MMAs issue
            has_next = idx + 1 < my_tiles
            off_m, w_row, pid_m, pid_n = _tile(first + (idx + 1) * step, num_tiles, block_expert_ptr, NUM_N, N,
                                               BLOCK_M, BLOCK_N)
            for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 2), BLOCK_K):
                producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs,
                                        NUM_BUFFERS, has_next)
                consumer, acc = _issue_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
            producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, BLOCK_K * (NUM_BUFFERS - 2), bars,
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


def moe_down_gluon(act: torch.Tensor, w_down: torch.Tensor, y: torch.Tensor, align,
                   topk_weights: torch.Tensor) -> torch.Tensor:
    """Launch the persistent down GEMM (see the module notes; needs usable(act, w_down, align.block_m)). The grid
    comes from host-known sizes only, so the launch can be captured in a CUDA graph."""
    E, N, K = w_down.shape
    dt = gl.bfloat16 if act.dtype == torch.bfloat16 else gl.float16
    a_desc = TensorDescriptor.from_tensor(act, [BLOCK_M, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dt))
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * N, K), [BLOCK_N, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dt))
    sms = torch.cuda.get_device_properties(act.device).multi_processor_count if act.is_cuda else 1  # 1: a compile check
    grid = (min(sms, align.num_blocks * (N // BLOCK_N)),)
    moe_down_kernel[grid](a_desc, w_desc, y, align.sorted_pairs, align.block_expert, align.num_padded, topk_weights,
                          align.num_pairs, y.stride(0), N=N, K=K, NUM_BUFFERS=NUM_BUFFERS, num_warps=NUM_WARPS)
    return y
