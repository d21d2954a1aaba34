"""What a reference's temperature and routed experts cost compare's forward (issue 45): `Engine.logprobs` calls at a
real config's shape (random weights, one rank-16 all-linear PEFT adapter on every row), timed interleaved:

  plain         the logprobs as before
  temperature   a temperature per row (the fused logprob kernel divides each row's logits)
  routes        the experts each MoE layer chose, recorded by the graph (captured with its routing kept) and
                gathered per predicted position to the host beside the logprobs
  routes-eager  the same recorded eagerly (no graph), as a batch that no captured graph holds

    python benchmarks/routes_temperature.py [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 8]
                                            [--batch 4x1024] [--rounds 7]

Prints one line per case: median ms per call and tokens/s, and the graph pool's bytes with and without routes kept.
Results: BENCHMARKS.md ("Current figures") and BENCHMARKS-history.md section 23.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lora_eval.adapters import load_adapter
from lora_eval.engine.engine import Batch, Engine
from lora_eval.models import load_model_from_tensors
from lora_eval.tasks.bench import make_peft_adapters, parse_batch, random_hf_model, read_model_config, text_config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", default="4x1024")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows, length = parse_batch(args.batch)
    config = read_model_config(args.config, args.layers)
    hf = random_hf_model(config, dtype, dev, seed=0)
    model = load_model_from_tensors(config, hf.state_dict(), dtype, dev, where=args.config)
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, ["a"], 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model, hf
        adapter = load_adapter(Path(tmp) / "a", "a", model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text_config(config)["vocab_size"], (rows, length), generator=g).tolist()
    tags = ["a"] * rows
    plain, routed = Engine(model, [adapter]), Engine(model, [adapter])
    routed.expect([(rows, length, True)], routes=True)
    eager = Engine(model, [adapter], cuda_graphs=False)
    calls = {
        "plain": lambda: plain.logprobs(Batch(ids, tags)),
        "temperature": lambda: plain.logprobs(Batch(ids, tags, temperatures=[0.7] * rows)),
        "routes": lambda: routed.logprobs(Batch(ids, tags, routes=True)),
        "routes-eager": lambda: eager.logprobs(Batch(ids, tags, routes=True)),
    }
    for call in calls.values():  # warm-up: compiles, graph captures
        call(), call()
    times = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
        for name in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            calls[name]()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    tokens = rows * length
    print(f"{args.config} at {args.layers} layers, {args.batch}, bf16, one rank-16 all-linear adapter, "
          f"{torch.cuda.get_device_name(dev)}")
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:13s} {t * 1000:8.2f} ms  {tokens / t:10,.0f} tok/s  {t / base:5.3f}x plain")
    print(f"graph pool: plain {plain.graph_stats()['graph_memory_bytes'] / 2**20:.0f} MiB, with routes kept "
          f"{routed.graph_stats()['graph_memory_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
