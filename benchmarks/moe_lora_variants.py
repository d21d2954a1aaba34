"""LoRA overhead of one fused MoE layer (Qwen3-30B-A3B shapes, 4 rank-16 adapters, CUDA-graph replays) under the
per-block shrink's settings in kernels/fused_moe.py: its adapter slots side by side in one pass or one pass per
slot (ALL_SLOTS_MAX), and its launch settings (SHRINK_WARPS, SHRINK_STAGES, SHRINK_SMEM).

    python benchmarks/moe_lora_variants.py [--tokens 64,1024,2048,4096,16384]
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.dense_lora import lora_metadata

from moe_layer import SLOTS, inputs, layer_weights  # benchmarks/ is the script's folder

VARIANTS = {  # name: module settings
    "side-by-side (kept)": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=4, SHRINK_STAGES=3, SHRINK_SMEM=160 * 1024),
    "per-slot": dict(ALL_SLOTS_MAX=0, SHRINK_WARPS=4, SHRINK_STAGES=3, SHRINK_SMEM=160 * 1024),
    "8 warps": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=8, SHRINK_STAGES=3, SHRINK_SMEM=160 * 1024),
    "4 stages": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=4, SHRINK_STAGES=4, SHRINK_SMEM=200 * 1024),
    "2 stages": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=4, SHRINK_STAGES=2, SHRINK_SMEM=100 * 1024),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,1024,2048,4096,16384")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, lora = layer_weights(g)
    kept = {name: getattr(fm, name) for name in VARIANTS["side-by-side (kept)"]}
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w = inputs(T, g)
        slots = torch.randint(0, SLOTS, (T,), generator=g, device="cuda")
        meta = lora_metadata(slots, SLOTS)
        base = triton.testing.do_bench_cudagraph(lambda: fm.fused_moe(x, ids, w, w_gu, w_d), rep=100,
                                                 return_mode="median")
        cells = []
        for name, settings in VARIANTS.items():
            for key, value in settings.items():
                setattr(fm, key, value)
            call = lambda: fm.fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta)  # noqa: E731
            call()  # compile outside the capture
            cells.append(f"{name} {triton.testing.do_bench_cudagraph(call, rep=100, return_mode='median') / base:.3f}")
        for key, value in kept.items():
            setattr(fm, key, value)
        print(f"M={T}: base {base:.4f} ms; LoRA overhead: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
