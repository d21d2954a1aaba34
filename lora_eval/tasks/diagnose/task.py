"""`diagnose`: where, layer by layer, the engine parts from a reference computation of the same samples.

Side A is the engine as `compare` runs it (the same EngineOptions: device, dtype, backend). Its k2 against the
reference picks the samples, then it runs them one row at a time, eagerly, with the probe of engine/forward.py reporting
its intermediates (a CUDA graph replays the very kernels the eager forward launches, so these are the engine's
numbers). Side B is the plain-torch backend of the same checkpoint in float32 with the same adapters; `against_model`
puts another checkpoint of the same architecture there and `against_dtype` another dtype. With `against_model`, side B
runs (`against_adapters`):
  "same"  the same adapters, read and checked against that checkpoint's shapes (a quantized release or another
          revision of the same base): each row is compared with the same row under the same adapter (or base)
  "none"  no adapters: the checkpoint has one adapter merged into its weights, as a server runs it. Exactly one
          adapter must be given, which names the one merged: side A's rows under it are compared with the merged
          model, and rows under base or other adapters are left out — the merged model computes neither, and
          comparing them would report the adapters' own difference as a divergence at the first layer they touch.

Samples: per adapter (and base), the `samples` reference samples with the largest k2 of the engine against the
reference (metrics.token_metrics over the sample's masked tokens, as compare computes it).

Two ways to measure (diagnose.json "measured"):
  free-running                          both sides run whole; errors accumulate from layer to layer
  layer by layer on the same inputs     side B runs one decoder layer at a time (one_layer.py: only that layer's
                                        weights read) on side A's input to that layer: each error is the layer's own
Free-running when both models fit the device by engine/plan.py's estimate, else layer by layer (`layer_by_layer`
forces it).

Per decoder layer and point — attention (the output projection, before the residual add), router (its logits;
router_flip_rate: share of tokens whose top-k expert set differs), moe (the routed experts' output), residual (the
stream after the layer) — rel_error = ‖a - b‖ / ‖b‖ (b: side B) over every position of the adapter's samples, summed
in float64. Per adapter and targeted module: lora_rel_effect = ‖ΔW x‖ / ‖W x‖ on its samples (lora_effect.py).

First divergent layer (per adapter and for base) — two signals, each over the "agreeing" positions, those whose
top-k expert sets have agreed at every MoE layer so far (free-running; layer by layer: at this layer):
    drift[l]      rel_error of the residual stream after layer l over the agreeing positions
    new_flips[l]  share of the positions agreeing before layer l whose top-k set differs at layer l
and layer l is divergent when
    drift[l]     > max(floor, FACTOR x the largest drift of the layers before l), or
    new_flips[l] > max(floor, FACTOR x the largest new_flips of the MoE layers before l),
floor = FLOOR_EPS x eps of the coarser dtype of the two sides (bfloat16 12.5%, float16 1.6%), at least MIN_FLOOR.
Why: rounding noise grows smoothly from layer to layer (measured on bf16 against float32: at most about 4x over one
layer from a small start, a few % over the whole model), and in the first layers it is bounded by the dtype's
precision; a wrong weight, kernel or routing decision is a step of its own, at the layer that makes it, in either
measurement. A position whose routing flipped in a near tie is not: its expert outputs differ outright, so one such
flip among a few dozen positions would step the residual error as a bug does — hence drift leaves flipped positions
out, and flips count apart, once per position, where they first happen (layers.csv keeps every position).

Every unit of work (a batch of the k2 pass; a sample, or a layer layer by layer; a sample's module effects) is a
part of the run folder (the run protocol, tasks/run.py): a killed run resumes, the same run twice recomputes nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...adapters import AdapterStack
from ...adapters.targets import layer_of
from ...engine.batching import make_batches
from ...engine.engine import (DTYPES, Batch, Engine, EngineOptions, current_device, first_non_finite, overflow_error,
                              read_adapters)
from ...engine.forward import Forward
from ...engine.plan import check_fits, host_memory_available, plan
from ...errors import InputError
from ...inputs.checks import adapter_names, model_config, positive_int, temperature_option
from ...inputs.references import read_reference, reference_arg, reference_inputs
from ...models import load_model
from ...names import AGAINST_ADAPTERS, BASE
from ...render.diagnose import diagnose_report_files
from ...results.metrics import token_metrics
from ...results.runfolder import Work, run_inputs
from ...results.tables import (DIAGNOSE_LAYER_COLUMNS, DIAGNOSE_MODULE_COLUMNS, DIAGNOSE_POINTS, DiagnoseResult,
                               diagnose_table_files, read_diagnose)
from ..run import Hashed, Plan, Run, Task, Units, run_task
from .lora_effect import EffectRecorder
from .one_layer import LayerLoader

FREE_RUNNING = "free-running"
LAYER_BY_LAYER = "layer by layer on the same inputs"
FACTOR = 4.0  # a step of more than this over the largest error of the layers before is a divergence
FLOOR_EPS = 16  # errors (and flip rates) under this many units of roundoff of the coarser dtype never count
MIN_FLOOR = 1e-5  # ... nor under this (float32 sums taken in another order differ by about 1e-6)
TOP_EXPERTS = 5  # flipped-in / flipped-out experts listed per layer in diagnose.json
UNIT_COLUMNS = ["kind", "sample", "layer", "name", "num", "den", "count"]  # the rows every unit of work records
POINT_OF = {"attention": "attention", "router_logits": "router", "moe": "moe", "residual": "residual"}


def diagnose(model: str | Path, adapters: dict[str, str | Path] | None = None, references: list | tuple = (), *,
             out: str | Path | None = None, options: EngineOptions | None = None, samples: int = 8,
             against_model: str | Path | None = None, against_dtype: str = "float32", against_adapters: str = "same",
             layer_by_layer: bool = False, batch_tokens: int = 4096, temperature: float | None = None,
             quiet: bool = False, overwrite: bool = False, notice=print) -> DiagnoseResult:
    """Compare the engine (side A) with a reference computation (side B) layer by layer on the reference samples it
    gets most wrong; return (and, with `out`, write as a run folder) the per-layer errors, the adapters' per-module
    effects and the first divergent layer per adapter. `references` holds paths or (adapter name, path) pairs, as
    for `compare`; `against_adapters` ("same" or "none"): whether side B runs the adapters; see the module notes for
    the sides, the samples and the rule. `temperature`: as compare's (the k2 that picks the samples is taken at the
    references' temperatures)."""
    task = DiagnoseTask(model, adapters, references, options=options, samples=samples, against_model=against_model,
                        against_dtype=against_dtype, against_adapters=against_adapters, layer_by_layer=layer_by_layer,
                        batch_tokens=batch_tokens, temperature=temperature)
    return run_task(task, out, overwrite=overwrite, quiet=quiet, notice=notice)


