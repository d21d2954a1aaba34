"""MMLU tables: per question, per subject and the summary, with paired deltas to the base model.

The prediction is the letter with the highest log-probability (ties: the first letter). Every question is answered
by the base model and each adapter, so differences are paired: per question d = c_adapter - c_base in {-1, 0, 1};
of n questions, `fixed` have d = 1 and `broken` d = -1 (the discordant pairs). delta = mean(d) = (fixed - broken) / n,
the accuracy difference as a fraction.

95% interval: Agresti and Min's (2005, "Simple improved confidence intervals for comparing matched proportions",
Stat Med 24:729): the Wald interval of the paired difference after adding 1/2 to each of the four cells of the
2x2 table, clipped to [-1, 1]. The plain Wald interval delta +- 1.96 sd(d) / sqrt(n) has no width where every d is
the same (two questions both broken give [-1, -1], "excluding 0" from two questions) and undercovers for small n;
Agresti-Min's covers near 95% for small n, and for MMLU's 14,042 questions it is Wald's moved by at most
2 |delta| / (n + 2) (a hundredth of a point or less: the added half questions are 2 of 14,044). Per subject and
per category (micro over the category's questions, as the paper reports categories) and overall micro; macro = mean of the subject deltas, its standard error
sqrt(sum se_s^2) / S (subjects independent, se_s Agresti-Min's).

Significance (which subjects a report says differ from base): the exact two-sided McNemar test, i.e. the sign test
on the discordant questions (under no difference each is fixed or broken with probability 1/2), p < ALPHA. It is
exact at any n, where any interval's coverage is only approximate at small n (Agresti-Min's of 3 questions all
broken is [-1, -0.02], while p = 0.25); the concordant questions carry no information about the difference. With
every discordant question on one side p = 2 * 0.5^k, so a subject needs at least MIN_SIGNIFICANT = 6 discordant
questions (hence 6 questions) to be reported at all: 5 give p = 0.0625. The reports show each subject's p beside
its interval, and list as different from base only the subjects with p < ALPHA.

`max_drop` is in percentage points of micro accuracy: an adapter fails when 100 * (base - adapter) > max_drop.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..inputs.mmlu_data import CATEGORIES, LETTERS
from ..names import BASE
from .tables import MMLU_SUMMARY_COLUMNS, QUESTION_COLUMNS, SUBJECT_COLUMNS

Z95 = 1.96
ALPHA = 0.05  # the exact McNemar test's level for "differs from base"
MIN_SIGNIFICANT = 6  # the fewest discordant questions that can reach p < ALPHA: 2 * 0.5^6 = 0.031, 2 * 0.5^5 = 0.0625
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


def paired_interval(fixed: int, broken: int, n: int) -> tuple[float, float, float]:
    """(low, high, se) of the Agresti-Min 95% interval of the paired difference (fixed - broken) / n (module
    docstring); NaN for n = 0."""
    if n == 0:
        return math.nan, math.nan, math.nan
    total = n + 2  # half a question added to each of the four cells
    up, down = (fixed + 0.5) / total, (broken + 0.5) / total
    centre = up - down
    se = math.sqrt(max(up + down - centre * centre, 0.0) / total)
    return max(centre - Z95 * se, -1.0), min(centre + Z95 * se, 1.0), se


def mcnemar_p(fixed: int, broken: int) -> float:
    """The exact two-sided McNemar p-value (the sign test on the discordant questions): 2 * P(X <= min) for
    X ~ Binomial(fixed + broken, 1/2), at most 1; 1 where no question changed. Exact integers (each binomial
    coefficient from the one before), so 14,042 discordant questions cost milliseconds and lose nothing to rounding."""
    k = fixed + broken
    term = tail = 1  # C(k, 0)
    for i in range(min(fixed, broken)):
        term = term * (k - i) // (i + 1)  # C(k, i + 1), exact
        tail += term
    return min(1.0, 2 * tail / 2 ** k)


def interval(delta: float, se: float) -> tuple[float, float]:
    """delta +- 1.96 se, clipped to [-1, 1] (macro's interval, from the subjects' Agresti-Min se); NaN for NaN."""
    return max(delta - Z95 * se, -1.0), min(delta + Z95 * se, 1.0)


def discordant(diff: np.ndarray) -> tuple[int, int]:
    """(fixed, broken): how many questions the adapter gets right where base is wrong, and the reverse."""
    return int((diff > 0).sum()), int((diff < 0).sum())


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
    delta = low = high = se = math.nan
    if model != BASE:
        diff = group["diff"].to_numpy()
        fixed, broken = discordant(diff)
        delta = (fixed - broken) / len(diff)
        low, high, se = paired_interval(fixed, broken, len(diff))
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


def subject_tests(questions: pd.DataFrame) -> pd.DataFrame:
    """Per (adapter, subject): questions, fixed, broken, delta and the exact McNemar p_value; adapters in order."""
    with_diff = _with_diff(questions)
    rows = []
    for (model, subject), group in with_diff[with_diff["model"] != BASE].groupby(["model", "subject"], sort=False):
        fixed, broken = discordant(group["diff"].to_numpy())
        rows.append(dict(model=model, subject=subject, questions=len(group), fixed=fixed, broken=broken,
                         delta=(fixed - broken) / len(group), p_value=mcnemar_p(fixed, broken)))
    return pd.DataFrame(rows, columns=["model", "subject", "questions", "fixed", "broken", "delta", "p_value"])


def significant_subjects(questions: pd.DataFrame) -> pd.DataFrame:
    """The subject_tests rows whose answers differ from base's by the exact McNemar test, p < ALPHA (so at least
    MIN_SIGNIFICANT questions changed); adapters in order, then by p."""
    tests = subject_tests(questions)
    return _model_order(tests[tests["p_value"] < ALPHA].sort_values(["p_value", "subject"], kind="stable"),
                        questions)


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
