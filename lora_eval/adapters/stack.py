"""Adapters side by side: per-site buffers with one slot per adapter, and the per-batch view the model uses.

Every buffer is padded to the largest rank among the adapters at that site; a slot whose adapter has no
weight there stays zero and is left out of `slots`, so the torch path skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.dense_lora import dense_lora_ref, embedding_lora_ref
from ..kernels.linear import linear_ref
from ..models.layers import rms_norm
from .load import Adapter


@dataclass
class DenseLoRA:
    A: torch.Tensor  # [S, R, in]
    B: torch.Tensor  # [S, out, R], scaling folded in
    slots: frozenset[int]


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
        for site in sorted({s for a in adapters for s in a.dense}):
            have = {i: a.dense[site] for i, a in enumerate(adapters) if site in a.dense}
            A = self._stack(S, {i: f[0] for i, f in have.items()}, rank_dim=0)  # [S, R, in]
            B = self._stack(S, {i: f[1] for i, f in have.items()}, rank_dim=1)  # [S, out, R]
            self.dense[site] = DenseLoRA(A, B, frozenset(have))
        for site in sorted({s for a in adapters for s in a.embedding}):
            have = {i: a.embedding[site] for i, a in enumerate(adapters) if site in a.embedding}
            A = self._stack(S, {i: f[0] for i, f in have.items()}, rank_dim=1)  # [S, V, R]
            B = self._stack(S, {i: f[1] for i, f in have.items()}, rank_dim=1)  # [S, H, R]
            self.embedding[site] = EmbeddingLoRA(A, B, frozenset(have))
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
        for site in sorted({s for a in adapters for s in a.overrides}):
            module = by_site[site]
            per_slot = {}
            for i, a in enumerate(adapters):
                if site in a.overrides:
                    own = a.overrides[site]
                    per_slot[i] = {p: own[p].to(self.device, self.dtype) if p in own else getattr(module, p).detach()
                                   for p in ("weight", "bias") if getattr(module, p, None) is not None}
            self.overrides[site] = Override(per_slot, frozenset(per_slot))

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.names.index(name)

    def _stack(self, S, tensors: dict[int, torch.Tensor], rank_dim: int) -> torch.Tensor:
        first = next(iter(tensors.values()))
        shape = list(first.shape)
        shape[rank_dim] = max(t.shape[rank_dim] for t in tensors.values())
        buf = torch.zeros(S, *shape, dtype=self.dtype, device=self.device)
        for i, t in tensors.items():
            index = [i] + [slice(None)] * t.dim()
            index[1 + rank_dim] = slice(0, t.shape[rank_dim])
            buf[tuple(index)] = t
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
            buf[tuple(index)] = t  # an expert dim of 1 broadcasts to Ex
        return buf


class LoraBatch:
    """The stack as seen by one batch: which adapter slot each token row uses (-1 = none), grouped once."""

    def __init__(self, stack: AdapterStack, token_slots: torch.Tensor):
        self.stack = stack
        self.token_slots = token_slots  # [T]
        present = [s for s in torch.unique(token_slots).tolist() if s >= 0]
        self.groups = {s: (token_slots == s).nonzero().squeeze(1) for s in present}  # slot -> rows [n]

    def subset(self, rows: torch.Tensor) -> "LoraBatch":
        return LoraBatch(self.stack, self.token_slots[rows])

    def _groups(self, slots: frozenset[int]) -> list[tuple[int, torch.Tensor]]:
        return [(s, rows) for s, rows in self.groups.items() if s in slots]

    def linear(self, module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        override = self.stack.overrides.get(module.site)
        if override is not None:
            for s, rows in self._groups(override.slots):
                own = override.params[s]
                y[rows] = linear_ref(x[rows], own["weight"], own.get("bias"))
        lora = self.stack.dense.get(module.site)
        if lora is not None:
            dense_lora_ref(y, x, lora.A, lora.B, self._groups(lora.slots))
        return y

    def norm(self, module, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
        override = self.stack.overrides.get(module.site)
        if override is not None:
            for s, rows in self._groups(override.slots):
                y[rows] = rms_norm(x[rows], override.params[s]["weight"], eps)
        return y

    def embedding(self, module, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        override = self.stack.overrides.get(module.site)
        if override is not None:
            for s, rows in self._groups(override.slots):
                h[rows] = F.embedding(ids[rows], override.params[s]["weight"])
        lora = self.stack.embedding.get(module.site)
        if lora is not None:
            embedding_lora_ref(h, ids, lora.A, lora.B, self._groups(lora.slots))
        return h

    def experts(self, site: str) -> tuple[ExpertLoRA | None, torch.Tensor]:
        lora = self.stack.experts.get(site)
        if lora is None or not any(s in lora.slots for s in self.groups):
            return None, self.token_slots
        return lora, self.token_slots
