"""Tile sweep of the dense multi-LoRA shrink and expand (kernels/dense_lora.py) at Qwen3-30B-A3B's projection
shapes, 4 x 1024 tokens, 4 adapter slots with every row in one (the end-to-end bench's lora-1 case), bf16.

    python benchmarks/dense_lora_tiles.py [--tokens 4096] [--sections shrink,expand,head-norm]

Shrink shapes: q/k/v's shared shrink (in 2048, R 48), o_proj (in 4096, R 16), router (in 2048, R 16); expand
shapes: q (out 4096), k or v (out 512), o (out 2048), router (out 128), R 16. Prints the current tiles' time, the
best, and a copy of the same bytes for scale. Head norm: q's and k's per-head RMSNorm + RoPE in one kernel
(kernels/head_norm_rope.py), with and without the LoRA expand inside, by tokens per program, against the separate
kernels. CUDA-graph replays, median.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from lora_eval.kernels import head_norm_rope as hnr
from lora_eval.kernels.dense_lora import BLOCKS, dense_lora_expand, dense_lora_shrink, lora_metadata
from lora_eval.kernels.rms_norm import rms_norm
from lora_eval.kernels.rope import rope
from lora_eval.models.layers import rope_cos_sin

SLOTS = 4


def time_graph(fn):
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sections", default="shrink,expand,head-norm")
    args = parser.parse_args()
    T, bf = args.tokens, torch.bfloat16
    meta = lora_metadata(torch.zeros(T, dtype=torch.long, device="cuda"), SLOTS)
    sections = args.sections.split(",")
    if "shrink" in sections:
        shrinks(T, meta)
    if "expand" in sections:
        expands(T, meta)
    if "head-norm" in sections:
        head_norms(T, meta)


def head_norms(T, meta, D=128, batch=4):
    """q's / k's per-head norm + RoPE (kernels/head_norm_rope.py) by tokens per program, with and without the LoRA
    expand inside, against the separate kernels (expand, rms_norm, rope)."""
    kept = hnr.TOKENS_PER_PROGRAM
    L = T // batch
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device="cuda") / D))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(L, device="cuda").expand(batch, L), torch.bfloat16)
    for name, heads in (("q", 32), ("k", 4)):
        y = torch.randn(T, heads * D, device="cuda", dtype=torch.bfloat16)
        shrunk = torch.randn(T, 16, device="cuda")
        B = torch.randn(SLOTS, heads * D, 16, device="cuda", dtype=torch.bfloat16) / 4
        w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5

        def apart(with_lora):
            z = y.clone()  # the expand writes into the projection: the clone is timed too, and subtracted below
            if with_lora:
                dense_lora_expand(z, shrunk, B, meta)
            return rope(rms_norm(z.view(T, heads, D), w, 1e-6).view(batch, L, heads, D), cos, sin)

        clone = time_graph(lambda: y.clone())
        cells = [f"apart: base {(time_graph(lambda: apart(False)) - clone) * 1e3:.1f} us, "
                 f"LoRA {(time_graph(lambda: apart(True)) - clone) * 1e3:.1f} us"]
        for tokens in (16, 32, 64):
            hnr.TOKENS_PER_PROGRAM = tokens
            base = time_graph(lambda: hnr.head_norm_rope(y, w, 1e-6, cos, sin))
            lora = time_graph(lambda: hnr.head_norm_rope(y, w, 1e-6, cos, sin, lora=(shrunk, B, meta.row_slot, None)))
            cells.append(f"fused at {tokens} tokens: base {base * 1e3:.1f} us, LoRA {lora * 1e3:.1f} us")
        hnr.TOKENS_PER_PROGRAM = kept
        print(f"{name} norm + rope ({heads} heads): " + "; ".join(cells), flush=True)


def shrinks(T, meta):
    bf = torch.bfloat16
    for name, K, R in (("q/k/v shrink", 2048, 48), ("o shrink", 4096, 16), ("router shrink", 2048, 16)):
        x = torch.randn(T, K, device="cuda", dtype=bf)
        A = torch.randn(SLOTS, R, K, device="cuda", dtype=bf) / K**0.5
        results = {}
        for bm, bk, nw, ns in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4)):
            blocks = dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            try:
                results[(bm, bk, nw, ns)] = time_graph(lambda: dense_lora_shrink(x, A, meta, blocks=blocks))
            except Exception as e:  # noqa: BLE001 - tiles that do not fit are skipped
                print(f"{name} {blocks}: {type(e).__name__}")
        current = time_graph(lambda: dense_lora_shrink(x, A, meta))
        best = min(results, key=results.get)
        copy = time_graph(lambda: x.clone())
        print(f"{name}: current {BLOCKS['shrink']} {current * 1e3:.1f} us; best BLOCK_M/BLOCK_K/warps/stages {best} "
              f"{results[best] * 1e3:.1f} us; copy of x {copy * 1e3:.1f} us", flush=True)


def expands(T, meta):
    bf = torch.bfloat16
    for name, N in (("q expand", 4096), ("k/v expand", 512), ("o expand", 2048), ("router expand", 128)):
        y = torch.randn(T, N, device="cuda", dtype=bf)
        shrunk = torch.randn(T, 16, device="cuda")
        B = torch.randn(SLOTS, N, 16, device="cuda", dtype=bf) / 4
        results = {}
        for bm, bn, nw, ns in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (1,)):
            blocks = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
            try:
                results[(bm, bn, nw, ns)] = time_graph(lambda: dense_lora_expand(y, shrunk, B, meta, blocks=blocks))
            except Exception as e:  # noqa: BLE001
                print(f"{name} {blocks}: {type(e).__name__}")
        current = time_graph(lambda: dense_lora_expand(y, shrunk, B, meta))
        best = min(results, key=results.get)
        copy = time_graph(lambda: y.clone())
        print(f"{name}: current {BLOCKS['expand']} {current * 1e3:.1f} us; best BLOCK_M/BLOCK_N/warps/stages {best} "
              f"{results[best] * 1e3:.1f} us; copy of y {copy * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main()
