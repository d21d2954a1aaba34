"""Expert parallel (lora_eval/expert_parallel.py), on the CPU with gloo.

1. every MoE family (and DeepSeek-V3 as a block-FP8 release), with PEFT all-linear adapters and (on Qwen3-MoE) every
   hand-written expert layout, mixed adapter and base rows: logprobs of 2 and 4 processes, each holding its share of the experts, within 1e-5 of one process
   in float32 (an uneven split: 6 experts over 4 ranks); and the GPU's Triton path (in the interpreter) the same;
2. `torchrun ... lora-eval compare --expert-parallel` on the demo: the same within 1e-5; without torchrun it is
   refused by name;
3. a rank reads only its experts: each rank's peak host memory, measured, below what the whole model takes;
4. ExpertShard: fused expert tensors cut by rows, per-expert keys renumbered, the other experts neither listed nor
   read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from lora_eval import Batch, Engine, EngineOptions
from lora_eval.models.checkpoint import TensorDict, TensorFiles
from lora_eval.cli import cli
from lora_eval.engine.expert_parallel import ExpertShard, shares
from tests.builders import random_sequences, save_quantized_copy, save_random_model, save_random_peft_adapter, \
    save_random_peft_adapter_any, write_expert_adapter
from tests.cli_checks import assert_input_error
from tests.conftest import CPU, MOE_OVERRIDES
from tests.test_distributed import GLOO_TIMEOUT, demo, demo_compare, finish, torchrun  # noqa: F401 (demo: fixture)

VOCAB = 96
TOL = 1e-5
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_vl_moe"]
LAYOUTS = [("per_expert_2d", False), ("fused_3d", False), ("split_3d", True), ("peft_target_parameters", False)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory, session_seed):
    """[(name, model folder, {adapter: folder})]: every family with a PEFT all-linear adapter; Qwen3-MoE also with
    every hand-written expert layout (shared-outer where the layout has it)."""
    root = tmp_path_factory.mktemp("ep")
    found = []
    for i, family in enumerate(FAMILIES):
        overrides = MOE_OVERRIDES if family == "qwen3_moe" else {}
        model = save_random_model(root / family, family, seed=session_seed + i, **overrides)
        peft = save_random_peft_adapter_any if family == "qwen3_vl_moe" else save_random_peft_adapter
        found.append((family, model, {"peft": peft(model, root / f"{family}-peft", seed=session_seed + 50 + i, r=4,
                                                   lora_alpha=8, target_modules="all-linear")}))
    # a block-FP8 release (DeepSeek-V3's format: per-expert weights with their weight_scale_inv): a rank dequantises
    # only its experts' blocks
    deepseek = next(m for name, m, _ in found if name == "deepseek_v3")
    fp8, plain, _ = save_quantized_copy(deepseek, root / "deepseek_v3-fp8", root / "deepseek_v3-fp8-plain", "fp8", [],
                                        block=(16, 16))
    found.append(("deepseek_v3 fp8", fp8, {"peft": save_random_peft_adapter(plain, root / "deepseek_v3-fp8-peft",
                                                                            seed=session_seed + 70, r=4, lora_alpha=8,
                                                                            target_modules="all-linear")}))
    model = found[0][1]
    found.append(("qwen3_moe layouts", model, {
        layout: write_expert_adapter(model, root / layout, layout=layout, shared_outer=shared, seed=session_seed + j,
                                     rank=4, alpha=6).adapter_dir for j, (layout, shared) in enumerate(LAYOUTS)}))
    return found


def _rows(names: list[str], seed: int):
    seqs = random_sequences(10, VOCAB, seed=seed, min_len=3, max_len=20)
    return seqs, [([None] + names)[i % (len(names) + 1)] for i in range(len(seqs))]


def _ep_worker(rank: int, world: int, init: str, cases, seed: int, results, backend: str | None = None):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=GLOO_TIMEOUT)  # bounded
    torch.set_num_threads(1)
    try:
        for name, model, adapters in cases:
            options = EngineOptions(device="cpu", dtype="float32", backend=backend, expert_parallel=True)
            engine = Engine.load(model, adapters, options)
            seqs, tags = _rows(list(adapters), seed)
            mine = list(range(rank, len(seqs), world))  # rows of this rank; every rank runs one batch per case
            out = engine.logprobs(Batch([seqs[i] for i in mine], [tags[i] for i in mine]))
            results[(name, rank)] = {i: lp.tolist() for i, lp in zip(mine, out)}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_family_and_layout_matches_one_process(cases, world, tmp_path, seed):
    results = mp.Manager().dict()
    mp.spawn(_ep_worker, args=(world, f"file://{tmp_path / 'init'}", cases, seed, results), nprocs=world)
    for name, model, adapters in cases:
        seqs, tags = _rows(list(adapters), seed)
        whole = Engine.load(model, adapters, CPU).logprobs(Batch(seqs, tags))
        spread = {i: lp for r in range(world) for i, lp in results[(name, r)].items()}
        worst = max((torch.tensor(spread[i]) - whole[i]).abs().max().item() for i in range(len(seqs)))
        assert worst <= TOL, (name, world, worst)
        base = Engine.load(model, None, CPU).logprobs(Batch(seqs, [None] * len(seqs)))
        moved = max((whole[i] - base[i]).abs().max().item() for i in range(len(seqs)) if tags[i] is not None)
        assert moved > 1e-3, (name, "the adapters must matter, or agreeing proves nothing")


def test_the_triton_path_matches_one_process(cases, tmp_path, seed):
    """The GPU's path through the Triton interpreter, 2 ranks, Qwen3-MoE with a PEFT adapter and the hand-written
    layouts of shared factors: each rank's experts run the fused MoE kernels on the pairs it received (whose expert
    ids and slots arrive as columns of one tensor; read as if contiguous they once crashed a GPU run)."""
    chosen = [case for case in cases if case[0] == "qwen3_moe"]
    results = mp.Manager().dict()
    mp.spawn(_ep_worker, args=(2, f"file://{tmp_path / 'init'}", chosen, seed, results, "triton"), nprocs=2)
    for name, model, adapters in chosen:
        seqs, tags = _rows(list(adapters), seed)
        whole = Engine.load(model, adapters, CPU).logprobs(Batch(seqs, tags))
        spread = {i: lp for r in range(2) for i, lp in results[(name, r)].items()}
        worst = max((torch.tensor(spread[i]) - whole[i]).abs().max().item() for i in range(len(seqs)))
        assert worst <= TOL, (name, worst)


@pytest.mark.parametrize("ranks", [2, 4])
def test_compare_under_torchrun_matches_one_process(demo, tmp_path, ranks):
    out = tmp_path / "run"
    code, stdout, stderr = finish(torchrun(ranks, [*demo_compare(demo, out), "--expert-parallel"]))
    assert code == 0, (stdout, stderr)
    ours, one = (pd.read_parquet(folder / "tokens.parquet") for folder in (out, demo / "report"))
    assert list(ours["sample_id"]) == list(one["sample_id"])
    assert np.abs(ours["engine"].to_numpy() - one["engine"].to_numpy()).max() <= TOL
    run = json.loads((out / "run.json").read_text())
    assert run["fingerprint"]["options"]["expert_parallel"] and len(run["work"]["ranks"]) == ranks


def test_routes_under_expert_parallel_match_one_process(demo, tmp_path, seed):
    """The sampler's routes (the engine's own, the first MoE layer's changed at random positions) compared under
    --expert-parallel over 2 ranks: routing.csv and the summary's flip rates as one process gives them (each rank
    records the routing of its own rows; the router is whole on every rank)."""
    from lora_eval.inputs.references import read_reference, write_reference

    ref = read_reference(demo / "reference.parquet")
    engine = Engine.load(demo / "model", {a: demo / "adapters" / a for a in ("peft-all-linear", "tinker-shared-outer")},
                         CPU)
    tags = [a if isinstance(a, str) else None for a in ref["adapter"]]  # (base rows: NaN in pandas' str column)
    _, routes = engine.logprobs(Batch(list(ref["input_ids"]), tags, routes=True))
    rng = np.random.default_rng(seed)
    changed = []
    for ids, _ in routes:
        r = ids.numpy().astype(np.int32)  # [n, MoE layers, k]
        for p in np.flatnonzero(rng.random(len(r)) < 0.3):
            r[p, 0, 0] = min(set(range(engine.model.args.num_experts)) - set(r[p, 0].tolist()))  # another set
        changed.append(r)
    routed = write_reference(ref.assign(routed_experts=changed), tmp_path / "routed.parquet")

    def args(out):
        return [routed if a == demo / "reference.parquet" else a for a in demo_compare(demo, out)] + ["--max-k2", 100]
    one = CliRunner().invoke(cli, [str(a) for a in [*args(tmp_path / "one"), "--quiet"]])
    assert one.exit_code == 0, (one.stdout, one.stderr)
    code, stdout, stderr = finish(torchrun(2, [*args(tmp_path / "ep"), "--expert-parallel"]))
    assert code == 0, (stdout, stderr)
    a, b = (pd.read_csv(folder / "routing.csv") for folder in (tmp_path / "one", tmp_path / "ep"))
    pd.testing.assert_frame_equal(a, b)
    assert a["flips"].sum() > 0
    ours, theirs = (pd.read_csv(f / "summary.csv").set_index("adapter")["routing_flip_rate"] for f in
                    (tmp_path / "ep", tmp_path / "one"))
    pd.testing.assert_series_equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallel over GPUs needs two of them")
def test_expert_parallel_over_two_gpus_matches_one_gpu(demo, tmp_path):
    """On a machine with 2+ GPUs: the demo's compare with --expert-parallel over 2 GPUs (NCCL, the Triton kernels on
    each rank's received pairs) against the demo's own one-GPU run, both float32 (the demo's dtype; on a GPU compare's
    own default is bf16). Within 1e-4, not the CPU's 1e-5: the expert GEMMs sum in other tile compositions here, and
    on the GPU that is not bit-neutral."""
    out = tmp_path / "run"
    code, stdout, stderr = finish(torchrun(2, [*demo_compare(demo, out), "--expert-parallel", "--dtype", "float32"]),
                                  timeout=600)
    assert code == 0, (stdout, stderr)
    ours, one = (pd.read_parquet(folder / "tokens.parquet") for folder in (out, demo / "report"))
    assert json.loads((demo / "report" / "run.json").read_text())["resolved"]["dtype"] == "float32"
    assert list(ours["sample_id"]) == list(one["sample_id"])
    assert np.abs(ours["engine"].to_numpy() - one["engine"].to_numpy()).max() <= 1e-4


def test_expert_parallel_needs_torchrun(demo, tmp_path):
    assert_input_error(CliRunner().invoke(cli, [*map(str, demo_compare(demo, tmp_path / "run")), "--expert-parallel"]),
                       "--expert-parallel", "lora-eval launch --nproc-per-node 2 or more")


def test_each_rank_holds_only_its_experts(tmp_path, seed):
    """A model that is nearly all routed experts (4 layers of 32, 1.6 GB in float32): each of 4 ranks peaks below the
    whole model's size in host memory (a process with torch and transformers imported takes ~0.65 GB before any
    weight), and below one process's peak by at least half of the 3/4 of the experts it does not hold."""
    model = save_random_model(tmp_path / "model", "qwen3_moe", seed=seed, hidden_size=1024, moe_intermediate_size=1024,
                              num_experts=32, num_hidden_layers=4, mlp_only_layers=[], intermediate_size=64)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    ref = tmp_path / "ref.jsonl"
    ids = random_sequences(8, VOCAB, seed=seed, min_len=4, max_len=12)
    ref.write_text("".join(json.dumps(dict(input_ids=x, logprobs=[-1.0] * (len(x) - 1))) + "\n" for x in ids))
    args = ["compare", "--model", model, "--reference", ref, "--batch-tokens", 16, "--max-k2", 100]
    one = subprocess.run([sys.executable, "-m", "lora_eval", *map(str, args), "--out", str(tmp_path / "one")],
                         env={**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    code, stdout, stderr = finish(torchrun(4, [*args, "--out", tmp_path / "ep", "--expert-parallel"]))
    assert code == 0, (stdout, stderr)
    single = json.loads((tmp_path / "one" / "run.json").read_text())["work"]["peak_rss_mb"] * 2**20
    peaks = [r["peak_rss_mb"] * 2**20 for r in json.loads((tmp_path / "ep" / "run.json").read_text())["work"]["ranks"]]
    assert len(peaks) == 4 and all(p < weights for p in peaks), (peaks, weights)
    experts = 4 * 32 * 3 * 1024 * 1024 * 4
    assert single > weights and all(p < single - 0.5 * 0.75 * experts for p in peaks), (peaks, single, experts)


def test_expert_shard_reads_only_its_share(tmp_path, seed):
    model = save_random_model(tmp_path / "m", "qwen3_moe", seed=seed, **MOE_OVERRIDES)  # per-expert keys, 6 experts
    files = TensorFiles.from_checkpoint_dir(model)
    (start, count), total = shares(6, 4)[1], 6  # rank 1 of 4: experts 2, 3
    shard = ExpertShard(files, start, count, total)
    key = "model.layers.0.mlp.experts.{}.down_proj.weight"
    assert key.format(1) in shard and key.format(2) not in shard and key.format(0) in shard.keys()
    assert torch.equal(shard.get(key.format(1)), files.get(key.format(3)))
    assert not any(".experts.4." in k or ".experts.5." in k for k in shard.keys())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    fused = {name: torch.randn(6, 4, 3)}
    cut = ExpertShard(TensorDict(fused), start, count, total)
    assert cut.shape(name) == (2, 4, 3) and torch.equal(cut.get(name), fused[name][2:4])
    assert shares(6, 4) == [(0, 2), (2, 2), (4, 1), (5, 1)]
