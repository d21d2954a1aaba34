"""What a reference file holds, as `lora-eval inspect --reference FILE` prints it: the format it was read as (and the
framework source that reader follows), samples, tokens, the sides it carries and the one compared, temperatures and
routes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..inputs.references import read_file, resolve_temperature, validate


def describe_reference(path: str | Path, temperature: float | None = None) -> dict:
    """The description of one reference file (InputError when it cannot be read). `temperature`: as compare's
    --temperature; a file that needs one and has none is described as such, not refused."""
    path = Path(path)
    form, frame = read_file(path)
    frame = validate(frame, path)
    if temperature is not None or not form.temperature_key:
        frame["temperature"] = pd.Series(resolve_temperature(frame, form, temperature, path), index=frame.index,
                                         dtype=object)
    lengths = [len(ids) - 1 for ids in frame["input_ids"]]
    scored = sum(n if m is None else sum(m) for n, m in zip(lengths, frame["mask"]))
    has_sampler = frame["sampler_logprobs"].notna().any()
    sides = ["sampler"] if form.compared == "sampler" else ["trainer"] + (["sampler"] if has_sampler else [])
    adapters = sorted({a for a in frame["adapter"] if a is not None})
    return dict(file=str(path), format=form.name, follows=form.follows, samples=len(frame),
                tokens=sum(lengths) + len(lengths), scored=int(scored), sides=sides, compared=form.compared,
                adapters=adapters if form.adapter_column else None,
                temperature=_temperatures(list(frame["temperature"]), form.temperature_key),
                routes=_routes([r for r in frame["routed_experts"] if r is not None]))


def _temperatures(temps: list, needs: str | None) -> dict:
    recorded = [t for t in temps if t is not None]
    if not recorded:
        return dict(kind="none", needs=needs)  # needs: the run's setting compare's --temperature must give
    values = np.concatenate([np.atleast_1d(np.asarray(t, dtype=np.float64)) for t in recorded])
    kind = "per token" if any(isinstance(t, list) for t in recorded) else "per sample"
    return dict(kind=kind, samples=len(recorded), min=float(values.min()), max=float(values.max()), needs=None)


def _routes(routes: list) -> dict | None:
    if not routes:
        return None
    return dict(samples=len(routes), rows=sum(len(r) for r in routes), layers=int(routes[0].shape[1]),
                top_k=int(routes[0].shape[2]), max_expert=int(max(r.max() for r in routes)))


def describe_lines(d: dict) -> list[str]:
    """The description as the lines `inspect` prints."""
    t = d["temperature"]
    if t["kind"] == "none":
        temperature = (f"not recorded: compare needs --temperature T (the run's {t['needs']})" if t["needs"]
                       else "not recorded: T = 1")
    else:
        spread = f"{t['min']:g}" if t["min"] == t["max"] else f"{t['min']:g} to {t['max']:g}"
        temperature = f"{t['kind']} ({t['samples']} samples), {spread}"
    r = d["routes"]
    routes = "none" if r is None else (f"{r['samples']} samples, {r['rows']} rows x {r['layers']} layers x "
                                       f"top-{r['top_k']} (expert ids up to {r['max_expert']})")
    adapters = ("none in the file: give it as NAME=FILE" if d["adapters"] is None
                else ", ".join(d["adapters"]) or "none (the base model)")
    return [f"reference: {d['file']}",
            f"format: {d['format']} (follows {d['follows']})",
            f"samples: {d['samples']}, tokens: {d['tokens']}, scored tokens: {d['scored']}",
            f"sides: {', '.join(d['sides'])}; compared: {d['compared']}",
            f"adapters: {adapters}",
            f"temperature: {temperature}",
            f"routed experts: {routes}"]
