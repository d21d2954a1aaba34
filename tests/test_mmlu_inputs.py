"""Bad MMLU inputs and misleading MMLU reports (issue 42, classes 3 and 7), through `lora-eval mmlu` where the case is
a CLI input: each refusal is exit 2 and one line naming the file and the line where the row starts.

1. CSV rows read strictly: a quote opened and never closed (it once swallowed the next row: 134 questions of 135,
   one taking another's answer, exit 0), empty fields, field counts and answers, named by physical line (rows
   spanning lines and blank lines before them); the dev split alike; unreadable files; a byte-order mark, LF or
   CRLF and blank lines read as the release; repeated questions;
2. cais/mmlu parquet and `save_to_disk` rows read as strictly;
3. reports: a subject is "different from base" only by the exact McNemar test (never from 2 questions); the
   intervals are Agresti-Min's (the plain Wald interval of 2 broken questions was [-1, -1]); a threshold not given is
   "off", never "None".

Rows are random words (fresh seeds: the `seed` fixture); the subjects' names are real (global_facts, virology).
"""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lora_eval.render.formatting import thresholds_sentence
from lora_eval.results.metrics import check_thresholds, group_metrics
from lora_eval.inputs.mmlu_data import LETTERS, read_split
from lora_eval.results.mmlu_stats import (MIN_SIGNIFICANT, question_table, significant_subjects, subject_table,
                                          summary_table)
from lora_eval.render.files import render_report
from lora_eval.results.tables import CompareResult, MmluResult
from tests.cli_checks import assert_input_error
from tests.test_mmlu import DATA, copy_subjects, run_cli, select, write_cais_parquet, write_saved_dataset

pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="the MMLU release is not in ../shared/data/mmlu")

SUBJECT = "global_facts"


# ---- builders ----------------------------------------------------------------------------------------


def words(rng, low: int = 1, high: int = 6) -> str:
    """Lower-case random words: no comma, quote or line break, so csv writes them unquoted."""
    return " ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 8)))
                    for _ in range(rng.integers(low, high)))


def random_rows(rng, n: int) -> list[list[str]]:
    return [[words(rng, 3, 9), words(rng), words(rng), words(rng), words(rng), str(rng.choice(list(LETTERS)))]
            for _ in range(n)]


def csv_text(rows: list[list[str]]) -> str:
    """The rows as the release writes them: CRLF, quotes only where a field needs them."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    return out.getvalue()


def write_rows(path: Path, rows: list[list[str]], lines: dict[int, str] | None = None,
               blank_before: int = -1) -> list[int]:
    """`rows` written to `path` (row i's line replaced by `lines[i]` where given; a blank line before row
    `blank_before`); returns the line each row starts on."""
    text, starts = "", []
    for i, row in enumerate(rows):
        if i == blank_before:
            text += "\r\n"
        starts.append(text.count("\n") + 1)
        text += (lines or {}).get(i, csv_text([row]))
    path.write_bytes(text.encode("utf-8"))
    return starts


@pytest.fixture
def data(tmp_path, seed):
    """global_facts and abstract_algebra (dev and test) from the release; global_facts' test file replaced by 135
    random rows (the reproducer's count), one of them a question over two lines, and a blank line after it: so a
    row's line is not its index + 1. Returns (folder, rng, rows)."""
    root = copy_subjects(tmp_path / "mmlu", [SUBJECT, "abstract_algebra"])
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, 135)
    rows[3][0] = words(rng) + "\n" + words(rng)  # quoted, over two lines
    return root, rng, rows


def mmlu_args(root: Path, *extra) -> list:
    return ["mmlu", "--model", root / "no-model-needed", "--data", root, "--out", root.parent / "out", *extra]


# ---- 1. CSV rows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("split,field,following", [("test", 0, "quoted"), ("test", 3, "quoted"), ("dev", 0, "quoted"),
                                                   ("test", 0, "inches"), ("test", 2, "inches"), ("dev", 4, "inches")])
