"""`lora-eval compare` on the GPU at a real model's shape, and what its run folder's parts cost.

A random-weight Qwen3-30B-A3B (48 layers by default, bf16) with one rank-16 all-linear adapter (experts and router
included), and a reference of SAMPLES samples (lengths 128-2048, half under the adapter, random logprobs: this
measures time, not agreement). After a warm-up run (graphs captured, nothing written), compare runs into a run
folder in rounds, alternating
  parts      the default: a part every 256 samples or 30 s (lora_eval/runfolder.py)
  one part   LORA_EVAL_PART_ITEMS / _SECONDS so large that the only part is written at the end
and reports per run the forward phase (which includes writing the parts), the time spent writing parts, the whole
command, and the overhead of the parts = median forward(parts) / median forward(one part) - 1.

    python benchmarks/compare_gpu.py [--layers 48] [--samples 1024] [--rounds 3] [--out DIR]
    (a dry run on the CPU: --device cpu --dtype float32 --config TINY.json --samples 32)

The weights are made on the device and shared with our model (lora_eval.bench), no checkpoint is written; the run
folder's fingerprint then covers the config (the engine is given).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from lora_eval import Engine, compare
from lora_eval.adapters import load_adapter
from lora_eval.bench import make_peft_adapters, random_hf_model, random_reference, read_model_config
from lora_eval.engine import EngineOptions
from lora_eval.models import load_model_from_tensors

POLICIES = {"parts": {}, "one part": {"LORA_EVAL_PART_ITEMS": str(10**12), "LORA_EVAL_PART_SECONDS": "1e12"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=None, help="Write the table as CSV here.")
    args = parser.parse_args()
    options = EngineOptions(device=args.device, dtype=args.dtype).resolved()
    dev, dtype = torch.device(options.device), getattr(torch, options.dtype)
    config = read_model_config(args.config, args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = tmp / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        t0 = time.perf_counter()
        hf = random_hf_model(config, dtype, dev, seed=0)
        model = load_model_from_tensors(config, hf.state_dict(), dtype, dev, where=args.config)
        peft_model, _ = make_peft_adapters(hf, ["adapter"], 16, "all", seed=0)
        peft_model.save_pretrained(tmp / "peft")
        del peft_model, hf
        engine = Engine(model, [load_adapter(tmp / "peft" / "adapter", "adapter", model)])
        ref = random_reference(tmp / "ref.parquet", args.samples, config["vocab_size"], seed=1)
        print(f"built in {time.perf_counter() - t0:.1f} s; {args.samples} samples, "
              f"{sum(len(x) for x in pd.read_parquet(ref)['input_ids']):,} tokens", flush=True)
        run = dict(options=options, batch_tokens=args.batch_tokens, quiet=True, engine=engine, notice=lambda _: None)
        compare(folder, references=[ref], **run)  # warm-up: graphs captured, nothing written
        for i in range(args.rounds):
            for policy, env in POLICIES.items():
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    out = tmp / f"run-{i}-{policy.replace(' ', '-')}"
                    t0 = time.perf_counter()
                    result = compare(folder, references=[ref], out=out, **run)
                    wall = time.perf_counter() - t0
                finally:
                    for k, v in saved.items():
                        if v is None:
                            del os.environ[k]
                        else:
                            os.environ[k] = v
                timings, work = result.run["timings"], result.run["work"]
                rows.append(dict(round=i, policy=policy, forward_s=timings["forward_s"], parts_s=work["parts_s"],
                                 command_s=wall, tokens_per_s=result.run["tokens_per_s"],
                                 replays=(result.run["cuda_graphs"] or {}).get("replays")))
                print(pd.Series(rows[-1]).to_dict(), flush=True)
    frame = pd.DataFrame(rows)
    medians = frame.groupby("policy", sort=False)[["forward_s", "parts_s", "command_s", "tokens_per_s"]].median()
    overhead = medians.loc["parts", "forward_s"] / medians.loc["one part", "forward_s"] - 1
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{config['num_hidden_layers']} layers, {options.dtype} on {device}, torch {torch.__version__}")
    print(medians.to_string())
    print(f"parts overhead on the forward phase: {100 * overhead:+.2f}% (median of {args.rounds} rounds); "
          f"time writing parts: {100 * medians.loc['parts', 'parts_s'] / medians.loc['parts', 'forward_s']:.2f}% "
          "of the forward phase")
    if args.out:
        frame.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
