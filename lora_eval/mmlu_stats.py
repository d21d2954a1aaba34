"""MMLU tables: per question, per subject and the summary, with paired deltas to the base model.

The prediction is the letter with the highest log-probability (ties: the first letter). Every question is answered
by the base model and each adapter, so differences are paired: per question d = c_adapter - c_base in {-1, 0, 1};
delta = mean(d) (accuracy difference as a fraction), 95% interval delta +- 1.96 * sd(d) / sqrt(n) (sd with n-1; NaN
for n < 2). Per subject and per category (micro over the category's questions, as the paper reports categories)
and overall micro; macro = mean of the subject deltas, its standard error sqrt(sum se_s^2) / S (subjects
independent). `max_drop` is in percentage points of micro accuracy: an adapter fails when
100 * (base - adapter) > max_drop.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .mmlu_data import CATEGORIES, LETTERS
from .names import BASE
from .results import MMLU_SUMMARY_COLUMNS, QUESTION_COLUMNS, SUBJECT_COLUMNS

Z95 = 1.96
GROUPS = ("micro", "macro", "STEM", "humanities", "social sciences", "other")


def question_table(questions: pd.DataFrame, models: list[str], lp: np.ndarray) -> pd.DataFrame:
    """One row per (model, question); lp [questions, models, 4] log-probabilities of A-D."""
    parts = []
    for m, name in enumerate(models):
        scores = lp[:, m, :].astype(np.float64)  # [Q, 4]
        prediction = np.array(LETTERS, dtype=object)[scores.argmax(axis=1)] if len(scores) else []
        part = pd.DataFrame(dict(subject=questions["subject"].to_numpy(),
                                 category=questions["subject"].map(CATEGORIES).to_numpy(),
                                 question_index=questions["question_index"].to_numpy(), model=name,
                                 answer=questions["answer"].to_numpy(), prediction=prediction))
        part["correct"] = (part["prediction"] == part["answer"]).astype(bool)
        for j, x in enumerate(LETTERS):
            part[f"lp_{x}"] = scores[:, j]
        parts.append(part)
    return pd.concat(parts, ignore_index=True)[QUESTION_COLUMNS]


def paired_delta(diff: np.ndarray) -> tuple[float, float]:
    """Mean of per-question differences d = c_adapter - c_base and its standard error sd(d, n-1) / sqrt(n)."""
    n = len(diff)
    if n == 0:
        return math.nan, math.nan
    return float(np.mean(diff)), float(np.std(diff, ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def interval(delta: float, se: float) -> tuple[float, float]:
    return delta - Z95 * se, delta + Z95 * se


def _with_diff(questions: pd.DataFrame) -> pd.DataFrame:
    """The question table plus `diff` = correct - the base model's correct on the same question (NaN for base)."""
    base = questions.loc[questions["model"] == BASE, ["subject", "question_index", "correct"]]
    merged = questions.merge(base.rename(columns={"correct": "base_correct"}), on=["subject", "question_index"],
                             how="left", validate="many_to_one")
    merged["diff"] = merged["correct"].astype(float) - merged["base_correct"].astype(float)
    merged.loc[merged["model"] == BASE, "diff"] = math.nan
    return merged


def _stats(group: pd.DataFrame, model: str) -> dict:
    """questions, correct, accuracy and (adapters) the paired delta, its se and 95% interval of some rows."""
    delta, se = paired_delta(group["diff"].to_numpy()) if model != BASE else (math.nan, math.nan)
    low, high = interval(delta, se)
    return dict(questions=len(group), correct=int(group["correct"].sum()), accuracy=float(group["correct"].mean()),
                delta=delta, delta_low=low, delta_high=high, se=se)


def _subject_stats(with_diff: pd.DataFrame) -> pd.DataFrame:
    rows = [dict(subject=subject, category=category, model=model, **_stats(group, model))
            for (subject, category, model), group in with_diff.groupby(["subject", "category", "model"], sort=False)]
    return _model_order(pd.DataFrame(rows, columns=[*SUBJECT_COLUMNS, "se"]), with_diff)


def subject_table(questions: pd.DataFrame) -> pd.DataFrame:
    """Per (subject, model): questions, correct, accuracy, and the paired delta to base with its 95% interval."""
    return _subject_stats(_with_diff(questions))[SUBJECT_COLUMNS]


def summary_table(questions: pd.DataFrame, max_drop: float | None = None) -> pd.DataFrame:
    """Per model: micro (all questions), macro (mean over subjects) and each category present (micro inside it),
    with paired deltas to base; `passed` False for an adapter whose micro drop exceeds `max_drop` points."""
    with_diff = _with_diff(questions)
    subjects = _subject_stats(with_diff)
    rows = []
    for model, group in with_diff.groupby("model", sort=False):
        mine = subjects[subjects["model"] == model]
        macro = dict(questions=len(group), accuracy=float(mine["accuracy"].mean()), delta=math.nan, se=math.nan)
        if model != BASE:  # subjects are independent: the variance of the mean is sum(se_s^2) / S^2
            macro.update(delta=float(mine["delta"].mean()), se=math.sqrt(float((mine["se"] ** 2).sum())) / len(mine))
        macro["delta_low"], macro["delta_high"] = interval(macro["delta"], macro["se"])
        ok = passes(group, max_drop) if model != BASE else True
        rows.append(dict(model=model, group="micro", **_stats(group, model), passed=ok))
        rows.append(dict(model=model, group="macro", **macro, passed=ok))
        for category in GROUPS[2:]:
            inside = group[group["category"] == category]
            if len(inside):
                rows.append(dict(model=model, group=category, **_stats(inside, model), passed=ok))
    return _model_order(pd.DataFrame(rows), with_diff)[MMLU_SUMMARY_COLUMNS]


def passes(rows: pd.DataFrame, max_drop: float | None) -> bool:
    """False when an adapter's micro accuracy over `rows` (its rows with `base_correct`) is more than
    `max_drop` percentage points below base's; exact in counts: 100 * (base - adapter correct) > max_drop * n."""
    if max_drop is None:
        return True
    drop = int(rows["base_correct"].sum()) - int(rows["correct"].sum())
    return not 100 * drop > max_drop * len(rows)


def _model_order(frame: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """Rows in the order models first appear in `reference` (base first), stable otherwise."""
    order = {m: i for i, m in enumerate(reference["model"].unique())}
    return frame.sort_values("model", key=lambda s: s.map(order), kind="stable").reset_index(drop=True)
