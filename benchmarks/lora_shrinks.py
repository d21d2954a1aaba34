"""Where the LoRA shrinks of the end-to-end bench's lora-1 case stand, at Qwen3-30B-A3B shapes (4 adapter slots,
every row in slot 0, rank 16, bf16; CUDA-graph replays, median µs):

* `moe`: the per-block MoE shrinks with PEFT's per-expert factors (kernels/fused_moe.moe_lora_shrink): gate_up
  (x gathered by pair, R 32) and down (the activation, R 16), by launch settings (warps, stages, BLOCK_K), against
  the bytes they read at the copy bandwidth and a gather copy x[rows] of the same rows (reads and writes them).
* `dense`: the dense shrinks (kernels/dense_lora.dense_lora_shrink: q/k/v's shared one, o_proj, router) against
  what cuBLAS takes to compute the same shrink as extra output columns of the base GEMM (x @ [W; A]^T with one
  or all slots' A rows appended).

    python benchmarks/lora_shrinks.py [--tokens 128,4096] [--sections moe,dense]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.dense_lora import dense_lora_shrink, lora_metadata
from lora_eval.kernels.moe_align import moe_align

from moe_layer import E, H, I, K_TOP, bandwidth_gbs, inputs  # benchmarks/ is the script's folder

SLOTS, RANK = 4, 16


def time_graph(fn) -> float:
    fn()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")  # µs


def moe(T, g, gbs):
    x, ids, _ = inputs(T, g)
    slots = torch.zeros(T, dtype=torch.long, device="cuda")
    config = fm.pick_config(T, K_TOP, E)
    align = moe_align(ids, E, config.block_m, slots, SLOTS)
    act_rows = align.num_blocks * config.block_m if config.sorted_act else T * K_TOP
    act = torch.randn(act_rows, I, generator=g, device="cuda").to(torch.bfloat16)
    gate_up_A = (0.02 * torch.randn(SLOTS, E, 2 * RANK, H, generator=g, device="cuda")).to(torch.bfloat16)
    down_A = (0.02 * torch.randn(SLOTS, E, RANK, I, generator=g, device="cuda")).to(torch.bfloat16)
    rows = ids.reshape(-1).argsort() // K_TOP  # the pairs' tokens, pairs by expert
    gather = time_graph(lambda: x.index_select(0, rows))
    P = T * K_TOP
    cases = {"gate_up": (x, gate_up_A, dict(rows_are_tokens=True), P * H * 2),
             "down": (act, down_A, dict(rows_are_tokens=False, a_sorted=config.sorted_act), P * I * 2)}
    current = {name: config.shrink_tiles(name) for name in cases}
    out = []
    for name, (a, A, kw, nbytes) in cases.items():
        for warps, stages, bk in itertools.product((4, 8), (2, 3, 4), (64, 128, 256)):
            tiles = dict(num_warps=warps, num_stages=stages, BLOCK_K=bk)
            try:
                us = time_graph(lambda: fm.moe_lora_shrink(a, A, align, top_k=K_TOP, tiles=tiles, **kw))
            except Exception as e:  # noqa: BLE001 - a setting that does not fit shared memory
                print(f"  {name} w{warps} s{stages} bk{bk}: {type(e).__name__}")
                continue
            out.append(dict(tokens=T, shrink=name, warps=warps, stages=stages, block_k=bk, us=round(us, 1),
                            current=tiles == current[name], read_floor_us=round(nbytes / gbs / 1e3, 1),
                            gather_copy_us=round(gather, 1)))
    return out


def dense(T, g):
    meta = lora_metadata(torch.zeros(T, dtype=torch.long, device="cuda"), SLOTS)
    out = []
    for name, n_in, n_out, R in (("q/k/v", H, 5120, 3 * RANK), ("o", 4096, H, RANK), ("router", H, E, RANK)):
        x = torch.randn(T, n_in, generator=g, device="cuda").to(torch.bfloat16)
        W = (0.02 * torch.randn(n_out + SLOTS * R, n_in, generator=g, device="cuda")).to(torch.bfloat16)
        A = W[n_out:].view(SLOTS, R, n_in)
        base = time_graph(lambda: F.linear(x, W[:n_out]))
        row = dict(tokens=T, proj=name, base_gemm_us=round(base, 1),
                   shrink_kernel_us=round(time_graph(lambda: dense_lora_shrink(x, A, meta)), 1))
        for slots in (1, SLOTS):
            fused = time_graph(lambda: F.linear(x, W[:n_out + slots * R]))
            row[f"gemm_with_{slots}_slot_cols_us"] = round(fused, 1)
        out.append(row)
    return out


def main():
    import pandas as pd

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--sections", default="moe,dense")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    sections = args.sections.split(",")
    gbs = bandwidth_gbs()
    print(f"copy bandwidth {gbs:.0f} GB/s")
    pd.set_option("display.width", 200)
    for T in [int(t) for t in args.tokens.split(",")]:
        if "moe" in sections:
            table = pd.DataFrame(moe(T, g, gbs))
            for name, part in table.groupby("shrink", sort=False):
                print(part.sort_values("us").head(8).to_string(index=False))
                print("current:", part[part.current].us.tolist())
        if "dense" in sections:
            print(pd.DataFrame(dense(T, g)).to_string(index=False))


if __name__ == "__main__":
    main()
