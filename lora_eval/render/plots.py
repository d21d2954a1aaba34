"""Figures for the reports, from the run's DataFrames: each function returns an `svg.Figure` (drawn by our own
SVG code, render/svg.py, whose module notes say why not matplotlib) that report.html holds inline and Jupyter shows
as it is. The same data give the same bytes, so a report re-rendered from the saved files equals the original.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .svg import Figure

WIDTH = 800  # px
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
OVERALL = "overall"


def color_of(names: list[str]) -> dict[str, str]:
    return {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}


def _masked(tokens: pd.DataFrame, columns: list[str]) -> dict[str, np.ndarray]:
    """The scored tokens' `columns`, as arrays (without copying the whole per-token table)."""
    keep = tokens["mask"].to_numpy(dtype=bool)
    return {c: tokens[c].to_numpy()[keep] for c in columns}


def _rows_by_adapter(adapter: np.ndarray) -> dict[str, np.ndarray]:
    """Adapter -> the indices of its rows, adapters in order of appearance (pd.unique's), 'overall' left out."""
    codes, names = pd.factorize(adapter)
    return {name: np.flatnonzero(codes == k) for k, name in enumerate(names) if name != OVERALL}


def _adapters(tokens: pd.DataFrame) -> list[str]:
    return [a for a in pd.unique(tokens["adapter"]) if a != OVERALL]


def _log_bins(values: np.ndarray, per_decade: int = 5) -> np.ndarray:
    """Log-spaced bin edges covering the positive `values` (whole decades)."""
    positive = values[values > 0]
    if positive.size == 0:
        return np.logspace(-8, 0, 8 * per_decade + 1)
    lo, hi = math.floor(math.log10(positive.min())), math.ceil(math.log10(positive.max()))
    hi = max(hi, lo + 1)
    return np.logspace(lo, hi, (hi - lo) * per_decade + 1)


def abs_diff_histogram(tokens: pd.DataFrame) -> Figure:
    """|ref - engine| per token, one panel per adapter, log-spaced bins on a log x axis (masked tokens)."""
    masked = _masked(tokens, ["adapter", "d"])
    rows = _rows_by_adapter(masked["adapter"])
    adapters = list(rows)
    colors = color_of(adapters)
    d = np.abs(masked["d"].astype(np.float64))
    bins = _log_bins(d)
    fig = Figure(WIDTH, 40 + 150 * max(len(adapters), 1), rows=max(len(adapters), 1), xlog=True)
    for (ax,), adapter in zip(fig.axes, adapters):
        a = d[rows[adapter]]
        zeros = int((a == 0).sum())
        counts, _ = np.histogram(a[a > 0], bins=bins)
        ax.bars(bins[:-1], bins[1:], counts, colors[adapter], bottom=np.zeros(len(counts)), opacity=0.8)
        ax.title = f"{adapter}: {len(a)} tokens" + (f", {zeros} exactly 0 (not drawn)" if zeros else "")
        ax.ylabel = "tokens"
    for (ax,) in fig.axes:
        ax.x.limits = (float(bins[0]), float(bins[-1]))
    fig.axes[-1][0].xlabel = "|ref - engine| (nats, log scale)"
    return fig


def diff_by_position(tokens: pd.DataFrame) -> Figure:
    """Signed d = ref - engine against the token position: the mean per position and the min..max band."""
    masked = _masked(tokens, ["adapter", "position", "d"])
    rows = _rows_by_adapter(masked["adapter"])
    adapters = list(rows)
    colors = color_of(adapters)
    fig = Figure(WIDTH, 320)
    ax = fig.axes[0][0]
    for adapter in adapters:
        part = pd.DataFrame({"position": masked["position"][rows[adapter]],
                             "d": masked["d"][rows[adapter]]}).groupby("position")["d"]
        stats = pd.DataFrame(dict(mean=part.mean(), lo=part.min(), hi=part.max())).sort_index()
        x = stats.index.to_numpy()
        ax.band(x, stats["lo"].to_numpy(), stats["hi"].to_numpy(), colors[adapter], opacity=0.2)
        ax.line(x, stats["mean"].to_numpy(), colors[adapter], width=1.2, label=f"{adapter} (mean)")
    ax.hline(0, "black", width=0.6)
    ax.xlabel = "position (index of the predicted token - 1)"
    ax.ylabel = "ref - engine (nats)"
    ax.title = "d by position: mean per position, band = min..max over samples"
    return fig


