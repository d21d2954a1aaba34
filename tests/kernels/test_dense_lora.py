"""Triton dense multi-LoRA and embedding LoRA against the plain-torch references in the same module.

On the CPU these run in the Triton interpreter (float32, float16; small shapes, large blocks); with CUDA the
same tests run compiled on the GPU, and the `gpu` tests add bf16 at layer shapes, no host sync in the launch
path, and CUDA-graph capture. Every batch mixes several slots of different row counts, a slot with no rows
and rows with slot -1, which must come out bit for bit untouched. Fresh random inputs every run (`seed`).
"""

from __future__ import annotations


import pytest
import torch

from lora_eval.kernels.dense_lora import (
    dense_lora,
    dense_lora_expand,
    dense_lora_ref,
    dense_lora_shrink,
    embedding_lora,
    embedding_lora_ref,
    lora_residual_add,
    lora_residual_add_ref,
    shrink_splits,
)
from lora_eval.kernels import dense_lora as dense_lora_module
from lora_eval.kernels.linear import linear_ref
from lora_eval.kernels.lora_meta import lora_metadata
from tests.kernels.partials import shrink_partials

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float16, 2e-3, id="fp16")]
T, K, N, S = 77, 200, 150, 4  # rows, in, out, slots: none a multiple of any block
COUNTS = (30, 5, 0, 20)  # rows per slot (slot 2 has none); the other T - 55 rows have slot -1
SMALL = {"shrink": dict(BLOCK_M=16, BLOCK_K=32), "expand": dict(BLOCK_M=16, BLOCK_N=32)}  # many tiles per dim


def make_slots(counts, total, g):
    slots = torch.full((total,), -1, dtype=torch.long)
    slots[:sum(counts)] = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return slots[torch.randperm(total, generator=g)]


def make_lora(ranks, fan_in, fan_out, g):
    """A [S, R, in], B [S, out, R] stacked to R = max(ranks), zero beyond each slot's own rank."""
    R = max(ranks)
    A = torch.randn(len(ranks), R, fan_in, generator=g) / fan_in ** 0.5
    B = torch.randn(len(ranks), fan_out, R, generator=g)
    for s, r in enumerate(ranks):
        A[s, r:] = 0
        B[s, :, r:] = 0
        B[s] /= r ** 0.5
    return A, B


def groups_of(slots, skip=()):
    return [(s, (slots == s).nonzero().squeeze(1)) for s in range(S) if s not in skip and (slots == s).any()]


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_update(name, y0, out, ref64, ref, slots, tol, skip=()):
    """Rows of no (unmasked) slot equal y0 bit for bit; the others' update (out - y0) matches the float64
    reference within tol, and out matches the same-dtype reference within tol."""
    untouched = (slots < 0) | torch.isin(slots, torch.tensor(list(skip), dtype=torch.long))
    out = out.cpu()
    assert torch.equal(out[untouched], y0[untouched])  # never written (any CPU, any dot: no sum involved)
    touched = ~untouched
    if not touched.any():
        return
    delta = rel_err(out[touched].double() - y0[touched].double(), ref64[touched] - y0[touched].double())
    full = rel_err(out[touched], ref[touched])
    print(f"{name}: update rel err {delta:.2e} (vs float64), output rel err {full:.2e} (vs {ref.dtype} reference)")
    assert delta < tol and full < tol