@dataclass
class DiagnoseTask(Task):
    """diagnose through the run protocol (tasks/run.py), in one process, with the arguments of `diagnose`. Units: the
    k2 pass's batches, then the comparisons (a sample free-running, or a layer layer by layer), then the chosen
    adapter samples' module effects."""

    command = "diagnose"
    distributed = False
    model: str | Path
    adapters: dict | None
    references: list | tuple
    options: EngineOptions | None
    samples: int
    against_model: str | Path | None
    against_dtype: str
    against_adapters: str
    layer_by_layer: bool
    batch_tokens: int
    temperature: float | None = None

    def check(self, run: Run) -> dict:
        self.options = options = (self.options or EngineOptions()).resolved()
        if options.expert_parallel or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise InputError("WORLD_SIZE", "diagnose runs in one process: run it without lora-eval launch (or "
                             "torchrun) and expert parallel")
        self.adapters = adapter_names(self.adapters)
        self.samples = positive_int(self.samples, "--samples")
        self.batch_tokens = positive_int(self.batch_tokens, "--batch-tokens")
        self.temperature = temperature_option(self.temperature)
        self.side_b = SideB.checked(self.model, self.against_model, self.against_dtype, self.against_adapters,
                                    self.adapters)
        if not self.references:
            raise InputError("--reference", "at least one reference dump is needed")
        run.arguments = dict(model=str(self.model), adapters={k: str(v) for k, v in self.adapters.items()},
                             references=[reference_arg(r) for r in self.references], samples=self.samples,
                             against_model=None if self.against_model is None else str(self.against_model),
                             against_dtype=self.against_dtype, against_adapters=self.against_adapters,
                             layer_by_layer=self.layer_by_layer, batch_tokens=self.batch_tokens,
                             temperature=self.temperature)
        return run_inputs(self.model, self.adapters, reference=list(self.references),
                          against_model=self.against_model)

    def plan(self, run: Run) -> Plan:
        model, adapters, options, side_b = self.model, self.adapters, self.options, self.side_b
        self.args = model_config(model)[1]
        if side_b.against:
            _check_against(self.args, self.against_model)
        with run.phases("read"):
            self.refs, self.left_out = _read_references(self.references, adapters, self.args.vocab_size,
                                                        side_b.merged, self.temperature)
            self.lengths = [len(ids) for ids in self.refs["input_ids"]]
            self.batches = make_batches(self.lengths, self.batch_tokens)
        self.tags = [a if isinstance(a, str) else BASE for a in self.refs["adapter"]]
        # reports list base first, then the adapters as given; against a merged checkpoint its adapter alone
        self.order = [side_b.merged] if side_b.merged else [BASE, *adapters]
        self.measured, self.why = _measurement(model, adapters, side_b, options, max(self.lengths),
                                               self.layer_by_layer, self.batch_tokens)
        with run.phases("load"):  # the adapters' files (the models' load with their first use)
            self.parsed = read_adapters(model, adapters, options)
            self.parsed_b = side_b.read_adapters(self.parsed, adapters, options)
            self.quantization = load_model(model, device="meta").args.quantization
        self.floor = noise_floor(options.dtype, self.against_dtype)
        self.rule = dict(factor=FACTOR, floor=self.floor, floor_eps=FLOOR_EPS, min_floor=MIN_FLOOR)
        task_options = dict(options.record(), samples=self.samples, against_dtype=self.against_dtype,
                            against_adapters=self.against_adapters, measured=self.measured,
                            batch_tokens=self.batch_tokens, rule=self.rule)
        if self.temperature is not None:  # (only when set: an older run's fingerprint predates the option)
            task_options["temperature"] = self.temperature
        return Plan(task_options)

    def hashed(self) -> list[Hashed]:
        return [Hashed(self.model, self.adapters, reference_inputs(self.references))] + \
            ([Hashed(self.against_model, prefix="against-")] if self.side_b.against else [])

    def read(self, out: Path) -> DiagnoseResult:
        return read_diagnose(out)

    def load(self, run: Run) -> Units:
        """The sides load with their first use; the units: the k2 batches, the comparisons, the module effects."""
        self.sides = _Sides(self.model, self.parsed, self.options, self.side_b, self.parsed_b)
        n_chosen = sum(min(self.samples, self.tags.count(tag)) for tag in self.order)
        n_adapter = sum(min(self.samples, self.tags.count(tag)) for tag in self.order if tag != BASE)
        self.k2_units = list(range(len(self.batches)))
        start = len(self.k2_units)
        self.compare_units = list(range(start, start + (n_chosen if self.measured == FREE_RUNNING
                                                        else self.args.num_layers)))
        start += len(self.compare_units)
        self.effect_units = list(range(start, start + n_adapter))
        longest = max(self.lengths)
        weights = [sum(self.lengths[i] for i in b) for b in self.batches] + \
            [2 * longest] * len(self.compare_units) + [longest] * len(self.effect_units)  # tokens, for the bar
        return Units(weights, "tok", phase=None)

    def run(self, work: Work, run: Run) -> None:
        sides, refs, phases = self.sides, self.refs, run.phases
        with phases("k2"):  # (side A loads with its first batch)
            for b in work.steps(self.k2_units):
                work.record(b, self._k2_unit(b))
        chosen = _choose({u: work.done[u] for u in self.k2_units}, self.tags, self.order, self.samples)
        with phases("compare"), current_device(self.options.device):  # (these run the models' layers directly)
            for u in work.steps(self.compare_units):
                if self.measured == FREE_RUNNING:
                    i = chosen[u - self.compare_units[0]]
                    work.record(u, _free_running(sides, i, refs["input_ids"][i], _adapter(refs["adapter"][i])))
                else:
                    work.record(u, _one_layer(sides, u - self.compare_units[0], chosen, refs))
        with phases("effects"), current_device(self.options.device):
            with_adapter = [i for i in chosen if self.tags[i] != BASE]
            for u in work.steps(self.effect_units):
                i = with_adapter[u - self.effect_units[0]]
                work.record(u, _effects(sides, i, refs["input_ids"][i], self.tags[i]))
        sides.release()

    def _k2_unit(self, b: int) -> pd.DataFrame:
        rows = self.refs.iloc[self.batches[b]]
        logprobs = self.sides.a.logprobs(Batch(list(rows["input_ids"]), [_adapter(t) for t in rows["adapter"]],
                                               temperatures=list(rows["temperature"])))
        bad = first_non_finite(logprobs)
        if bad is not None:  # (k2 would pick the samples from NaN)
            raise overflow_error(self.model, self.adapters, _adapter(rows["adapter"].iloc[bad]),
                                 f"sample {rows['sample_id'].iloc[bad]}", self.options.dtype)
        return _k2_rows(rows, self.batches[b], logprobs)

    def merge(self, frames: dict[int, pd.DataFrame], run: Run) -> DiagnoseResult:
        tags, order, floor, options = self.tags, self.order, self.floor, self.options
        with run.phases("metrics"):
            units = pd.concat([frames[u] for u in sorted(frames)], ignore_index=True)
            chosen = _choose({u: frames[u] for u in self.k2_units}, tags, order, self.samples)
            sample_tag = {i: tags[i] for i in chosen}
            layers = layer_table(units[units["kind"].isin(["error", "flip"])], sample_tag, order)
            modules = module_table(units[units["kind"] == "module"], sample_tag, order)
            record = dict(
                measured=self.measured, why=self.why, points=DIAGNOSE_POINTS, side_a=_side_a(self.model, options),
                side_b=self.side_b.record(options, self.left_out),
                rule=dict(self.rule, text=RULE_TEXT.format(factor=FACTOR, floor=floor)),
                adapters={tag: _adapter_record(tag, layers, units, self.refs, chosen, tags, self.measured, floor)
                          for tag in order})
        run_record = run.record(resolved=dict(device=options.device, dtype=options.dtype,
                                              batch_invariant=options.batch_invariant,
                                              against_dtype=self.against_dtype,
                                              against_adapters=self.against_adapters, measured=self.measured),
                                samples=len(chosen), quantization=self.quantization)
        return DiagnoseResult(layers=layers, modules=modules, record=record, run=run_record)

    def files(self, result: DiagnoseResult) -> dict[str, bytes]:
        return {**diagnose_table_files(result), **diagnose_report_files(result)}


