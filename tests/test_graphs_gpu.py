"""The CUDA-graph runner on a GPU (marker gpu): replay equals the eager forward bit for bit on the same padded
batch, a batch without adapter rows replays the plain graph and equals the base model, a mixed batch routes
every row to its adapter, neither the captured forward nor a replay synchronises with the host, and an engine
dropped earlier does not break a later engine's capture."""

from __future__ import annotations

import gc

import pytest
import torch

from lora_eval import Batch, Engine
from lora_eval.adapters import load_adapter
from lora_eval.models import load_model
from lora_eval.runners.graphs import BucketPlan, pad_to_bucket
from tests.builders import random_sequences, save_random_peft_adapter, write_expert_adapter
from tests.conftest import eager_on_the_bucket

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VOCAB = 96


@pytest.fixture(scope="module")
def adapters(moe_model, tmp_path_factory, session_seed):
    root = tmp_path_factory.mktemp("graph_adapters")
    return {
        "peft": save_random_peft_adapter(moe_model, root / "peft", seed=session_seed + 11, r=4, lora_alpha=8,
                                         target_modules="all-linear"),
        "tinker": write_expert_adapter(moe_model, root / "tinker", layout="split_3d", shared_outer=True,
                                       seed=session_seed + 12, rank=2).adapter_dir,
    }


def engine(model_dir, adapters, dtype=torch.bfloat16, **kw):
    model = load_model(model_dir, dtype=dtype, device="cuda")
    return Engine(model, [load_adapter(p, n, model) for n, p in adapters.items()], **kw)


def test_a_batch_in_a_fitted_bucket_replays_the_eager_forward(moe_model, adapters, seed):
    """Buckets fitted to a run (Engine.expect): a batch lands in the fitted bucket, larger than its rounded one,
    and its replay equals the eager forward of the batch padded the same way, bit for bit."""
    e = engine(moe_model, adapters)
    e.expect([(3, 40, True), (4, 48, True)])  # merged: (3, 40) -> (4, 48), 3 x 40 -> 4 x 48
    assert e.graphs.plan.fitted[True] == [(4, 48)]
    seqs = random_sequences(3, VOCAB, seed=seed, min_len=30, max_len=40)
    slots = [e._slot(t, i) for i, t in enumerate(["peft", None, "tinker"])]
    hidden, length = e._forward(seqs, slots)[:2]
    assert length == 48 and hidden.shape[0] == 4 * 48
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    padded, token_slots = pad_to_bucket(ids, slots, 4, 48)
    replayed = hidden.clone()
    eager = e._build(padded.cuda(), token_slots.cuda(), True)
    assert torch.equal(replayed, eager)
    assert e.graph_stats()["buckets"] == [(4, 48)]


def test_replay_equals_eager_on_the_same_padded_batch(moe_model, adapters, seed):
    e = engine(moe_model, adapters)
    seqs = random_sequences(3, VOCAB, seed=seed, min_len=20, max_len=40)
    for tags in (["peft", None, "tinker"], [None, None, None]):
        slots = [e._slot(t, i) for i, t in enumerate(tags)]
        hidden, length = e._forward(seqs, slots)[:2]
        replayed = hidden.clone()
        rows = replayed.shape[0] // length
        eager = eager_on_the_bucket(e, seqs, slots, rows, length).clone()
        again = eager_on_the_bucket(e, seqs, slots, rows, length)
        assert torch.equal(eager, again), "two eager runs of the same batch differ"
        differ = (replayed != eager).any(-1).view(rows, length)  # [rows, length] positions that differ
        assert not differ.any(), (f"tags {tags}: {int(differ.sum())} positions differ, max |d| "
                                  f"{(replayed.float() - eager.float()).abs().max().item():.3g}, per row "
                                  f"{differ.sum(1).tolist()}, lengths {[len(s) for s in seqs]}")
    stats = e.graph_stats()
    assert stats["graphs"] == 2 and stats["replays"] == 2 and stats["eager_batches"] == 0
    assert stats["graph_memory_bytes"] > 0


def test_batch_without_adapter_rows_replays_the_plain_graph_and_equals_the_base_model(moe_model, adapters, seed):
    seqs = random_sequences(4, VOCAB, seed=seed, max_len=40)
    with_adapters = engine(moe_model, adapters)
    out = with_adapters.logprobs(Batch(seqs, [None] * 4))
    captured = list(with_adapters.graphs.graphs)
    assert captured and all(not lora for *_, lora in captured)  # only the plain variant was needed
    base = engine(moe_model, {}).logprobs(Batch(seqs, [None] * 4))
    assert all(torch.equal(a, b) for a, b in zip(out, base))


def test_mixed_batch_routes_every_row(moe_model, adapters, seed):
    """float32 on the GPU: each row of a mixed replayed batch equals that row alone, run eagerly."""
    seqs = random_sequences(6, VOCAB, seed=seed, max_len=40)
    tags = ["peft", None, "tinker", "tinker", None, "peft"]
    mixed = engine(moe_model, adapters, torch.float32).logprobs(Batch(seqs, tags))
    alone = engine(moe_model, adapters, torch.float32, cuda_graphs=False)
    for s, t, got in zip(seqs, tags, mixed):
        want = alone.logprobs(Batch([s], [t]))[0]
        assert (got - want).abs().max().item() < 1e-5


def test_shapes_beyond_the_largest_bucket_run_eagerly(moe_model, adapters, seed):
    e = engine(moe_model, adapters, graph_plan=BucketPlan(max_tokens=64))
    seqs = random_sequences(4, VOCAB, seed=seed, min_len=30, max_len=40)
    out = e.logprobs(Batch(seqs, ["peft"] * 4))
    ref = engine(moe_model, adapters, cuda_graphs=False).logprobs(Batch(seqs, ["peft"] * 4))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert e.graph_stats()["graphs"] == 0 and e.graph_stats()["eager_batches"] == 1


def test_captured_forward_and_replay_do_not_sync(moe_model, adapters, seed):
    e = engine(moe_model, adapters)
    seqs = random_sequences(2, VOCAB, seed=seed, min_len=10, max_len=30)
    slots = [0, 1]
    e._forward(seqs, slots)  # capture (torch.cuda.graph itself synchronises around a capture)
    ids = torch.zeros(2, 32, dtype=torch.long, device="cuda")
    token_slots = torch.tensor(slots, device="cuda").repeat_interleave(32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        e._build(ids, token_slots, True)  # the forward that gets captured, run eagerly
        e._forward(seqs, slots)  # copies in + replay
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_dropped_engine_does_not_break_a_later_capture(moe_model, adapters, seed):
    """An engine with captured graphs, dropped in a reference cycle (only the garbage collector frees it), then a
    new engine captures with collection as eager as it gets: without collection held off during a capture, the
    old engine's graphs were destroyed mid-capture and the capture failed (cudaErrorStreamCaptureInvalidated)."""
    seqs = random_sequences(3, VOCAB, seed=seed, min_len=20, max_len=40)
    tags = ["peft", None, "tinker"]
    old = engine(moe_model, adapters)
    expected = old.logprobs(Batch(seqs, tags))
    assert old.graph_stats()["graphs"] == 1
    cycle = [old]
    cycle.append(cycle)
    del old, cycle
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        new = engine(moe_model, adapters)
        got = new.logprobs(Batch(seqs, tags))
    finally:
        gc.set_threshold(*thresholds)
    assert new.graph_stats()["graphs"] == 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
