"""The engine: a base model plus adapters in stacked slots, and `logprobs(batch)` — the one API every task uses.

A batch is a list of token sequences, each with the adapter it runs under (None = base model). The result
is, per sequence, float32 `lp[i] = log p(ids[i+1] | ids[:i+1])`. Rows are right-padded into one [B, L]
forward; logits are computed for a bounded number of positions at a time, so the [tokens, vocab] matrix
never exists for the whole batch. A row with no adapter gets exactly the base model's numbers.

A row may name leading tokens it shares with other rows (`Batch.prefixes`): they are computed once per (prefix,
adapter), alone, and kept in a bounded cache (`prefixes.PrefixCache`), and the row runs only its suffix
(engine/prefixes.py says why and how; `tokens_computed` counts every position run, prefix passes included).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..adapters import Adapter, AdapterStack, load_adapter
from ..distributed import Ranks
from ..errors import InputError
from ..kernels.logprobs import token_logprobs
from ..kernels.tiles import INVARIANT_VOCAB_SPLITS
from ..models import load_model
from ..names import DTYPE_NAMES
from ..runners.compile_clock import COMPILE_CLOCK
from ..runners.graphs import BucketPlan, GraphRunner
from .expert_parallel import ExpertParallel
from .forward import BACKENDS, Forward, to_device
from .prefixes import PREFIX_CACHE_BYTES, PrefixCache, PrefixKV

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DEVICES = ("auto", "cpu", "cuda")
LOGITS_BUDGET = 1 << 24  # float32 logits held at once (64 MiB)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, as one object from the command line or the API down to `Engine.load`.

    device: "auto" (cuda when torch sees a GPU, else cpu), "cpu", "cuda" or "cuda:N". dtype: "auto" (bfloat16 on
    cuda, float32 on cpu) or a DTYPES name. backend: "torch" or "triton" (None: triton on cuda). gate_up_layout: the
    row order of fused 3D gate_up LoRA where the files do not fix it (adapters/load.py). cuda_graphs: replay
    captured forwards on a GPU, at most graph_buckets graphs and max_graph_memory bytes of pool (runners/graphs.py).
    expert_parallel: the routed experts spread over the ranks of a torchrun job (expert_parallel.py).
    prefix_cache: tasks (compare, mmlu) name rows' shared leading tokens so that the engine computes them once per
    (prefix, adapter) (prefixes.py); off: every row runs its whole prompt. prefix_cache_memory: bytes of computed
    prefixes (keys, values, logprobs) the engine keeps at most, least recently used evicted first. Neither is in
    `record()`: the tasks put what they used into their fingerprints. batch_invariant: on the Triton path, a row's
    logprobs are bitwise the same whatever else is in its batch, where it sits and however much padding there is
    (Forward's `invariant`); the torch path is so already. Not with expert_parallel."""

    device: str = "auto"
    dtype: str = "auto"
    backend: str | None = None
    gate_up_layout: str | None = None
    cuda_graphs: bool = True
    graph_buckets: int = 32
    max_graph_memory: int | None = None
    expert_parallel: bool = False
    prefix_cache: bool = True
    prefix_cache_memory: int = PREFIX_CACHE_BYTES
    batch_invariant: bool = False

    def resolved(self) -> "EngineOptions":
        """The same options with "auto" replaced by what this machine gives; InputError on a bad value."""
        device, dtype = self.device, self.dtype
        if not isinstance(device, str) or not (device in DEVICES or device.startswith("cuda:")):
            raise InputError("--device", f"'{device}' is not one of {', '.join(DEVICES)} (or cuda:N)")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError("--device", "CUDA was asked for but torch sees no GPU")
        if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one GPU per rank under torchrun
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        if dtype not in DTYPES:
            raise InputError("--dtype", f"'{dtype}' is not one of auto, {', '.join(DTYPES)}")
        if self.batch_invariant and self.expert_parallel:
            raise InputError("--batch-invariant", "is not supported with --expert-parallel (the experts' sums are "
                             "combined across ranks in an order that follows the batch)")
        if self.expert_parallel and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise InputError("--expert-parallel", "spreads the experts over the processes of a job: run it under "
                             "lora-eval launch --nproc-per-node 2 or more")
        return replace(self, device=device, dtype=dtype)

    def record(self) -> dict:
        """What a run record and a run's fingerprint keep of the options (resolve first). On the CPU that includes
        torch's thread count: matrix products split their sums by thread, so the last bits of a result depend on it
        (torchrun gives each worker one thread unless OMP_NUM_THREADS says otherwise)."""
        device = self.device.split(":")[0]  # a rank's own GPU is not part of what a run computes
        graphs = dict(max_buckets=self.graph_buckets, max_memory=self.max_graph_memory) if self.cuda_graphs else None
        name = torch.cuda.get_device_name(torch.device(self.device)) if device == "cuda" else "cpu"
        return dict(device=device, device_name=name, dtype=self.dtype,
                    backend=self.backend or ("triton" if device == "cuda" else "torch"),
                    gate_up_layout=self.gate_up_layout, cuda_graphs=graphs, expert_parallel=self.expert_parallel,
                    batch_invariant=self.batch_invariant, threads=torch.get_num_threads() if device == "cpu" else None)