def test_an_unclosed_quote_does_not_swallow_the_next_row(data, split, field, following):
    """A quote opened before row r's `field` and never closed, the next row's question quoted ('"Q",...') or ending
    in a quote ('Q 10",...'): a lenient reader makes the two rows one of six fields (134 questions of 135, row r's
    text taking row r + 1's answer; exit 0 before)."""
    root, rng, rows = data
    if split == "dev":
        rows = rows[:5]
    r = int(rng.integers(5, len(rows) - 2)) if split == "test" else 2
    damaged = list(rows[r])
    damaged[field] = '"' + damaged[field]
    question = f'"{rows[r + 1][0]}"' if following == "quoted" else f'{rows[r + 1][0]} 10"'
    path = root / split / f"{SUBJECT}_{split}.csv"
    starts = write_rows(path, rows, {r: ",".join(damaged) + "\r\n",
                                     r + 1: question + "," + ",".join(rows[r + 1][1:]) + "\r\n"}, blank_before=5)
    name = ["question", *LETTERS, "answer"][field]
    problem = "a quoted field has more text after its closing quote (expected ',' there): a quote opened in this " \
        "row is never closed" if following == "quoted" else "a quote opened in this row is never closed: its " \
        f"{name} runs on over the end of a row (',{rows[r][5]}' and a line break, line {starts[r]})"
    assert_input_error(run_cli(*mmlu_args(root)), f"{path}: line {starts[r]}: {problem}")


def test_an_unclosed_quote_in_the_last_row(data):
    root, _, rows = data
    path = root / "test" / f"{SUBJECT}_test.csv"
    last = len(rows) - 1
    starts = write_rows(path, rows, {last: '"' + csv_text([rows[last]])}, blank_before=5)
    assert_input_error(run_cli(*mmlu_args(root)), f"{path}: line {starts[last]}: a quote opened in this row is never "
                       "closed (the file ends inside it)")


@pytest.mark.parametrize("field,value", [(0, ""), (0, "  "), (2, ""), (4, " \t"), (5, "")])
def test_an_empty_field_is_refused(data, field, value):
    """An empty question (or choice, or answer) was read as data before."""
    root, rng, rows = data
    r = int(rng.integers(5, len(rows)))
    rows[r][field] = value
    path = root / "test" / f"{SUBJECT}_test.csv"
    starts = write_rows(path, rows, blank_before=5)
    name = ["question", *LETTERS, "answer"][field]
    assert_input_error(run_cli(*mmlu_args(root, "--shots", 0)), f"{path}: line {starts[r]}: the {name} is empty")


@pytest.mark.parametrize("field,char", [(0, "\x00"), (3, "\x1b"), (0, "\x7f")])
def test_a_control_character_is_refused(data, field, char):
    """A NUL byte (a binary file, a broken export) was read as part of a question."""
    root, rng, rows = data
    r = int(rng.integers(0, len(rows)))
    at = int(rng.integers(0, len(rows[r][field]) + 1))
    rows[r][field] = rows[r][field][:at] + char + rows[r][field][at:]
    path = root / "test" / f"{SUBJECT}_test.csv"
    starts = write_rows(path, rows)
    name = ["question", *LETTERS, "answer"][field]
    assert_input_error(run_cli(*mmlu_args(root, "--shots", 0)), f"{path}: line {starts[r]}: the {name} holds the "
                       f"control character U+{ord(char):04X} at offset {at}")


@pytest.mark.parametrize("edit,needle", [
    (lambda row: row[:5], "5 fields, expected 6 (question, A, B, C, D, answer)"),
    (lambda row: row + ["extra"], "7 fields, expected 6"),
    (lambda row: row[:5] + ["a"], "answer must be one of A, B, C, D, found 'a'"),
    (lambda row: row[:5] + [" B"], "answer must be one of A, B, C, D, found ' B'")])
def test_fields_and_answers_are_named_by_their_line(data, edit, needle):
    root, rng, rows = data
    r = int(rng.integers(5, len(rows)))
    rows[r] = edit(rows[r])
    path = root / "test" / f"{SUBJECT}_test.csv"
    starts = write_rows(path, rows, blank_before=5)
    assert starts[r] > r + 1  # the two-line question and the blank line come before
    assert_input_error(run_cli(*mmlu_args(root, "--shots", 0)), f"{path}: line {starts[r]}: {needle}")


def test_the_dev_split_is_read_as_strictly(data):
    root, rng, _ = data
    path = root / "dev" / "abstract_algebra_dev.csv"
    rows = random_rows(rng, 5)
    rows[2][1] = ""
    starts = write_rows(path, rows)
    assert_input_error(run_cli(*mmlu_args(root)), f"{path}: line {starts[2]}: the A is empty")


