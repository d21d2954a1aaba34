"""diagnose.md, diagnose.html and the terminal summary of a diagnose run, from a DiagnoseResult (fresh, or read back
with results.tables.read_diagnose). The HTML page is self-contained (figures as inline SVG) and deterministic: no clock
time, figures that are functions of the tables alone."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd

from ..results.tables import DIAGNOSE_POINTS, DiagnoseResult
from . import plots
from .formatting import fixed_width, markdown_table, model_line
from .html import CSS, html_figure, html_table

DASHES = {"attention": None, "router": "5 3", "moe": "6 2 1 2", "residual": None}
ERRORS_NOTE = ("rel_error = ‖a - b‖ / ‖b‖ of each point over every position (a: the engine, b: side B); "
               "router_flip_rate: share of positions whose top-k expert set differs; drift and new_flips: what the "
               "rule reads (over the positions whose routing agreed so far).")


# ---- what every format shows ----------------------------------------------------------------------------


def divergence_table(result: DiagnoseResult) -> pd.DataFrame:
    """One row per adapter (base first): samples, tokens, the first divergent layer and what crossed the band."""
    rows = []
    for adapter, entry in result.record.get("adapters", {}).items():
        trigger = entry.get("trigger") or {}
        first = entry.get("first_divergent_layer")
        rows.append(dict(adapter=adapter, samples=len(entry.get("samples", [])),
                         tokens=sum(s.get("tokens", 0) for s in entry.get("samples", [])),
                         first_divergent_layer="none" if first is None else str(first),
                         trigger=trigger.get("trigger", entry.get("note", "")),
                         value=_shown(trigger.get("value")), band=_shown(trigger.get("band"))))
    return pd.DataFrame(rows, columns=["adapter", "samples", "tokens", "first_divergent_layer", "trigger", "value",
                                       "band"])


def error_table(layers: pd.DataFrame, entry: dict, adapter: str) -> pd.DataFrame:
    """Layers of one adapter as rows: the points' rel_error, the router flip rate, and the rule's drift and new flips
    (diagnose.json `entry`)."""
    mine = layers[layers["adapter"] == adapter]
    table = mine.pivot(index="layer", columns="point", values="rel_error")
    table = table[[p for p in DIAGNOSE_POINTS if p in table.columns]]
    flips = mine[mine["point"] == "router"].set_index("layer")["router_flip_rate"]
    table["router_flip_rate"] = flips.reindex(table.index)
    for key in ("drift", "new_flips"):
        table[key] = [entry.get(key, {}).get(str(layer), np.nan) for layer in table.index]
    return table.reset_index()


def flips_table(result: DiagnoseResult) -> pd.DataFrame:
    """Layers with router flips: the most frequent experts flipped in (chosen by the engine only) and out."""
    rows = []
    for adapter, entry in result.record.get("adapters", {}).items():
        for flip in entry.get("router_flips", []):
            rows.append(dict(adapter=adapter, layer=flip["layer"], flip_rate=flip["flip_rate"],
                             flipped_in=_experts(flip["flipped_in"]), flipped_out=_experts(flip["flipped_out"])))
    return pd.DataFrame(rows, columns=["adapter", "layer", "flip_rate", "flipped_in", "flipped_out"])


def effect_table(modules: pd.DataFrame) -> pd.DataFrame:
    """Per adapter and module kind: over the layers it is targeted in, the smallest, median and largest
    lora_rel_effect, and how many layers it leaves unchanged (exactly 0)."""
    rows = []
    for (adapter, module), part in modules.groupby(["adapter", "module"], sort=False):
        effect = part["lora_rel_effect"].to_numpy(dtype=float)
        rows.append(dict(adapter=adapter, module=module, layers=len(part), min=effect.min(),
                         median=float(np.median(effect)), max=effect.max(), unchanged=int((effect == 0).sum())))
    return pd.DataFrame(rows, columns=["adapter", "module", "layers", "min", "median", "max", "unchanged"])


def _with_layers(modules: pd.DataFrame) -> pd.DataFrame:
    """modules.csv for display: layer numbers as integers, empty outside the decoder layers."""
    return modules.assign(layer=["" if pd.isna(v) else int(v) for v in modules["layer"]])


def _shown(value) -> str:
    return "" if value is None else f"{value:.4g}"


def _experts(pairs: list) -> str:
    return ", ".join(f"{e} ({n}x)" for e, n in pairs)


def _sides(record: dict) -> list[str]:
    a, b = record.get("side_a", {}), record.get("side_b", {})
    return [f"Side A (the engine): `{a.get('model')}`, {a.get('dtype')} on {a.get('device')}, {a.get('backend')} "
            f"backend, adapters {a.get('adapters')}; {a.get('note')}.",
            f"Side B (the reference): `{b.get('model')}`, {b.get('dtype')} on {b.get('device')}, {b.get('backend')} "
            f"backend, {_side_b_adapters(b)}.",
            f"Measured {record.get('measured')} ({record.get('why')}).",
            f"Rule: {record.get('rule', {}).get('text')}."]


def _side_b_adapters(b: dict) -> str:
    """Which adapters side B ran, in words: tasks/diagnose/task.py SideB.record's note (`adapters` in a record
    without one)."""
    return b.get("note") or f"adapters {b.get('adapters')}"


def diagnose_summary(result: DiagnoseResult) -> str:
    """For the terminal: how it was measured, side B's adapters and the first divergent layer per adapter."""
    side_b = _side_b_adapters(result.record.get("side_b", {}))
    return f"measured {result.record.get('measured')}; side B {side_b}\n" + fixed_width(divergence_table(result))