def run_dense(dtype, tol, ranks, seed, counts=COUNTS, total=T, blocks=None, slot_mask_off=(), splits=1):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(counts, total, g)
    A, B = make_lora(ranks, K, N, g)
    x, y0 = torch.randn(total, K, generator=g).to(dtype), torch.randn(total, N, generator=g).to(dtype)
    A, B = A.to(dtype), B.to(dtype)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    meta = lora_metadata(on(slots), len(ranks))
    slot_mask = None
    if slot_mask_off:
        slot_mask = on(torch.tensor([s not in slot_mask_off for s in range(len(ranks))]))
    shrunk = on(torch.full((splits, total, A.shape[1]), float("nan")))  # poison: a slot's rows must be written
    dense_lora_shrink(on(x), on(A), meta, shrunk, slot_mask=slot_mask, blocks=(blocks or {}).get("shrink"))
    y = on(y0.clone())
    dense_lora_expand(y, shrunk, on(B), meta, slot_mask=slot_mask, blocks=(blocks or {}).get("expand"))

    groups = groups_of(slots, skip=slot_mask_off)
    shrunk = shrunk.cpu()
    for s, rows in groups:
        exact = linear_ref(x[rows].double(), A[s].double())
        assert rel_err(shrunk[:, rows].sum(0), exact) < tol, f"shrink of slot {s}"
        if splits > 1:  # each split holds its own range of the input features
            assert rel_err(shrunk[0, rows], exact) > 0.05
    idle = torch.tensor([s < 0 or s in slot_mask_off for s in slots.tolist()])
    assert shrunk[:, idle].isnan().all(), "the shrink wrote rows outside the slots' segments"
    ref64 = dense_lora_ref(y0.double(), x.double(), A.double(), B.double(), groups)
    ref = dense_lora_ref(y0.clone(), x, A, B, groups)
    check_update(f"{dtype} ranks {ranks}", y0, y, ref64, ref, slots, tol, skip=slot_mask_off)
    return x, y0, A, B, slots, y, slot_mask


def test_metadata(seed):
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(COUNTS, T, g)
    meta = lora_metadata(slots.to(DEVICE), S)
    rows, start = meta.sorted_rows.cpu().tolist(), meta.slot_start.cpu().tolist()
    assert sorted(rows) == list(range(T)) and meta.sorted_rows.dtype == torch.int32
    assert rows[:start[0]] == (slots < 0).nonzero().squeeze(1).tolist()
    for s in range(S):
        assert rows[start[s]:start[s + 1]] == (slots == s).nonzero().squeeze(1).tolist()  # stable: ascending
    assert start[S] == T and meta.slot_count.cpu().tolist() == list(COUNTS)
    assert meta.row_slot.cpu().tolist() == slots.tolist()


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("ranks", [(2, 5, 16, 16), (1, 1, 1, 1), (24, 3, 24, 17), (128, 64, 128, 7)],
                         ids=["R16-padded", "R1", "R24", "R128"])
def test_dense_lora(dtype, tol, ranks, seed):
    x, y0, A, B, slots, y, _ = run_dense(dtype, tol, ranks, seed)
    again = y0.clone().to(DEVICE)  # the one-call wrapper runs the same two kernels: same bits
    dense_lora(again, x.to(DEVICE), A.to(DEVICE), B.to(DEVICE), lora_metadata(slots.to(DEVICE), S))
    assert torch.equal(again, y)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 8], ids=["unsplit", "3-splits", "8-splits"])
def test_dense_lora_small_blocks(dtype, tol, seed, splits):
    """Blocks much smaller than the shapes: several M tiles per slot, N tiles and K steps, all ragged; the shrink
    split over the input features (3: ragged ranges of three K steps; 8: the last split starts past the end and
    holds zeros), the expand adding the partials."""
    run_dense(dtype, tol, (2, 5, 16, 16), seed, blocks=SMALL, splits=splits)


