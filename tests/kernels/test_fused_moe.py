"""Triton fused MoE (+ MoE-LoRA) and the on-device alignment against their plain-torch references.

On the CPU these run in the Triton interpreter (float32, float16; small shapes, large blocks). The GPU tests
(marker `gpu`) run bf16 at Qwen3-30B-A3B layer shapes against a float32 reference.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from lora_eval.adapters.stack import ExpertLoRA
from lora_eval.kernels.fused_moe import fused_moe, fused_moe_ref, moe_gemm, moe_sum, pick_config
from lora_eval.kernels import fused_moe as fused_moe_module
from lora_eval.kernels.moe_align import moe_align, moe_align_ref
from lora_eval.kernels.tiles import SUM_BLOCKS, SUM_LORA_BLOCKS, MoeConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (tests/conftest.py)
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
_TILES = {k: v for k, v in SMALL.items() if k != "BLOCK_M"}
# operand layouts: pointers; expert weights through TMA descriptors; and the activation in block order read
# through a descriptor too; and the LoRA delta added before the main loop; half-height tail blocks; the down
# shrink inside the down GEMM (kernels/tiles.py MoeConfig)
LAYOUTS = {"ptr": MoeConfig(16, _TILES, _TILES), "w_tma": MoeConfig(16, _TILES, _TILES, w_tma=True),
           "sorted_act": MoeConfig(16, _TILES, _TILES, w_tma=True, sorted_act=True),
           "expand_first": MoeConfig(16, _TILES, _TILES, w_tma=True, expand_first=True),
           "half_tail": MoeConfig(32, _TILES, _TILES, w_tma=True, sorted_act=True, half_tail=True),
           "pair_shrink": MoeConfig(32, _TILES, _TILES, w_tma=True, expand_first=True, half_tail=True,
                                    pair_shrink=True)}
INTERPRETER_DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def routing(T, E, k, g, device=DEVICE, skip_expert=None):
    """Random top-k routing (distinct experts per token, weights not normalised so double use shows)."""
    logits = torch.randn(T, E, generator=g)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # this expert gets no token
    weights, ids = torch.topk(logits.softmax(-1), k)
    return ids.to(device), (weights * 1.7).to(device)


def expert_lora(S, E, H, I, R, g, dtype, shared_outer=True, empty_slot=None, gate_up_rank=None):
    """Stacked expert LoRA with gate/up A shared across experts and down B shared (expert dim 1) when
    shared_outer; slot `empty_slot` all zero (an adapter with no expert weights). Rank R, gate_up_rank (gate and up
    stacked: twice PEFT's rank per projection) R unless given. Drawn on g's device."""
    Ea = 1 if shared_outer else E
    Rg = gate_up_rank or R
    draw = functools.partial(torch.randn, generator=g, device=g.device)
    lora = ExpertLoRA(
        gate_up_A=0.3 * draw(S, Ea, Rg, H), gate_up_B=0.3 * draw(S, E, 2 * I, Rg),
        down_A=0.3 * draw(S, E, R, I), down_B=0.3 * draw(S, Ea, H, R),
        slots=frozenset(range(S)))
    for name in ("gate_up_A", "gate_up_B", "down_A", "down_B"):
        t = getattr(lora, name)
        if empty_slot is not None:
            t[empty_slot] = 0
        setattr(lora, name, t.to(DEVICE, dtype))
    return lora


def test_alignment_matches_reference(seed):
    """Expert groups in order, each padded to BLOCK_M with the sentinel, pairs ordered by slot inside a group
    (the order inside one (expert, slot) bin is the atomics' and may vary); block maps right."""
    g = torch.Generator().manual_seed(seed)
    T, k, E, S, bm = 37, 3, 7, 4, 8
    ids, _ = routing(T, E, k, g, skip_expert=2)
    slots = torch.randint(-1, S, (T,), generator=g)
    slots[slots == 1] = 2  # slot 1 has no rows
    align = moe_align(ids, E, bm, slots.to(DEVICE), S)
    groups = moe_align_ref(ids.cpu(), E, bm, slots)
    pairs = align.sorted_pairs.tolist()
    start = 0
    for e, members in groups:
        n_blocks = -(-len(members) // bm)
        got = pairs[start:start + len(members)]
        assert sorted(got) == sorted(members)
        block_slots = [slots[p // k].item() for p in got]
        assert block_slots == [slots[p // k].item() for p in members]  # slot order within the group
        assert all(p == T * k for p in pairs[start + len(members):start + n_blocks * bm])  # padding sentinel
        for b in range(n_blocks):
            chunk = block_slots[b * bm:(b + 1) * bm]
            assert align.block_expert[start // bm + b].item() == e
            assert align.block_slot_lo[start // bm + b].item() == min(chunk)
            assert align.block_slot_hi[start // bm + b].item() == max(chunk)
        start += n_blocks * bm
    assert align.num_padded.item() == start
    assert 2 not in [e for e, _ in groups]
    assert (align.block_expert[start // bm:] == E).all()  # blocks past the padded count are marked unused
    assert (align.block_slot_hi[start // bm:] == -2).all()
    plain = moe_align(ids, E, bm)  # without adapter slots: the same expert groups
    assert plain.num_padded.item() == start and torch.equal(plain.block_expert, align.block_expert)
    assert plain.block_slot_lo is None and plain.token_slots is None
    for e, members in groups:
        first = plain.block_expert.tolist().index(e) * bm
        assert sorted(plain.sorted_pairs[first:first + len(members)].tolist()) == sorted(members)


def test_alignment_of_many_programs(seed):
    """Pairs and blocks spread over several programs of both alignment kernels."""
    g = torch.Generator().manual_seed(seed)
    T, k, E, S, bm = 700, 2, 5, 3, 16  # 1400 pairs: two programs of ALIGN_BLOCK pairs; 93 blocks: two of maps
    ids, _ = routing(T, E, k, g)
    slots = torch.randint(-1, S, (T,), generator=g)
    align = moe_align(ids, E, bm, slots.to(DEVICE), S)
    pairs = align.sorted_pairs[:align.num_padded.item()].cpu()
    real = pairs[pairs < T * k]
    assert sorted(real.tolist()) == list(range(T * k))
    expert_of_row = align.block_expert.cpu().repeat_interleave(bm)[:len(pairs)]
    assert torch.equal(ids.reshape(-1).cpu()[real.long()], expert_of_row[pairs < T * k].long())
    lo, hi = align.block_slot_lo.cpu(), align.block_slot_hi.cpu()
    for b in range(len(pairs) // bm):
        chunk = pairs[b * bm:(b + 1) * bm]
        chunk_slots = slots[chunk[chunk < T * k].long() // k]
        assert lo[b] == chunk_slots.min() and hi[b] == chunk_slots.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_sum_over_k(seed, dtype):
    """out[t] = sum over the k routed copies in fp32, every column written (H past one block, ragged)."""
    g = torch.Generator().manual_seed(seed)
    T, k, H = 3, 5, SUM_BLOCKS["BLOCK_H"] + 37
    y = torch.randn(T, k, H, generator=g).to(DEVICE, dtype)
    out = moe_sum(y)
    ref = y.double().sum(1)
    assert out.dtype == dtype and out.shape == (T, H)
    assert not out.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_sum_adds_the_residual(seed, dtype):
    """With `residual`, the sum over k (and a shared down B's expand) rounded to the dtype and then added to the
    residual: bit for bit torch's residual + the sum without it, lanes past one block and a ragged tail too."""
    g = torch.Generator().manual_seed(seed)
    T, k, H, R, S = 37, 3, SUM_LORA_BLOCKS["BLOCK_H"] + 24, 8, 3
    y = torch.randn(T, k, H, generator=g).to(DEVICE, dtype)
    residual = (4 * torch.randn(T, H, generator=g)).to(DEVICE, dtype)
    shrunk, weights = torch.randn(T, k, R, generator=g), torch.rand(T, k, generator=g) + 0.5
    B, slots = 0.5 * torch.randn(S, H, R, generator=g), torch.randint(-1, S, (T,), generator=g)
    lora = (shrunk.to(DEVICE, dtype), weights.to(DEVICE, dtype), slots.to(DEVICE), B.to(DEVICE, dtype))
    for with_lora in (None, lora):
        out = moe_sum(y, with_lora, residual)
        assert torch.equal(out, residual + moe_sum(y, with_lora))
        assert not torch.equal(out, moe_sum(y, with_lora))
    with pytest.raises(ValueError, match="residual"):
        moe_sum(y, None, residual[:, :-1])


@pytest.mark.parametrize("dtype,tol", INTERPRETER_DTYPES)
def test_moe_sum_with_shared_down_expand(seed, dtype, tol):
    """The sum over k plus the expand of a down B shared by all experts: out[t] = sum_j y[t, j] +
    (sum_j w[t, j] shrunk[t, j]) @ B[slot]^T; tokens of no adapter read no shrink row (NaN there) and equal the
    plain sum bit for bit; tiles with several slots and a ragged last tile (T past one BLOCK_T, H past BLOCK_H)."""
    g = torch.Generator().manual_seed(seed)
    T, k, H, R, S = 37, 3, SUM_LORA_BLOCKS["BLOCK_H"] + 24, 8, 3
    y = torch.randn(T, k, H, generator=g).to(DEVICE, dtype)
    shrunk = torch.randn(T, k, R, generator=g)
    weights = torch.rand(T, k, generator=g) + 0.5
    B = 0.5 * torch.randn(S, H, R, generator=g)
    slots = torch.randint(-1, S, (T,), generator=g)
    shrunk[slots == -1] = float("nan")  # never written by the shrink kernel: must not be read
    out = moe_sum(y, (shrunk.to(DEVICE, dtype), weights.to(DEVICE, dtype), slots.to(DEVICE), B.to(DEVICE, dtype)))
    ref = y.double().sum(1)
    for t in range(T):
        if slots[t] >= 0:
            shrunk_t = (weights.to(dtype)[t, :, None].double() * shrunk.to(dtype)[t].double()).sum(0)  # [R]
            ref[t] += (B.to(dtype)[slots[t]].double() @ shrunk_t).to(DEVICE)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol
    plain = moe_sum(y)
    assert torch.equal(out[slots.to(DEVICE) == -1], plain[slots.to(DEVICE) == -1])
    assert rel_err(plain, ref) > 0.05  # the expand matters, so the test can fail


def check_gemm_stages(ids, weights, E, H, I, config, g, dtype, tol, **layout):
    """Each launch of the grouped GEMM into NaN-poisoned outputs against an einsum: gate_up + activation, then
    down * routing weight."""
    T, k = ids.shape
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    align = moe_align(ids, E, config["BLOCK_M"])
    act = torch.full((T * k, I), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm(x, w_gu, act, align, gated=True, rows_are_tokens=True, top_k=k, config=config, **layout)
    gu = torch.einsum("th,tjnh->tjn", x.float(), w_gu.float()[ids])  # [T, k, 2I]
    act_ref = (torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]).reshape(T * k, I)
    assert not act.isnan().any()
    assert rel_err(act, act_ref) < tol
    y = torch.full((T * k, H), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm(act, w_d, y, align, gated=False, rows_are_tokens=False, top_k=k, topk_weights=weights.reshape(-1),
             config=config, **layout)
    y_ref = torch.einsum("pi,phi->ph", act.float(), w_d.float()[ids.reshape(-1)]) * weights.reshape(-1, 1).float()
    assert not y.isnan().any()
    assert rel_err(y, y_ref) < tol
    return align


@pytest.mark.parametrize("dtype,tol", INTERPRETER_DTYPES)
def test_moe_gemm_stages_write_every_output(seed, dtype, tol):
    """Both launches of the grouped GEMM write every output (an expert without tokens among them)."""
    g = torch.Generator().manual_seed(seed)
    ids, weights = routing(19, 5, 2, g, skip_expert=4)
    check_gemm_stages(ids, weights, 5, 32, 24, SMALL, g, dtype, tol)


def sized_routing(sizes, k, g):
    """Routing in which expert e gets exactly sizes[e] pairs (each token's k experts distinct), rows shuffled."""
    experts = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # [T*k] sorted by expert
    T = experts.numel() // k
    assert max(sizes) <= T
    ids = experts.view(k, T).T  # [T, k]: token t gets experts[t], experts[t + T], ... (distinct: runs <= T)
    ids = ids[torch.randperm(T, generator=g)]
    return ids.to(DEVICE), torch.rand(T, k, generator=g).to(DEVICE) + 0.5


@pytest.mark.parametrize("dtype,tol", INTERPRETER_DTYPES)
def test_moe_gemm_half_tail_blocks(seed, dtype, tol):
    """half_tail: blocks whose pairs fit in their first half compute that half only. Expert groups of 10 (one
    half block), 45 (a full block and a half one), 25 and 20 (full blocks), none; NaN-poisoned outputs."""
    g = torch.Generator().manual_seed(seed)
    k, BM = 2, 32
    ids, weights = sized_routing([0, 10, 45, 25, 20], k, g)
    align = check_gemm_stages(ids, weights, 5, 32, 24, dict(SMALL, BLOCK_M=BM), g, dtype, tol, half_tail=True)
    pairs = align.sorted_pairs[:int(align.num_padded)].view(-1, BM)  # [blocks, BM]
    half = (pairs[:, BM // 2:] >= ids.numel()).all(1)  # [blocks]
    assert half.sum() == 2 and (~half).sum() == 3  # both kinds of blocks were there


@pytest.mark.parametrize("dtype,tol", INTERPRETER_DTYPES)
@pytest.mark.parametrize("shared_outer", [True, False])
@pytest.mark.parametrize("all_slots", [True, False], ids=["shrink-all-slots", "shrink-per-slot"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_moe_lora_matches_reference(seed, dtype, tol, shared_outer, all_slots, layout):
    g = torch.Generator().manual_seed(seed)
    T, k, E, H, I, S, R = 61, 2, 6, 32, 16, 5, 8  # ~20 pairs per expert: several blocks, several slots in most
    config = replace(LAYOUTS[layout], all_slots_max=128 if all_slots else 0)  # both shrink variants
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    ids, weights = routing(T, E, k, g, skip_expert=0)
    weights = weights.to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    lora = expert_lora(S, E, H, I, R, g, dtype, shared_outer=shared_outer, empty_slot=4)
    slots = torch.randint(-1, S, (T,), generator=g)
    slots[slots == 2] = 0  # slot 2 has no rows
    slots[:2] = 4  # the empty slot has rows: they must equal the base model
    slots = slots.to(DEVICE)
    out = fused_moe(x, ids, weights, w_gu, w_d, lora, slots, config=config)
    ref = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float(), _float(lora), slots)
    base = fused_moe(x, ids, weights, w_gu, w_d, config=config)
    assert rel_err(out, ref) < tol
    assert rel_err(base, ref) > 0.05  # the adapters matter, so the test can fail
    no_delta = (slots == -1) | (slots == 4)
    # rows with no (or an empty) adapter get no delta; the interpreter's numpy matmul may round a row
    # differently in another block composition, so exact equality is checked on the GPU only
    torch.testing.assert_close(out[no_delta], base[no_delta], rtol=tol, atol=tol)


def test_fused_moe_reads_strided_routing_inputs(seed):
    """Expert ids, weights and slots given as columns of wider tensors (expert parallel receives (expert, slot)
    pairs as one [n, 2] tensor): the same output as from contiguous copies, and the reference's. The kernels read
    these by flat index, so a strided view once read slots as expert ids, out of bounds (a GPU run crashed)."""
    g = torch.Generator().manual_seed(seed)
    T, E, H, I, S, R = 40, 4, 32, 16, 2, 8
    x = torch.randn(T, H, generator=g).to(DEVICE)
    ids = torch.randint(0, E, (T, 1), generator=g)
    slots = torch.randint(-1, S, (T,), generator=g)
    items = torch.stack([ids[:, 0], slots], 1).to(DEVICE)  # [T, 2]: the layout expert parallel sends
    weights = torch.rand(T, 2, generator=g).to(DEVICE)[:, :1]  # [T, 1], stride 2
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE)
    w_d = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE)
    lora = expert_lora(S, E, H, I, R, g, torch.float32, shared_outer=False)
    strided = fused_moe(x, items[:, :1], weights, w_gu, w_d, lora, items[:, 1], config=LAYOUTS["ptr"])
    assert not items[:, :1].is_contiguous() and not items[:, 1].is_contiguous()
    dense = fused_moe(x, items[:, :1].contiguous(), weights.contiguous(), w_gu, w_d, lora, items[:, 1].contiguous(),
                      config=LAYOUTS["ptr"])
    ref = fused_moe_ref(x, ids.to(DEVICE), weights, w_gu, w_d, _float(lora), slots.to(DEVICE))
    assert torch.equal(strided, dense)  # the same operands in the same tiles: equal whatever the dot's order
    assert rel_err(strided, ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", INTERPRETER_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_moe_biases_and_clamped_swiglu(seed, dtype, tol, layout):
    """GPT-OSS experts: gate_up and down biases, the clamped SwiGLU (a small limit so that the clamps bite on
    both sides), with LoRA on some rows."""
    g = torch.Generator().manual_seed(seed)
    T, k, E, H, I, S, R = 21, 2, 5, 32, 16, 2, 8
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    ids, weights = routing(T, E, k, g, skip_expert=1)
    weights = weights.to(DEVICE, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    b_gu = torch.randn(E, 2 * I, generator=g).to(DEVICE, dtype)
    b_d = torch.randn(E, H, generator=g).to(DEVICE, dtype)
    lora = expert_lora(S, E, H, I, R, g, dtype, shared_outer=False)
    slots = torch.randint(-1, S, (T,), generator=g).to(DEVICE)
    kw = dict(activation="clamped_swiglu", alpha=1.702, limit=0.8)
    out = fused_moe(x, ids, weights, w_gu, w_d, lora, slots, config=LAYOUTS[layout], gate_up_bias=b_gu,
                    down_bias=b_d, **kw)
    ref = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float(), _float(lora), slots,
                        gate_up_bias=b_gu.float(), down_bias=b_d.float(), **kw)
    assert rel_err(out, ref) < tol
    gate_up = torch.einsum("th,tjnh->tjn", x.float(), w_gu.float()[ids]) + b_gu.float()[ids]  # [T, k, 2I]
    assert (gate_up[..., :I] > 0.8).any() and (gate_up[..., I:].abs() > 0.8).any()  # the clamps are active
    unbiased = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float(), _float(lora), slots, **kw)
    silu = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float(), _float(lora), slots,
                         gate_up_bias=b_gu.float(), down_bias=b_d.float())
    assert rel_err(unbiased, ref) > 0.05 and rel_err(silu, ref) > 0.05  # biases and activation both matter


def _float(lora):
    return ExpertLoRA(*(getattr(lora, n).float() for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")),
                      slots=lora.slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,shared_outer,R", [(T, shared_outer, 16) for T in (64, 1024, 2048, 8192)
                                              for shared_outer in (True, False)]
                         + [(64, False, 32), (2048, False, 32), (4096, True, 32), (8192, False, 32),
                            (2048, False, 64), (8192, True, 64)])
def test_fused_moe_bf16_qwen3_30b_shapes(T, shared_outer, R, seed):
    """Qwen3-30B-A3B layer: E=128, top-8, H=2048, I=768; 4 adapters (shared-outer or per-expert factors) of rank R
    (16: gate and up stacked 16; 32 / 64: PEFT's rank per projection, gate and up stacked 64 / 128, the grouped
    GEMM one pipeline stage shallower to fit shared memory, at rank 64 its expand in two rank chunks); bf16 vs fp32
    reference. The sizes reach every MOE_CONFIGS entry (TMA weights from 1024 tokens, half-height tail blocks from
    2048, the block-ordered activation and the Gluon GEMMs at 8192). Weights drawn on the GPU (on the CPU, 0.6 G
    normal draws took ~10 s a case)."""
    g = torch.Generator().manual_seed(seed)
    dev = "cuda"
    gd = torch.Generator(device=dev).manual_seed(seed)
    E, k, H, I, S = 128, 8, 2048, 768, 4
    x = torch.randn(T, H, generator=gd, device=dev).to(torch.bfloat16)
    ids, weights = routing(T, E, k, g, device=dev)
    w_gu = (torch.randn(E, 2 * I, H, generator=gd, device=dev) / H**0.5).to(torch.bfloat16)
    w_d = (torch.randn(E, H, I, generator=gd, device=dev) / I**0.5).to(torch.bfloat16)
    lora = expert_lora(S, E, H, I, R, gd, torch.bfloat16, shared_outer=shared_outer,
                       gate_up_rank=16 if R == 16 else 2 * R)
    lora = ExpertLoRA(*(getattr(lora, n).to(dev) for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")),
                      slots=lora.slots)
    slots = torch.randint(-1, S, (T,), generator=g).to(dev)
    out = fused_moe(x, ids, weights.to(torch.bfloat16), w_gu, w_d, lora, slots)
    ref = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float(), _float(lora), slots)
    assert rel_err(out, ref) < 1e-2
    base = fused_moe(x, ids, weights.to(torch.bfloat16), w_gu, w_d)
    base_ref = fused_moe_ref(x.float(), ids, weights.float(), w_gu.float(), w_d.float())
    assert rel_err(base, base_ref) < 1e-2
    assert torch.equal(out[slots == -1], base[slots == -1])  # rows with no adapter: base bit for bit
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, ids, weights.to(torch.bfloat16), w_gu, w_d, lora, slots)  # no host sync in the launch path
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [40, 8192])
def test_gluon_gemms_equal_moe_gemm(T, seed):
    """The persistent Gluon GEMMs (the base layer's from 8192 tokens on) against moe_gemm on the same alignment,
    bit for bit, and against their torch references; Qwen3-30B-A3B shapes, an expert without tokens, NaN-poisoned
    outputs; then their LoRA work (gate_up's expand, down's expand and pair shrink) against moe_gemm's. 40 tokens:
    fewer tiles than SMs (most programs get none)."""
    from lora_eval.kernels import moe_gemm_gluon as mg

    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device="cuda").manual_seed(seed)  # the weights: drawn on the GPU
    E, k, H, I, BM = 128, 8, 2048, 768, 128
    ids, weights = routing(T, E, k, g, device="cuda", skip_expert=5)
    weights = weights.reshape(-1).to(torch.bfloat16)
    align = moe_align(ids, E, BM)
    x = torch.randn(T, H, generator=gd, device="cuda").to(torch.bfloat16)
    w_gu = (torch.randn(E, 2 * I, H, generator=gd, device="cuda") / H**0.5).to(torch.bfloat16)
    w_d = (torch.randn(E, H, I, generator=gd, device="cuda") / I**0.5).to(torch.bfloat16)
    if not (mg.usable(x, w_gu, BM, gated=True) and mg.usable(x.new_empty(BM, I), w_d, BM, gated=False)):
        pytest.skip("needs a Hopper GPU and Gluon")
    tiles = pick_config(8192, k, E)
    rows = align.num_blocks * BM
    act = torch.full((rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")  # [NB * BM, I] block order
    mg.moe_gate_up_gluon(x, w_gu, act, align, k)
    act_triton = torch.full_like(act, float("nan"))
    moe_gemm(x, w_gu, act_triton, align, gated=True, rows_are_tokens=True, top_k=k, config=tiles.tiles("gate_up"),
             w_tma=True, out_sorted=True)
    padded = int(align.num_padded)
    assert not act[:padded].isnan().any()
    assert torch.equal(act[:padded], act_triton[:padded])
    assert rel_err(act[:padded], mg.moe_gate_up_ref(x, w_gu, align, k)[:padded]) < 1e-2
    y = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16, device="cuda")  # [P, H]
    mg.moe_down_gluon(act, w_d, y, align, k, weights)
    y_triton = torch.empty_like(y)
    moe_gemm(act, w_d, y_triton, align, gated=False, rows_are_tokens=False, top_k=k, topk_weights=weights,
             config=tiles.tiles("down"), w_tma=True, a_sorted=True, a_tma=True)
    assert not y.isnan().any()
    assert torch.equal(y, y_triton)
    assert rel_err(y, mg.moe_down_ref(act, w_d, align, weights)) < 1e-2
    # gate_up with its LoRA expand (4 adapter slots and rows of none; shrink by block row, and by token) against
    # moe_gemm's expand-first, bit for bit
    S, R = 4, 32
    slots = torch.randint(-1, S, (T,), generator=g).to("cuda")
    align = moe_align(ids, E, BM, slots, S)
    B = (0.3 * torch.randn(S, E, 2 * I, R, generator=gd, device="cuda")).to(torch.bfloat16)
    for by_token in (False, True):
        shrunk = torch.randn(T if by_token else align.num_blocks * BM, R, generator=g).to(  # by token: float32
            "cuda", torch.float32 if by_token else torch.bfloat16)  # partial sums, as dense_lora_shrink gives
        act = torch.full((rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        mg.moe_gate_up_gluon(x, w_gu, act, align, k, (shrunk, B, by_token))
        moe_gemm(x, w_gu, act_triton, align, gated=True, rows_are_tokens=True, top_k=k, lora_B=B, shrunk=shrunk,
                 shrunk_by_token=by_token, config=tiles.tiles("gate_up"), w_tma=True, out_sorted=True,
                 expand_first=True)
        padded = int(align.num_padded)
        assert not act[:padded].isnan().any()
        assert torch.equal(act[:padded], act_triton[:padded])
    # down with the pair shrink (LoRA A of 4 slots side by side; rows of no adapter) against moe_gemm's, bit for bit,
    # and the shrink against torch: act[row of pair] @ A[slot, expert]^T
    RS = 16
    la = (torch.randn(S, E, RS, I, generator=gd, device="cuda") / I**0.5).to(torch.bfloat16)
    shrunk = torch.full((T * k, RS), float("nan"), dtype=torch.bfloat16, device="cuda")  # [P, RS]
    shrunk_triton = torch.full_like(shrunk, float("nan"))
    y = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    mg.moe_down_gluon(act, w_d, y, align, k, weights, pair_shrink=(la, shrunk))
    moe_gemm(act, w_d, y_triton, align, gated=False, rows_are_tokens=False, top_k=k, topk_weights=weights,
             config=tiles.tiles("down"), w_tma=True, a_sorted=True, a_tma=True, pair_shrink=(la, shrunk_triton))
    assert not y.isnan().any()
    assert torch.equal(y, y_triton)
    pair_slot = slots.repeat_interleave(k)  # [P]
    adapter = pair_slot >= 0
    assert not shrunk[adapter].isnan().any()
    assert torch.equal(shrunk[adapter], shrunk_triton[adapter])
    row_of_pair = torch.empty(T * k, dtype=torch.long, device="cuda")
    padded = int(align.num_padded)
    placed = align.sorted_pairs[:padded].long()
    row_of_pair[placed[placed < T * k]] = (placed < T * k).nonzero().squeeze(1)
    pairs = adapter.nonzero().squeeze(1)
    ref = torch.cat([torch.bmm(la[pair_slot[p], ids.reshape(-1)[p]].float(), act[row_of_pair[p]].float()[:, :, None])
                     [:, :, 0] for p in pairs.split(4096)])  # [n, RS]
    assert rel_err(shrunk[pairs], ref) < 1e-2
    # down with a per-expert LoRA expand (the shrink by block row; 4 slots and rows of none) against moe_gemm's
    # expand-first, bit for bit
    shrunk = torch.randn(align.num_blocks * BM, RS, generator=g).to("cuda", torch.bfloat16)  # [NB * BM, RS]
    B_down = (0.3 * torch.randn(S, E, H, RS, generator=gd, device="cuda")).to(torch.bfloat16)
    y = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    mg.moe_down_gluon(act, w_d, y, align, k, weights, lora=(shrunk, B_down))
    moe_gemm(act, w_d, y_triton, align, gated=False, rows_are_tokens=False, top_k=k, topk_weights=weights,
             lora_B=B_down, shrunk=shrunk, config=tiles.tiles("down"), w_tma=True, a_sorted=True, a_tma=True,
             expand_first=True)
    assert not y.isnan().any()
    assert torch.equal(y, y_triton)
    assert not torch.equal(y[adapter], mg.moe_down_ref(act, w_d, align, weights)[adapter])  # the delta is there


def test_gemm_stages_fit_the_lora_operands_in_shared_memory():
    """The grouped GEMM gives up pipeline stages for the LoRA expand's operands (and the pair shrink's tiles) where
    the table's depth would overflow an H100's shared memory, and steps the expand over rank chunks where one stage
    would not hold them (the numbers behind it: tests/kernels/test_sm90_compile.py compiles these configurations
    for sm_90); work no depth fits is refused by name."""
    from lora_eval.kernels.fused_moe import expand_rank_step, gemm_stages
    from lora_eval.kernels.tiles import GEMM_SMEM

    large = pick_config(4096, 8, 128)
    gate_up, down = large.tiles("gate_up"), large.tiles("down")
    assert gemm_stages(gate_up, True, 32, 0, 2) == gate_up["num_stages"] == 4  # rank 16 (gate and up: 32)
    assert gemm_stages(gate_up, True, 64, 0, 2) == 3  # rank 32
    assert gemm_stages(down, False, 0, 64, 2) == 4 and gemm_stages(down, False, 0, 128, 2) == 3  # pair shrink
    assert [expand_rank_step(gate_up, True, r, 0, 2) for r in (32, 64, 128, 256)] == [32, 64, 64, 64]  # rank 64+
    assert expand_rank_step(down, False, 64, 0, 2) == 64 and gemm_stages(down, False, 64, 0, 2) == 3
    with pytest.raises(ValueError, match=r"tiles on gate_up .* expand of 128 ranks at a time"):
        gemm_stages(gate_up, True, 128, 0, 2)  # all of rank 64 (gate and up: 128) at once at 128-row blocks
    small = pick_config(64, 8, 128).tiles("gate_up")
    assert expand_rank_step(small, True, 128, 0, 2) == 128 and gemm_stages(small, True, 128, 0, 2) == 3
    assert GEMM_SMEM == 227 * 1024


def test_lora_expand_steps_over_rank_chunks(monkeypatch, seed):
    """The in-GEMM expand over rank chunks (what rank 64 per projection takes at 128-row blocks on the GPU), forced
    here at rank 48 in chunks of 16, with 3 adapter slots mixed and rows of none: the layer matches the float32
    reference, per-expert and shared-outer factors, the expand after the main loop and before it."""
    monkeypatch.setattr(fused_moe_module, "expand_rank_step", lambda tiles, gated, rank, shrink_cols, size: 16)
    g = torch.Generator().manual_seed(seed)
    T, E, k, H, I, S, R = 40, 6, 2, 32, 24, 3, 48
    x = torch.randn(T, H, generator=g).to(DEVICE)
    ids, weights = routing(T, E, k, g)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE)
    w_d = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE)
    slots = torch.randint(-1, S, (T,), generator=g).to(DEVICE)
    base = fused_moe_ref(x, ids, weights, w_gu, w_d)
    for shared_outer in (False, True):
        lora = expert_lora(S, E, H, I, R, g, torch.float32, shared_outer=shared_outer)
        ref = fused_moe_ref(x, ids, weights, w_gu, w_d, lora, slots)
        assert rel_err(ref, base) > 1e-2  # the delta is there
        for layout in ("ptr", "pair_shrink"):  # the expand after the main loop, and before it
            out = fused_moe(x, ids, weights, w_gu, w_d, lora, slots, config=LAYOUTS[layout])
            assert rel_err(out, ref) < 1e-5, layout


def test_pick_config_by_pairs_per_expert():
    """Small batches keep pointer loads; large ones take TMA weights and the block-ordered activation; float32
    halves the K step and the pipeline of both GEMMs (4-byte tiles)."""
    small, large = pick_config(64, 8, 128), pick_config(16384, 8, 128)
    assert small.block_m == 16 and not small.w_tma and not small.sorted_act
    assert large.block_m == 128 and large.w_tma and large.sorted_act and large.half_tail and large.pair_shrink
    assert large.gluon and not small.gluon  # the persistent Gluon GEMMs with the block-ordered activation
    fp32 = pick_config(16384, 8, 128, torch.float32)
    assert fp32.block_m == 128 and fp32.w_tma == large.w_tma
    assert all(getattr(fp32, g)["BLOCK_K"] <= 32 and getattr(fp32, g)["num_stages"] == 2 for g in ("gate_up", "down"))
    assert large.gate_up["BLOCK_K"] == 64  # the table itself is left alone


def test_tma_ready_needs_a_unit_last_stride():
    w = torch.randn(4, 32, 64)
    assert fused_moe_module.tma_ready(w)
    assert not fused_moe_module.tma_ready(w.transpose(1, 2))
    assert not fused_moe_module.tma_ready(w[:, :, 1:])  # rows 63 elements apart: not 16-byte strides
