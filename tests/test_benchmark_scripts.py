"""benchmarks/tiles.py's sweeps, dry-run on the CPU (Triton interpreter, float32, tiny shapes): they run
to the end and the numbers they check (each kernel against its reference) are right. Times mean nothing here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("op, args, settings", [
    ("matmul", ["--tokens", "16"], 18 * 3),  # MATMUL_SWEEP x (q/k/v, o_proj, router)
    ("attention", ["--rows", "2", "--prefix", "8", "--suffix", "8"], 6),  # ATTENTION_TILES
    ("small", ["--tokens", "16"], 6 * 3),  # SMALL_SWEEP x (router top-k, RMSNorm, RoPE)
])
def test_tiles_sweeps_check_every_setting(op, args, settings):
    out = run_script("benchmarks/tiles.py", op, "--device", "cpu", "--shape", "tiny", "--dtype", "float32", *args)
    diffs = [float(d) for d in re.findall(r"max diff ([0-9.e+-]+)", out)]
    assert len(diffs) == settings, out
    assert max(diffs) < 1e-5, out
    assert "(ships)" in out  # the shipped settings are among those swept

