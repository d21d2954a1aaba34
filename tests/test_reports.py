"""Reports people read, JUnit for CI, the golden regression, and the example notebook.

1. the regression run exactly as CI runs it (`python -m lora_eval.golden check`): the demo model and adapters
   rebuilt on the spot against the committed golden dump, tight thresholds, exit 0, JUnit all green, both adapters
   applied (gates.csv) and far below the bf16 sampler's k2 floor;
2. the committed golden dump equals what the regenerate command produces now;
3. report.html: every inline figure parses as SVG; the summary cells carry summary.csv's exact numbers;
   report.md shows the same numbers as summary.csv;
4. `lora-eval report` re-renders html and md byte for byte from the saved files; a figure is deterministic and
   draws its histogram's counts;
5. JUnit: structure and counts, and a failing adapter (a known shift) as failed testcases with its numbers;
6. worst tokens: the right tokens, token text and context on hand-made data;
7. MMLU: HTML, JUnit and re-rendering of a small synthetic run written by lora_eval.tasks.mmlu.task;
8. the example notebook executes (nbclient);
9. .ci/run and the workflow run the same regression command.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from lora_eval import golden
from lora_eval.render import plots
from lora_eval.cli import cli
from lora_eval.tasks.compare import worst_tokens
from lora_eval.render.formatting import display_table
from lora_eval.render.junit import compare_junit, mmlu_junit
from lora_eval.results.mmlu_stats import question_table, subject_table, summary_table
from lora_eval.inputs.references import read_reference, write_reference
from lora_eval.render.files import phase_times, render
from lora_eval.results.tables import COMPARE_SUMMARY_COLUMNS, MmluResult, Phases, read_run
from tests.cli_checks import assert_input_error, assert_no_traceback, save_run
from tests.test_distributed import demo, demo_compare  # noqa: F401 - demo is a fixture

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = ROOT / "references"
ADAPTERS = ("peft-all-linear", "tinker-shared-outer")
ROWS = ("base", *ADAPTERS, "overall")


# ---- helpers ---------------------------------------------------------------------------------------------


class Page(HTMLParser):
    """The parts of report.html the tests look at: headings, and tables as rows of cells."""

    def __init__(self, text: str):
        super().__init__()
        self.h1, self.tables = [], []
        self._cell = self._row = None
        self._in_h1 = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "h1":
            self._in_h1 = True
            self.h1.append([attrs.get("class"), ""])
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = dict(cls=attrs.get("class"), cells=[])
            self.tables[-1].append(self._row)
        elif tag in ("td", "th"):
            self._cell = dict(tag=tag, text="", **attrs)
            self._row["cells"].append(self._cell)

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._cell = None
        elif tag == "h1":
            self._in_h1 = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data
        if self._in_h1:
            self.h1[-1][1] += data


def table_frame(table: list[dict]) -> tuple[pd.DataFrame, list]:
    """A parsed HTML table as a DataFrame of cell dicts (columns from the header), and each row's class."""
    header = [c["text"] for c in table[0]["cells"]]
    return pd.DataFrame([r["cells"] for r in table[1:]], columns=header), [r["cls"] for r in table[1:]]


