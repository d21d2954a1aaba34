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

from lora_eval.kernels.fused_moe import moe_gemm, moe_lora_shrink, pick_config
from lora_eval.kernels.moe_align import moe_align

from moe_tiles import E, H, I, K_TOP, gemm_inputs, time_graph  # benchmarks/ is the script's folder


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    T = parser.parse_args().tokens
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    t = gemm_inputs(T, g)
    w_gu, w_d, x, ids, w, act = (t[k] for k in ("w_gu", "w_d", "x", "ids", "w", "act"))
    factor = lambda *shape: (0.02 * torch.randn(*shape, generator=g, device="cuda")).to(bf)  # noqa: E731
    a_gu, b_gu, a_d, b_d = factor(1, E, 32, H), factor(1, E, 2 * I, 32), factor(1, E, 16, I), factor(1, E, H, 16)
    config = pick_config(T, K_TOP, E)
    out_gu = torch.empty(T * K_TOP, I, device="cuda", dtype=bf)
    out_d = torch.empty(T * K_TOP, H, device="cuda", dtype=bf)
    layout = dict(half_tail=config.half_tail, w_tma=config.w_tma)

    def gemms(align, lora=None, **kw):
        gu = dict(lora_B=b_gu, shrunk=lora[0]) if lora else {}
        dn = dict(lora_B=b_d, shrunk=lora[1]) if lora else {}
        gate_up = lambda: moe_gemm(x, w_gu, out_gu, align, gated=True, rows_are_tokens=True, top_k=K_TOP,  # noqa: E731
                                   config=config.tiles("gate_up"), **layout, **kw, **gu)
        down = lambda: moe_gemm(act, w_d, out_d, align, gated=False, rows_are_tokens=False, top_k=K_TOP,  # noqa: E731
                                topk_weights=w, config=config.tiles("down"), **layout, **kw, **dn)
        return 1000 * time_graph(gate_up), 1000 * time_graph(down)  # µs

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