RULE_TEXT = ("layer l is divergent when its drift (the residual stream's rel_error over the positions whose top-k "
             "expert sets agreed at every MoE layer so far) exceeds max(floor, {factor:g} x the largest drift of the "
             "layers before it), or its new router flips (the share of those positions whose top-k set differs first "
             "at l) exceed max(floor, {factor:g} x the largest of the MoE layers before it); floor = {floor:.3g}")


def noise_floor(*dtypes: str) -> float:
    """Errors and flip rates under this never count: FLOOR_EPS units of roundoff of the coarsest dtype, at least
    MIN_FLOOR."""
    return max(FLOOR_EPS * max(torch.finfo(DTYPES[d]).eps for d in dtypes), MIN_FLOOR)


def first_divergence(drift: dict[int, float], new_flips: dict[int, float], floor: float,
                     factor: float = FACTOR) -> dict | None:
    """The first layer whose drift or new router flips leave the band of the layers before it (see the module
    notes): {layer, trigger ("drift" or "new_flips"), value, band}, or None. `drift`: layer -> rel_error of the
    residual stream over the agreeing positions; `new_flips`: MoE layer -> share of the agreeing positions whose top-k
    set differs first there."""
    worst = dict(drift=0.0, new_flips=0.0)
    for layer in sorted(drift):
        values = dict(drift=drift[layer], new_flips=new_flips.get(layer))
        for trigger, value in values.items():
            band = max(floor, factor * worst[trigger])
            if value is not None and value > band:
                return dict(layer=layer, trigger=trigger, value=value, band=band)
        worst = {k: max(worst[k], values[k] or 0.0) for k in worst}
    return None


