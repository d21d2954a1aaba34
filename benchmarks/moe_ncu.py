"""One MoE layer under Nsight Compute: base and one per-expert rank-16 adapter (PEFT's layout), Qwen3-30B-A3B
shapes, one call each inside torch.cuda.profiler's range (the warm-up calls outside it).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section LaunchStats -k regex:moe_gemm python benchmarks/moe_ncu.py [--tokens 4096]

Kernels in order: base gate_up, base down, LoRA gate_up, LoRA down (the shrink kernels are not moe_gemm).
"""

from __future__ import annotations

import argparse

import torch

from lora_eval.kernels.dense_lora import lora_metadata
from lora_eval.kernels.fused_moe import fused_moe

from moe_layer import SLOTS, inputs, layer_weights  # benchmarks/ is the script's folder
from moe_variants import per_expert


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, shared_outer = layer_weights(g)
    lora = per_expert(shared_outer, g)
    x, ids, w = inputs(args.tokens, g)
    slots = torch.zeros(args.tokens, dtype=torch.long, device="cuda")
    meta = lora_metadata(slots, SLOTS)
    calls = [lambda: fused_moe(x, ids, w, w_gu, w_d),
             lambda: fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta)]
    for call in calls:
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
