"""The CUDA-graph runner's logic without CUDA: bucket choice, padding into a bucket, and the fallbacks to the
eager forward (beyond the largest bucket, past the graph count or memory limit). The captures and replays
themselves are GPU tests (tests/test_graphs_gpu.py)."""

from __future__ import annotations

import random

import pytest
import torch

from lora_eval import Batch, Engine
from lora_eval.engine.batching import make_batches
from lora_eval.models import load_model
from lora_eval.runners.graphs import MIN_LENGTH, BucketPlan, pad_to_bucket, round_length, round_rows
from tests.builders import random_sequences


def test_length_buckets_hold_the_batch_with_at_most_a_quarter_of_padding():
    lengths = [round_length(n) for n in range(1, 5000)]
    for n, b in zip(range(1, 5000), lengths):
        assert b >= n and b >= MIN_LENGTH
        if n > 64:
            assert b <= 1.25 * n
    assert lengths == sorted(lengths)  # monotone: a longer batch never gets a shorter bucket
    assert len(set(lengths)) < 60  # few distinct buckets over 1..5000 tokens
    assert [round_length(n) for n in (16, 17, 100, 128, 129, 1000, 1024, 1025)] == \
        [16, 20, 112, 128, 160, 1024, 1024, 1280]


def test_row_buckets_take_two_steps_per_octave():
    assert [round_rows(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 100)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 16, 128]
    assert all(n <= round_rows(n) <= max(n, 4) * 1.5 for n in range(1, 3000))


def test_plan_picks_the_smallest_bucket_and_falls_back_beyond_the_largest():
    plan = BucketPlan(max_tokens=4096)
    assert plan.bucket(3, 100) == (3, 112)
    assert plan.bucket(1, 4096) == (1, 4096)
    assert plan.bucket(2, 4096) is None  # 8192 tokens: eager
    assert plan.bucket(5, 900) is None  # 6 x 1024 after rounding


def test_plan_stops_capturing_at_the_graph_count_and_memory_limits():
    plan = BucketPlan(max_buckets=2, max_memory=1000)
    assert plan.may_capture(0)
    plan.captured[(1, 16, False)] = 400
    assert plan.may_capture(400)
    assert not plan.may_capture(1000)  # the pool reached the memory limit
    plan.captured[(1, 16, True)] = 500
    assert not plan.may_capture(500)  # two graphs already
    assert BucketPlan(max_memory=None).may_capture(10**15)


def test_fitted_buckets_hold_every_batch_and_each_merge_pays_for_itself(seed):
    """A compare-like run (random lengths, batches under a token budget, adapter and base batches): the fitted
    buckets hold every batch, no bucket passes max_tokens, there are fewer buckets than rounded shapes, and the
    padding the merges added stays under what the captures they saved cost."""
    rng = random.Random(seed)
    lengths = [rng.randint(128, 2048) for _ in range(rng.randint(60, 200))]
    batches = make_batches(lengths, 4096)
    shapes = [(len(b), max(lengths[i] for i in b), rng.random() < 0.5) for b in batches]
    plan = BucketPlan(max_tokens=16384)
    plan.fit(shapes)
    for lora in (False, True):
        mine = [(r, n) for r, n, v in shapes if v == lora]
        rounded = {(round_rows(r), round_length(n)) for r, n in mine}
        chosen = [plan.bucket(r, n, lora) for r, n in mine]
        assert all(b is not None and b[0] >= r and b[1] >= n and b[0] * b[1] <= 16384
                   for b, (r, n) in zip(chosen, mine))
        assert set(chosen) <= set(plan.fitted[lora]) and len(plan.fitted[lora]) <= len(rounded)
        extra = sum(b[0] * b[1] - round_rows(r) * round_length(n) for b, (r, n) in zip(chosen, mine))
        assert 0 <= extra < (len(rounded) - len(set(chosen))) * plan.capture_tokens or extra == 0
    assert sum(map(len, plan.fitted.values())) < len({(round_rows(r), round_length(n), v) for r, n, v in shapes})