# ---- the two sides --------------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by a probe to end a forward once the layer it wanted has been seen."""


@dataclass(frozen=True)
class SideB:
    """What side B runs, as one object: the checkpoint `model` (--against-model when `against`, else --model's) in
    `dtype` on the plain-torch backend, with side A's adapters (`adapters` "same") or none ("none": `merged`, the one
    adapter given, is merged into the checkpoint's weights)."""

    model: str
    dtype: str
    adapters: str
    against: bool
    merged: str | None = None

    @classmethod
    def checked(cls, model, against_model, against_dtype: str, against_adapters: str, adapters: dict) -> "SideB":
        """diagnose's side B arguments checked before anything is read (InputError naming the option); `adapters`:
        side A's, {name: folder}."""
        if against_dtype not in DTYPES:
            raise InputError("--against-dtype", f"'{against_dtype}' is not one of {', '.join(DTYPES)}")
        if against_adapters not in AGAINST_ADAPTERS:
            raise InputError("--against-adapters",
                             f"'{against_adapters}' is not one of {', '.join(AGAINST_ADAPTERS)}")
        merged = None
        if against_adapters == "none":
            if against_model is None:
                raise InputError("--against-adapters", "'none' runs side B without adapters, as a checkpoint with "
                                 "an adapter merged into its weights: it needs --against-model (that checkpoint)")
            # a merged checkpoint holds one adapter: the one --adapter given names it, and nothing else compares
            if len(adapters) != 1:
                given = ", ".join(adapters) or "none"
                raise InputError("--against-adapters", f"'none' compares with a checkpoint that has one adapter "
                                 f"merged into its weights: give exactly that one --adapter (given: {given})")
            merged = next(iter(adapters))
        return cls(model=str(against_model if against_model is not None else model), dtype=against_dtype,
                   adapters=against_adapters, against=against_model is not None, merged=merged)

    def read_adapters(self, parsed: list, adapters: dict, options: EngineOptions) -> list:
        """Side B's adapters: side A's (`parsed` from `adapters`) on side A's checkpoint; on --against-model read
        again, checked against its shapes (no weight loaded); none against a merged checkpoint."""
        if self.adapters == "none":
            return []
        if not self.against:
            return parsed
        try:
            return read_adapters(self.model, adapters, options)
        except InputError as e:  # the adapter's file and key, and which checkpoint it does not fit
            raise type(e)(e.where, f"{e.problem}, on --against-model {self.model} (where side B runs the same "
                          "adapters: --against-adapters same)", key=e.key) from None

    def record(self, options: EngineOptions, left_out: int) -> dict:
        """diagnose.json's side_b: the checkpoint, dtype and which adapters ran (`left_out`: reference rows not
        compared)."""
        if self.adapters == "none":
            note = (f"without adapters: a checkpoint with adapter '{self.merged}' merged into its weights "
                    f"(--against-adapters none); '{self.merged}' rows are compared with it, rows under base or any "
                    f"other adapter are not ({left_out} left out)")
        else:
            note = "with the same adapters as side A" + (", read against this checkpoint (--against-adapters same)"
                                                         if self.against else "")
        return dict(model=self.model, device=options.device, dtype=self.dtype, backend="torch",
                    adapters=self.adapters, merged_adapter=self.merged, note=note)


