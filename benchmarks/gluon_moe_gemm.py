"""Fused MoE's base GEMMs: the persistent Gluon kernels (kernels/moe_gemm_gluon.py) against kernels/fused_moe.py's
moe_gemm on the same alignment and block-ordered activation (MoeConfig.sorted_act), Qwen3-30B-A3B shapes.

    python benchmarks/gluon_moe_gemm.py [--tokens 4096,8192,16384]

Per size and GEMM: CUDA-graph replay times (median) of moe_gemm with and without half-height tail blocks and of the
Gluon kernel, and whether each output equals moe_gemm's bit for bit (over the padded rows; relative error otherwise);
then the down GEMM with the pair shrink (moe_layer.py's shared-outer LoRA layer's down GEMM) both ways.
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels import moe_gemm_gluon as mg
from lora_eval.kernels.moe_align import moe_align


def report(name, call, ref, rows, flops):
    out = call()[:rows]
    same = "bit for bit" if torch.equal(out, ref[:rows]) else \
        f"rel err {((out.float() - ref[:rows].float()).norm() / ref[:rows].float().norm()).item():.2e}"
    ms = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
    print(f"  {name:36s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  {same}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384")
    args = parser.parse_args()
    E, k, H, I, BM = 128, 8, 2048, 768, mg.BLOCK_M
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    w_d = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
    config = fm.CONFIGS[None]
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.randn(T, E, generator=g, device="cuda").topk(k).indices  # [T, k]
        weights = torch.rand(T * k, generator=g, device="cuda").to(torch.bfloat16)  # [P]
        align = moe_align(ids, E, BM)
        padded = int(align.num_padded)
        print(f"T={T} (pairs {T * k}, padded rows {padded})")
        act = {name: torch.empty(align.num_blocks * BM, I, dtype=torch.bfloat16, device="cuda")
               for name in ("half", "full", "gluon")}

        def gate_up(out, half_tail):
            return lambda: fm.moe_gemm(x, w_gu, out, align, gated=True, rows_are_tokens=True, top_k=k,
                                       config=config.tiles("gate_up"), w_tma=True, out_sorted=True,
                                       half_tail=half_tail)

        ref = gate_up(act["full"], False)().clone()
        flops = 2 * T * k * 2 * I * H
        report("gate_up moe_gemm, half-height tails", gate_up(act["half"], True), ref, padded, flops)
        report("gate_up moe_gemm", gate_up(act["full"], False), ref, padded, flops)
        report("gate_up gluon", lambda: mg.moe_gate_up_gluon(x, w_gu, act["gluon"], align, k), ref, padded, flops)
        y = {name: torch.empty(T * k, H, dtype=torch.bfloat16, device="cuda") for name in ("half", "full", "gluon")}

        def down(out, half_tail):
            return lambda: fm.moe_gemm(ref, w_d, out, align, gated=False, rows_are_tokens=False, top_k=k,
                                       topk_weights=weights, config=config.tiles("down"), w_tma=True, a_sorted=True,
                                       a_tma=True, half_tail=half_tail)

        y_ref = down(y["full"], False)().clone()
        flops = 2 * T * k * H * I
        report("down moe_gemm, half-height tails", down(y["half"], True), y_ref, T * k, flops)
        report("down moe_gemm", down(y["full"], False), y_ref, T * k, flops)
        report("down gluon", lambda: mg.moe_down_gluon(ref, w_d, y["gluon"], align, k, weights), y_ref, T * k, flops)
        # with the pair shrink (the down LoRA shrink of a down B shared by all experts): 4 adapters, every token
        # under one of them, rank 16 side by side in N tile 0 of each block
        S, RS = 4, 16
        slotted = moe_align(ids, E, BM, torch.randint(0, S, (T,), generator=g, device="cuda"), S)
        act_s = mg.moe_gate_up_gluon(x, w_gu, torch.empty_like(ref), slotted, k)
        la = (torch.randn(S, E, RS, I, generator=g, device="cuda") / I**0.5).to(torch.bfloat16)
        shrunk = {name: torch.empty(T * k, RS, dtype=torch.bfloat16, device="cuda") for name in ("half", "gluon")}

        def down_shrink(out):
            return lambda: fm.moe_gemm(act_s, w_d, out, slotted, gated=False, rows_are_tokens=False, top_k=k,
                                       topk_weights=weights, config=config.tiles("down"), w_tma=True, a_sorted=True,
                                       a_tma=True, half_tail=True, pair_shrink=(la, shrunk["half"]))

        y_ref = down_shrink(y["full"])().clone()
        report("down moe_gemm + pair shrink, half tails", down_shrink(y["half"]), y_ref, T * k, flops)
        report("down gluon + pair shrink", lambda: mg.moe_down_gluon(
            act_s, w_d, y["gluon"], slotted, k, weights, pair_shrink=(la, shrunk["gluon"])), y_ref, T * k, flops)
        same = torch.equal(shrunk["gluon"], shrunk["half"])  # every pair has an adapter: every row written
        print(f"  pair shrink gluon vs moe_gemm: {'bit for bit' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
