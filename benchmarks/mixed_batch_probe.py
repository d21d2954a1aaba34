"""Probe of issue #23's defect (retire once its finding is written down in BENCHMARKS.md): on the GPU, a row with
no adapter in a mixed bf16 batch is sometimes not bit-equal to the same row run with no adapters loaded.

For several tiny Qwen3-MoE models (random session seeds, plus the two of the issue's failures) and many random
batches, counts the batches with a no-adapter row that differs, per adapter set (which op's LoRA variant is
involved) and per MoE launch setting switched off (which setting makes a row depend on its neighbours); also
base against base (run to run). Prints one line per case and writes a CSV.

    python benchmarks/mixed_batch_probe.py --models 6 --batches 40 --out probe.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from lora_eval import Batch, Engine
from lora_eval.adapters import load_adapter
from lora_eval.forward import Forward
from lora_eval.kernels import fused_moe
from lora_eval.models import load_model
from tests.builders import random_sequences, save_random_model
from tests.conftest import MOE_OVERRIDES
from tests.test_engine_gpu import VOCAB, make_adapters

ADAPTER_SETS = {"all": ("peft", "heads", "tinker"), "experts-shared-outer": ("tinker",), "peft-all-linear": ("peft",),
                "heads": ("heads",)}
SWITCHES = ("half_tail", "expand_first", "pair_shrink", "w_tma", "gluon", "sorted_act")
KNOWN_FAILURES = (843810942, 1714229363)  # session seeds of issue #23


def configs_without(switch: str | None) -> dict:
    if switch is None:
        return dict(fused_moe.CONFIGS)
    if switch == "all":
        return {k: dataclasses.replace(c, **{s: False for s in SWITCHES}) for k, c in fused_moe.CONFIGS.items()}
    return {k: dataclasses.replace(c, **{switch: False}) for k, c in fused_moe.CONFIGS.items()}


def first_difference(engine, plain, seqs, tags) -> str:
    """Both engines' forwards of one batch under the probe: the first (layer, point), in the order the forward
    reports them, where the positions of rows without adapter differ, with the largest difference there."""
    seen = {}
    L = max(len(s) for s in seqs)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, (s, t) in enumerate(zip(seqs, tags)):
        mask[i, :len(s)] = t is None
    mask = mask.reshape(-1)  # [B * L]
    for name, e, row_tags in (("mixed", engine, tags), ("alone", plain, [None] * len(seqs))):
        seen[name] = []
        Forward.probe = staticmethod(  # every Forward of the batch reports to it (a class attribute: not bound)
            lambda layer, point, t, out=seen[name]: out.append((layer, point, t.detach().float().cpu())))
        try:
            e.logprobs(Batch(seqs, row_tags))
        finally:
            Forward.probe = None
    for (layer, point, a), (_, _, b) in zip(seen["mixed"], seen["alone"]):
        if a.shape[0] == mask.shape[0] and not torch.equal(a[mask], b[mask]):
            return f"layer {layer} {point}: max |d| {(a[mask] - b[mask]).abs().max().item():.3g}"
    return "no probed point differs (the difference is after the last layer: norm, lm_head, log-softmax)"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=6)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--graphs", action="store_true", help="replay CUDA graphs instead of running eagerly")
    parser.add_argument("--out", default="mixed_batch_probe.csv")
    parser.add_argument("--device", default="cuda", help="cpu: the torch backend (a check of this script only)")
    args = parser.parse_args()
    original = dict(fused_moe.CONFIGS)
    seeds = list(KNOWN_FAILURES) + [random.SystemRandom().randrange(2**31) for _ in range(args.models - 2)]
    cases = [("all", None), ("all", "all")] + [("all", s) for s in SWITCHES] + \
        [(a, None) for a in ADAPTER_SETS if a != "all"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for session_seed in seeds:
            root = Path(tmp) / str(session_seed)
            model_dir = save_random_model(root / "model", "qwen3_moe", seed=session_seed, **MOE_OVERRIDES)
            adapter_dirs = make_adapters(model_dir, root, session_seed)
            model = load_model(model_dir, dtype=torch.bfloat16, device=args.device)
            batch_seeds = [random.SystemRandom().randrange(2**31) for _ in range(args.batches)]
            for adapter_set, switch in cases + [("base-vs-base", None)]:
                fused_moe.CONFIGS.clear()
                fused_moe.CONFIGS.update(configs_without(switch))
                names = ADAPTER_SETS.get(adapter_set, ())
                engine = Engine(model, [load_adapter(adapter_dirs[n], n, model) for n in names],
                                cuda_graphs=args.graphs) if names else Engine(model, [], cuda_graphs=args.graphs)
                plain = Engine(model, [], cuda_graphs=args.graphs)  # the same settings, no adapters
                bad_batches, bad_rows, max_diff, t0, where = 0, 0, 0.0, time.perf_counter(), "-"
                for seed in batch_seeds:
                    seqs = random_sequences(8, VOCAB, seed=seed, max_len=40)
                    tags = [names[i // 2 % len(names)] if names and i % 2 == 0 else None for i in range(8)]
                    mixed = engine.logprobs(Batch(seqs, tags))
                    alone = plain.logprobs(Batch(seqs, [None] * 8))
                    diffs = [(a - b).abs().max().item() for t, a, b in zip(tags, mixed, alone) if t is None]
                    bad = sum(d > 0 for d in diffs)
                    if bad and where == "-" and not args.graphs:
                        where = first_difference(engine, plain, seqs, tags)
                    bad_batches += bad > 0
                    bad_rows += bad
                    max_diff = max(max_diff, *diffs)
                row = dict(session_seed=session_seed, adapters=adapter_set, switched_off=switch or "-",
                           batches=len(batch_seeds), bad_batches=bad_batches, bad_rows=bad_rows, max_abs_diff=max_diff,
                           first_difference=where, seconds=round(time.perf_counter() - t0, 1), graphs=args.graphs)
                rows.append(row)
                print(row, flush=True)
                del engine, plain
            fused_moe.CONFIGS.clear()
            fused_moe.CONFIGS.update(original)
            del model
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out, index=False)
    print(frame.groupby(["adapters", "switched_off"])[["batches", "bad_batches", "bad_rows", "max_abs_diff"]]
          .agg({"batches": "sum", "bad_batches": "sum", "bad_rows": "sum", "max_abs_diff": "max"}).to_string())


if __name__ == "__main__":
    main()
