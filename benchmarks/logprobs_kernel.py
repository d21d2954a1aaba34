"""The fused lm_head + log-softmax + gather (kernels/logprobs.py) at Qwen3-30B-A3B's lm_head (H 2048, V 151936,
bf16) by launch settings, against cuBLAS computing only the logits (hidden @ weight.T) and against the weight's
read floor; CUDA-graph replays, median ms.

    python benchmarks/logprobs_kernel.py [--rows 128,1024,4096,8192]
"""

from __future__ import annotations

import argparse

import torch
import triton

from lora_eval.kernels import logprobs as lp

H, V = 2048, 151936
SETTINGS = {  # name: module constants of kernels/logprobs.py
    "pointers": dict(TMA=False),
    "tma": dict(TMA=True),
    "tma, 4 stages": dict(TMA=True, NUM_STAGES=4),
    "tma, BLOCK_V 128": dict(TMA=True, BLOCK_V=128),
}


def time_graph(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="128,1024,4096,8192")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (0.02 * torch.randn(V, H, generator=g, device="cuda")).to(torch.bfloat16)
    kept = {name: getattr(lp, name) for settings in SETTINGS.values() for name in settings}
    floor_ms = weight.numel() * 2 / 3.0e12 * 1e3
    for N in [int(n) for n in args.rows.split(",")]:
        hidden = torch.randn(N, H, generator=g, device="cuda").to(torch.bfloat16)
        targets = torch.randint(0, V, (N,), generator=g, device="cuda")
        cublas = time_graph(lambda: hidden @ weight.T)
        row = [f"N={N}: cuBLAS logits {cublas:.3f} ms ({2 * N * H * V / cublas / 1e9:.0f} TFLOP/s), weight read "
               f"floor {floor_ms:.3f}"]
        reference = None
        for name, settings in SETTINGS.items():
            for key, value in settings.items():
                setattr(lp, key, value)
            try:
                ms = time_graph(lambda: lp.token_logprobs(hidden, weight, targets))
                out = lp.token_logprobs(hidden, weight, targets)
                reference = out if reference is None else reference
                row.append(f"{name} {ms:.3f} ({cublas / ms:.2f}x cuBLAS, max diff {(out - reference).abs().max():.1e})")
            except Exception as e:  # noqa: BLE001 - a setting that does not fit
                row.append(f"{name}: {type(e).__name__}")
            finally:
                for key, value in kept.items():
                    setattr(lp, key, value)
        print("\n  ".join(row))


if __name__ == "__main__":
    main()
