#!/usr/bin/env bash
# The cost of a change to loading, old tree against this one on one machine (issue 42: the weights and adapter tensors
# checked finite on load): a 12-layer Qwen3-30B-A3B written to disk (16 GB) with a rank-16 all-linear adapter, then
# `lora-eval compare` 4 times a tree, alternating (the first of each compiles), printing run.json's phases; then the
# check alone on the loaded weights and the adapter's read.
#   git archive OLD_COMMIT | tar -x -C .scratch/old; OLD=.scratch/old bash benchmarks/load_cost.sh   (carry .scratch)
set -uo pipefail
source benchmarks/gpu_setup.sh
W=${WORK:-/tmp/job}; mkdir -p $W
OLD=${OLD:-.scratch/old}
(cd "$OLD" && ln -sfn ../kernels lora_eval/kernels && ln -sfn ../runners lora_eval/runners)
t0=$(date +%s); python3 benchmarks/write_checkpoint.py --config benchmarks/configs/Qwen3-30B-A3B.json --layers 12 --samples 48 --tokenizer-from .mmlu-data --out $W > $OUT/write.log 2>&1; echo "write rc $? $(( $(date +%s)-t0 )) s"; du -sh $W/model $W/peft
for i in 1 2 3 4; do for tree in new old; do
  if [ $tree = old ]; then PP=$(realpath "$OLD"); else PP=$PWD; fi
  s=$(date +%s%N)
  PYTHONPATH=$PP:${PYTHONPATH:-} CI=true python3 -m lora_eval compare --model $W/model --adapter adapter=$W/peft/adapter --reference $W/reference.parquet --max-k2 1e9 --quiet --out $W/c_${tree}_$i > $OUT/c_${tree}_$i.log 2>&1; rc=$?
  e=$(( ($(date +%s%N)-s)/1000000 ))
  python3 -c "import json,sys; t=json.load(open('$W/c_${tree}_$i/run.json'))['timings']; print('$tree run $i rc $rc command ${e} ms', ', '.join(f'{k} {v:.2f}' for k,v in t.items()))" 2>/dev/null || { echo "$tree $i rc $rc"; tail -3 $OUT/c_${tree}_$i.log; }
done; done
python3 - $W <<'PY'
import sys, time, torch
from pathlib import Path
from lora_eval.models import load_model
from lora_eval.models.checkpoint import TensorFiles, check_finite
from lora_eval.adapters.load import read_adapter_tensors
w = Path(sys.argv[1])
model = load_model(w / "model", dtype=torch.bfloat16, device="cuda")
weights = dict(model.named_parameters()); n = sum(t.numel() * t.element_size() for t in weights.values())
files = TensorFiles.from_checkpoint_dir(w / "model")
for _ in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter(); check_finite(weights, files); torch.cuda.synchronize()
    print(f"check_finite on {len(weights)} tensors, {n/1e9:.1f} GB bf16 on the GPU: {1e3*(time.perf_counter()-t0):.1f} ms")
for _ in range(2):
    t0 = time.perf_counter(); tensors, _ = read_adapter_tensors(w / "peft/adapter")
    print(f"adapter read + checked: {len(tensors)} tensors, {sum(t.numel()*4 for t in tensors.values())/1e9:.2f} GB fp32: {time.perf_counter()-t0:.2f} s")
PY
