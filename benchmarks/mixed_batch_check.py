"""Stress check of issue #23's property: on the GPU (bf16, the Triton backend), a row with no adapter in a batch with
adapter rows is bit-equal to the same row in a batch run with no adapters loaded.

For several tiny Qwen3-MoE models (random session seeds, plus the two of the issue's failures) and many random
batches (2-10 rows of 1-40 tokens, each row an adapter of the set or none, in random places, at least one none),
eagerly and by CUDA-graph replay, per adapter set (which ops' LoRA variants are involved: PEFT all-linear with
the router, per-expert Tinker layout, heads only): counts the batches with a no-adapter row that differs, and names
the first (layer, point) where one differs (eager). --switches also runs each MoE launch setting switched off (to
localise a defect), handing the engine that table through Forward.moe_configs. --batch-invariant checks the
stronger property of that mode (issue #23 item 2): every row, adapter or none, bit-equal to the same row run alone
(the random batches shuffle, split and pad it). Exit status 1 when any row differs. Prints one line per case and
writes the CSV after each (a run stopped by a time limit keeps the cases it finished).

The cause it found (BENCHMARKS.md "Mixed-batch check"): the router's LoRA expand ran inside the top-k kernel, whose
softmax then summed in the dot's layout; rows without an adapter got routing weights a last bit apart.

    python benchmarks/mixed_batch_check.py --models 6 --batches 100 --modes eager,graphs --out check.csv
    python benchmarks/mixed_batch_check.py --dims wide --models 2 --batches 50   (real attention and expert widths)
    python benchmarks/mixed_batch_check.py --batch-invariant --models 6 --batches 100
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
from lora_eval.engine.forward import Forward
from lora_eval.kernels.tiles import MOE_CONFIGS
from lora_eval.models import load_model
from tests.builders import random_sequences, save_random_model
from tests.conftest import MOE_OVERRIDES
from tests.test_engine_gpu import VOCAB, make_adapters

ADAPTER_SETS = {"all": ("peft", "heads", "tinker"), "experts-shared-outer": ("tinker",), "peft-all-linear": ("peft",),
                "heads": ("heads",)}
SWITCHES = ("half_tail", "expand_first", "pair_shrink", "w_tma", "gluon", "sorted_act")
KNOWN_FAILURES = (843810942, 1714229363)  # session seeds of issue #23
# --dims wide: Qwen3-30B-A3B's attention and expert widths (hidden 2048, 32 heads of 128, 4 KV heads, experts of
# 768) with 32 experts, top-4: the kernels' tiles and layouts as at the real model, where a summation order that
# depends on a kernel variant shows (the tiny model's heads of 8 fit one thread's registers)
DIMS = {"tiny": MOE_OVERRIDES,
        "wide": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4)}


def configs_without(switch: str | None) -> dict | None:
    """The shipped MoE launch table (MOE_CONFIGS) with `switch` (or "all") off; None (the table itself) for none."""
    if switch is None:
        return None
    if switch == "all":
        return {k: dataclasses.replace(c, **{s: False for s in SWITCHES}) for k, c in MOE_CONFIGS.items()}
    return {k: dataclasses.replace(c, **{switch: False}) for k, c in MOE_CONFIGS.items()}


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


def random_tags(rng: random.Random, rows: int, names: tuple) -> list:
    """Each row an adapter of `names` or none (two in five), in random places; at least one row of none."""
    tags = [rng.choice(names) if names and rng.random() < 0.6 else None for _ in range(rows)]
    tags[rng.randrange(rows)] = None
    return tags


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=6)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--modes", default="eager,graphs", help="eager and/or graphs (CUDA-graph replay)")
    parser.add_argument("--switches", action="store_true", help="also each MoE launch setting switched off")
    parser.add_argument("--out", default="mixed_batch_check.csv")
    parser.add_argument("--dims", default="tiny", choices=sorted(DIMS), help="the models' widths (see DIMS)")
    parser.add_argument("--device", default="cuda", help="cpu: the torch backend (a check of this script only)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engines in the batch-invariant mode; every row against itself run alone")
    args = parser.parse_args()
    invariant = args.batch_invariant
    seeds = list(KNOWN_FAILURES)[:args.models] + [random.SystemRandom().randrange(2**31)
                                                   for _ in range(args.models - len(KNOWN_FAILURES))]
    cases = [(a, None) for a in ADAPTER_SETS] + ([("all", "all")] + [("all", s) for s in SWITCHES]
                                                 if args.switches else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for session_seed in seeds:
            root = Path(tmp) / str(session_seed)
            model_dir = save_random_model(root / "model", "qwen3_moe", seed=session_seed, **DIMS[args.dims])
            adapter_dirs = make_adapters(model_dir, root, session_seed)
            model = load_model(model_dir, dtype=torch.bfloat16, device=args.device)
            batch_seeds = [random.SystemRandom().randrange(2**31) for _ in range(args.batches)]
            for mode in args.modes.split(","):
                graphs = mode == "graphs"
                for adapter_set, switch in cases + [("base-vs-base", None)]:
                    Forward.moe_configs = configs_without(switch)  # every forward of both engines (graphs too)
                    names = ADAPTER_SETS.get(adapter_set, ())
                    engine = Engine(model, [load_adapter(adapter_dirs[n], n, model) for n in names],
                                    cuda_graphs=graphs, batch_invariant=invariant)
                    plain = Engine(model, [], cuda_graphs=graphs)  # the same settings, no adapters
                    bad_batches, bad_rows, max_diff, t0, where = 0, 0, 0.0, time.perf_counter(), "-"
                    for seed in batch_seeds:
                        rng = random.Random(seed)
                        n = rng.randint(2, 10)
                        seqs = random_sequences(n, VOCAB, seed=seed, max_len=40)
                        tags = random_tags(rng, n, names)
                        mixed = engine.logprobs(Batch(seqs, tags))
                        if invariant:  # every row against itself alone
                            alone = [engine.logprobs(Batch([s], [t]))[0] for s, t in zip(seqs, tags)]
                        else:
                            alone = plain.logprobs(Batch(seqs, [None] * n))
                        diffs = [(a - b).abs().max().item() for t, a, b in zip(tags, mixed, alone)
                                 if t is None or invariant]
                        bad = sum(d > 0 for d in diffs)
                        if bad and where == "-" and not graphs and not invariant:
                            where = first_difference(engine, plain, seqs, tags)
                        bad_batches += bad > 0
                        bad_rows += bad
                        max_diff = max(max_diff, *diffs)
                    row = dict(session_seed=session_seed, dims=args.dims, mode=mode, invariant=invariant,
                               adapters=adapter_set,
                               switched_off=switch or "-",
                               batches=len(batch_seeds), bad_batches=bad_batches, bad_rows=bad_rows,
                               max_abs_diff=max_diff, first_difference=where,
                               seconds=round(time.perf_counter() - t0, 1))
                    rows.append(row)
                    print(row, flush=True)
                    pd.DataFrame(rows).to_csv(args.out, index=False)  # so far: a run cut off by a time limit keeps it
                    del engine, plain
            Forward.moe_configs = None
            del model
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out, index=False)
    print(frame.groupby(["mode", "adapters", "switched_off"])[["batches", "bad_batches", "bad_rows", "max_abs_diff"]]
          .agg({"batches": "sum", "bad_batches": "sum", "bad_rows": "sum", "max_abs_diff": "max"}).to_string())
    checked = int(frame.loc[frame["switched_off"] == "-", "batches"].sum())
    failed = int(frame.loc[frame["switched_off"] == "-", "bad_batches"].sum())
    print(f"{checked} batches checked (models x batches x adapter sets x modes, base-vs-base included), "
          f"{failed} with a differing {'row' if invariant else 'no-adapter row'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
