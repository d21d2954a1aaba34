"""Mismatch metrics between reference and engine logprobs: small pure functions over DataFrames.

Per token d = ref - engine over masked positions (DESIGN.md "Metrics"):
  mean_abs_diff, max_abs_diff = mean/max |d|;  k1 = mean(-d);  k2 = mean(d^2 / 2);
  k3 = mean(exp(d) - 1 - d);  mult_prob_error = mean(exp(|d|));  frac_gt_<t> = share of |d| > t.
`sampler_*` twins apply the same formulas to d = ref - sampler: the noise floor of the original sampler.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

FRACTION_THRESHOLDS = (0.01, 0.1, 1.0)
METRICS = ["mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error"] + \
    [f"frac_gt_{t:g}" for t in FRACTION_THRESHOLDS]


def token_metrics(d: np.ndarray) -> dict[str, float]:
    """All metrics of one group of per-token differences d (float64); NaN for an empty group."""
    d = np.asarray(d, dtype=np.float64)
    if d.size == 0:
        return {m: float("nan") for m in METRICS}
    a = np.abs(d)
    out = dict(mean_abs_diff=a.mean(), max_abs_diff=a.max(), k1=(-d).mean(), k2=(d * d / 2).mean(),
               k3=(np.expm1(d) - d).mean(), mult_prob_error=np.exp(a).mean())
    out.update({f"frac_gt_{t:g}": float((a > t).mean()) for t in FRACTION_THRESHOLDS})
    return {k: float(v) for k, v in out.items()}


def group_metrics(tokens: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """One row per group of `tokens` (columns: by..., d, and sampler_d when known): counts and metrics."""
    rows = []
    groups = tokens.groupby(by, sort=False, dropna=False) if by else [((), tokens)]
    for key, group in groups:  # a group whose tokens are all masked out keeps its row, with NaN metrics
        key = key if isinstance(key, tuple) else (key,)
        group = group[group["mask"]]
        row = dict(zip(by, key))
        row.update(n_samples=group["sample_id"].nunique(), n_tokens=len(group))
        row.update(token_metrics(group["d"].to_numpy()))
        if "sampler_d" in group and group["sampler_d"].notna().any():
            sampler = token_metrics(group["sampler_d"].dropna().to_numpy())
            row.update({f"sampler_{k}": v for k, v in sampler.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def check_thresholds(summary: pd.DataFrame, max_k2: float | None, max_mean_abs_diff: float | None) -> pd.DataFrame:
    """Add `passed` and `failed` (which thresholds a row crosses, e.g. 'k2 > 0.005') to a summary."""
    summary = summary.copy()
    failed = []
    for _, row in summary.iterrows():
        crossed = []
        if max_k2 is not None and not row["k2"] <= max_k2:
            crossed.append(f"k2 > {max_k2:g}")
        if max_mean_abs_diff is not None and not row["mean_abs_diff"] <= max_mean_abs_diff:
            crossed.append(f"mean_abs_diff > {max_mean_abs_diff:g}")
        failed.append("; ".join(crossed))
    summary["failed"] = failed
    summary["passed"] = summary["failed"] == ""
    return summary
