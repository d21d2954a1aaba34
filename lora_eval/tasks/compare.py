"""`compare`: the engine's logprobs against trainer reference dumps, per token, sample, adapter and overall.

A thin layer over `Engine.logprobs`: read and check the references (before any model is loaded), batch them by
length under a token budget (adapters mixed in a batch), run the batches as resumable units (the run protocol,
tasks/run.py), and turn the differences into the metrics of `results/metrics.py`. The adapter applied gate's base
re-runs of a sample of each adapter's rows are further units of the same work, so they are checkpointed, resumed and
shared out over data parallel ranks like the batches; its static facts come from the adapters' factors, read before
the model loads.

Shared prefixes (on unless `EngineOptions.prefix_cache` is off, `--no-prefix-cache`): samples of one adapter that
begin with the same token ids (an RL group's N completions of one prompt, a common system prompt; at least
MIN_SHARED_TOKENS of them) are found from the ids alone (prefixes.shared_prefix_lengths) and compute those tokens
once per (prefix, adapter): `Batch.prefixes` names all but the last shared token, whose position the prefix pass
predicts from, so each row's logprobs are the prefix's (shared) followed by its suffix's. Batches then take a
group's samples together (by length inside it). The gate's base re-runs use the same prefixes under the base model,
so that an adapter that changes nothing gives the base model's numbers bit for bit on the CPU, as without prefixes.
Under expert parallel prefixes are off (a prefix pass is a forward one rank would run alone).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..adapters import Adapter
from ..engine.batching import batches_in_order, make_batches, padding_waste
from ..engine.engine import DTYPES, Batch, Engine, EngineOptions, first_non_finite, overflow_error, read_adapters
from ..engine.plan import check_fits
from ..engine.prefixes import MIN_SHARED_TOKENS, grouped_order, prefix_bytes, shared_prefix_lengths
from ..errors import InputError
from ..inputs.checks import adapter_names, check_lengths, model_config, positive_int, temperature_option, threshold
from ..inputs.references import read_reference, reference_arg, reference_inputs
from ..inputs.tokenizer import load_decoder
from ..names import BASE, OVERALL
from ..render.files import report_files
from ..results.metrics import NOISE_ULPS, applied_gate, check_thresholds, group_metrics, sampler_floor, with_floor
from ..results.routing import route_flips, routing_table
from ..results.runfolder import Work, run_inputs
from ..results.tables import (COMPARE_SUMMARY_COLUMNS, WORST_COLUMNS, WORST_PER_ADAPTER, CompareResult, no_gates,
                              read_run, table_files)
from .run import Hashed, Plan, Run, Task, Units, run_task

CONTEXT_TOKENS = 12  # tokens of context shown before a worst token
# The adapter applied gate runs at most this many rows / tokens of each adapter again under the base model: a few
# percent of a run of a few hundred rows, a fraction of a percent of a real one.
GATE_ROWS = 8
GATE_TOKENS = 4096


def compare(model: str | Path, adapters: dict[str, str | Path] | None = None,
            references: list | tuple = (), *, out: str | Path | None = None, options: EngineOptions | None = None,
            batch_tokens: int = 4096, max_k2: float | None = 5e-3, max_mean_abs_diff: float | None = None,
            max_k2_over_floor: float | None = None, max_routing_flip_rate: float | None = None,
            temperature: float | None = None, check_adapters: bool = True, quiet: bool = False,
            overwrite: bool = False, engine: Engine | None = None, notice=print) -> CompareResult:
    """Run the engine on every reference sample under the adapter it names; return (and, with `out`, write) the
    summary, per-sample and per-token tables and the gates. `references` holds paths or (adapter name, path) pairs.
    With `out`, the run is a run folder (results/runfolder.py): a complete run of the same inputs there is returned as
    saved, without recomputing; a partial one is resumed; another run there is refused unless `overwrite`. `engine`:
    an engine already built (its adapters replace `adapters`; `model` then supplies config and tokenizer).
    Gates: `check_adapters` fails an adapter that changes nothing (its files, then a sample of its rows run again
    under the base model); `max_k2_over_floor` fails a row whose k2 exceeds that many times the sampler's noise
    floor in the references (off when they carry no sampler logprobs); `max_routing_flip_rate` a row whose routing
    flip rate against the references' routed experts exceeds it (off where they carry none; results/routing.py).
    `temperature`: the sampling temperature of references that record none (inputs/references.py: a framework
    dump that applies one without recording it is refused without it); the logprobs are those of logits / T."""
    task = CompareTask(model, adapters, references, options=options, batch_tokens=batch_tokens, max_k2=max_k2,
                       max_mean_abs_diff=max_mean_abs_diff, max_k2_over_floor=max_k2_over_floor,
                       max_routing_flip_rate=max_routing_flip_rate, temperature=temperature,
                       check_adapters=check_adapters, engine=engine)
    return run_task(task, out, overwrite=overwrite, quiet=quiet, notice=notice)


@dataclass
class CompareTask(Task):
    """compare through the run protocol (tasks/run.py), with the arguments of `compare`. Units: the reference batches,
    then the adapter applied gate's base re-runs."""

    command = "compare"
    model: str | Path
    adapters: dict | None
    references: list | tuple
    options: EngineOptions | None
    batch_tokens: int
    max_k2: float | None
    max_mean_abs_diff: float | None
    max_k2_over_floor: float | None
    max_routing_flip_rate: float | None
    temperature: float | None
    check_adapters: bool
    engine: Engine | None

    def check(self, run: Run) -> dict:
        self.options = (self.options or EngineOptions()).resolved()
        self.adapters = adapter_names(self.adapters if self.engine is None
                                      else {a.name: a.path for a in self.engine.adapters})
        self.max_k2 = threshold(self.max_k2, "--max-k2")
        self.max_mean_abs_diff = threshold(self.max_mean_abs_diff, "--max-mean-abs-diff")
        self.max_k2_over_floor = threshold(self.max_k2_over_floor, "--max-k2-over-floor")
        self.max_routing_flip_rate = threshold(self.max_routing_flip_rate, "--max-routing-flip-rate")
        self.temperature = temperature_option(self.temperature)
        if not isinstance(self.check_adapters, bool):
            raise InputError("check_adapters", f"expected True or False, found {self.check_adapters!r}")
        self.batch_tokens = positive_int(self.batch_tokens, "--batch-tokens")
        if not self.references:
            raise InputError("--reference", "at least one reference dump is needed")
        run.arguments = dict(model=str(self.model), adapters={k: str(v) for k, v in self.adapters.items()},
                             references=[reference_arg(r) for r in self.references], batch_tokens=self.batch_tokens,
                             max_k2=self.max_k2, max_mean_abs_diff=self.max_mean_abs_diff,
                             max_k2_over_floor=self.max_k2_over_floor,
                             max_routing_flip_rate=self.max_routing_flip_rate, temperature=self.temperature,
                             check_adapters=self.check_adapters)
        return run_inputs(self.model, self.adapters, reference=list(self.references))

    def plan(self, run: Run) -> Plan:
        options, phases = self.options, run.phases
        with phases("read"):  # the references, read and checked, and the work planned from their token ids
            self.args = args = model_config(self.model)[1]
            self.refs = refs = _read_references(self.references, self.adapters, args.vocab_size, self.temperature)
            for file, rows in refs.groupby("file", sort=False):  # no sample beyond the model's positions
                check_lengths(rows["input_ids"].map(len), rows["sample_id"], args.max_position_embeddings, file)
            self.routed = check_routes(refs, args)  # per row the sampler's routes [n, MoE layers, k], or None
            self.lengths = [len(ids) for ids in refs["input_ids"]]
            self.use_prefixes = bool(options.prefix_cache) and not options.expert_parallel
            self.prefix, group = sample_prefixes(refs) if self.use_prefixes else ([0] * len(refs), [0] * len(refs))
            self.suffix = [n - p for n, p in zip(self.lengths, self.prefix)]  # tokens a row runs itself
        with phases("load"):  # the adapters' files (the model's follow once the run folder is ours)
            if self.engine is None:  # (the prefix cache's bound counts where samples share prefixes)
                check_fits(self.model, self.adapters, options.device, options.dtype, self.batch_tokens,
                           run.ranks.world if run.ranks and options.expert_parallel else 1,
                           options.prefix_cache_memory if any(self.prefix) else 0)
            self.parsed = None if self.engine is not None else read_adapters(self.model, self.adapters, options)
            self.static = unchanged_adapters(self.parsed if self.engine is None else self.engine.adapters) \
                if self.check_adapters else {}
        with phases("read"):
            self._plan_units(group)
        task_options = dict(options.record(), batch_tokens=self.batch_tokens, max_k2=self.max_k2,
                            max_mean_abs_diff=self.max_mean_abs_diff, max_k2_over_floor=self.max_k2_over_floor,
                            adapter_check=dict(max_rows=GATE_ROWS, max_tokens=GATE_TOKENS, noise_ulps=NOISE_ULPS)
                            if self.check_adapters else None, prefix_cache=self.use_prefixes,
                            engine="given" if self.engine is not None else "loaded")
        # options added since runs were first written: in the fingerprint only when set, so that an older run folder
        # (which predates them) stays the same run and resumes
        task_options.update({k: v for k, v in dict(max_routing_flip_rate=self.max_routing_flip_rate,
                                                   temperature=self.temperature).items() if v is not None})
        return Plan(task_options, phase="read")

    def hashed(self) -> list[Hashed]:
        return [Hashed(self.model, self.adapters, reference_inputs(self.references))]  # (references whole)

    def _plan_units(self, group: list) -> None:
        """The batches, then the adapter applied gate's base re-runs: more units of the same work (resumed and
        shared out alike)."""
        suffix = self.suffix
        if self.use_prefixes:  # groups chunked as the prefix cache holds them (engine/prefixes.grouped_order)
            dtype = DTYPES[self.options.dtype]
            group_bytes = {g: prefix_bytes(self.args, dtype, p) for g, p in zip(group, self.prefix)}
            cache = self.engine.prefix_cache.budget if self.engine is not None else self.options.prefix_cache_memory
            self.batches = batches_in_order(grouped_order(suffix, group, group_bytes, cache), suffix,
                                            self.batch_tokens)
        else:
            self.batches = make_batches(self.lengths, self.batch_tokens)
        self.sampled = gate_sample(self.refs, list(self.adapters)) if self.check_adapters else {}
        self.gate_rows = [i for rows in self.sampled.values() for i in rows]
        self.gate_batches = [[self.gate_rows[j] for j in b]
                             for b in make_batches([suffix[i] for i in self.gate_rows], self.batch_tokens)]
        self.units = self.batches + self.gate_batches
        self.with_routes = [u < len(self.batches) and any(self.routed[i] is not None for i in b)
                            for u, b in enumerate(self.units)]  # such batches record the engine's routes

    def read(self, out: Path) -> CompareResult:
        return read_run(out)

    def load(self, run: Run) -> Units:
        options, refs, lengths = self.options, self.refs, self.lengths
        with run.phases("load"):
            self.engine = self.engine or Engine.load(self.model, self.parsed, options)
        # said once every input (the weights too) is checked: an input error stays the only line on stderr
        for adapter in self.engine.adapters:  # a layout its files cannot tell apart: the gate and k2 decide
            for decision in adapter.decisions:
                if "AMBIGUOUS" in decision:
                    run.notice(f"compare: adapter '{adapter.name}': {decision}")
        if options.prefix_cache and options.expert_parallel:
            run.notice("compare: shared prefixes are off under --expert-parallel (every rank takes part in every "
                       "forward); full samples run")
        self.engine.expect([(len(b), max(lengths[i] for i in b), u < len(self.batches) and any(
            isinstance(a, str) for a in refs["adapter"].iloc[b])) for u, b in enumerate(self.units)
            if not any(self.prefix[i] for i in b)], routes=any(self.with_routes))
        return Units([sum(self.suffix[i] for i in b) for b in self.units], "tok", lockstep=options.expert_parallel)

    def run(self, work: Work, run: Run) -> None:
        work.overlapped(range(len(self.units)), self._start, self._finish)

    def _start(self, u):
        if u is None:
            return self.engine.stand_in()
        rows = self.refs.iloc[self.units[u]]
        tags = [a if isinstance(a, str) and u < len(self.batches) else None for a in rows["adapter"]]
        before = self.engine.tokens_computed
        logprobs = self.engine.start_logprobs(Batch(
            list(rows["input_ids"]), tags, [self.prefix[i] for i in self.units[u]] if self.use_prefixes else None,
            temperatures=list(rows["temperature"]), routes=self.with_routes[u]))
        return logprobs, self.engine.tokens_computed - before

    def _finish(self, u, started) -> pd.DataFrame:
        logprobs, computed = started[0].get(), started[1]
        routes = None
        if self.with_routes[u]:
            logprobs, routes = logprobs
        bad = first_non_finite(logprobs)
        if bad is not None:  # (k2 and the gates would be computed from NaN)
            i = self.units[u][bad]
            adapter = self.refs["adapter"].iloc[i] if u < len(self.batches) else None
            raise overflow_error(self.model, self.adapters, adapter if isinstance(adapter, str) else None,
                                 f"sample {self.refs['sample_id'].iloc[i]}", self.options.dtype)
        n = len(self.units[u])
        frame = pd.DataFrame(dict(sample=self.units[u], logprobs=[lp.numpy() for lp in logprobs],
                                  tokens_computed=np.asarray([computed] + [0] * (n - 1), dtype=np.int64)))  # (row 1)
        if routes is not None:  # per row [n-1, MoE layers] flattened (a unit's frame holds 1-D lists)
            flips = [route_flips(ids.numpy(), w.numpy(), self.routed[i]) if self.routed[i] is not None else None
                     for i, (ids, w) in zip(self.units[u], routes)]
            frame["route_flips"] = [None if f is None else f[0].reshape(-1) for f in flips]
            frame["route_flip_weight"] = [None if f is None else f[1].reshape(-1) for f in flips]
        return frame

    def merge(self, frames: dict[int, pd.DataFrame], run: Run) -> CompareResult:
        refs, lengths, phases = self.refs, self.lengths, run.phases
        with phases("metrics"):
            engine_lp, base_lp = [None] * len(refs), {}  # base_lp: the gate's base re-runs, by sample
            flips, flip_weights = [None] * len(refs), [None] * len(refs)  # [n-1, MoE layers] where routed
            tokens_computed = sum(int(f["tokens_computed"].sum()) for f in frames.values() if "tokens_computed" in f)
            for u, frame in frames.items():
                for j, (i, lp) in enumerate(zip(frame["sample"], frame["logprobs"])):
                    if u < len(self.batches):
                        engine_lp[i] = np.asarray(lp, dtype=np.float32)
                        if self.routed[i] is not None:
                            shape = self.routed[i].shape[:2]
                            flips[i] = np.asarray(frame["route_flips"].iloc[j], dtype=bool).reshape(shape)
                            flip_weights[i] = np.asarray(frame["route_flip_weight"].iloc[j]).reshape(shape)
                    else:
                        base_lp[int(i)] = np.asarray(lp, dtype=np.float32)
            tokens = _token_table(refs, engine_lp, flips, flip_weights)
            routing = routing_table([a if isinstance(a, str) else BASE for a in refs["adapter"]],
                                    [np.asarray(m if m is not None else [True] * len(lp), dtype=bool)
                                     for m, lp in zip(refs["mask"], engine_lp)], flips, flip_weights,
                                    list(self.args.sparse_layers))
            eps = float(torch.finfo(next(self.engine.model.parameters()).dtype).eps)  # of the compute dtype
            summary, gates, floor = self._summary(tokens, engine_lp, base_lp, eps)
            samples = group_metrics(tokens, ["adapter", "sample_id"])
        with phases("load"):  # the tokenizer, for the worst tokens' text alone (only the rank that merges)
            decode = load_decoder(self.model)
        with phases("metrics"):
            worst = worst_tokens(tokens, dict(zip(refs["sample_id"], refs["input_ids"])), decode)
        full = sum(lengths[i] for b in self.units for i in b)
        gate_record = dict(
            adapter_check=dict(max_rows=GATE_ROWS, max_tokens=GATE_TOKENS, noise_ulps=NOISE_ULPS, eps=eps,
                               batches=len(self.gate_batches), rows=len(self.gate_rows),
                               tokens=sum(lengths[i] for i in self.gate_rows)) if self.check_adapters else None,
            k2_over_floor=dict(floor, limit=self.max_k2_over_floor))
        options, ranks, engine = self.options, run.ranks, self.engine
        record = run.record(
            resolved=dict(device=options.device, dtype=options.dtype, ranks=ranks.world if ranks else 1,
                          batch_invariant=options.batch_invariant),
            batches=len(self.batches), padding_waste=padding_waste(self.suffix, self.batches),
            tokens_computed=tokens_computed, tokens_full_prompts=full,
            prefix_cache=dict(enabled=self.use_prefixes, min_shared_tokens=MIN_SHARED_TOKENS,
                              rows_with_prefix=sum(1 for p in self.prefix if p),
                              computed_share=tokens_computed / max(full, 1), this_process=engine.prefix_stats()),
            tokens_per_s=run.work.stats()["computed"] / max(phases.timings()["forward_s"], 1e-9), gates=gate_record,
            quantization=engine.model.args.quantization, tokenizer=str(self.model) if decode else None,
            adapters_read={a.name: a.decisions for a in engine.adapters if a.decisions},
            cuda_graphs=engine.graph_stats())
        return CompareResult(summary=summary, samples=samples, tokens=tokens, worst=worst, run=record, gates=gates,
                             routing=routing)

    def _summary(self, tokens: pd.DataFrame, engine_lp: list, base_lp: dict, eps: float):
        """The summary (per adapter and overall, with the gates' verdicts), the gates table and the sampler floor."""
        per_adapter = group_metrics(tokens, ["adapter"])
        overall = group_metrics(tokens, []).assign(adapter=OVERALL)
        floor = sampler_floor(tokens)
        gates = applied_gate(list(self.adapters), self.static, {a: [(engine_lp[i], base_lp[i]) for i in rows]
                                                                for a, rows in self.sampled.items()}, eps) \
            if self.check_adapters else no_gates()
        summary = check_thresholds(with_floor(pd.concat([per_adapter, overall], ignore_index=True), floor["k2_floor"]),
                                   self.max_k2, self.max_mean_abs_diff, self.max_k2_over_floor, gates,
                                   self.max_routing_flip_rate)
        summary = summary[COMPARE_SUMMARY_COLUMNS + [c for c in summary.columns if c not in COMPARE_SUMMARY_COLUMNS]]
        return summary, gates, floor

    def files(self, result: CompareResult) -> dict[str, bytes]:
        return {**table_files(result), **report_files(result)}


