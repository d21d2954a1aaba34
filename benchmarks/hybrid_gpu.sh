#!/usr/bin/env bash
# Issue 44's figures for the Gated DeltaNet hybrids on one H100, in one device call (under 9 minutes):
#   (a) `lora-eval bench`, Qwen3.5-35B-A3B shape, its first 32 layers (8 periods of 3 Gated DeltaNet + 1 gated
#       attention), 4 x 1024 tokens, one rank-16 all-linear adapter, CUDA graphs: tokens/s of ours (base, lora-1)
#       and of transformers + PEFT at the same depth, ours over theirs (goal >= 3x), the LoRA overhead lora-1 / base
#       (goal <= 1.20);
#   (b) the same on the Qwen3-Next-80B-A3B shape, its first 16 layers;
#   (c) a 24-layer Qwen3.5-35B-A3B-shape checkpoint written to disk as released (benchmarks/write_checkpoint.py
#       --as-released: the vision-language class, text weights under model.language_model., per-expert keys, the
#       vision tower beside them; 43 GB) with one rank-16 all-linear PEFT adapter made on that model and a reference
#       of 128 random samples (~140k tokens), then `lora-eval compare` through the CLI twice (cold: the first
#       process to load it, its kernels mostly compiled by (a) already; warm), each run's phases from its run.json.
# Depths: bench holds one copy of the weights (transformers' and ours share them) beside transformers' 4 x 1024
# logits in float32 (10 GB at Qwen3.5's 248k vocabulary, 6 GB at Qwen3-Next's 152k), PEFT's expert weights merged
# with the adapter per layer and the adapters: 35B-A3B takes 1.69 GB a layer + 2.0 GB outside the layers, so 32
# layers are ~73 GB at transformers' peak (36 would leave ~3 GB of an H100's 80: too close to try inside one call);
# 80B-A3B 3.30 GB a layer + 1.25 GB, so 16 layers are ~70 GB (20 would be ~83). Both sides run at the same depth;
# if one runs out of device memory the bench runs again one period shallower (28, 12), and the summary says so.
# Results in $OUT: hybrid_summary.txt (the compact summary, also printed), hybrid.json (the same figures) and
# hybrid.tgz (bench CSVs and logs, compare run records and logs, env.txt).
#   bash benchmarks/hybrid_gpu.sh
# A dry run on the CPU (tiny widths; the times mean nothing):
#   HYBRID_DRY=1 bash benchmarks/hybrid_gpu.sh
# HYBRID_DRY=1 writes bench.small_config of both configs under $WORK and runs every step on them in float32 with
# 5, 5 and 8 layers and batches of 2 x 64. Step limits: HYBRID_BUDGET_S (default 530) for the whole script; a step
# that would start with too little time left is skipped and named in the summary.
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/lora-eval-hybrid}
RES=$OUT/hybrid
START=$(date +%s)
BUDGET=${HYBRID_BUDGET_S:-530}
mkdir -p "$RES" "$WORK"
export PYTHONUNBUFFERED=1 CI=true
if [ -n "${HYBRID_DRY:-}" ]; then
  python3 - "$WORK" <<'PY'
import json, sys
from pathlib import Path
from lora_eval.tasks.bench import small_config
for name in ("Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B-Instruct"):
    config = json.loads(Path(f"benchmarks/configs/{name}.json").read_text())
    Path(sys.argv[1], f"{name}.json").write_text(json.dumps(small_config(config)))
PY
  CFG_35B=$WORK/Qwen3.5-35B-A3B.json CFG_NEXT=$WORK/Qwen3-Next-80B-A3B-Instruct.json
  LAYERS_35B="5" LAYERS_NEXT="5" CKPT_LAYERS=8 BATCH=2x64 SAMPLES=8
  DEVICE_ARGS="--device cpu --dtype float32" WRITE_DEVICE=cpu
