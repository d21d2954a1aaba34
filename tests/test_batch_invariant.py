"""The batch-invariant mode (EngineOptions.batch_invariant, `--batch-invariant`; issue #23): a row's logprobs bitwise
the same whatever else is in its batch, where it sits and however much padding there is.

On the CPU the Triton path runs in the interpreter, where the property is checked together with what makes it on a
GPU: no cuBLAS GEMM (F.linear) and no SDPA call inside the forward. On a GPU (bf16, CUDA graphs on and off) the
property itself, over shuffled, split and padded batches of a model with adapters on every linear and the experts
(the tests that matter: a green CPU run proves nothing about cuBLAS or the GPU tiles), and compare's tables the same
for any --batch-tokens."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from lora_eval import Batch, Engine
from lora_eval.cli import cli
from lora_eval.demo import build_demo
from tests.builders import save_random_peft_adapter_any
from tests.cli_checks import assert_input_error
from tests.conftest import CPU
from tests.test_distributed import demo, demo_compare  # noqa: F401 - demo is a fixture

VOCAB = 96


PLACES = ((3, 0), (4, 2), (5, 5), (9, 4))  # (other rows, the target's index): first, middle, last; a larger batch


def batches_around(target: list[int], tag, seed: int, vocab: int = VOCAB,
                   places=PLACES) -> list[tuple[Batch, int]]:
    """(batch, index of `target` in it): alone; among rows of other lengths and adapters at `places`; beside a
    much longer row (more padding)."""
    rng = random.Random(seed)

    def others(n):
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(3, 2 * len(target)))] for _ in range(n)]
        return rows, [rng.choice(["a", "b", None]) for _ in range(n)]

    cases = [(Batch([target], [tag]), 0)]
    for n, where in places:
        rows, tags = others(n)
        rows.insert(where, target)
        tags.insert(where, tag)
        cases.append((Batch(rows, tags), where))
    long = [rng.randrange(vocab) for _ in range(4 * len(target) + 7)]
    cases.append((Batch([long, target], ["b", tag]), 1))
    return cases


def assert_invariant(engine: Engine, seed: int, places=PLACES) -> None:
    rng = random.Random(seed)
    for tag in ("a", None):
        target = [rng.randrange(VOCAB) for _ in range(rng.randint(10, 20))]
        results = [engine.logprobs(batch)[i] for batch, i in batches_around(target, tag, seed, places=places)]
        for k, other in enumerate(results[1:], start=1):
            assert torch.equal(other, results[0]), (tag, k, (other - results[0]).abs().max().item())


@pytest.fixture(scope="module")
def adapters(moe_model, tmp_path_factory, session_seed):
    root = tmp_path_factory.mktemp("invariant_adapters")
    return {name: save_random_peft_adapter_any(moe_model, root / name, seed=session_seed + i, r=4, lora_alpha=8,
                                               target_modules="all-linear")
            for i, name in enumerate(("a", "b"))}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels run compiled (the GPU test below)")
def test_interpreter_rows_do_not_see_their_batch(moe_model, adapters, seed, monkeypatch):
    """The Triton path in the interpreter with the mode on: every row bitwise the same across batches, with no
    F.linear and no SDPA inside the forward (both would follow the batch's size on a GPU); with the mode off the
    same forward calls them (so the check above means something). First and last only: the interpreter takes
    seconds a batch, and the GPU test below covers the middle and the larger batch (another graph bucket).
    Kept on the CPU: with the suite's fixed-order interpreter dot (tests/interpreter_dot.py) a row's bits follow from
    the row alone on any CPU, as the kernels' tiles do on a GPU; with numpy's BLAS they moved with the row's place in
    a tile on AVX2 machines (issue 41)."""
    engine = Engine.load(moe_model, adapters, replace(CPU, backend="triton", batch_invariant=True))
    calls = []
    for name in ("linear", "scaled_dot_product_attention"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    assert_invariant(engine, seed, places=((3, 0), (5, 5)))
    assert calls == []
    default = Engine.load(moe_model, adapters, replace(CPU, backend="triton"))
    default.logprobs(Batch([[1, 2, 3]], ["a"]))
    assert {"linear", "scaled_dot_product_attention"} <= set(calls)


def test_refused_with_expert_parallel(demo, tmp_path):  # noqa: F811 - the fixture
    assert_input_error(CliRunner().invoke(cli, [*map(str, demo_compare(demo, tmp_path / "run")), "--batch-invariant",
                                                "--expert-parallel"]),
                       "--batch-invariant", "--expert-parallel")


def test_compare_records_the_mode(demo, tmp_path):  # noqa: F811 - the fixture
    """run.json says the mode was on; on the CPU (batch-invariant as it is) the tables equal the default run's."""
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, [*map(str, demo_compare(demo, out)), "--batch-invariant", "--device", "cpu",
                                      "--quiet"])
    assert result.exit_code in (0, 1), (result.stdout, result.stderr)
    run = json.loads((out / "run.json").read_text())
    assert run["resolved"]["batch_invariant"] is True and run["fingerprint"]["options"]["batch_invariant"] is True
    default = pd.read_parquet(demo / "report" / "tokens.parquet")
    assert pd.read_parquet(out / "tokens.parquet")["engine"].equals(default["engine"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_rows_do_not_see_their_batch(moe_model, adapters, seed, graphs):
    engine = Engine.load(moe_model, adapters, replace(CPU, device="cuda", dtype="bfloat16", batch_invariant=True,
                                                      cuda_graphs=graphs))
    assert_invariant(engine, seed)


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory):
    """The demo's model, adapters and reference without its compare run (which, on a GPU machine, compiles every
    kernel in float32: 48 s of the GPU suite's 174 on an H100)."""
    root = tmp_path_factory.mktemp("demo_inputs")
    build_demo(root, quiet=True, notice=lambda _: None)
    return root


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compare_tables_do_not_depend_on_batch_tokens(demo_inputs, tmp_path):
    """compare in bf16 on the GPU with the mode on: its tables byte-identical for --batch-tokens 64, 1024 and 16384
    (many small batches, some, one)."""
    runs = []
    for tokens in (64, 1024, 16384):
        out = tmp_path / f"run{tokens}"
        args = [*map(str, demo_compare(demo_inputs, out)), "--batch-invariant", "--device", "cuda", "--quiet",
                "--max-k2", "1e9"]
        args[args.index("--batch-tokens") + 1] = str(tokens)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert json.loads((out / "run.json").read_text())["batches"] > (1 if tokens == 64 else 0)
        runs.append(out)
    for name in ("tokens.parquet", "samples.csv", "summary.csv"):
        first = (runs[0] / name).read_bytes()
        assert all((run / name).read_bytes() == first for run in runs[1:]), name