def test_unreadable_files_exit_2_naming_them(data):
    """A folder named like a CSV and bytes that are not UTF-8 exited 3 ('unexpected IsADirectoryError'); a file
    without read permission too (not checked as root, who reads it anyway)."""
    root, rng, rows = data
    folder = root / "test" / "virology_test.csv"
    folder.mkdir()
    assert_input_error(run_cli(*mmlu_args(root)), f"{folder}: cannot be read (Is a directory)")
    folder.rmdir()
    path = root / "test" / f"{SUBJECT}_test.csv"
    starts = write_rows(path, rows, blank_before=5)
    r = int(rng.integers(5, len(rows)))
    raw = path.read_bytes().split(b"\n")
    line = starts[r] - 1  # (0-based among the lines)
    raw[line] = raw[line][:3] + b"\xff\xfe" + raw[line][3:]
    path.write_bytes(b"\n".join(raw))
    assert_input_error(run_cli(*mmlu_args(root)), f"{path}: line {starts[r]}: not UTF-8 text (byte 0xff")
    if os.geteuid() != 0:
        write_rows(path, rows)
        path.chmod(0)
        try:
            assert_input_error(run_cli(*mmlu_args(root)), f"{path}: cannot be read (Permission denied)")
        finally:
            path.chmod(0o644)


def test_bom_line_ends_and_blank_lines_read_as_the_release(tmp_path, seed):
    """A UTF-8 byte-order mark (Excel's) is dropped (it was read into the first question); LF for CRLF and blank
    lines between rows change nothing."""
    root = copy_subjects(tmp_path / "mmlu", [SUBJECT], splits=("test",))
    path = root / "test" / f"{SUBJECT}_test.csv"
    _, _, expected = read_split(root, "test")
    original = path.read_bytes()
    rng = np.random.default_rng(seed)
    lines = original.split(b"\r\n")
    blank = int(rng.integers(1, len(lines) - 1))
    for variant in (b"\xef\xbb\xbf" + original, original.replace(b"\r\n", b"\n"),
                    b"\r\n".join(lines[:blank] + [b"", b""] + lines[blank:]) + b"\r\n\r\n"):
        path.write_bytes(variant)
        _, _, got = read_split(root, "test")
        columns = ["subject", "question_index", "question", *LETTERS, "answer"]
        pd.testing.assert_frame_equal(got[columns], expected[columns])
    assert got["key"].tolist()[blank - 1:blank + 1] == [f"line {blank}", f"line {blank + 3}"]


def test_repeated_questions(data):
    """An exact repeat is kept (the release repeats 28 rows); the same question and choices with another answer is
    refused, naming both lines."""
    root, rng, rows = data
    r, s = sorted(int(x) for x in rng.choice(np.arange(5, len(rows)), 2, replace=False))
    path = root / "test" / f"{SUBJECT}_test.csv"
    rows[s] = list(rows[r])
    write_rows(path, rows, blank_before=5)
    assert len(read_split(root, "test")[2].query("subject == @SUBJECT")) == len(rows)
    rows[s][5] = LETTERS[(LETTERS.index(rows[r][5]) + 1) % 4]
    starts = write_rows(path, rows, blank_before=5)
    assert_input_error(run_cli(*mmlu_args(root, "--shots", 0)), f"{path}: line {starts[s]}: the question and choices "
                       f"of line {starts[r]} again, with answer {rows[s][5]} where line {starts[r]} has {rows[r][5]}")


@pytest.mark.parametrize("name", ["virology_tst.csv", "virology_test.CSV", "virology.csv"])
def test_a_misnamed_csv_is_not_skipped(data, name):
    """A CSV of the split folder that the reader's pattern misses was skipped: its subject left out of the run."""
    root, _, _ = data
    stray = shutil.copy(DATA / "test" / "virology_test.csv", root / "test" / name)
    assert_input_error(run_cli(*mmlu_args(root)), f"{stray}: a CSV file in test/ not named <subject>_test.csv")


def test_the_real_release_still_reads_whole():
    for split, total in (("test", 14_042), ("dev", 285), ("val", 1_531)):
        layout, files, frame = read_split(DATA, split)
        assert layout == "csv" and len(files) == 57 and len(frame) == total
        assert not frame["question"].str.startswith("\ufeff").any()


# ---- 2. cais/mmlu rows -------------------------------------------------------------------------------