def sample_prefixes(refs: pd.DataFrame, min_shared: int = MIN_SHARED_TOKENS) -> tuple[list[int], list]:
    """Per sample, the shared prefix it names to the engine (Batch.prefixes: the tokens it shares with its group but
    the last, 0 for none) and a sortable group key that keeps a group's samples together. Groups are found among
    the samples of one adapter (a prefix is computed per adapter): prefixes.shared_prefix_lengths."""
    prefix, group = [0] * len(refs), [("",)] * len(refs)
    tags = ["" if not isinstance(a, str) else f"={a}" for a in refs["adapter"]]
    ids = list(refs["input_ids"])
    for tag in sorted(set(tags)):
        members = [i for i, t in enumerate(tags) if t == tag]
        shared = shared_prefix_lengths([list(ids[i]) for i in members], min_shared)
        for i, c in zip(members, shared):
            if c:
                prefix[i] = c - 1
                group[i] = (tag, tuple(ids[i][:c]))
    return prefix, group


# ---- the adapter applied gate -----------------------------------------------------------------------------


def unchanged_adapters(adapters: list[Adapter]) -> dict[str, str]:
    """Adapters whose files already show that they change nothing in this model (name -> why): no LoRA weight of
    theirs applies to a module of it (every key skipped, or an empty weights file), or every LoRA delta
    is zero (lora_B all zero, scaling folded in; or a zero lora_A beside each nonzero B) and they save no module.
    Checked on the factors read before the model loads: cheap."""
    found = {}
    for adapter in adapters:
        experts = [part for factors in adapter.experts.values() for part in (factors.gate_up, factors.down)
                   if part is not None]
        pairs = list(adapter.dense.values()) + list(adapter.embedding.values()) + experts
        if not pairs and not adapter.overrides and not adapter.token_rows:
            skipped = f" ({len(adapter.skipped)} keys for modules this model leaves out)" if adapter.skipped else ""
            found[adapter.name] = f"matched no module of this model: none of its LoRA weights applies{skipped}"
        elif adapter.overrides or adapter.token_rows:
            continue  # modules_to_save copies and trainable tokens may change the model: the logprobs decide
        elif not any(bool(B.any()) for _, B in pairs):
            found[adapter.name] = "every lora_B is zero"
        elif not any(bool(A.any()) and bool(B.any()) for A, B in pairs):
            found[adapter.name] = "every LoRA pair has a zero factor (lora_A or lora_B)"
    return found


