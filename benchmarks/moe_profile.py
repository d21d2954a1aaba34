"""Where one MoE layer's time goes, kernel by kernel (torch.profiler's CUDA kernel times), base and with LoRA,
at Qwen3-30B-A3B shapes (E=128, top-8, H=2048, I=768, bf16; rank 16, 4 adapters, shared-outer layout).

    python benchmarks/moe_profile.py [--tokens 64,1024,16384] [--out FILE.csv]

Prints, per M and variant, the mean GPU time per layer call of each kernel name.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from lora_eval.kernels.dense_lora import lora_metadata
from lora_eval.kernels.fused_moe import fused_moe

from moe_layer import SLOTS, inputs, layer_weights  # benchmarks/ is the script's folder

CALLS = 20


def kernel_times(fn) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times[ev.name[:60]] += ev.device_time / 1000 / CALLS  # ms per call
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,1024,16384")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, lora = layer_weights(g)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w = inputs(T, g)
        slots = torch.randint(0, SLOTS, (T,), generator=g, device="cuda")
        meta = lora_metadata(slots, SLOTS)
        for variant, fn in (("base", lambda: fused_moe(x, ids, w, w_gu, w_d)),
                            ("lora", lambda: fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta))):
            for name, ms in kernel_times(fn).items():
                rows.append(dict(tokens=T, variant=variant, kernel=name, ms=ms))
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(table.pivot_table(index=["tokens", "kernel"], columns="variant", values="ms", aggfunc="sum")
              .to_string(float_format=lambda v: f"{v:.4f}"))
        print(table.groupby(["tokens", "variant"])["ms"].sum().to_string(float_format=lambda v: f"{v:.4f}"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
