"""Shared by every renderer (terminal, Markdown, HTML): how a cell, a verdict and a delta in points are written."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..results.mmlu_stats import ALPHA, MIN_SIGNIFICANT, significant_subjects, subject_tests
from ..results.tables import WRITTEN_AFTER_REPORTS

# compare summary columns shown to people (k2_over_floor only where the references give a floor: shown_columns)
SHOWN = ["adapter", "n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error",
         "k2_over_floor", "routing_flip_rate", "routing_flip_weight", "passed", "failed"]
OPTIONAL = ("k2_over_floor", "routing_flip_rate", "routing_flip_weight")  # shown where some row has a value
NEWLINE = "\u23ce"  # shown for a newline inside token text


def cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.4g}"
    if isinstance(value, (bool, np.bool_)) or str(value) in ("True", "False"):
        return "PASS" if value in (True, "True") else "FAIL"
    return str(value)


def markdown_table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def fixed_width(frame: pd.DataFrame) -> str:
    """A table for the terminal: left-aligned columns two spaces apart."""
    cells = [list(frame.columns)] + [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def shown_text(text: str) -> str:
    """Token text with newlines and tabs made visible."""
    return str(text).replace("\n", NEWLINE).replace("\t", "\u21e5")


def model_line(run: dict) -> str:
    """'Model `M`, dtype D, device X' (and the quantized checkpoint's numerics): the first line of every report."""
    args, resolved = run.get("arguments", {}), run.get("resolved", {})
    quantized = f" ({run['quantization']})" if run.get("quantization") else ""
    return f"Model `{args.get('model')}`{quantized}, dtype {resolved.get('dtype')}, device {resolved.get('device')}"


def report_timings(run: dict) -> dict:
    """The phase times a report shows: run.json's timings but those known only after the reports are rendered
    (the write phase and the total), so that re-rendering a run folder gives the bytes the run wrote."""
    return {k: v for k, v in (run.get("timings") or {}).items() if k not in WRITTEN_AFTER_REPORTS}


def versions_of(run: dict) -> dict:
    """The package versions a run record's fingerprint names."""
    return (run.get("fingerprint") or {}).get("versions") or {}


def shown_columns(summary: pd.DataFrame) -> list[str]:
    """The SHOWN columns a compare summary has, less the OPTIONAL ones no row has a value of (k2_over_floor without a
    sampler floor, the routing columns without routes)."""
    return [c for c in SHOWN if c in summary.columns and not (c in OPTIONAL and summary[c].isna().all())]


def compare_verdict(summary: pd.DataFrame, gates: pd.DataFrame) -> str:
    """'PASSED', or 'FAILED: ' and each failing row with what it failed; an adapter that the applied gate fails and
    that has no summary row (no reference rows) is named too."""
    failed = [f"{r.adapter} ({r.failed})" for r in summary.itertuples() if not bool(r.passed)]
    failed += [f"{g.adapter} (adapter not applied: {g.reason})" for g in gates.itertuples()
               if not bool(g.applied) and g.adapter not in set(summary["adapter"])]
    return "PASSED" if not failed else "FAILED: " + "; ".join(failed)


def threshold_text(name: str, value, unit: str = "") -> str:
    """'k2 <= 0.005' for a threshold that was given, 'k2 off' for one that was not (never '<= None')."""
    return f"{name} off" if value is None else f"{name} <= {value}{unit}"


def thresholds_sentence(args: dict) -> str:
    """compare's thresholds for the first line of its reports: 'thresholds: k2 <= 0.005, mean_abs_diff off'."""
    return (f"thresholds: {threshold_text('k2', args.get('max_k2'))}, "
            f"{threshold_text('mean_abs_diff', args.get('max_mean_abs_diff'))}{floor_clause(args)}"
            + ("" if args.get("max_routing_flip_rate") is None
               else f", routing_flip_rate <= {args['max_routing_flip_rate']:g}"))


def floor_clause(args: dict) -> str:
    """', k2 <= X x the sampler's floor' for the thresholds sentence of a report, where --max-k2-over-floor is set."""
    limit = args.get("max_k2_over_floor")
    return "" if limit is None else f", k2 <= {limit:g} x the sampler's floor"


def routing_by_layer(routing: pd.DataFrame) -> pd.DataFrame:
    """The routing table for a report: one row per MoE layer, its flip rate under each adapter (and overall)."""
    table = routing.pivot(index="layer", columns="adapter", values="flip_rate")
    table = table[list(dict.fromkeys(routing["adapter"]))]  # adapters in the table's order
    return table.reset_index().rename(columns={a: f"flip_rate {a}" for a in table.columns})


def gate_lines(gates: pd.DataFrame, run: dict) -> list[str]:
    """What the gates found, one line each: the adapter applied gate (each adapter's max |lp - base| against the
    noise bound, or why it is not applied) and the k2 over floor gate (the floor and the limit, or why it is off)."""
    record = run.get("gates") or {}
    check = record.get("adapter_check")
    if check is None:
        applied = "adapter applied: not checked (--no-adapter-check)"
    elif not len(gates):
        applied = "adapter applied: no adapter to check"
    else:
        parts = []
        for g in gates.itertuples():
            if not bool(g.applied):
                parts.append(f"{g.adapter} NOT applied: {g.reason}")
            elif g.rows_checked:
                parts.append(f"{g.adapter} {cell(float(g.max_abs_diff_vs_base))} > {cell(float(g.noise_bound))}")
            else:
                parts.append(f"{g.adapter} ({g.reason})")
        applied = (f"adapter applied (max |lp - base| > noise bound, on up to {check['max_rows']} rows / "
                   f"{check['max_tokens']} tokens of each adapter run again under the base model: {check['rows']} "
                   f"rows, {check['tokens']} tokens): " + "; ".join(parts))
    floor = record.get("k2_over_floor") or {}
    if floor.get("k2_floor") is None:
        over = "k2 over floor: off (the references carry no sampler logprobs)"
    else:
        limit = floor.get("limit")
        over = (f"k2 over floor: floor {cell(float(floor['k2_floor']))} (k2 of ref - sampler over {floor['rows']} "
                f"{floor['source']}, {floor['tokens']} tokens); " +
                ("no limit set (--max-k2-over-floor)" if limit is None else f"limit k2 <= {limit:g} x floor"))
    return [applied, over]


def points(value: float) -> str:
    """A fraction as signed percentage points ('' for NaN)."""
    return "" if math.isnan(value) else f"{100 * value:+.1f}"


def display_table(summary: pd.DataFrame) -> pd.DataFrame:
    """An MMLU summary with accuracy in % and delta in points with its interval, for people."""
    return pd.DataFrame({
        "model": summary["model"], "group": summary["group"], "questions": summary["questions"].astype(str),
        "accuracy %": [f"{100 * a:.1f}" for a in summary["accuracy"]],
        "delta (points)": [points(d) for d in summary["delta"]],
        "95% interval": ["" if math.isnan(lo) else f"[{points(lo)}, {points(hi)}]"
                         for lo, hi in zip(summary["delta_low"], summary["delta_high"])],
        "passed": summary["passed"]})


def significance_note() -> str:
    """What the reports' 'differ from base' list means, and why small subjects never appear in it."""
    fewest, fewer = 2 * 0.5 ** MIN_SIGNIFICANT, 2 * 0.5 ** (MIN_SIGNIFICANT - 1)  # all on one side
    return (f"Exact two-sided McNemar test (sign test on the questions that changed), p < {ALPHA:g}: a subject needs "
            f"at least {MIN_SIGNIFICANT} questions that changed to be listed (all {MIN_SIGNIFICANT} on one side give "
            f"p = {fewest:.3f}, {MIN_SIGNIFICANT - 1} give {fewer:.4f}). fixed: base wrong, adapter right; broken: "
            "the reverse.")


def with_p_values(subjects: pd.DataFrame, questions: pd.DataFrame) -> pd.DataFrame:
    """Subject rows (model, subject, ...) with their fixed, broken and exact McNemar p_value (NaN for base), so that
    an interval is never read without the test that decides significance (mmlu_stats' docstring)."""
    tests = subject_tests(questions)[["model", "subject", "fixed", "broken", "p_value"]]
    return subjects.merge(tests, on=["model", "subject"], how="left", validate="one_to_one")


def significance_rows(questions: pd.DataFrame) -> pd.DataFrame:
    """The subjects that differ from base (mmlu_stats.significant_subjects), for people."""
    rows = significant_subjects(questions)
    return pd.DataFrame({"model": rows["model"], "subject": rows["subject"], "questions": rows["questions"].astype(str),
                         "fixed": rows["fixed"].astype(str), "broken": rows["broken"].astype(str),
                         "delta (points)": [points(d) for d in rows["delta"]],
                         "p (exact)": [f"{p:.3g}" for p in rows["p_value"]]})


def mmlu_verdict(summary: pd.DataFrame, max_drop: float | None) -> str:
    failed = summary[(summary["group"] == "micro") & ~summary["passed"].astype(bool)]
    return "PASSED" if not len(failed) else "FAILED: " + "; ".join(
        f"{r.model} ({points(r.delta)} points, limit -{max_drop:g})" for r in failed.itertuples())
