"""The engine: a base model plus adapters in stacked slots, and `logprobs(batch)` — the one API every task uses.

A batch is a list of token sequences, each with the adapter it runs under (None = base model). The result
is, per sequence, float32 `lp[i] = log p(ids[i+1] | ids[:i+1])`. Rows are right-padded into one [B, L]
forward; logits are computed for a bounded number of positions at a time, so the [tokens, vocab] matrix
never exists for the whole batch. A row with no adapter gets exactly the base model's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import AdapterStack, load_adapter
from .errors import InputError
from .forward import BACKENDS, Forward
from .models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGITS_BUDGET = 1 << 24  # float32 logits held at once (64 MiB)


@dataclass
class Batch:
    input_ids: list[list[int]]
    adapters: list[str | None]  # one per row; None = base model

    def __post_init__(self):
        if len(self.input_ids) != len(self.adapters):
            raise ValueError(f"{len(self.input_ids)} sequences but {len(self.adapters)} adapter tags")


class Engine:
    """`backend`: "torch" (plain-torch ops, batch-invariant: the CPU path and the oracle) or "triton" (the
    Triton kernels; the default on CUDA)."""

    def __init__(self, model, adapters=(), backend: str | None = None, logits_budget: int = LOGITS_BUDGET):
        self.model = model
        self.adapters = list(adapters)
        self.stack = AdapterStack(self.adapters, model) if self.adapters else None
        device = model.inv_freq.device
        self.backend = backend or ("triton" if device.type == "cuda" else "torch")
        if self.backend not in BACKENDS:
            raise InputError("--backend", f"'{self.backend}' is not one of {', '.join(BACKENDS)}")
        self.logits_budget = logits_budget

    @classmethod
    def load(cls, model_dir: str | Path, adapters: dict[str, str | Path] | None = None, *,
             dtype: str | torch.dtype = "float32", device: str = "cpu", backend: str | None = None) -> "Engine":
        """Engine for a local checkpoint and named PEFT adapter folders."""
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise InputError("--dtype", f"'{dtype}' is not one of {', '.join(DTYPES)}")
            dtype = DTYPES[dtype]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError("--device", "CUDA was asked for but torch sees no GPU")
        model = load_model(model_dir, dtype=dtype, device=device)
        adapters = [load_adapter(path, name, model) for name, path in (adapters or {}).items()]
        return cls(model, adapters, backend=backend)

    @property
    def adapter_names(self) -> list[str]:
        return [a.name for a in self.adapters]

    @torch.inference_mode()
    def logprobs(self, batch: Batch) -> list[torch.Tensor]:
        """Per row, float32 logprobs [len-1] of each next token, on the CPU."""
        device = self.model.inv_freq.device
        vocab = self.model.args.vocab_size
        slots = [self._slot(name, i) for i, name in enumerate(batch.adapters)]
        lengths = []
        for i, ids in enumerate(batch.input_ids):
            if len(ids) < 2:
                raise InputError(f"row {i}", f"a sequence needs at least 2 tokens, found {len(ids)}")
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InputError(f"row {i}", f"token id {bad} is outside the vocabulary [0, {vocab})")
            lengths.append(len(ids))
        B, L = len(lengths), max(lengths)
        ids = torch.zeros(B, L, dtype=torch.long)  # [B, L], right-padded with 0
        for i, row in enumerate(batch.input_ids):
            ids[i, :len(row)] = torch.tensor(row)
        token_slots = torch.tensor(slots, dtype=torch.long).repeat_interleave(L)  # [T]
        with_lora = self.stack is not None and max(slots) >= 0
        fwd = Forward(self.backend, lengths, self.stack if with_lora else None,
                      token_slots.to(device) if with_lora else None)
        ids = ids.to(device)
        hidden = self.model(ids, fwd)  # [T, H]
        # positions whose next token exists, and that token
        rows = torch.cat([torch.arange(n - 1) + i * L for i, n in enumerate(lengths)])  # [N]
        rows_dev = rows.to(device)
        targets = ids.reshape(-1)[rows_dev + 1]  # [N]
        head = self.model.lm_head
        head_slots = set()  # adapters that change lm_head (LoRA or their own copy)
        for table in (self.stack.dense, self.stack.overrides) if with_lora else ():
            if "lm_head" in table:
                head_slots |= table["lm_head"].slots
        if self.backend == "triton":
            from .kernels.logprobs import token_logprobs

            out = token_logprobs(hidden[rows_dev], head.weight, targets, head.bias)  # [N], no [N, V] tensor
            # rows whose adapter changes lm_head: recomputed below; the others keep the fused result
            chosen = [j for j, r in enumerate(rows.tolist()) if slots[r // L] in head_slots]
        else:
            out = torch.empty(rows.numel(), dtype=torch.float32, device=device)  # [N]
            chosen = list(range(rows.numel()))
        chosen = torch.tensor(chosen, dtype=torch.long)
        chunk = max(1, self.logits_budget // vocab)
        for start in range(0, chosen.numel(), chunk):
            pick = chosen[start:start + chunk].to(device)  # [C] positions in rows
            part = rows_dev[pick]  # [C] token rows
            logits = self.model.logits(hidden[part], fwd.subset(part))  # [C, V]
            logp = torch.log_softmax(logits.float(), dim=-1)  # [C, V]
            out[pick] = logp.gather(1, targets[pick, None]).squeeze(1)
        return list(out.cpu().split([n - 1 for n in lengths]))

    def _slot(self, name: str | None, row: int) -> int:
        if name is None:
            return -1
        if name not in self.adapter_names:
            known = ", ".join(self.adapter_names) or "none"
            raise InputError(f"row {row}", f"unknown adapter '{name}' (known adapters: {known})")
        return self.adapter_names.index(name)
