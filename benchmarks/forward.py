"""The whole forward on a random-weight model of a real config's shape: where its GPU time goes, kernel by kernel
(`profile`), and whether a change pays end to end (`variants`, an A/B of patched settings in one process).

    python benchmarks/forward.py profile [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 4]
                                         [--batch 4x1024] [--top 25] [--replay] [--prefix 600]
    python benchmarks/forward.py variants [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 24]
                                          [--batch 1x128 --batch 4x1024] [--rounds 7] [--out FILE.csv]
    (a dry run on the CPU, either: TRITON_INTERPRET=1 python benchmarks/forward.py OP --device cpu --dtype float32
     --backend triton --config TINY.json --batch 2x16; the times then mean nothing)

`profile` (was forward_profile.py): the engine base and with one rank-16 all-linear adapter on every row. Per case:
GPU kernel time by kernel name per `Engine.logprobs` call — of an eager call, or with --replay inside the CUDA-graph
replay (then also the replay's span from first kernel start to last kernel end and the idle time between kernels).
Before that: the experts each layer's routing touches (a random-weight model routes deeper layers to fewer
experts), the bytes a forward must read at least (dense and lm_head weights + every touched expert's weights once)
and that floor at the measured device copy bandwidth, beside the measured call times (replay and eager, median of
7). Random token ids (seed 0). On the CPU the table is of torch ops' own CPU time instead. --prefix P: every row
continues one shared P-token prefix, as an MMLU batch of one subject (issue #24), scored as MMLU scores
(`next_token_logprobs`: lm_head at each row's last position only): the prefix pass runs once, in the warm-up, and the
timed calls compute the rows' own tokens against it (eagerly: graphs hold no prefixes).

`variants` (was forward_variants.py): 4 rank-16 PEFT adapters on every linear projection (as `lora-eval bench`),
each variant's engine captured while its patches are in force (a CUDA graph keeps the kernels it was captured with),
then all (variant, batch, case) calls timed in interleaved rounds, each round starting one variant later, so that
clock drift and a variant's place in the round hit every variant alike. The first variant is the reference; a
variant is a list of (module or class, attribute, replacement) patches. Edit VARIANTS to measure a new one.

Findings: BENCHMARKS-history.md sections 2 and 3.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pandas as pd
import torch
import triton
from torch.profiler import ProfilerActivity, profile

import lora_eval.kernels.fused_moe as fused_moe_module
from lora_eval.adapters import load_adapter
from lora_eval.tasks.bench import (make_peft_adapters, measure, parse_batch, random_hf_model, read_model_config,
                                   text_config)
from lora_eval.engine.engine import Batch, Engine
from lora_eval.engine.forward import Forward
from lora_eval.kernels import dense_lora, fused_moe
from lora_eval.kernels.tiles import MOE_CONFIGS
from lora_eval.models import load_model_from_tensors

# ------------------------------------------------------------------------------------------------------- profile

CHOICES = [32, 33, 34, 35]  # profile --prefix: the candidate tokens scored at each row's last position


def kernel_table(call, device: torch.device) -> tuple[dict[str, float], float, float]:
    """({kernel name: ms}, span ms, idle ms) of one profiled call, after one call outside the profiler. On the CPU:
    torch ops by their own CPU time, the span the call's wall time, no idle time."""
    call()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            call()
        span = (time.perf_counter() - t0) * 1000
        times = defaultdict(float)
        for ev in prof.key_averages():
            times[ev.key[:70]] += ev.self_cpu_time_total / 1000
        return times, span, 0.0
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def recorded_routes():
    """Per fused MoE call while inside: (experts touched, most pairs on one expert). Syncs: a diagnostic only. Only
    the Triton backend's fused MoE is recorded (the torch backend's reference is not)."""
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


def copy_bandwidth_gbs(device: torch.device) -> float:
    a = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    if device.type == "cuda":
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    else:
        b.copy_(a)
        t0 = time.perf_counter()
        b.copy_(a)
        ms = (time.perf_counter() - t0) * 1000
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


def run_profile(args, dev: torch.device, dtype: torch.dtype):
    batches = args.batch or ["4x1024"]
    rows, length = parse_batch(batches[0])
    config = read_model_config(args.config, args.layers)
    hf = random_hf_model(config, dtype, dev, seed=0)
    tensors = hf.state_dict()
    model = load_model_from_tensors(config, tensors, dtype, dev, where=args.config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text_config(config)["vocab_size"], (rows, length), generator=g).tolist()
    shared = torch.randint(0, text_config(config)["vocab_size"], (args.prefix,), generator=g).tolist()
    ids = [shared + row for row in ids]
    prefixes = [args.prefix] * rows if args.prefix else None

    def score(engine: Engine, tags: list) -> torch.Tensor:
        """One call: with --prefix as MMLU scores (lm_head at each row's last position only), else every logprob."""
        if args.prefix:
            return engine.next_token_logprobs(Batch(ids, tags, prefixes), CHOICES)
        return torch.stack(engine.logprobs(Batch(ids, tags, prefixes)))
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, ["a0"], 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model
        adapter = load_adapter(Path(tmp) / "a0", "a0", model)
    with recorded_routes() as routes:
        score(Engine(model, [], backend=args.backend, cuda_graphs=False), [None] * rows)
    floor_ms = floor_report(tensors, config, routes, copy_bandwidth_gbs(dev))
    for name, adapters, tags in (("base", [], [None] * rows), ("lora-1", [adapter], ["a0"] * rows)):
        calls = {}
        for graphs in (True, False):
            engine = Engine(model, adapters, backend=args.backend, cuda_graphs=graphs)
            calls[graphs] = lambda engine=engine, tags=tags: score(engine, tags)
        replay, eager = (measure(calls[g], dev, warmup=2, repeat=7).seconds * 1000 for g in (True, False))
        times, span, idle = kernel_table(calls[args.replay], dev)
        total = sum(times.values())
        after = f" after a {args.prefix}-token prefix" if args.prefix else ""
        print(f"\n== {name} ({args.layers} layers, {batches[0]}{after}): call {replay:.2f} ms replayed, {eager:.2f} ms eager "
              f"({eager / replay:.2f}x); {replay / floor_ms:.2f}x the weight-read floor")
        print(f"   {'inside a replay' if args.replay else 'eager call'}: {total:.2f} ms of "
              f"{'GPU kernels' if dev.type == 'cuda' else 'torch ops (self CPU time)'}, span {span:.2f} ms, idle "
              f"between kernels {idle:.2f} ms")
        for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{ms:9.3f} ms  {100 * ms / total:5.1f}%  {kernel}")
        del calls
    touched = [t for t, _ in routes]
    print("(per-call medians of 7 after 2 warm-ups; "
          + (f"{statistics.median(touched):.0f} experts touched per layer in the median)" if touched else
             "no fused MoE call recorded: not the Triton backend)"))


