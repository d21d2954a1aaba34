"""Mismatch metrics between reference and engine logprobs: small pure functions over DataFrames.

Per token d = ref - engine over masked positions (DESIGN.md "Metrics"):
  mean_abs_diff, max_abs_diff = mean/max |d|;  k1 = mean(-d);  k2 = mean(d^2 / 2);
  k3 = mean(exp(d) - 1 - d);  mult_prob_error = mean(exp(|d|));  frac_gt_<t> = share of |d| > t.
`sampler_*` twins apply the same formulas to d = ref - sampler: the noise floor of the original sampler.

Gates (docs/metrics.md "Gates"), decided here from numbers tasks/compare.py computed:
  adapter applied: an adapter's logprobs on a sample of its rows differ from the base model's on the same rows by
    more than the numerical noise: max |lp_adapter - lp_base| > NOISE_ULPS * eps(dtype) * max(1, mean |lp_base|)
    (`noise_bound`), unless a static fact of its files already says it changes nothing;
  k2 over floor: k2 <= X * k2_floor, where k2_floor is k2 of d = ref - sampler over the masked tokens of the base
    rows carrying sampler logprobs (of every row carrying them when no base row does): `sampler_floor`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..names import BASE

FRACTION_THRESHOLDS = (0.01, 0.1, 1.0)
# Rounding one value to the compute dtype moves it by at most eps/2 relative; two orders of the same sums (the
# LoRA and plain variants of a GPU kernel may tile differently) differ by a few eps relative, and through the
# layers a logprob by a few eps times its own size. 16 eps x the mean |lp| is well above that and far below what
# any trained adapter moves (tenths of a nat and more on some token of a few rows). On the CPU torch backend the
# noise is exactly 0: a row without adapter equals the base model bit for bit, and a zero LoRA adds exact zeros.
NOISE_ULPS = 16
GATE_COLUMNS = ["adapter", "applied", "max_abs_diff_vs_base", "noise_bound", "rows_checked", "tokens_checked",
                "reason"]
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
    """One row per group of `tokens` (columns: by..., d, and sampler_d when known), in the order the groups first
    appear: counts and the metrics of token_metrics over the group's masked tokens (NaN where there are none),
    computed for all groups at once (sums per group with np.bincount: a million tokens in a fraction of a second)."""
    if by:
        codes = tokens.groupby(by, sort=False, dropna=False).ngroup().to_numpy()  # [N] group of each token
        first = ~pd.Series(codes).duplicated().to_numpy()  # [N] a group's first token
        frame = tokens.loc[first, by].reset_index(drop=True)  # [G] the groups' keys, in code order
    else:
        codes = np.zeros(len(tokens), dtype=np.int64)
        frame = pd.DataFrame(index=range(1))
    groups = len(frame)
    masked = tokens["mask"].to_numpy(dtype=bool)  # [N]
    samples = pd.DataFrame(dict(group=codes[masked], sample=tokens["sample_id"].to_numpy()[masked]))
    frame["n_samples"] = np.bincount(samples.drop_duplicates()["group"], minlength=groups)
    frame["n_tokens"] = np.bincount(codes[masked], minlength=groups)
    for name, value in _grouped_metrics(codes[masked], tokens["d"].to_numpy(np.float64)[masked], groups).items():
        frame[name] = value
    if "sampler_d" in tokens:
        sampler = tokens["sampler_d"].to_numpy(np.float64)
        known = masked & ~np.isnan(sampler)  # [N]
        if known.any():
            for name, value in _grouped_metrics(codes[known], sampler[known], groups).items():
                frame[f"sampler_{name}"] = value
    for column in ("routing_flip_rate", "routing_flip_weight"):  # means over the masked positions with routes
        if column in tokens:
            values = tokens[column].to_numpy(np.float64)  # [N]
            known = masked & ~np.isnan(values)
            count = np.bincount(codes[known], minlength=groups)
            total = np.bincount(codes[known], weights=values[known], minlength=groups)
            frame[column] = np.divide(total, count, out=np.full(groups, np.nan), where=count > 0)
    return frame


def _grouped_metrics(codes: np.ndarray, d: np.ndarray, groups: int) -> dict[str, np.ndarray]:
    """token_metrics of every group at once: codes [n] group of each difference d [n] (float64) -> metric ->
    [groups], NaN for a group without differences."""
    count = np.bincount(codes, minlength=groups).astype(np.float64)  # [G]
    a = np.abs(d)  # [n]

    def mean(values):
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.bincount(codes, weights=values, minlength=groups) / count  # [G], NaN where count is 0

    largest = np.full(groups, -np.inf)
    np.maximum.at(largest, codes, a)
    out = dict(mean_abs_diff=mean(a), max_abs_diff=np.where(count > 0, largest, np.nan), k1=mean(-d),
               k2=mean(d * d / 2), k3=mean(np.expm1(d) - d), mult_prob_error=mean(np.exp(a)))
    out.update({f"frac_gt_{t:g}": mean((a > t).astype(np.float64)) for t in FRACTION_THRESHOLDS})
    return out


def check_thresholds(summary: pd.DataFrame, max_k2: float | None, max_mean_abs_diff: float | None,
                     max_k2_over_floor: float | None = None, gates: pd.DataFrame | None = None,
                     max_routing_flip_rate: float | None = None) -> pd.DataFrame:
    """Add `passed` and `failed` (which thresholds a row crosses, e.g. 'k2 > 0.005') to a summary. The k2 over
    floor threshold needs the summary's `k2_floor` (off where it is NaN: no sampler logprobs); the routing flip
    rate threshold its `routing_flip_rate` (off where absent or NaN: no routes in the references); `gates` (the
    adapter applied gate) fails the rows of the adapters it finds not applied."""
    summary = summary.copy()
    not_applied = {} if gates is None else {g.adapter: g.reason for g in gates.itertuples() if not g.applied}
    failed = []
    for _, row in summary.iterrows():
        crossed = []
        if row["adapter"] in not_applied:
            crossed.append(f"adapter not applied: {not_applied[row['adapter']]}")
        if max_k2 is not None and not row["k2"] <= max_k2:
            crossed.append(f"k2 > {max_k2:g}")
        if max_mean_abs_diff is not None and not row["mean_abs_diff"] <= max_mean_abs_diff:
            crossed.append(f"mean_abs_diff > {max_mean_abs_diff:g}")
        if max_k2_over_floor is not None and not np.isnan(row["k2_floor"]) and \
                not row["k2"] <= max_k2_over_floor * row["k2_floor"]:
            crossed.append(f"k2 > {max_k2_over_floor:g} x floor {row['k2_floor']:.4g}")
        flip_rate = row.get("routing_flip_rate", np.nan)
        if max_routing_flip_rate is not None and not np.isnan(flip_rate) and not flip_rate <= max_routing_flip_rate:
            crossed.append(f"routing_flip_rate > {max_routing_flip_rate:g}")
        failed.append("; ".join(crossed))
    summary["failed"] = failed
    summary["passed"] = summary["failed"] == ""
    return summary


# ---- gates ----------------------------------------------------------------------------------------------


def sampler_floor(tokens: pd.DataFrame) -> dict:
    """The sampler's noise floor in a run's references: k2 of d = ref - sampler (`sampler_d`) over the masked tokens
    of the base-model rows that carry sampler logprobs — what the serving stack's numerics cost without any adapter.
    Where no base row carries them, over every row that does (the adapters' own rows: their floor then includes the
    sampler's LoRA error). `k2_floor` None when no row has sampler logprobs (the k2 over floor gate is off)."""
    has = tokens["mask"].astype(bool) & tokens["sampler_d"].notna()
    base = has & (tokens["adapter"] == BASE)
    chosen, source = (base, "base rows") if base.any() else (has, "all rows")
    if not chosen.any():
        return dict(k2_floor=None, source=None, rows=0, tokens=0)
    d = tokens.loc[chosen, "sampler_d"].to_numpy(dtype=np.float64)
    return dict(k2_floor=float((d * d / 2).mean()), source=source,
                rows=int(tokens.loc[chosen, "sample_id"].nunique()), tokens=int(chosen.sum()))


def with_floor(summary: pd.DataFrame, k2_floor: float | None) -> pd.DataFrame:
    """`k2_floor` (the same on every row; NaN without sampler logprobs) and `k2_over_floor` = k2 / k2_floor."""
    floor = np.nan if k2_floor is None else k2_floor
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = summary["k2"].to_numpy(dtype=np.float64) / np.float64(floor)
    return summary.assign(k2_floor=floor, k2_over_floor=ratio)


def noise_bound(base_lp: np.ndarray, eps: float) -> float:
    """The most two computations of the same logprobs in a dtype of machine epsilon `eps` may differ by:
    NOISE_ULPS * eps * max(1, mean |lp|) over the compared tokens."""
    scale = float(np.mean(np.abs(base_lp))) if base_lp.size else 0.0
    return NOISE_ULPS * eps * max(1.0, scale)


def applied_gate(adapters: list[str], static: dict[str, str], pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]],
                 eps: float) -> pd.DataFrame:
    """One row per adapter (GATE_COLUMNS): `static` names the adapters whose files already show they change nothing
    (adapter -> why); `pairs` holds, per adapter, (its logprobs, the base model's) on each sampled row; an adapter is
    applied when max |lp - base| over those tokens exceeds `noise_bound` (measured for every adapter, `static` ones
    too). An adapter without reference rows is judged by the static facts alone."""
    rows = []
    for name in adapters:
        checked = pairs.get(name, [])
        adapter_lp = np.concatenate([a for a, _ in checked]).astype(np.float64) if checked else np.zeros(0)
        base_lp = np.concatenate([b for _, b in checked]).astype(np.float64) if checked else np.zeros(0)
        diff = float(np.abs(adapter_lp - base_lp).max()) if adapter_lp.size else np.nan
        bound = noise_bound(base_lp, eps) if base_lp.size else np.nan
        if name in static:
            applied, reason = False, static[name]
        elif not checked:
            applied, reason = True, "no reference rows: checked on its files only"
        elif diff > bound:
            applied, reason = True, ""
        else:
            applied, reason = False, (f"its logprobs equal the base model's within the noise (max |lp - base| "
                                      f"{diff:.3g} <= {bound:.3g})")
        rows.append(dict(adapter=name, applied=applied, max_abs_diff_vs_base=diff, noise_bound=bound,
                         rows_checked=len(checked), tokens_checked=int(adapter_lp.size), reason=reason))
    return pd.DataFrame(rows, columns=GATE_COLUMNS)
