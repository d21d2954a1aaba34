"""MMLU data: the test / val / dev questions of a local MMLU folder (nothing downloaded): CSV files with Python's csv
module, parquet files with pyarrow, folders written by `datasets` with `datasets` (reading the first two through
`datasets`' builders would add seconds of import and conversion for the same values: BENCHMARKS-history 18.3).

Two layouts: the original release (`dev/ val/ test/`, one headerless CSV per subject, `<subject>_<split>.csv`,
columns question, A, B, C, D, answer letter) and Hugging Face `cais/mmlu` on disk — parquet files per subject and
split (`<subject>/test-00000-of-00001.parquet`; the `all/` folder is skipped when per-subject folders exist) or a
folder written by `DatasetDict.save_to_disk` — with columns question, subject, choices (4 strings), answer (int
0-3). The `validation` split is `val` here. Rows are numbered from 0 in file order (`question_index`).

Read strictly, since a damaged file must not become questions (a quote opened and never closed swallows the next
row: one question fewer, one taking another's answer): a CSV row is exactly six fields, none empty or only
whitespace, quotes closed, the answer exactly one of A-D, and no field holds a row's end (',A'-',D' then a line
break: a row swallowed by an unclosed quote; no field of the real release holds one); cais/mmlu rows have a
non-empty question and subject, choices exactly 4 non-empty strings, the answer an integer 0-3 or a letter A-D. A
question repeated in a subject with the same choices but another answer is refused (the release repeats 28 rows
exactly: those are kept, as lm-eval keeps them). A UTF-8 byte-order mark is dropped, CRLF or LF line ends and blank
lines between rows are accepted (the release has all of them). Every error names the file and where: `line N` of a
CSV (the physical line where the row starts, from 1) or `row N` of a parquet / saved split (from 0); the questions
carry that as `key`. CATEGORIES: the paper's grouping of the 57 subjects.
"""

from __future__ import annotations

import codecs
import csv
import io
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import InputError
from ..hf import quiet_libraries

LETTERS = ("A", "B", "C", "D")
CSV_COLUMNS = ["question", *LETTERS, "answer"]
CAIS_COLUMNS = ["question", "subject", "choices", "answer"]
SPLITS = {"dev": ("dev",), "val": ("val", "validation"), "test": ("test",)}  # our name -> names on disk

# The paper's grouping (hendrycks/test categories.py: subject -> subcategory -> category), flattened.
_GROUPED = {
    "STEM": """abstract_algebra astronomy college_biology college_chemistry college_computer_science
        college_mathematics college_physics computer_security conceptual_physics electrical_engineering
        elementary_mathematics high_school_biology high_school_chemistry high_school_computer_science
        high_school_mathematics high_school_physics high_school_statistics machine_learning""",
    "humanities": """formal_logic high_school_european_history high_school_us_history high_school_world_history
        international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy prehistory
        professional_law world_religions""",
    "social sciences": """econometrics high_school_geography high_school_government_and_politics
        high_school_macroeconomics high_school_microeconomics high_school_psychology human_sexuality
        professional_psychology public_relations security_studies sociology us_foreign_policy""",
    "other": """anatomy business_ethics clinical_knowledge college_medicine global_facts human_aging management
        marketing medical_genetics miscellaneous nutrition professional_accounting professional_medicine
        virology""",
}
CATEGORIES = {subject: group for group, names in _GROUPED.items() for subject in names.split()}  # 57 subjects

def read_split(data: str | Path, split: str) -> tuple[str, list[Path], pd.DataFrame]:
    """(layout, files read, questions) for one split of an MMLU folder. Questions: subject, question_index,
    question, A, B, C, D, answer (letter), file, row, key — in file order."""
    data = Path(data)
    if not data.is_dir():
        raise InputError(data, "MMLU data folder not found")
    if (data / "dataset_dict.json").is_file() or any(data.glob("*/dataset_dict.json")):
        layout, (files, parts) = "datasets.save_to_disk", _read_saved(data, split)
    elif any(data.rglob("*.parquet")):
        layout, (files, parts) = "cais/mmlu parquet", _read_parquet(data, split)
    else:
        layout, (files, parts) = "csv", _read_csv(data, split)
    frame = pd.concat(parts, ignore_index=True)
    for subject, group in frame.groupby("subject", sort=False):
        if subject not in CATEGORIES:
            raise InputError(group["file"].iloc[0], f"subject '{subject}' is not one of MMLU's 57 subjects",
                             key=group["key"].iloc[0])
    _check_repeats(frame)
    frame["question_index"] = frame.groupby("subject", sort=False).cumcount()
    return layout, files, frame[["subject", "question_index", "question", *LETTERS, "answer", "file", "row", "key"]]