def read_adapters(model_dir: str | Path, adapters: dict[str, str | Path] | None,
                  options: EngineOptions | None = None) -> list[Adapter]:
    """Every adapter read and checked against the checkpoint's config and tensor shapes (no weights loaded)."""
    shapes = load_model(model_dir, device="meta")
    layout = (options or EngineOptions()).gate_up_layout
    return [load_adapter(path, name, shapes, layout) for name, path in (adapters or {}).items()]


def current_device(device):
    """A context in which `device` is CUDA's current device (nothing on the CPU): Triton launches its kernels on the
    current device, whichever GPU their tensors are on (--device cuda:1 in one process)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_its_device(method):
    """An Engine method run with the engine's GPU as the current device (`current_device`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with current_device(self.model.inv_freq.device):
            return method(self, *args, **kwargs)
    return run


@dataclass
class Batch:
    """`prefixes`: per row, how many of its leading tokens are a prefix it shares with other rows (0: none; None:
    no row has one). The engine computes such a prefix once per (prefix tokens, adapter) and runs only the rest of
    the row (engine/prefixes.py); what comes back is what the whole row gives, equal within rounding. A prefix
    must leave at least one token of its row.
    `temperatures`: per row None (1), one number, or one per predicted position (len(row) - 1): the logprobs are
    those of logits / T (a sampler's tempered distribution); None: every row at 1.
    `routes`: also return, per row, the experts each MoE layer chose at each predicted position and their routing
    weights (`Engine.start_logprobs`)."""
    input_ids: list[list[int]]
    adapters: list[str | None]  # one per row; None = base model
    prefixes: list[int] | None = None
    temperatures: list | None = None
    routes: bool = False

    def __post_init__(self):
        if len(self.input_ids) != len(self.adapters):
            raise ValueError(f"{len(self.input_ids)} sequences but {len(self.adapters)} adapter tags")
        if self.prefixes is not None:
            if len(self.prefixes) != len(self.input_ids):
                raise ValueError(f"{len(self.input_ids)} sequences but {len(self.prefixes)} prefix lengths")
            for i, (p, ids) in enumerate(zip(self.prefixes, self.input_ids)):
                if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(ids):
                    raise InputError(f"row {i}", f"a shared prefix must be an integer from 0 to the row's length "
                                     f"minus 1 ({len(ids) - 1}), found {p!r}")
        if self.temperatures is not None:
            if len(self.temperatures) != len(self.input_ids):
                raise ValueError(f"{len(self.input_ids)} sequences but {len(self.temperatures)} temperatures")
            self.temperatures = [_row_temperatures(t, len(ids), i) for i, (t, ids) in
                                 enumerate(zip(self.temperatures, self.input_ids))]


def _row_temperatures(value, length: int, row: int) -> float | list[float] | None:
    """A row's temperature: None (1 everywhere), one float for every position, or one per predicted position,
    checked finite and above 0 (vectorised: a row may hold thousands)."""
    if value is None:
        return None
    scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        values = np.asarray([value] if scalar else value, dtype=np.float64)  # [1] or [length - 1]
    except (TypeError, ValueError):
        raise InputError(f"row {row}", "temperatures must be finite numbers above 0") from None
    if not scalar and values.shape != (length - 1,):
        raise InputError(f"row {row}", f"{values.size} temperatures for {length - 1} predicted positions")
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise InputError(f"row {row}", "temperatures must be finite numbers above 0")
    if (values == 1).all():
        return None
    return float(values[0]) if scalar or (values == values[0]).all() else values.tolist()


