"""Adapters side by side: per-site buffers with one slot per adapter.

Every buffer is padded to the largest rank among the adapters at that site; a slot whose adapter has no
weight there stays zero and is left out of `slots` (and `slot_mask`), so the kernels skip it.
Projections of one input (a module's `input_groups`, e.g. q/k/v) with LoRA at two or more of them also get
their A stacked along the rank (`SharedShrink`), so that the GPU path shrinks the input once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .load import Adapter


@dataclass
class DenseLoRA:
    A: torch.Tensor  # [S, R, in]
    B: torch.Tensor  # [S, out, R], scaling folded in
    slots: frozenset[int]
    slot_mask: torch.Tensor | None = None  # [S] bool on the device: slot has weights here


@dataclass
class SharedShrink:
    A: torch.Tensor  # [S, sum of the members' R, in]: the members' A one after another
    columns: dict[str, tuple[int, int]]  # site -> (first column, R) of its shrink in the stacked result
    slot_mask: torch.Tensor  # [S] bool on the device: the slot has weights at some member


@dataclass
class ExpertLoRA:
    gate_up_A: torch.Tensor  # [S, Ea, R, H]   Ea/Eb: 1 (shared by all experts) or E
    gate_up_B: torch.Tensor  # [S, Eb, 2I, R]
    down_A: torch.Tensor  # [S, Ea, R, I]
    down_B: torch.Tensor  # [S, Eb, H, R]
    slots: frozenset[int]


@dataclass
class EmbeddingLoRA:
    A: torch.Tensor  # [S, V, R]
    B: torch.Tensor  # [S, H, R]
    slots: frozenset[int]
    slot_mask: torch.Tensor | None = None  # [S] bool on the device


@dataclass
class Override:
    """Adapters' own copies of a module's weights (modules_to_save): params[slot] = {"weight": ..., "bias": ...}."""

    params: dict[int, dict[str, torch.Tensor]]
    slots: frozenset[int]


class AdapterStack:
    """All adapters of a run, one slot each (slot = position in `adapters`), in the compute dtype and device."""

    def __init__(self, adapters: list[Adapter], model):
        self.names = [a.name for a in adapters]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"adapter names must be unique: {self.names}")
        self.adapters = adapters
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        S = len(adapters)
        self.dense: dict[str, DenseLoRA] = {}
        self.experts: dict[str, ExpertLoRA] = {}
        self.embedding: dict[str, EmbeddingLoRA] = {}
        self.overrides: dict[str, Override] = {}
        self.shared: dict[str, SharedShrink] = {}  # member site -> its group's stacked shrink
        for site in sorted({s for a in adapters for s in a.dense}):
            have = {i: a.dense[site] for i, a in enumerate(adapters) if site in a.dense}
            A = self._stack(S, {i: f[0] for i, f in have.items()}, rank_dim=0)  # [S, R, in]
            B = self._stack(S, {i: f[1] for i, f in have.items()}, rank_dim=1)  # [S, out, R]
            self.dense[site] = DenseLoRA(A, B, frozenset(have), self._mask(S, have))
        for site in sorted({s for a in adapters for s in a.embedding}):
            have = {i: a.embedding[site] for i, a in enumerate(adapters) if site in a.embedding}
            A = self._stack(S, {i: f[0] for i, f in have.items()}, rank_dim=1)  # [S, V, R]
            B = self._stack(S, {i: f[1] for i, f in have.items()}, rank_dim=1)  # [S, H, R]
            self.embedding[site] = EmbeddingLoRA(A, B, frozenset(have), self._mask(S, have))
        for module in model.modules():
            for names in getattr(module, "input_groups", ()):
                sites = [getattr(module, n).site for n in names if getattr(module, n).site in self.dense]
                if len(sites) < 2:
                    continue
                loras = [self.dense[site] for site in sites]
                starts = [sum(lora.A.shape[1] for lora in loras[:i]) for i in range(len(loras))]
                group = SharedShrink(torch.cat([lora.A for lora in loras], dim=1),
                                     {site: (start, lora.A.shape[1]) for site, start, lora in zip(sites, starts, loras)},
                                     torch.stack([lora.slot_mask for lora in loras]).any(0))
                self.shared.update({site: group for site in sites})
        by_site = {m.site: m for m in model.modules() if hasattr(m, "site")}
        for site in sorted({s for a in adapters for s in a.experts}):
            experts = by_site[site]
            E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
            have = {i: a.experts[site] for i, a in enumerate(adapters) if site in a.experts}
            gu = {i: f.gate_up for i, f in have.items() if f.gate_up is not None}
            dn = {i: f.down for i, f in have.items() if f.down is not None}
            self.experts[site] = ExpertLoRA(
                gate_up_A=self._stack_experts(S, {i: p[0] for i, p in gu.items()}, (H,), E, rank_dim=1),
                gate_up_B=self._stack_experts(S, {i: p[1] for i, p in gu.items()}, (2 * I,), E, rank_dim=2),
                down_A=self._stack_experts(S, {i: p[0] for i, p in dn.items()}, (I,), E, rank_dim=1),
                down_B=self._stack_experts(S, {i: p[1] for i, p in dn.items()}, (H,), E, rank_dim=2),
                slots=frozenset(have),
            )
        for site in sorted({s for a in adapters for s in (*a.overrides, *a.token_rows)}):
            module = by_site[site]
            per_slot = {}
            for i, a in enumerate(adapters):
                if site in a.overrides:
                    own = a.overrides[site]
                    per_slot[i] = {p: own[p].to(self.device, self.dtype) if p in own else getattr(module, p).detach()
                                   for p in ("weight", "bias") if getattr(module, p, None) is not None}
                elif site in a.token_rows:  # trainable tokens: the module's weight with the adapter's rows in it
                    ids, rows = a.token_rows[site]
                    weight = module.weight.detach().clone()  # [V, H]
                    weight[ids.to(self.device)] = rows.to(self.device, self.dtype)
                    per_slot[i] = {"weight": weight, **({"bias": module.bias.detach()} if getattr(
                        module, "bias", None) is not None else {})}
            self.overrides[site] = Override(per_slot, frozenset(per_slot))

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.names.index(name)

    def _mask(self, S, have) -> torch.Tensor:
        return torch.tensor([i in have for i in range(S)], dtype=torch.bool, device=self.device)

    def _stack(self, S, tensors: dict[int, torch.Tensor], rank_dim: int) -> torch.Tensor:
        first = next(iter(tensors.values()))
        shape = list(first.shape)
        shape[rank_dim] = max(t.shape[rank_dim] for t in tensors.values())
        buf = torch.zeros(S, *shape, dtype=self.dtype, device=self.device)
        for i, t in tensors.items():
            index = [i] + [slice(None)] * t.dim()
            index[1 + rank_dim] = slice(0, t.shape[rank_dim])
            buf[tuple(index)] = t.to(self.device)  # (the device casts and reorders: moved as it lies in memory)
        return buf

    def _stack_experts(self, S, tensors: dict[int, torch.Tensor], features: tuple[int], E: int, rank_dim: int):
        """[S, Ex, ...] with Ex = 1 when every adapter shares one factor across experts, else E (broadcast)."""
        if not tensors:  # no adapter has this part: one zero rank so shapes stay valid
            shape = (S, 1, 1, *features) if rank_dim == 1 else (S, 1, *features, 1)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        Ex = max(t.shape[0] for t in tensors.values())
        R = max(t.shape[rank_dim] for t in tensors.values())
        sample = next(iter(tensors.values()))
        shape = [S, Ex, *sample.shape[1:]]
        shape[1 + rank_dim] = R
        buf = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, t in tensors.items():
            index = [i, slice(None), slice(None), slice(None)]
            index[1 + rank_dim] = slice(0, t.shape[rank_dim])
            buf[tuple(index)] = t.to(self.device)  # an expert dim of 1 broadcasts to Ex; cast and reordered there
        return buf
