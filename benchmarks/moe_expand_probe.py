"""Where the per-expert LoRA expand's cost inside the grouped GEMMs (kernels/fused_moe.moe_gemm) comes from, at
Qwen3-30B-A3B shapes (PEFT's per-expert factors: gate_up rank 32, down rank 16; one adapter; bf16; CUDA-graph
replays, median µs). Each GEMM is timed four ways with the LoRA variant compiled in — every row under the adapter
(the expand runs) or under none (the same code, the expand skipped: only the kernel's LoRA prologue and its
register cost remain), the expand before or after the main loop — and twice without LoRA (the base kernel, two
rounds: their spread is the noise floor).

    python benchmarks/moe_expand_probe.py [--tokens 4096]
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.kernels.fused_moe import moe_gemm, moe_lora_shrink, pick_config
from lora_eval.kernels.moe_align import moe_align

E, K_TOP, H, I = 128, 8, 2048, 768


def time_graph(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    T = parser.parse_args().tokens
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(bf)
    w_d = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(bf)
    x = torch.randn(T, H, generator=g, device="cuda").to(bf)
    ids = torch.topk(torch.randn(T, E, generator=g, device="cuda"), K_TOP).indices
    w = torch.full((T * K_TOP,), 1.0 / K_TOP, device="cuda", dtype=bf)
    act = torch.randn(T * K_TOP, I, generator=g, device="cuda").to(bf)  # [P, I]
    factor = lambda *shape: (0.02 * torch.randn(*shape, generator=g, device="cuda")).to(bf)  # noqa: E731
    a_gu, b_gu, a_d, b_d = factor(1, E, 32, H), factor(1, E, 2 * I, 32), factor(1, E, 16, I), factor(1, E, H, 16)
    config = pick_config(T, K_TOP, E)
    out_gu = torch.empty(T * K_TOP, I, device="cuda", dtype=bf)
    out_d = torch.empty(T * K_TOP, H, device="cuda", dtype=bf)
    layout = dict(half_tail=config.half_tail, w_tma=config.w_tma)

    def gemms(align, lora=None, **kw):
        gu = dict(lora_B=b_gu, shrunk=lora[0]) if lora else {}
        dn = dict(lora_B=b_d, shrunk=lora[1]) if lora else {}
        return (time_graph(lambda: moe_gemm(x, w_gu, out_gu, align, gated=True, rows_are_tokens=True, top_k=K_TOP,
                                            config=config.tiles("gate_up"), **layout, **kw, **gu)),
                time_graph(lambda: moe_gemm(act, w_d, out_d, align, gated=False, rows_are_tokens=False, top_k=K_TOP,
                                            topk_weights=w, config=config.tiles("down"), **layout, **kw, **dn)))

    for name, slot in (("every row under the adapter", 0), ("no row under it (expand skipped)", -1)):
        align = moe_align(ids, E, config.block_m, torch.full((T,), slot, dtype=torch.int32, device="cuda"), 1)
        shrunk = (moe_lora_shrink(x, a_gu, align, rows_are_tokens=True, top_k=K_TOP),
                  moe_lora_shrink(act, a_d, align, rows_are_tokens=False, top_k=K_TOP))
        for first in (True, False):
            gu, dn = gemms(align, shrunk, expand_first=first)
            print(f"T={T} LoRA variant, {name}, expand {'before' if first else 'after'} the main loop: "
                  f"gate_up {gu:.1f} us, down {dn:.1f} us", flush=True)
    align = moe_align(ids, E, config.block_m)
    for i in range(2):
        gu, dn = gemms(align)
        print(f"T={T} base kernel, round {i + 1}: gate_up {gu:.1f} us, down {dn:.1f} us", flush=True)


if __name__ == "__main__":
    main()