def markdown_section_table(text: str, heading: str) -> pd.DataFrame:
    """The first Markdown table after `## heading`, as strings."""
    lines = text.split(f"## {heading}\n", 1)[1].splitlines()
    rows = [line for line in lines[lines.index(next(x for x in lines if x.startswith("|"))):]]
    rows = rows[:next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    return pd.DataFrame(cells[2:], columns=cells[0])


def read_summary(path: Path) -> pd.DataFrame:
    frame = pd.read_csv(path, dtype={"failed": str, "adapter": str})
    return frame.assign(failed=frame["failed"].fillna(""))


def figures(text: str, named: bool = True) -> list[ET.Element]:
    """The page's inline SVG figures, each parsed as XML (raises on a malformed one), with something drawn in a
    plot area of sensible size and (`named`, as report.html's are) an accessible name."""
    found = []
    for svg in re.findall(r"<svg\b.*?</svg>", text, flags=re.S):
        root = ET.fromstring(svg)
        assert root.get("role") == "img", root.attrib
        if named:
            assert root.get("aria-label") and root.find("{*}title").text == root.get("aria-label"), root.attrib
        assert float(root.get("width")) > 200 and float(root.get("height")) > 100, root.attrib
        assert root.findall(".//{*}rect") and root.findall(".//{*}text"), svg[:200]  # (with or without xmlns)
        found.append(root)
    assert len(found) == text.count("<svg")
    return found


def parse_junit(text: str) -> tuple[ET.Element, list[dict]]:
    """The XML root (validated for structure and consistent counts) and one dict per testcase."""
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = []
    for case in suite.findall("testcase"):
        assert set(case.attrib) >= {"classname", "name", "time"}
        failures = case.findall("failure")
        assert len(failures) <= 1
        cases.append(dict(classname=case.get("classname"), name=case.get("name"),
                          failure=failures[0] if failures else None,
                          out=case.findtext("system-out")))
    n_failed = sum(c["failure"] is not None for c in cases)
    for element in (root, suite):
        assert int(element.get("tests")) == len(cases)
        assert int(element.get("failures")) == n_failed
        assert int(element.get("errors")) == 0
        assert float(element.get("time")) >= 0
    assert len({(c["classname"], c["name"]) for c in cases}) == len(cases)  # no duplicate testcase
    return root, cases


# ---- fixtures --------------------------------------------------------------------------------------------


def test_report_on_a_damaged_run_folder(regression, tmp_path):
    """A saved table missing a column, a run.json that is not an object, an --out folder that does not exist:
    one line naming the file and the key, exit 2."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(regression[0] / "run", run)
    summary = pd.read_csv(run / "summary.csv")
    summary.drop(columns=["k2"]).to_csv(run / "summary.csv", index=False)
    assert_input_error(CliRunner().invoke(cli, ["report", str(run)]), str(run / "summary.csv"), "k2",
                       "missing column")
    summary.to_csv(run / "summary.csv", index=False)
    (run / "run.json").write_text("[1, 2]")
    assert_input_error(CliRunner().invoke(cli, ["report", str(run)]), str(run / "run.json"), "JSON object")
    shutil.copy(regression[0] / "run" / "run.json", run / "run.json")
    assert_input_error(CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "no" / "r.html")]),
                       "--out", "does not exist")


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """The regression exactly as .ci/run and the workflow run it."""
    out = tmp_path_factory.mktemp("regression")
    result = CliRunner().invoke(golden.golden, ["check", str(out), "--references", str(REFERENCES)])
    return out, result


@pytest.fixture(scope="module")
def shifted_run(regression, tmp_path_factory, session_seed):
    """The golden dump with one adapter's logprobs moved by a known delta: that adapter must fail."""
    out, _ = regression
    rng = np.random.default_rng(session_seed + 701)
    adapter = str(rng.choice(ADAPTERS))
    delta = float(rng.choice([-1, 1]) * rng.uniform(0.15, 0.3))
    frame = read_reference(REFERENCES / golden.GOLDEN)
    frame["logprobs"] = [list(np.asarray(lp) + delta) if a == adapter else lp
                         for lp, a in zip(frame["logprobs"], frame["adapter"])]
    root = tmp_path_factory.mktemp("shifted")
    path = write_reference(frame, root / "shifted.parquet")
    inputs = out / "inputs"
    args = ["compare", "--model", inputs / "model", "--reference", path, "--out", root / "run",
            "--junit", root / "junit.xml", "--max-mean-abs-diff", "0.05", "--quiet"]
    for name in ADAPTERS:
        args += ["--adapter", f"{name}={inputs / 'adapters' / name}"]
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return root, result, adapter, delta


# ---- 1. the regression against the golden dump ----------------------------------------------------------


def test_regression_passes_against_golden(regression):
    out, result = regression
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert result.stdout.startswith("lora-eval compare --model ")  # the command it ran, for the CI log
    summary = read_summary(out / "run" / "summary.csv").set_index("adapter")
    assert list(summary.index) == list(ROWS)
    assert summary["passed"].all()
    # float32 engine vs float32 transformers + PEFT: far below the thresholds
    assert (summary["k2"] < golden.MAX_K2 / 1000).all(), summary["k2"]
    assert (summary["mean_abs_diff"] < golden.MAX_MEAN_ABS_DIFF / 5).all(), summary["mean_abs_diff"]
    assert summary.loc["overall", "n_tokens"] == summary.drop("overall")["n_tokens"].sum() > 300
    # the bf16 sampler's noise floor is orders of magnitude above the engine's mismatch
    assert (summary["sampler_mean_abs_diff"] > 1000 * summary["mean_abs_diff"]).all()
    run = json.loads((out / "run" / "run.json").read_text())
    assert run["arguments"]["max_k2"] == golden.MAX_K2
    assert run["arguments"]["max_mean_abs_diff"] == golden.MAX_MEAN_ABS_DIFF
    assert run["tokenizer"] == str(out / "inputs" / "model")

    # both demo adapters change the model far beyond float32 noise: the adapter applied gate passes
    gates = pd.read_csv(out / "run" / "gates.csv").set_index("adapter")
    assert list(gates.index) == list(ADAPTERS) and gates["applied"].all()
    assert (gates["max_abs_diff_vs_base"] > 1e4 * gates["noise_bound"]).all()
    # the bf16 sampler gives the k2 floor (over the base rows): the engine's float32 k2 is far below it
    assert run["gates"]["k2_over_floor"]["source"] == "base rows"
    assert (summary["k2_floor"] == run["gates"]["k2_over_floor"]["k2_floor"]).all()
    assert (summary["k2_over_floor"] < 1e-6).all()

    _, cases = parse_junit((out / "junit.xml").read_text())
    assert len(cases) == len(ROWS) * 2 + len(ADAPTERS)  # rows x thresholds, adapters x the applied gate
    assert all(c["failure"] is None for c in cases)
    assert {(c["classname"], c["name"]) for c in cases} == {
        (f"lora-eval.compare.{row}", f"{metric} <= {limit:g}") for row in ROWS
        for metric, limit in (("k2", golden.MAX_K2), ("mean_abs_diff", golden.MAX_MEAN_ABS_DIFF))} | {
        (f"lora-eval.compare.{adapter}", "adapter applied") for adapter in ADAPTERS}


def test_golden_matches_regeneration(regression, tmp_path):
    """The committed dump equals what `python -m lora_eval.golden write` produces now: the same seeded
    build_inputs (here the regression's, to save a rebuild), dumped in float32 and bf16 again."""
    inputs = regression[0] / "inputs"
    committed = read_reference(REFERENCES / golden.GOLDEN)
    fresh = golden.golden_frame(tmp_path, (inputs / "model", {a: inputs / "adapters" / a for a in ADAPTERS}))
    exact = ["sample_id", "adapter", "input_ids", "mask"]
    pd.testing.assert_frame_equal(committed[exact], fresh[exact])
    assert committed["sampler_logprobs"].notna().all()

    def flat(frame, column):
        return np.concatenate([np.asarray(v, dtype=np.float64) for v in frame[column]])

    # the float32 trainer logprobs, which the regression checks against: within the project's float32 tolerance,
    # 1e-5 (bitwise with the same CPU and thread count; another thread count splits the GEMMs' sums differently)
    diff = np.abs(flat(committed, "logprobs") - flat(fresh, "logprobs"))
    print(f"logprobs: max |committed - regenerated| = {diff.max():.3g}")
    assert len(diff) > 300 and diff.max() <= 1e-5
    # the bf16 sampler column only draws the noise floor; bf16 kernels may round differently on another CPU,
    # so it must describe the same noise floor (mean |ref - sampler| within 10%), bitwise on the same platform
    sampler_diff = np.abs(flat(committed, "sampler_logprobs") - flat(fresh, "sampler_logprobs"))
    print(f"sampler_logprobs: max |committed - regenerated| = {sampler_diff.max():.3g}")
    floors = [np.mean(np.abs(flat(f, "logprobs") - flat(f, "sampler_logprobs"))) for f in (committed, fresh)]
    assert floors[0] > 1e-3 and floors[1] == pytest.approx(floors[0], rel=0.1), floors
    size = (REFERENCES / golden.GOLDEN).stat().st_size
    assert 1_000 < size < 200_000, size


def test_golden_check_refuses_missing_dump(tmp_path):
    result = CliRunner().invoke(golden.golden, ["check", str(tmp_path / "out"), "--references", str(tmp_path)])
    assert result.exit_code == 2
    assert "golden dump not found" in result.stderr and golden.GOLDEN in result.stderr
    assert not (tmp_path / "out").exists()


# ---- 3. report.html and report.md against summary.csv ----------------------------------------------------


def test_html_figures_parse_and_summary_numbers_are_exact(regression):
    out, _ = regression
    run = out / "run"
    text = (run / "report.html").read_text(encoding="utf-8")
    assert "<script" not in text and "http://" not in text and "https://" not in text  # self-contained
    page = Page(text)
    assert len(figures(text)) == 4  # noise floor, |d| histogram, d by position, k2 per sample
    assert page.h1 == [["pass", "lora-eval compare: PASSED"]]

    summary = read_summary(run / "summary.csv")
    shown, classes = table_frame(page.tables[0])
    assert list(shown["adapter"].map(lambda c: c["text"])) == list(summary["adapter"])
    assert classes == [None] * len(summary)
    for column in ("mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error"):
        for cell, value in zip(shown[column], summary[column]):
            assert float(cell["title"]) == value, (column, cell, value)  # the full-precision number
            assert cell["text"] == f"{value:.4g}"
    for column in ("n_samples", "n_tokens"):
        assert [int(c["text"]) for c in shown[column]] == list(summary[column])
    assert [c["text"] for c in shown["passed"]] == ["PASS"] * len(summary)

    gates, classes = table_frame(page.tables[1])  # the adapter applied gate
    saved = pd.read_csv(run / "gates.csv")
    assert [c["text"] for c in gates["adapter"]] == list(saved["adapter"]) and classes == [None] * len(saved)
    assert [float(c["title"]) for c in gates["max_abs_diff_vs_base"]] == list(saved["max_abs_diff_vs_base"])
    assert [float(c["title"]) for c in shown["k2_over_floor"]] == list(summary["k2_over_floor"])

    floor, _ = table_frame(page.tables[2])  # engine beside the sampler
    for column in ("sampler_mean_abs_diff", "sampler_k2", "sampler_max_abs_diff"):
        assert [float(c["title"]) for c in floor[column]] == list(summary[column])

    worst, _ = table_frame(page.tables[3])
    saved = pd.read_parquet(run / "worst_tokens.parquet")
    assert len(worst) == len(saved) == 5 * 3
    assert [float(c["title"]) for c in worst["d"]] == list(saved["d"])


def test_markdown_holds_the_summary_csv_numbers(regression):
    out, _ = regression
    text = (out / "run" / "report.md").read_text(encoding="utf-8")
    summary = read_summary(out / "run" / "summary.csv")
    table = markdown_section_table(text, "Summary")
    assert list(table["adapter"]) == list(summary["adapter"])
    for column in ("mean_abs_diff", "max_abs_diff", "k1", "k2", "k3", "mult_prob_error"):
        for cell, value in zip(table[column], summary[column]):
            assert float(cell) == float(f"{value:.4g}"), (column, cell, value)
            assert abs(float(cell) - value) <= 5e-4 * abs(value), (column, cell, value)
    for column in ("n_samples", "n_tokens"):
        assert [int(c) for c in table[column]] == list(summary[column])
    assert list(table["passed"]) == ["PASS" if p else "FAIL" for p in summary["passed"]]
    floor = markdown_section_table(text, "Sampler noise floor (reference - sampler)")
    for column in ("sampler_mean_abs_diff", "sampler_k2", "sampler_max_abs_diff"):
        assert [float(c) for c in floor[column]] == [float(f"{v:.4g}") for v in summary[column]]
    worst = markdown_section_table(text, "Worst tokens by |d|")
    assert len(worst) == 15 and set(worst["adapter"]) == set(ROWS) - {"overall"}


# ---- 4. re-rendering -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,name", [("html", "report.html"), ("md", "report.md")])
def test_report_command_equals_the_original(regression, shifted_run, tmp_path, fmt, name):
    for run in (regression[0] / "run", shifted_run[0] / "run"):  # passing and failing
        original = (run / name).read_bytes()
        result = CliRunner().invoke(cli, ["report", str(run), "--format", fmt])
        assert result.exit_code == 0, (result.stderr, result.exception)
        assert result.stdout_bytes == original
    target = tmp_path / f"again.{fmt}"
    result = CliRunner().invoke(cli, ["report", str(run), "--format", fmt, "--out", str(target)])
    assert result.exit_code == 0 and result.stdout == "" and target.read_bytes() == original


def test_saved_tables_read_back_exactly(regression, tmp_path):
    """Sample ids that CSV readers like to reinterpret ('NA', '001', '1.0', quotes) survive the round trip."""
    result = read_run(regression[0] / "run")
    odd = {"base-0": "NA", "base-1": "001", "base-2": "null", "base-3": ' spaced, "quoted"', "base-4": "1.0"}
    for frame in (result.samples, result.tokens, result.worst):
        frame["sample_id"] = frame["sample_id"].replace(odd)
    save_run(result, tmp_path / "odd")
    again = read_run(tmp_path / "odd")
    for name in ("summary", "samples", "tokens", "worst", "gates"):
        pd.testing.assert_frame_equal(getattr(again, name), getattr(result, name), check_exact=True, obj=name)
    assert set(odd.values()) <= set(again.samples["sample_id"])
    assert again.summary["failed"].tolist() == [""] * len(ROWS)
    assert render(tmp_path / "odd", "md") == (tmp_path / "odd" / "report.md").read_text(encoding="utf-8")


def test_report_command_bad_input(tmp_path):
    assert_input_error(CliRunner().invoke(cli, ["report", str(tmp_path / "missing")]), "run folder not found")
    (tmp_path / "summary.csv").write_text("adapter\nbase\n")
    assert_input_error(CliRunner().invoke(cli, ["report", str(tmp_path)]), str(tmp_path), "not a run folder")
    (tmp_path / "summary.csv").write_text(",".join(COMPARE_SUMMARY_COLUMNS) + "\n")
    (tmp_path / "samples.csv").write_text("adapter,sample_id\nbase,a\n")
    (tmp_path / "run.json").write_text("{}")
    assert_input_error(CliRunner().invoke(cli, ["report", str(tmp_path)]), str(tmp_path), "a partial run",
                       "run the command that started it again")
    (tmp_path / "run.json").write_text('{"command": "compare", "status": "complete"}')
    (tmp_path / "tokens.parquet").write_bytes(b"not parquet at all")
    assert_input_error(CliRunner().invoke(cli, ["report", str(tmp_path)]), str(tmp_path / "tokens.parquet"),
                       "not a readable Parquet file")


def test_histogram_figure_is_deterministic_and_draws_the_counts(seed):
    rng = np.random.default_rng(seed)
    n = 400
    tokens = pd.DataFrame(dict(adapter=rng.choice(["base", "a", "b"], n), sample_id=rng.choice(list("pqrs"), n),
                               position=rng.integers(0, 30, n), d=rng.normal(0, 1e-3, n), mask=rng.random(n) < 0.8))
    first = plots.abs_diff_histogram(tokens).svg()
    assert plots.abs_diff_histogram(tokens).svg() == first
    assert plots.abs_diff_histogram(tokens.assign(d=tokens["d"] * 10)).svg() != first  # other data, other picture
    root = ET.fromstring(first)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    # every panel's bars stand on one baseline, their heights in proportion to np.histogram's counts
    kept = tokens[tokens["mask"]]
    bars = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("fill-opacity") == "0.8"]
    heights = np.array([float(r.get("height")) for r in bars])
    d = np.abs(kept["d"].to_numpy())
    bins = np.logspace(math.floor(math.log10(d.min())), math.ceil(math.log10(d.max())), 1 + 5 * (
        math.ceil(math.log10(d.max())) - math.floor(math.log10(d.min()))))
    panels = [np.histogram(np.abs(kept.loc[kept["adapter"] == a, "d"]), bins)[0] for a in pd.unique(kept["adapter"])]
    assert len(bars) == sum((c > 0).sum() for c in panels) and len(bars) > 5
    for counts in panels:  # (each panel its own y scale; the bars in the panels' order)
        drawn, heights = heights[:(counts > 0).sum()], heights[(counts > 0).sum():]
        scale = drawn.max() / counts.max()  # px per token
        assert np.abs(drawn - counts[counts > 0] * scale).max() <= 0.11, (drawn, counts)  # coordinates in 0.1 px


