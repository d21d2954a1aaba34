#!/usr/bin/env bash
# The multi-GPU runs of issue #27 on every GPU of the machine (NCCL, one process per GPU, NVLink multicast off).
# Results: $OUT/multi_gpu.tgz (env.txt, *.log, *.json run records, dp_summary.txt, ep_summary.txt; one file, as
# the device tool returns at most 8) and the two summaries beside it.
#   bash benchmarks/multi_gpu.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
# STEPS picks the parts (default "dp ep"):
#   dp  data parallel: compare and an MMLU subset on a Qwen3-30B-A3B-shaped checkpoint written to disk, on one GPU
#       and on all of them; speed-up and whether the tables are byte-identical.
#       DP_LAYERS (48), DP_SAMPLES (1024 reference samples), MMLU_LIMIT (questions per subject, 10), MMLU (the release);
#       DP_ARGS go to both commands (DP_ARGS=--batch-invariant: issue #27's identity under the batch-invariant mode);
#       DP_TASKS picks them (default "compare mmlu"; MMLU_LIMIT=100000: the whole test split).
#   ep  expert parallel: a Qwen3-235B-A22B-shaped checkpoint of EP_LAYERS layers (18: 92 GB in bf16, more than one
#       H100 holds) written layer by layer, compare and an MMLU subset with --expert-parallel; then the first
#       EP_AGREE_LAYERS (8) layers of the same checkpoint on one GPU and with --expert-parallel, logprobs side by side,
#       in bf16 and in float32 on the first EP_F32_SAMPLES (16) samples.
#       EP_FP8=1 writes it in block FP8 as Qwen's FP8 releases (half the disk; on H200s, 32 layers dequantise to 162 GB,
#       more than one H200 (150.8 GB) holds, in 80 GB of the 128 GB disk: EP_FP8=1 EP_LAYERS=32).
# CONFIG_DIR holds the two configs (default benchmarks/configs); WRITE_ARGS and DEVICE_ARGS go to write_checkpoint.py
# and to every lora-eval command (a dry run on the CPU: fake nvidia-smi, tiny configs, "--device cpu").
# WORK is where the checkpoints go (default /tmp/lora-eval-multi; the dp checkpoint is removed before ep's).
# EP_RUNS names the ep runs to do (default all: run first_ep first_one first_one_f32 first_ep_f32 mmlu).
# BUDGET_S caps the script's wall time (default none): each ep run gets at most the time left less 30 s for packing,
# and a run whose folder already holds run.json is not run again, so a second call on the warm machine goes on
# where the first was cut (the 32-layer FP8 write and its runs take more than one 10-minute call).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/lora-eval-multi}
MMLU=${MMLU:-.mmlu-data}
RES=$OUT/multi_gpu
mkdir -p "$RES" "$WORK"
export PYTHONUNBUFFERED=1 CI=true NCCL_NVLS_ENABLE=0
GPUS=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; echo "$GPUS GPUs"; df -h /tmp | tail -n 1; free -g | head -n 2; } 2>&1 | tee "$RES/env.txt"
left() {  # $1: a step's own limit; prints it, capped by what BUDGET_S leaves (0: no time)
  local l=$1; [ -n "${BUDGET_S:-}" ] && l=$(( BUDGET_S - SECONDS - 30 < l ? BUDGET_S - SECONDS - 30 : l ))
  echo $(( l > 1 ? l : 1 )); }
ep_run() {  # $1: run folder name under $EP, $2: limit (s), $3: log; the rest: the command. Skipped when done.
  local name=$1 limit; limit=$(left "$2"); shift 2; local log=$1; shift
  if [[ -n "${EP_RUNS:-}" && " $EP_RUNS " != *" $name "* ]]; then echo "$name: not in EP_RUNS" >> "$RES/ep_steps.txt"; return; fi
  if [ -f "$EP/$name/run.json" ]; then echo "$name: done before" >> "$RES/ep_steps.txt"; return; fi
  if [ "$limit" -lt 30 ]; then echo "$name: no time left" | tee -a "$RES/ep_steps.txt"; return; fi
  local t0=$SECONDS; timeout "$limit" "$@" --out "$EP/$name" > "$RES/$log" 2>&1
  echo "$name: rc $? in $(( SECONDS - t0 )) s (limit $limit)" | tee -a "$RES/ep_steps.txt"; }
TORCHRUN=(torchrun --standalone --nproc-per-node "$GPUS" --no-python lora-eval)
MMLU_ARGS=(--data "$MMLU" --limit "${MMLU_LIMIT:-10}" --quiet --overwrite ${DEVICE_ARGS:-})

