"""`lora-eval mmlu` on the GPU at a real model's shape: the full 5-shot MMLU test set (14,042 questions) through a
random-weight Qwen3-30B-A3B (48 layers, bf16) with one rank-16 all-linear adapter (experts and router included;
--adapters N: N of them), base and adapters in one pass. Random weights score at chance, so this measures time, not accuracy. With
--both-prefix-modes the same engine then runs again with the shared-prefix cache off (--no-prefix-cache), and the
two runs' log-probabilities of A-D are set side by side (the GPU's bf16 agreement of prefix reuse, issue #24).

    python benchmarks/mmlu_gpu.py --data DIR [--layers 48] [--subjects a,b] [--both-prefix-modes] [--out DIR]
    (a dry run on the CPU: --device cpu --dtype float32 --config TINY.json --subjects ...)

--profile runs the same task once more (prefix cache emptied, kernels already compiled) under torch.profiler and
writes OUT/profile.txt: the device's kernel time against the wall time, split into the prefix passes, the
questions' forwards and the rest, and the top operators by device and by host time (where MMLU's time goes).

The model has no tokenizer of its own here: a byte-level BPE (32k) trained on the MMLU text itself stands in
(prompts come out about as long as with a real 150k-vocabulary tokenizer: see the printed mean length). The
weights are made on the device and shared with our model (lora_eval.tasks.bench), no checkpoint is written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lora_eval import mmlu
from lora_eval.adapters import load_adapter
from lora_eval.tasks.bench import make_peft_adapters, random_hf_model, read_model_config, text_config
from lora_eval.tasks.demo import build_tokenizer
from lora_eval.engine.engine import Engine, EngineOptions
from lora_eval.models import load_model_from_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--config", default="benchmarks/configs/Qwen3-30B-A3B.json")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--subjects", default=None)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--adapters", type=int, default=1, help="how many adapters (issue #24: 1 and 4)")
    parser.add_argument("--out", default="mmlu-gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--both-prefix-modes", action="store_true",
                        help="run again without the shared-prefix cache and compare the two runs")
    parser.add_argument("--profile", action="store_true", help="then once more under torch.profiler (profile.txt)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the prefix-cache task this many times on the same engine (the later ones: kernels "
                             "compiled and loaded, prefix cache emptied; out/prefix-2 ...)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    config = read_model_config(args.config, args.layers)
    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        texts = [line for f in sorted(Path(args.data).glob("*/*.csv")) for line in f.read_text().splitlines()]
        build_tokenizer(folder, vocab_size=32768, texts=texts)
        hf = random_hf_model(config, dtype, dev, seed=0)
        model = load_model_from_tensors(config, hf.state_dict(), dtype, dev, where=args.config)
        names = ["adapter"] if args.adapters == 1 else [f"adapter{i}" for i in range(args.adapters)]
        peft_model, _ = make_peft_adapters(hf, names, 16, "all", seed=0)
        peft_model.save_pretrained(Path(tmp) / "peft")
        del peft_model, hf
        engine = Engine(model, [load_adapter(Path(tmp) / "peft" / name, name, model) for name in names])
        build_s = time.perf_counter() - t0
        modes = [True] * args.rounds + ([False] if args.both_prefix_modes else [])
        results = {}
        for n, prefix_cache in enumerate(modes, 1):
            engine.prefix_cache.clear()
            t1 = time.perf_counter()
            out = Path(args.out) / (("prefix" if n == 1 else f"prefix-{n}") if prefix_cache else "full")
            out.parent.mkdir(parents=True, exist_ok=True)
            results[prefix_cache] = mmlu(
                folder, data=args.data, out=out, shots=5, subjects=args.subjects,
                options=EngineOptions(device=args.device, dtype=args.dtype, prefix_cache=prefix_cache),
                batch_tokens=args.batch_tokens, quiet=True, overwrite=True, engine=engine)
            report(results[prefix_cache], config, dev, build_s, time.perf_counter() - t1, prefix_cache)
        if args.profile:
            profiled(engine, folder, args, Path(args.out))
    if len(results) == 2:
        a, b = (results[m].questions for m in (True, False))
        lp = [f"lp_{x}" for x in "ABCD"]
        d = (a[lp].to_numpy() - b[lp].to_numpy())
        print(f"prefix cache vs full prompts: {d.size} log-probabilities, max |d| {abs(d).max():.3g}, "
              f"mean |d| {abs(d).mean():.3g}, identical {bool((d == 0).all())}; predictions differ on "
              f"{int((a['prediction'] != b['prediction']).sum())} of {len(a)} (model, question) rows")


def profiled(engine, folder, args, out: Path):
    """The prefix-cache run again under torch.profiler, its prefix passes and question forwards labelled."""
    engine.prefix_cache.clear()
    labelled = {}
    for name, label in (("_prefix_entries", "prefix passes"), ("_forward", "forwards"),
                        ("next_token_logprobs", "task batches")):
        method = getattr(Engine, name)
        labelled[name] = method

        def wrapped(*a, _method=method, _label=label, **k):
            with record_function(_label):
                return _method(*a, **k)
        setattr(Engine, name, wrapped)
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            mmlu(folder, data=args.data, out=out / "profiled", shots=5, subjects=args.subjects,
                 options=EngineOptions(device=args.device, dtype=args.dtype), batch_tokens=args.batch_tokens,
                 quiet=True, overwrite=True, engine=engine)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        wall = time.perf_counter() - t0
    finally:
        for name, method in labelled.items():
            setattr(Engine, name, method)
    events = prof.key_averages()
    labels = ("prefix passes", "forwards", "task batches")  # (their device times are the kernels' again)
    kernels = sum(e.self_device_time_total for e in events if e.device_type.name != "CPU" and e.key not in labels)
    kernels /= 1e6
    ranges = {e.key: e for e in events if e.key in labels}
    lines = [f"wall {wall:.2f} s under the profiler; device kernels {kernels:.2f} s ({kernels / wall:.0%} busy)"]
    lines += [f"{k}: host {e.cpu_time_total / 1e6:.2f} s, device {e.device_time_total / 1e6:.2f} s, {e.count} calls"
              for k, e in ranges.items()]
    lines += ["", events.table(sort_by="self_device_time_total", row_limit=30),
              events.table(sort_by="self_cpu_time_total", row_limit=30)]
    (out / "profile.txt").write_text("\n".join(lines))
    print("\n".join(lines[:4]))


def report(result, config, dev, build_s, wall_s, prefix_cache):
    run = result.run
    line = dict(prefix_cache=prefix_cache, adapters=len(run["arguments"]["adapters"]), task_s=run["timings"]["total_s"],
                questions=run["questions"], rows=run["rows"], batches=run["batches"],
                prompt_tokens_mean=run["prompts"]["tokens_mean"], padding_waste=run["padding_waste"],
                tokens_full_prompts=run.get("tokens_full_prompts"), tokens_computed=run.get("tokens_computed"),
                forward_s=run["timings"]["forward_s"], load_s=run["timings"].get("load_s"),
                questions_per_s=run["questions_per_s"],
                full_prompt_tokens_per_s=run["prompts"]["tokens_mean"] * run["rows"] / run["timings"]["forward_s"],
                build_s=build_s, wall_s=wall_s, graphs=run["cuda_graphs"],
                layers=text_config(config)["num_hidden_layers"],
                device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__)
    print(pd.Series(line).to_string())
    print(result.summary.to_string(index=False))

if __name__ == "__main__":
    main()
