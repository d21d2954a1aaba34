#!/usr/bin/env bash
# The user's whole job on one GPU (issue #24 item 5): a random-weight Qwen3-30B-A3B-shaped checkpoint written to disk
# (JOB_LAYERS, 24: 30 GB; 48 layers are 61 GB and the one-GPU machine's disk is 64 GiB) with one rank-16 all-linear
# adapter and a reference of JOB_SAMPLES (128: ~140k tokens) samples, then through the CLI, each command twice (a
# machine's first run compiles into Triton's on-disk cache; the second is the warm figure):
#   lora-eval compare   the reference, default batch size
#   lora-eval mmlu      the full 5-shot test split (MMLU: the release, default .mmlu-data)
#   lora-eval bench     the same model built in memory, 4 x 1024 (the forward's yardstick)
# and with JOB_MEMORY=1 the 48-layer MMLU on a model built in memory (benchmarks/mmlu_gpu.py), with 1 and 4 adapters;
# JOB_PROBE=0 leaves out the load probe below.
# Prints issue #24's ratios (job_summary.txt): compare's forward against bench's tokens/s, metrics + write against
# the forward, load GB/s from the page cache, the warm command against 1.3 x (load + forward) + 3 s, MMLU's command.
# Results: $OUT/job.tgz (run records, logs, the summary; one file, as the device tool returns at most 8).
#   bash benchmarks/job.sh
# A dry run on the CPU: JOB_CONFIG=TINY.json JOB_LAYERS=2 JOB_SAMPLES=8 WRITE_ARGS="--device cpu" \
#   DEVICE_ARGS="--device cpu" MMLU_LIMIT=2 bash benchmarks/job.sh   (TINY.json: configs/Qwen3-30B-A3B.json made small)
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/lora-eval-job}
MMLU=${MMLU:-.mmlu-data}
CONFIG=${JOB_CONFIG:-benchmarks/configs/Qwen3-30B-A3B.json}
RES=$OUT/job
mkdir -p "$RES" "$WORK"
[ -n "${DEVICE_ARGS:-}" ] || source benchmarks/gpu_setup.sh > /dev/null
export PYTHONUNBUFFERED=1 CI=true
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; df -h /tmp | tail -n 1; } 2>&1 | tee "$RES/env.txt"