class _Sides:
    """Side A (the engine) and side B (the reference computation), each loaded on first use."""

    def __init__(self, model, parsed, options: EngineOptions, side_b: SideB, parsed_b: list):
        self.model, self.parsed, self.options = model, parsed, options
        self.side_b, self.parsed_b = side_b, parsed_b  # side B's settings and adapters (SideB.read_adapters)
        self._a = self._b = self._layers = None

    @property
    def a(self) -> Engine:
        if self._a is None:
            self._a = Engine.load(self.model, self.parsed, self.options)
        return self._a

    @property
    def b(self) -> Engine:
        """Side B whole (free-running): the plain-torch engine of its checkpoint in its dtype."""
        if self._b is None:
            options = replace(self.options, dtype=self.side_b.dtype, backend="torch", cuda_graphs=False)
            self._b = Engine.load(self.side_b.model, self.parsed_b, options)
        return self._b

    @property
    def layers(self) -> LayerLoader:
        """Side B one decoder layer at a time."""
        if self._layers is None:
            self._layers = LayerLoader(self.side_b.model, DTYPES[self.side_b.dtype], self.options.device)
        return self._layers

    def layer_adapters(self, sites: set[str]):
        """Side B's adapters for one layer (their factors at `sites` only), or None (it runs none)."""
        if not self.parsed_b:
            return None
        return [replace(a, dense={s: f for s, f in a.dense.items() if s in sites},
                        experts={s: f for s, f in a.experts.items() if s in sites}, embedding={},
                        overrides={s: f for s, f in a.overrides.items() if s in sites}) for a in self.parsed_b]

    def release(self) -> None:
        self._a = self._b = self._layers = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _row_forward(backend: str, stack, names: list[str], adapter: str | None, n: int, device, probe,
                 invariant: bool = False) -> Forward:
    """The Forward of one row of n positions under `adapter` (None, or one the side does not hold: base), probed
    (`invariant`: the engine's batch-invariant mode, Forward's)."""
    slot = names.index(adapter) if stack is not None and adapter in names else -1
    slots = torch.full((n,), slot, dtype=torch.long, device=device) if slot >= 0 else None
    fwd = Forward(backend, [n], stack if slot >= 0 else None, slots, invariant=invariant)
    fwd.probe = probe
    return fwd


def _run_engine(engine: Engine, ids: list[int], adapter: str | None, probe) -> None:
    """One row through an engine's model with `probe` on its intermediates (a probe may stop it with _Stop)."""
    device = engine.model.inv_freq.device
    fwd = _row_forward(engine.backend, engine.stack, engine.adapter_names, adapter, len(ids), device, probe,
                       engine.batch_invariant)
    try:
        with torch.inference_mode():
            engine.model(torch.tensor([ids], device=device), fwd)
    except _Stop:
        pass


def _capture(layer: int | None = None):
    """(what it saw, a probe keeping every point — or only layer `layer`'s, stopping the forward after it — on the
    CPU)."""
    seen = {}

    def probe(index, point, tensor):
        if layer is None or index == layer:
            seen[(index, point)] = tensor.detach().to("cpu", copy=True)
            if index == layer and point == "residual":
                raise _Stop

    return seen, probe


def _comparer(a: dict, sample: int, rows: list, layer: int | None = None):
    """A probe for side B that compares each point it sees with side A's (`a`), adding unit rows to `rows`: the
    error of every point over all positions; router flips; and for the rule, over the positions whose top-k sets
    have agreed at every MoE layer so far ("agreeing"), the residual error ("drift") and the first flips."""
    agreeing = None  # [T] bool, from the first router on

    def probe(index, point, tensor):
        nonlocal agreeing
        if (layer is not None and index != layer) or point == "input" or (index, point) not in a:
            return  # (a point only side B has: nothing to compare it with)
        engine = a[(index, point)]
        if point == "router_topk":
            flipped = _flips(sample, index, engine, tensor.detach().cpu(), rows)  # [T]
            agreeing = torch.ones_like(flipped) if agreeing is None else agreeing
            rows.append(dict(kind="new_flip", sample=sample, layer=index, name="router",
                             num=float((flipped & agreeing).sum()), den=0.0, count=int(agreeing.sum())))
            agreeing = agreeing & ~flipped
            return
        reference = tensor.detach().cpu().double()  # [T, ...]
        diff = engine.double() - reference  # [T, ...]
        rows.append(dict(kind="error", sample=sample, layer=index, name=POINT_OF[point],
                         num=float(diff.square().sum()), den=float(reference.square().sum()),
                         count=reference.shape[0]))
        if point == "residual":
            keep = agreeing if agreeing is not None else torch.ones(diff.shape[0], dtype=torch.bool)  # [T]
            rows.append(dict(kind="drift", sample=sample, layer=index, name="residual",
                             num=float(diff[keep].square().sum()), den=float(reference[keep].square().sum()),
                             count=int(keep.sum())))

    return probe


