"""Rendering results for people: terminal tables, the Markdown reports, and the report files of a run folder.

Renderers read results (results/) and never run a task; rendering is deterministic (no clock time but what
run.json holds), so `render(run_dir)` gives the bytes the run wrote.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ..errors import InputError
from ..names import BASE
from ..results.tables import CompareResult, MmluResult, complete_record, read_diagnose, read_run
from .diagnose import diagnose_html, diagnose_markdown
from .formatting import (compare_verdict, display_table, fixed_width, gate_lines, markdown_table, mmlu_verdict,
                         model_line, points, report_timings, routing_by_layer, shown_columns, shown_text,
                         significance_note, significance_rows, threshold_text, thresholds_sentence, versions_of,
                         with_p_values)
from .html import compare_html, mmlu_html

# ---- the terminal -------------------------------------------------------------------------------------------


def summary_text(result: CompareResult | MmluResult) -> str:
    """The summary for the terminal: compare's rows with PASS/FAIL and what failed, then what the gates found;
    MMLU's micro and macro rows."""
    if isinstance(result, CompareResult):
        return "\n".join([fixed_width(result.summary[shown_columns(result.summary)]), "",
                          *gate_lines(result.gates, result.run)])
    return fixed_width(display_table(result.summary[result.summary["group"].isin(["micro", "macro"])]))


def verdict(result: CompareResult | MmluResult) -> str:
    if isinstance(result, CompareResult):
        return compare_verdict(result.summary, result.gates)
    return mmlu_verdict(result.summary, result.run.get("arguments", {}).get("max_drop"))


def phase_times(run: dict) -> str:
    """'read 0.12 s, load 2.31 s, compile 0.00 s, forward 10.20 s, metrics 0.51 s, write 0.20 s; total 13.40 s':
    where the time went, phase by phase (results.tables.PHASES), as run.json records it."""
    timings = run.get("timings") or {}
    phases = {k[:-2]: v for k, v in timings.items() if k.endswith("_s") and k != "total_s"}
    work = run.get("work") or {}
    text = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    if "total_s" in timings:
        text += f"; total {timings['total_s']:.2f} s"
    if work.get("resumed_units"):
        text += f"; {work['resumed_units']} of {work['units']} units resumed from parts"
    return text


# ---- Markdown -----------------------------------------------------------------------------------------------


def compare_markdown(result: CompareResult) -> str:
    """report.md of a compare run: verdict, summary, gates, noise floor, worst samples, run facts."""
    summary, run = result.summary, result.run
    args = run.get("arguments", {})
    lines = [f"# lora-eval compare: {compare_verdict(summary, result.gates)}", "",
             f"{model_line(run)}; {thresholds_sentence(args)}.", "",
             "## Summary", "", markdown_table(summary[shown_columns(summary)]), "",
             "## Gates", "", *[f"* {line}" for line in gate_lines(result.gates, run)], ""]
    if len(result.gates):
        lines += [markdown_table(result.gates.assign(reason=result.gates["reason"].str.replace("|", "\\|"))), ""]
    sampler_cols = [c for c in summary.columns if c.startswith("sampler_")]
    if sampler_cols:
        lines += ["## Sampler noise floor (reference - sampler)", "",
                  markdown_table(summary[["adapter", "sampler_mean_abs_diff", "sampler_k2", "sampler_max_abs_diff"]]),
                  ""]
    if len(result.routing):
        lines += ["## Routing against the sampler's routed experts", "",
                  "Share of scored positions whose top-k expert set differs from the sampler's, per MoE layer.", "",
                  markdown_table(routing_by_layer(result.routing)), ""]
    worst = result.samples.sort_values("k2", ascending=False).head(10)
    lines += ["## Worst samples by k2", "",
              markdown_table(worst[["adapter", "sample_id", "n_tokens", "mean_abs_diff", "max_abs_diff", "k2"]]), ""]
    lines += _worst_tokens_section(result.worst, run)
    lines += ["## Run", "",
              f"{run.get('batches')} batches, padding waste {run.get('padding_waste', 0):.1%}, "
              f"{run.get('tokens_per_s', 0):,.0f} tokens/s; timings " +
              ", ".join(f"{k} {v:.2f}" for k, v in report_timings(run).items()), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in versions_of(run).items()), ""]
    return "\n".join(lines)


