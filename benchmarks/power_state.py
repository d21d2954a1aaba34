"""One MoE layer's time with the GPU's clocks free and at its power limit: ours (Triton, base) against transformers'
grouped_mm experts module, Qwen3-30B-A3B shapes (benchmarks/moe_layer.py's layer and inputs).

    python benchmarks/power_state.py [--tokens 4096,8192,16384] [--seconds 3] [--out power.csv]

Each case is captured once in a CUDA graph and timed three ways: `burst` (single replays after a 2 s idle pause,
before the board's power limit pulls the clocks down), `sustained` (replays back to back for --seconds; the median
of the last third, when the clocks have settled) and `do_bench` (triton.testing.do_bench_cudagraph, the protocol of
moe_layer.py, which lands somewhere between). nvidia-smi samples the SM clock and board power meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import pandas as pd
import torch
import triton

from lora_eval.kernels.fused_moe import fused_moe

from moe_layer import inputs, layer_weights, transformers_layer  # benchmarks/ is the script's folder


class Sampler:
    """nvidia-smi's SM clock (MHz) and board power (W), every 50 ms, while in a `with` block."""

    def __enter__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out = self.proc.communicate()[0]
        self.samples = [tuple(float(v) for v in line.split(",")) for line in out.splitlines() if line.count(",") == 1]

    def medians(self, last_fraction: float = 1 / 3) -> tuple[float, float]:
        tail = self.samples[-max(1, int(len(self.samples) * last_fraction)):] or [(float("nan"),) * 2]
        return statistics.median(s[0] for s in tail), statistics.median(s[1] for s in tail)


def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph, n: int) -> list[float]:
    """Per-replay ms of n back-to-back replays (CUDA events)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def measure(fn, seconds: float) -> dict:
    graph = capture(fn)
    torch.cuda.synchronize()
    time.sleep(2.0)
    burst = statistics.median(replay_ms(graph, 6)[1:])
    per_call = burst / 1000
    with Sampler() as sampler:
        times = replay_ms(graph, max(30, int(seconds / per_call)))
    sustained = statistics.median(times[-len(times) // 3:])
    clock, power = sampler.medians()
    bench = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return dict(burst_ms=burst, sustained_ms=sustained, do_bench_ms=bench, sustained_sm_mhz=clock,
                sustained_power_w=power)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, _ = layer_weights(g)
    reference, reference_name = transformers_layer(w_gu, w_d)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w = inputs(T, g)
        for impl, fn in (("ours", lambda: fused_moe(x, ids, w, w_gu, w_d)),
                         ("grouped_mm", lambda: reference(x, ids, w))):
            rows.append(dict(tokens=T, impl=impl, **measure(fn, args.seconds)))
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    wide = table.pivot(index="tokens", columns="impl")
    for col in ("burst_ms", "sustained_ms", "do_bench_ms"):
        wide[("speed-up", col.removesuffix("_ms"))] = wide[(col, "grouped_mm")] / wide[(col, "ours")]
    print(f"grouped_mm = {reference_name}")
    with pd.option_context("display.width", 250):
        print(wide.to_string(float_format=lambda v: f"{v:.3f}"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