def gate_sample(refs: pd.DataFrame, adapters: list[str], max_rows: int = GATE_ROWS,
                max_tokens: int = GATE_TOKENS) -> dict[str, list[int]]:
    """Per adapter, the reference rows (indices) the adapter applied gate runs again under the base model: in the
    order of sha256(sample_id) (fixed by the ids alone, spread over the files), at most `max_rows` rows of at most
    `max_tokens` tokens together; where every row is longer than that, its shortest row alone."""
    ids, tags, lengths = list(refs["sample_id"]), list(refs["adapter"]), [len(x) for x in refs["input_ids"]]
    order = sorted(range(len(refs)), key=lambda i: hashlib.sha256(ids[i].encode()).hexdigest())
    chosen, used = {a: [] for a in adapters}, dict.fromkeys(adapters, 0)
    for i in order:
        adapter, n = tags[i], lengths[i]
        if adapter in chosen and len(chosen[adapter]) < max_rows and used[adapter] + n <= max_tokens:
            chosen[adapter].append(i)
            used[adapter] += n
    for adapter, rows in chosen.items():
        if not rows:
            own = [i for i in order if tags[i] == adapter]
            rows += [min(own, key=lambda i: lengths[i])] if own else []
    return {a: sorted(rows) for a, rows in chosen.items() if rows}