def _log_floor(values: np.ndarray) -> float:
    positive = values[values > 0]
    return float(positive.min()) / 10 if positive.size else 1e-20


def k2_per_sample(samples: pd.DataFrame, max_k2: float | None) -> Figure:
    """k2 of every sample, one column per adapter (log y); the k2 threshold as a red line."""
    samples = samples[samples["k2"].notna()]
    adapters = _adapters(samples)
    colors = color_of(adapters)
    k2 = samples["k2"].to_numpy(dtype=np.float64)
    floor = _log_floor(np.concatenate([k2, [max_k2] if max_k2 else []]))
    fig = Figure(WIDTH, 320, ylog=True)
    ax = fig.axes[0][0]
    for i, adapter in enumerate(adapters):
        values = samples.loc[samples["adapter"] == adapter, "k2"].to_numpy(dtype=np.float64)
        x = i + np.linspace(-0.3, 0.3, len(values)) if len(values) > 1 else np.full(len(values), float(i))
        zero = values <= 0
        ax.points(x[~zero], values[~zero], colors[adapter], size=3)
        if zero.any():
            ax.points(x[zero], np.full(zero.sum(), floor), colors[adapter], size=4, marker="triangle",
                      label=f"{adapter}: k2 = 0 (drawn at {floor:.0e})")
    if max_k2:
        ax.hline(max_k2, "#d62728", width=1, dash="5 3", label=f"threshold k2 = {max_k2:g}")
    ax.x.ticks = (list(range(len(adapters))), adapters)
    ax.x.limits = (-0.6, max(len(adapters), 1) - 0.4)
    ax.ylabel = "k2 = mean(d^2 / 2) per sample"
    ax.title = "k2 per sample"
    return fig


def noise_floor(summary: pd.DataFrame, tokens: pd.DataFrame) -> Figure:
    """The engine's mismatch beside the sampler's (ref - sampler): mean |d| and k2 per adapter, and the
    pooled |d| histograms of both."""
    rows = summary[summary["sampler_k2"].notna()]
    names = list(rows["adapter"])
    fig = Figure(WIDTH, 340, cols=3)
    x = np.arange(len(names))
    for ax, metric in zip(fig.axes[0][:2], ("mean_abs_diff", "k2")):
        ax.y.log = True
        engine = rows[metric].to_numpy(dtype=np.float64)
        sampler = rows[f"sampler_{metric}"].to_numpy(dtype=np.float64)
        floor = _log_floor(np.concatenate([engine, sampler]))
        ax.bars(x - 0.4, x, np.maximum(engine, floor), "#1f77b4")
        ax.bars(x, x + 0.4, np.maximum(sampler, floor), "#7f7f7f")
        ax.x.ticks = (list(x), names)
        ax.x.limits = (-0.6, max(len(names), 1) - 0.4)
        ax.slanted_xticks = True
        ax.title = metric
    fig.legend = [("engine: ref - engine", "#1f77b4", "box"), ("sampler: ref - sampler", "#7f7f7f", "box")]
    ax = fig.axes[0][2]
    ax.x.log = True
    masked = _masked(tokens, ["d", "sampler_d"])
    engine = np.abs(masked["d"].astype(np.float64))
    sampler = np.abs(masked["sampler_d"].astype(np.float64))
    sampler = sampler[~np.isnan(sampler)]
    bins = _log_bins(np.concatenate([engine, sampler]))
    ax.steps(bins, np.histogram(engine[engine > 0], bins=bins)[0], "#1f77b4", label="|ref - engine|")
    ax.steps(bins, np.histogram(sampler[sampler > 0], bins=bins)[0], "#7f7f7f", label="|ref - sampler|")
    ax.x.limits = (float(bins[0]), float(bins[-1]))
    ax.title = "|d| per token, all adapters"
    return fig