def test_fit_merges_cheap_neighbours_and_keeps_costly_ones_apart():
    plan = BucketPlan(max_tokens=16384, capture_tokens=10_000)
    plan.fit([(2, 1024, True)] * 3 + [(2, 1280, True)] * 3  # 3 x 512 padded tokens: merged into (2, 1280)
             + [(1, 2048, True), (12, 384, True)]  # their union, 12 x 2048, passes max_tokens: kept apart
             + [(4, 256, False)] * 40 + [(4, 320, False)] * 40)  # 40 x 256 = 10,240 tokens: more than a capture
    assert plan.fitted[True] == [(1, 2048), (2, 1280), (12, 384)]
    assert plan.fitted[False] == [(4, 256), (4, 320)]
    assert plan.bucket(2, 1000, True) == (2, 1280) and plan.bucket(2, 1000, False) == (2, 1024)  # unfitted: rounded
    assert plan.bucket(3, 300, False) == (4, 320) and plan.bucket(3, 250, False) == (4, 256)
    plan.fit([])
    assert plan.bucket(2, 1000, True) == (2, 1024)  # a new fit replaces the last


def test_padding_into_a_bucket(seed):
    rng = random.Random(seed)
    B, L, rows, length = 3, 7, 4, 16
    ids = torch.randint(1, 50, (B, L), generator=torch.Generator().manual_seed(seed))
    slots = [rng.randrange(-1, 3) for _ in range(B)]
    padded, token_slots = pad_to_bucket(ids, slots, rows, length)
    assert padded.shape == (rows, length) and token_slots.shape == (rows * length,)
    assert torch.equal(padded[:B, :L], ids)
    assert (padded[B:] == 0).all() and (padded[:, L:] == 0).all()
    assert token_slots.view(rows, length)[:B].tolist() == [[s] * length for s in slots]
    assert (token_slots.view(rows, length)[B:] == -1).all()


def test_no_graphs_without_cuda(moe_model, seed):
    """On the CPU the engine runs eagerly (graphs are a GPU feature); asking for them changes nothing."""
    model = load_model(moe_model)
    with_graphs = Engine(model, cuda_graphs=True)
    assert with_graphs.graphs is None and with_graphs.graph_stats() is None
    seqs = random_sequences(3, 96, seed=seed)
    a = with_graphs.logprobs(Batch(seqs, [None] * 3))
    b = Engine(model, cuda_graphs=False).logprobs(Batch(seqs, [None] * 3))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_garbage_collection_inside_a_capture(monkeypatch):
    """A capture runs with the garbage collector off, and collects just before: collecting a dropped engine destroys
    its graphs, and destroying a graph while another is captured invalidated that capture on an H200. The CUDA calls
    are stood in for (no GPU here); what is checked is the collector's state while the forward is being recorded, and
    that the capture runs on a stream made for the runner's device (torch's default capture stream lives on whichever
    GPU was current when it was first made: an engine on cuda:1 after one on cuda:0 captured nothing, 2 x H200)."""
    import contextlib
    import gc

    from lora_eval.runners import graphs

    seen = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})()
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    recording, captured_on = [], []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        captured_on.append(stream)
        recording.append(True)
        yield
        recording.pop()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(len(recording)) or 0)
    runner = graphs.GraphRunner(lambda ids, slots, lora, routes=None: seen.append((bool(recording), gc.isenabled())) or
                                torch.zeros(ids.numel(), 4), torch.device("cpu"))
    assert gc.isenabled()
    runner._capture(2, 16, True)
    assert seen == [(False, True), (True, False)]  # warm-up with collection on, the recorded forward with it off
    assert collected == [0] and gc.isenabled()  # collected once, before recording; on again after
    assert captured_on == [stream] and made == [torch.device("cpu")]  # the runner's device's stream
    with pytest.raises(RuntimeError):  # a failing capture leaves the collector on too
        runner.build = lambda *a: (_ for _ in ()).throw(RuntimeError("capture failed"))
        runner._capture(2, 16, True)
    assert gc.isenabled()