# ---- 5. JUnit with a failing adapter ---------------------------------------------------------------------


def test_junit_marks_the_failing_adapter_with_its_numbers(shifted_run):
    root, result, adapter, delta = shifted_run
    assert_no_traceback(result)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    summary = read_summary(root / "run" / "summary.csv").set_index("adapter")
    k2 = summary.loc[adapter, "k2"]
    assert k2 == pytest.approx(delta ** 2 / 2, rel=1e-3)

    _, cases = parse_junit((root / "junit.xml").read_text(encoding="utf-8"))
    assert len(cases) == len(ROWS) * 2 + len(ADAPTERS)  # rows x thresholds, adapters x the applied gate
    failed = {(c["classname"].rsplit(".", 1)[1], c["name"]) for c in cases if c["failure"] is not None}
    expected = set()
    for row in summary.itertuples():
        if row.k2 > 5e-3:
            expected.add((row.Index, "k2 <= 0.005"))
        if row.mean_abs_diff > 0.05:
            expected.add((row.Index, "mean_abs_diff <= 0.05"))
    assert (adapter, "k2 <= 0.005") in expected and (adapter, "mean_abs_diff <= 0.05") in expected
    assert failed == expected
    assert {a for a, _ in failed} == set(summary.index[~summary["passed"]])  # agrees with summary.csv

    case = next(c for c in cases if c["failure"] is not None and c["classname"].endswith(f".{adapter}")
                and c["name"].startswith("k2"))
    message = case["failure"].get("message")
    assert message == f"{adapter}: k2 = {k2:.6g} > 0.005"
    assert case["failure"].get("type") == "threshold"
    numbers = dict(re.findall(r"(\w+) = ([-\d.e+]+)", case["failure"].text))
    assert float(numbers["mean_abs_diff"]) == pytest.approx(abs(delta), rel=1e-3)
    assert int(numbers["n_tokens"]) == summary.loc[adapter, "n_tokens"]

    page = Page((root / "run" / "report.html").read_text(encoding="utf-8"))
    assert page.h1[0][0] == "fail" and adapter in page.h1[0][1]
    shown, classes = table_frame(page.tables[0])
    marked = {cells["text"] for cells, cls in zip(shown["adapter"], classes) if cls == "fail"}
    assert marked == set(summary.index[~summary["passed"]])
    for cells, passed in zip(shown["passed"], summary["passed"]):
        assert cells["text"] == ("PASS" if passed else "FAIL") and cells["class"] == cells["text"]
    figures((root / "run" / "report.html").read_text(encoding="utf-8"))


