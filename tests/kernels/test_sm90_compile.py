"""The fused MoE layer's kernels compiled for an H100 (sm_90) on a machine without a GPU (tests/kernels/
sm90_compile.py), the Gluon GEMMs and the dense LoRA consumers: compile errors of the GPU-only paths and
shared memory beyond 227 KB show up on a CPU run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")
ROOT = Path(__file__).resolve().parents[2]


def run_case(case: str) -> str:
    """The output of sm90_compile.py CASE (fails the test on any error)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT), case], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def compiled_kernels(case: str) -> list[tuple[str, int]]:
    """(kernel name, shared memory bytes) of every kernel binary CASE compiles (or takes from Triton's cache) for
    sm_90, one per compiled variant."""
    return [(name, int(size)) for name, size in re.findall(r"compiled (\w+): (\d+) bytes", run_case(case))]


def compile_case(case: str) -> dict[str, int]:
    """{kernel name: shared memory bytes} of the kernels CASE compiles for sm_90."""
    return dict(compiled_kernels(case))


@pytest.mark.parametrize("case", ["moe-4096", "moe-8192", "moe-8192-no-half-tail", "moe-64-rank-32",
                                  "moe-4096-rank-32-shared-outer", "moe-8192-rank-32", "moe-2048-rank-64",
                                  "moe-8192-rank-64-shared-outer"])
def test_fused_moe_compiles_for_hopper(case):
    compiled = compile_case(case)
    # every launch of a LoRA layer: alignment, the shrinks (per block; shared-outer: per token, the down shrink
    # inside the down GEMM), both GEMMs, the sum over k
    shrinks = {"moe_lora_shrink_kernel"}  # per block (per-expert A)
    if "shared-outer" in case:  # gate_up's shared A per token; the down shrink inside the down GEMM while the slots
        shrinks = {"_shrink_kernel"} | (shrinks if "rank-64" in case else set())  # side by side fit (4 x 32)
    assert set(compiled) == {"moe_count_kernel", "moe_place_kernel", "moe_gemm_kernel", "moe_sum_kernel"} | shrinks, \
        compiled
    assert compiled["moe_gemm_kernel"] > 100_000  # the pipelined GEMM's stages (a real sm_90 compile)


def test_gluon_gemms_compile_for_hopper():
    """The persistent Gluon GEMMs (never run by the interpreter): 4 stages of operand tiles each (down: with and
    without the pair shrink's LoRA A rows)."""
    compiled = compile_case("gluon-gemms")
    assert set(compiled) == {"moe_gate_up_kernel", "moe_down_kernel"}
    assert compiled["moe_gate_up_kernel"] >= 4 * (128 + 2 * 128) * 64 * 2
    assert compiled["moe_down_kernel"] >= 4 * (128 + 256) * 64 * 2


def test_dense_lora_consumers_compile_with_the_most_partials():
    """Every consumer of a dense LoRA shrink at MAX_SPLITS partial sums (each loads a row's partials once; inside
    the slot loop they once needed 274 KB of shared memory at 32 partials)."""
    compiled = compile_case("dense-lora-partials")
    assert set(compiled) == {"_expand_kernel", "_residual_add_kernel"}


def test_prefix_attention_compiles_for_hopper():
    """The prefixed attention at real head widths (128; MLA's 192 / 128; GPT-OSS's 64 with sinks and a window), in
    shared memory."""
    compiled = compile_case("prefix-attention")
    assert set(compiled) == {"prefix_attention_kernel"}


def test_batch_invariant_gemm_compiles_for_hopper():
    """The batch-invariant mode's GEMM (kernels/matmul.py) in bf16 and float32 (whose tiles take twice the bytes)."""
    assert set(compile_case("batch-invariant")) == {"matmul_kernel"}


@pytest.mark.parametrize("case,gluon_gate_up", [("moe-8192-gluon-rank-16", True), ("moe-8192-gluon-rank-32", False),
                                               ("moe-8192-gluon-shared-outer", True)])
def test_fused_moe_routes_lora_work_to_gluon(case, gluon_gate_up):
    """On Hopper from 8192 tokens: gate_up's LoRA expand runs in the Gluon kernel up to MAX_EXPAND_RANK (gate and up
    ranks together), in moe_gemm above it; the down GEMM takes its LoRA expand (per-expert B, rank 16 or 32) or the
    pair shrink (a B shared by all experts) in Gluon."""
    compiled = compile_case(case)
    assert ("moe_gate_up_kernel" in compiled) == gluon_gate_up, compiled
    assert "moe_down_kernel" in compiled, compiled
    assert ("moe_gemm_kernel" in compiled) == (not gluon_gate_up), compiled


def test_batches_of_varying_shape_compile_each_kernel_once():
    """Token and pair counts, sequence and prefix lengths of every divisibility class by 16 (MMLU's and compare's
    batches): one variant per kernel and role (the MoE GEMM and its shrink: gate_up and down), where Triton's
    specialisation on integer arguments had compiled up to 4 (issue #24: compilation inside the timed forward)."""
    counts = Counter(name for name, _ in compiled_kernels("batch-shapes"))
    twice = {"moe_lora_shrink_kernel", "moe_gemm_kernel"}
    once = {"moe_count_kernel", "moe_place_kernel", "moe_sum_kernel", "_expand_kernel", "_residual_add_kernel",
            "head_norm_rope_kernel", "prefix_attention_kernel", "rms_norm_kernel", "router_topk_kernel",
            "matmul_kernel", "_partial_kernel", "_combine_kernel"}
    assert counts == {**dict.fromkeys(twice, 2), **dict.fromkeys(once, 1)}, counts


def test_compile_clock_counts_compiles_outside_captures_and_keeps_earlier_hooks():
    """runners/compile_clock.py on real compiles: one kernel compiled (or loaded from Triton's cache) counts, with its
    seconds; one inside `paused` (a graph capture) does not; a hook set before the clock's still sees both."""
    out = run_case("compile-clock")
    compiles, seconds, seen = re.search(r"clock: (\d+) compiles, ([0-9.]+) s; earlier hook saw (.*)", out).groups()
    assert int(compiles) == 1 and float(seconds) > 0, out
    assert seen == "['rms_norm_kernel', 'router_topk_kernel']", out
