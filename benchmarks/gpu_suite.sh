#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: GPU tests, then the benchmarks. Results go to $OUT.
#   bash benchmarks/gpu_suite.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; } 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || tail -n 5 "$OUT/install.log"
# the package maps lora_eval.kernels/runners onto kernels/ and runners/; without a working install, link them
python3 -c "import lora_eval.kernels.fused_moe, lora_eval.runners" 2>/dev/null || {
  echo "editable install did not map lora_eval.kernels; linking kernels/ and runners/ into lora_eval/"
  ln -sfn ../kernels lora_eval/kernels && ln -sfn ../runners lora_eval/runners; }
python3 -m pytest -m gpu -q -rs tests ${GPU_TESTS_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.csv" ${MOE_BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_layer.log" | tail -n 16
