"""LoRA overhead of one fused MoE layer (Qwen3-30B-A3B shapes, 4 rank-16 adapters, CUDA-graph replays) under the
per-block shrink's settings in kernels/fused_moe.py: its adapter slots side by side in one pass or one pass per
slot (ALL_SLOTS_MAX) and its launch settings (SHRINK_WARPS, SHRINK_STAGES); for 4 adapters mixed in the
shared-outer layout and for 1 adapter with per-expert factors (PEFT's layout). (Slicing aligned blocks into
16-64-row shrink programs was measured with an earlier version of this script and dropped: BENCHMARKS.md.)

    python benchmarks/moe_lora_variants.py [--tokens 64,1024,2048,4096,16384]
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.adapters.stack import ExpertLoRA
from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.dense_lora import lora_metadata

from moe_layer import SLOTS, inputs, layer_weights  # benchmarks/ is the script's folder

VARIANTS = {  # name: module settings
    "side-by-side (kept)": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=4, SHRINK_STAGES=3),
    "per-slot": dict(ALL_SLOTS_MAX=0, SHRINK_WARPS=4, SHRINK_STAGES=3),
    "8 warps": dict(ALL_SLOTS_MAX=128, SHRINK_WARPS=8, SHRINK_STAGES=3),
}


def per_expert(lora, g):
    """The same adapters with gate_up A and down B per expert (PEFT's target_parameters layout): every pair's
    shrink runs in the per-block kernel."""
    S, _, R2, H = lora.gate_up_A.shape
    E = lora.gate_up_B.shape[1]
    return ExpertLoRA(gate_up_A=(0.02 * torch.randn(S, E, R2, H, generator=g, device="cuda")).to(torch.bfloat16),
                      gate_up_B=lora.gate_up_B, down_A=lora.down_A,
                      down_B=(0.02 * torch.randn(S, E, H, lora.down_B.shape[3], generator=g, device="cuda"))
                      .to(torch.bfloat16), slots=lora.slots)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="64,1024,2048,4096,16384")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, shared_outer = layer_weights(g)
    kept = {name: getattr(fm, name) for name in VARIANTS["side-by-side (kept)"]}
    cases = {"4 adapters mixed, shared-outer": (shared_outer, "mixed"),
             "1 adapter, per-expert A and B": (per_expert(shared_outer, g), "one")}
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w = inputs(T, g)
        base = triton.testing.do_bench_cudagraph(lambda: fm.fused_moe(x, ids, w, w_gu, w_d), rep=100,
                                                 return_mode="median")
        for case, (lora, rows) in cases.items():
            slots = (torch.randint(0, SLOTS, (T,), generator=g, device="cuda") if rows == "mixed"
                     else torch.zeros(T, dtype=torch.long, device="cuda"))
            meta = lora_metadata(slots, SLOTS)
            cells = []
            for name, settings in VARIANTS.items():
                for key, value in settings.items():
                    setattr(fm, key, value)
                call = lambda: fm.fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta)  # noqa: E731
                call()  # compile outside the capture
                ms = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
                cells.append(f"{name} {ms / base:.3f}")
            for key, value in kept.items():
                setattr(fm, key, value)
            print(f"M={T} {case}: base {base:.4f} ms; LoRA overhead: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
