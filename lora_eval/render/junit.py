"""JUnit XML for CI systems: one testcase per adapter x threshold or gate, a failure carrying the numbers.

compare: every summary row (each adapter, `base`, `overall`) x every threshold that was set (`max_k2`,
`max_mean_abs_diff`, `max_k2_over_floor`: skipped where the references carry no sampler logprobs,
`max_routing_flip_rate`: skipped where they carry no routed experts), decided by
`metrics.check_thresholds` itself so the XML always agrees with summary.csv; and every adapter x the adapter
applied gate (gates.csv).
mmlu: every adapter x `--max-drop` (the one MMLU threshold, on micro accuracy), every group's numbers inside.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pandas as pd

from ..results.metrics import check_thresholds
from .formatting import versions_of

# compare's threshold arguments and the summary column each one bounds (see metrics.check_thresholds)
THRESHOLDS = {"max_k2": "k2", "max_mean_abs_diff": "mean_abs_diff", "max_k2_over_floor": "k2",
              "max_routing_flip_rate": "routing_flip_rate"}
GATE_DETAIL = ["max_abs_diff_vs_base", "noise_bound", "rows_checked", "tokens_checked"]
DETAIL = ["n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error",
          "routing_flip_rate", "routing_flip_weight"]


def _num(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _suite(name: str, cases: list[ET.Element], run: dict) -> ET.Element:
    timings = run.get("timings", {})
    seconds = timings.get("total_s", sum(v for v in timings.values() if isinstance(v, (int, float))))
    failures = sum(1 for c in cases if c.find("failure") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    suites = ET.Element("testsuites", name=name, tests=str(len(cases)), failures=str(failures), errors="0",
                        skipped=str(skipped), time=f"{seconds:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=name, tests=str(len(cases)), failures=str(failures),
                          errors="0", skipped=str(skipped), time=f"{seconds:.3f}")
    properties = ET.SubElement(suite, "properties")
    for key, value in versions_of(run).items():
        ET.SubElement(properties, "property", name=f"version.{key}", value=str(value))
    for key, value in run.get("arguments", {}).items():
        ET.SubElement(properties, "property", name=f"argument.{key}",
                      value=value if isinstance(value, str) else json.dumps(value))
    suite.extend(cases)
    return suites


def _case(classname: str, name: str, failure: str | None, details: str, kind: str = "threshold",
          skipped: str | None = None) -> ET.Element:
    case = ET.Element("testcase", classname=classname, name=name, time="0")
    if skipped is not None:
        ET.SubElement(case, "skipped", message=skipped)
    if failure is not None:
        ET.SubElement(case, "failure", message=failure, type=kind).text = details
    else:
        ET.SubElement(case, "system-out").text = details
    return case


def compare_junit(summary: pd.DataFrame, run: dict, gates: pd.DataFrame | None = None) -> str:
    """The JUnit XML of a compare run from its summary, run.json (thresholds from run['arguments']) and gates
    (the adapter applied gate's table; None or empty: no such testcases)."""
    args = run.get("arguments", {})
    limits = {arg: args.get(arg) for arg in THRESHOLDS if args.get(arg) is not None}
    cases = []
    for arg, limit in limits.items():
        column = THRESHOLDS[arg]
        one = {a: (limit if a == arg else None) for a in THRESHOLDS}  # this threshold alone
        verdicts = check_thresholds(summary, **one)
        for row, passed in zip(summary.itertuples(index=False), verdicts["passed"]):
            value = float(getattr(row, column, math.nan))
            details = ", ".join(f"{c} = {_num(getattr(row, c))}" for c in DETAIL if hasattr(row, c))
            if arg == "max_k2_over_floor":
                floor = float(row.k2_floor)
                off = "off: the references carry no sampler logprobs" if math.isnan(floor) else None
                failure = None if passed else \
                    f"{row.adapter}: k2 = {_num(value)} > {limit:g} x floor {_num(floor)} (k2 / floor = " \
                    f"{_num(float(row.k2_over_floor))})"
                cases.append(_case(f"lora-eval.compare.{row.adapter}", f"k2 <= {limit:g} x floor", failure,
                                   f"{row.adapter}: k2 = {_num(value)}, floor {_num(floor)} (limit {limit:g} x "
                                   f"floor); {details}", skipped=off))
                continue
            failure = None if passed else f"{row.adapter}: {column} = {_num(value)} > {limit:g}"
            off = "off: the references carry no routed experts" \
                if arg == "max_routing_flip_rate" and math.isnan(value) else None
            cases.append(_case(f"lora-eval.compare.{row.adapter}", f"{column} <= {limit:g}", failure,
                               f"{row.adapter}: {column} = {_num(value)} (threshold {limit:g}); {details}",
                               skipped=off))
    if not limits:  # no threshold set: one passing case per row, so the metrics still reach the CI page
        for row in summary.itertuples(index=False):
            details = ", ".join(f"{c} = {_num(getattr(row, c))}" for c in DETAIL if hasattr(row, c))
            cases.append(_case(f"lora-eval.compare.{row.adapter}", "no threshold set", None, details))
    for gate in (gates if gates is not None else pd.DataFrame()).itertuples(index=False):
        details = f"{gate.adapter}: " + ", ".join(f"{c} = {_num(getattr(gate, c))}" for c in GATE_DETAIL) + \
            (f"; {gate.reason}" if gate.reason else "")
        failure = None if bool(gate.applied) else f"{gate.adapter}: adapter not applied: {gate.reason}"
        cases.append(_case(f"lora-eval.compare.{gate.adapter}", "adapter applied", failure, details, kind="gate"))
    return _xml(_suite("lora-eval compare", cases, run))


def mmlu_junit(summary: pd.DataFrame, run: dict) -> str:
    """The JUnit XML of an MMLU run: one testcase per adapter for `max_drop` (percentage points of micro accuracy
    below base), its verdict the micro row's `passed`; the numbers of every group in the testcase output."""
    max_drop = run.get("arguments", {}).get("max_drop")
    base = summary[summary["model"] == "base"].set_index("group")["accuracy"].to_dict()
    cases = []
    for model, rows in summary[summary["model"] != "base"].groupby("model", sort=False):
        lines = [f"{r.group}: accuracy {_num(float(r.accuracy))} vs base {_num(float(base.get(r.group, math.nan)))}, "
                 f"delta {_points(r.delta)} points (95% interval {_points(r.delta_low)} .. {_points(r.delta_high)}) "
                 f"on {r.questions} questions" for r in rows.itertuples(index=False)]
        micro = rows[rows["group"] == "micro"].iloc[0]
        if max_drop is None:
            cases.append(_case(f"lora-eval.mmlu.{model}", "micro accuracy (no threshold set)", None, "\n".join(lines)))
            continue
        failure = None if bool(micro["passed"]) else \
            f"{model}: micro accuracy {_points(micro['delta'])} points against base, limit -{max_drop:g}; " + lines[
                list(rows["group"]).index("micro")]
        cases.append(_case(f"lora-eval.mmlu.{model}", f"micro accuracy drop <= {max_drop:g} points", failure,
                           "\n".join(lines)))
    return _xml(_suite("lora-eval mmlu", cases, run))


def _points(fraction) -> str:
    return "nan" if math.isnan(float(fraction)) else f"{100 * float(fraction):+.2f}"


def _xml(root: ET.Element) -> str:
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