def _read_references(references, adapters: dict, vocab_size: int, temperature: float | None) -> pd.DataFrame:
    frames = []
    for ref in references:
        name, path = ref if isinstance(ref, tuple) else (None, ref)
        frame = read_reference(path, adapter=name, vocab_size=vocab_size, temperature=temperature)
        frame["file"] = str(path)
        unknown = sorted({a for a in frame["adapter"].dropna() if a not in adapters})
        if unknown:
            known = ", ".join(sorted(adapters)) or "none (only the base model)"
            raise InputError(path, f"names adapter '{unknown[0]}', which was not given; known adapters: {known}",
                             key="adapter")
        frames.append(frame)
    refs = pd.concat(frames, ignore_index=True)
    duplicated = refs[refs["sample_id"].duplicated(keep=False)]
    if len(duplicated):
        files = sorted(set(duplicated["file"]))
        raise InputError(", ".join(files), "sample_id appears in more than one reference file",
                         key=f"sample {duplicated['sample_id'].iloc[0]}")
    return refs


def check_routes(refs: pd.DataFrame, args) -> list[np.ndarray | None]:
    """Per reference row the sampler's routes as [n, MoE layers, k] int64 (None where it records none), checked
    against the model (`args`) before it loads: top-k, expert ids, and the layers — one row of routes per MoE layer,
    or one per decoder layer (as vLLM returns them) of which the MoE layers' are kept."""
    column = refs.get("routed_experts")
    if column is None or all(r is None for r in column):
        return [None] * len(refs)
    moe = list(args.sparse_layers)
    routed = []
    for r, file, sample in zip(column, refs["file"], refs["sample_id"]):
        if r is None:
            routed.append(None)
            continue
        where = f"sample {sample}"
        r = np.asarray(r, dtype=np.int64)  # [n, layers, k]
        if not moe:
            raise InputError(file, "carries routed_experts, but the model has no MoE layer", key=where)
        if r.shape[2] != args.top_k:
            raise InputError(file, f"routed_experts holds {r.shape[2]} experts per token; the model routes each "
                             f"token to {args.top_k}", key=where)
        if r.shape[1] == args.num_layers and len(moe) != args.num_layers:
            r = r[:, moe]  # one row per decoder layer: the MoE layers' rows
        elif r.shape[1] != len(moe):
            raise InputError(file, f"routed_experts has {r.shape[1]} layers; the model has {len(moe)} MoE layers "
                             f"(of {args.num_layers}): one row per MoE layer, or per decoder layer, expected",
                             key=where)
        outside = r[(r < 0) | (r >= args.num_experts)]
        if outside.size:
            raise InputError(file, f"routed_experts names expert {int(outside[0])}, outside the model's "
                             f"{args.num_experts} experts", key=where)
        routed.append(r)
    return routed


