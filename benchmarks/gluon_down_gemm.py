"""Prototype: the MoE down GEMM as a persistent Gluon kernel (Hopper: TMA, mbarriers, async wgmma), the next
tile's first loads issued while the current tile's last MMAs drain, against kernels/fused_moe.py's moe_gemm on the
same block-ordered activation (MoeConfig.sorted_act), Qwen3-30B-A3B shapes. Base GEMM only (no LoRA, no half-height
tail blocks): it measures whether a persistent kernel pays here before anything is built on it.

    python benchmarks/gluon_down_gemm.py [--tokens 4096,8192,16384] [--buffers 3,4]

Per size: both kernels' outputs compared (bf16, fp32 accumulation; relative error over the real pairs) and their
CUDA-graph replay times (median), moe_gemm with and without half-height tail blocks.
Shapes: act [NB * BM, I] in block order, w_down [E, H, I], y [P, H] by pair id, y[pair] = w_pair * act_row @ W[e]^T.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 128, 256, 64, 8


@gluon.constexpr_function
def wgmma_layout(block_m, block_n, num_warps):
    """The accumulator layout of one m64nNk16 wgmma per warpgroup, warpgroups stacked along M."""
    warps_m = max(4, min(num_warps, block_m // 16))
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
                                     instr_shape=[16, block_n // (num_warps // warps_m), 16])


@gluon.jit
def _issue_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr,
                 pred=True):
    """TMA loads of step k's a tile [BM, BK] and w tile [BN, BK] into buffer producer % NUM_BUFFERS."""
    index = producer % NUM_BUFFERS
    bar = bars.index(index)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(index), pred)
    tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_bufs.index(index), pred)
    return producer + 1


@gluon.jit
def _issue_mma(consumer, acc, use_acc, bars, a_bufs, w_bufs, NUM_BUFFERS: gl.constexpr):
    """Wait for buffer consumer % NUM_BUFFERS, retire the previous wgmma (its buffer may be refilled next), issue
    this step's async wgmma acc += a @ w^T."""
    index = consumer % NUM_BUFFERS
    mbarrier.wait(bars.index(index), (consumer // NUM_BUFFERS) & 1)
    acc = warpgroup_mma_wait(0, (acc, ))
    acc = warpgroup_mma(a_bufs.index(index), w_bufs.index(index).permute((1, 0)), acc, is_async=True,
                        use_acc=use_acc)
    return consumer + 1, acc


@gluon.jit
def _tile(t, num_tiles, block_expert_ptr, NUM_N: gl.constexpr, N: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr):
    """(row of a, row of the [E * N, K] weight view, pid_m, pid_n) of tile t (N tiles of a block adjacent); a t
    past the last tile gives expert 0 (its loads are predicated off)."""
    pid_m = t // NUM_N
    pid_n = t % NUM_N
    e = gl.load(block_expert_ptr + pid_m, mask=t < num_tiles, other=0)
    return pid_m * BLOCK_M, e * N + pid_n * BLOCK_N, pid_m, pid_n


@gluon.jit
def down_gemm_kernel(a_desc, w_desc, y_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, weight_ptr, P,
                     stride_ym, N: gl.constexpr, K: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                     COALESCED: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    NUM_N: gl.constexpr = N // BLOCK_N
    dtype: gl.constexpr = a_desc.dtype
    acc_layout: gl.constexpr = wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
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
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)

    # the first tile's first NUM_BUFFERS - 1 steps
    off_m, w_row, pid_m, pid_n = _tile(first, num_tiles, block_expert_ptr, NUM_N, N, BLOCK_M, BLOCK_N)
    for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 1), BLOCK_K):
        producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs, NUM_BUFFERS,
                                my_tiles > 0)

    for idx in range(my_tiles):
        consumer, acc = _issue_mma(consumer, acc, False, bars, a_bufs, w_bufs, NUM_BUFFERS)
        for k in range(BLOCK_K * (NUM_BUFFERS - 1), K, BLOCK_K):
            producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, k, bars, a_bufs, w_bufs, NUM_BUFFERS)
            consumer, acc = _issue_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
        tile_m = pid_m
        tile_n = pid_n
        # the next tile's first steps load while this tile's last NUM_BUFFERS - 2 MMAs issue
        has_next = idx + 1 < my_tiles
        off_m, w_row, pid_m, pid_n = _tile(first + (idx + 1) * step, num_tiles, block_expert_ptr, NUM_N, N, BLOCK_M, BLOCK_N)
        for kk in gl.static_range(0, BLOCK_K * (NUM_BUFFERS - 2), BLOCK_K):
            producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, kk, bars, a_bufs, w_bufs, NUM_BUFFERS,
                                    has_next)
            consumer, acc = _issue_mma(consumer, acc, True, bars, a_bufs, w_bufs, NUM_BUFFERS)
        producer = _issue_loads(producer, a_desc, w_desc, off_m, w_row, BLOCK_K * (NUM_BUFFERS - 2), bars, a_bufs,
                                w_bufs, NUM_BUFFERS, has_next)
        acc = warpgroup_mma_wait(0, (acc, ))
        # epilogue: the routing weight in the accumulator's layout (one rounding, as moe_gemm), then rows stored by
        # pair id (padding rows skipped); COALESCED: through a layout whose threads hold 8 consecutive columns
        # (16-byte stores), converted through shared memory
        rows = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))  # [BM]
        acc_pair = gl.load(sorted_pairs_ptr + rows)  # [BM]
        w = gl.load(weight_ptr + acc_pair, mask=acc_pair < P, other=0.0).to(gl.float32)  # [BM]
        out = (acc * gl.expand_dims(w, 1)).to(dtype)  # [BM, BN]
        if COALESCED:
            out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
            out = gl.convert_layout(out, out_layout)
        else:
            out_layout: gl.constexpr = acc_layout
        offs_m = tile_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))  # [BM]
        offs_n = tile_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))  # [BN]
        pair = gl.load(sorted_pairs_ptr + offs_m)  # [BM]
        valid = pair < P
        ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_ym, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(valid, 1))

    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))


