"""Figures for the reports: matplotlib on the Agg canvas (no pyplot, no global backend change).

Every function takes the run's DataFrames and returns a `Figure`; `png(fig)` turns one into PNG bytes that
are the same byte for byte for the same data (fixed style, fixed size and dpi, no software/date metadata),
so a report re-rendered from the saved files equals the original. matplotlib is imported with the first figure (it
takes ~0.5 s: a command that draws nothing, or stops at a bad input, does not wait for it).
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
WIDTH = 8.0  # inches
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
         "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.alpha": 0.3,
         "font.family": "DejaVu Sans", "figure.facecolor": "white", "axes.facecolor": "white",
         "savefig.facecolor": "white", "path.simplify": True}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
OVERALL = "overall"


def styled():
    """A context in which figures are built and drawn with STYLE."""
    from matplotlib import rc_context

    return rc_context(STYLE)


def new_figure(width: float, height: float) -> Figure:
    """An empty figure (inches) on no global backend, laid out when drawn."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def png(fig: Figure) -> bytes:
    """The figure as deterministic PNG bytes (no Software tag, no timestamp)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    with styled():
        fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


def color_of(names: list[str]) -> dict[str, str]:
    return {name: COLORS[i % len(COLORS)] for i, name in enumerate(names)}


def _figure(height: float, rows: int = 1, cols: int = 1, width: float = WIDTH, **kwargs):
    with styled():
        fig = new_figure(width, height)
        axes = fig.subplots(rows, cols, squeeze=False, **kwargs)
    return fig, axes


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
    with styled():
        masked = _masked(tokens, ["adapter", "d"])
        rows = _rows_by_adapter(masked["adapter"])
        adapters = list(rows)
        colors = color_of(adapters)
        d = np.abs(masked["d"].astype(np.float64))
        bins = _log_bins(d)
        fig, axes = _figure(0.4 + 1.5 * max(len(adapters), 1), rows=max(len(adapters), 1), sharex=True)
        for ax, adapter in zip(axes[:, 0], adapters):
            a = d[rows[adapter]]
            zeros = int((a == 0).sum())
            ax.hist(a[a > 0], bins=bins, color=colors[adapter], alpha=0.8)
            label = f"{adapter}: {len(a)} tokens" + (f", {zeros} exactly 0 (not drawn)" if zeros else "")
            ax.set_title(label, loc="left")
            ax.set_xscale("log")
            ax.set_ylabel("tokens")
        axes[-1, 0].set_xlabel("|ref - engine| (nats, log scale)")
    return fig


def diff_by_position(tokens: pd.DataFrame) -> Figure:
    """Signed d = ref - engine against the token position: the mean per position and the min..max band."""
    with styled():
        masked = _masked(tokens, ["adapter", "position", "d"])
        rows = _rows_by_adapter(masked["adapter"])
        adapters = list(rows)
        colors = color_of(adapters)
        fig, axes = _figure(3.2)
        ax = axes[0, 0]
        for adapter in adapters:
            part = pd.DataFrame({"position": masked["position"][rows[adapter]],
                                 "d": masked["d"][rows[adapter]]}).groupby("position")["d"]
            stats = pd.DataFrame(dict(mean=part.mean(), lo=part.min(), hi=part.max())).sort_index()
            x = stats.index.to_numpy()
            ax.plot(x, stats["mean"].to_numpy(), color=colors[adapter], lw=1.2, label=f"{adapter} (mean)")
            ax.fill_between(x, stats["lo"].to_numpy(), stats["hi"].to_numpy(), color=colors[adapter], alpha=0.2,
                            lw=0)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel("position (index of the predicted token - 1)")
        ax.set_ylabel("ref - engine (nats)")
        ax.set_title("d by position: mean per position, band = min..max over samples", loc="left")
        if adapters:
            ax.legend(loc="best")
    return fig


def _log_floor(values: np.ndarray) -> float:
    positive = values[values > 0]
    return float(positive.min()) / 10 if positive.size else 1e-20


def k2_per_sample(samples: pd.DataFrame, max_k2: float | None) -> Figure:
    """k2 of every sample, one column per adapter (log y); the k2 threshold as a red line."""
    with styled():
        samples = samples[samples["k2"].notna()]
        adapters = _adapters(samples)
        colors = color_of(adapters)
        k2 = samples["k2"].to_numpy(dtype=np.float64)
        floor = _log_floor(np.concatenate([k2, [max_k2] if max_k2 else []]))
        fig, axes = _figure(3.2)
        ax = axes[0, 0]
        for i, adapter in enumerate(adapters):
            values = samples.loc[samples["adapter"] == adapter, "k2"].to_numpy(dtype=np.float64)
            x = i + np.linspace(-0.3, 0.3, len(values)) if len(values) > 1 else np.full(len(values), float(i))
            zero = values <= 0
            ax.scatter(x[~zero], values[~zero], s=12, color=colors[adapter], alpha=0.8)
            if zero.any():
                ax.scatter(x[zero], np.full(zero.sum(), floor), s=14, marker="v", color=colors[adapter],
                           label=f"{adapter}: k2 = 0 (drawn at {floor:.0e})")
        if max_k2:
            ax.axhline(max_k2, color="#d62728", lw=1, ls="--", label=f"threshold k2 = {max_k2:g}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(adapters)), adapters)
        ax.set_xlim(-0.6, max(len(adapters), 1) - 0.4)
        ax.set_ylabel("k2 = mean(d^2 / 2) per sample")
        ax.set_title("k2 per sample", loc="left")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    return fig


def noise_floor(summary: pd.DataFrame, tokens: pd.DataFrame) -> Figure:
    """The engine's mismatch beside the sampler's (ref - sampler): mean |d| and k2 per adapter, and the
    pooled |d| histograms of both."""
    with styled():
        rows = summary[summary["sampler_k2"].notna()]
        names = list(rows["adapter"])
        fig, axes = _figure(3.4, cols=3)
        x = np.arange(len(names))
        for ax, metric in zip(axes[0, :2], ("mean_abs_diff", "k2")):
            engine = rows[metric].to_numpy(dtype=np.float64)
            sampler = rows[f"sampler_{metric}"].to_numpy(dtype=np.float64)
            floor = _log_floor(np.concatenate([engine, sampler]))
            ax.bar(x - 0.2, np.maximum(engine, floor), 0.4, color="#1f77b4", label="engine: ref - engine")
            ax.bar(x + 0.2, np.maximum(sampler, floor), 0.4, color="#7f7f7f", label="sampler: ref - sampler")
            ax.set_yscale("log")
            ax.set_xticks(x, names, rotation=30, ha="right")
            ax.set_title(metric, loc="left")
        fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside upper center", ncols=2)
        ax = axes[0, 2]
        masked = _masked(tokens, ["d", "sampler_d"])
        engine = np.abs(masked["d"].astype(np.float64))
        sampler = np.abs(masked["sampler_d"].astype(np.float64))
        sampler = sampler[~np.isnan(sampler)]
        bins = _log_bins(np.concatenate([engine, sampler]))
        ax.hist(engine[engine > 0], bins=bins, histtype="step", color="#1f77b4", lw=1.5, label="|ref - engine|")
        ax.hist(sampler[sampler > 0], bins=bins, histtype="step", color="#7f7f7f", lw=1.5, label="|ref - sampler|")
        ax.set_xscale("log")
        ax.set_title("|d| per token, all adapters", loc="left")
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
    with styled():
        rows = subjects[subjects["model"] != "base"]
        adapters = list(pd.unique(rows["model"]))
        order = rows[["category", "subject"]].drop_duplicates().sort_values(["category", "subject"])
        y = {s: i for i, s in enumerate(order["subject"])}
        categories = list(pd.unique(order["category"]))
        colors = color_of(categories)
        n = max(len(adapters), 1)
        fig, axes = _figure(1.2 + 0.16 * len(y), cols=n, width=max(WIDTH, 3.0 + 3.0 * n), sharey=True, sharex=True)
        for ax, adapter in zip(axes[0], adapters):
            part = rows[rows["model"] == adapter]
            for category in categories:
                cat = part[part["category"] == category]
                if cat.empty:
                    continue
                delta, err = _points_with_errors(cat)
                ax.errorbar(delta, [y[s] for s in cat["subject"]], xerr=err, fmt="o", ms=3, lw=1,
                            color=colors[category], label=category if adapter == adapters[0] else None)
            ax.axvline(0, color="black", lw=0.6)
            ax.set_title(f"{adapter} - base", loc="left")
            ax.set_xlabel("accuracy difference, points (95% interval)")
        axes[0, 0].set_yticks(list(y.values()), list(y), fontsize=6)
        axes[0, 0].set_ylim(max(len(y), 1) - 0.5, -0.5)  # no adapter: an empty panel, not a singular axis
        if categories and adapters:
            fig.legend(loc="outside upper center", ncols=len(categories), fontsize=7)
    return fig


def mmlu_group_deltas(summary: pd.DataFrame) -> Figure:
    """Accuracy difference to base (points) per group (micro, macro, categories) with 95% intervals, per adapter."""
    with styled():
        rows = summary[(summary["model"] != "base") & summary["delta"].notna()]
        adapters = list(pd.unique(rows["model"]))
        groups = list(pd.unique(rows["group"]))
        colors = color_of(adapters)
        fig, axes = _figure(0.8 + 0.3 * max(len(groups), 1) * max(len(adapters), 1) ** 0.5)
        ax = axes[0, 0]
        step = 0.7 / max(len(adapters), 1)
        for i, adapter in enumerate(adapters):
            part = rows[rows["model"] == adapter].set_index("group").reindex(groups)
            delta, err = _points_with_errors(part)
            ys = np.arange(len(groups)) + (i - (len(adapters) - 1) / 2) * step
            ax.errorbar(delta, ys, xerr=err, fmt="o", ms=4, lw=1.2, color=colors[adapter], label=adapter)
        ax.axvline(0, color="black", lw=0.6)
        ax.set_yticks(range(len(groups)), groups)
        ax.set_ylim(max(len(groups), 1) - 0.5, -0.5)
        ax.set_xlabel("accuracy difference to base, points (95% interval)")
        ax.set_title("MMLU: adapter - base by group", loc="left")
        if adapters:
            ax.legend(loc="best")
    return fig