side_by_side() {  # $1 $2: two run folders; the engine's logprobs of their tokens.parquet side by side
python3 - "$1" "$2" <<'PY'
import sys
import pandas as pd
a, b = (pd.read_parquet(f"{d}/tokens.parquet") for d in sys.argv[1:3])
d = (a["engine"] - b["engine"]).abs()
print(f"{sys.argv[1]} vs {sys.argv[2]}: {len(d)} tokens, max |d| {d.max():.3g}, mean |d| {d.mean():.3g}, "
      f"identical {bool((d == 0).all())}")
PY
}

timings() {  # $1: label, $2: run folder
python3 - "$1" "$2" <<'PY'
import json, sys
run = json.load(open(f"{sys.argv[2]}/run.json"))
t, w = run["timings"], run.get("work", {})
ranks = w.get("ranks") or [w]
rate = run["tokens_computed"] / t["forward_s"] if t.get("forward_s") else 0  # mmlu records no tokens_per_s
rates = f"{rate:,.0f} tokens computed/s" + (f", {run['questions_per_s']:,.1f} questions/s" if "questions_per_s" in run else "")
print(f"{sys.argv[1]}: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()) +
      f"; {rates}; peak device MiB per rank {[r.get('peak_device_mb') for r in ranks]}"
      f"; peak host MiB per rank {[r.get('peak_rss_mb') for r in ranks]}")
PY
}

