#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: GPU tests, then the benchmarks. Results go to $OUT.
#   bash benchmarks/gpu_suite.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  date -u; } 2>&1 | tee "$OUT/env.txt"
source benchmarks/gpu_setup.sh
python3 -m pytest -m gpu -q -rfs --durations=25 tests ${GPU_TESTS_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.csv" ${MOE_BENCH_ARGS:-} 2>&1 | tee "$OUT/moe_layer.log" | tail -n 16
