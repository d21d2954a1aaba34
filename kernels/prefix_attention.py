"""Causal attention of rows that continue a cached prefix (issue #24): each row's queries attend to its prefix's keys
and values, read in place (several rows may share one), then to the row's own, causally. A flash-attention
loop with the softmax online in float32: the prefix is neither copied per row nor masked through a [queries, keys]
tensor, as the plain torch form (row_attention) has to.

One program per (block of positions, row, key/value head and part of its query heads): the query heads that share a
key/value head (grouped-query attention: 8 of Qwen3-30B-A3B's 32 share each of its 4) are packed into the program's
BLOCK_M query rows (`heads_per_program`), so that every key and value tile read serves all of them, and a block spans
BLOCK_M / heads positions — 8 at Qwen3-30B-A3B's heads — rather than BLOCK_M, which pads MMLU's suffixes of 60-150
tokens less. Blocks wholly past a row's own length (`lengths`) compute nothing.

Shapes: q [B, nh, L, D], k [B, nkv, L, D], v [B, nkv, L, Dv] (any strides; nh a multiple of
nkv: query head h reads kv head h // (nh // nkv)); rows [G] the batch rows to compute; out [B, nh, L, Dv] (head dim
contiguous), written at those rows. Each row's prefix comes from a `PrefixTable`: the row's entry, whose keys pk
[nkv, P, D] and values pv [nkv, P, Dv] (contiguous, q's dtype) the kernel reads through their addresses, so that one
launch serves every row of a batch whatever prefix each continues (a launch per prefix costs host time at every
layer: BENCHMARKS-history 14 and 18.2). Query i of a row sits at position P + i and
sees the P prefix keys and its own keys 0..i; with a `window` only the last `window` of those (GPT-OSS's
sliding layers; the window counts the prefix's keys too), and with `sinks` [nh] a learned logit per head joins every
softmax denominator (GPT-OSS). Right padding after a row's length only ever meets queries of the padding. Fixed tiles,
and a query's sums over the keys in the same blocks and order wherever the row sits: a row's result does not depend
on the other rows or the padding (the batch-invariant mode's attention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .tiles import PREFIX_ATTENTION_TILES


def prefix_attention_ref(q, k, v, scale: float, prefix_k=None, prefix_v=None, sinks=None,
                         window: int | None = None) -> torch.Tensor:
    """Plain torch: the prefix's keys and values in front of each row's, then attention under the causal mask
    offset by the prefix length (and the window; sinks as an extra softmax column dropped after), in float32. Same
    shapes as the kernel, all rows."""
    B, nh, L, _ = q.shape
    group = nh // k.shape[1]
    if prefix_k is not None:
        k = torch.cat([prefix_k[None].expand(B, -1, -1, -1), k], dim=2)  # [B, nkv, P + L, D]
        v = torch.cat([prefix_v[None].expand(B, -1, -1, -1), v], dim=2)  # [B, nkv, P + L, Dv]
    P = k.shape[2] - L
    k = k.float().repeat_interleave(group, dim=1)  # [B, nh, P + L, D]
    v = v.float().repeat_interleave(group, dim=1)  # [B, nh, P + L, Dv]
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale  # [B, nh, L, P + L]
    keys, queries = torch.arange(P + L)[None, :], torch.arange(L)[:, None] + P  # absolute positions
    allowed = keys <= queries  # [L, P + L]
    if window is not None:
        allowed &= keys > queries - window
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, nh, 1, 1).expand(B, nh, L, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :P + L]  # [B, nh, L, P + L]
    return torch.matmul(probs, v).to(q.dtype)  # [B, nh, L, Dv]


@triton.jit
def _online_softmax(s, seen, vv, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key block into the running softmax: scores s [BM, BN] (log2 units) where `seen`, values vv [BN, BDV].
    A block wholly outside a query's view leaves its running max at -inf: the updates then subtract 0 instead
    (m_safe), so that nothing becomes NaN."""
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["k_address", "v_address", "L", "E"])
def prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_address, v_address, entry_ptr, addresses_ptr, prefix_lengths_ptr, out_ptr, rows_ptr,
    lengths_ptr, sinks_ptr, L, E, WINDOW, qk_scale, stride_qb, stride_qh, stride_ql, stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_ol,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PACKED: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """BLOCK_M query rows of row rows[g]: PACKED query heads of key/value head kvh (heads kvh * GROUP + part *
    PACKED ..), each at the BLOCK_M // PACKED positions from pid_q * that (program 1 = (g * KV_HEADS + kvh) *
    (GROUP // PACKED) + part); every key and value tile read serves all of them. qk_scale: scale * log2(e). Blocks
    past the row's own length (lengths[b]) hold padding only: written with zeros, nothing computed. The row's prefix:
    entry e = entry[b] of the table, P = prefix_lengths[e] positions whose keys start at addresses[e] and values at
    addresses[E + e], each [nkv, P, D or DV] contiguous."""
    BLOCK_Q: tl.constexpr = BLOCK_M // PACKED  # positions per program
    PARTS: tl.constexpr = GROUP // PACKED
    pid_q = tl.program_id(0)
    part = tl.program_id(1) % PARTS
    kvh = tl.program_id(1) // PARTS % KV_HEADS
    g = tl.program_id(1) // PARTS // KV_HEADS
    b = tl.load(rows_ptr + g).to(tl.int64)
    own = tl.minimum(tl.load(lengths_ptr + b), L)  # the row's positions; the rest is padding
    e = tl.load(entry_ptr + b)  # the row's prefix: its length, where its keys and values lie
    P = tl.load(prefix_lengths_ptr + e)
    # reached from k_ptr and v_ptr by a whole number of 16-byte steps (prefix_addresses checks the alignment), as the
    # compiler must know to load the prefix's tiles in 16-byte pieces: from a pointer made of an integer it loads
    # them element by element (sm_90 PTX: 128 ld.global.b16 in place of cp.async), hints or not
    ek: tl.constexpr = k_ptr.dtype.element_ty.primitive_bitwidth // 8
    ev: tl.constexpr = v_ptr.dtype.element_ty.primitive_bitwidth // 8
    pk_ptr = k_ptr + tl.multiple_of((tl.load(addresses_ptr + e) - k_address) // ek, 16 // ek)
    pv_ptr = v_ptr + tl.multiple_of((tl.load(addresses_ptr + E + e) - v_address) // ev, 16 // ev)
    stride_pkh, stride_pvh = P.to(tl.int64) * D, P.to(tl.int64) * DV  # [nkv, P, D] / [nkv, P, DV], contiguous
    offs_r = tl.arange(0, BLOCK_M)
    head = kvh * GROUP + part * PACKED + offs_r // BLOCK_Q  # [BM] query head of each query row
    pos = pid_q * BLOCK_Q + offs_r % BLOCK_Q  # [BM] position of each query row in the row's own tokens
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    out_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + pos[:, None] * stride_ol + offs_dv[None, :]
    out_mask = (pos < L)[:, None] & (offs_dv < DV)[None, :]
    if pid_q * BLOCK_Q >= own:
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_DV), dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_ql + offs_d[None, :],
                mask=(pos < L)[:, None] & (offs_d < D)[None, :], other=0.0)  # [BM, BD]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of the scaled scores (log2 units)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)  # [BM, BDV]
    # the prefix: every key visible to every query
    for n0 in range(0, P, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        keep = offs_n < P
        kt = tl.load(pk_ptr + kvh * stride_pkh + offs_n[None, :] * D + offs_d[:, None],
                     mask=keep[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
        vv = tl.load(pv_ptr + kvh * stride_pvh + offs_n[:, None] * DV + offs_dv[None, :],
                     mask=keep[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [BN, BDV]
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        seen = keep[None, :]
        if HAS_WINDOW:  # key position n > query position P + i - WINDOW
            seen = seen & (offs_n[None, :] > pos[:, None] + P - WINDOW)
        m_i, l_i, acc = _online_softmax(s, seen, vv, m_i, l_i, acc, DOT_PRECISION)
    # the row's own keys, causally: key j is seen by queries i >= j
    for n0 in range(0, tl.minimum(L, (pid_q + 1) * BLOCK_Q), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        keep = offs_n < L
        kt = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + offs_n[None, :] * stride_kl + offs_d[:, None],
                     mask=keep[None, :] & (offs_d < D)[:, None], other=0.0)  # [BD, BN]
        vv = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vl + offs_dv[None, :],
                     mask=keep[:, None] & (offs_dv < DV)[None, :], other=0.0)  # [BN, BDV]
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        seen = keep[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (offs_n[None, :] > pos[:, None] - WINDOW)
        m_i, l_i, acc = _online_softmax(s, seen, vv, m_i, l_i, acc, DOT_PRECISION)
    if HAS_SINKS:  # each head's sink logit joins its rows' denominators (in log2 units, as the scores)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # [BM]
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0 only in padding queries past a window
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def heads_per_program(group: int, block_m: int) -> int:
    """How many query heads of one key/value head a program takes: the largest power of two dividing `group`, at most
    block_m // 8 (each head keeps 8 or more positions of the program's block_m query rows)."""
    packed = 1
    while group % (packed * 2) == 0 and packed * 2 <= block_m // 8:
        packed *= 2
    return packed


class PrefixTable(NamedTuple):
    """The prefixes of one attention layer's rows: row b continues entry `entry[b]` (int32 [B]); entry e has
    `lengths[e]` positions (int32 [E]; 0: no prefix) whose keys [nkv, P, D] start at address `addresses[0, e]` and
    values [nkv, P, Dv] at `addresses[1, e]` (int64 [2, E]), contiguous and in the layer's dtype. All on q's device.
    The tensors at those addresses must outlive the launch's queued work, as any kernel argument must."""
    entry: torch.Tensor
    addresses: torch.Tensor
    lengths: torch.Tensor


def prefix_addresses(prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> list[int]:
    """[keys' address, values' address] of one prefix's layer for a PrefixTable, after checking its layout: contiguous,
    16-byte aligned (the kernel's loads of its tiles count on it)."""
    for t in (prefix_k, prefix_v):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"prefix_attention: a prefix's keys and values must be contiguous and 16-byte aligned, "
                             f"found strides {t.stride()} for shape {tuple(t.shape)} at address {t.data_ptr():#x}")
    return [prefix_k.data_ptr(), prefix_v.data_ptr()]


def one_prefix(prefix_k, prefix_v, rows: int, device) -> PrefixTable:
    """The table of `rows` rows that all continue one prefix (keys [nkv, P, D], values [nkv, P, Dv]), or none (None):
    the kernel's tests and benchmarks. Copies its addresses to the device (not inside a CUDA graph capture)."""
    if prefix_k is None:
        return PrefixTable(torch.zeros(rows, dtype=torch.int32, device=device),
                           torch.zeros(2, 1, dtype=torch.int64, device=device),
                           torch.zeros(1, dtype=torch.int32, device=device))
    return PrefixTable(torch.zeros(rows, dtype=torch.int32, device=device),
                       torch.tensor(prefix_addresses(prefix_k, prefix_v), dtype=torch.int64, device=device)[:, None],
                       torch.tensor([prefix_k.shape[1]], dtype=torch.int32, device=device))


def prefix_attention(q, k, v, out, rows, scale: float, table: PrefixTable | None = None, sinks=None,
                     window: int | None = None, lengths=None, tiles: dict | None = None) -> None:
    """out[rows] = the attention of q[rows] over each row's prefix (`table`; None: no row has one) and its own
    k[rows] / v[rows], causally, within `window` if given, `sinks` [nh] in the denominators if given (shapes in the
    module notes; rows: an int tensor on q's device). `lengths` [B] (int, on q's device): each row's own positions;
    those after are padding, written with zeros (None: all L positions are the rows')."""
    B, nh, L, D = q.shape
    nkv, DV = k.shape[1], v.shape[-1]
    if nh % nkv:
        raise ValueError(f"prefix_attention: {nh} query heads are not a multiple of {nkv} key/value heads")
    tiles = {**PREFIX_ATTENTION_TILES, **(tiles or {})}
    BLOCK_M, BLOCK_N = tiles["BLOCK_M"], tiles["BLOCK_N"]
    group = nh // nkv
    packed = heads_per_program(group, BLOCK_M)
    if out.stride(-1) != 1:
        raise ValueError("prefix_attention: out's head dim must be contiguous")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.int32, device=q.device)
    table = table if table is not None else one_prefix(None, None, B, q.device)
    grid = (triton.cdiv(L, BLOCK_M // packed), rows.numel() * nkv * (group // packed))
    prefix_attention_kernel[grid](
        q, k, v, k.data_ptr(), v.data_ptr(), table.entry, table.addresses, table.lengths, out, rows, lengths,
        q if sinks is None else sinks, L, table.addresses.shape[1], window or 0, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        KV_HEADS=nkv, GROUP=group, PACKED=packed, D=D, DV=DV, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_SINKS=sinks is not None,
        HAS_WINDOW=window is not None, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