def _slice_temperatures(t, start: int, stop: int | None = None):
    """Positions start..stop of a row's temperature (None or a float stand for every position alike)."""
    return t[start:stop] if isinstance(t, list) else t


class Engine:
    """`backend`: "torch" (plain-torch ops, batch-invariant: the CPU path and the oracle) or "triton" (the
    Triton kernels; the default on CUDA)."""

    def __init__(self, model, adapters=(), backend: str | None = None, logits_budget: int = LOGITS_BUDGET,
                 cuda_graphs: bool = True, graph_plan: BucketPlan | None = None, expert_parallel=None,
                 prefix_cache_memory: int = PREFIX_CACHE_BYTES, batch_invariant: bool = False):
        self.model = model
        self.prefix_cache = PrefixCache(prefix_cache_memory)  # computed prefixes (Batch.prefixes)
        self.tokens_computed = 0  # token positions run through the model (no padding), prefixes included
        self.expert_parallel = expert_parallel  # expert_parallel.ExpertParallel: experts over the ranks
        self.adapters = list(adapters)
        self.stack = AdapterStack(self.adapters, model) if self.adapters else None
        device = model.inv_freq.device
        self.backend = backend or ("triton" if device.type == "cuda" else "torch")
        if self.backend not in BACKENDS:
            raise InputError("--backend", f"'{self.backend}' is not one of {', '.join(BACKENDS)}")
        if self.backend == "triton":
            COMPILE_CLOCK.install()  # Triton's compiles timed apart from the forwards (runners/compile_clock.py)
        self.logits_budget = logits_budget
        self.batch_invariant = batch_invariant  # EngineOptions.batch_invariant
        self.graphs = None  # CUDA graphs: the Triton path on a GPU only (the torch path is the oracle)
        if cuda_graphs and device.type == "cuda" and self.backend == "triton" and expert_parallel is None:
            self.graphs = GraphRunner(self._build, device, graph_plan)

    @classmethod
    def load(cls, model_dir: str | Path, adapters: dict[str, str | Path] | list[Adapter] | None = None,
             options: EngineOptions | None = None) -> "Engine":
        """Engine for a local checkpoint and adapters ({name: PEFT folder}, or what `read_adapters` returned), run
        as `options` say. Adapters are read and checked against the checkpoint's shapes before any weight loads."""
        options = (options or EngineOptions()).resolved()
        if not isinstance(adapters, list):
            adapters = read_adapters(model_dir, adapters, options)
        spread = None
        if options.expert_parallel:
            ranks = Ranks.from_env()
            spread = ExpertParallel(ranks.rank, ranks.world, load_model(model_dir, device="meta").args.num_experts)
            adapters = [spread.shard_adapter(a) for a in adapters]
        model = load_model(model_dir, dtype=DTYPES[options.dtype], device=options.device, experts=spread)
        plan = BucketPlan(max_buckets=options.graph_buckets, max_memory=options.max_graph_memory)
        return cls(model, adapters, backend=options.backend, cuda_graphs=options.cuda_graphs, graph_plan=plan,
                   expert_parallel=spread, prefix_cache_memory=options.prefix_cache_memory,
                   batch_invariant=options.batch_invariant)

    def stand_in(self) -> None:
        """A two-token batch whose result nobody reads: under expert parallel, this rank's part in a step where it
        has no batch of its own (every rank takes part in every MoE layer's exchange)."""
        self.logprobs(Batch([[0, 0]], [None]))

    @property
    def adapter_names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def logprobs(self, batch: Batch) -> list[torch.Tensor]:
        """Per row, float32 logprobs [len-1] of each next token, on the CPU. A row with a shared prefix of p tokens
        (Batch.prefixes) takes lp[0..p-1] from its prefix's pass (over its first p + 1 tokens, computed once per
        those tokens and adapter) and the rest from a pass over tokens p.. only."""
        return self.start_logprobs(batch).get()

    @on_its_device
    @torch.inference_mode()
    def start_logprobs(self, batch: Batch) -> "HostResult":
        """`logprobs(batch)` queued on the device: its `get()` waits for this batch's result alone, so that a task
        can prepare and queue the next batch meanwhile (a new prefix's pass waits for its own logprobs). With
        `batch.routes`, `get()` gives (logprobs, routes): per row (expert ids int64 [len-1, MoE layers, k], routing
        weights float32 [len-1, MoE layers, k]), the MoE layers in model order."""
        vocab = self.model.args.vocab_size
        slots = [self._slot(name, i) for i, name in enumerate(batch.adapters)]
        for i, ids in enumerate(batch.input_ids):
            if len(ids) < 2:
                raise InputError(f"row {i}", f"a sequence needs at least 2 tokens, found {len(ids)}")
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InputError(f"row {i}", f"token id {bad} is outside the vocabulary [0, {vocab})")
        temps = batch.temperatures or [None] * len(slots)
        if not batch.prefixes or not any(batch.prefixes):
            return self._logprobs(batch.input_ids, slots, temperatures=temps, routes=batch.routes)
        entries = self._prefix_entries(batch, slots, with_logprobs=True, routes=batch.routes)
        rows = [ids if e is None else ids[e.length:] for ids, e in zip(batch.input_ids, entries)]
        suffix_temps = [t if e is None else _slice_temperatures(t, e.length) for t, e in zip(temps, entries)]
        return self._logprobs(rows, slots, entries, temperatures=suffix_temps, routes=batch.routes)

    def _prefix_entries(self, batch: Batch, slots: list[int], with_logprobs: bool,
                        routes: bool = False) -> list[PrefixKV | None]:
        """Per row its prefix's PrefixKV (None without one), from the cache or computed now, alone (see prefixes.py
        for why alone). Keyed by the adapter slot and the prefix's tokens — plus, for logprobs, the token after them,
        which the prefix pass predicts, the temperatures of the prefix's positions and whether its routes were
        recorded (`routes`: the pass records them)."""
        entries, held = [], {}
        temps = batch.temperatures or [None] * len(slots)
        for ids, p, slot, t in zip(batch.input_ids, batch.prefixes, slots, temps):
            if not p:
                entries.append(None)
                continue
            head = _slice_temperatures(t, 0, p) if with_logprobs else None  # the prefix positions' temperature
            key = (slot, with_logprobs, tuple(ids[:p + 1] if with_logprobs else ids[:p]),
                   tuple(head) if isinstance(head, list) else head, routes)
            entry = held.get(key) or self.prefix_cache.get(key)
            if entry is None:
                kept, states, recorded = [], [], None
                if with_logprobs:
                    lp = self._logprobs([list(key[2])], [slot], capture=(p, kept, states),
                                        temperatures=[head], routes=routes).get()
                    if routes:
                        lp, recorded = lp[0], lp[1][0]
                    lp = lp[0]  # [p]
                else:
                    self._forward([list(key[2])], [slot], capture=(p, kept, states))
                    lp = None
                entry = PrefixKV(p, kept, lp, states, routes=recorded)
                self.prefix_cache.put(key, entry, in_use=sum(e.nbytes for k, e in held.items()
                                                             if k not in self.prefix_cache.entries))
            held[key] = entry
            entries.append(entry)
        return entries

    def _logprobs(self, input_ids: list[list[int]], slots: list[int], prefixes: list | None = None,
                  capture: tuple | None = None, temperatures: list | None = None,
                  routes: bool = False) -> "HostResult":
        """`start_logprobs` of checked rows (a row may be a single token: a suffix); `prefixes` per row PrefixKV or
        None: a row's result is its prefix's logprobs (and routes) followed by its own; `capture`: Forward's (a
        prefix pass); `temperatures`: per row None or one per predicted position; `routes`: as Batch.routes."""
        device = self.model.inv_freq.device
        vocab = self.model.args.vocab_size
        lengths = [len(ids) for ids in input_ids]
        recorded = [] if routes else None
        hidden, L, with_lora = self._forward(input_ids, slots, prefixes, capture, routes=recorded)  # [B'*L, H]
        fwd = _LazyForward(self, lengths, slots, L, with_lora, hidden.shape[0] // L)
        # positions whose next token exists, and that token
        rows = torch.cat([torch.arange(n - 1) + i * L for i, n in enumerate(lengths)])  # [N]
        rows_dev = to_device(rows, device)
        targets = to_device([t for row in input_ids for t in row[1:]], device)  # [N]
        temps = None
        if temperatures is not None and any(t is not None for t in temperatures):
            temps = to_device(torch.cat([torch.tensor(t, dtype=torch.float32) if isinstance(t, list) else torch.full(
                (n - 1,), 1.0 if t is None else t, dtype=torch.float32) for t, n in zip(temperatures, lengths)]),
                device, torch.float32)  # [N]
        head = self.model.lm_head
        head_slots = set()  # adapters that change lm_head (LoRA or their own copy)
        for table in (self.stack.dense, self.stack.overrides) if with_lora else ():
            if "lm_head" in table:
                head_slots |= table["lm_head"].slots
        if self.backend == "triton" and rows.numel():
            out = token_logprobs(hidden[rows_dev], head.weight, targets, head.bias,  # [N], no [N, V] tensor
                                 temperature=temps, v_splits=INVARIANT_VOCAB_SPLITS if self.batch_invariant else None)
            # rows whose adapter changes lm_head: recomputed below; the others keep the fused result
            chosen = [j for j, r in enumerate(rows.tolist()) if slots[r // L] in head_slots]
        else:
            out = torch.empty(rows.numel(), dtype=torch.float32, device=device)  # [N]
            chosen = list(range(rows.numel()))
        chosen = torch.tensor(chosen, dtype=torch.long)
        chunk = max(1, self.logits_budget // vocab)
        for start in range(0, chosen.numel(), chunk):
            pick = to_device(chosen[start:start + chunk], device)  # [C] positions in rows
            part = rows_dev[pick]  # [C] token rows
            logits = self.model.logits(hidden[part], fwd.subset(part)).float()  # [C, V]
            if temps is not None:
                logits = logits / temps[pick, None]
            logp = torch.log_softmax(logits, dim=-1)  # [C, V]
            out[pick] = logp.gather(1, targets[pick, None]).squeeze(1)
        split = [n - 1 for n in lengths]
        entries = prefixes or [None] * len(lengths)

        def joined(values: torch.Tensor, part) -> list[torch.Tensor]:  # per row: its prefix's values, then its own
            return [v if e is None else torch.cat([part(e), v]) for v, e in zip(values.split(split), entries)]

        if not routes:
            return HostResult(out, lambda host: joined(host, lambda e: e.logprobs))
        recorded.sort(key=lambda r: r[0])  # model order (the layers record in it already; expert parallel too)
        ids = torch.stack([r[1][rows_dev] for r in recorded], 1)  # [N, MoE layers, k]
        weights = torch.stack([r[2][rows_dev].float() for r in recorded], 1)  # [N, MoE layers, k]
        return HostResult((out, ids, weights), lambda host: (joined(host[0], lambda e: e.logprobs), list(zip(
            joined(host[1], lambda e: e.routes[0]), joined(host[2], lambda e: e.routes[1])))))

    def next_token_logprobs(self, batch: Batch, candidates: list[int]) -> torch.Tensor:
        """float32 [rows, len(candidates)] on the CPU: log p(candidate | whole row) at each row's last position
        (`start_next_token_logprobs` says how)."""
        return self.start_next_token_logprobs(batch, candidates).get()

    @on_its_device
    @torch.inference_mode()
    def start_next_token_logprobs(self, batch: Batch, candidates: list[int]) -> "HostResult":
        """`next_token_logprobs` queued on the device (`get()` waits for this batch alone, as `start_logprobs`):
        log p(candidate | whole row) at each row's last position.
        The same forward as `logprobs`, but lm_head and the log-softmax over the vocabulary run for the last
        positions only (multiple-choice scoring). Every row runs with one padding token after it, so that no
        scored position is among the last elements of a batch tensor, where plain-torch elementwise ops (F.silu)
        take a scalar path a few ulps off the vectorised one (`logprobs` never reads a row's last position). The torch
        path's own ops run in whole vector steps (Forward.pointwise); the padding keeps any other such op off the
        scored positions, and the forward's shapes the same on both backends."""
        device = self.model.inv_freq.device
        vocab = self.model.args.vocab_size
        if not candidates or not all(0 <= c < vocab for c in candidates):
            raise InputError("candidates", f"need token ids in [0, {vocab}), found {list(candidates)}")
        slots = [self._slot(name, i) for i, name in enumerate(batch.adapters)]
        lengths = [len(ids) for ids in batch.input_ids]
        for i, ids in enumerate(batch.input_ids):
            if not ids:
                raise InputError(f"row {i}", "an empty sequence has no last position")
            if min(ids) < 0 or max(ids) >= vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise InputError(f"row {i}", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if not lengths:
            return HostResult(torch.empty(0, len(candidates)))
        B = len(lengths)
        entries = [None] * B
        rows = batch.input_ids
        if batch.prefixes and any(batch.prefixes):  # a shared prefix's keys and values, computed once (prefixes.py)
            entries = self._prefix_entries(batch, slots, with_logprobs=False)
            rows = [ids if e is None else ids[e.length:] for ids, e in zip(rows, entries)]
            lengths = [len(ids) for ids in rows]
        hidden, L, with_lora = self._forward([[*ids, 0] for ids in rows], slots, entries,
                                             real=sum(lengths))  # [B'*L, H]
        fwd = _LazyForward(self, lengths, slots, L, with_lora, hidden.shape[0] // L)
        last = to_device([i * L + n - 1 for i, n in enumerate(lengths)], device)  # [B] token rows
        wanted = to_device(candidates, device)  # [C]
        out = torch.empty(B, len(candidates), dtype=torch.float32, device=device)  # [B, C]
        chunk = max(1, self.logits_budget // vocab)
        for start in range(0, B, chunk):
            part = last[start:start + chunk]  # [b]
            logits = self.model.logits(hidden[part], fwd.subset(part))  # [b, V]
            out[start:start + chunk] = torch.log_softmax(logits.float(), dim=-1)[:, wanted]  # [b, C]
        return HostResult(out)

    def _build(self, ids: torch.Tensor, token_slots: torch.Tensor, lora: bool, lengths: list[int] | None = None,
               prefixes: list | None = None, capture: tuple | None = None, routes: list | None = None):
        """The model's forward over device tensors: ids [B, L], token_slots [B*L] -> hidden [B*L, H]. What the
        graph runner captures (every row at full length there: padding comes after the real positions; graphs are
        captured without prefixes or capture, which run eagerly)."""
        lengths = lengths or [ids.shape[1]] * ids.shape[0]
        fwd = Forward(self.backend, lengths, self.stack if lora else None, token_slots if lora else None,
                      self.expert_parallel, prefixes=prefixes, capture=capture, invariant=self.batch_invariant,
                      routes=routes)
        return self.model(ids, fwd)

    def _forward(self, input_ids: list[list[int]], slots: list[int], prefixes: list | None = None,
                 capture: tuple | None = None, real: int | None = None,
                 routes: list | None = None) -> tuple[torch.Tensor, int, bool]:
        """Rows right-padded with 0 to one length -> (hidden [B' * L', H], L', with_lora): replayed from a
        captured graph when one fits (then B' >= B and L' >= L, the padded bucket), else eagerly. `prefixes` (per
        row a PrefixKV or None) and `capture` as Forward's: such forwards run eagerly (graphs hold no prefixes yet).
        `real`: the token positions that count as computed (all of the rows' by default)."""
        lengths = [len(row) for row in input_ids]
        self.tokens_computed += sum(lengths) if real is None else real
        if prefixes is not None and all(p is None for p in prefixes):
            prefixes = None
        B, L = len(lengths), max(lengths)
        ids = torch.zeros(B, L, dtype=torch.long)  # [B, L]
        for i, row in enumerate(input_ids):
            ids[i, :len(row)] = torch.tensor(row)
        # under expert parallel this rank's experts also serve other ranks' adapter rows
        with_lora = self.stack is not None and (max(slots) >= 0 or self.expert_parallel is not None)
        if self.graphs is not None and prefixes is None and capture is None:
            replayed = self.graphs.replay(ids, slots if with_lora else [-1] * B, routes=routes is not None)
            if replayed is not None:
                hidden, length, recorded = replayed
                if routes is not None:
                    routes.extend(recorded)
                return hidden, length, with_lora
        device = self.model.inv_freq.device
        token_slots = to_device(torch.tensor(slots, dtype=torch.long).repeat_interleave(L), device)  # [B*L]
        return self._build(to_device(ids, device), token_slots, with_lora, lengths, prefixes, capture, routes), L, \
            with_lora

    def prefix_stats(self) -> dict:
        """The prefix cache's figures (prefixes.PrefixCache.stats) and the token positions this engine computed."""
        return dict(self.prefix_cache.stats(), tokens_computed=self.tokens_computed)

    def expect(self, shapes: list[tuple[int, int, bool]], routes: bool = False) -> None:
        """The batches this engine is about to run without prefixes, as (rows, longest row, with an adapter row):
        the CUDA graphs' buckets are fitted to them (runners.graphs.BucketPlan.fit); `routes`: some of them record
        routes (Batch.routes), which the graphs then keep. Nothing without graphs."""
        if self.graphs is not None:
            self.graphs.plan.fit([(rows, length, lora and self.stack is not None) for rows, length, lora in shapes])
            self.graphs.record_routes = self.graphs.record_routes or routes

    def graph_stats(self) -> dict | None:
        """Captured graphs, their memory and how many batches replayed or ran eagerly; None without graphs."""
        return self.graphs.stats() if self.graphs is not None else None

    def _slot(self, name: str | None, row: int) -> int:
        if name is None:
            return -1
        if name not in self.adapter_names:
            known = ", ".join(self.adapter_names) or "none"
            raise InputError(f"row {row}", f"unknown adapter '{name}' (known adapters: {known})")
        return self.adapter_names.index(name)


def first_non_finite(rows) -> int | None:
    """The first row (of a list of tensors, or of a tensor's first dimension) holding a NaN or an infinity; None when
    every value is finite. One reduction over the whole batch; the rows are looked at one by one only on a failure."""
    whole = torch.cat([r.reshape(-1) for r in rows]) if isinstance(rows, (list, tuple)) else rows
    if bool(torch.isfinite(whole).all()):
        return None
    return next(i for i, r in enumerate(rows) if not bool(torch.isfinite(r).all()))


def overflow_error(model_dir, adapters: dict, adapter: str | None, sample: str, dtype: str,
                   computed_by: str = "the engine") -> InputError:
    """The one refusal of a non-finite logprob (compare, mmlu, diagnose, dump-reference), naming the adapter's folder
    (or the model's under the base model) and the sample. The weights and adapter factors were checked finite on
    load, so finite numbers overflowed on the way (a huge lora_alpha or factor, or a dtype too narrow for the model):
    a result computed from them would be a silent wrong answer."""
    under = f"adapter '{adapter}'" if adapter else "the base model"
    where = adapters[adapter] if adapter in adapters else model_dir
    return InputError(where, f"{computed_by} computed a non-finite logprob for {sample} under {under} in {dtype}: "
                      f"{'the adapter or the model' if adapter else 'the model'} overflows in the compute dtype "
                      "(its weights are finite; check the adapter's scale and factors, or the model's dtype)")


class HostResult:
    """A result on its way from the device to the host: the copy is queued behind the kernels that make it, into
    pinned memory, and `get()` waits for that copy alone — later batches may already be queued or running — and
    returns `then(the host tensor)` (the tensor itself by default; a tuple of tensors travels as a tuple). On the
    CPU it is ready at once."""

    def __init__(self, tensor: torch.Tensor | tuple, then=None):
        self._then, self._event = then, None
        tensors = tensor if isinstance(tensor, tuple) else (tensor,)
        if tensors[0].device.type == "cuda":
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)  # on the tensor's device's current stream
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensors[0].device))  # after those copies
        else:
            host = tensors
        self._host = host if isinstance(tensor, tuple) else host[0]

    def get(self):
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host if self._then is None else self._then(self._host)


class _LazyForward:
    """The `Forward` of a batch laid out at length L, built only if lm_head needs one (most batches on the GPU
    never do): `subset(rows)` as Forward.subset."""

    def __init__(self, engine: Engine, lengths: list[int], slots: list[int], L: int, with_lora: bool, rows: int):
        self.engine, self.lengths, self.slots, self.L, self.with_lora = engine, lengths, slots, L, with_lora
        self.rows = rows  # of the hidden states: a graph bucket's may exceed the batch's
        self._fwd = None

    def subset(self, rows: torch.Tensor) -> Forward:
        if self._fwd is None:
            e = self.engine
            slots = self.slots + [-1] * (self.rows - len(self.slots))  # padding rows of a graph bucket
            token_slots = torch.tensor(slots, dtype=torch.long).repeat_interleave(self.L)  # [B'*L]
            device = e.model.inv_freq.device
            self._fwd = Forward(e.backend, self.lengths, e.stack if self.with_lora else None,
                                to_device(token_slots, device) if self.with_lora else None,
                                invariant=e.batch_invariant)
        return self._fwd.subset(rows)
