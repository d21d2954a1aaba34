#!/usr/bin/env bash
# Data-parallel compare on every GPU of the machine against one GPU, on a checkpoint written to disk (NCCL, one
# process per GPU). Results go to $OUT: env.txt, one.log / all.log, one/ and all/ run folders' run.json, summary.txt.
#   bash benchmarks/multi_gpu.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
# MULTI_CONFIG, MULTI_LAYERS, MULTI_SAMPLES change the model and the reference (default: Qwen3-30B-A3B, 48 layers,
# 4096 samples); WORK is where the checkpoint goes (default /tmp/lora-eval-multi). NVLink multicast stays off.
# EP_LAYERS=N also runs expert parallel on N layers of Qwen3-235B-A22B (see the end of this script).
set -uo pipefail
OUT=${OUT:-gpu-out}
WORK=${WORK:-/tmp/lora-eval-multi}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 CI=true NCCL_NVLS_ENABLE=0
GPUS=$(nvidia-smi -L | wc -l)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; git rev-parse --short HEAD 2>/dev/null; echo "$GPUS GPUs"; } 2>&1 | tee "$OUT/env.txt"
source benchmarks/gpu_setup.sh
[ -f "$WORK/reference.parquet" ] || python3 benchmarks/write_checkpoint.py --config "${MULTI_CONFIG:-benchmarks/configs/Qwen3-30B-A3B.json}" \
    ${MULTI_LAYERS:+--layers $MULTI_LAYERS} --samples "${MULTI_SAMPLES:-4096}" --out "$WORK" 2>&1 | tail -n 3
ARGS=(compare --model "$WORK/model" --adapter "adapter=$WORK/peft/adapter" --reference "$WORK/reference.parquet"
      --batch-tokens 4096 --quiet --overwrite)
CUDA_VISIBLE_DEVICES=0 lora-eval "${ARGS[@]}" --out "$WORK/one" 2>&1 | tee "$OUT/one.log" | tail -n 3
torchrun --standalone --nproc-per-node "$GPUS" --no-python lora-eval "${ARGS[@]}" --out "$WORK/all" 2>&1 \
    | tee "$OUT/all.log" | tail -n 3
cp "$WORK/one/run.json" "$OUT/one.json"; cp "$WORK/all/run.json" "$OUT/all.json"
python3 - "$WORK" "$GPUS" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
work, gpus = Path(sys.argv[1]), int(sys.argv[2])
one, all_ = (json.loads((work / n / "run.json").read_text()) for n in ("one", "all"))
for name, run in (("1 GPU", one), (f"{gpus} GPUs", all_)):
    t = run["timings"]
    print(f"{name}: forward {t['forward_s']:.1f} s, whole {t['total_s']:.1f} s, {run['tokens_per_s']:,.0f} tokens/s "
          f"(phases: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()) + ")")
print(f"speed-up of the forward phase: {one['timings']['forward_s'] / all_['timings']['forward_s']:.2f}x on {gpus} GPUs")
same = all((work / "one" / f).read_bytes() == (work / "all" / f).read_bytes()
           for f in ("summary.csv", "samples.csv", "tokens.parquet"))
print("tables byte-identical to one GPU:", same)
PY

# Expert parallel on a model that does not fit one GPU: a random-weight Qwen3-235B-A22B cut to EP_LAYERS layers
# (default 24: 115 GB in bf16, built on the CPU), written to disk, compared over every GPU with --expert-parallel.
if [ -n "${EP_LAYERS:-}" ]; then
  EPWORK=${EPWORK:-/tmp/lora-eval-ep}
  [ -f "$EPWORK/reference.parquet" ] || python3 benchmarks/write_checkpoint.py --config benchmarks/configs/Qwen3-235B-A22B.json \
      --layers "$EP_LAYERS" --samples "${EP_SAMPLES:-512}" --device cpu --out "$EPWORK" 2>&1 | tail -n 3
  lora-eval plan --model "$EPWORK/model" --adapter "adapter=$EPWORK/peft/adapter" --gpus "$GPUS" | tee "$OUT/ep_plan.txt"
  torchrun --standalone --nproc-per-node "$GPUS" --no-python lora-eval compare --model "$EPWORK/model" \
      --adapter "adapter=$EPWORK/peft/adapter" --reference "$EPWORK/reference.parquet" --expert-parallel --quiet \
      --overwrite --out "$EPWORK/run" 2>&1 | tee "$OUT/ep.log" | tail -n 3
  cp "$EPWORK/run/run.json" "$OUT/ep.json"
fi