def _check_repeats(frame: pd.DataFrame) -> None:
    """A question repeated in its subject with the same choices must have the same answer (one of the two is
    wrong, and either would be scored); exact repeats are kept (the release has 28)."""
    same = ["subject", "question", *LETTERS]
    repeated = frame[frame.duplicated(same, keep=False)]
    for _, group in repeated.groupby(same, sort=False):
        first = group.iloc[0]
        other = group[group["answer"] != first["answer"]]
        if len(other):
            other = other.iloc[0]
            where = first["key"] if other["file"] == first["file"] else f"{first['file']} {first['key']}"
            raise InputError(other["file"], f"the question and choices of {where} again, with answer "
                             f"{other['answer']} where {where} has {first['answer']}", key=other["key"])


def _read_csv(data: Path, split: str) -> tuple[list[Path], list[pd.DataFrame]]:
    """The original release: `<split>/<subject>_<split>.csv`, no header, 6 columns, answer a letter."""
    folder = data / split
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise InputError(folder, f"no {split} questions: expected <subject>_{split}.csv files here (the original "
                         "MMLU release), cais/mmlu parquet files or a folder saved by datasets under the data folder")
    stray = [f for f in sorted(folder.iterdir()) if f.suffix.lower() == ".csv" and f not in files]
    if stray:  # (skipped, its subject would be missing from the run without a word)
        raise InputError(stray[0], f"a CSV file in {split}/ not named <subject>_{split}.csv; rename it (e.g. "
                         f"anatomy_{split}.csv) or move it out of the data folder")
    parts = []
    for path in files:  # every field a string, exactly as written
        lines, records = _csv_records(path)
        frame = pd.DataFrame(records, columns=CSV_COLUMNS, dtype=object)
        frame.insert(0, "subject", path.name[:-len(f"_{split}.csv")])
        parts.append(_checked(frame, path, [f"line {n}" for n in lines]))
    return files, parts


LINE_END = re.compile(r"\r\n|\r|\n")  # a line end as csv.reader over a file opened with newline="" sees one
ROW_END = re.compile(r",[ABCD](?:\r\n|\r|\n)")  # the end of a row, inside a field: an unclosed quote swallowed it
CSV_ERRORS = {  # csv.Error's words -> what they mean in an MMLU file
    "unexpected end of data": "a quote opened in this row is never closed (the file ends inside it)",
    "expected after": "a quoted field has more text after its closing quote (expected ',' there): a quote opened "
                      "in this row is never closed, or a quote inside a quoted field is not written twice",
    "field larger than field limit": "a field of over 131072 characters: a quote opened in this row is never "
                                     "closed",
}


def _csv_records(path: Path) -> tuple[list[int], list[list[str]]]:
    """The file's records and the line each starts on (from 1), each record exactly the 6 fields, none empty, no
    quote left open; blank lines skipped. A reader that pads short rows, drops extra fields or runs an unclosed
    quote on into the next row would hide a damaged file."""
    try:
        raw = path.read_bytes()
    except OSError as e:  # a folder named like a CSV, a file without read permission
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    raw = raw[len(codecs.BOM_UTF8):] if raw.startswith(codecs.BOM_UTF8) else raw  # (as Excel writes UTF-8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = len(LINE_END.findall(raw[:e.start].decode("utf-8"))) + 1
        raise InputError(path, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): MMLU CSV files "
                         "are UTF-8", key=f"line {line}") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    lines, records, start = [], [], 1
    while True:
        try:
            record = next(reader, None)
        except csv.Error as e:
            problem = next((v for k, v in CSV_ERRORS.items() if k in str(e)), f"not a CSV row ({e})")
            raise InputError(path, problem, key=f"line {start}") from None
        if record is None:
            break
        if record:  # (a blank line is an empty record)
            _check_record(record, path, start)
            lines.append(start)
            records.append(record)
        start = reader.line_num + 1
    if not records:
        raise InputError(path, "no questions (empty file)")
    return lines, records


