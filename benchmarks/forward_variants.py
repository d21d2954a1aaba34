"""A/B of whole-forward settings in one process: a random-weight model of a real config's shape with 4 rank-16
PEFT adapters on every linear projection (as `lora-eval bench`), each variant's engine captured while its
patches are in force (a CUDA graph keeps the kernels it was captured with), then all (variant, batch, case)
replays timed in interleaved rounds, each round starting one variant later, so that clock drift and a variant's
place in the round hit every variant alike. The first variant is the reference; a variant is a list of (module,
attribute, replacement) patches. Edit VARIANTS to measure a new one.

    python benchmarks/forward_variants.py [--config benchmarks/configs/Qwen3-30B-A3B.json] [--layers 24]
                                          [--batch 1x128 --batch 4x1024] [--rounds 7] [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pandas as pd
import torch

from lora_eval.adapters import load_adapter
from lora_eval.bench import make_peft_adapters, measure, parse_batch, random_hf_model, read_model_config
from lora_eval.engine import Batch, Engine
from lora_eval.kernels import dense_lora, fused_moe
from lora_eval.models import load_model_from_tensors

_moe_sum, _pick_config = fused_moe.moe_sum, fused_moe.pick_config


def _sum_then_add(y, lora=None, residual=None):
    out = _moe_sum(y, lora)  # [T, H]
    return out if residual is None else residual + out


VARIANTS = {  # the changes of the seventh session (BENCHMARKS.md section 3), each undone on its own
    "kept": [],
    "dense shrink unsplit": [(dense_lora, "shrink_splits", lambda *args: 1)],
    "residual added after the MoE sum": [(fused_moe, "moe_sum", _sum_then_add)],
    "MoE shrink default tiles": [(fused_moe, "pick_config", lambda *a, **k: replace(_pick_config(*a, **k), shrink={}))],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", action="append", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = args.batch or ["1x128", "4x1024"]
    dev = torch.device("cuda")
    config = read_model_config(args.config, args.layers)
    hf = random_hf_model(config, torch.bfloat16, dev, seed=0)
    model = load_model_from_tensors(config, hf.state_dict(), torch.bfloat16, dev, where=args.config)
    names = [f"a{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        peft_model, _ = make_peft_adapters(hf, names, 16, "all", seed=0)
        peft_model.save_pretrained(tmp)
        del peft_model, hf
        adapters = [load_adapter(Path(tmp) / name, name, model) for name in names]
    generator = torch.Generator().manual_seed(0)
    ids = {b: torch.randint(0, config["vocab_size"], parse_batch(b), generator=generator).tolist() for b in batches}
    calls, engines = {}, []
    for variant, patches in VARIANTS.items():
        with contextlib.ExitStack() as stack:
            for module, name, value in patches:
                stack.enter_context(mock.patch.object(module, name, value))
            engine = Engine(model, adapters, cuda_graphs=True)
            engines.append(engine)
            for b in batches:
                for case, tag in (("base", None), ("lora-1", names[0])):
                    batch = Batch(ids[b], [tag] * len(ids[b]))
                    call = calls[variant, b, case] = lambda e=engine, batch=batch: torch.stack(e.logprobs(batch))
                    call(), call()  # captured now, under this variant's patches
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
    print(f"{args.layers} layers, {args.rounds} rounds of 5 replays")
    print(frame.to_string(index=False))
    if args.out:
        frame.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
