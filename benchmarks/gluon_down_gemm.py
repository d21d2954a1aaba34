"""The MoE down GEMM, persistent Gluon kernel (kernels/moe_down_gluon.py) against kernels/fused_moe.py's moe_gemm on
the same block-ordered activation (MoeConfig.sorted_act), Qwen3-30B-A3B shapes, base GEMM (no LoRA).

    python benchmarks/gluon_down_gemm.py [--tokens 4096,8192,16384]

Per size: CUDA-graph replay times (median) of moe_gemm with and without half-height tail blocks and of the Gluon
kernel, and whether each output equals moe_gemm's bit for bit (relative error otherwise).
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.moe_align import moe_align
from lora_eval.kernels.moe_down_gluon import BLOCK_M, moe_down_gluon


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384")
    args = parser.parse_args()
    E, k, H, I = 128, 8, 2048, 768
    g = torch.Generator(device="cuda").manual_seed(0)
    w_down = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    for T in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randn(T, E, generator=g, device="cuda").topk(k).indices  # [T, k]
        weights = torch.rand(T * k, generator=g, device="cuda").to(torch.bfloat16)  # [P]
        align = moe_align(ids, E, BLOCK_M)
        act = torch.randn(align.num_blocks * BLOCK_M, I, generator=g, device="cuda").to(torch.bfloat16)
        tiles = dict(fm.CONFIGS[None].tiles("down"), BLOCK_M=BLOCK_M)

        def triton_call(half_tail):
            y = torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda")
            return lambda: fm.moe_gemm(act, w_down, y, align, gated=False, rows_are_tokens=False, top_k=k,
                                       topk_weights=weights, config=tiles, w_tma=True, a_sorted=True, a_tma=True,
                                       half_tail=half_tail)

        y_gluon = torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda")
        calls = {"moe_gemm, half-height tails": triton_call(True), "moe_gemm": triton_call(False),
                 "gluon persistent": lambda: moe_down_gluon(act, w_down, y_gluon, align, weights)}
        y_ref = calls["moe_gemm"]().clone()
        flops = 2 * T * k * H * I
        print(f"T={T} (pairs {T * k}, blocks <= {align.num_blocks})")
        for name, call in calls.items():
            y = call()
            same = "bit for bit" if torch.equal(y, y_ref) else \
                f"rel err {((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item():.2e}"
            ms = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
            print(f"  {name:28s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  {same}", flush=True)


if __name__ == "__main__":
    main()
