#!/usr/bin/env bash
# `lora-eval diagnose` at a real model's size (issue #28): a random-weight Qwen3-30B-A3B of LAYERS layers (48: 61 GB
# in bf16) with a rank-16 all-linear PEFT adapter written to disk, diagnosed on SAMPLES samples per adapter (8) —
# the bf16 engine on the GPU against the float32 oracle, which does not fit beside it and so runs layer by layer.
# Results: $OUT/diagnose_gpu.tgz (run.json, diagnose.json, layers.csv, modules.csv, diagnose.md, the log) and
# $OUT/diagnose_summary.txt (time per phase, peak device and host memory, how the errors were measured).
#   bash benchmarks/diagnose_gpu.sh          (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
# LAYERS, SAMPLES, WORK (default /tmp/lora-eval-diagnose), CONFIG; WRITE_ARGS / DEVICE_ARGS as in multi_gpu.sh.
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/lora-eval-diagnose}
RES=$OUT/diagnose_gpu
mkdir -p "$RES" "$WORK"
export PYTHONUNBUFFERED=1 CI=true
source benchmarks/gpu_setup.sh
[ -f "$WORK/reference.parquet" ] || timeout 400 python3 benchmarks/write_checkpoint.py \
    --config "${CONFIG:-benchmarks/configs/Qwen3-30B-A3B.json}" --layers "${LAYERS:-48}" --samples 64 \
    ${WRITE_ARGS:-} --out "$WORK" 2>&1 | tail -n 2 | tee "$RES/write.log"
timeout 500 lora-eval diagnose --model "$WORK/model" --adapter "adapter=$WORK/peft/adapter" \
    --reference "$WORK/reference.parquet" --samples "${SAMPLES:-8}" --out "$WORK/diagnose" --overwrite --quiet \
    ${DEVICE_ARGS:-} > "$RES/diagnose.log" 2>&1
echo "rc=$?" >> "$RES/diagnose.log"
cp "$WORK"/diagnose/{run.json,diagnose.json,layers.csv,modules.csv,diagnose.md} "$RES/" 2>/dev/null
python3 - "$RES" <<'PY' | tee "$OUT/diagnose_summary.txt"
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
run, diagnosis = (json.loads((res / n).read_text()) for n in ("run.json", "diagnose.json"))
work = run.get("work", {})
print("timings:", ", ".join(f"{k} {v:.1f} s" for k, v in run.get("timings", {}).items()))
print("peak device MiB:", work.get("peak_device_mb"), "peak host MiB:", work.get("peak_rss_mb"))
print("measured:", diagnosis.get("measured"))
print("first divergent layer:", {a: e.get("first_divergent_layer") for a, e in diagnosis.get("adapters", {}).items()})
PY
tar -czf "$OUT/diagnose_gpu.tgz" -C "$OUT" diagnose_gpu && rm -rf "$RES"
