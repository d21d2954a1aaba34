"""MMLU data: the test / val / dev questions of a local MMLU folder (nothing downloaded): CSV files with Python's csv
module, parquet files with pyarrow, folders written by `datasets` with `datasets` (reading the first two through
`datasets`' builders cost ~1-3 s of import and conversion, a twentieth of a whole GPU MMLU run, for the same values).

Two layouts: the original release (`dev/ val/ test/`, one headerless CSV per subject, `<subject>_<split>.csv`,
columns question, A, B, C, D, answer letter) and Hugging Face `cais/mmlu` on disk — parquet files per subject and
split (`<subject>/test-00000-of-00001.parquet`; the `all/` folder is skipped when per-subject folders exist) or a
folder written by `DatasetDict.save_to_disk` — with columns question, subject, choices (4 strings), answer (int
0-3). The `validation` split is `val` here. Rows are numbered from 0 in file order (`question_index`); bad data
raises an InputError naming the file and the row. CATEGORIES: the paper's grouping of the 57 subjects.
"""

from __future__ import annotations

import contextlib
import csv
import os
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import InputError

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
    question, A, B, C, D, answer (letter), file, row — in file order."""
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
                             key=f"row {group['row'].iloc[0]}")
    frame["question_index"] = frame.groupby("subject", sort=False).cumcount()
    return layout, files, frame[["subject", "question_index", "question", *LETTERS, "answer", "file", "row"]]


def _read_csv(data: Path, split: str) -> tuple[list[Path], list[pd.DataFrame]]:
    """The original release: `<split>/<subject>_<split>.csv`, no header, 6 columns, answer a letter."""
    folder = data / split
    files = sorted(folder.glob(f"*_{split}.csv"))
    if not files:
        raise InputError(folder, f"no {split} questions: expected <subject>_{split}.csv files here (the original "
                         "MMLU release), cais/mmlu parquet files or a folder saved by datasets under the data folder")
    parts = []
    for path in files:  # every field a string, exactly as written
        frame = pd.DataFrame(_csv_records(path), columns=CSV_COLUMNS, dtype=object)
        frame.insert(0, "subject", path.name[:-len(f"_{split}.csv")])
        parts.append(_checked(frame, path))
    return files, parts


def _csv_records(path: Path) -> list[list[str]]:
    """The file's records, each exactly the 6 fields (a reader that pads short rows or drops extra fields would hide
    a damaged file); blank lines skipped."""
    records = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for record in csv.reader(f):
                if not record:  # a blank line
                    continue
                if len(record) != len(CSV_COLUMNS):
                    raise InputError(path, f"{len(record)} fields, expected {len(CSV_COLUMNS)} "
                                     f"({', '.join(CSV_COLUMNS)})", key=f"row {len(records)}")
                records.append(record)
    except (UnicodeDecodeError, csv.Error) as e:
        raise InputError(path, f"not a UTF-8 CSV file ({e})", key=f"row {len(records)}") from None
    if not records:
        raise InputError(path, "no questions (empty file)")
    return records


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
    with _datasets_quiet() as datasets:
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
    """question/subject/choices/answer(0-3) -> subject, question, A, B, C, D, answer (letter)."""
    options, answers = [], []
    for row, (choices, answer) in enumerate(zip(frame["choices"], frame["answer"])):
        if choices is None or len(choices) != len(LETTERS):
            raise InputError(where, f"choices must hold {len(LETTERS)} answers, found "
                             f"{'none' if choices is None else len(choices)}", key=f"row {row}")
        if isinstance(answer, (bool, np.bool_)) or not isinstance(answer, (int, np.integer)) or not 0 <= answer < 4:
            raise InputError(where, f"answer must be an integer 0-3 (A-D), found {answer!r}", key=f"row {row}")
        options.append(list(choices))
        answers.append(LETTERS[answer])
    out = pd.DataFrame(options, columns=list(LETTERS), index=frame.index, dtype=object)
    return pd.concat([frame[["subject", "question"]], out], axis=1).assign(answer=answers)


def _checked(frame: pd.DataFrame, where: Path) -> pd.DataFrame:
    """Every field a string, the subject non-empty, the answer a letter A-D; adds file and row."""
    for row, values in enumerate(frame[["subject", "question", *LETTERS, "answer"]].itertuples(index=False)):
        for name, value in zip(["subject", "question", *LETTERS, "answer"], values):
            if not isinstance(value, str) or (name == "subject" and not value):
                raise InputError(where, f"{name} must be a non-empty string, found {value!r}" if name == "subject"
                                 else f"{name} must be a string, found {value!r}", key=f"row {row}")
        if values[-1] not in LETTERS:
            raise InputError(where, f"answer must be one of {', '.join(LETTERS)}, found {values[-1]!r}",
                             key=f"row {row}")
    return frame.assign(file=str(where), row=np.arange(len(frame)))


@contextlib.contextmanager
def _datasets_quiet():
    """`datasets` offline (HF_DATASETS_OFFLINE=1 for the block), without its progress bars and logs; yields the
    module. The user's setting is back afterwards."""
    saved = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read when datasets is first imported
    import datasets
    from datasets.utils import logging as ds_logging
    from huggingface_hub import constants

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # if it was imported before
    bars_on = datasets.is_progress_bar_enabled()
    verbosity = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield datasets
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars_on:
            datasets.enable_progress_bars()
        if saved is None:
            del os.environ["HF_DATASETS_OFFLINE"]
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved
        offline = constants.HF_HUB_OFFLINE if saved is None else saved.upper() in datasets.config.ENV_VARS_TRUE_VALUES
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = offline  # as datasets/config.py


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