else
  source benchmarks/gpu_setup.sh
  CFG_35B=benchmarks/configs/Qwen3.5-35B-A3B.json CFG_NEXT=benchmarks/configs/Qwen3-Next-80B-A3B-Instruct.json
  LAYERS_35B="32 28" LAYERS_NEXT="16 12" CKPT_LAYERS=24 BATCH=4x1024 SAMPLES=128
  DEVICE_ARGS="--device cuda --dtype bfloat16" WRITE_DEVICE=cuda
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla: not installed"
  date -u; git rev-parse --short HEAD 2>/dev/null; df -h /tmp | tail -n 1; } 2>&1 | tee "$RES/env.txt"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {  # $1: name, $2: seconds it needs at least, $3: its own limit; the rest: the command. Status as the command's
  local name=$1 need=$2 cap=$3; shift 3
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$need" ]; then
    echo "$name skipped: $remaining s left of $BUDGET" | tee -a "$RES/steps.txt"; return 124
  fi
  local limit=$(( cap < remaining ? cap : remaining )) t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1; local rc=$?
  echo "$name rc $rc $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$RES/steps.txt"
  return $rc
}
ran_out() {  # $1: a bench's CSV and log without the suffix. Status 0 where a case or the model ran out of device memory
  if [ -f "$1.csv" ]; then
    python3 -c "import sys, pandas as pd; sys.exit(int(not pd.read_csv(sys.argv[1])['status'].str.startswith('oom').any()))" \
      "$1.csv"
  else
    grep -q "out of device memory" "$1.log"
  fi
}
bench_depths() {  # $1: label, $2: config, $3: layer counts, deepest first (the next only where one ran out of memory)
  local label=$1 config=$2 layers
  for layers in $3; do
    rm -f "$RES/bench_${label}_${layers}L.csv"
    step "bench_${label}_${layers}L" 60 240 lora-eval bench --config "$config" --layers "$layers" --batch "$BATCH" \
      --adapters 1 --rank 16 --targets all $DEVICE_ARGS --repeat 5 --warmup 2 --quiet \
      --out "$RES/bench_${label}_${layers}L.csv"
    ran_out "$RES/bench_${label}_${layers}L" || return
    echo "bench $label: $layers layers ran out of device memory; one period shallower" | tee -a "$RES/steps.txt"
  done
}

bench_depths 35b "$CFG_35B" "$LAYERS_35B"
bench_depths next "$CFG_NEXT" "$LAYERS_NEXT"
rm -rf "$WORK/ckpt"
step write 90 200 python3 benchmarks/write_checkpoint.py --config "$CFG_35B" --layers "$CKPT_LAYERS" --as-released \
  --samples "$SAMPLES" --device "$WRITE_DEVICE" --out "$WORK/ckpt" \
  && du -sh "$WORK/ckpt/model" "$WORK/ckpt/peft" | tee -a "$RES/steps.txt"
for run in cold warm; do
  [ -f "$WORK/ckpt/reference.parquet" ] || break
  step "compare_$run" 45 120 lora-eval compare --model "$WORK/ckpt/model" --adapter "adapter=$WORK/ckpt/peft/adapter" \
    --reference "$WORK/ckpt/reference.parquet" --max-k2 1e9 --quiet --out "$WORK/compare_$run" $DEVICE_ARGS
  cp "$WORK/compare_$run/run.json" "$RES/compare_$run.json" 2>/dev/null
done

