"""How one forward pass computes its ops: the backend — plain torch (the CPU path and the oracle) or the
Triton kernels (the GPU path) — and, when adapters are loaded, the adapter slot of each token row (-1 none).

The model code calls `fwd.linear(module, x)`, `fwd.norm(...)`, `fwd.embedding(...)`, `fwd.moe(...)` and
`fwd.attention(...)` (and take token positions from `fwd.positions`, which continue after a row's cached prefix:
see `Forward.__init__`); each adds the rows' adapter deltas (or swaps in an adapter's own weights, for
modules_to_save) on top of the base op. The Triton path never syncs with the host.

Observing intermediates (`lora-eval diagnose`): `Forward.probe`, None by default, may be set to a callable
`probe(layer, point, tensor)`; the ops and the models' decoder-layer loops then report, per decoder layer:
  input [T, H]          the residual stream entering the layer      (models' layer loops)
  attention [T, H]      attention's output projection, before the residual add   (linear, self_attn sites)
  router_logits [T, E]  the router's logits, LoRA included          (route, or the family's own router)
  router_topk [T, k]    the chosen expert ids                        (likewise)
  moe [T, H]            the routed experts' output, before any residual or shared-expert add   (moe)
  residual [T, H]       the residual stream after the layer          (models' layer loops)
Where a kernel fuses one of these into a sum (o_proj's and the MoE's residual add), the observed part is computed
once more on its own and the fused result is kept, so a probe never changes what the forward returns. With no probe
nothing of this runs: one `is None` test per report site.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..adapters.targets import layer_of
from ..kernels.dense_lora import (dense_lora, dense_lora_expand, dense_lora_ref, dense_lora_shrink, embedding_lora,
                                 embedding_lora_ref, lora_residual_add)
from ..kernels.fused_moe import fused_moe, fused_moe_ref, pick_config
from ..kernels.gated_delta import causal_conv1d, causal_conv1d_ref, gated_delta_rule, gated_delta_rule_ref
from ..kernels.head_norm_rope import head_norm_rope
from ..kernels.linear import linear_ref, pointwise_in_blocks
from ..kernels.lora_meta import lora_metadata
from ..kernels.matmul import matmul
from ..kernels.prefix_attention import PrefixTable, prefix_attention
from ..kernels.rms_norm import rms_norm, rms_norm_ref
from ..kernels.rope import rope, rope_ref
from ..kernels.router import router_topk, router_topk_ref
from ..kernels.tiles import INVARIANT_MOE, INVARIANT_SHRINK_SPLITS

BACKENDS = ("torch", "triton")


def to_device(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, or a tensor on the CPU) as a tensor on `device`. To a GPU through pinned memory, without
    waiting: a copy from pageable memory makes the host wait until every kernel queued before it has run, and the
    GPU then idles while the host prepares what comes next (CUDA graph replays copy their inputs the same way)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Forward:
    probe = None  # callable probe(layer, point, tensor) that sees intermediates (see the module notes), or None
    # the fused MoE's launch table for every forward on the Triton path (kernels/tiles.py MOE_CONFIGS when None): a
    # benchmark's way to run the engine under other MoE launch settings (benchmarks/mixed_batch_check.py --switches)
    moe_configs = None

    def __init__(self, backend: str, lengths: list[int], stack=None, token_slots: torch.Tensor | None = None,
                 expert_parallel=None, *, prefixes: list | None = None, capture: tuple[int, list] | None = None,
                 invariant: bool = False, routes: list | None = None):
        """`prefixes`: per row None or a cached prefix (lora_eval.engine.prefixes.PrefixKV: its length and per attention
        layer the keys and values of its positions): the row holds only the suffix; its positions start at the
        prefix's length and each layer's attention sees the prefix's keys and values before the row's own.
        `capture` = (n, list, states): each attention layer appends (k [nkv, n, Dk], v [nkv, n, Dv]) of the first n
        positions of row 0 to the list (a prefix pass: one row), and each Gated DeltaNet layer appends its state
        after those n positions to `states` (see linear_attention). Layers are counted by their attention calls
        (and linear-attention calls): every family calls `attention` exactly once per attention layer, in layer
        order, so the i-th call of a forward is attention layer i's (one counter per Forward, which serves one
        forward).
        `invariant` (the batch-invariant mode, Triton path): every launch setting that would follow the batch's size
        is fixed (kernels/tiles.py), the dense projections run through kernels/matmul.py instead of cuBLAS and
        attention through kernels/prefix_attention.py, so that a row's result does not depend on the other rows of
        its batch, where it sits, or the padding. The torch path is batch-invariant as it is.
        `routes`: a list that each MoE layer's router appends (layer, expert ids [T, k], weights [T, k]) to (compare
        against a sampler's routed experts); None records nothing."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.lengths = backend, lengths
        self.prefixes = prefixes if prefixes is not None and any(p is not None for p in prefixes) else None
        self.capture = capture
        self.routes = routes
        self._attention_calls = 0
        self._linear_attention_calls = 0  # Gated DeltaNet layers, counted as attention layers are (see `capture`)
        self._rows_by_prefix = None  # built by _prefix_groups
        self._row_lengths = None  # likewise, or by _prefix_table
        self._table = None  # built by _prefix_table
        self._distinct = None  # built by _distinct_prefixes
        self._entries = None  # its entries on the device, by _start_states
        self.expert_parallel = expert_parallel  # lora_eval.engine.expert_parallel.ExpertParallel, or None
        self.triton = backend == "triton"
        self.invariant = invariant and self.triton
        self.gemm = (matmul if self.invariant else F.linear) if self.triton else linear_ref  # x W^T (+ b)
        self.splits = INVARIANT_SHRINK_SPLITS if self.invariant else None  # dense LoRA shrinks' (None: by size)
        self.stack = stack if token_slots is not None else None
        self.token_slots = token_slots  # [T]
        if self.stack is None:
            return
        if self.triton:
            self.meta = lora_metadata(token_slots, len(self.stack.names))
        else:
            present = [s for s in torch.unique(token_slots).tolist() if s >= 0]
            self.groups = {s: (token_slots == s).nonzero().squeeze(1) for s in present}  # slot -> rows [n]

    def subset(self, rows: torch.Tensor) -> "Forward":
        """The same pass restricted to some token rows (lm_head chunks)."""
        slots = self.token_slots[rows] if self.stack is not None else None
        return Forward(self.backend, self.lengths, self.stack, slots, self.expert_parallel, invariant=self.invariant)

    def positions(self, B: int, L: int, device) -> torch.Tensor:
        """Token positions [B, L] of a batch laid out at length L: 0..L-1, after a row's cached prefix when it has
        one (RoPE then continues where the prefix ended). The one place the model families take positions from."""
        positions = torch.arange(L, device=device).expand(B, L)  # [B, L]
        if self.prefixes is None:
            return positions
        offsets = to_device([0 if p is None else p.length for p in self.prefixes] + [0] * (B - len(self.prefixes)),
                            device)  # [B]
        return positions + offsets[:, None]

    # ---- observing (diagnose) -----------------------------------------------------------------------------
    def observe(self, where: int | str, point: str, tensor: torch.Tensor) -> torch.Tensor:
        """Report `tensor` as `point` of a decoder layer to the probe (nothing without one); `where`: the layer's
        index or a module site in it (`model.layers.{i}....`). Returns `tensor`."""
        if self.probe is not None:
            self.probe(where if isinstance(where, int) else layer_of(where), point, tensor)
        return tensor

    def observe_routing(self, site: str, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Report a router's logits [T, E], chosen expert ids [T, k] and their routing weights [T, k] (`site`: the
        router's) to the probe, and record (layer, ids, weights) in `routes` when this forward records them."""
        if self.routes is not None:
            self.routes.append((layer_of(site), ids, weights))
        if self.probe is not None:
            self.observe(site, "router_logits", logits)
            self.observe(site, "router_topk", ids)

    # ---- per-slot selection ------------------------------------------------------------------------------
    def _groups(self, slots: frozenset[int]) -> list[tuple[int, torch.Tensor]]:
        """torch path: (slot, row indices) for the slots present in the batch among `slots`."""
        return [(s, rows) for s, rows in self.groups.items() if s in slots]

    def _replace(self, override, y: torch.Tensor, compute) -> torch.Tensor:
        """Rows of an overriding slot get compute(rows or None, params) instead of the base result."""
        if self.triton:  # no host sync: compute for all rows and select (modules_to_save is rare)
            for s in override.slots:
                mask = (self.token_slots == s).view(-1, *[1] * (y.dim() - 1))
                y = torch.where(mask, compute(None, override.params[s]), y)
            return y
        for s, rows in self._groups(override.slots):
            y[rows] = compute(rows, override.params[s])
        return y

    # ---- ops ---------------------------------------------------------------------------------------------
    def linear(self, module, x: torch.Tensor, with_lora: bool = True, residual: torch.Tensor | None = None,
               y: torch.Tensor | None = None):
        """x [T, in] -> [T, out]; `with_lora=False`: without the rows' LoRA deltas (the caller adds them);
        `residual` [T, out]: return residual + the projection (on the Triton path the LoRA expand runs inside that
        sum: dense_lora.lora_residual_add); `y`: the base projection x W^T (+ b) when the caller computed it (one
        GEMM of a projection group, `linears`)."""
        if residual is not None and self.probe is not None and (".self_attn." in module.site
                                                                 or ".linear_attn." in module.site):
            self.observe(module.site, "attention", self.linear(module, x, with_lora))  # [T, out], apart from the sum
        base = self.gemm
        if y is None:
            y = base(x, module.weight, module.bias)  # [T, out]
        if self.stack is None:
            return y if residual is None else residual + y
        override = self.stack.overrides.get(module.site)
        if override is not None:
            y = self._replace(override, y, lambda rows, p: base(x if rows is None else x[rows], p["weight"],
                                                                   p.get("bias")))
        lora = self.stack.dense.get(module.site) if with_lora else None
        if lora is not None:
            if self.triton:
                if residual is not None:
                    shrunk = dense_lora_shrink(x, lora.A, self.meta, slot_mask=lora.slot_mask,
                                               splits=self.splits)  # [splits, T, R]
                    return lora_residual_add(residual, y, shrunk, lora.B, self.meta, slot_mask=lora.slot_mask)
                dense_lora(y, x, lora.A, lora.B, self.meta, slot_mask=lora.slot_mask, splits=self.splits)
            else:
                dense_lora_ref(y, x, lora.A, lora.B, self._groups(lora.slots))
        return y if residual is None else residual + y

    def linear_float32(self, module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> float32 [T, out]: x W^T (+ b) with x and the weights upcast to float32, as transformers computes
        the logits of GLM-4.5's and DeepSeek-V3's routers (whatever the compute dtype), plus the rows' LoRA deltas
        (shrink and expand in the compute dtype, added in float32) and modules_to_save weights. Rows with no adapter
        get the base projection bit for bit; in a float32 run this is `linear` exactly."""
        base = self.gemm
        xf = x.float()  # [T, in] (x itself when float32)

        def project(rows, weight, bias):
            return base(xf if rows is None else xf[rows], weight.float(), None if bias is None else bias.float())

        y = project(None, module.weight, module.bias)  # [T, out] float32
        if self.stack is None:
            return y
        override = self.stack.overrides.get(module.site)
        if override is not None:
            y = self._replace(override, y, lambda rows, p: project(rows, p["weight"], p.get("bias")))
        lora = self.stack.dense.get(module.site)
        if lora is not None:
            if self.triton:
                dense_lora(y, x, lora.A, lora.B, self.meta, slot_mask=lora.slot_mask,
                           splits=self.splits)  # float32 y, expand in place
            else:
                for s, rows in self._groups(lora.slots):
                    y.index_add_(0, rows, linear_ref(linear_ref(x[rows], lora.A[s]), lora.B[s]).float())
        return y

    def linears(self, modules, x: torch.Tensor, head_norms=None, rope=None) -> list[torch.Tensor]:
        """Projections of one input: [linear(m, x) for m in modules]. On the Triton path the members of a projection
        group (models.layers.ProjectionGroup) take their base from one GEMM, and members of one SharedShrink
        (adapters/stack.py) shrink x once together, then each expands from its own columns.
        `head_norms` with `rope` = (cos, sin) [B, L, D]: per module an RMSNorm over each head of its output followed
        by RoPE (Qwen3's q and k), or None; such an output comes back as [B, heads, L, D]
        (kernels/head_norm_rope.py on the Triton path, after the module's LoRA expand: see that module for why the
        expand does not run inside it)."""
        head_norms = head_norms or (None,) * len(modules)
        bases = self._grouped_bases(modules, x)
        shared = self.stack.shared if self.triton and self.stack is not None else {}
        groups = {id(shared[m.site]): shared[m.site] for m in modules if m.site in shared}
        group = next(iter(groups.values())) if len(groups) == 1 else None
        if group is None or any(m.site in self.stack.dense and m.site not in group.columns for m in modules):
            return [self._head_norm_rope(norm, self.linear(m, x, y=y), rope)
                    for m, norm, y in zip(modules, head_norms, bases)]

        shrunk = dense_lora_shrink(x, group.A, self.meta, slot_mask=group.slot_mask,
                                   splits=self.splits)  # [splits, T, sum R]
        outs = []
        for module, norm, base in zip(modules, head_norms, bases):
            y = self.linear(module, x, with_lora=False, y=base)  # [T, out]
            if module.site in group.columns:
                first, rank = group.columns[module.site]
                lora = self.stack.dense[module.site]
                columns = shrunk[..., first:first + rank]  # [splits, T, R]
                dense_lora_expand(y, columns, lora.B, self.meta, slot_mask=lora.slot_mask)
            outs.append(self._head_norm_rope(norm, y, rope))
        return outs

    def _grouped_bases(self, modules, x: torch.Tensor) -> list[torch.Tensor | None]:
        """On the Triton path, the base projections of a projection group (models.layers.ProjectionGroup) from one
        GEMM: column views [T, out] of one [T, sum out] output; else one None per module (each computes its own)."""
        group = getattr(modules[0], "group", None)
        if not self.triton or group is None or not group.serves(modules):
            return [None] * len(modules)
        return list(self.gemm(x, group.weight, group.bias).split(group.outs, dim=1))  # [T, out] each

    def _fused_head_norm(self, norm, rope) -> bool:
        """Whether head_norm_rope serves this norm: the Triton path and RoPE over the whole head."""
        return self.triton and rope[0].shape[-1] == norm.weight.shape[0]

    def _head_norm_rope(self, norm, y: torch.Tensor, rope) -> torch.Tensor:
        """y [T, heads * D] -> RMSNorm over each head, then RoPE: [B, heads, L, D] (y itself when norm is None)."""
        if norm is None:
            return y
        cos, sin = rope
        B, L, _ = cos.shape
        D = norm.weight.shape[0]
        if self._fused_head_norm(norm, rope):
            out = head_norm_rope(y, norm.weight, norm.eps, cos, sin)  # [B, heads, L, D]
            override = self.stack.overrides.get(norm.site) if self.stack is not None else None
            for s in override.slots if override is not None else ():  # adapters' own norm weights (rare)
                rows = (self.token_slots == s).view(B, 1, L, 1)
                out = torch.where(rows, head_norm_rope(y, override.params[s]["weight"], norm.eps, cos, sin), out)
            return out
        normed = self.norm(norm, y.view(y.shape[0], -1, D))  # [T, heads, D]
        return self.rope(normed.view(B, L, -1, D), cos, sin)

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            norm = rms_norm
        else:
            norm = rms_norm_ref
        offset = module.unit_offset
        y = norm(x, module.weight, module.eps, offset)
        override = self.stack.overrides.get(module.site) if self.stack is not None else None
        if override is not None:
            y = self._replace(override, y, lambda rows, p: norm(x if rows is None else x[rows], p["weight"],
                                                                 module.eps, offset))
        return y

    def gated_norm(self, module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated RMSNorm of Gated DeltaNet's output: norm(x) * silu(gate) with the product in float32, rounded
        to x's dtype once (transformers' Qwen3NextRMSNormGated): x, gate [T, heads, D] -> [T, heads, D], each head
        normed over D; rows are tokens, as for every op (an adapter's own norm weight replaces a token's rows)."""
        return (self.norm(module, x) * self.pointwise(F.silu, gate.float())).to(x.dtype)

    def pointwise(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """fn (an elementwise op: sigmoid, silu) of xs (tensors of one shape whose size follows the batch, e.g.
        [T, n]): on the torch path zero-padded to whole vector steps, in calls that each run on one thread
        (kernels/linear.py pointwise_in_blocks), so that a row's result does not depend on where it sits in the batch
        or on the batch's size; on the GPU as it is."""
        return fn(*xs) if self.triton else pointwise_in_blocks(fn, *xs)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [B, L, heads, D] by cos/sin [B, L, D] -> [B, heads, L, D], the attention layout."""
        if self.triton and x.stride(-1) == 1 and (x.shape[-1] // 2) & (x.shape[-1] // 2 - 1) == 0:
            return rope(x, cos, sin)
        return rope_ref(x, cos, sin)

    def embedding(self, module, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, module.weight)  # [T, H]
        if self.stack is None:
            return h
        override = self.stack.overrides.get(module.site)
        if override is not None:
            h = self._replace(override, h, lambda rows, p: F.embedding(ids if rows is None else ids[rows],
                                                                        p["weight"]))
        lora = self.stack.embedding.get(module.site)
        if lora is not None:
            if self.triton:
                embedding_lora(h, ids, lora.A, lora.B, self.meta, slot_mask=lora.slot_mask)
            else:
                embedding_lora_ref(h, ids, lora.A, lora.B, self._groups(lora.slots))
        return h

    def moe(self, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts of one layer: x [T, H], topk [T, k] -> [T, H]; `residual` [T, H]: residual + that (on the
        Triton path added inside the sum over k). Under expert parallel the pairs go to their experts' ranks."""
        if self.probe is None:
            return self._moe(experts, x, topk_ids, topk_weights, residual)
        out = self.observe(experts.site, "moe", self._moe(experts, x, topk_ids, topk_weights))  # [T, H]
        if residual is None:
            return out
        fused = self.triton and self.expert_parallel is None  # (expert parallel adds the residual apart too)
        return self._moe(experts, x, topk_ids, topk_weights, residual) if fused else residual + out

    def _moe(self, experts, x, topk_ids, topk_weights, residual=None) -> torch.Tensor:
        """`moe` itself (the probe's observation aside)."""
        if self.expert_parallel is not None:
            return self.expert_parallel.moe(self, experts, x, topk_ids, topk_weights, residual)
        lora = self.stack.experts.get(experts.site) if self.stack is not None else None
        variant = experts.variant()
        if self.triton:
            table = {None: INVARIANT_MOE} if self.invariant else self.moe_configs
            config = None if table is None else pick_config(*topk_ids.shape, experts.down_proj.shape[0], x.dtype,
                                                            table)
            return fused_moe(x, topk_ids, topk_weights, experts.gate_up_proj, experts.down_proj, lora,
                             self.token_slots, config, lora_meta=self.meta if lora is not None else None,
                             residual=residual, **variant)
        if lora is not None and not any(s in lora.slots for s in self.groups):
            lora = None
        out = fused_moe_ref(x, topk_ids, topk_weights, experts.gate_up_proj, experts.down_proj, lora,
                            self.token_slots, **variant)  # [T, H]
        return out if residual is None else residual + out

    def route(self, router, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: logits = router(x) -> softmax over the experts (float32) -> top-k -> renormalise if asked:
        x [T, H] -> weights [T, k] float32, expert ids [T, k]. The logits carry the rows' LoRA deltas (expanded in
        place, `linear`) before the top-k, so that one compiled top-k serves every batch: a top-k kernel with the
        expand inside would reduce the softmax in the expand's layout, another summation order, and the routing
        weights of rows without an adapter would differ in the last bit from a batch without adapters (issue #23)."""
        logits = self.linear(router, x)  # [T, E]
        if self.triton:
            weights, ids = router_topk(logits, top_k, renormalize)  # [T, k] float32, [T, k]
        else:
            weights, ids = router_topk_ref(logits, top_k, renormalize)
        self.observe_routing(router.site, logits, ids, weights)
        return weights, ids

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """Causal attention over right-padded rows: q [B, nh, L, D], k/v [B, nkv, L, D] -> [B, nh, L, D].
        `sinks` [nh]: a learned logit per head in every softmax denominator; `window`: a query sees only the last
        `window` positions, itself included (both GPT-OSS; computed by sink_attention, or by the prefix kernel in the
        batch-invariant mode).
        With cached prefixes (see __init__) each row attends to its prefix's keys and values, then its own; without
        them this is the plain causal attention below."""
        layer = self._attention_calls
        self._attention_calls += 1
        if self.capture is not None:
            n, kept = self.capture[:2]
            kept.append((k[0, :, :n].clone(memory_format=torch.contiguous_format),
                         v[0, :, :n].clone(memory_format=torch.contiguous_format)))
        if self.prefixes is not None or self.invariant:  # (invariant: one program per row and head, fixed tiles)
            return self._prefixed_attention(layer, q, k, v, scale, sinks, window)
        if sinks is not None or window is not None:
            # the Triton path: plain torch over the padded batch (the prefix kernel, which takes sinks and a window
            # too, serves only the batch-invariant mode above: its speed against this is not measured yet)
            if self.triton:
                return sink_attention(q, k, v, scale, sinks, window)
            out = torch.zeros_like(q)  # each row over its own length, as below
            for b, n in enumerate(self.lengths):
                out[b, :, :n] = sink_attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale,
                                               sinks, window)[0]
            return out
        gqa = q.shape[1] != k.shape[1]
        if self.triton:  # one call: padding sits after every valid position, so causal masking suffices
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        # each row over its own length: results do not depend on the batch; v heads may be narrower than q's (MLA)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # [B, nh, L, Dv]
        for b, n in enumerate(self.lengths):
            out[b, :, :n] = F.scaled_dot_product_attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                                           is_causal=True, scale=scale, enable_gqa=gqa)[0]
        return out

    def linear_attention(self, module, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, B: int,
                         L: int) -> torch.Tensor:
        """Gated DeltaNet's token mixing over the rows of a padded [B, L] batch: a causal depthwise convolution with
        SiLU over qkv [T, C] (the channels: queries, keys, values), then the gated delta rule with beta = sigmoid(b)
        and log decay g = -exp(A_log) * softplus(a + dt_bias) (b, a [T, Hv]) -> [T, Hv, V] (padding rows: zeros
        on the torch path, garbage on the GPU). Every row is its own sequence, so no state crosses rows; the torch
        path runs each row over its own length (batch-invariant as the other ops), the GPU one launch per op
        (kernels/gated_delta.py). A row continuing a cached prefix starts from the prefix's last conv inputs and
        recurrent state (PrefixKV.states, this layer's); a prefix pass (`capture`) keeps them after n positions."""
        layer = self._linear_attention_calls
        self._linear_attention_calls += 1
        beta = self.pointwise(torch.sigmoid, b).view(B, L, -1)  # [B, L, Hv]
        g = -module.A_log.float().exp() * self.pointwise(F.softplus, a.float() + module.dt_bias.float())  # [T, Hv]
        x, g = qkv.view(B, L, -1), g.view(B, L, -1)  # [B, L, C], [B, L, Hv] float32
        if self.triton:
            return self._delta_rows(module, x, beta, g, self._start_states(module, layer, x)).reshape(
                B * L, *module.value_shape)
        states = [None] * B
        if self.prefixes is not None:
            states = [None if p is None else p.states[layer] for p in self.prefixes] + [None] * (B - len(self.prefixes))
        out = x.new_zeros(B, L, *module.value_shape)  # [B, L, Hv, V]
        for row, n in enumerate(self.lengths):
            state = states[row]
            start = None if state is None else (state[0][None], state[1][None])
            out[row, :n] = self._delta_rows(module, x[row:row + 1, :n], beta[row:row + 1, :n], g[row:row + 1, :n],
                                            start)[0]
        return out.view(B * L, *module.value_shape)

    def _start_states(self, module, layer: int, x: torch.Tensor) -> tuple | None:
        """The GPU path's start of every row of x [B, L, C] at Gated DeltaNet layer `layer`: (conv inputs [B, W-1, C],
        recurrent state [B, Hv, K, V] float32) gathered in one launch each from a table of zeros and the batch's
        distinct prefixes' (entry per row: _distinct_prefixes); None where no row continues a prefix. Per-row stacking
        was ~5,000 host calls per forward on MMLU's batches (BENCHMARKS-history 22)."""
        if self.prefixes is None:  # nothing to gather (and nothing copied from the host, which a graph cannot capture)
            return None
        entry, prefixes = self._distinct_prefixes(x.shape[0])
        if self._entries is None:
            self._entries = to_device(entry, x.device)  # [B]
        entries = self._entries
        conv = torch.stack([module.conv_state(x)] + [p.states[layer][0].to(x) for p in prefixes])  # [P+1, W-1, C]
        recurrent = torch.stack([module.recurrent_state(x)] + [p.states[layer][1] for p in prefixes])  # [P+1, Hv, K, V]
        return conv[entries], recurrent[entries]  # [B, W-1, C], [B, Hv, K, V]

    def _distinct_prefixes(self, rows: int) -> tuple[list[int], list]:
        """(entry per row of `rows`: 0 for a row without a prefix, else 1 + its prefix's index; the batch's distinct
        prefixes), on the host, built once per forward (the prefix tables of attention and of Gated DeltaNet)."""
        if self._distinct is None:
            distinct: dict = {}  # id -> (entry, prefix)
            entry = [0] * rows
            for b, prefix in enumerate(self.prefixes or []):
                if prefix is not None:
                    entry[b] = distinct.setdefault(id(prefix), (len(distinct) + 1, prefix))[0]
            self._distinct = (entry, [prefix for _, prefix in distinct.values()])
        return self._distinct

    def _delta_rows(self, module, x, beta, g, start) -> torch.Tensor:
        """linear_attention's conv and delta rule over rows x [R, n, C] from `start` (conv inputs [R, W-1, C],
        recurrent state [R, Hv, K, V]) or zeros -> [R, n, Hv, V]; under `capture` (one row) split after the first n
        positions, whose end state is kept."""
        conv = causal_conv1d if self.triton else causal_conv1d_ref
        delta = gated_delta_rule if self.triton else gated_delta_rule_ref
        weight = module.conv1d.weight[:, 0]  # [C, W]

        def run(x, beta, g, start, keep: bool):
            y, conv_state = conv(x, weight, None if start is None else start[0])  # [R, n, C], [R, W-1, C]
            q, k, v = y.split(module.qkv_split, dim=-1)
            R, n = x.shape[:2]
            out, recurrent = delta(q.reshape(R, n, -1, module.head_k_dim), k.reshape(R, n, -1, module.head_k_dim),
                                   v.reshape(R, n, *module.value_shape), g, beta,
                                   None if start is None else start[1], output_final_state=keep)
            return out, (conv_state, recurrent)  # [R, n, Hv, V]

        if self.capture is None:
            return run(x, beta, g, start, False)[0]
        n = self.capture[0]
        first, state = run(x[:, :n], beta[:, :n], g[:, :n], start, True)
        self.capture[2].append((state[0][0].clone(), state[1][0].clone()))  # [W-1, C], [Hv, K, V] float32
        if x.shape[1] == n:
            return first
        return torch.cat([first, run(x[:, n:], beta[:, n:], g[:, n:], state, False)[0]], dim=1)

    def _prefix_groups(self, rows: int, device) -> list:
        """[(prefix or None, rows [G] on device)]: the batch's `rows` rows by cached prefix, built at the first layer
        (the Triton path's sinks-or-window attention outside the batch-invariant mode)."""
        if self._rows_by_prefix is None:
            groups: dict = {}
            for b in range(rows):
                prefix = self.prefixes[b] if b < len(self.prefixes) else None
                groups.setdefault(id(prefix), (prefix, []))[1].append(b)
            self._rows_by_prefix = [(prefix, to_device(members, device))
                                    for prefix, members in groups.values()]
        return self._rows_by_prefix

    def _prefix_table(self, layer: int, rows: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, PrefixTable]:
        """(every row [B], layer `layer`'s PrefixTable) on device, the batch's built at the first layer: entry 0 is no
        prefix, then each distinct prefix of the batch (one launch per layer reads every row's own;
        kernels/prefix_attention.py). Without prefixes (the batch-invariant mode) it is made on the device: a CUDA
        graph captures that, where it cannot capture a copy from the host. `dtype`: the layer's keys' (the cached
        prefixes' must match: the kernel reads them as that)."""
        if self._table is None:
            every = torch.arange(rows, device=device)  # [B]
            if self.prefixes is None:
                self._table = (every, torch.zeros(rows, dtype=torch.int32, device=device),
                               torch.zeros(2, 1, dtype=torch.int64, device=device),  # [2, 1]: every layer's
                               torch.zeros(1, dtype=torch.int32, device=device))
            else:
                entry, prefixes = self._distinct_prefixes(rows)
                wrong = {t.dtype for prefix in prefixes for t in prefix.kv[0]} - {dtype}
                if wrong:
                    raise ValueError(f"cached prefixes hold {wrong.pop()} keys or values, the layers compute {dtype}")
                addresses = torch.stack([torch.zeros_like(prefixes[0].addresses())]
                                        + [prefix.addresses() for prefix in prefixes], dim=2)  # [layers, 2, E]
                self._table = (every, to_device(entry, device, torch.int32), to_device(addresses, device),
                               to_device([0] + [prefix.length for prefix in prefixes], device, torch.int32))
                self._row_lengths = to_device(self.lengths + [0] * (rows - len(self.lengths)), device,
                                              torch.int32)  # [B]
        every, entry, addresses, lengths = self._table
        return every, PrefixTable(entry, addresses[layer] if addresses.dim() == 3 else addresses, lengths)

    def _prefixed_attention(self, layer: int, q, k, v, scale: float, sinks, window) -> torch.Tensor:
        """Attention of a batch some of whose rows continue a cached prefix: per row, over the prefix's keys and
        values of this layer followed by the row's own, query i (at position prefix + i) seeing keys 0..prefix + i
        (and only the last `window` of them; sinks as usual). Rows without a prefix compute exactly what the torch
        path computes for them. The Triton path runs every row in one launch of kernels/prefix_attention.py, which
        reads each row's prefix in place (with sinks or a window outside the batch-invariant mode: plain torch per
        prefix group, over the prefix's keys concatenated in front, at the padded length, whose right padding sits
        after every valid position and so outside every real query's view); the torch path goes row by row.
        Prefixed batches run eagerly, without graphs. The batch-invariant mode's attention comes here too, prefixes
        or not: every row through the kernel, sinks and window included."""
        if self.triton:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])  # [B, nh, L, Dv]: every row written below
            if (sinks is None and window is None) or self.invariant:  # (positions past a row's length: zeros)
                every, table = self._prefix_table(layer, q.shape[0], q.device, k.dtype)
                prefix_attention(q, k, v, out, every, scale, table, sinks, window, lengths=self._row_lengths)
                return out
            for prefix, rows in self._prefix_groups(q.shape[0], q.device):
                qg, kg, vg = q[rows], k[rows], v[rows]  # [G, nh, L, D], [G, nkv, L, Dk], [G, nkv, L, Dv]
                if prefix is not None:  # pk [nkv, P, Dk], pv [nkv, P, Dv]
                    pk, pv = (t.to(k.dtype) for t in prefix.kv[layer])
                    kg = torch.cat([pk[None].expand(len(rows), -1, -1, -1), kg], dim=2)
                    vg = torch.cat([pv[None].expand(len(rows), -1, -1, -1), vg], dim=2)
                out[rows] = row_attention(qg, kg, vg, scale, sinks, window, 0 if prefix is None else prefix.length)
            return out
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # [B, nh, L, Dv]
        for b, n in enumerate(self.lengths):
            prefix = self.prefixes[b] if b < len(self.prefixes) else None
            qb, kb, vb = q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n]
            offset = 0
            if prefix is not None:
                pk, pv = prefix.kv[layer]  # [nkv, P, Dk], [nkv, P, Dv]
                kb = torch.cat([pk[None].to(kb.dtype), kb], dim=2)  # [1, nkv, P + n, Dk]
                vb = torch.cat([pv[None].to(vb.dtype), vb], dim=2)  # [1, nkv, P + n, Dv]
                offset = prefix.length
            out[b, :, :n] = row_attention(qb, kb, vb, scale, sinks, window, offset)[0]
        return out