def test_junit_without_thresholds_lists_every_row(regression):
    summary = read_summary(regression[0] / "run" / "summary.csv")
    run = dict(arguments=dict(max_k2=None, max_mean_abs_diff=None))
    _, cases = parse_junit(compare_junit(summary, run))
    assert [c["classname"] for c in cases] == [f"lora-eval.compare.{r}" for r in ROWS]
    assert all(c["failure"] is None and "k2 = " in c["out"] for c in cases)


# ---- 6. worst tokens -------------------------------------------------------------------------------------


def test_worst_tokens_pick_the_largest_masked_diffs(seed):
    rng = np.random.default_rng(seed)
    input_ids = {f"s{i}": [int(t) for t in rng.integers(0, 500, int(rng.integers(3, 40)))] for i in range(12)}
    adapters = {sid: str(rng.choice(["base", "x"])) for sid in input_ids}
    rows = []
    for sid, ids in input_ids.items():
        for p in range(len(ids) - 1):
            rows.append(dict(adapter=adapters[sid], sample_id=sid, position=p, token_id=ids[p + 1],
                             ref=-1.0, engine=-1.0, d=float(rng.normal(0, 0.1)), mask=bool(rng.random() < 0.7),
                             sampler=np.nan))
    tokens = pd.DataFrame(rows)
    tokens.loc[~tokens["mask"], "d"] = 100.0  # masked out: must never be listed
    worst = worst_tokens(tokens, input_ids, decode=None, per_adapter=4, context=5)
    for adapter, group in tokens[tokens["mask"]].groupby("adapter"):
        expected = group.assign(a=group["d"].abs()).sort_values("a", ascending=False).head(4)
        got = worst[worst["adapter"] == adapter]
        assert list(got["d"]) == list(expected["d"])
        for row in got.itertuples():
            ids = input_ids[row.sample_id]
            assert row.token == f"[{ids[row.position + 1]}]" and row.token_id == ids[row.position + 1]
            assert row.context == "".join(f"[{t}]" for t in ids[max(0, row.position - 4):row.position + 1])