python3 - "$RES" "$WORK/ckpt/model" <<'PY' 2>&1 | tee "$OUT/hybrid_summary.txt"
"""The compact summary of the steps that ran, and the same figures as JSON."""
import json, re, sys
from pathlib import Path
import pandas as pd
res, model = Path(sys.argv[1]), Path(sys.argv[2])
steps = (res / "steps.txt").read_text().splitlines() if (res / "steps.txt").exists() else []
seconds = {m[1]: int(m[3]) for m in (re.match(r"(\S+) rc (\d+) (\d+) s", line) for line in steps) if m}
figures = {"env": (res / "env.txt").read_text().splitlines(), "steps": steps}
for csv in sorted(res.glob("bench_*L.csv")):
    frame = pd.read_csv(csv)
    if not (frame["status"] == "ok").all():
        print(f"{csv.stem}: not every case ran: " + "; ".join(f"{r.system} {r.case} {r.status}" for r in
                                                            frame[frame["status"] != "ok"].itertuples()))
        continue
    rows = frame.set_index(["system", "case"])
    ours, hf = rows.loc["ours"], rows.loc["hf"] if "hf" in rows.index.get_level_values(0) else None
    fig = dict(model=frame["model"][0], layers=int(frame["layers"][0]), batch=frame["batch"][0],
               device=frame["device_name"][0],
               ours_base_tokens_per_s=float(ours.loc["base", "tokens_per_s"]),
               ours_lora_tokens_per_s=float(ours.loc["lora-1", "tokens_per_s"]),
               lora_overhead=float(ours.loc["lora-1", "cost_vs_base"]),
               ours_peak_gb=float(ours["peak_mem_gb"].max()), max_abs_diff_vs_hf=float(ours["max_abs_diff"].max()),
               graphs=str(ours.loc["lora-1", "note"]).split(" | ")[-1], seconds=seconds.get(csv.stem))
    if hf is not None:
        fig.update(hf_base_tokens_per_s=float(hf.loc["base", "tokens_per_s"]),
                   hf_lora_tokens_per_s=float(hf.loc["lora-1", "tokens_per_s"]),
                   hf_peak_gb=float(hf["peak_mem_gb"].max()),
                   vs_hf_lora=float(ours.loc["lora-1", "vs_hf"]), vs_hf_base=float(ours.loc["base", "vs_hf"]))
    figures[csv.stem] = fig
    print(f"{fig['model']}, {fig['layers']} layers, {fig['batch']}, one rank-16 all-linear adapter, graphs "
          f"({fig['device']}, step {fig['seconds']} s):")
    print(f"  ours: base {fig['ours_base_tokens_per_s']:,.0f} tok/s, LoRA {fig['ours_lora_tokens_per_s']:,.0f} tok/s;"
          f" LoRA overhead {fig['lora_overhead']:.3f} (goal <= 1.20); peak {fig['ours_peak_gb']:.1f} GB; {fig['graphs']}")
    if hf is not None:
        print(f"  transformers + PEFT: base {fig['hf_base_tokens_per_s']:,.0f} tok/s, LoRA "
              f"{fig['hf_lora_tokens_per_s']:,.0f} tok/s; peak {fig['hf_peak_gb']:.1f} GB")
        print(f"  ours / theirs: LoRA {fig['vs_hf_lora']:.2f}x (goal >= 3), base {fig['vs_hf_base']:.2f}x; "
              f"max |ours - theirs| logprob {fig['max_abs_diff_vs_hf']:.3g}")
size = sum(f.stat().st_size for f in model.glob("*.safetensors")) if model.is_dir() else 0
for run in ("cold", "warm"):
    path = res / f"compare_{run}.json"
    if not path.exists():
        continue
    record = json.loads(path.read_text())
    t = record["timings"]
    fig = dict(timings=t, tokens_computed=record["tokens_computed"], tokens_per_s=record["tokens_per_s"],
               batches=record["batches"], cuda_graphs=record.get("cuda_graphs"), checkpoint_gb=size / 1e9,
               command_s=seconds.get(f"compare_{run}"),
               load_gb_per_s=size / 1e9 / t["load_s"] if t["load_s"] else None)
    figures[f"compare_{run}"] = fig
    print(f"compare ({run}), {size / 1e9:.1f} GB on disk, {fig['tokens_computed']:,} tokens: command "
          f"{fig['command_s']} s; " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in t.items())
          + f"; forward {fig['tokens_per_s']:,.0f} tok/s; graphs {fig['cuda_graphs']}")
(res.parent / "hybrid.json").write_text(json.dumps(figures, indent=1, default=str))
PY
tar -czf "$OUT/hybrid.tgz" -C "$OUT" hybrid && rm -rf "$RES"
rm -rf "$WORK/ckpt" "$WORK/compare_cold" "$WORK/compare_warm"
echo "hybrid_gpu.sh: $(( $(date +%s) - START )) s"
