"""Where a whole forward's GPU time goes, by kernel (torch.profiler), for the engine on a random-weight model of a
real config's shape (a few layers), base and with one rank-16 all-linear adapter on every row.

    python benchmarks/forward_profile.py [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 4]
                                         [--batch 4x1024] [--top 25]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lora_eval.adapters import load_adapter
from lora_eval.bench import make_peft_adapters, parse_batch, random_hf_model, read_model_config
from lora_eval.engine import Batch, Engine
from lora_eval.models import load_model_from_tensors


def kernel_table(call, calls: int = 3) -> tuple[dict[str, float], float]:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times[ev.name[:70]] += ev.device_time / 1000 / calls
    return times, sum(times.values())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", default="4x1024")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows, length = parse_batch(args.batch)
    config = read_model_config(args.config, args.layers)
    dev = torch.device("cuda")
    hf = random_hf_model(config, torch.bfloat16, dev, seed=0)
    model = load_model_from_tensors(config, hf.state_dict(), torch.bfloat16, dev, where=args.config)
    ids = torch.randint(0, config["vocab_size"], (rows, length)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, ["a0"], 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model
        adapter = load_adapter(Path(tmp) / "a0", "a0", model)
    for name, engine, tags in (("base", Engine(model, [], cuda_graphs=False), [None] * rows),
                               ("lora-1", Engine(model, [adapter], cuda_graphs=False), ["a0"] * rows)):
        times, total = kernel_table(lambda: engine.logprobs(Batch(ids, tags)))
        print(f"\n== {name}: {total:.2f} ms of GPU kernels per forward ({args.layers} layers, {args.batch})")
        for kernel, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{ms:9.3f} ms  {100 * ms / total:5.1f}%  {kernel}")


if __name__ == "__main__":
    main()