def _wordpiece_tokenizer(out: Path):
    """A BERT-like WordPiece (its decoder joins "##" pieces and spaces words: the clean-up that decoding turns off
    matters here), with [CLS] / [SEP] special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator(["Don't stop: it's 3.5 times the model's loss , isn't it ?"] * 20, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]").save_pretrained(str(out))


@pytest.mark.parametrize("kind", ["byte-level-bpe", "wordpiece"])
def test_decoder_equals_transformers_decode(tmp_path, seed, kind):
    """load_decoder reads tokenizer.json without transformers; its text equals transformers' decode (special
    tokens kept, no clean-up) for random ids, special ones among them; None without a readable tokenizer."""
    from transformers import AutoTokenizer

    from lora_eval.tasks.demo import build_tokenizer
    from lora_eval.inputs.tokenizer import load_decoder

    build_tokenizer(tmp_path) if kind == "byte-level-bpe" else _wordpiece_tokenizer(tmp_path)
    oracle = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    decode = load_decoder(tmp_path)
    rng = np.random.default_rng(seed)
    special = oracle.all_special_ids
    assert special
    for _ in range(50):
        ids = [int(i) for i in rng.integers(0, len(oracle), int(rng.integers(1, 12)))]
        ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.choice(special)))
        assert decode(ids) == oracle.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    empty = tmp_path / "none"
    empty.mkdir()
    assert load_decoder(empty) is None
    (empty / "tokenizer.json").write_text("{not json")
    assert load_decoder(empty) is None


def test_compare_reads_its_tokenizer_without_transformers(demo, tmp_path):  # noqa: F811 - the fixture
    """A compare run in a fresh process decodes its worst tokens (text, not ids) and never imports transformers."""
    out = tmp_path / "run"
    code = ("import atexit, sys; from lora_eval.cli import main; sys.argv = ['lora-eval', *sys.argv[1:]]\n"
            "atexit.register(lambda: print('transformers imported:', 'transformers' in sys.modules))\n"
            "main()")  # (main ends the process; its exit handlers run first)
    args = [str(a) for a in demo_compare(demo, out)] + ["--device", "cpu", "--quiet", "--max-k2", "1e9"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.strip().splitlines()[-1] == "transformers imported: False", (done.stdout, done.stderr)
    assert json.loads((out / "run.json").read_text())["tokenizer"] == str(demo / "model")
    worst = pd.read_parquet(out / "worst_tokens.parquet")
    assert len(worst) > 0 and not worst["token"].str.fullmatch(r"(\[\d+\])+").any()  # text, not ids


def test_worst_tokens_break_ties_at_the_cut_as_a_full_sort(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(200, 400))
    tokens = pd.DataFrame(dict(adapter=rng.choice(["base", "x"], n), sample_id=[f"s{i % 7}" for i in range(n)],
                               position=np.arange(n), token_id=rng.integers(0, 50, n), ref=-1.0, engine=-1.0,
                               d=rng.choice([-0.3, -0.2, 0.2, 0.3, 0.1], n), mask=rng.random(n) < 0.8,
                               sampler=np.nan))  # few distinct |d|: many ties at the 6th place
    input_ids = {f"s{i}": [int(t) for t in rng.integers(0, 50, n + 1)] for i in range(7)}
    worst = worst_tokens(tokens, input_ids, decode=None, per_adapter=6, context=3)
    for adapter, group in tokens[tokens["mask"]].groupby("adapter"):
        expected = group.assign(a=group["d"].abs()).sort_values(["a", "sample_id", "position"],
                                                                ascending=[False, True, True]).head(6)
        got = worst[worst["adapter"] == adapter]
        assert list(zip(got["sample_id"], got["position"])) == list(zip(expected["sample_id"], expected["position"]))


def test_phases_count_each_phase_and_move_graph_captures_and_compiles_to_compile(seed):
    rng = np.random.default_rng(seed)
    seconds = dict(zip(["write", "forward", "read", "load", "metrics"], rng.uniform(0.01, 5.0, 5)))
    again = float(rng.uniform(0.01, 1.0))
    capture, jit = (float(x) for x in rng.uniform(0, seconds["forward"] / 2, 2))
    for graphs, compiled, compile_s in ((None, 0.0, 0.0), (dict(graphs=2), 0.0, 0.0), (None, jit, jit),
                                        (dict(capture_s=capture), 0.0, capture),
                                        (dict(capture_s=capture), jit, capture + jit),
                                        (dict(capture_s=seconds["forward"]), jit, seconds["forward"])):  # capped
        phases = Phases()
        for name, value in seconds.items():
            phases.add(name, value)
        phases.add("load", again)  # a phase that comes back adds up
        with phases("read"):
            pass
        phases.captured(graphs, compiled)
        timings = phases.timings()
        order = ["read", "load", "compile", "forward", "metrics", "write"]
        assert list(timings) == [f"{p}_s" for p in order] + ["total_s"]
        assert timings["load_s"] == seconds["load"] + again
        assert seconds["read"] <= timings["read_s"] < seconds["read"] + 1.0
        assert timings["forward_s"] == pytest.approx(seconds["forward"] - compile_s, abs=1e-12)
        assert timings["compile_s"] == pytest.approx(compile_s, abs=1e-12)
        assert timings["total_s"] >= 0
        text = phase_times(dict(timings=timings))
        assert text == ", ".join(f"{p} {timings[p + '_s']:.2f} s" for p in order) + \
            f"; total {timings['total_s']:.2f} s"


# ---- 7. MMLU ---------------------------------------------------------------------------------------------


MMLU_SUBJECTS = ("abstract_algebra", "astronomy", "philosophy", "world_religions", "econometrics", "sociology",
                 "nutrition", "marketing")


def write_mmlu_run(out: Path, rng, max_drop: float = 5.0):
    """A small synthetic MMLU run folder written by lora_eval.tasks.mmlu.task's own table and file functions: base, an
    adapter close to base ('good') and one that turns a third of base's right answers wrong ('bad')."""
    counts = rng.integers(12, 30, len(MMLU_SUBJECTS))
    questions = pd.DataFrame(dict(subject=np.repeat(MMLU_SUBJECTS, counts),
                                  question_index=np.concatenate([np.arange(n) for n in counts]),
                                  answer=rng.choice(list("ABCD"), counts.sum())))
    q = len(questions)
    right = np.array(["ABCD".index(a) for a in questions["answer"]])
    base = rng.normal(0, 1, (q, 4))
    base[np.arange(q), right] += rng.choice([0.0, 3.0], q, p=[0.4, 0.6])  # base right on ~60%
    good = base + rng.normal(0, 0.05, (q, 4))  # flips a few close calls: a delta of ~1 point, never near max_drop
    bad = base.copy()
    spoil = rng.random(q) < 0.35
    bad[spoil, right[spoil]] -= 10.0  # never the prediction there
    lp = np.stack([base, good, bad], axis=1) - 5  # [Q, models, 4]
    table = question_table(questions, ["base", "good", "bad"], lp)
    result = MmluResult(questions=table, subjects=subject_table(table), summary=summary_table(table, max_drop),
                        run=dict(arguments=dict(model="tiny", split="test", shots=0, max_drop=max_drop),
                                 resolved=dict(device="cpu", dtype="float32"), fingerprint=dict(versions=dict(lora_eval="0.1.0")),
                                 timings=dict(forward_s=1.5), questions=q))
    save_run(result, out)
    return result


