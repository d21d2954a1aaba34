#!/usr/bin/env bash
# Source this on the GPU machine before anything else: installs the package from the tree (no downloads there)
# and, where the editable install does not map lora_eval.kernels / lora_eval.runners, links them. Packages the GPU
# image lacks (datasets and its dill / multiprocess, for `lora-eval mmlu`; msgpack, for prime-rl dumps; pytest-xdist
# and execnet, with which the GPU tests run in several processes; fla-core, the extra `gpu`'s Gated DeltaNet kernels,
# whose einops the image has) travel as wheels in .whl/gpu (carry it);
# fetch them here, once, with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl/gpu \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytest-xdist==3.8.0 execnet==2.1.2 fla-core==0.6.0 \
#     msgpack==1.2.4
python3 -m pip install -q --no-deps --no-build-isolation -e . > "${OUT:-.}/install.log" 2>&1 || tail -n 5 "${OUT:-.}/install.log"
python3 -c "import lora_eval.kernels.fused_moe, lora_eval.runners.graphs" 2>/dev/null || {
  echo "editable install did not map lora_eval.kernels; linking kernels/ and runners/ into lora_eval/"
  ln -sfn ../kernels lora_eval/kernels && ln -sfn ../runners lora_eval/runners; }
if compgen -G ".whl/gpu/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gpu/*.whl \
    >> "${OUT:-.}/install.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the image's site-packages ship no .pyc: each fresh process compiled torch, pandas, matplotlib & co. again (session
# 19's profile of a warm compare: 1,571 modules compiled, 4.2 s); a pip-installed environment has them, so the
# figures here should too: .pyc files go to a writable prefix, and are written (PYTHONDONTWRITEBYTECODE unset)
unset PYTHONDONTWRITEBYTECODE
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