def _points_with_errors(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """delta in percentage points and the [2, n] distances to its interval ends (0 where the interval is NaN,
    e.g. a subject with one question)."""
    delta = 100 * rows["delta"].to_numpy(dtype=np.float64)
    err = np.vstack([delta - 100 * rows["delta_low"].to_numpy(dtype=np.float64),
                     100 * rows["delta_high"].to_numpy(dtype=np.float64) - delta])
    return delta, np.nan_to_num(err, nan=0.0)


def mmlu_subject_deltas(subjects: pd.DataFrame) -> Figure:
    """Per subject: adapter accuracy - base accuracy (points) with its 95% interval, one panel per adapter,
    subjects grouped by category."""
    rows = subjects[subjects["model"] != "base"]
    adapters = list(pd.unique(rows["model"]))
    order = rows[["category", "subject"]].drop_duplicates().sort_values(["category", "subject"])
    y = {s: i for i, s in enumerate(order["subject"])}
    categories = list(pd.unique(order["category"]))
    colors = color_of(categories)
    n = max(len(adapters), 1)
    fig = Figure(max(WIDTH, 300 + 300 * n), 120 + 16 * len(y), cols=n)
    for c, (ax, adapter) in enumerate(zip(fig.axes[0], adapters)):
        part = rows[rows["model"] == adapter]
        for category in categories:
            cat = part[part["category"] == category]
            if cat.empty:
                continue
            delta, err = _points_with_errors(cat)
            ax.errorbars(delta, [y[s] for s in cat["subject"]], delta - err[0], delta + err[1], colors[category])
        ax.vline(0, "black", width=0.6)
        ax.title = f"{adapter} - base"
        ax.xlabel = "accuracy difference, points (95% interval)"
        ax.show_yticks = c == 0
    for ax in fig.axes[0]:
        ax.y.ticks = (list(y.values()), list(y))
        ax.y.limits = (max(len(y), 1) - 0.5, -0.5)  # the first subject on top; no adapter: an empty panel
    if categories and adapters:
        fig.legend = [(category, colors[category], "point") for category in categories]
    return fig


def mmlu_group_deltas(summary: pd.DataFrame) -> Figure:
    """Accuracy difference to base (points) per group (micro, macro, categories) with 95% intervals, per adapter."""
    rows = summary[(summary["model"] != "base") & summary["delta"].notna()]
    adapters = list(pd.unique(rows["model"]))
    groups = list(pd.unique(rows["group"]))
    colors = color_of(adapters)
    fig = Figure(WIDTH, 80 + 30 * max(len(groups), 1) * max(len(adapters), 1) ** 0.5)
    ax = fig.axes[0][0]
    step = 0.7 / max(len(adapters), 1)
    for i, adapter in enumerate(adapters):
        part = rows[rows["model"] == adapter].set_index("group").reindex(groups)
        delta, err = _points_with_errors(part)
        ys = np.arange(len(groups)) + (i - (len(adapters) - 1) / 2) * step
        ax.errorbars(delta, ys, delta - err[0], delta + err[1], colors[adapter], label=adapter)
    ax.vline(0, "black", width=0.6)
    ax.y.ticks = (list(range(len(groups))), groups)
    ax.y.limits = (max(len(groups), 1) - 0.5, -0.5)
    ax.xlabel = "accuracy difference to base, points (95% interval)"
    ax.title = "MMLU: adapter - base by group"
    return fig