def _flips(sample: int, layer: int, engine_ids: torch.Tensor, reference_ids: torch.Tensor, rows: list) -> torch.Tensor:
    """Router flips of one layer: which tokens' top-k set differs [T] (returned), their count and, per expert, how
    often it was flipped in (chosen by the engine, not by side B) or out (chosen by side B, not by the engine),
    added to `rows`."""
    T = engine_ids.shape[0]
    E = int(max(engine_ids.max(), reference_ids.max())) + 1 if T else 1
    chosen_a = torch.zeros(T, E, dtype=torch.bool).scatter_(1, engine_ids.long(), True)  # [T, E]
    chosen_b = torch.zeros(T, E, dtype=torch.bool).scatter_(1, reference_ids.long(), True)  # [T, E]
    flipped = (chosen_a != chosen_b).any(dim=1)  # [T]
    rows.append(dict(kind="flip", sample=sample, layer=layer, name="router", num=float(flipped.sum()), den=0.0,
                     count=T))
    for kind, counts in (("flip_in", (chosen_a & ~chosen_b).sum(0)), ("flip_out", (chosen_b & ~chosen_a).sum(0))):
        rows += [dict(kind=kind, sample=sample, layer=layer, name=str(e), num=float(c), den=0.0, count=T)
                 for e, c in enumerate(counts.tolist()) if c]
    return flipped


def _free_running(sides: _Sides, sample: int, ids: list[int], adapter: str | None) -> pd.DataFrame:
    """One sample through both sides whole; its rows of every layer and point."""
    seen, probe = _capture()
    _run_engine(sides.a, list(ids), adapter, probe)
    rows = []
    _run_engine(sides.b, list(ids), adapter, _comparer(seen, sample, rows))  # (without adapters: as base)
    return _frame(rows)


def _one_layer(sides: _Sides, layer: int, chosen: list[int], refs: pd.DataFrame) -> pd.DataFrame:
    """One decoder layer of side B (only its weights loaded), on side A's input to it, for every chosen sample."""
    one = sides.layers.load(layer)
    loaded = sides.layer_adapters(one.sites)
    stack = AdapterStack(loaded, one.model) if loaded else None
    names = [a.name for a in loaded] if loaded else []
    device = one.model.inv_freq.device
    dtype = DTYPES[sides.side_b.dtype]
    rows = []
    for i in chosen:
        ids, adapter = list(refs["input_ids"][i]), _adapter(refs["adapter"][i])
        seen, probe = _capture(layer)
        _run_engine(sides.a, ids, adapter, probe)
        fwd = _row_forward("torch", stack, names, adapter, len(ids), device, _comparer(seen, i, rows, layer))
        one.run(seen[(layer, "input")].to(device=device, dtype=dtype), fwd)
    return _frame(rows)


def _effects(sides: _Sides, sample: int, ids: list[int], adapter: str) -> pd.DataFrame:
    """‖ΔW x‖² and ‖W x‖² of every module the sample's adapter targets, on side A's model (lora_effect.py)."""
    engine = sides.a
    device = engine.model.inv_freq.device
    slot = engine.adapter_names.index(adapter)
    recorder = EffectRecorder(engine.stack, slot, engine.adapters[slot], len(ids), device)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor([ids], device=device), recorder)  # [T, H]
        recorder.head(engine.model.lm_head, hidden)
    return _frame([dict(kind="module", sample=sample, layer=_layer_of(site), name=site, num=num, den=den,
                        count=count) for site, (num, den, count) in sorted(recorder.sums.items())])


# ---- the tables -----------------------------------------------------------------------------------------


def layer_table(units: pd.DataFrame, sample_tag: dict[int, str], order: list[str]) -> pd.DataFrame:
    """layers.csv from the units' error and flip rows: per adapter (base first), layer and point, rel_error =
    sqrt(Σ‖a - b‖² / Σ‖b‖²) over the adapter's samples, and router_flip_rate on the router rows."""
    units = units.assign(adapter=units["sample"].map(sample_tag))
    errors = units[units["kind"] == "error"].groupby(["adapter", "layer", "name"])[["num", "den"]].sum()
    flips = units[units["kind"] == "flip"].groupby(["adapter", "layer"])[["num", "count"]].sum()
    rows = []
    for adapter in order:
        if adapter not in errors.index.get_level_values(0):
            continue
        part = errors.loc[adapter]
        for layer in sorted(part.index.get_level_values(0).unique()):
            for point in DIAGNOSE_POINTS:
                if (layer, point) not in part.index:
                    continue
                num, den = part.loc[(layer, point)]
                flip = flips.loc[(adapter, layer)] if point == "router" and (adapter, layer) in flips.index else None
                rows.append(dict(adapter=adapter, layer=int(layer), point=point, rel_error=_ratio(num, den),
                                 router_flip_rate=float(flip["num"] / flip["count"]) if flip is not None else np.nan))
    return pd.DataFrame(rows, columns=DIAGNOSE_LAYER_COLUMNS)


