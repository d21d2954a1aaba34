"""The prefixed attention kernel against its plain-torch reference and against the forward's torch form
(row_attention over the prefix's keys concatenated in front): interpreter on the CPU in float32 and float16, the GPU
in bf16 at Qwen3-30B-A3B's heads; odd lengths and head dims so that masked tails are exercised, grouped-query heads,
MLA's wider query/key head, GPT-OSS's sinks and sliding window (narrower than the prefix, so that whole key blocks
fall outside it), rows of the batch outside the group left untouched."""

from __future__ import annotations

import pytest
import torch

from lora_eval.engine.forward import row_attention, sink_attention
from lora_eval.kernels.prefix_attention import (PrefixTable, heads_per_program, one_prefix, prefix_addresses,
                                                prefix_attention, prefix_attention_ref)
from lora_eval.kernels.tiles import PREFIX_ATTENTION_TILES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BM = PREFIX_ATTENTION_TILES["BLOCK_M"]


def _case(g, B, nh, nkv, L, P, D, DV, dtype, device=DEVICE):
    draw = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    q = draw(B, L, nh, D).transpose(1, 2)  # [B, nh, L, D], the forward's layout (heads a stride apart)
    k, v = draw(B, nkv, L, D), draw(B, nkv, L, DV)
    pk, pv = (draw(nkv, P, D), draw(nkv, P, DV)) if P else (None, None)
    return q, k, v, pk, pv


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("nh,nkv,D,DV,P,sinks,window", [(4, 2, 24, 24, BM + 9, False, None),
                                                        (3, 3, 20, 12, 5, False, None),
                                                        (4, 1, 16, 16, 0, False, None),
                                                        (4, 2, 16, 16, 2 * BM + 3, True, BM // 2 + 5),
                                                        (4, 2, 16, 16, 0, True, None),
                                                        (16, 2, 16, 16, BM + 1, True, BM // 4 + 3),
                                                        (12, 1, 16, 16, 9, False, None)],
                         ids=["gqa", "mla-widths", "no-prefix", "sinks-window", "sinks", "gqa-8-packed",
                              "gqa-12-in-parts"])
def test_matches_reference(seed, dtype, tol, nh, nkv, D, DV, P, sinks, window):
    """Rows 0 and 2 of a 3-row batch (row 1 poisoned and left so); L not a multiple of the query block, P of the key
    block; every output within tol of the float32 reference and of the torch path's form (row_attention, or
    sink_attention with sinks or a window)."""
    g = torch.Generator().manual_seed(seed)
    B, L = 3, BM + 7
    q, k, v, pk, pv = _case(g, B, nh, nkv, L, P, D, DV, dtype)
    sink = (3 + torch.rand(nh, generator=g)).to(DEVICE, dtype) if sinks else None  # large enough to matter
    scale = D ** -0.5
    out = torch.full((B, nh, L, DV), float("nan"), dtype=dtype, device=DEVICE)
    rows = torch.tensor([0, 2], device=DEVICE)
    prefix_attention(q, k, v, out, rows, scale, one_prefix(pk, pv, B, DEVICE), sink, window)
    ref = prefix_attention_ref(q, k, v, scale, pk, pv, sink, window)
    assert out[1].isnan().all()
    assert not out[rows].isnan().any()
    assert (out[rows].float() - ref[rows].float()).abs().max().item() < tol
    if pk is not None:
        kk = torch.cat([pk[None].expand(B, -1, -1, -1), k], dim=2)
        vv = torch.cat([pv[None].expand(B, -1, -1, -1), v], dim=2)
    else:
        kk, vv = k, v
    if sinks or window:
        torch_form = sink_attention(q.float(), kk.float(), vv.float(), scale, None if sink is None else sink.float(),
                                    window, offset=P)
    else:
        torch_form = row_attention(q.float(), kk.float(), vv.float(), scale, offset=P)
    assert (out[rows].float() - torch_form[rows]).abs().max().item() < tol
    # each feature matters: the same rows without the prefix, the sinks or the window differ
    for name, change in (("prefix", dict(table=None)), ("sinks", dict(sinks=None)), ("window", dict(window=None))):
        given = dict(table=None if pk is None else one_prefix(pk, pv, B, DEVICE), sinks=sink, window=window)
        if given[next(iter(change))] is None:
            continue
        other = torch.full_like(out, float("nan"))
        prefix_attention(q, k, v, other, rows, scale, **{**given, **change})
        assert (other[rows].float() - out[rows].float()).abs().max().item() > 10 * tol, name


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("sinks,window", [(False, None), (True, BM // 2 + 5)], ids=["plain", "sinks-window"])
def test_rows_of_different_prefixes_in_one_launch(seed, dtype, tol, sinks, window):
    """One launch over a batch whose rows continue different prefixes (of their own lengths, one of them none, two
    rows sharing one; an entry that no row uses), rows of their own lengths: each row equals the reference of that
    row alone with its own prefix, and a row omitted from `rows` is left untouched."""
    g = torch.Generator().manual_seed(seed)
    nh, nkv, D, DV = 8, 2, 24, 16
    B, L = 6, BM + 7
    q, k, v, _, _ = _case(g, B, nh, nkv, L, 0, D, DV, dtype)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)  # noqa: E731
    sizes = [0, 5, BM + 9, 2 * BM + 3, 17]  # entry 0: no prefix; entry 4: not used
    kv = [None] + [(draw(nkv, P, D), draw(nkv, P, DV)) for P in sizes[1:]]
    entry = [2, 0, 3, 1, 2, 3]
    lengths = [L, 1, int(torch.randint(2, L, (1,), generator=g)), L - 3, 9, L]
    addresses = torch.tensor([[0, 0]] + [prefix_addresses(*pair) for pair in kv[1:]], dtype=torch.int64).T
    table = PrefixTable(torch.tensor(entry, dtype=torch.int32, device=DEVICE), addresses.contiguous().to(DEVICE),
                        torch.tensor(sizes, dtype=torch.int32, device=DEVICE))
    sink = (3 + torch.rand(nh, generator=g)).to(DEVICE, dtype) if sinks else None
    rows = torch.tensor([0, 1, 2, 3, 5], device=DEVICE)  # row 4 left out
    out = torch.full((B, nh, L, DV), float("nan"), dtype=dtype, device=DEVICE)
    prefix_attention(q, k, v, out, rows, D ** -0.5, table, sink, window,
                     lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    assert out[4].isnan().all()
    for b in rows.tolist():
        n, pair = lengths[b], kv[entry[b]]
        alone = prefix_attention_ref(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], D ** -0.5,
                                     *(pair or (None, None)), sink, window)
        assert (out[b:b + 1, :, :n].float() - alone.float()).abs().max().item() < tol, b
    with pytest.raises(ValueError, match="must be contiguous"):
        prefix_addresses(kv[1][0].transpose(1, 2), kv[1][1])


def test_heads_per_program():
    """Powers of two dividing the group, each head keeping 8 or more of the program's query rows."""
    assert [heads_per_program(g, 64) for g in (1, 2, 3, 8, 12, 16)] == [1, 2, 1, 8, 4, 8]
    assert heads_per_program(8, 32) == 4 and heads_per_program(8, 128) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_shorter_than_the_batch(seed, dtype):
    """Rows of their own lengths in a batch padded to L (packed heads: 8 of a key/value head): each row's positions
    equal the reference of the row alone, blocks wholly past its length come out as zeros, nothing is NaN."""
    g = torch.Generator().manual_seed(seed)
    nh, nkv, D = 16, 2, 16
    B, L, P = 4, 3 * BM // 2 + 5, BM // 2 + 3
    q, k, v, pk, pv = _case(g, B, nh, nkv, L, P, D, D, dtype)
    lengths = [L, 1, int(torch.randint(2, L // 2, (1,), generator=g)), int(torch.randint(L // 2, L, (1,), generator=g))]
    out = torch.full((B, nh, L, D), float("nan"), dtype=dtype, device=DEVICE)
    prefix_attention(q, k, v, out, torch.arange(B, device=DEVICE), D ** -0.5, one_prefix(pk, pv, B, DEVICE),
                     lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    block = BM // heads_per_program(nh // nkv, BM)  # positions per program
    assert not out.isnan().any()
    for b, n in enumerate(lengths):
        alone = prefix_attention_ref(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], D ** -0.5, pk, pv)
        assert (out[b:b + 1, :, :n].float() - alone.float()).abs().max().item() < (2e-5 if dtype == torch.float32
                                                                                   else 3e-3)
        assert (out[b, :, -(-n // block) * block:] == 0).all()


def test_refuses_heads_that_do_not_group(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, _, _ = _case(g, 1, 3, 2, 5, 0, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        prefix_attention(q, k, v, torch.empty(1, 3, 5, 16, device=DEVICE), torch.tensor([0], device=DEVICE), 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nh,nkv,D,DV", [(32, 4, 128, 128), (16, 16, 192, 128)], ids=["qwen3-30b", "mla"])
def test_gpu_bf16_real_heads(seed, nh, nkv, D, DV):
    """bf16 on the GPU at real head counts and widths (an MMLU-like group: 24 rows of up to 97 tokens after a
    613-token prefix) against the float32 reference: as close as bf16 SDPA over the concatenated keys is."""
    g = torch.Generator().manual_seed(seed)
    B, L, P = 24, 97, 613
    q, k, v, pk, pv = _case(g, B, nh, nkv, L, P, D, DV, torch.bfloat16)
    scale = D ** -0.5
    out = torch.empty(B, nh, L, DV, dtype=torch.bfloat16, device="cuda")
    prefix_attention(q, k, v, out, torch.arange(B, device="cuda"), scale, one_prefix(pk, pv, B, "cuda"))
    ref = prefix_attention_ref(q.float(), k.float(), v.float(), scale, pk.float(), pv.float())
    kk = torch.cat([pk[None].expand(B, -1, -1, -1), k], dim=2)
    vv = torch.cat([pv[None].expand(B, -1, -1, -1), v], dim=2)
    sdpa = row_attention(q, kk, vv, scale, offset=P)
    ours, theirs = (out.float() - ref).abs().max().item(), (sdpa.float() - ref).abs().max().item()
    print(f"max |d| against float32: kernel {ours:.3g}, SDPA {theirs:.3g}")
    assert ours <= 2 * theirs + 1e-3
