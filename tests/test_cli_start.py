"""The command line's first moments (lora_eval/cli.py): every command answers a usage error in one line before torch,
pandas or numpy is imported (what made a usage error cost ~3 s), and a SIGINT / SIGTERM arriving while the command's
work is still being imported ends it with 130 / 143 and one line, never a traceback or a silent kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HEAVY = ("torch", "pandas", "numpy", "transformers", "safetensors")
BAD_USAGE = {  # command line -> the one line it must answer
    "compare": (["compare", "--model", "m", "--reference", "r", "--out", "o", "--max-k2", "nan"],
                "error: Invalid value for '--max-k2': expected a finite number >= 0, got 'nan'"),
    "mmlu": (["mmlu", "--model", "m", "--data", "d", "--out", "o", "--max-drop", "-1"],
             "error: Invalid value for '--max-drop': expected a finite number >= 0, got '-1'"),
    "dump-reference": (["dump-reference", "--model", "m", "--prompts", "p", "--out", "o", "--adapter", "x"],
                       "error: Invalid value for --adapter: expected NAME=PATH, got 'x'"),
    "diagnose": (["diagnose", "--model", "m", "--reference", "r", "--out", "o", "--samples", "0"],
                 "error: Invalid value for '--samples': 0 is not in the range x>=1."),
    "plan": (["plan", "--model", "m", "--gpu-memory", "inf"],
             "error: Invalid value for '--gpu-memory': expected a finite number > 0, got 'inf'"),
    "plan-nan": (["plan", "--model", "m", "--gpu-memory", "nan"],
                 "error: Invalid value for '--gpu-memory': expected a finite number > 0, got 'nan'"),
    "graph-memory": (["compare", "--model", "m", "--reference", "r", "--out", "o", "--max-graph-memory", "inf"],
                     "error: Invalid value for '--max-graph-memory': expected a finite number >= 0, got 'inf'"),
    "inspect": (["inspect", "--adapter", "a=b"], "error: Missing option '--model'."),
    "report": (["report", "run", "--format", "pdf"],
               "error: Invalid value for '--format': 'pdf' is not one of 'html', 'md'."),
    "bench": (["bench", "--config", "c", "--batch", "4x1024", "--rank", "0"],
              "error: Invalid value for '--rank': 0 is not in the range x>=1."),
    "launch": (["launch", "--nproc-per-node", "2", "compare", "--model", "m", "--reference", "r", "--out", "o",
                "--max-k2", "inf"], "error: Invalid value for '--max-k2': expected a finite number >= 0, got 'inf'"),
    "group option": (["--badflag"], "error: No such option '--badflag'."),
    "launch nothing": (["launch", "--nproc-per-node", "2"],
                       "error: Missing argument 'COMMAND'. Choose from: compare, mmlu, dump-reference"),
    "launch-plan": (["launch", "plan", "--model", "m"],
                    "error: Invalid value for 'COMMAND': 'plan' is not one of 'compare', 'mmlu', 'dump-reference'."),
}


@pytest.mark.parametrize("case", list(BAD_USAGE))
def test_a_usage_error_is_answered_before_torch_is_imported(case):
    args, line = BAD_USAGE[case]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lora_eval", *args], capture_output=True,
                          text=True, timeout=60)
    imported = [row.split("|")[-1].strip() for row in proc.stderr.splitlines() if row.startswith("import time:")]
    said = [row for row in proc.stderr.splitlines() if not row.startswith("import time:")]
    assert (proc.returncode, proc.stdout, said) == (2, "", [line]), proc.stderr[-2000:]
    assert "click" in imported and not [m for m in imported if m.split(".")[0] in HEAVY], imported


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler of its own for `signum` (/proc: SigCgt, a bit mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = next(int(row.split()[1], 16) for row in status.splitlines() if row.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_work_is_imported_ends_in_one_line(tmp_path, seed, signum):
    """The signal lands at a random moment of the first ~second (the command's modules, torch among them, still
    being imported) once main() has begun: exit 130 / 143 and one line. (Before, Ctrl-C there printed a Python
    traceback and SIGTERM killed the process without a word.)"""
    (tmp_path / "model").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "lora_eval", "compare", "--model", str(tmp_path / "model"),
                             "--reference", str(tmp_path / "ref.parquet"), "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CI": "true"})
    end = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.001)
    time.sleep(random.Random(seed).uniform(0, 0.25))
    assert proc.poll() is None, "the command ended before the signal"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stdout, stderr) == (128 + signum, "", f"interrupted by {signal.Signals(signum).name}\n")
    assert not (tmp_path / "out").exists()