def test_mmlu_html_junit_and_rerendering(tmp_path, seed):
    rng = np.random.default_rng(seed)
    result = write_mmlu_run(tmp_path / "mmlu", rng)
    summary = result.summary
    micro = summary[summary["group"] == "micro"].set_index("model")
    assert micro.loc["bad", "delta"] < -0.05 and not micro.loc["bad", "passed"]
    assert micro.loc["good", "passed"] and micro.loc["base", "passed"]

    original = (tmp_path / "mmlu" / "report.html").read_bytes()
    for fmt, name in (("html", "report.html"), ("md", "mmlu.md")):
        got = CliRunner().invoke(cli, ["report", str(tmp_path / "mmlu"), "--format", fmt])
        assert got.exit_code == 0, (got.stderr, got.exception)
        assert got.stdout_bytes == (tmp_path / "mmlu" / name).read_bytes(), name
    page = Page(original.decode("utf-8"))
    assert len(figures(original.decode("utf-8"))) == 2  # by group, per subject
    assert page.h1[0][0] == "fail" and page.h1[0][1].startswith("lora-eval mmlu: FAILED: bad (")
    shown, classes = table_frame(page.tables[0])
    assert [c == "fail" for c in classes] == list(summary["model"] == "bad")
    expected = display_table(summary)
    assert [c["text"] for c in shown["accuracy %"]] == list(expected["accuracy %"])
    assert [c["text"] for c in shown["delta (points)"]] == list(expected["delta (points)"])
    changes, _ = table_frame(page.tables[1])
    q = result.questions
    for cells in changes.itertuples(index=False):
        model = cells[0]["text"]
        joined = q[q["model"] == model].merge(q[q["model"] == "base"], on=["subject", "question_index"])
        assert int(cells[3]["text"]) == int((joined["correct_x"] & ~joined["correct_y"]).sum())  # fixed
        assert int(cells[4]["text"]) == int((~joined["correct_x"] & joined["correct_y"]).sum())  # broken
    assert [c[0]["text"] for c in changes.itertuples(index=False)] == ["good", "bad"]

    _, cases = parse_junit(mmlu_junit(summary, result.run))
    assert [(c["classname"], c["name"]) for c in cases] == [
        (f"lora-eval.mmlu.{m}", "micro accuracy drop <= 5 points") for m in ("good", "bad")]
    assert cases[0]["failure"] is None and cases[1]["failure"] is not None
    message = cases[1]["failure"].get("message")
    assert message.startswith(f"bad: micro accuracy {100 * micro.loc['bad', 'delta']:+.2f} points against base, "
                              "limit -5")
    assert f"accuracy {micro.loc['bad', 'accuracy']:.6g} vs base {micro.loc['base', 'accuracy']:.6g}" in message
    assert all(f"{g}: accuracy" in cases[1]["failure"].text for g in ("micro", "macro", "STEM", "humanities"))
    _, cases = parse_junit(mmlu_junit(summary, dict(arguments=dict(max_drop=None))))
    assert [c["failure"] for c in cases] == [None, None]


