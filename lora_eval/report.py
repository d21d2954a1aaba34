"""Rendering results for people: the summary as a terminal table and the run as a Markdown report."""

from __future__ import annotations

import pandas as pd

SHOWN = ["adapter", "n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error",
         "passed", "failed"]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (bool,)) or str(value) in ("True", "False"):
        return "PASS" if value else "FAIL"
    return str(value)


def markdown_table(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(_cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def summary_table(summary: pd.DataFrame) -> str:
    """The summary for the terminal: fixed-width columns, PASS/FAIL, which threshold failed."""
    shown = summary[[c for c in SHOWN if c in summary.columns]]
    cells = [list(shown.columns)] + [[_cell(v) for v in row] for row in shown.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def markdown_report(result) -> str:
    """report.md of a compare run: verdict, summary, noise floor, worst samples, run facts."""
    summary, run = result.summary, result.run
    args = run.get("arguments", {})
    verdict = "PASSED" if result.passed else "FAILED: " + "; ".join(
        f"{r.adapter} ({r.failed})" for r in summary.itertuples() if not r.passed)
    lines = [f"# lora-eval compare: {verdict}", "",
             f"Model `{args.get('model')}`, dtype {args.get('dtype')}, device {args.get('device')}; "
             f"thresholds: k2 <= {args.get('max_k2')}, mean_abs_diff <= {args.get('max_mean_abs_diff')}.", "",
             "## Summary", "", markdown_table(summary[[c for c in SHOWN if c in summary.columns]]), ""]
    sampler_cols = [c for c in summary.columns if c.startswith("sampler_")]
    if sampler_cols:
        lines += ["## Sampler noise floor (reference - sampler)", "",
                  markdown_table(summary[["adapter", "sampler_mean_abs_diff", "sampler_k2", "sampler_max_abs_diff"]]),
                  ""]
    worst = result.samples.sort_values("k2", ascending=False).head(10)
    lines += ["## Worst samples by k2", "",
              markdown_table(worst[["adapter", "sample_id", "n_tokens", "mean_abs_diff", "max_abs_diff", "k2"]]), ""]
    lines += _worst_tokens_section(getattr(result, "worst", None), run)
    lines += ["## Run", "",
              f"{run.get('batches')} batches, padding waste {run.get('padding_waste', 0):.1%}, "
              f"{run.get('tokens_per_s', 0):,.0f} tokens/s; timings " +
              ", ".join(f"{k} {v:.2f}" for k, v in run.get("timings", {}).items()), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items()), ""]
    return "\n".join(lines)


def _worst_tokens_section(worst, run: dict) -> list[str]:
    """Worst tokens by |d|: context, then the predicted token in brackets (newlines shown as a symbol)."""
    if worst is None or not len(worst):
        return []
    from .html_report import shown_text

    source = f"decoded with the tokenizer in `{run['tokenizer']}`" if run.get("tokenizer") else \
        "token ids in brackets (no tokenizer in the model folder)"
    shown = worst[["adapter", "sample_id", "position", "token_id"]].assign(
        text=[(shown_text(c) + "\u27e6" + shown_text(t) + "\u27e7").replace("|", "\\|")
              for c, t in zip(worst["context"], worst["token"])],
        ref=worst["ref"], engine=worst["engine"], d=worst["d"])
    return ["## Worst tokens by |d|", "", f"Context, then the predicted token in \u27e6brackets\u27e7; {source}.", "",
            markdown_table(shown), ""]