# ------------------------------------------------------------------------------------------------------ variants

_moe_sum = fused_moe.moe_sum


def _sum_then_add(y, lora=None, residual=None):
    out = _moe_sum(y, lora)  # [T, H]
    return out if residual is None else residual + out


VARIANTS = {  # the changes of the seventh session (BENCHMARKS-history.md section 3), each undone on its own
    "kept": [],
    "dense shrink unsplit": [(dense_lora, "shrink_splits", lambda *args: 1)],
    "residual added after the MoE sum": [(fused_moe, "moe_sum", _sum_then_add)],
    "MoE shrink default tiles": [(Forward, "moe_configs", {n: replace(c, shrink={}) for n, c in MOE_CONFIGS.items()})],
}


def run_variants(args, dev: torch.device, dtype: torch.dtype):
    batches = args.batch or ["1x128", "4x1024"]
    config = read_model_config(args.config, args.layers)
    hf = random_hf_model(config, dtype, dev, seed=0)
    model = load_model_from_tensors(config, hf.state_dict(), dtype, dev, where=args.config)
    names = [f"a{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, names, 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model, hf
        adapters = [load_adapter(Path(tmp) / name, name, model) for name in names]
    generator = torch.Generator().manual_seed(0)
    vocab = text_config(config)["vocab_size"]
    ids = {b: torch.randint(0, vocab, parse_batch(b), generator=generator).tolist() for b in batches}
    calls, engines = {}, []
    for variant, patches in VARIANTS.items():
        with contextlib.ExitStack() as stack:
            for module, name, value in patches:
                stack.enter_context(mock.patch.object(module, name, value))
            engine = Engine(model, adapters, backend=args.backend, cuda_graphs=True)
            engines.append(engine)
            for b in batches:
                for case, tag in (("base", None), ("lora-1", names[0])):
                    batch = Batch(ids[b], [tag] * len(ids[b]))
                    call = calls[variant, b, case] = lambda e=engine, batch=batch: torch.stack(e.logprobs(batch))
                    call(), call()  # captured now, under this variant's patches
    # Without CUDA graphs (the CPU) a call runs whatever is patched when it runs: the variants then time the same code
    reference = {(b, case): calls["kept", b, case]() for b in batches for case in ("base", "lora-1")}
    times = {key: [] for key in calls}
    order = list(VARIANTS)
    for r in range(args.rounds):
        for variant in order[r % len(order):] + order[:r % len(order)]:
            for key in [key for key in calls if key[0] == variant]:
                times[key].append(measure(calls[key], dev, warmup=1, repeat=5).seconds * 1000)
    rows = []
    for (variant, b, case), values in times.items():
        out = calls[variant, b, case]()
        rows.append(dict(variant=variant, batch=b, case=case, median_ms=round(statistics.median(values), 3),
                         min_ms=round(min(values), 3),
                         max_abs_diff_vs_kept=(out - reference[b, case]).abs().max().item()))
    frame = pd.DataFrame(rows)
    kept = frame[frame.variant == "kept"].set_index(["batch", "case"]).median_ms
    frame["vs_kept"] = [round(r.median_ms / kept[r.batch, r.case], 4) for r in frame.itertuples()]
    pd.set_option("display.width", 200)
    print(f"{args.layers} layers, {args.rounds} rounds of 5 {'replays' if dev.type == 'cuda' else 'calls'}")
    print(frame.to_string(index=False))
    if args.out:
        frame.to_csv(args.out, index=False)


# ---------------------------------------------------------------------------------------------------------- main

def main():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    common.add_argument("--batch", action="append", default=None, help="ROWSxLENGTH (profile: the first)")
    common.add_argument("--device", default="cuda")
    common.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    common.add_argument("--backend", default=None, help="the engine's (default: triton on a GPU, torch elsewhere)")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = parser.add_subparsers(dest="op", required=True)
    p = ops.add_parser("profile", parents=[common], help="GPU time by kernel of one forward, and its weight-read floor")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--replay", action="store_true", help="profile inside CUDA-graph replays")
    p.add_argument("--prefix", type=int, default=0, help="every row continues one shared prefix of this many tokens")
    p = ops.add_parser("variants", parents=[common], help="A/B of patched settings on the whole forward")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = parser.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    {"profile": run_profile, "variants": run_variants}[args.op](args, dev, dtype)


if __name__ == "__main__":
    main()