def _worst_tokens_section(worst: pd.DataFrame, run: dict) -> list[str]:
    """Worst tokens by |d|: context, then the predicted token in brackets (newlines shown as a symbol)."""
    if worst is None or not len(worst):
        return []
    source = f"decoded with the tokenizer in `{run['tokenizer']}`" if run.get("tokenizer") else \
        "token ids in brackets (no tokenizer in the model folder)"
    shown = worst[["adapter", "sample_id", "position", "token_id"]].assign(
        text=[(shown_text(c) + "\u27e6" + shown_text(t) + "\u27e7").replace("|", "\\|")
              for c, t in zip(worst["context"], worst["token"])],
        ref=worst["ref"], engine=worst["engine"], d=worst["d"])
    return ["## Worst tokens by |d|", "", f"Context, then the predicted token in \u27e6brackets\u27e7; {source}.", "",
            markdown_table(shown), ""]


def mmlu_markdown(result: MmluResult) -> str:
    """mmlu.md: verdict, micro/macro, categories, the subjects that moved most, run facts."""
    run, args = result.run, result.run.get("arguments", {})
    summary = result.summary
    lines = [f"# lora-eval mmlu: {verdict(result)}", "",
             f"{model_line(run)}; {run.get('questions')} {args.get('split')} questions, {args.get('shots')}-shot; "
             f"{threshold_text('max drop', args.get('max_drop'), ' points')}. Deltas are paired per question, 95% "
             "intervals (Agresti-Min).", "",
             "## Micro and macro", "",
             markdown_table(display_table(summary[summary["group"].isin(["micro", "macro"])])), "",
             "## Categories (micro within each)", "",
             markdown_table(display_table(summary[~summary["group"].isin(["micro", "macro"])]).drop(
                 columns="passed")), ""]
    subjects = result.subjects[result.subjects["model"] != BASE]
    if len(subjects):
        order = {m: i for i, m in enumerate(result.subjects["model"].unique())}
        worst = subjects.sort_values(["delta", "subject"]).groupby("model", sort=False).head(10)
        worst = worst.sort_values("model", key=lambda s: s.map(order), kind="stable")  # per adapter, worst first
        worst = with_p_values(worst, result.questions)
        lines += ["## Subjects with the largest drops", "",
                  markdown_table(pd.DataFrame({
                      "model": worst["model"], "subject": worst["subject"], "questions": worst["questions"].astype(str),
                      "accuracy %": [f"{100 * a:.1f}" for a in worst["accuracy"]],
                      "delta (points)": [points(d) for d in worst["delta"]],
                      "95% interval": ["" if math.isnan(lo) else f"[{points(lo)}, {points(hi)}]"
                                       for lo, hi in zip(worst["delta_low"], worst["delta_high"])],
                      "p (exact)": [f"{p:.3g}" for p in worst["p_value"]]})), ""]
    significant = significance_rows(result.questions)
    lines += ["## Subjects that differ from base", "", significance_note(), "",
              markdown_table(significant) if len(significant) else "None.", ""]
    prompts = run.get("prompts", {})
    lines += ["## Run", "",
              f"{run.get('rows')} scored rows in {run.get('batches')} batches, padding waste "
              f"{run.get('padding_waste', 0):.1%}, {run.get('questions_per_s', 0):,.1f} questions/s; prompts "
              f"{prompts.get('tokens_mean', 0):.0f} tokens on average (max {prompts.get('tokens_max')}), "
              f"{prompts.get('with_fewer_shots')} with fewer shots to fit; answer tokens " +
              ", ".join(f"{k} {v['token']!r} ({v['id']})" for k, v in run.get("answer_tokens", {}).items()) + ".", "",
              "Timings (s): " + ", ".join(f"{k} {v:.2f}" for k, v in report_timings(run).items()), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in versions_of(run).items()), ""]
    return "\n".join(lines)


# ---- the files of a run folder ------------------------------------------------------------------------------

REPORTS = {"compare": {"md": "report.md", "html": "report.html"}, "mmlu": {"md": "mmlu.md", "html": "report.html"}}


def render_report(result: CompareResult | MmluResult, fmt: str) -> str:
    if isinstance(result, CompareResult):
        return compare_html(result) if fmt == "html" else compare_markdown(result)
    return mmlu_html(result) if fmt == "html" else mmlu_markdown(result)


def report_files(result: CompareResult | MmluResult) -> dict[str, bytes]:
    """The report files a run folder holds, as bytes."""
    kind = "compare" if isinstance(result, CompareResult) else "mmlu"
    return {name: render_report(result, fmt).encode("utf-8") for fmt, name in REPORTS[kind].items()}


def render(run_dir: str | Path, fmt: str = "html") -> str:
    """The report of a complete run folder, from its files alone (equal to the report written with the run)."""
    if fmt not in ("html", "md"):
        raise InputError("--format", f"'{fmt}' is not one of html, md")
    if complete_record(run_dir, ("compare", "mmlu", "diagnose"))["command"] == "diagnose":
        result = read_diagnose(run_dir)
        return diagnose_html(result) if fmt == "html" else diagnose_markdown(result)
    return render_report(read_run(run_dir), fmt)