def module_table(units: pd.DataFrame, sample_tag: dict[int, str], order: list[str]) -> pd.DataFrame:
    """modules.csv: per adapter and module it targets, lora_rel_effect = sqrt(Σ‖ΔW x‖² / Σ‖W x‖²) on its samples;
    `module` is the site without its layer's prefix, `layer` empty outside the decoder layers."""
    units = units.assign(adapter=units["sample"].map(sample_tag))
    sums = units.groupby(["adapter", "name"])[["num", "den"]].sum()
    rows = []
    for adapter in order:
        if adapter not in sums.index.get_level_values(0):
            continue
        for site, (num, den) in sums.loc[adapter].iterrows():
            layer = _layer_of(site)
            rows.append(dict(adapter=adapter, layer=layer if layer >= 0 else None,
                             module=site.split(f"layers.{layer}.", 1)[1] if layer >= 0 else site,
                             lora_rel_effect=_ratio(num, den)))
    frame = pd.DataFrame(rows, columns=DIAGNOSE_MODULE_COLUMNS)
    frame["layer"] = frame["layer"].astype("Int64")
    rank = {a: i for i, a in enumerate(order)}
    return frame.sort_values(["adapter", "layer", "module"], key=lambda c: c.map(rank) if c.name == "adapter" else c,
                             na_position="last", kind="mergesort").reset_index(drop=True)


def _side_a(model, options: EngineOptions) -> dict:
    return dict(model=str(model), device=options.device, dtype=options.dtype, backend=options.record()["backend"],
                adapters="applied", note="run eagerly with a probe on its intermediates: a CUDA graph replays the "
                "very kernels the eager forward launches")


def _adapter_record(tag: str, layers: pd.DataFrame, units: pd.DataFrame, refs: pd.DataFrame, chosen: list[int],
                    tags: list[str], measured: str, floor: float) -> dict:
    """diagnose.json's entry of one adapter (or base)."""
    picked = [i for i in chosen if tags[i] == tag]
    if not picked:
        return dict(first_divergent_layer=None, measured=measured, trigger=None, samples=[],
                    note="no reference sample runs under it")
    theirs = units[units["sample"].isin(picked)]
    drift = _series(theirs, "drift", lambda n, d, c: _ratio(n, d))
    new_flips = _series(theirs, "new_flip", lambda n, d, c: n / c if c else 0.0)
    found = first_divergence(drift, new_flips, floor)
    mine = layers[layers["adapter"] == tag]
    flip_rates = {int(r.layer): float(r.router_flip_rate) for r in mine[mine["point"] == "router"].itertuples()}
    k2 = units[units["kind"] == "k2"].set_index("sample")["num"]
    flips = []
    for layer, rate in sorted(flip_rates.items()):
        if rate > 0:
            part = theirs[theirs["layer"] == layer]
            flips.append(dict(layer=layer, flip_rate=rate, flipped_in=_top_experts(part, "flip_in"),
                              flipped_out=_top_experts(part, "flip_out")))
    return dict(first_divergent_layer=None if found is None else found["layer"], measured=measured, trigger=found,
                samples=[dict(sample_id=str(refs["sample_id"][i]), k2=_number(k2.get(i)),
                              tokens=len(refs["input_ids"][i])) for i in picked],
                drift={str(k): v for k, v in drift.items()}, new_flips={str(k): v for k, v in new_flips.items()},
                router_flips=flips)


def _series(units: pd.DataFrame, kind: str, value) -> dict[int, float]:
    """layer -> value(Σnum, Σden, Σcount) of the units' rows of `kind`."""
    sums = units[units["kind"] == kind].groupby("layer")[["num", "den", "count"]].sum()
    return {int(layer): float(value(row["num"], row["den"], row["count"])) for layer, row in sums.iterrows()}


def _top_experts(rows: pd.DataFrame, kind: str) -> list[list[int]]:
    """[[expert id, times], ...]: the TOP_EXPERTS most frequent, most frequent first (ties by id)."""
    counts = rows[rows["kind"] == kind].groupby("name")["num"].sum()
    ranked = sorted(((int(e), int(c)) for e, c in counts.items()), key=lambda ec: (-ec[1], ec[0]))
    return [list(ec) for ec in ranked[:TOP_EXPERTS]]


# ---- choosing samples -----------------------------------------------------------------------------------


def _k2_rows(rows: pd.DataFrame, indices: list[int], logprobs: list[torch.Tensor]) -> pd.DataFrame:
    """Per sample of a batch, k2 of the engine against the reference over its masked tokens (metrics.py)."""
    found = []
    for i, row, lp in zip(indices, rows.itertuples(), logprobs):
        d = np.asarray(row.logprobs, dtype=np.float64) - lp.numpy().astype(np.float64)
        mask = np.asarray(row.mask, dtype=bool) if row.mask is not None else np.ones(len(d), dtype=bool)
        found.append(dict(kind="k2", sample=i, layer=-1, name="k2", num=token_metrics(d[mask])["k2"], den=0.0,
                          count=int(mask.sum())))
    return _frame(found)


def _choose(k2_frames: dict[int, pd.DataFrame], tags: list[str], order: list[str], per_tag: int) -> list[int]:
    """Per adapter in `order`, the `per_tag` samples with the largest k2 (NaN last, ties by position in the
    references): sample indices, adapter by adapter, largest k2 first."""
    k2 = pd.concat(k2_frames.values()).set_index("sample")["num"] if k2_frames else pd.Series(dtype=float)
    chosen = []
    for tag in order:
        mine = [i for i in range(len(tags)) if tags[i] == tag]
        ranked = sorted(mine, key=lambda i: (-k2[i] if not math.isnan(k2[i]) else math.inf, i))
        chosen += ranked[:per_tag]
    return chosen