def test_shrink_splits(monkeypatch):
    """The split count doubles up to MAX_SPLITS while one slot's row programs times the splits fit the SMs once
    and each split keeps SPLIT_MIN_K features; 1 off CUDA."""
    assert shrink_splits(128, 2048, 64, torch.device("cpu")) == 1
    monkeypatch.setattr(dense_lora_module, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert [shrink_splits(T, 2048, 64, cuda) for T in (1, 128, 4096, 8192)] == [16, 16, 2, 1]
    assert shrink_splits(128, 4096, 64, cuda) == 16 and shrink_splits(128, 200, 64, cuda) == 1


@pytest.mark.parametrize("counts,total", [((T, 0, 0, 0), T), ((0, 0, 0, 0), T), ((0, 0, 0, 3), 3)],
                         ids=["all-one-slot", "all-none", "three-rows"])
def test_dense_lora_extremes(counts, total, seed):
    run_dense(torch.float32, 1e-5, (2, 5, 16, 16), seed, counts=counts, total=total, blocks=SMALL)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_lora_residual_add(dtype, tol, seed, splits):
    """h + (y + shrunk @ B[slot]^T) in one pass against the reference and against the expand then torch's add:
    rows of no slot and of a masked slot are torch's h + y bit for bit; tiles hold several slots; the shrink as
    one [T, R] or as partial sums."""
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(COUNTS, T, g)
    _, B = make_lora((2, 5, 16, 16), K, N, g)
    h, y0 = torch.randn(T, N, generator=g).to(dtype), torch.randn(T, N, generator=g).to(dtype)
    given, shrunk = shrink_partials(splits, T, 16, g)
    B = B.to(dtype)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    meta = lora_metadata(on(slots), S)
    slot_mask = on(torch.tensor([True, True, True, False]))  # slot 3: no weights at this site
    out = lora_residual_add(on(h), on(y0), on(given), on(B), meta, slot_mask=slot_mask).cpu()
    groups = groups_of(slots, skip=(3,))
    ref64 = lora_residual_add_ref(h.double(), y0.double(), shrunk.double(), B.double(), groups)
    untouched = (slots < 0) | (slots == 3)
    assert torch.equal(out[untouched], (h + y0)[untouched])
    assert rel_err(out[~untouched], ref64[~untouched]) < tol
    assert rel_err((h + y0)[~untouched], ref64[~untouched]) > 0.05  # the deltas matter
    y = on(y0.clone())
    dense_lora_expand(y, on(given), on(B), meta, slot_mask=slot_mask)
    torch.testing.assert_close(out, (on(h) + y).cpu(), rtol=tol, atol=tol)  # the unfused pair


def test_dense_lora_slot_mask(seed):
    """A slot left out by slot_mask (no weights at this site) keeps its rows bit for bit, like slot -1."""
    run_dense(torch.float32, 1e-5, (2, 5, 16, 16), seed, slot_mask_off=(0,))


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_dense_lora_shared_x_slices(dtype, tol, seed):
    """Two projections sharing x (q, k): one shrink over the A's stacked along R, then one expand per slice
    from a column view of the intermediate into a column view of the fused output."""
    g = torch.Generator().manual_seed(seed)
    slots = make_slots(COUNTS, T, g)
    Nq, Nk = 96, 40
    Aq, Bq = make_lora((2, 5, 16, 16), K, Nq, g)
    Ak, Bk = make_lora((8, 3, 8, 1), K, Nk, g)
    x, y0 = torch.randn(T, K, generator=g).to(dtype), torch.randn(T, Nq + Nk, generator=g).to(dtype)
    Aq, Bq, Ak, Bk = (t.to(dtype) for t in (Aq, Bq, Ak, Bk))
    meta = lora_metadata(slots.to(DEVICE), S)
    shrunk = dense_lora_shrink(x.to(DEVICE), torch.cat([Aq, Ak], 1).to(DEVICE), meta, splits=2)  # [2, T, 16 + 8]
    y = y0.clone().to(DEVICE)
    dense_lora_expand(y[:, :Nq], shrunk[..., :16], Bq.to(DEVICE), meta)
    dense_lora_expand(y[:, Nq:], shrunk[..., 16:], Bk.to(DEVICE), meta)
    groups = groups_of(slots)
    for name, cols, A, B in (("q", slice(0, Nq), Aq, Bq), ("k", slice(Nq, None), Ak, Bk)):
        ref64 = dense_lora_ref(y0[:, cols].double(), x.double(), A.double(), B.double(), groups)
        ref = dense_lora_ref(y0[:, cols].clone(), x, A, B, groups)
        check_update(f"{dtype} slice {name}", y0[:, cols], y[:, cols], ref64, ref, slots, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_embedding_lora(dtype, tol, seed):
    g = torch.Generator().manual_seed(seed)
    V = 50
    slots = make_slots(COUNTS, T, g)
    ids = torch.randint(0, V, (T,), generator=g)
    A, B = make_lora((2, 5, 16, 16), V, N, g)
    A, B = (A.transpose(1, 2) * V ** 0.5).to(dtype), B.to(dtype)  # A [S, V, R]: lora_embedding_A transposed
    h0 = torch.randn(T, N, generator=g).to(dtype)
    h = h0.clone().to(DEVICE)
    embedding_lora(h, ids.to(DEVICE), A.to(DEVICE), B.to(DEVICE), lora_metadata(slots.to(DEVICE), S))
    groups = groups_of(slots)
    ref64 = embedding_lora_ref(h0.double(), ids, A.double(), B.double(), groups)
    ref = embedding_lora_ref(h0.clone(), ids, A, B, groups)
    check_update(f"{dtype} embedding", h0, h, ref64, ref, slots, tol)


# --- GPU only ---------------------------------------------------------------------------------------------

def layer_case(seed, dtype=torch.bfloat16, total=4096):
    """Layer shapes: T=4096 (or 128), in=2048, out=4096, S=4, R=16 (ranks 16, 8, 16, 4), 7% of the rows with slot
    -1. On an H100 the shrink splits the input features in 2 at 4096 rows, in 16 at 128 (shrink_splits)."""
    g = torch.Generator().manual_seed(seed)
    fan_in, fan_out = 2048, 4096
    slots = make_slots([total * n // 4096 for n in (1500, 1000, 700, 600)], total, g)
    A, B = make_lora((16, 8, 16, 4), fan_in, fan_out, g)
    x, y0 = torch.randn(total, fan_in, generator=g), torch.randn(total, fan_out, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, y0, A, B)] + [slots.to(DEVICE)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("total", [4096, 128])
def test_dense_lora_bf16_layer_shapes(seed, total):
    x, y0, A, B, slots = layer_case(seed, total=total)
    y = y0.clone()
    dense_lora(y, x, A, B, lora_metadata(slots, 4))
    groups = groups_of(slots.cpu())
    groups = [(s, rows.to(DEVICE)) for s, rows in groups]
    ref = dense_lora_ref(y0.float(), x.float(), A.float(), B.float(), groups)
    none = slots < 0
    assert torch.equal(y[none], y0[none])
    err = rel_err(y[~none].float() - y0[~none].float(), ref[~none] - y0[~none].float())
    print(f"bf16 layer shapes: update rel err {err:.2e} vs float32 reference")
    assert err < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_launch_path_has_no_host_sync(seed):
    x, y0, A, B, slots = layer_case(seed)
    ids = torch.randint(0, 1000, (x.shape[0],), device=DEVICE)
    emb_A, emb_B = torch.randn(4, 1000, 16, device=DEVICE, dtype=x.dtype), B
    for _ in range(2):  # the first round compiles; the second must not sync either
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            meta = lora_metadata(slots, 4)
            dense_lora(y0.clone(), x, A, B, meta)
            embedding_lora(y0.clone(), ids, emb_A, emb_B, meta, slot_mask=torch.ones(4, dtype=torch.bool,
                                                                                        device=DEVICE))
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay(seed):
    """Metadata + both kernels captured once; replayed with other slots in the same buffer, it matches eager."""
    x, y0, A, B, slots = layer_case(seed)
    static_slots, y = slots.clone(), y0.clone()
    dense_lora(y, x, A, B, lora_metadata(static_slots, 4))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(y0)
        dense_lora(y, x, A, B, lora_metadata(static_slots, 4))
    static_slots.copy_(slots[torch.randperm(slots.numel(), device=DEVICE)])
    graph.replay()
    eager = dense_lora(y0.clone(), x, A, B, lora_metadata(static_slots, 4))
    assert torch.equal(y, eager)


@pytest.mark.gpu
@needs_cuda
def test_consumers_compile_with_the_most_partials(seed):
    """At MAX_SPLITS partial sums (a 128-token batch) every consumer of a shrink compiles at Qwen3-30B-A3B shapes
    (bf16) and gives what the summed [T, R] shrink gives, bit for bit (the same additions in the same order):
    the expand and o_proj's residual add."""
    from lora_eval.kernels.tiles import MAX_SPLITS

    g = torch.Generator().manual_seed(seed)
    T, R, S = 128, 16, 4
    parts, total = (t.to(DEVICE) for t in shrink_partials(MAX_SPLITS, T, R, g))
    slots = make_slots((60, 30, 0, 20), T, g).to(DEVICE)
    meta = lora_metadata(slots, S)
    bf = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(DEVICE, bf)

    y, B = rand(T, 4096), rand(S, 4096, R, scale=0.1)
    assert torch.equal(dense_lora_expand(y.clone(), parts, B, meta), dense_lora_expand(y.clone(), total, B, meta))
    h, y, B = rand(T, 2048), rand(T, 2048), rand(S, 2048, R, scale=0.1)
    assert torch.equal(lora_residual_add(h, y, parts, B, meta), lora_residual_add(h, y, total, B, meta))