# ---- Markdown --------------------------------------------------------------------------------------------


def diagnose_markdown(result: DiagnoseResult) -> str:
    parts = ["# lora-eval diagnose", "", model_line(result.run), "", *[f"- {line}" for line in _sides(result.record)],
             "", "## First divergent layer", "", markdown_table(divergence_table(result)), ""]
    for adapter, entry in result.record.get("adapters", {}).items():
        if (result.layers["adapter"] == adapter).any():
            parts += [f"## Errors per layer: {adapter}", "", ERRORS_NOTE, "",
                      markdown_table(error_table(result.layers, entry, adapter)), ""]
    flips = flips_table(result)
    if len(flips):
        parts += ["## Router flips", "", markdown_table(flips), ""]
    if len(result.modules):
        parts += ["## Adapter effect per module", "", "lora_rel_effect = ‖ΔW x‖ / ‖W x‖ on the adapter's samples, "
                  "over the layers each module is targeted in (modules.csv has every layer).", "",
                  markdown_table(effect_table(result.modules)), ""]
    return "\n".join(parts)


# ---- HTML ------------------------------------------------------------------------------------------------


def error_figure(layers: pd.DataFrame, adapter: str, first: int | None) -> plots.Figure:
    """rel_error per layer (log scale) of each point, and the router flip rate per MoE layer, of one adapter; the
    first divergent layer marked."""
    mine = layers[layers["adapter"] == adapter]
    fig = plots.Figure(plots.WIDTH, 500, rows=2, heights=[3, 2])
    (errors,), (flips,) = fig.axes
    colors = plots.color_of(DIAGNOSE_POINTS)
    for point in DIAGNOSE_POINTS:
        part = mine[mine["point"] == point]
        values = part["rel_error"].to_numpy(dtype=float)
        if len(part) and (values > 0).any():
            errors.line(part["layer"], np.where(values > 0, values, np.nan), colors[point], dash=DASHES[point],
                        markers=True, label=point)
    errors.y.log = bool((mine["rel_error"] > 0).any())
    errors.ylabel = "rel_error (log)"
    errors.title = f"{adapter}: error per layer (zeros not drawn)"
    router = mine[mine["point"] == "router"]
    layer = router["layer"].to_numpy(dtype=float)
    flips.bars(layer - 0.3, layer + 0.3, router["router_flip_rate"].fillna(0), colors["router"],
               bottom=np.zeros(len(router)))
    flips.ylabel = "router flip rate"
    flips.xlabel = "layer"
    shown = mine["layer"].to_numpy(dtype=float)
    for ax in (errors, flips):
        ax.x.integer = True
        ax.x.limits = (shown.min() - 0.6, shown.max() + 0.6) if len(shown) else (-0.6, 0.6)  # the panels share x
        if first is not None:
            ax.vline(first, "#cf222e", width=1.2, dash="2 2",
                     label=f"first divergent layer ({first})" if ax is errors else None)
    return fig


def diagnose_html(result: DiagnoseResult) -> str:
    record = result.record
    body = [f"<p>{html.escape(model_line(result.run))}</p>", "<ul>",
            *[f"<li>{html.escape(line)}</li>" for line in _sides(record)], "</ul>",
            "<h2>First divergent layer</h2>", html_table(divergence_table(result))]
    for adapter, entry in record.get("adapters", {}).items():
        if not (result.layers["adapter"] == adapter).any():
            continue
        first = entry.get("first_divergent_layer")
        body += [f"<h2>{html.escape(adapter)}</h2>",
                 html_figure(error_figure(result.layers, adapter, first), f"errors per layer: {adapter}"),
                 "<details><summary>Errors per layer</summary>", f"<p>{html.escape(ERRORS_NOTE)}</p>",
                 html_table(error_table(result.layers, entry, adapter)), "</details>"]
    flips = flips_table(result)
    if len(flips):
        body += ["<h2>Router flips</h2>", "<p>Experts flipped in: chosen by the engine, not by side B; out: the "
                 "other way round.</p>", html_table(flips)]
    if len(result.modules):
        body += ["<h2>Adapter effect per module</h2>", "<p>lora_rel_effect = ‖ΔW x‖ / ‖W x‖ on the adapter's "
                 "samples, over the layers each module is targeted in.</p>", html_table(effect_table(result.modules)),
                 "<details><summary>Every module</summary>", html_table(_with_layers(result.modules)), "</details>"]
    title = "lora-eval diagnose"
    return "\n".join(["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
                      f"<title>{title}</title>", f"<style>{CSS}</style>", "</head>", "<body>", f"<h1>{title}</h1>",
                      *body, "</body>", "</html>", ""])


def diagnose_report_files(result: DiagnoseResult) -> dict[str, bytes]:
    """diagnose.md and diagnose.html of a run folder."""
    return {"diagnose.md": diagnose_markdown(result).encode("utf-8"),
            "diagnose.html": diagnose_html(result).encode("utf-8")}