@pytest.fixture
def cais(tmp_path):
    real = {s: read_split(DATA, s)[2] for s in ("dev", "test")}
    splits = {s: select(frame, ["virology"], None, DATA, s) for s, frame in real.items()}
    root = write_cais_parquet(tmp_path / "cais", splits)
    return root, root / "virology" / "test-00000-of-00001.parquet", splits


def test_cais_rows_are_read_strictly(cais, seed):
    root, path, splits = cais
    good = pd.read_parquet(path)
    r = int(np.random.default_rng(seed).integers(len(good)))

    def edited(column, value):
        frame = good.copy()
        frame[column] = frame[column].astype(object)
        frame.at[r, column] = value
        return frame

    cases = [(edited("question", "  "), f"row {r}: question must be a non-empty string"),
             (edited("subject", ""), f"row {r}: subject must be a non-empty string"),
             (edited("choices", ["w", "x", "", "z"]), f"row {r}: C must be a non-empty string"),
             (good.assign(choices=["".join(c) for c in good["choices"]]),  # 4 one-letter choices as one string
              "row 0: choices must be a list of 4 answers, found a str"),
             (good.assign(answer=[LETTERS[a] for a in good["answer"]]).pipe(
                 lambda f: f.assign(answer=[*f["answer"][:r], "E", *f["answer"][r + 1:]])),
              f"row {r}: answer must be an integer 0-3 or a letter A-D, found 'E'")]
    for frame, needle in cases:
        frame.to_parquet(path, index=False)
        assert_input_error(run_cli(*mmlu_args(root)), f"{path}: {needle}")
    good.assign(answer=[LETTERS[a] for a in good["answer"]]).to_parquet(path, index=False)  # letters are answers too
    got = read_split(root, "test")[2]
    assert got["answer"].tolist() == splits["test"]["answer"].tolist()


def test_saved_dataset_rows_are_read_strictly(cais, tmp_path, seed):
    _, _, splits = cais
    r = int(np.random.default_rng(seed).integers(len(splits["test"])))
    test = splits["test"].copy()
    test.at[r, "question"] = ""
    saved = write_saved_dataset(tmp_path / "saved", {"dev": splits["dev"], "test": test})
    assert_input_error(run_cli(*mmlu_args(saved)), f"{saved / 'test'}: row {r}: question must be a non-empty string")


# ---- 3. reports --------------------------------------------------------------------------------------


def broken_answers(counts: dict[str, tuple[int, int]], rng) -> pd.DataFrame:
    """A question table of base and 'lora' where, per subject, (n, k): n questions, base right on all, lora wrong
    on the first k."""
    subjects = np.repeat(list(counts), [n for n, _ in counts.values()])
    index = np.concatenate([np.arange(n) for n, _ in counts.values()])
    answers = rng.choice(list(LETTERS), len(subjects))
    right = np.array([LETTERS.index(a) for a in answers])
    base = rng.normal(0, 1, (len(subjects), 4))
    base[np.arange(len(subjects)), right] += 20  # always right
    lora = base.copy()
    wrong = np.concatenate([np.arange(n) < k for n, k in counts.values()])
    lora[wrong, right[wrong]] -= 40
    questions = pd.DataFrame(dict(subject=subjects, question_index=index, answer=answers))
    return question_table(questions, ["base", "lora"], np.stack([base, lora], axis=1) - 5)