def _token_table(refs: pd.DataFrame, engine_lp: list, flips: list, flip_weights: list) -> pd.DataFrame:
    """One row per predicted token: adapter, sample_id, position, token_id, ref, engine, mask, d, sampler,
    sampler_d, and where the reference carries routes routing_flip_rate and routing_flip_weight (the share of MoE
    layers whose expert set differs from the sampler's there, and their mean flip weight: results/routing.py; NaN
    elsewhere). Built column by column over all samples at once (a DataFrame per sample cost ~1.4 s per 1M
    tokens)."""
    n = np.array([len(lp) for lp in engine_lp], dtype=np.int64)
    total = int(n.sum())
    starts = np.cumsum(n) - n

    def joined(values, dtype, missing=None) -> np.ndarray:
        """Each sample's values (lists; `missing`: the fill of a sample without them) as one array of `total`: one
        conversion of one list (a conversion per sample costs twice as much)."""
        flat = itertools.chain.from_iterable(v if v is not None else [missing] * k for v, k in zip(values, n))
        return np.array(list(flat), dtype=dtype).reshape(total)

    adapters = np.array([a if isinstance(a, str) else BASE for a in refs["adapter"]], dtype=object)
    ref = joined(refs["logprobs"], np.float64)
    engine = np.concatenate(engine_lp).astype(np.float64) if total else np.empty(0)
    sampler = joined(refs["sampler_logprobs"], np.float64, np.nan)
    table = pd.DataFrame(dict(
        adapter=np.repeat(adapters, n), sample_id=np.repeat(refs["sample_id"].to_numpy(dtype=object), n),
        position=np.arange(total, dtype=np.int64) - np.repeat(starts, n),
        token_id=joined([ids[1:] for ids in refs["input_ids"]], np.int64),
        ref=ref, engine=engine, mask=joined(refs["mask"], bool, True), d=ref - engine,
        sampler=sampler, sampler_d=ref - sampler))
    if any(f is not None for f in flips):
        table["routing_flip_rate"] = joined([None if f is None else f.mean(1) for f in flips], np.float64, np.nan)
        table["routing_flip_weight"] = joined([None if w is None else w.mean(1) for w in flip_weights], np.float64,
                                              np.nan)
    return table


