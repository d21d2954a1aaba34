"""Shared fixtures: a fresh random seed per test (printed on failure) and tiny checkpoints built once per session."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run through the interpreter on CPU-only machines
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter's tl.dot is numpy's BLAS, whose summation order follows the CPU and a row's place among the
    # others: the suite's bit-equality claims (a row's bits whatever the rows around it) held on AVX-512 machines
    # and failed on AVX2 ones (issue 41). This dot sums every element in one fixed order, the same on any CPU
    # (tests/interpreter_dot.py; checked against a hostile BLAS in tests/kernels/test_interpreter_dot.py).
    from tests.interpreter_dot import install

    install()

# Tests use tiny tensors: intra-op threads only add overhead, and on a busy 2-core machine spinning OpenMP
# threads made some modules ~20x slower (50 s instead of 3 s). One thread for the whole run.
torch.set_num_threads(1)

from lora_eval.engine.engine import EngineOptions
from lora_eval.runners.graphs import pad_to_bucket
from tests.builders import save_random_model

# 2I (16) != H (32) and I != H, so a transposed or swapped expert factor cannot pass by coincidence
MOE_OVERRIDES = dict(moe_intermediate_size=8)


@pytest.fixture
def seed(request) -> int:
    """Fresh each run; shown in the test's report section so a failure can be replayed (LORA_EVAL_TEST_SEED=N)."""
    value = int(os.environ.get("LORA_EVAL_TEST_SEED") or random.SystemRandom().randrange(2**31))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    return value


_SESSION_SEED: list[int] = []  # this process's session seed, once drawn (each pytest-xdist worker draws its own)


@pytest.fixture(scope="session")
def session_seed() -> int:
    """The session's models' seed, printed at setup and in the report of every failing test that used it;
    LORA_EVAL_SESSION_SEED=N replays one."""
    value = int(os.environ.get("LORA_EVAL_SESSION_SEED") or random.SystemRandom().randrange(2**31))
    print(f"session seed={value}")
    _SESSION_SEED.append(value)
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test whose models came from the session seed names it: the print at setup went to whichever test
    set the fixture up first, perhaps in another worker's log."""
    report = (yield).get_result()
    if report.failed and _SESSION_SEED and "session_seed" in item.fixturenames:
        report.sections.append(("replay", f"LORA_EVAL_SESSION_SEED={_SESSION_SEED[0]}"))


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory, session_seed):
    """A tiny Qwen3-MoE checkpoint (layer 1 dense via mlp_only_layers, norm_topk_prob true), float32 on disk."""
    return save_random_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=session_seed, **MOE_OVERRIDES)


CPU = EngineOptions(device="cpu", dtype="float32")  # the oracle's options, whatever the machine has


def eager_on_the_bucket(engine, seqs: list, slots: list, rows: int, length: int) -> torch.Tensor:
    """The engine's eager forward of `seqs` padded as a graph bucket of rows x length pads them: the twin of a replay,
    for the checks that a replay computes what eager does on the same padded batch -> hidden [rows * length, H]."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # [B, L]
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    padded, token_slots = pad_to_bucket(ids, slots, rows, length)
    device = engine.model.inv_freq.device  # the model's (the engine keeps no device of its own)
    return engine._build(padded.to(device), token_slots.to(device), max(slots) >= 0)