def _check_record(record: list[str], path: Path, start: int) -> None:
    """One CSV row starting on line `start`: no swallowed row end, 6 fields, none empty, the answer a letter."""
    before = 0  # line ends in the fields before this one
    for name, value in zip(CSV_COLUMNS, record):
        if "\n" not in value and "\r" not in value:  # (most fields: one line)
            continue
        end = ROW_END.search(value)
        if end:
            line = start + before + len(LINE_END.findall(value[:end.start()]))
            raise InputError(path, f"a quote opened in this row is never closed: its {name} runs on over the end "
                             f"of a row ('{end.group()[:2]}' and a line break, line {line})",
                             key=f"line {start}")
        before += len(LINE_END.findall(value))
    if len(record) != len(CSV_COLUMNS):
        raise InputError(path, f"{len(record)} fields, expected {len(CSV_COLUMNS)} ({', '.join(CSV_COLUMNS)})",
                         key=f"line {start}")
    for name, value in zip(CSV_COLUMNS, record):
        if not value.strip():
            raise InputError(path, f"the {name} is empty, expected text in each of the {len(CSV_COLUMNS)} fields "
                             f"({', '.join(CSV_COLUMNS)})", key=f"line {start}")
        _check_text(value, name, path, f"line {start}")


CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters other than tab and line ends


def _check_text(value: str, name: str, where: Path, key: str) -> None:
    """A field is text: a control character (a NUL byte from a binary file or a broken export) is refused; no field
    of the release holds one."""
    bad = CONTROL.search(value)
    if bad:
        raise InputError(where, f"the {name} holds the control character U+{ord(bad.group()):04X} at offset "
                         f"{bad.start()}: expected text", key=key)


def _read_parquet(data: Path, split: str) -> tuple[list[Path], list[pd.DataFrame]]:
    """cais/mmlu parquet: `<subject>/<split>-*.parquet` (or files of one folder), the subject in a column."""
    import pyarrow.parquet as pq

    files = [f for f in sorted(data.rglob("*.parquet")) if f.name.split("-")[0].split(".")[0] in SPLITS[split]]
    per_subject = [f for f in files if "all" not in f.relative_to(data).parts[:-1]]
    files = per_subject or files  # all/ repeats every subject
    if not files:
        raise InputError(data, f"no {split} parquet files ({' or '.join(SPLITS[split])}-*.parquet)")
    folders = sorted({f.parent for f in files})
    subjects = {}
    for folder in folders:  # one folder per subject: two copies (e.g. two cache snapshots) would count twice
        if folder.name in subjects and folder != data:
            raise InputError(data, f"subject '{folder.name}' is found twice ({subjects[folder.name]} and {folder}); "
                             "point --data at one copy of the release")
        subjects[folder.name] = folder
    parts = []
    for path in files:
        try:
            meta = pq.read_metadata(path)
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            raise InputError(path, f"not a readable parquet file ({e})") from None
        missing = [c for c in CAIS_COLUMNS if c not in meta.schema.to_arrow_schema().names]
        if missing:
            raise InputError(path, f"missing column (cais/mmlu has {', '.join(CAIS_COLUMNS)})", key=missing[0])
        if meta.num_rows == 0:
            raise InputError(path, "no questions (empty file)")
        try:
            frame = pq.read_table(path, columns=CAIS_COLUMNS).to_pandas()
        except Exception as e:  # as above
            raise InputError(path, f"not a readable parquet file ({e})") from None
        parts.append(_checked(_from_cais(frame, path), path))
    return files, parts


def _read_saved(data: Path, split: str) -> tuple[list[Path], list[pd.DataFrame]]:
    """Folders written by `DatasetDict.save_to_disk`: the data folder itself or one per subject."""
    with quiet_libraries(datasets=True) as datasets:
        roots = [data] if (data / "dataset_dict.json").is_file() else sorted(
            p.parent for p in data.glob("*/dataset_dict.json"))
        files, parts = [], []
        for root in roots:
            try:
                saved = datasets.load_from_disk(str(root))
            except Exception as e:  # datasets raises several types for a damaged folder
                raise InputError(root, f"not a folder saved by datasets ({e})") from None
            names = [n for n in SPLITS[split] if n in saved]
            if not names:
                continue
            where = root / names[0]
            missing = [c for c in CAIS_COLUMNS if c not in saved[names[0]].column_names]
            if missing:
                raise InputError(where, f"missing column (cais/mmlu has {', '.join(CAIS_COLUMNS)})", key=missing[0])
            if len(saved[names[0]]) == 0:
                raise InputError(where, "no questions (empty split)")
            frame = saved[names[0]].select_columns(CAIS_COLUMNS).to_pandas()
            files += sorted(where.glob("*.arrow"))
            parts.append(_checked(_from_cais(frame, where), where))
    if not parts:
        raise InputError(data, f"no '{' or '.join(SPLITS[split])}' split in the saved dataset")
    return files, parts