def test_mmlu_command_writes_junit(tmp_path, seed, monkeypatch):
    """`lora-eval mmlu --junit FILE`: the CLI wiring (the scoring itself is lora_eval.tasks.mmlu.task's, replaced
    here by a synthetic result so no model runs)."""
    result = write_mmlu_run(tmp_path / "run", np.random.default_rng(seed))
    monkeypatch.setattr(importlib.import_module("lora_eval.commands"), "mmlu", lambda *args, **kwargs: result)
    junit = tmp_path / "ci" / "mmlu.xml"
    junit.parent.mkdir()
    got = CliRunner().invoke(cli, ["mmlu", "--model", "m", "--data", "d", "--out", str(tmp_path / "run"),
                                   "--max-drop", "5", "--junit", str(junit)])
    assert got.exit_code == 1, (got.stdout, got.stderr, got.exception)
    assert junit.read_text(encoding="utf-8") == mmlu_junit(result.summary, result.run)
    assert "report.html" in got.stdout


# ---- 8. the example notebook -----------------------------------------------------------------------------


def test_example_notebook_executes(tmp_path, monkeypatch):
    import nbclient
    import nbformat
    from jupyter_client.manager import KernelManager

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's demo folder goes under tmp_path
    # one OpenMP thread in the kernel: on a busy 2-core machine, 2 spinning threads made the demo ~6x slower
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(ROOT / "reports" / "example.ipynb", as_version=4)
    # The kernel's channels on Unix sockets under tmp_path, not TCP: jupyter_client picks TCP ports by binding port 0
    # and closing it before the kernel binds them, and any process on the machine (another CI run beside this one)
    # can take one in between (jupyter_client issue 487); kernel start and cells bounded generously for a busy machine.
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    nbclient.NotebookClient(notebook, km=kernel, timeout=180, startup_timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/svg+xml" in o.get("data", {})]
    assert len(images) == 3
    for image in images:
        assert len(figures(image["data"]["image/svg+xml"], named=False)) == 1
    tables = [o for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) >= 4
    assert any("passed: True" in o.get("text", "") for o in outputs)
    assert len(list(tmp_path.glob("lora-eval-demo-*/report/report.html"))) == 1


# ---- 9. CI runs the same regression ----------------------------------------------------------------------


def test_ci_and_workflow_run_the_same_regression():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "lora-regression.yml").read_text())
    steps = workflow["jobs"]["regression"]["steps"]
    commands = "\n".join(step.get("run", "") for step in steps)
    assert commands.index("torch==2.13.0") < commands.index("pip install .") < commands.index(
        "python -m lora_eval.golden check regression")
    upload = next(step for step in steps if step.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    assert upload["with"]["path"].split() == ["regression/run/", "regression/junit.xml"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("python3 -m pytest -q") < ci.index("python3 -m lora_eval.golden check")