def mmlu_result(table: pd.DataFrame, max_drop) -> MmluResult:
    return MmluResult(questions=table, subjects=subject_table(table), summary=summary_table(table, max_drop),
                      run=dict(arguments=dict(model="tiny", split="test", shots=0, max_drop=max_drop),
                               resolved=dict(device="cpu", dtype="float32"), questions=len(table) // 2))


def test_small_subjects_are_never_significant(seed):
    """Two questions both broken gave the interval [-1, -1] and the 'excludes 0' list; now the list is the exact
    McNemar test's, which needs MIN_SIGNIFICANT questions that changed, and the interval holds 0."""
    counts = {"virology": (2, 2), "anatomy": (MIN_SIGNIFICANT - 1, MIN_SIGNIFICANT - 1),
              "astronomy": (MIN_SIGNIFICANT, MIN_SIGNIFICANT), "nutrition": (40, 3)}
    table = broken_answers(counts, np.random.default_rng(seed))
    subjects = subject_table(table).set_index(["model", "subject"])
    assert subjects.loc[("lora", "virology"), "delta"] == -1
    assert subjects.loc[("lora", "virology"), "delta_low"] == -1 < 0 < subjects.loc[("lora", "virology"), "delta_high"]
    significant = significant_subjects(table)
    assert significant["subject"].tolist() == ["astronomy"]
    assert significant["p_value"].tolist() == [2 * 0.5 ** MIN_SIGNIFICANT]
    result = mmlu_result(table, None)
    md, page = render_report(result, "md"), render_report(result, "html")
    section = md.split("## Subjects that differ from base")[1].split("## Run")[0]
    assert "| lora | astronomy | 6 | 0 | 6 | -100.0 | 0.0312 |" in section and "virology" not in section
    drops = md.split("## Subjects with the largest drops")[1].split("## Subjects that differ")[0]
    # 5 of 5 broken: Agresti-Min's interval leaves out 0, the exact test does not; the p is shown beside it
    low, high = subjects.loc[("lora", "anatomy"), ["delta_low", "delta_high"]]
    assert high < 0 and "anatomy" not in section
    assert f"| lora | anatomy | 5 | 0.0 | -100.0 | [{100 * low:+.1f}, {100 * high:+.1f}] | 0.0625 |" in drops
    assert "| lora | virology | 2 | 0.0 | -100.0 | [-100.0, +19.3] | 0.5 |" in drops
    assert "excludes 0" not in page and "<h2>Subjects that differ from base</h2>" in page
    listed = page.split("<h2>Subjects that differ from base</h2>")[1].split("<details>")[0]
    assert "astronomy" in listed and "virology" not in listed and "anatomy" not in listed


def test_the_micro_interval_on_14042_questions_is_walds(seed):
    """Agresti-Min's interval equals the plain Wald interval to 1e-4 on the full test split's size."""
    rng = np.random.default_rng(seed)
    table = broken_answers({"miscellaneous": (14_042, int(rng.integers(200, 1500)))}, rng)
    micro = summary_table(table).set_index(["model", "group"]).loc[("lora", "micro")]
    d = table[table["model"] == "lora"]["correct"].to_numpy(float) - \
        table[table["model"] == "base"]["correct"].to_numpy(float)
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert micro["delta"] == pytest.approx(d.mean(), abs=1e-15)
    assert micro["delta_low"] == pytest.approx(d.mean() - 1.96 * se, abs=1e-4)
    assert micro["delta_high"] == pytest.approx(d.mean() + 1.96 * se, abs=1e-4)


def compare_result(max_k2, max_mean_abs_diff, rng) -> CompareResult:
    """A compare result from the metrics' own functions on random per-token differences."""
    n = 40
    tokens = pd.DataFrame(dict(adapter=np.repeat(["base", "lora"], n), sample_id=np.tile(np.arange(n) // 8, 2),
                               position=np.tile(np.arange(n) % 8, 2), d=rng.normal(0, 0.01, 2 * n), mask=True))
    summary = check_thresholds(group_metrics(tokens, ["adapter"]), max_k2, max_mean_abs_diff)
    return CompareResult(summary=summary, samples=group_metrics(tokens, ["adapter", "sample_id"]), tokens=tokens,
                         run=dict(arguments=dict(model="tiny", max_k2=max_k2, max_mean_abs_diff=max_mean_abs_diff),
                                  resolved=dict(device="cpu", dtype="float32")))


def test_a_threshold_not_given_is_off(seed):
    """'<= None' and 'max drop None' were printed where a threshold was not given."""
    rng = np.random.default_rng(seed)
    limit = float(rng.uniform(0.1, 5))
    for result, needles in [
            (compare_result(None, None, rng), ["thresholds: k2 off, mean_abs_diff off"]),
            (compare_result(limit, None, rng), [f"thresholds: k2 <= {limit}, mean_abs_diff off"]),
            (mmlu_result(broken_answers({"virology": (9, 1)}, rng), None), ["max drop off"]),
            (mmlu_result(broken_answers({"virology": (9, 1)}, rng), limit), [f"max drop <= {limit} points"])]:
        for fmt in ("md", "html"):
            text = render_report(result, fmt).replace("&lt;", "<")
            assert "<= None" not in text and "drop None" not in text, fmt
            for needle in needles:
                assert needle in text, (fmt, needle)
    assert thresholds_sentence(dict(max_k2=None, max_mean_abs_diff=0.5)) == "thresholds: k2 off, mean_abs_diff <= 0.5"
