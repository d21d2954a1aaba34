#!/usr/bin/env bash
# End-to-end benchmark on the GPU: our engine against transformers + PEFT on a random-weight Qwen3-30B-A3B
# (48 layers, bf16), 4 rank-16 adapters on every linear projection including experts and router, batches of
# 4 x 1024 and 1 x 128 tokens (our engine also with CUDA graphs off: system ours-eager). Results go to $OUT:
#   bench_<layers>L.csv / .log, env.txt, summary.txt.
#   bash benchmarks/e2e.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
# If a side runs out of GPU memory at 48 layers (its rows say status "oom: ...", or the model and adapters do
# not fit at all), the comparison runs again at 24 and then 12 layers, and summary.txt says so; any other error
# stops there. BENCH_ARGS adds options to every run (e.g. BENCH_ARGS="--repeat 3"); E2E_CONFIG, E2E_LAYERS and
# E2E_BATCHES replace the config, the layer counts tried and the batch options (for a dry run on a CPU).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CI=true
CONFIG=${E2E_CONFIG:-benchmarks/configs/Qwen3-30B-A3B.json}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
source benchmarks/gpu_setup.sh

run_bench() {  # $1 = layers. Status 0: every row ran; 2: out of GPU memory somewhere; 1: another error
  local layers=$1 csv="$OUT/bench_${1}L.csv" log="$OUT/bench_${1}L.log"
  python3 -c 'from lora_eval.cli import main; main()' bench --config "$CONFIG" --layers "$layers" \
    ${E2E_BATCHES:---batch 4x1024 --batch 1x128} --adapters 4 --rank 16 --targets all --dtype bfloat16 \
    --device cuda --also-eager --out "$csv" ${BENCH_ARGS:-} 2>&1 | tee "$log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    if grep -q "out of device memory" "$log"; then return 2; fi
    return 1
  fi
  python3 - "$csv" <<'EOF'
import sys
import pandas as pd
frame = pd.read_csv(sys.argv[1])
bad = frame[frame["status"] != "ok"]
for row in bad.itertuples():
    print(f"{row.system} {row.batch} {row.case}: {row.status}")
sys.exit(2 if bad["status"].str.startswith("oom").any() else 1 if len(bad) else 0)
EOF
}

for layers in ${E2E_LAYERS:-48 24 12}; do
  run_bench "$layers"
  status=$?
  if [ "$status" -eq 0 ]; then
    echo "complete comparison at $layers layers: $OUT/bench_${layers}L.csv" | tee -a "$OUT/summary.txt"
    break
  elif [ "$status" -eq 2 ]; then
    echo "at $layers layers a side ran out of GPU memory (recorded in bench_${layers}L.csv / .log);" \
         "comparing again with fewer layers" | tee -a "$OUT/summary.txt"
  else
    echo "at $layers layers the bench failed (see bench_${layers}L.log); stopping" | tee -a "$OUT/summary.txt"
    exit 1
  fi
done
