"""report.html: one self-contained page per run (tables + PNG plots embedded as base64), and reading a saved
run folder back so `lora-eval report` can re-render it without recomputing anything.

Rendering is deterministic: the page holds no clock time (only what run.json holds) and the PNGs carry no
metadata, so re-rendering a run folder gives the same bytes as the report written with the run.
A compare run folder holds summary.csv, samples.csv, tokens.parquet, worst_tokens.parquet and run.json;
an MMLU run folder holds mmlu_summary.csv, mmlu_subjects.csv, mmlu_questions.parquet and run.json.
"""

from __future__ import annotations

import base64
import html
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import InputError
from .report import SHOWN, _cell

WORST_PER_ADAPTER = 5  # worst tokens listed per adapter
CONTEXT_TOKENS = 12  # tokens of context shown before a worst token
COMPARE_FILES = ("summary.csv", "samples.csv", "tokens.parquet", "run.json")
MMLU_FILES = ("mmlu_summary.csv", "mmlu_subjects.csv", "mmlu_questions.parquet", "run.json")
NEWLINE = "\u23ce"  # shown for a newline inside token text

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 70em;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1.pass { color: #1a7f37; } h1.fail { color: #cf222e; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; font-size: 0.85em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: right; white-space: nowrap; }
th { background: #f6f8fa; } td.text { text-align: left; white-space: pre-wrap; font-family: monospace; }
tr.fail td { background: #ffebe9; } td.PASS { color: #1a7f37; font-weight: bold; }
td.FAIL { color: #cf222e; font-weight: bold; } mark { background: #ffd8a8; } .ctx { color: #57606a; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em 0; } code { background: #f6f8fa; padding: 0 0.2em; }
p.note { color: #57606a; font-size: 0.9em; }
"""


# ---- worst tokens (computed by compare, saved as worst_tokens.parquet) --------------------------------------


def load_tokenizer(model_dir):
    """The model folder's tokenizer, or None when it has none (token ids are shown instead)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None  # an unreadable tokenizer only costs the decoded text
    finally:
        hf_logging.set_verbosity(verbosity)


def worst_tokens(tokens: pd.DataFrame, input_ids: dict[str, list[int]], tokenizer=None,
                 per_adapter: int = WORST_PER_ADAPTER, context: int = CONTEXT_TOKENS) -> pd.DataFrame:
    """The `per_adapter` masked tokens with the largest |d| of each adapter, with the decoded token and the
    `context` tokens before it (token ids in brackets when there is no tokenizer)."""
    columns = ["adapter", "sample_id", "position", "token_id", "token", "context", "ref", "engine", "d",
               "sampler"]
    masked = tokens[tokens["mask"].astype(bool)].assign(abs_d=lambda t: t["d"].abs())
    rows = []
    for _, group in masked.groupby("adapter", sort=False):
        top = group.sort_values(["abs_d", "sample_id", "position"], ascending=[False, True, True],
                                kind="mergesort").head(per_adapter)
        for row in top.itertuples():
            ids = list(input_ids[row.sample_id])
            p = int(row.position)  # predicts ids[p + 1] from ids[:p + 1]
            rows.append(dict(adapter=row.adapter, sample_id=row.sample_id, position=p, token_id=int(row.token_id),
                             token=_decode(tokenizer, [ids[p + 1]]),
                             context=_decode(tokenizer, ids[max(0, p + 1 - context):p + 1]),
                             ref=row.ref, engine=row.engine, d=row.d, sampler=row.sampler))
    return pd.DataFrame(rows, columns=columns)


def _decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return "".join(f"[{i}]" for i in ids)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def shown_text(text: str) -> str:
    """Token text with newlines and tabs made visible."""
    return str(text).replace("\n", NEWLINE).replace("\t", "\u21e5")


# ---- reading a run folder back ------------------------------------------------------------------------------


def run_kind(run_dir: str | Path) -> str:
    """'compare' or 'mmlu', from the files present in the run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(run_dir, "run folder not found")
    for kind, files in (("compare", COMPARE_FILES), ("mmlu", MMLU_FILES)):
        if all((run_dir / name).is_file() for name in files):
            return kind
    raise InputError(run_dir, f"not a run folder: expected the files of a compare run ({', '.join(COMPARE_FILES)}) "
                     f"or of an mmlu run ({', '.join(MMLU_FILES)})")


def _read_run_json(run_dir: Path) -> dict:
    try:
        run = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(run_dir / "run.json", f"not valid JSON ({e})") from None
    if not isinstance(run, dict):
        raise InputError(run_dir / "run.json", f"expected a JSON object, found {type(run).__name__}")
    return run


def _require(frame: pd.DataFrame, path: Path, columns: list[str]) -> pd.DataFrame:
    """A saved table with the columns the reports read, or an error naming the first missing one."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(path, "missing column (was this file written by lora-eval?)", key=missing[0])
    return frame


def _read_csv(path: Path, text: list[str]) -> pd.DataFrame:
    """A saved table as written: `text` columns as exact strings ('' stays '', 'NA' stays 'NA'), empty cells of
    the other columns as NaN (how to_csv writes NaN); float columns round-trip exactly."""
    try:
        header = pd.read_csv(path, nrows=0).columns
        frame = pd.read_csv(path, dtype={c: str for c in text if c in header}, keep_default_na=False,
                            na_values={c: [""] for c in header if c not in text})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise InputError(path, f"not a readable CSV file ({e})") from None
    for column in text:
        if column in frame:
            frame[column] = frame[column].astype(object)
    return frame


def _read_parquet(path: Path) -> pd.DataFrame:
    import pyarrow as pa

    try:
        return pd.read_parquet(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(path, f"not a readable Parquet file ({e})") from None


def read_compare_run(run_dir: str | Path):
    """The CompareResult a compare run folder was written from (tables as saved, run.json as saved)."""
    from .compare import CompareResult

    from .compare import SUMMARY_COLUMNS

    run_dir = Path(run_dir)
    summary = _require(_read_csv(run_dir / "summary.csv", ["adapter", "failed"]), run_dir / "summary.csv",
                       SUMMARY_COLUMNS)
    samples = _require(_read_csv(run_dir / "samples.csv", ["adapter", "sample_id"]), run_dir / "samples.csv",
                       ["adapter", "sample_id"])
    tokens = _require(_read_parquet(run_dir / "tokens.parquet"), run_dir / "tokens.parquet",
                      ["adapter", "sample_id", "position", "d", "mask"])
    worst_path = run_dir / "worst_tokens.parquet"
    worst = _read_parquet(worst_path) if worst_path.is_file() else pd.DataFrame()
    for frame in (tokens, worst):
        for column in ("adapter", "sample_id", "token", "context"):
            if column in frame:
                frame[column] = frame[column].astype(object)
    return CompareResult(summary=summary, samples=samples, tokens=tokens, run=_read_run_json(run_dir), worst=worst)


def read_mmlu_run(run_dir: str | Path):
    """The MmluResult an MMLU run folder was written from (tables and run.json as saved)."""
    from .mmlu import MmluResult

    from .mmlu import QUESTION_COLUMNS, SUBJECT_COLUMNS, SUMMARY_COLUMNS

    run_dir = Path(run_dir)
    summary = _require(_read_csv(run_dir / "mmlu_summary.csv", ["model", "group"]), run_dir / "mmlu_summary.csv",
                       SUMMARY_COLUMNS)
    subjects = _require(_read_csv(run_dir / "mmlu_subjects.csv", ["subject", "category", "model"]),
                        run_dir / "mmlu_subjects.csv", SUBJECT_COLUMNS)
    questions = _require(_read_parquet(run_dir / "mmlu_questions.parquet"), run_dir / "mmlu_questions.parquet",
                         QUESTION_COLUMNS)
    for frame in (questions,):
        for column in ("model", "subject", "category", "answer", "prediction"):
            if column in frame:
                frame[column] = frame[column].astype(object)
    return MmluResult(questions=questions, subjects=subjects, summary=summary, run=_read_run_json(run_dir))


def read_run(run_dir: str | Path):
    """A compare run as CompareResult or an MMLU run as MmluResult, by the files present."""
    return read_compare_run(run_dir) if run_kind(run_dir) == "compare" else read_mmlu_run(run_dir)


# ---- HTML building blocks -----------------------------------------------------------------------------------


def _esc(value) -> str:
    return html.escape(str(value), quote=True)


def _td(value) -> str:
    """A cell: numbers shown as in report.md, full precision in the title; PASS/FAIL marked."""
    if isinstance(value, (bool, np.bool_)):
        word = "PASS" if value else "FAIL"
        return f'<td class="{word}">{word}</td>'
    if isinstance(value, (float, np.floating)):
        return f'<td title="{float(value)!r}">{_esc(_cell(float(value)))}</td>'
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


def html_image(png_bytes: bytes, alt: str) -> str:
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{base64.b64encode(png_bytes).decode("ascii")}">'


def _page(title: str, passed: bool, body: list[str]) -> str:
    verdict = "pass" if passed else "fail"
    return "\n".join(["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
                      f"<title>{_esc(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
                      f'<h1 class="{verdict}">{_esc(title)}</h1>', *body, "</body>", "</html>", ""])


def _run_facts(run: dict) -> list[str]:
    parts = ["<h2>Run</h2>"]
    if run.get("batches") is not None:
        speed = f"{run['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in run else \
            f"{run['questions_per_s']:,.1f} questions/s" if "questions_per_s" in run else "speed not recorded"
        parts.append(f"<p>{run.get('batches')} batches, padding waste {run.get('padding_waste', 0):.1%}, "
                     f"{speed}.</p>")
    for key in ("timings", "versions"):
        if run.get(key):
            parts.append(f"<p>{key.capitalize()}: " + ", ".join(
                f"{_esc(k)} {v:.2f}" if isinstance(v, float) else f"{_esc(k)} {_esc(v)}"
                for k, v in run[key].items()) + "</p>")
    if run.get("arguments"):
        args = pd.DataFrame({"argument": list(run["arguments"]),
                             "value": [json.dumps(v) for v in run["arguments"].values()]})
        parts.append("<details><summary>Arguments</summary>" + html_table(args) + "</details>")
    if run.get("files"):
        files = pd.DataFrame({"file": list(run["files"]), "sha256 or size": list(run["files"].values())})
        parts.append("<details><summary>Input files</summary>" + html_table(files) + "</details>")
    return parts


# ---- compare ------------------------------------------------------------------------------------------------


def compare_html(result) -> str:
    """report.html of a compare run (a CompareResult, fresh or read back with read_compare_run)."""
    from . import plots

    summary, samples, tokens, run = result.summary, result.samples, result.tokens, result.run
    args = run.get("arguments", {})
    failed = [not bool(p) for p in summary["passed"]]
    verdict = "PASSED" if not any(failed) else "FAILED: " + "; ".join(
        f"{r.adapter} ({r.failed})" for r, bad in zip(summary.itertuples(), failed) if bad)
    body = [f"<p>Model <code>{_esc(args.get('model'))}</code>, dtype {_esc(args.get('dtype'))}, device "
            f"{_esc(args.get('device'))}; thresholds: k2 &le; {_esc(args.get('max_k2'))}, mean_abs_diff &le; "
            f"{_esc(args.get('max_mean_abs_diff'))}. Per token <code>d = ref - engine</code> over masked "
            "positions.</p>",
            "<h2>Summary</h2>", html_table(summary[[c for c in SHOWN if c in summary.columns]], failed)]
    has_sampler = "sampler_k2" in summary.columns and summary["sampler_k2"].notna().any()
    if has_sampler:
        floor = summary[["adapter", "mean_abs_diff", "sampler_mean_abs_diff", "k2", "sampler_k2", "max_abs_diff",
                         "sampler_max_abs_diff"]]
        body += ["<h2>Engine beside the sampler's noise floor</h2>",
                 "<p>The sampler columns compare the reference with the logprobs the original sampler reported "
                 "(<code>ref - sampler</code>): the mismatch a serving stack already lives with.</p>",
                 html_table(floor), html_image(plots.png(plots.noise_floor(summary, tokens)),
                                               "engine and sampler mismatch per adapter")]
    body += ["<h2>|d| per token</h2>",
             html_image(plots.png(plots.abs_diff_histogram(tokens)), "histogram of |d| per adapter"),
             "<h2>d by position</h2>", html_image(plots.png(plots.diff_by_position(tokens)), "d by position"),
             "<h2>k2 per sample</h2>",
             html_image(plots.png(plots.k2_per_sample(samples, args.get("max_k2"))), "k2 per sample")]
    worst = getattr(result, "worst", None)
    if worst is not None and len(worst):
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
    return _page(f"lora-eval compare: {verdict}", not any(failed), body)


# ---- MMLU ---------------------------------------------------------------------------------------------------


def answer_changes(questions: pd.DataFrame) -> pd.DataFrame:
    """Per adapter, against the base model on the same questions: both right, fixed, broken, both wrong."""
    keys = ["subject", "question_index"]
    base = questions[questions["model"] == "base"][keys + ["correct"]].rename(columns={"correct": "base_correct"})
    rows = []
    for model, part in questions[questions["model"] != "base"].groupby("model", sort=False):
        joined = part.merge(base, on=keys, how="inner")
        right, base_right = joined["correct"].astype(bool), joined["base_correct"].astype(bool)
        rows.append(dict(model=model, questions=len(joined), both_right=int((right & base_right).sum()),
                         fixed=int((right & ~base_right).sum()), broken=int((~right & base_right).sum()),
                         both_wrong=int((~right & ~base_right).sum())))
    return pd.DataFrame(rows, columns=["model", "questions", "both_right", "fixed", "broken", "both_wrong"])


def mmlu_html(run) -> str:
    """report.html of an MMLU run (an MmluResult, fresh or read back with read_mmlu_run): the summary with
    pass/fail, and the adapter - base differences by group and per subject with their 95% intervals."""
    from . import plots
    from .mmlu import BASE, display_table, verdict

    summary, subjects, args = run.summary, run.subjects, run.run.get("arguments", {})
    failed = [not bool(p) for p in summary["passed"]]
    body = [f"<p>Model <code>{_esc(args.get('model'))}</code>, dtype {_esc(args.get('dtype'))}, device "
            f"{_esc(args.get('device'))}; {_esc(run.run.get('questions'))} {_esc(args.get('split'))} questions, "
            f"{_esc(args.get('shots'))}-shot; max drop {_esc(args.get('max_drop'))} points of micro accuracy. "
            "Deltas (adapter - base, in points) are paired per question, with 95% intervals.</p>",
            "<h2>Summary</h2>", html_table(display_table(summary), failed),
            html_image(plots.png(plots.mmlu_group_deltas(summary)), "accuracy difference to base by group"),
            "<h2>Per subject: adapter - base</h2>",
            html_image(plots.png(plots.mmlu_subject_deltas(subjects)), "per-subject accuracy difference to base")]
    if len(run.questions):
        body += ["<h2>Answers changed against base</h2>",
                 "<p><code>fixed</code>: base wrong, adapter right; <code>broken</code>: base right, adapter "
                 "wrong.</p>", html_table(answer_changes(run.questions))]
    rows = subjects[subjects["model"] != BASE]
    clear = rows[(rows["delta_low"] > 0) | (rows["delta_high"] < 0)].sort_values(["model", "delta", "subject"])
    body += ["<h2>Subjects whose interval excludes 0</h2>",
             html_table(clear) if len(clear) else "<p>None.</p>",
             "<details><summary>All subjects</summary>" + html_table(subjects) + "</details>"]
    body += _run_facts(run.run)
    return _page(f"lora-eval mmlu: {verdict(run, args.get('max_drop'))}", not any(failed), body)


# ---- re-rendering -------------------------------------------------------------------------------------------


def render(run_dir: str | Path, fmt: str = "html") -> str:
    """The report of a saved run folder, from its files alone (equal to the report written with the run)."""
    kind = run_kind(run_dir)
    if fmt not in ("html", "md"):
        raise InputError("--format", f"'{fmt}' is not one of html, md")
    if kind == "compare":
        from .report import markdown_report

        result = read_compare_run(run_dir)
        return compare_html(result) if fmt == "html" else markdown_report(result)
    from .mmlu import markdown_report

    result = read_mmlu_run(run_dir)
    return mmlu_html(result) if fmt == "html" else markdown_report(result)