# ---- inputs ---------------------------------------------------------------------------------------------


def _measurement(model, adapters: dict, side_b: SideB, options: EngineOptions, tokens: int, forced: bool,
                 batch_tokens: int) -> tuple[str, str]:
    """(how to measure, why): free-running when the engine and side B fit the device together by plan.py's
    estimate, else layer by layer (side A alone must fit: refused otherwise, as compare refuses it)."""
    if forced:
        check_fits(model, adapters, options.device, options.dtype, batch_tokens)
        return LAYER_BY_LAYER, "asked for (--layer-by-layer)"
    on_gpu = options.device.startswith("cuda")
    _, a = plan(model, adapters, batch_tokens=max(batch_tokens, tokens), dtype=options.dtype,
                cuda_graphs=on_gpu and options.cuda_graphs)
    _, b = plan(side_b.model, adapters if side_b.adapters == "same" else {}, batch_tokens=tokens, dtype=side_b.dtype,
                cuda_graphs=False)
    need = float(a.iloc[0]["per_gpu_gb"] + b.iloc[0]["per_gpu_gb"])
    free = (torch.cuda.mem_get_info(torch.device(options.device))[0] if on_gpu else host_memory_available()) / 1e9
    where = f"{free:.1f} GB free on {options.device}" if on_gpu else f"{free:.1f} GB of host memory available"
    if need <= free:
        return FREE_RUNNING, f"both sides fit: about {need:.1f} GB, {where}"
    check_fits(model, adapters, options.device, options.dtype, batch_tokens)
    return LAYER_BY_LAYER, f"both sides together would need about {need:.1f} GB, {where}"


def _check_against(args, against_model) -> None:
    """The --against-model checkpoint must have the engine model's layers and sizes."""
    config, theirs = model_config(against_model)
    where = Path(against_model) / "config.json"
    for key, field in (("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                       ("vocab_size", "vocab_size"), ("num_experts", "num_experts")):
        if getattr(theirs, field) != getattr(args, field):
            raise InputError(where, f"{getattr(theirs, field)}, but the --model checkpoint has "
                             f"{getattr(args, field)}: side B must be the same architecture", key=key)


def _read_references(references, adapters: dict, vocab_size: int, merged: str | None = None,
                     temperature: float | None = None) -> tuple[pd.DataFrame, int]:
    """Every reference dump, checked (as compare checks them): adapters it names must be given, sample ids unique;
    and how many rows were left out. With `merged` (SideB.merged), only the rows under that adapter: the others are
    left out, not refused, so that one dump of several adapters serves each one's merged checkpoint."""
    frames = []
    for ref in references:
        name, path = ref if isinstance(ref, tuple) else (None, ref)
        frame = read_reference(path, adapter=name, vocab_size=vocab_size, temperature=temperature)
        unknown = sorted({a for a in frame["adapter"].dropna() if a not in adapters})
        if unknown and merged is None:
            known = ", ".join(sorted(adapters)) or "none (only the base model)"
            raise InputError(path, f"names adapter '{unknown[0]}', which was not given; known adapters: {known}",
                             key="adapter")
        frames.append(frame.assign(file=str(path)))
    refs = pd.concat(frames, ignore_index=True)
    duplicated = refs[refs["sample_id"].duplicated(keep=False)]
    if len(duplicated):
        raise InputError(", ".join(sorted(set(duplicated["file"]))), "sample_id appears more than once",
                         key=f"sample {duplicated['sample_id'].iloc[0]}")
    if merged is None:
        return refs, 0
    kept = refs[refs["adapter"] == merged].reset_index(drop=True)
    if not len(kept):
        found = ", ".join(sorted({a if isinstance(a, str) else BASE for a in refs["adapter"]}))
        raise InputError(", ".join(sorted(set(refs["file"]))), f"no sample runs under adapter '{merged}', the one "
                         f"merged into --against-model (--against-adapters none); the dumps name: {found}",
                         key="adapter")
    return kept, len(refs) - len(kept)


# ---- small helpers --------------------------------------------------------------------------------------


def _frame(rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=UNIT_COLUMNS)
    return frame.astype(dict(kind=str, sample="int64", layer="int64", name=str, num="float64", den="float64",
                             count="int64"))


def _layer_of(site: str) -> int:
    """The decoder layer of a module site, -1 outside the layers (embeddings, lm_head)."""
    layer = layer_of(site)
    return -1 if layer is None else layer


def _ratio(num: float, den: float) -> float:
    """sqrt(num / den): 0 where both are 0, inf where only den is."""
    if den > 0:
        return math.sqrt(num / den)
    return 0.0 if num == 0 else math.inf


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _adapter(tag) -> str | None:
    return tag if isinstance(tag, str) else None