timed() {  # $1: log name; the rest: the command. Appends "<log> <seconds> <rc>" to times.txt
  local log=$1; shift
  local t0; t0=$(date +%s%N)
  "$@" > "$RES/$log.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf "%s %d.%03d %d\n" "$log" $((ms / 1000)) $((ms % 1000)) "$rc" | tee -a "$RES/times.txt"; }

[ -f "$WORK/reference.parquet" ] || timed write python3 benchmarks/write_checkpoint.py --config "$CONFIG" \
    --layers "${JOB_LAYERS:-24}" --samples "${JOB_SAMPLES:-128}" --tokenizer-from "$MMLU" --out "$WORK" ${WRITE_ARGS:-}
# where loading's time goes (#24 item 3: 5 GB/s from the page cache wanted), each a second time so the files are cached:
# our loader (load_model; its first run in a fresh process, CUDA's start included, printed too), the engine's load
# split into its parts (the adapter read and checked, the weights, the adapters stacked on the device: compare's load
# phase is these), and the raw rates beneath: a safetensors tensor per copy to the device (what the loader does), the
# files read into one pinned buffer, and that buffer to the device
if [ "${JOB_PROBE:-1}" != 0 ]; then  # (JOB_PROBE=0: the commands alone)
timed load_probe python3 - "$WORK/model" "$WORK/peft/adapter" ${DEVICE_ARGS:+cpu} <<'PY'
import sys, time
from pathlib import Path
import torch
from safetensors import safe_open
from lora_eval.engine.engine import Engine, read_adapters
from lora_eval.models import load_model
folder, adapter = Path(sys.argv[1]), sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
files = sorted(folder.glob("*.safetensors"))
size = sum(f.stat().st_size for f in files)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
def rate(name, fn):
    for run in ("first", "second"):  # the first reads the files into the page cache
        t0 = time.perf_counter(); fn(); sync(); s = time.perf_counter() - t0
        print(f"{name}, {run} run: {s:.2f} s, {size / 1e9 / s:.2f} GB/s ({size / 1e9:.1f} GB)")
rate("load_model (bf16)", lambda: load_model(folder, dtype=torch.bfloat16, device=device))
for run in ("first", "second"):
    t0 = time.perf_counter(); parsed = read_adapters(folder, {"adapter": adapter}); t1 = time.perf_counter()
    model = load_model(folder, dtype=torch.bfloat16, device=device); sync(); t2 = time.perf_counter()
    engine = Engine(model, parsed); sync(); t3 = time.perf_counter()
    print(f"engine load, {run} run: adapter read {t1 - t0:.2f} s, weights {t2 - t1:.2f} s, engine with the adapter "
          f"stacked {t3 - t2:.2f} s")
    del engine, model
def per_tensor():
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                h.get_tensor(k).to(device)
rate("per tensor .to(device)", per_tensor)
biggest = max(f.stat().st_size for f in files)
pinned = torch.empty(biggest, dtype=torch.uint8, pin_memory=device == "cuda")
def read_pinned():
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            fh.readinto(memoryview(pinned.numpy())[:f.stat().st_size])
rate("files read into one pinned buffer", read_pinned)
rate("pinned buffer to the device, once per file", lambda: [pinned[:f.stat().st_size].to(device, non_blocking=True)
                                                           for f in files])
PY
fi
MODEL=(--model "$WORK/model" --adapter "adapter=$WORK/peft/adapter")
LIMIT=(); [ -n "${MMLU_LIMIT:-}" ] && LIMIT=(--limit "$MMLU_LIMIT")
for run in cold warm; do
  timed "compare_$run" lora-eval compare "${MODEL[@]}" --reference "$WORK/reference.parquet" --max-k2 1e9 --quiet \
      --out "$WORK/compare_$run" ${DEVICE_ARGS:-}
  timed "mmlu_$run" lora-eval mmlu "${MODEL[@]}" --data "$MMLU" "${LIMIT[@]}" --quiet --out "$WORK/mmlu_$run" \
      ${DEVICE_ARGS:-}
done
timed bench lora-eval bench --config "$CONFIG" --layers "${JOB_LAYERS:-24}" --skip-hf --adapters 1 --batch 4x1024 \
    --repeat 7 --quiet --out "$RES/bench.csv" ${DEVICE_ARGS:-}
for r in compare_cold compare_warm mmlu_cold mmlu_warm; do cp "$WORK/$r/run.json" "$RES/$r.json" 2>/dev/null; done
if [ -n "${JOB_MEMORY:-}" ]; then
  for n in 1 4; do
    timed "mmlu48_$n" python3 benchmarks/mmlu_gpu.py --data "$MMLU" --adapters "$n" --out "$WORK/mmlu48_$n"
    cp "$WORK/mmlu48_$n/prefix/run.json" "$RES/mmlu48_$n.json" 2>/dev/null
  done
fi

python3 - "$RES" "$WORK/model" <<'PY' 2>&1 | tee "$RES/job_summary.txt"
import json, sys
from pathlib import Path
import pandas as pd
res, model = Path(sys.argv[1]), Path(sys.argv[2])
wall = {line.split()[0]: float(line.split()[1]) for line in (res / "times.txt").read_text().splitlines()}
size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
runs = {p.stem: json.loads(p.read_text()) for p in res.glob("*.json")}
for name, run in sorted(runs.items()):
    print(f"{name}: command {wall.get(name, float('nan')):.1f} s; " + ", ".join(f"{k} {v:.2f}" for k, v in run["timings"].items()))
bench = pd.read_csv(res / "bench.csv") if (res / "bench.csv").exists() else None
lora = None if bench is None else bench[(bench["system"] == "ours") & (bench["case"] == "lora-1")]
c = runs.get("compare_warm")
if c is not None:
    t = c["timings"]
    print(f"compare (warm): {c['tokens_computed']:,} tokens computed, forward {c['tokens_per_s']:,.0f} tokens/s"
          + ("" if lora is None or lora.empty else
             f" = {c['tokens_per_s'] / lora['tokens_per_s'].iloc[0]:.2f} x bench's lora-1 {lora['tokens_per_s'].iloc[0]:,.0f} (goal >= 0.80)"))
    rest = t.get("read_s", 0) + t.get("metrics_s", 0) + t.get("write_s", 0)
    print(f"  read + metrics + write {rest:.2f} s = {rest / t['forward_s']:.2f} x the forward (goal <= 0.25)")
    print(f"  load {size / 1e9:.1f} GB in {t['load_s']:.2f} s = {size / 1e9 / t['load_s']:.2f} GB/s (goal >= 5)")
    bound = 1.3 * (t["load_s"] + t["forward_s"]) + 3
    print(f"  whole command {wall['compare_warm']:.1f} s against 1.3 x (load + forward) + 3 = {bound:.1f} s")
m = runs.get("mmlu_warm")
if m is not None:
    print(f"mmlu (warm): whole command {wall['mmlu_warm']:.1f} s (goal <= 45 on 24 layers); tokens computed "
          f"{m['tokens_computed'] / m['tokens_full_prompts']:.1%} of the full prompts (goal <= 25%)")
for n, goal in ((1, 60), (4, 120)):
    r = runs.get(f"mmlu48_{n}")
    if r is not None:
        print(f"mmlu, 48 layers in memory, {n} adapter(s): task {r['timings']['total_s']:.1f} s (goal <= {goal})")
PY
tar -czf "$OUT/job.tgz" -C "$OUT" job && rm -rf "$RES"
