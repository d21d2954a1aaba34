"""A/B of fused-MoE settings in one process: one MoE layer at Qwen3-30B-A3B shapes (CUDA-graph replays, rounds
interleaved so that drift hits every variant alike), base and with LoRA (4 rank-16 adapters mixed in the
shared-outer layout; 1 adapter with per-expert factors, PEFT's layout). A variant is a dict of settings: a
lower-case key is a field of the MoeConfig pick_config gives (e.g. half_tail), an upper-case key a constant of
kernels/fused_moe.py (e.g. ALL_SLOTS_MAX). The first variant is the reference. Edit VARIANTS to measure a new one.
`--baseline FILE`: a kernels/fused_moe.py of another commit (`git show REV:kernels/fused_moe.py > FILE`), measured
as one more variant, so that a code change is A/B'd in one process too.

    python benchmarks/moe_variants.py [--tokens 1024,4096,8192] [--rounds 3] [--variants kept,...] [--baseline FILE]
                                      [--out FILE.csv]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace

import pandas as pd
import torch
import triton

from lora_eval.adapters.stack import ExpertLoRA
from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.dense_lora import lora_metadata

from moe_layer import E, K_TOP, SLOTS, inputs, layer_weights  # benchmarks/ is the script's folder

VARIANTS = {  # name: settings (the switches measured in the fifth session, BENCHMARKS.md section 1)
    "kept": {},
    "no half-height tail blocks": dict(half_tail=False),
    "expand after the main loop": dict(expand_first=False),
    "down shrink kernel": dict(pair_shrink=False),
    "base GEMMs in Triton (no Gluon)": dict(gluon=False),
    "Gluon GEMMs (block-ordered activation)": dict(sorted_act=True, gluon=True),
}


def per_expert(lora, g):
    """The same adapters with gate_up A and down B per expert (PEFT's target_parameters layout): every pair's
    shrink runs in the per-block kernel."""
    S, _, R2, H = lora.gate_up_A.shape
    E = lora.gate_up_B.shape[1]
    return ExpertLoRA(gate_up_A=(0.02 * torch.randn(S, E, R2, H, generator=g, device="cuda")).to(torch.bfloat16),
                      gate_up_B=lora.gate_up_B, down_A=lora.down_A,
                      down_B=(0.02 * torch.randn(S, E, H, lora.down_B.shape[3], generator=g, device="cuda"))
                      .to(torch.bfloat16), slots=lora.slots)


def load_baseline(path: str):
    """kernels/fused_moe.py of another commit as module lora_eval.kernels.fused_moe_baseline (its relative imports
    resolve to this tree's kernels)."""
    spec = importlib.util.spec_from_file_location("lora_eval.kernels.fused_moe_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def applied(settings: dict, T: int):
    """(module, MoeConfig) of `settings` at T tokens; sets the module's constants (the caller restores them).
    The key "module" picks another fused_moe module (--baseline)."""
    module = settings.get("module", fm)
    for key, value in settings.items():
        if key.isupper():
            setattr(module, key, value)
    fields = {k: v for k, v in settings.items() if not k.isupper() and k != "module"}
    return module, replace(module.pick_config(T, K_TOP, E), **fields)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1024,4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=None, help="names of VARIANTS to measure (comma-separated; default all)")
    parser.add_argument("--baseline", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.variants:
        for name in set(VARIANTS) - set(args.variants.split(",")):
            del VARIANTS[name]
    if args.baseline:
        VARIANTS[f"baseline {args.baseline}"] = dict(module=load_baseline(args.baseline))
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, shared_outer = layer_weights(g)
    constants = {k for v in VARIANTS.values() for k in v if k.isupper()}
    kept = {name: getattr(fm, name) for name in constants}
    cases = {"base": (None, None), "lora 4 mixed shared-outer": (shared_outer, "mixed"),
             "lora 1 per-expert": (per_expert(shared_outer, g), "one")}
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x, ids, w = inputs(T, g)
        calls = {}
        for case, (lora, kind) in cases.items():
            slots = None if lora is None else (torch.randint(0, SLOTS, (T,), generator=g, device="cuda")
                                               if kind == "mixed" else torch.zeros(T, dtype=torch.long, device="cuda"))
            meta = None if lora is None else lora_metadata(slots, SLOTS)
            calls[case] = (lora, slots, meta)
        times = {}
        for r in range(args.rounds):
            for name, settings in VARIANTS.items():
                module, config = applied(settings, T)
                for case, (lora, slots, meta) in calls.items():
                    call = lambda: module.fused_moe(x, ids, w, w_gu, w_d, lora, slots, config=config,  # noqa: E731
                                                lora_meta=meta)
                    call()  # compile outside the capture
                    ms = triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")
                    times.setdefault((name, case), []).append(ms)
                for key, value in kept.items():
                    setattr(fm, key, value)
        for name in VARIANTS:
            base = min(times[(name, "base")])
            for case in cases:
                ms = min(times[(name, case)])
                rows.append(dict(tokens=T, variant=name, case=case, ms=ms, over_own_base=ms / base,
                                 over_ref_variant=ms / min(times[(next(iter(VARIANTS)), case)]),
                                 spread=(max(times[(name, case)]) - ms) / ms))
        table = pd.DataFrame([r for r in rows if r["tokens"] == T])
        print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"), flush=True)
    if args.out:
        pd.DataFrame(rows).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