def down_gemm(act, w_down, y, align, topk_weights, num_buffers=3, coalesced=True):
    """y[pair] = topk_weights[pair] * act[block row] @ w_down[e]^T for every aligned block (act in block order)."""
    E, N, K = w_down.shape
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(act, [BLOCK_M, BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(w_down.view(E * N, K), [BLOCK_N, BLOCK_K], w_layout)
    sms = torch.cuda.get_device_properties(act.device).multi_processor_count
    grid = (min(sms, align.num_blocks * (N // BLOCK_N)),)
    down_gemm_kernel[grid](a_desc, w_desc, y, align.sorted_pairs, align.block_expert, align.num_padded,
                           topk_weights, align.num_pairs, y.stride(0), N=N, K=K, NUM_BUFFERS=num_buffers,
                           COALESCED=coalesced, num_warps=NUM_WARPS)
    return y


def main():
    from lora_eval.kernels import fused_moe as fm
    from lora_eval.kernels.moe_align import moe_align

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--buffers", default="3,4")
    args = parser.parse_args()
    E, k, H, I = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    w_down = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randn(T, E, generator=g, device="cuda").topk(k).indices  # [T, k]
        weights = torch.rand(T * k, generator=g, device="cuda").to(torch.bfloat16)  # [P]
        align = moe_align(ids, E, BLOCK_M)
        act = torch.randn(align.num_blocks * BLOCK_M, I, generator=g, device="cuda").to(torch.bfloat16)
        config = fm.pick_config(T, k, E)
        tiles = config.tiles("down")
        assert tiles["BLOCK_M"] == BLOCK_M

        def triton_call(half_tail):
            y = torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda")
            return lambda: fm.moe_gemm(act, w_down, y, align, gated=False, rows_are_tokens=False, top_k=k,
                                       topk_weights=weights, config=tiles, w_tma=True, a_sorted=True, a_tma=True,
                                       half_tail=half_tail)

        def gluon_call(buffers, coalesced):
            y = torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda")
            return lambda: down_gemm(act, w_down, y, align, weights, buffers, coalesced)

        y_ref = torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda")
        fm.moe_gemm(act, w_down, y_ref, align, gated=False, rows_are_tokens=False, top_k=k, topk_weights=weights,
                    config=tiles, w_tma=True, a_sorted=True, a_tma=True)
        flops = 2 * T * k * H * I
        rows = []
        for name, call in [("moe_gemm half_tail", triton_call(True)), ("moe_gemm", triton_call(False))] + [
                (f"gluon {b} buffers{' 16-byte stores' if c else ''}", gluon_call(b, c))
                for b in (int(b) for b in args.buffers.split(",")) for c in (False, True)]:
            try:
                y = call()
                torch.cuda.synchronize()
            except Exception as error:  # noqa: BLE001 - a prototype: report and go on with the other kernels
                rows.append(f"  {name:32s} failed: {type(error).__name__}: {str(error)[:1500]}")
                continue
            err = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
            ms = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
            rows.append(f"  {name:32s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  rel err {err:.2e}")
        print(f"T={T} (pairs {T * k}, blocks <= {align.num_blocks})", *rows, sep="\n", flush=True)


if __name__ == "__main__":
    main()
