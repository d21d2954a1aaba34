"""Shared-prefix reuse: rows that begin with the same tokens compute those tokens once per (prefix, adapter).

The engine side (`Batch.prefixes`, `Engine.logprobs` / `next_token_logprobs`): a row may name how many of its leading
tokens are a prefix shared with other rows. The engine computes that prefix once per (prefix tokens, adapter) — an
adapter changes every layer's keys and values, so the adapter is part of the key — as a forward of its own over
that prefix alone (one row), keeps each layer's keys and values after RoPE and norms (what `Forward.attention`
receives: for MLA the decompressed keys and values) in a `PrefixKV`, and runs the row's suffix only, its positions
continuing after the prefix and its attention seeing the prefix's keys and values first. For `logprobs` the prefix
pass also yields the logprobs of the prefix's positions: the pass runs over the prefix plus the one token after it
(the row's first suffix token, part of the key), so every position's logprob comes from exactly one pass.

Why a prefix is always computed alone: its keys and values, hence every number of the rows that use it, are then
the same whichever batch, run unit, rank or resumed run needs it first, and whether it came from the cache or was
computed again after an eviction — results never depend on what the cache held. (On the CPU torch backend the
engine is batch-invariant anyway; on the GPU this keeps data-parallel and resumed runs deterministic.)

`PrefixCache` holds the entries, least recently used first, under a budget of bytes (keys, values and logprobs of
every entry; an entry larger than the whole budget is used by its batch and not kept); it counts what it holds at
its peak, the entries computed, reused and evicted.

The task side: `shared_prefix_lengths` finds leading token ids that sequences share (an RL group's N completions of
one prompt, a common system prompt) from the ids alone; `grouped_order` gathers groups into chunks whose prefixes
the cache holds together and orders rows by length inside a chunk, so that batches made in that order pad little and
every prefix is computed once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..kernels.prefix_attention import prefix_addresses

PREFIX_CACHE_BYTES = 2 << 30  # default budget of cached keys and values (2 GiB)
MIN_SHARED_TOKENS = 32  # compare: leading tokens samples must share before they share a prefix
MAX_SPLIT_DEPTH = 64  # shared_prefix_lengths: how deep a run of neighbours is split into better groups


@dataclass(eq=False)
class PrefixKV:
    """A computed prefix: `length` positions; `kv[i]` = (k [nkv, length, Dk], v [nkv, length, Dv]) of attention
    layer i; `logprobs` [length] float32 on the CPU (lp[j] = log p(token j+1 | tokens ..j), the last one predicting
    the token after the prefix) or None when the entry was made for last-position scoring only; `states[i]` = (conv
    inputs [W-1, C], recurrent state [Hv, K, V] float32) of linear-attention layer i at the prefix's end (Gated
    DeltaNet: a linear layer's prefix is its state, not keys and values); `routes` = (expert ids [length, MoE layers,
    k], routing weights [length, MoE layers, k]) on the CPU where the prefix pass recorded them (Batch.routes)."""
    length: int
    kv: list
    logprobs: torch.Tensor | None = None
    states: list = field(default_factory=list)
    routes: tuple | None = None
    _addresses: torch.Tensor | None = field(default=None, repr=False)

    def addresses(self) -> torch.Tensor:
        """int64 [layers, 2] on the CPU: where each attention layer's keys and values start (the prefix attention
        kernel reads them there: kernels/prefix_attention.PrefixTable), worked out once."""
        if self._addresses is None:
            self._addresses = torch.tensor([prefix_addresses(k, v) for k, v in self.kv], dtype=torch.int64)
        return self._addresses

    @property
    def nbytes(self) -> int:
        held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv + self.states)
        routes = sum(t.numel() * t.element_size() for t in self.routes) if self.routes is not None else 0
        return held + routes + (self.logprobs.numel() * 4 if self.logprobs is not None else 0)


class PrefixCache:
    """Computed prefixes by key, least recently used evicted first once their bytes exceed `budget`."""

    def __init__(self, budget: int = PREFIX_CACHE_BYTES):
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"the prefix cache budget must be an integer >= 0, got {budget!r}")
        self.budget = budget
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.computed = self.reused = self.evicted = 0

    def get(self, key) -> PrefixKV | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.reused += 1
        return entry

    def put(self, key, entry: PrefixKV, in_use: int = 0) -> None:
        """Keep `entry` (just computed), evicting the least recently used beyond the budget. `in_use`: bytes of
        entries the current batch holds outside the cache (counted in the peak)."""
        self.computed += 1
        size = entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes + size + in_use)
        if size > self.budget:
            return  # used by the batch that computed it, not kept
        self.entries[key] = entry
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return dict(budget_bytes=self.budget, peak_bytes=self.peak_bytes, held_bytes=self.bytes,
                    prefixes_computed=self.computed, prefixes_reused=self.reused, prefixes_evicted=self.evicted)


def common_length(a, b) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_lengths(sequences: list[list[int]], min_shared: int = MIN_SHARED_TOKENS) -> list[int]:
    """Per sequence, how many leading tokens it shares with the other members of its group (0: none), groups found
    from the token ids alone. Sorted lexicographically, sequences that share leading tokens are neighbours; a run of
    neighbours each sharing >= `min_shared` tokens with the next is a candidate group whose common prefix is the
    smallest of those shared lengths. Where splitting the run at its weakest links saves more tokens (a common
    system prompt before prompts that each have N completions: the completions of one prompt share much more than
    the system prompt), the parts are groups instead; a group of m sequences sharing c tokens saves (m - 1) x c.
    Splitting looks at most MAX_SPLIT_DEPTH levels deep (beyond that a run stays one group), which bounds the work
    on pathological inputs. Deterministic: the result depends on the sequences only (not their order)."""
    order = sorted(range(len(sequences)), key=lambda i: (tuple(sequences[i]), i))
    links = [common_length(sequences[a], sequences[b]) for a, b in zip(order, order[1:])]  # [n-1]
    shared = [0] * len(sequences)

    def solve(lo: int, hi: int, depth: int = 0) -> tuple[int, list[tuple[int, int, int]]]:
        """Best grouping of order[lo..hi] (links lo..hi-1 all >= min_shared): (saved tokens, [(lo, hi, c)])."""
        if hi == lo:
            return 0, []
        c = min(links[lo:hi])
        whole = (hi - lo) * c
        if depth >= MAX_SPLIT_DEPTH:
            return whole, [(lo, hi, c)]
        parts, saved, start = [], 0, lo
        for j in range(lo, hi + 1):
            if j == hi or links[j] == c:
                if j > start:
                    s, p = solve(start, j, depth + 1)
                    saved, parts = saved + s, parts + p
                start = j + 1
        if saved > whole:
            return saved, parts
        return whole, [(lo, hi, c)]

    lo = 0
    for j in range(len(order)):
        if j == len(order) - 1 or links[j] < min_shared:
            for a, b, c in solve(lo, j)[1] if j > lo else []:
                for k in range(a, b + 1):
                    shared[order[k]] = c
            lo = j + 1
    return shared


def grouped_order(lengths: list[int], groups: list, group_bytes: dict | None = None, budget: int = 0) -> list[int]:
    """Indices ordered by chunk of groups, then by length. Groups (a sortable key per row) are taken in key order
    and gathered into chunks whose prefixes fit the cache together (`group_bytes[g]`: the bytes of group g's
    computed prefixes, every adapter's; `budget`: the cache's): inside a chunk rows go by length, so that batches cut
    from this order pad little, and the prefixes a chunk's batches need stay cached until it ends (computed once).
    Without `group_bytes` each group is a chunk of its own. Chunks of many groups pad far less than a chunk per
    group (MMLU's subjects: BENCHMARKS-history 9 and 18.3)."""
    chunk_of, chunk, used = {}, 0, 0
    for g in sorted(set(groups)):
        size = group_bytes[g] if group_bytes is not None else budget + 1
        if used and used + size > budget:
            chunk, used = chunk + 1, 0
        chunk_of[g] = chunk
        used += size
    return sorted(range(len(lengths)), key=lambda i: (chunk_of[groups[i]], lengths[i], i))


def prefix_bytes(args, dtype: torch.dtype, length: int) -> int:
    """Bytes a computed prefix (PrefixKV) of `length` tokens holds: per token every attention layer's keys and values
    (MLA's decompressed, all heads) in the compute dtype and a float32 logprob; per Gated DeltaNet layer its state,
    whatever the length: the last W-1 conv inputs in the compute dtype and the recurrent state [Hv, K, V] in float32
    (at Qwen3.5-35B-A3B's widths 2.1 MB a layer, 63 MB a prefix: more than 3,000 tokens of its keys and values)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if hasattr(args, "v_head_dim"):  # MLA: q/k heads of head_dim, v heads of v_head_dim, num_heads of each
        per_layer = args.num_heads * (args.head_dim + args.v_head_dim)
    else:
        per_layer = 2 * args.num_kv_heads * args.head_dim
    types = getattr(args, "layer_types", ())
    linear = sum(t == "linear_attention" for t in types)
    per_token = (args.num_layers - linear) * per_layer * size + 4
    if not linear:
        return length * per_token
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    K, V = args.linear_key_head_dim, args.linear_value_head_dim
    state = (args.conv_kernel - 1) * (2 * Hk * K + Hv * V) * size + Hv * K * V * 4
    return length * per_token + linear * state
