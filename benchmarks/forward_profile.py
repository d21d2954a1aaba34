"""Where a whole forward's GPU time goes, by kernel (torch.profiler), for the engine on a random-weight model of a
real config's shape, base and with one rank-16 all-linear adapter on every row — and how far the forward is from
its weight-read floor.

    python benchmarks/forward_profile.py [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 4]
                                         [--batch 4x1024] [--top 25] [--replay]

Per case: GPU kernel time by kernel name per `Engine.logprobs` call — of an eager call, or with --replay inside the
CUDA-graph replay (then also the replay's span from first kernel start to last kernel end and the idle time
between kernels). Before that: the experts each layer's routing touches (a random-weight model routes deeper
layers to fewer experts), the bytes a forward must read at least (dense and lm_head weights + every touched
expert's weights once) and that floor at the measured device copy bandwidth, beside the measured call times
(replay and eager, median of 7). Random token ids (seed 0).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import lora_eval.kernels.fused_moe as fused_moe_module
from lora_eval.adapters import load_adapter
from lora_eval.bench import make_peft_adapters, measure, parse_batch, random_hf_model, read_model_config
from lora_eval.engine import Batch, Engine
from lora_eval.models import load_model_from_tensors


def kernel_table(call) -> tuple[dict[str, float], float, float]:
    """({kernel name: ms}, span ms, idle ms) of one profiled call, after one call outside the profiler."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"), key=lambda ev: ev.time_range.start)
    times = defaultdict(float)
    for ev in events:
        times[ev.name[:70]] += ev.device_time / 1000
    span = (events[-1].time_range.end - events[0].time_range.start) / 1000
    idle = sum(max(0, b.time_range.start - a.time_range.end) for a, b in zip(events, events[1:])) / 1000
    return times, span, idle


@contextmanager
def recorded_routes():
    """Per fused MoE call while inside: (experts touched, most pairs on one expert). Syncs: a diagnostic only."""
    routes, original = [], fused_moe_module.fused_moe

    def recording(x, topk_ids, *args, **kwargs):
        counts = torch.bincount(topk_ids.flatten(), minlength=1)
        routes.append((int((counts > 0).sum()), int(counts.max())))
        return original(x, topk_ids, *args, **kwargs)

    fused_moe_module.fused_moe = recording
    try:
        yield routes
    finally:
        fused_moe_module.fused_moe = original


def copy_bandwidth_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    return 2 * a.numel() / ms / 1e6


def floor_report(model_tensors: dict, config: dict, routes: list[tuple[int, int]], bandwidth: float) -> float:
    """Print the routing summary and return the weight-read floor in ms."""
    layer0 = {name: t for name, t in model_tensors.items()
              if name.startswith("model.layers.0.") and ".experts." in name}
    expert_bytes = (sum(t[0].numel() * t.element_size() for t in layer0.values() if t.dim() == 3)  # stacked experts
                    or sum(t.numel() * t.element_size() for name, t in layer0.items() if ".experts.0." in name))
    dense = sum(t.numel() * t.element_size() for name, t in model_tensors.items()
                if ".experts." not in name and "embed_tokens" not in name)
    if "lm_head.weight" not in model_tensors:  # tied: the embedding is the head
        embedding = model_tensors["model.embed_tokens.weight"]
        dense += embedding.numel() * embedding.element_size()
    touched = [t for t, _ in routes]
    floor_bytes = dense + sum(touched) * expert_bytes
    floor_ms = floor_bytes / bandwidth / 1e6
    print(f"experts touched per MoE layer: {touched}")
    print(f"most pairs on one expert:       {[m for _, m in routes]}")
    print(f"weight-read floor: {floor_bytes / 1e9:.2f} GB (dense + lm_head {dense / 1e9:.2f} GB, experts "
          f"{sum(touched) * expert_bytes / 1e9:.2f} GB: {sum(touched)} expert reads of {expert_bytes / 1e6:.1f} MB) "
          f"at {bandwidth:.0f} GB/s copy bandwidth = {floor_ms:.2f} ms")
    return floor_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", default="4x1024")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--replay", action="store_true", help="profile inside CUDA-graph replays")
    args = parser.parse_args()
    rows, length = parse_batch(args.batch)
    config = read_model_config(args.config, args.layers)
    dev = torch.device("cuda")
    hf = random_hf_model(config, torch.bfloat16, dev, seed=0)
    tensors = hf.state_dict()
    model = load_model_from_tensors(config, tensors, torch.bfloat16, dev, where=args.config)
    ids = torch.randint(0, config["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, ["a0"], 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model
        adapter = load_adapter(Path(tmp) / "a0", "a0", model)
    with recorded_routes() as routes:
        Engine(model, [], cuda_graphs=False).logprobs(Batch(ids, [None] * rows))
    floor_ms = floor_report(tensors, config, routes, copy_bandwidth_gbs())
    for name, adapters, tags in (("base", [], [None] * rows), ("lora-1", [adapter], ["a0"] * rows)):
        calls = {}
        for graphs in (True, False):
            engine = Engine(model, adapters, cuda_graphs=graphs)
            calls[graphs] = lambda engine=engine: torch.stack(engine.logprobs(Batch(ids, tags)))
        replay, eager = (measure(calls[g], dev, warmup=2, repeat=7).seconds * 1000 for g in (True, False))
        times, span, idle = kernel_table(calls[args.replay])
        total = sum(times.values())
        print(f"\n== {name} ({args.layers} layers, {args.batch}): call {replay:.2f} ms replayed, {eager:.2f} ms eager "
              f"({eager / replay:.2f}x); {replay / floor_ms:.2f}x the weight-read floor")
        print(f"   {'inside a replay' if args.replay else 'eager call'}: {total:.2f} ms of GPU kernels, span "
              f"{span:.2f} ms, idle between kernels {idle:.2f} ms")
        for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{ms:9.3f} ms  {100 * ms / total:5.1f}%  {kernel}")
        del calls
    print(f"(per-call medians of 7 after 2 warm-ups; {statistics.median([t for t, _ in routes]):.0f} experts touched "
          f"per layer in the median)")


if __name__ == "__main__":
    main()
