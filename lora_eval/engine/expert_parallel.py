"""Expert parallel over torch.distributed (`--expert-parallel` under torchrun): every MoE layer's routed experts split
into contiguous shares, one per rank; everything else (embeddings, attention, routers, shared experts, dense MLPs,
lm_head) replicated, each rank running it on its own rows (attention data parallel).

Loading: `ExpertShard` wraps a checkpoint's tensors so that a family's loader, asking for its (local) experts, reads
only this rank's share from the safetensors files — fused expert tensors ([E, ...]: weights, biases, MXFP4 blocks
and scales) by their first-dimension rows, per-expert keys (`experts.{e}.`) under their global index — and no rank
ever holds the whole model. Expert LoRA factors with a per-expert dimension are cut the same way; shared-outer
factors (expert dimension 1) stay whole.

The forward: at each MoE layer, every (token, k) pair goes to the rank owning its expert with its hidden row, its
local expert id and its row's adapter slot (all_to_all), the owner runs its experts on the pairs it received (the
fused MoE kernel, or its torch reference, at top-1), the results come back (all_to_all) and each rank sums its
tokens' k results with their routing weights. Every rank must take part in every layer, so ranks run their
batches in lock-step (a rank without a batch left runs a two-token stand-in) and decide together when to stop.
The sum over k runs in another order than one process's, so logprobs agree with it to float rounding (1e-5 in
float32, tested), not bit for bit. CUDA graphs are off (the exchange's sizes change with every batch).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..adapters import Adapter
from ..adapters.load import ExpertFactors
from ..errors import InputError
from ..kernels.fused_moe import fused_moe_ref
from ..models.layers import FusedExperts

PER_EXPERT = re.compile(r"^(?P<site>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
FUSED = re.compile(r"^(?P<site>.*\.experts)\.(?P<name>[A-Za-z_]\w*)$")


def shares(total: int, world: int) -> list[tuple[int, int]]:
    """(first expert, count) of each rank: contiguous, sizes differing by at most one."""
    counts = [total // world + (r < total % world) for r in range(world)]
    starts = [sum(counts[:r]) for r in range(world)]
    return list(zip(starts, counts))


class ExpertShard:
    """A checkpoint's tensors (TensorFiles or TensorDict) as one rank's loader sees them: fused expert tensors cut to
    rows start .. start+count of their expert dimension, per-expert keys renumbered from 0 (`experts.{e}.` reads
    `experts.{start + e}.`); the other experts' keys are neither listed nor read."""

    def __init__(self, files, start: int, count: int, total: int):
        self.files, self.start, self.count, self.total = files, start, count, total
        self.read_keys: set[str] = set()

    def _split(self, key: str) -> tuple[str, bool]:
        """(the stored key, whether rows of its first dimension are this rank's share)."""
        m = PER_EXPERT.match(key)
        if m:
            return f"{m['site']}.{int(m['e']) + self.start}.{m['rest']}", False
        stored_fused = FUSED.match(key) and key in self.files and self.files.shape(key)[:1] == (self.total,)
        return key, bool(stored_fused)

    def keys(self) -> list[str]:
        found = []
        for key in self.files.keys():
            m = PER_EXPERT.match(key)
            if m is None:
                found.append(key)
            elif self.start <= int(m["e"]) < self.start + self.count:
                found.append(f"{m['site']}.{int(m['e']) - self.start}.{m['rest']}")
        return found

    def __contains__(self, key: str) -> bool:
        m = PER_EXPERT.match(key)
        return (m is None or int(m["e"]) < self.count) and self._split(key)[0] in self.files

    def file_of(self, key: str):
        return self.files.file_of(self._split(key)[0])

    def describe(self) -> str:
        return self.files.describe()

    def dtype(self, key: str):
        return self.files.dtype(self._split(key)[0])

    def shape(self, key: str) -> tuple[int, ...]:
        stored, cut = self._split(key)
        shape = self.files.shape(stored)
        return (self.count, *shape[1:]) if cut else shape

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        if key not in self:
            raise InputError(self.describe(), "missing tensor", key=self._split(key)[0])
        self.read_keys.add(key)
        if self.shape(key) != tuple(shape):
            raise InputError(self.file_of(key), f"shape {list(self.shape(key))}, expected {list(shape)}",
                             key=self._split(key)[0])

    def get(self, key: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        if shape is not None:
            self.check(key, shape)
        stored, cut = self._split(key)
        self.read_keys.add(key)
        tensor = self.files.get_rows(stored, self.start, self.count) if cut else self.files.get(stored)
        return tensor if dtype is None else tensor.to(dtype)


class ExpertParallel:
    """This rank's share of every MoE layer's experts (`start`, `count` of `total`) and the exchange of (token,
    expert) pairs with the other ranks, over the default process group."""

    def __init__(self, rank: int, world: int, total: int):
        self.rank, self.world, self.total = rank, world, total
        self.shares = shares(total, world)
        self.start, self.count = self.shares[rank]
        self.owner = torch.repeat_interleave(torch.arange(world), torch.tensor([c for _, c in self.shares]))  # [E]
        self.first = torch.tensor([s for s, _ in self.shares])  # [world] first expert of each rank

    # -- loading --

    def shard_files(self, files) -> ExpertShard:
        return ExpertShard(files, self.start, self.count, self.total)

    def shard_model(self, model) -> None:
        """Every FusedExperts of `model` (on the meta device) down to this rank's experts."""
        for module in model.modules():
            if isinstance(module, FusedExperts):
                if module.num_experts != self.total:
                    raise InputError(module.site, f"{module.num_experts} experts, expected {self.total} in every "
                                     "MoE layer for expert parallel")
                for name, param in list(module.named_parameters(recurse=False)):
                    setattr(module, name, torch.nn.Parameter(param.new_empty(self.count, *param.shape[1:]),
                                                             requires_grad=False))
                module.num_experts = self.count

    def shard_adapter(self, adapter: Adapter) -> Adapter:
        """`adapter` with every per-expert factor cut to this rank's experts (shared ones, expert dim 1, whole)."""
        def cut(t):
            return t[self.start:self.start + self.count] if t.shape[0] == self.total else t

        for site, factors in adapter.experts.items():
            adapter.experts[site] = ExpertFactors(
                *(None if part is None else (cut(part[0]), cut(part[1])) for part in (factors.gate_up, factors.down)))
        return adapter

    # -- the forward --

    def moe(self, fwd, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        """Forward.moe with the experts spread over the ranks: x [T, H], topk [T, k] (global expert ids) -> [T, H]."""
        T, k = topk_ids.shape
        device = x.device
        flat = topk_ids.reshape(-1)  # [T*k]
        owner = self.owner.to(device)[flat]  # [T*k]
        order = torch.argsort(owner, stable=True)  # [T*k] pairs grouped by owner
        rows = order // k  # [T*k] token of each sent pair
        slots = fwd.token_slots[rows] if fwd.token_slots is not None else torch.full_like(rows, -1)  # [T*k]
        local = flat[order] - self.first.to(device)[owner[order]]  # [T*k] expert id on its owner
        send = torch.bincount(owner, minlength=self.world)  # [world]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        items = torch.stack([local, slots], 1)  # [T*k, 2]
        got_items = items.new_empty(sum(recv_sizes), 2)  # [n, 2]
        dist.all_to_all_single(got_items, items, recv_sizes, send_sizes)
        got_x = x.new_empty(sum(recv_sizes), x.shape[1])  # [n, H]
        dist.all_to_all_single(got_x, x[rows].contiguous(), recv_sizes, send_sizes)
        y = self._experts(fwd, experts, got_x, got_items)  # [n, H]
        back = x.new_empty(T * k, x.shape[1])  # [T*k, H] in `order`
        dist.all_to_all_single(back, y, send_sizes, recv_sizes)
        out = torch.zeros_like(x)  # [T, H]
        out.index_add_(0, rows, back * topk_weights.reshape(-1)[order, None])
        return out if residual is None else residual + out

    def _experts(self, fwd, experts, x: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the pairs it received: x [n, H], items [n, 2] (local expert, slot) -> [n, H]."""
        lora = fwd.stack.experts.get(experts.site) if fwd.stack is not None and fwd.token_slots is not None else None
        ids = items[:, :1]  # [n, 1]
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)  # [n, 1]: weights applied at home
        slots = items[:, 1] if lora is not None else None  # [n]
        variant = experts.variant()
        if fwd.triton:
            from ..kernels.fused_moe import fused_moe

            return fused_moe(x, ids, ones, experts.gate_up_proj, experts.down_proj, lora, slots, **variant)
        return fused_moe_ref(x, ids, ones, experts.gate_up_proj, experts.down_proj, lora, slots, **variant)
