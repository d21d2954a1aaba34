#!/usr/bin/env bash
# Everything a GPU session starts with, in one call: the GPU tests and the mixed-batch check (issue #23: tiny models
# RUNS times (2), then real attention and expert widths once, then the batch-invariant mode's), then the MoE layer
# benchmark and the batch-invariant mode's cost (lora-eval bench --also-invariant, 48 layers, 4 x 1024). With two or
# more GPUs the tests run on GPU 0 while GPU 1 runs the checks and the benchmarks, and the tests that need two GPUs
# run last on both. Results: $OUT/gpu_suite.tgz (env.txt, gpu_tests.log with the 25 slowest tests, check_*.log/.csv,
# moe_layer.*, bench_invariant.*; one file, as the device tool returns at most 8) and gpu_tests.log beside it.
#   bash benchmarks/gpu_suite.sh            (on the device tool: OUT is set; elsewhere OUT defaults to ./gpu-out)
# GPU_TESTS_ARGS go to pytest, CHECK_ARGS to mixed_batch_check.py, MOE_BENCH_ARGS to moe_layer.py; STEP_S (120)
# limits each check and benchmark, BENCH_S (STEP_S) the last benchmark (a cut one's log says so: no summary line).
# The tests run in GPU_TEST_WORKERS (6) pytest-xdist processes on one GPU: a serial run spends most of its time
# compiling Triton kernels one after another on one CPU core, which processes do side by side (H200: 463 s serially
# at 7d35a35, 139 s in 4 processes at 0fceba8; H100, 16 cores: 184 s in 4 processes, 174 s in 6 at 62a3f15;
# BENCHMARKS.md); 1 runs them in one process.
set -uo pipefail
OUT=${OUT:-gpu-out}
RES=$OUT/gpu_suite
mkdir -p "$RES"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  git log -1 --format=%h 2>/dev/null; date -u; } 2>&1 | tee "$RES/env.txt"
source benchmarks/gpu_setup.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the check imports tests.builders
GPUS=$(nvidia-smi -L | wc -l)
WORKERS=${GPU_TEST_WORKERS:-6}
STEP_S=${STEP_S:-120}  # each check and benchmark's limit, so that the script packs its results inside one call
# loadgroup: the tests of one xdist_group run in one process, one after another (the real-shape tests and the bench of
# every config: their models, up to 12 GB, would not all fit an H100 at once)
[ "$WORKERS" -gt 1 ] && XDIST=(-n "$WORKERS" --dist loadgroup) || XDIST=()

check_and_layer() {
  for i in $(seq "${RUNS:-2}"); do
    timeout "$STEP_S" python3 benchmarks/mixed_batch_check.py --models 6 --batches 100 --modes eager,graphs \
      --out "$RES/check_$i.csv" ${CHECK_ARGS:-} > "$RES/check_$i.log" 2>&1
    echo "exit $?" >> "$RES/check_$i.log"; tail -n 2 "$RES/check_$i.log"
  done
  timeout "$STEP_S" python3 benchmarks/mixed_batch_check.py --dims wide --models 2 --batches 50 --modes eager,graphs \
    --out "$RES/check_wide.csv" ${CHECK_ARGS:-} > "$RES/check_wide.log" 2>&1; echo "exit $?" >> "$RES/check_wide.log"
  tail -n 2 "$RES/check_wide.log"
  timeout "$STEP_S" python3 benchmarks/mixed_batch_check.py --batch-invariant --models 6 --batches 100 \
    --modes eager,graphs --out "$RES/check_invariant.csv" ${CHECK_ARGS:-} > "$RES/check_invariant.log" 2>&1
  echo "exit $?" >> "$RES/check_invariant.log"; tail -n 2 "$RES/check_invariant.log"
  timeout "$STEP_S" python3 benchmarks/moe_layer.py --out "$RES/moe_layer.csv" ${MOE_BENCH_ARGS:-} \
    > "$RES/moe_layer.log" 2>&1
  tail -n 16 "$RES/moe_layer.log"
  # the batch-invariant mode's cost beside the default, one process (issue #23 item 2)
  timeout "${BENCH_S:-$STEP_S}" lora-eval bench --config benchmarks/configs/Qwen3-30B-A3B.json --skip-hf --adapters 1 \
    --batch 4x1024 --repeat 7 --also-invariant --quiet --out "$RES/bench_invariant.csv" \
    > "$RES/bench_invariant.log" 2>&1
  tail -n 12 "$RES/bench_invariant.log"
}

if [ "$GPUS" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=1 check_and_layer &
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu -q -rfs --durations=25 "${XDIST[@]}" tests ${GPU_TESTS_ARGS:-} \
    > "$RES/gpu_tests.log" 2>&1
  wait
  python3 -m pytest -m gpu -q -rfs tests/test_expert_parallel.py \
    tests/test_prefix_cache.py::test_an_engine_on_the_second_gpu > "$RES/gpu_tests_2gpu.log" 2>&1  # both GPUs
  tail -n 3 "$RES/gpu_tests_2gpu.log"
else
  python3 -m pytest -m gpu -q -rfs --durations=25 "${XDIST[@]}" tests ${GPU_TESTS_ARGS:-} > "$RES/gpu_tests.log" 2>&1
  check_and_layer
fi
tail -n 40 "$RES/gpu_tests.log"
cp "$RES/gpu_tests.log" "$OUT/"
tar -czf "$OUT/gpu_suite.tgz" -C "$OUT" gpu_suite && rm -rf "$RES"