def _from_cais(frame: pd.DataFrame, where: Path) -> pd.DataFrame:
    """question/subject/choices/answer(0-3 or A-D) -> subject, question, A, B, C, D, answer (letter)."""
    options, answers = [], []
    for row, (choices, answer) in enumerate(zip(frame["choices"], frame["answer"])):
        if not isinstance(choices, (list, tuple, np.ndarray)) or len(choices) != len(LETTERS):
            found = "none" if choices is None else f"{len(choices)}" if isinstance(
                choices, (list, tuple, np.ndarray)) else f"a {type(choices).__name__}"
            raise InputError(where, f"choices must be a list of {len(LETTERS)} answers, found {found}",
                             key=f"row {row}")
        if isinstance(answer, str) and answer in LETTERS:
            answer = LETTERS.index(answer)
        if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, (int, np.integer)) or not 0 <= answer < 4:
            raise InputError(where, f"answer must be an integer 0-3 or a letter A-D, found {answer!r}",
                             key=f"row {row}")
        options.append(list(choices))
        answers.append(LETTERS[answer])
    out = pd.DataFrame(options, columns=list(LETTERS), index=frame.index, dtype=object)
    return pd.concat([frame[["subject", "question"]], out], axis=1).assign(answer=answers)


def _checked(frame: pd.DataFrame, where: Path, keys: list[str] | None = None) -> pd.DataFrame:
    """Every field a non-empty string (not only whitespace), the answer a letter A-D; adds file, row and key (where
    an error names the row: `keys`, else `row N`)."""
    keys = keys or [f"row {row}" for row in range(len(frame))]
    names = ["subject", "question", *LETTERS, "answer"]
    for key, values in zip(keys, frame[names].itertuples(index=False)):
        for name, value in zip(names, values):
            if not isinstance(value, str) or not value.strip():
                raise InputError(where, f"{name} must be a non-empty string, found {value!r}", key=key)
            _check_text(value, name, where, key)
        if values[-1] not in LETTERS:
            raise InputError(where, f"answer must be one of {', '.join(LETTERS)}, found {values[-1]!r}", key=key)
    return frame.assign(file=str(where), row=np.arange(len(frame)), key=keys)


def select(questions: pd.DataFrame, subjects, limit: int | None, data, split: str) -> pd.DataFrame:
    """Keep the named subjects (all by default) and the first `limit` questions of each."""
    if subjects:
        present = set(questions["subject"])
        unknown = [s for s in subjects if s not in present]
        if unknown:
            raise InputError("--subjects", f"'{unknown[0]}' has no {split} questions in {data}; available: "
                             f"{', '.join(sorted(present))}")
        questions = questions[questions["subject"].isin(subjects)]
    if limit is not None:
        questions = questions[questions["question_index"] < limit]
    return questions.reset_index(drop=True)


def check_shots(dev: pd.DataFrame, questions: pd.DataFrame, shots: int, layout: str, data) -> pd.DataFrame:
    """The dev rows of the tested subjects; each subject needs `shots` of them."""
    counts = dev["subject"].value_counts()
    for subject in questions["subject"].unique():
        have = int(counts.get(subject, 0))
        if have < shots:
            where = Path(data) / "dev" / f"{subject}_dev.csv" if layout == "csv" else \
                (dev.loc[dev["subject"] == subject, "file"].iloc[0] if have else f"{data} (dev split)")
            what = "no dev examples" if have == 0 else f"only {have} dev examples"
            raise InputError(where, f"subject '{subject}' has {what}; --shots {shots} needs {shots}")
    return dev[dev["subject"].isin(set(questions["subject"]))]
