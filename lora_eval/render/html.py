"""report.html: one self-contained page per run (tables + SVG figures inline), from a CompareResult or an
MmluResult. Deterministic: the page holds no clock time (only what run.json holds) and the figures are pure
functions of the tables, so re-rendering a run folder gives the same bytes as the report written with the run."""

from __future__ import annotations

import html
import json
import re

import numpy as np
import pandas as pd

from ..names import BASE
from ..results.tables import WORST_PER_ADAPTER
from . import plots
from .formatting import (cell, compare_verdict, display_table, gate_lines, mmlu_verdict, model_line, report_timings,
                         routing_by_layer, shown_columns, shown_text, significance_note, significance_rows,
                         threshold_text, thresholds_sentence, versions_of, with_p_values)

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 70em;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1.pass { color: #1a7f37; } h1.fail { color: #cf222e; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; font-size: 0.85em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f6f8fa; } td.text { text-align: left; white-space: pre-wrap; font-family: monospace; }
tr.fail td { background: #ffebe9; } td.PASS { color: #1a7f37; font-weight: bold; }
td.FAIL { color: #cf222e; font-weight: bold; } mark { background: #ffd8a8; } .ctx { color: #57606a; }
svg { max-width: 100%; height: auto; display: block; margin: 0.5em 0 1.5em 0; }
code { background: #f6f8fa; padding: 0 0.2em; }
p.note { color: #57606a; font-size: 0.9em; }
"""


# ---- HTML building blocks -----------------------------------------------------------------------------------


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _td(value) -> str:
    """A cell: numbers shown as in report.md, full precision in the title; PASS/FAIL marked."""
    if isinstance(value, (bool, np.bool_)):
        word = "PASS" if value else "FAIL"
        return f'<td class="{word}">{word}</td>'
    if isinstance(value, (float, np.floating)):
        return f'<td title="{float(value)!r}">{_esc(cell(float(value)))}</td>'
    if isinstance(value, (int, np.integer)):
        return f"<td>{int(value)}</td>"
    return f'<td class="text">{_esc(value)}</td>'


def html_table(frame: pd.DataFrame, failed_rows: list[bool] | None = None) -> str:
    head = "".join(f"<th>{_esc(c)}</th>" for c in frame.columns)
    body = []
    for i, row in enumerate(frame.itertuples(index=False)):
        css = ' class="fail"' if failed_rows is not None and failed_rows[i] else ""
        body.append(f"<tr{css}>" + "".join(_td(v) for v in row) + "</tr>")
    return f"<table>\n<tr>{head}</tr>\n" + "\n".join(body) + "\n</table>"


def html_figure(figure: plots.Figure, alt: str) -> str:
    """A figure inline, `alt` its accessible name."""
    return figure.svg(title=alt, standalone=False)


def _page(title: str, passed: bool, body: list[str]) -> str:
    verdict = "pass" if passed else "fail"
    return "\n".join(["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
                      f"<title>{_esc(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
                      f'<h1 class="{verdict}">{_esc(title)}</h1>', *body, "</body>", "</html>", ""])


def _model(run: dict) -> str:
    """The report's first line (formatting.model_line) with the model path as code."""
    line = _esc(model_line(run))
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", line, count=1)


def _run_facts(run: dict) -> list[str]:
    parts = ["<h2>Run</h2>"]
    if run.get("batches") is not None:
        speed = f"{run['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in run else \
            f"{run['questions_per_s']:,.1f} questions/s" if "questions_per_s" in run else "speed not recorded"
        parts.append(f"<p>{run.get('batches')} batches, padding waste {run.get('padding_waste', 0):.1%}, "
                     f"{speed}.</p>")
    for key, values in (("Timings", report_timings(run)), ("Versions", versions_of(run))):
        if values:
            parts.append(f"<p>{key}: " + ", ".join(
                f"{_esc(k)} {v:.2f}" if isinstance(v, float) else f"{_esc(k)} {_esc(v)}"
                for k, v in values.items()) + "</p>")
    if run.get("arguments"):
        args = pd.DataFrame({"argument": list(run["arguments"]),
                             "value": [json.dumps(v) for v in run["arguments"].values()]})
        parts.append("<details><summary>Arguments</summary>" + html_table(args) + "</details>")
    inputs = (run.get("fingerprint") or {}).get("files")
    if inputs:
        files = pd.DataFrame({"input": list(inputs), "fingerprint": list(inputs.values())})
        parts.append("<details><summary>Input files</summary>" + html_table(files) + "</details>")
    return parts


# ---- compare ------------------------------------------------------------------------------------------------


def compare_html(result) -> str:
    """report.html of a compare run (a CompareResult, fresh or read back with read_run)."""
    summary, samples, tokens, run = result.summary, result.samples, result.tokens, result.run
    args = run.get("arguments", {})
    failed = [not bool(p) for p in summary["passed"]]
    verdict = compare_verdict(summary, result.gates)
    body = [f"<p>{_model(run)}; {_esc(thresholds_sentence(args))}. Per token <code>d = ref - engine</code> over "
            "masked positions.</p>",
            "<h2>Summary</h2>", html_table(summary[shown_columns(summary)], failed),
            "<h2>Gates</h2>", "<ul>" + "".join(f"<li>{_esc(line)}</li>" for line in gate_lines(result.gates, run))
            + "</ul>"]
    if len(result.gates):
        body.append(html_table(result.gates, [not bool(a) for a in result.gates["applied"]]))
    has_sampler = "sampler_k2" in summary.columns and summary["sampler_k2"].notna().any()
    if has_sampler:
        floor = summary[["adapter", "mean_abs_diff", "sampler_mean_abs_diff", "k2", "sampler_k2", "max_abs_diff",
                         "sampler_max_abs_diff"]]
        body += ["<h2>Engine beside the sampler's noise floor</h2>",
                 "<p>The sampler columns compare the reference with the logprobs the original sampler reported "
                 "(<code>ref - sampler</code>): the mismatch a serving stack already lives with.</p>",
                 html_table(floor), html_figure(plots.noise_floor(summary, tokens),
                                                "engine and sampler mismatch per adapter")]
    if len(result.routing):
        body += ["<h2>Routing against the sampler's routed experts</h2>",
                 "<p>Share of scored positions whose top-k expert set differs from the sampler's, per MoE layer.</p>",
                 html_table(routing_by_layer(result.routing))]
    body += ["<h2>|d| per token</h2>",
             html_figure(plots.abs_diff_histogram(tokens), "histogram of |d| per adapter"),
             "<h2>d by position</h2>", html_figure(plots.diff_by_position(tokens), "d by position"),
             "<h2>k2 per sample</h2>",
             html_figure(plots.k2_per_sample(samples, args.get("max_k2")), "k2 per sample")]
    worst = result.worst
    if len(worst):
        source = (f"decoded with the tokenizer in <code>{_esc(run['tokenizer'])}</code>" if run.get("tokenizer")
                  else "token ids in brackets (no tokenizer in the model folder)")
        rows = []
        for r in worst.itertuples():
            sampler = "" if pd.isna(r.sampler) else _td(r.sampler)
            rows.append(f"<tr>{_td(r.adapter)}{_td(r.sample_id)}{_td(r.position)}{_td(r.token_id)}"
                        f'<td class="text"><span class="ctx">{_esc(shown_text(r.context))}</span>'
                        f"<mark>{_esc(shown_text(r.token))}</mark></td>{_td(r.ref)}{_td(r.engine)}{_td(r.d)}"
                        f"{sampler}</tr>")
        sampler_head = "<th>sampler</th>" if worst["sampler"].notna().any() else ""
        body += [f"<h2>Worst tokens by |d| ({WORST_PER_ADAPTER} per adapter)</h2>",
                 f"<p class=\"note\">Context, then the predicted token highlighted; {source}.</p>",
                 "<table>\n<tr><th>adapter</th><th>sample_id</th><th>position</th><th>token_id</th>"
                 f"<th>context + token</th><th>ref</th><th>engine</th><th>d</th>{sampler_head}</tr>\n"
                 + "\n".join(rows) + "\n</table>"]
    top = samples.sort_values("k2", ascending=False).head(10)
    body += ["<h2>Worst samples by k2</h2>",
             html_table(top[["adapter", "sample_id", "n_tokens", "mean_abs_diff", "max_abs_diff", "k2"]])]
    body += _run_facts(run)
    return _page(f"lora-eval compare: {verdict}", result.passed, body)


# ---- MMLU ---------------------------------------------------------------------------------------------------


def answer_changes(questions: pd.DataFrame) -> pd.DataFrame:
    """Per adapter, against the base model on the same questions: both right, fixed, broken, both wrong."""
    keys = ["subject", "question_index"]
    base = questions[questions["model"] == BASE][keys + ["correct"]].rename(columns={"correct": "base_correct"})
    rows = []
    for model, part in questions[questions["model"] != BASE].groupby("model", sort=False):
        joined = part.merge(base, on=keys, how="inner")
        right, base_right = joined["correct"].astype(bool), joined["base_correct"].astype(bool)
        rows.append(dict(model=model, questions=len(joined), both_right=int((right & base_right).sum()),
                         fixed=int((right & ~base_right).sum()), broken=int((~right & base_right).sum()),
                         both_wrong=int((~right & ~base_right).sum())))
    return pd.DataFrame(rows, columns=["model", "questions", "both_right", "fixed", "broken", "both_wrong"])


def mmlu_html(run) -> str:
    """report.html of an MMLU run (an MmluResult, fresh or read back with read_run): the summary with
    pass/fail, and the adapter - base differences by group and per subject with their 95% intervals."""
    summary, subjects, args = run.summary, run.subjects, run.run.get("arguments", {})
    failed = [not bool(p) for p in summary["passed"]]
    body = [f"<p>{_model(run.run)}; {_esc(run.run.get('questions'))} {_esc(args.get('split'))} questions, "
            f"{_esc(args.get('shots'))}-shot; "
            f"{_esc(threshold_text('max drop', args.get('max_drop'), ' points of micro accuracy'))}. "
            "Deltas (adapter - base, in points) are paired per question, with 95% intervals (Agresti-Min).</p>",
            "<h2>Summary</h2>", html_table(display_table(summary), failed),
            html_figure(plots.mmlu_group_deltas(summary), "accuracy difference to base by group"),
            "<h2>Per subject: adapter - base</h2>",
            html_figure(plots.mmlu_subject_deltas(subjects), "per-subject accuracy difference to base")]
    if len(run.questions):
        body += ["<h2>Answers changed against base</h2>",
                 "<p><code>fixed</code>: base wrong, adapter right; <code>broken</code>: base right, adapter "
                 "wrong.</p>", html_table(answer_changes(run.questions))]
    significant = significance_rows(run.questions)
    body += ["<h2>Subjects that differ from base</h2>", f'<p class="note">{_esc(significance_note())}</p>',
             html_table(significant) if len(significant) else "<p>None.</p>",
             "<details><summary>All subjects</summary>" + html_table(with_p_values(subjects, run.questions)) +
             "</details>"]
    body += _run_facts(run.run)
    return _page(f"lora-eval mmlu: {mmlu_verdict(summary, args.get('max_drop'))}", not any(failed), body)
