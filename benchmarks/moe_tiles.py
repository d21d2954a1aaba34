"""Tile sweep for the two grouped GEMMs of the fused MoE, each on its own (they have different shapes:
gate_up N=2*768 K=2048, down N=2048 K=768), plus the cost of the LoRA variant itself: the LoRA-compiled
kernel with no adapter rows (the slot loop never runs) against the plain kernel.

    python benchmarks/moe_tiles.py --tokens 64,1024,16384

Qwen3-30B-A3B layer shapes, bf16, CUDA-graph replays (median). Prints the fastest configs per GEMM and M.
"""

from __future__ import annotations

import argparse
import itertools

import pandas as pd
import torch
import triton

from lora_eval.kernels.fused_moe import moe_gemm, pick_config
from lora_eval.kernels.moe_align import moe_align

E, K_TOP, H, I, RANK, SLOTS = 128, 8, 2048, 768, 16, 4


def time_graph(fn):
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,1024,16384")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    w_gu = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(bf)
    w_d = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(bf)
    A_gu = (0.02 * torch.randn(SLOTS, E, 2 * RANK, H, generator=g, device="cuda")).to(bf)
    B_gu = (0.02 * torch.randn(SLOTS, E, 2 * I, 2 * RANK, generator=g, device="cuda")).to(bf)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        pairs_per_expert = T * K_TOP / E
        block_ms = (16, 32) if pairs_per_expert <= 16 else (32, 64) if pairs_per_expert <= 128 else (64, 128)
        grid = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=nw, num_stages=4 if bk == 64 else 3)
                for bm, bn, bk, nw in itertools.product(block_ms, (64, 128, 256), (64, 128), (4, 8))]
        x = torch.randn(T, H, generator=g, device="cuda").to(bf)
        ids = torch.topk(torch.randn(T, E, generator=g, device="cuda"), K_TOP).indices
        w = torch.full((T * K_TOP,), 1.0 / K_TOP, device="cuda", dtype=bf)
        act = torch.randn(T * K_TOP, I, generator=g, device="cuda").to(bf)
        no_adapter = torch.full((T,), -1, device="cuda", dtype=torch.long)
        for cfg in grid:
            align = moe_align(ids, E, cfg["BLOCK_M"])
            out_gu = torch.empty(T * K_TOP, I, device="cuda", dtype=bf)
            out_d = torch.empty(T * K_TOP, H, device="cuda", dtype=bf)
            try:
                gu = time_graph(lambda: moe_gemm(x, w_gu, out_gu, align, gated=True, rows_are_tokens=True,
                                                 top_k=K_TOP, config=cfg))
                dn = time_graph(lambda: moe_gemm(act, w_d, out_d, align, gated=False, rows_are_tokens=False,
                                                 top_k=K_TOP, topk_weights=w, config=cfg))
            except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
                print(f"T={T} {cfg}: {type(e).__name__}")
                continue
            rows.append(dict(tokens=T, gemm="gate_up", ms=gu, **cfg))
            rows.append(dict(tokens=T, gemm="down", ms=dn, **cfg))
        # the LoRA-compiled gate_up kernel with no adapter rows, at the default config
        cfg = pick_config(T, K_TOP, E)
        align_lora = moe_align(ids, E, cfg["BLOCK_M"], no_adapter, SLOTS)
        out_gu = torch.empty(T * K_TOP, I, device="cuda", dtype=bf)
        plain = time_graph(lambda: moe_gemm(x, w_gu, out_gu, align_lora, gated=True, rows_are_tokens=True,
                                            top_k=K_TOP, config=cfg))
        compiled = time_graph(lambda: moe_gemm(x, w_gu, out_gu, align_lora, gated=True, rows_are_tokens=True,
                                               top_k=K_TOP, lora_A=A_gu, lora_B=B_gu, config=cfg))
        print(f"T={T}: gate_up plain {plain:.4f} ms, LoRA variant with no adapter rows {compiled:.4f} ms "
              f"({compiled / plain:.3f}x)")
    table = pd.DataFrame(rows)
    best = table.sort_values("ms").groupby(["tokens", "gemm"]).head(3).sort_values(["tokens", "gemm", "ms"])
    print(best.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    defaults = {T: pick_config(T, K_TOP, E) for T in table["tokens"].unique()}
    for (T, gemm), group in table.groupby(["tokens", "gemm"]):
        d = defaults[T]
        match = group[(group[list(d)] == pd.Series(d)).all(axis=1)]
        if len(match):
            print(f"T={T} {gemm}: default config {match['ms'].iloc[0]:.4f} ms, best {group['ms'].min():.4f} ms")
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