def row_attention(q, k, v, scale: float, sinks=None, window: int | None = None, offset: int = 0) -> torch.Tensor:
    """Causal attention of rows whose n queries sit at positions offset..offset+n-1 over keys at 0..offset+n-1:
    q [B, nh, n, D], k/v [B, nkv, offset + n, D] -> [B, nh, n, Dv]. One row at offset 0: what Forward.attention's
    torch path computes for it."""
    if sinks is not None or window is not None:
        return sink_attention(q, k, v, scale, sinks, window, offset)
    gqa = q.shape[1] != k.shape[1]
    if offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    n, total = q.shape[2], k.shape[2]
    allowed = torch.arange(total, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + offset
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)  # [B, nh, n, Dv]


# ---- GPT-OSS ops in plain torch --------------------------------------------------------------------------
SCORES_BUDGET = 1 << 24  # attention scores held at once by sink_attention (64 MiB in float32)


def sink_attention(q, k, v, scale: float, sinks=None, window: int | None = None, offset: int = 0) -> torch.Tensor:
    """Causal attention with optional sinks and sliding window, transformers' eager formula: q [B, nh, Lq, D],
    k/v [B, nkv, L, D] -> [B, nh, Lq, D], query i at position offset + i (offset = L - Lq: a cached prefix's
    keys come first; the window counts them too). Queries go in chunks so that at most SCORES_BUDGET scores exist
    at once; the softmax is taken in float32."""
    B, nh, Lq, D = q.shape
    L = k.shape[2]
    k = k.repeat_interleave(nh // k.shape[1], dim=1)  # [B, nh, L, D]: query head h reads kv head h // groups
    v = v.repeat_interleave(nh // v.shape[1], dim=1)  # [B, nh, L, D]
    keys = torch.arange(L, device=q.device)  # [L]
    out = torch.empty_like(q) if v.shape[-1] == D else q.new_empty(B, nh, Lq, v.shape[-1])  # q's layout
    step = max(1, SCORES_BUDGET // (B * nh * L))
    for start in range(0, Lq, step):
        queries = keys[start:start + step] if offset == 0 else torch.arange(start, min(start + step, Lq),
                                                                             device=q.device) + offset  # [C]
        scores = torch.matmul(q[:, :, start:start + step], k.transpose(-1, -2)) * scale  # [B, nh, C, L]
        allowed = keys[None, :] <= queries[:, None]  # [C, L]
        if window is not None:
            allowed &= keys[None, :] > queries[:, None] - window
        scores = scores.float().masked_fill(~allowed, float("-inf"))  # [B, nh, C, L]
        if sinks is not None:
            sink = sinks.float().view(1, nh, 1, 1).expand(B, nh, queries.numel(), 1)  # [B, nh, C, 1]
            scores = torch.cat([scores, sink], dim=-1)  # [B, nh, C, L+1]
        probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :L]  # sink column dropped
        out[:, :, start:start + step] = torch.matmul(probs.to(v.dtype), v)  # [B, nh, C, D]
    return out
