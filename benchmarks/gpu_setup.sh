#!/usr/bin/env bash
# Source this on the GPU machine before anything else: installs the package from the tree (no downloads there)
# and, where the editable install does not map lora_eval.kernels / lora_eval.runners, links them.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "${OUT:-.}/install.log" 2>&1 || tail -n 5 "${OUT:-.}/install.log"
python3 -c "import lora_eval.kernels.fused_moe, lora_eval.runners.graphs" 2>/dev/null || {
  echo "editable install did not map lora_eval.kernels; linking kernels/ and runners/ into lora_eval/"
  ln -sfn ../kernels lora_eval/kernels && ln -sfn ../runners lora_eval/runners; }
export PYTHONUNBUFFERED=1
