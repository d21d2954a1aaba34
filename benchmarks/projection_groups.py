"""Projection groups (models.layers.ProjectionGroup: q / k / v in one weight buffer, one GEMM on the Triton path)
against one GEMM per projection, on a random-weight model of a real config's shape: the attention input's GEMMs
alone (cuBLAS, CUDA-graph replays) and the whole forward (engine replays, both variants captured in one process
and timed in interleaved rounds).

    python benchmarks/projection_groups.py [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 48]
                                           [--batch 1x128 --batch 4x1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton

from lora_eval.bench import measure, parse_batch, random_hf_model, read_model_config
from lora_eval.engine import Batch, Engine
from lora_eval.models import load_model_from_tensors
from lora_eval.models.layers import Linear


def gemms(config: dict, tokens: list[int]) -> None:
    """q, k and v of one layer as three GEMMs and as one."""
    H, D = config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    outs = (config["num_attention_heads"] * D, config["num_key_value_heads"] * D, config["num_key_value_heads"] * D)
    weights = [torch.randn(n, H, device="cuda", dtype=torch.bfloat16) for n in outs]
    joined = torch.cat(weights)
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        apart = triton.testing.do_bench_cudagraph(lambda: [F.linear(x, w) for w in weights], rep=200,
                                                  return_mode="median")
        one = triton.testing.do_bench_cudagraph(lambda: F.linear(x, joined), rep=200, return_mode="median")
        print(f"T={T}: q / k / v GEMMs {1000 * apart:.1f} us apart, {1000 * one:.1f} us as one")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batch", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batches = args.batch or ["1x128", "4x1024"]
    config = read_model_config(args.config, args.layers)
    gemms(config, [128, 512, 4096, 8192])
    dev = torch.device("cuda")
    hf = random_hf_model(config, torch.bfloat16, dev, seed=0)
    model = load_model_from_tensors(config, hf.state_dict(), torch.bfloat16, dev, where=args.config)
    del hf
    generator = torch.Generator().manual_seed(0)
    ids = {b: torch.randint(0, config["vocab_size"], parse_batch(b), generator=generator).tolist() for b in batches}
    groups = {m: m.group for m in model.modules() if isinstance(m, Linear)}
    calls = {}
    for variant in ("one GEMM per group", "one GEMM per projection"):
        for module, group in groups.items():  # a captured graph keeps the variant it was captured in
            module.group = group if variant == "one GEMM per group" else None
        engine = Engine(model, [], cuda_graphs=True)
        for b in batches:
            batch = Batch(ids[b], [None] * len(ids[b]))
            calls[variant, b] = lambda engine=engine, batch=batch: torch.stack(engine.logprobs(batch))
            calls[variant, b]()  # captured now, in this variant
    for module, group in groups.items():
        module.group = group
    times = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            times[key].append(measure(call, dev, warmup=2, repeat=5).seconds * 1000)
    for (variant, b), values in times.items():
        print(f"{b} {variant}: median {statistics.median(values):.2f} ms, min {min(values):.2f} ms "
              f"({args.layers} layers, base rows, replays)")


if __name__ == "__main__":
    main()