if [[ " ${STEPS:-dp ep} " == *" dp "* ]]; then
  DP=$WORK/dp
  [ -f "$DP/reference.parquet" ] || timeout 400 python3 benchmarks/write_checkpoint.py \
      --config "${CONFIG_DIR:-benchmarks/configs}/Qwen3-30B-A3B.json" ${WRITE_ARGS:-} --layers "${DP_LAYERS:-48}" --samples "${DP_SAMPLES:-1024}" \
      --tokenizer-from "$MMLU" --out "$DP" 2>&1 | tail -n 2 | tee "$RES/dp_write.log"
  if [[ " ${DP_TASKS:-compare mmlu} " == *" compare "* ]]; then
    ARGS=(compare --model "$DP/model" --adapter "adapter=$DP/peft/adapter" --reference "$DP/reference.parquet"
          --batch-tokens 4096 --max-k2 1e9 --quiet --overwrite ${DEVICE_ARGS:-} ${DP_ARGS:-})
    # a warm-up on 64 samples first: Triton compiles into its on-disk cache once per machine, not inside a timed run
    python3 -c "import pandas as pd, sys; pd.read_parquet(sys.argv[1]).head(64).to_parquet(sys.argv[2])" \
        "$DP/reference.parquet" "$DP/warm.parquet"
    CUDA_VISIBLE_DEVICES=0 timeout 300 lora-eval "${ARGS[@]/$DP\/reference.parquet/$DP/warm.parquet}" --out "$DP/warm" \
        > "$RES/dp_warm.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 300 lora-eval "${ARGS[@]}" --out "$DP/one" > "$RES/dp_one.log" 2>&1
    timeout 300 "${TORCHRUN[@]}" "${ARGS[@]}" --out "$DP/all" > "$RES/dp_all.log" 2>&1
    for r in one all; do cp "$DP/$r/run.json" "$RES/dp_$r.json" 2>/dev/null; done
    { timings "compare 1 GPU" "$DP/one"; timings "compare $GPUS GPUs" "$DP/all"  # written before MMLU starts
      for f in summary.csv samples.csv tokens.parquet; do
        cmp -s "$DP/one/$f" "$DP/all/$f" && echo "compare $f byte-identical" || echo "compare $f differs"; done
      side_by_side "$DP/one" "$DP/all"; } 2>&1 | tee "$RES/dp_summary.txt"
    cp "$RES/dp_summary.txt" "$OUT/" 2>/dev/null
  fi
  if [[ " ${DP_TASKS:-compare mmlu} " == *" mmlu "* ]]; then
    M=(mmlu --model "$DP/model" --adapter "adapter=$DP/peft/adapter" "${MMLU_ARGS[@]}" ${DP_ARGS:-})
    # a warm-up on 3 questions a subject first: Triton compiles once per machine, not inside the one-GPU run
    CUDA_VISIBLE_DEVICES=0 timeout 300 lora-eval "${M[@]}" --limit 3 --out "$DP/mmlu_warm" > "$RES/dp_mmlu_warm.log" 2>&1
    CUDA_VISIBLE_DEVICES=0 timeout 300 lora-eval "${M[@]}" --out "$DP/mmlu_one" > "$RES/dp_mmlu_one.log" 2>&1
    timeout 300 "${TORCHRUN[@]}" "${M[@]}" --out "$DP/mmlu_all" > "$RES/dp_mmlu_all.log" 2>&1
    for r in mmlu_one mmlu_all; do cp "$DP/$r/run.json" "$RES/dp_$r.json" 2>/dev/null; done
    { timings "mmlu 1 GPU" "$DP/mmlu_one"; timings "mmlu $GPUS GPUs" "$DP/mmlu_all"
      for f in "$DP"/mmlu_one/*.csv "$DP"/mmlu_one/*.parquet; do
        cmp -s "$f" "$DP/mmlu_all/$(basename "$f")" && echo "mmlu $(basename "$f") byte-identical" \
          || echo "mmlu $(basename "$f") differs"; done; } 2>&1 | tee -a "$RES/dp_summary.txt"
  fi
  [ -n "${KEEP_DP:-}" ] || rm -rf "$DP"  # KEEP_DP=1: leave the checkpoint for a next step (diagnose_gpu.sh WORK=$WORK/dp)
fi

if [[ " ${STEPS:-dp ep} " == *" ep "* ]]; then
  EP=$WORK/ep
  AGREE=${EP_AGREE_LAYERS:-8}
  W0=$SECONDS
  [ -f "$EP/reference.parquet" ] || timeout "$(left 500)" python3 benchmarks/write_checkpoint.py --streamed ${EP_FP8:+--fp8} \
      --config "${CONFIG_DIR:-benchmarks/configs}/Qwen3-235B-A22B.json" ${WRITE_ARGS:-} --layers "${EP_LAYERS:-18}" --samples "${EP_SAMPLES:-256}" \
      --tokenizer-from "$MMLU" --out "$EP" 2>&1 | tail -n 2 | tee -a "$RES/ep_write.log"
  { echo "write: $(( SECONDS - W0 )) s"; du -sh "$EP/model"; } | tee -a "$RES/ep_write.log"
  [ -f "$EP/first/reference.parquet" ] || python3 benchmarks/write_checkpoint.py --first-layers-of "$EP" --layers "$AGREE" \
      --out "$EP/first" >> "$RES/ep_write.log"
  timeout 60 lora-eval plan --model "$EP/model" --adapter "adapter=$EP/peft/adapter" --gpus "$GPUS" > "$RES/ep_plan.txt" 2>&1
  ARGS=(compare --reference "$EP/reference.parquet" --batch-tokens 4096 --max-k2 1e9 --quiet --overwrite ${DEVICE_ARGS:-})
  FIRST=(--model "$EP/first/model" --adapter "adapter=$EP/first/peft/adapter")
  ep_run run 400 ep.log "${TORCHRUN[@]}" "${ARGS[@]}" --model "$EP/model" --adapter "adapter=$EP/peft/adapter" --expert-parallel
  ep_run first_ep 200 ep_first_ep.log "${TORCHRUN[@]}" "${ARGS[@]}" "${FIRST[@]}" --expert-parallel
  CUDA_VISIBLE_DEVICES=0 ep_run first_one 200 ep_first_one.log lora-eval "${ARGS[@]}" "${FIRST[@]}"
  # the same pair in float32 on the first EP_F32_SAMPLES (16) samples: agreement without bf16's routing flips
  python3 -c "import pandas as pd, sys; pd.read_parquet(sys.argv[1]).head(int(sys.argv[3])).to_parquet(sys.argv[2])" \
      "$EP/reference.parquet" "$EP/first/reference_f32.parquet" "${EP_F32_SAMPLES:-16}"
  F32=("${ARGS[@]/$EP\/reference.parquet/$EP/first/reference_f32.parquet}" "${FIRST[@]}" --dtype float32)
  CUDA_VISIBLE_DEVICES=0 ep_run first_one_f32 200 ep_first_one_f32.log lora-eval "${F32[@]}"
  ep_run first_ep_f32 200 ep_first_ep_f32.log "${TORCHRUN[@]}" "${F32[@]}" --expert-parallel
  ep_run mmlu 300 ep_mmlu.log "${TORCHRUN[@]}" mmlu --model "$EP/model" --adapter "adapter=$EP/peft/adapter" \
      "${MMLU_ARGS[@]}" --expert-parallel
  for r in run mmlu first_one first_ep first_one_f32 first_ep_f32; do cp "$EP/$r/run.json" "$RES/ep_$r.json" 2>/dev/null; done
  { timings "EP compare, ${EP_LAYERS:-18} layers, $GPUS GPUs" "$EP/run"
    timings "EP mmlu, ${EP_LAYERS:-18} layers, $GPUS GPUs" "$EP/mmlu"
    timings "first $AGREE layers, 1 GPU" "$EP/first_one"; timings "first $AGREE layers, EP" "$EP/first_ep"
    side_by_side "$EP/first_one" "$EP/first_ep"; side_by_side "$EP/first_one_f32" "$EP/first_ep_f32"; } 2>&1 | tee "$RES/ep_summary.txt"
fi

cp "$RES"/*_summary.txt "$OUT/" 2>/dev/null
tar -czf "$OUT/multi_gpu.tgz" -C "$OUT" multi_gpu && rm -rf "$RES"