def worst_tokens(tokens: pd.DataFrame, input_ids: dict[str, list[int]], decode=None,
                 per_adapter: int = WORST_PER_ADAPTER, context: int = CONTEXT_TOKENS) -> pd.DataFrame:
    """The `per_adapter` masked tokens with the largest |d| of each adapter, with the decoded token and the
    `context` tokens before it (`decode`: token ids -> text, tokenizer.load_decoder; token ids in brackets
    without one)."""
    masked = tokens[tokens["mask"].astype(bool)].assign(abs_d=lambda t: t["d"].abs())
    rows = []
    for _, group in masked.groupby("adapter", sort=False):
        abs_d = group["abs_d"].to_numpy()
        if 0 < per_adapter < len(abs_d) and not np.isnan(abs_d).any():  # sort only the rows that can make the top
            cut = np.partition(abs_d, len(abs_d) - per_adapter)[len(abs_d) - per_adapter]  # (ties at the cut kept)
            group = group[abs_d >= cut]
        top = group.sort_values(["abs_d", "sample_id", "position"], ascending=[False, True, True],
                                kind="mergesort").head(per_adapter)
        for row in top.itertuples():
            ids = list(input_ids[row.sample_id])
            p = int(row.position)  # predicts ids[p + 1] from ids[:p + 1]
            rows.append(dict(adapter=row.adapter, sample_id=row.sample_id, position=p, token_id=int(row.token_id),
                             token=_decoded(decode, [ids[p + 1]]),
                             context=_decoded(decode, ids[max(0, p + 1 - context):p + 1]),
                             ref=row.ref, engine=row.engine, d=row.d, sampler=row.sampler))
    return pd.DataFrame(rows, columns=WORST_COLUMNS)


def _decoded(decode, ids: list[int]) -> str:
    return "".join(f"[{i}]" for i in ids) if decode is None else decode(ids)
