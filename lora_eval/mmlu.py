"""`lora-eval mmlu`: MMLU accuracy of the base model and of every adapter in one pass, with paired deltas.

What lives here: reading MMLU (through `datasets`, nothing downloaded), building the k-shot prompts,
scoring the four answer letters with `Engine.next_token_logprobs` in mixed multi-adapter batches, the result
tables (DataFrames first) and the files written from them.

Data. Two layouts, both read with `datasets`: the original release (`dev/ val/ test/`, one headerless CSV
per subject, `<subject>_<split>.csv`, columns question, A, B, C, D, answer letter) and Hugging Face
`cais/mmlu` on disk — parquet files per subject and split (`<subject>/test-00000-of-00001.parquet`; the `all/`
folder is skipped when per-subject folders exist) or a folder written by `DatasetDict.save_to_disk` — with
columns question, subject, choices (4 strings), answer (int 0-3). The `validation` split is `val` here.
Rows are numbered from 0 in file order (`question_index`); bad data raises an InputError naming the file and
the row.

Prompt (the paper's format; one space after "about", where the original script printed two):
    The following are multiple choice questions (with answers) about {subject, _ as spaces}.\\n\\n
    then k dev examples, each  {question}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer: {letter}\\n\\n
    then the test question      {question}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer:
The shots are the subject's first k dev rows. When the tokenised prompt is longer than the model's
`max_position_embeddings`, shots are dropped from the end until it fits (the paper's rule).

Scored token. The dev examples continue "Answer:" with " A"; so the candidates are the tokens that the
model's own tokenizer produces for the letter right after "\\nAnswer:" in the text "\\nAnswer: A" — " A" (one
token, `ĠA`) for byte-level BPE tokenizers (Qwen, Llama 3, GPT-2), `▁A` for SentencePiece ones. That is
the token the model saw after "Answer:" in every shot, so it is the natural next token; the bare "A" is a
different token that the prompt never shows in that position. A tokenizer that splits " A" there into more than
one token is refused (UnsupportedError): lora-eval scores exactly one token per letter. The prediction is the
letter with the highest log-probability (ties: the first letter); `lp_A`..`lp_D` are log-probabilities over
the whole vocabulary at the last position, the only position whose logits are computed.

Intervals. Every question is answered by the base model and each adapter, so differences are paired: per
question d = c_adapter - c_base in {-1, 0, 1}; delta = mean(d) (accuracy difference as a fraction), 95% interval
delta +- 1.96 * sd(d) / sqrt(n) (sd with n-1; NaN for n < 2). Per subject and per category (micro over the
category's questions, as the paper reports categories) and overall micro; macro = mean of the subject deltas,
its standard error sqrt(sum se_s^2) / S (subjects independent). `--max-drop` is in percentage points of micro
accuracy: an adapter fails when 100 * (base - adapter) > max_drop.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .batching import make_batches, padding_waste
from .checkpoint import read_json
from .engine import Batch, Engine
from .runners.graphs import BucketPlan
from .errors import InputError, UnsupportedError
from .progress import progress

BASE = "base"
LETTERS = ("A", "B", "C", "D")
CSV_COLUMNS = ["question", *LETTERS, "answer"]
CAIS_COLUMNS = ["question", "subject", "choices", "answer"]
SPLITS = {"dev": ("dev",), "val": ("val", "validation"), "test": ("test",)}  # our name -> names on disk
Z95 = 1.96
GROUPS = ("micro", "macro", "STEM", "humanities", "social sciences", "other")
QUESTION_COLUMNS = ["subject", "category", "question_index", "model", "answer", "prediction", "correct",
                    *[f"lp_{x}" for x in LETTERS]]
SUBJECT_COLUMNS = ["subject", "category", "model", "questions", "correct", "accuracy", "delta", "delta_low",
                   "delta_high"]
SUMMARY_COLUMNS = ["model", "group", "questions", "accuracy", "delta", "delta_low", "delta_high", "passed"]
BATCH_TOKENS = 16384

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


@dataclass
class MmluResult:
    questions: pd.DataFrame  # one row per (model, test question)
    subjects: pd.DataFrame  # one row per (subject, model)
    summary: pd.DataFrame  # one row per (model, group)
    run: dict = field(default_factory=dict)  # arguments, versions, timings, hashes

    @property
    def passed(self) -> bool:
        return bool(self.summary["passed"].all())


def mmlu(model: str | Path, adapters: dict[str, str | Path] | None = None, data: str | Path | None = None, *,
         out: str | Path | None = None, split: str = "test", shots: int = 5, subjects=None, limit: int | None = None,
         max_drop: float | None = None, device: str = "cpu", dtype: str = "float32",
         batch_tokens: int = BATCH_TOKENS, quiet: bool = False, gate_up_layout: str | None = None,
         cuda_graphs: bool = True, graph_plan: BucketPlan | None = None, engine: Engine | None = None) -> MmluResult:
    """Score every question of `split` for the base model and each adapter in one pass; return (and, with
    `out`, write) the per-question, per-subject and summary tables. `subjects`: names (list or comma string)
    to keep; `limit`: the first N questions of each subject; `max_drop`: percentage points; `gate_up_layout`:
    as for `Engine.load`; `cuda_graphs`, `graph_plan`: CUDA graphs, as for `Engine.load`. `engine`: an engine
    already built (its adapters replace `adapters`; `model` is then the folder with config.json and the
    tokenizer only, e.g. for benchmarks on in-memory random weights)."""
    adapters = dict(adapters or {})
    if isinstance(subjects, str):
        subjects = [s.strip() for s in subjects.split(",") if s.strip()]
        if not subjects:
            raise InputError("--subjects", "no subject named (expected A,B,...; leave it out for all subjects)")
    arguments = dict(model=str(model), adapters={k: str(v) for k, v in adapters.items()}, data=str(data),
                     split=split, shots=shots, subjects=subjects, limit=limit, max_drop=max_drop, device=device,
                     dtype=dtype, batch_tokens=batch_tokens, gate_up_layout=gate_up_layout)
    if data is None:
        raise InputError("--data", "an MMLU data folder is needed")
    if BASE in adapters:
        raise InputError("--adapter", f"'{BASE}' names the base model in the reports; choose another adapter name")
    if split not in ("test", "val"):
        raise InputError("--split", f"'{split}' is not one of test, val")
    for name, value, low in (("--shots", shots, 0), ("--limit", limit, 1), ("--batch-tokens", batch_tokens, 1)):
        if value is not None and (not isinstance(value, int) or value < low):
            raise InputError(name, f"expected an integer >= {low}, got {value!r}")
    if max_drop is not None and not max_drop >= 0:
        raise InputError("--max-drop", f"expected a number of points >= 0, got {max_drop!r}")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise InputError("--out", f"{out} exists and is not a folder")
    timings = {}

    t0 = time.perf_counter()
    layout, files, questions = read_split(data, split)
    questions = select(questions, subjects, limit, data, split)
    dev = None
    if shots > 0:
        _, dev_files, dev = read_split(data, "dev")
        files += dev_files
        dev = check_shots(dev, questions, shots, layout, data)
    timings["data_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(model)
    candidates = answer_tokens(tokenizer, model)
    max_len = read_json(Path(model) / "config.json").get("max_position_embeddings")
    ids, used = tokenize_prompts(tokenizer, questions, dev, shots, max_len)
    timings["tokenize_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if engine is None:
        engine = Engine.load(model, adapters, dtype=dtype, device=device, gate_up_layout=gate_up_layout,
                             cuda_graphs=cuda_graphs, graph_plan=graph_plan)
    vocab = engine.model.args.vocab_size
    largest = max([*candidates, *(max(row) for row in ids if row)])
    if largest >= vocab:
        raise InputError(Path(model) / "config.json", f"the tokenizer makes token id {largest}, outside the model's "
                         f"vocabulary ({vocab}): the tokenizer in the model folder does not belong to this model",
                         key="vocab_size")
    timings["load_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    models = [BASE, *engine.adapter_names]
    tags = [None, *engine.adapter_names]
    rows_ids = [row for row in ids for _ in tags]  # question-major: a question's rows share a batch
    rows_tags = tags * len(ids)
    lengths = [len(row) for row in rows_ids]
    batches = make_batches(lengths, batch_tokens)
    lp = np.empty((len(rows_ids), len(LETTERS)), dtype=np.float32)  # [rows, 4]
    with progress(len(rows_ids), "mmlu", "q", quiet) as bar:
        for batch in batches:
            lp[batch] = engine.next_token_logprobs(Batch([rows_ids[i] for i in batch], [rows_tags[i] for i in batch]),
                                                   candidates).numpy()
            bar.update(len(batch))
    timings["forward_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    table = question_table(questions, models, lp.reshape(len(ids), len(models), len(LETTERS)))
    subject_rows = subject_table(table)
    summary = summary_table(table, max_drop)
    timings["metrics_s"] = time.perf_counter() - t0
    from importlib.metadata import version

    from .compare import _hashes, _versions

    prompt_lengths = np.array([len(row) for row in ids])
    run = dict(arguments=arguments, versions={**_versions(), "datasets": version("datasets"),
                                              "tokenizers": version("tokenizers")},
               timings=timings, questions=len(ids), rows=len(rows_ids), batches=len(batches),
               padding_waste=padding_waste(lengths, batches),
               questions_per_s=len(ids) / max(timings["forward_s"], 1e-9),
               rows_per_s=len(rows_ids) / max(timings["forward_s"], 1e-9),
               prompts=dict(shots=shots, tokens_mean=float(prompt_lengths.mean()) if len(ids) else 0.0,
                            tokens_max=int(prompt_lengths.max()) if len(ids) else 0,
                            max_position_embeddings=max_len, with_fewer_shots=int(sum(u < shots for u in used))),
               answer_tokens={x: dict(id=t, token=tokenizer.convert_ids_to_tokens(t))
                              for x, t in zip(LETTERS, candidates)},
               data=dict(layout=layout, path=str(data), **_data_hash(files, Path(data))),
               files=_hashes(model, adapters, []), cuda_graphs=engine.graph_stats())
    result = MmluResult(questions=table, subjects=subject_rows, summary=summary, run=run)
    if out is not None:
        write_outputs(result, Path(out))
    return result


# ---- data ------------------------------------------------------------------------------------------------


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
    counts = [_check_csv_rows(path) for path in files]
    loaded = _load("csv", files, counts, strings=CSV_COLUMNS, column_names=CSV_COLUMNS, header=None,
                   keep_default_na=False, index_col=False)  # every field a string, exactly as written
    parts = []
    for path, frame in zip(files, loaded):
        frame.insert(0, "subject", path.name[:-len(f"_{split}.csv")])
        parts.append(_checked(frame, path))
    return files, parts


def _check_csv_rows(path: Path) -> int:
    """The number of records; each must have exactly the 6 fields (pandas would pad short rows and drop
    extra fields silently)."""
    count = 0
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for record in csv.reader(f):
                if not record:  # blank line: pandas skips it too
                    continue
                if len(record) != len(CSV_COLUMNS):
                    raise InputError(path, f"{len(record)} fields, expected {len(CSV_COLUMNS)} "
                                     f"({', '.join(CSV_COLUMNS)})", key=f"row {count}")
                count += 1
    except (UnicodeDecodeError, csv.Error) as e:
        raise InputError(path, f"not a UTF-8 CSV file ({e})", key=f"row {count}") from None
    if count == 0:
        raise InputError(path, "no questions (empty file)")
    return count


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
    counts = []
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
        counts.append(meta.num_rows)
    loaded = _load("parquet", files, counts, columns=CAIS_COLUMNS)
    return files, [_checked(_from_cais(frame, path), path) for path, frame in zip(files, loaded)]


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


def _load(builder: str, files: list[Path], counts: list[int], strings: list[str] | None = None,
          **options) -> list[pd.DataFrame]:
    """Each file as a DataFrame, read by a `datasets` packaged builder as one split (files in order, then cut
    at the known row counts), in a throwaway cache. `strings`: columns read as strings."""
    with _datasets_quiet() as datasets, tempfile.TemporaryDirectory(prefix="lora-eval-mmlu-") as cache:
        if strings:
            options["features"] = datasets.Features({c: datasets.Value("string") for c in strings})
        try:
            loaded = datasets.load_dataset(builder, data_files={"rows": [str(p) for p in files]}, split="rows",
                                           cache_dir=cache, **options)
        except Exception as e:  # datasets wraps the reader's error; show the root cause
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise InputError(files[0].parent, f"datasets could not read the {builder} files ({cause})") from None
        frame = loaded.to_pandas()
    if len(frame) != sum(counts):
        raise InputError(files[0].parent, f"datasets read {len(frame)} rows from the {builder} files, expected "
                         f"{sum(counts)}")
    starts = np.cumsum([0, *counts])
    return [frame.iloc[a:b].reset_index(drop=True) for a, b in zip(starts[:-1], starts[1:])]


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


# ---- prompts ---------------------------------------------------------------------------------------------


def subject_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def format_question(row, with_answer: bool) -> str:
    """One question block; `row` maps question, A-D and answer (a dev example shows its answer)."""
    text = row["question"] + "".join(f"\n{x}. {row[x]}" for x in LETTERS) + "\nAnswer:"
    return text + f" {row['answer']}\n\n" if with_answer else text


def load_tokenizer(model: str | Path):
    """The tokenizer saved in the model folder (never downloaded)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing or broken tokenizer
        raise InputError(model, f"mmlu needs the model's tokenizer in the model folder ({e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def answer_tokens(tokenizer, model) -> list[int]:
    """Token ids of A, B, C, D as they follow "\\nAnswer:" in "\\nAnswer: A" (see the module docstring)."""
    stub = tokenizer("\nAnswer:", add_special_tokens=False)["input_ids"]
    ids = []
    for letter in LETTERS:
        full = tokenizer(f"\nAnswer: {letter}", add_special_tokens=False)["input_ids"]
        if full[:len(stub)] != stub or len(full) != len(stub) + 1:
            pieces = tokenizer.convert_ids_to_tokens(full[len(stub):] if full[:len(stub)] == stub else full)
            raise UnsupportedError(model, f"the tokenizer does not make ' {letter}' after 'Answer:' one token (it "
                                   f"gives {pieces}); mmlu scores one token per answer letter", key="tokenizer")
        ids.append(full[-1])
    if len(set(ids)) != len(LETTERS):
        raise UnsupportedError(model, f"the answer letters share tokens {ids}", key="tokenizer")
    return ids


def prompt_prefixes(questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int) -> dict[str, list[str]]:
    """subject -> [header + the first k dev examples with answers, for k = 0..shots]."""
    prefixes = {}
    for subject in questions["subject"].unique():
        blocks = [] if shots == 0 else [format_question(r, True) for r in
                                        dev[dev["subject"] == subject].head(shots).to_dict("records")]
        prefixes[subject] = [subject_header(subject) + "".join(blocks[:k]) for k in range(shots + 1)]
    return prefixes


def prompts(questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int) -> list[str]:
    """The paper's `shots`-shot prompt of every question: header, dev examples, the question ending "\\nAnswer:"."""
    prefixes = prompt_prefixes(questions, dev, shots)
    return [prefixes[q["subject"]][shots] + format_question(q, False) for q in questions.to_dict("records")]


def tokenize_prompts(tokenizer, questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int,
                     max_len: int | None) -> tuple[list[list[int]], list[int]]:
    """Token ids of every question's prompt (with the tokenizer's special tokens, e.g. BOS) and the shots it
    kept: a prompt longer than `max_len` drops shots from the end until it fits."""
    prefixes = prompt_prefixes(questions, dev, shots)
    records = questions.to_dict("records")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than the model maximum": checked here
    try:
        ids = tokenizer(prompts(questions, dev, shots))["input_ids"]
        used = [shots] * len(ids)
        for i, q in enumerate(records):
            while max_len is not None and len(ids[i]) > max_len:
                if used[i] == 0:
                    raise InputError(q["file"], f"the prompt is {len(ids[i])} tokens even without shots, more than "
                                     f"the model's max_position_embeddings ({max_len})", key=f"row {q['row']}")
                used[i] -= 1
                ids[i] = tokenizer(prefixes[q["subject"]][used[i]] + format_question(q, False))["input_ids"]
    finally:
        hf_logging.set_verbosity(verbosity)
    return ids, used


# ---- tables ----------------------------------------------------------------------------------------------


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
    return _model_order(pd.DataFrame(rows), with_diff)[SUMMARY_COLUMNS]


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


# ---- files -----------------------------------------------------------------------------------------------


def _data_hash(files: list[Path], root: Path) -> dict:
    """One sha256 over (path relative to the data folder, file sha256) of every data file read."""
    total = hashlib.sha256()
    for path in sorted(set(files)):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        total.update(f"{path.relative_to(root)}\0{h.hexdigest()}\n".encode())
    return dict(files=len(set(files)), sha256=total.hexdigest())


def _points(value: float) -> str:
    return "" if math.isnan(value) else f"{100 * value:+.1f}"


def display_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary with accuracy in % and delta in points with its interval, for people."""
    return pd.DataFrame({
        "model": summary["model"], "group": summary["group"], "questions": summary["questions"].astype(str),
        "accuracy %": [f"{100 * a:.1f}" for a in summary["accuracy"]],
        "delta (points)": [_points(d) for d in summary["delta"]],
        "95% interval": ["" if math.isnan(lo) else f"[{_points(lo)}, {_points(hi)}]"
                         for lo, hi in zip(summary["delta_low"], summary["delta_high"])],
        "passed": summary["passed"]})


def summary_text(result: MmluResult) -> str:
    """Micro and macro rows for the terminal, fixed-width."""
    shown = display_table(result.summary[result.summary["group"].isin(["micro", "macro"])])
    cells = [list(shown.columns)] + [[("PASS" if v else "FAIL") if isinstance(v, (bool, np.bool_)) else str(v)
                                      for v in row] for row in shown.itertuples(index=False)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def verdict(result: MmluResult, max_drop: float | None) -> str:
    failed = result.summary[(result.summary["group"] == "micro") & ~result.summary["passed"]]
    return "PASSED" if result.passed else "FAILED: " + "; ".join(
        f"{r.model} ({_points(r.delta)} points, limit -{max_drop:g})" for r in failed.itertuples())


def markdown_report(result: MmluResult) -> str:
    """mmlu.md: verdict, micro/macro, categories, the subjects that moved most, run facts."""
    from .report import markdown_table

    run, args = result.run, result.run.get("arguments", {})
    summary = result.summary
    lines = [f"# lora-eval mmlu: {verdict(result, args.get('max_drop'))}", "",
             f"Model `{args.get('model')}`, dtype {args.get('dtype')}, device {args.get('device')}; "
             f"{run.get('questions')} {args.get('split')} questions, {args.get('shots')}-shot; "
             f"max drop {args.get('max_drop')} points. Deltas are paired per question, 95% intervals.", "",
             "## Micro and macro", "",
             markdown_table(display_table(summary[summary["group"].isin(["micro", "macro"])])), "",
             "## Categories (micro within each)", "",
             markdown_table(display_table(summary[~summary["group"].isin(["micro", "macro"])]).drop(
                 columns="passed")), ""]
    subjects = result.subjects[result.subjects["model"] != BASE]
    if len(subjects):
        worst = _model_order(subjects.sort_values(["delta", "subject"]).groupby("model", sort=False).head(10),
                             result.subjects)  # per adapter, largest drop first
        lines += ["## Subjects with the largest drops", "",
                  markdown_table(pd.DataFrame({
                      "model": worst["model"], "subject": worst["subject"], "questions": worst["questions"].astype(str),
                      "accuracy %": [f"{100 * a:.1f}" for a in worst["accuracy"]],
                      "delta (points)": [_points(d) for d in worst["delta"]],
                      "95% interval": ["" if math.isnan(lo) else f"[{_points(lo)}, {_points(hi)}]"
                                       for lo, hi in zip(worst["delta_low"], worst["delta_high"])]})), ""]
    prompts = run.get("prompts", {})
    lines += ["## Run", "",
              f"{run.get('rows')} scored rows in {run.get('batches')} batches, padding waste "
              f"{run.get('padding_waste', 0):.1%}, {run.get('questions_per_s', 0):,.1f} questions/s; prompts "
              f"{prompts.get('tokens_mean', 0):.0f} tokens on average (max {prompts.get('tokens_max')}), "
              f"{prompts.get('with_fewer_shots')} with fewer shots to fit; answer tokens " +
              ", ".join(f"{k} {v['token']!r} ({v['id']})" for k, v in run.get("answer_tokens", {}).items()) + ".", "",
              "Timings (s): " + ", ".join(f"{k} {v:.2f}" for k, v in run.get("timings", {}).items()), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items()), ""]
    return "\n".join(lines)


def write_outputs(result: MmluResult, out: Path) -> None:
    """mmlu_questions.parquet, mmlu_subjects.csv, mmlu_summary.csv, mmlu.md, report.html and run.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    result.questions.to_parquet(out / "mmlu_questions.parquet", index=False)
    result.subjects.to_csv(out / "mmlu_subjects.csv", index=False)
    result.summary.to_csv(out / "mmlu_summary.csv", index=False)
    (out / "mmlu.md").write_text(markdown_report(result))
    from .html_report import mmlu_html

    (out / "report.html").write_text(mmlu_html(result), encoding="utf-8")
    (out / "run.json").write_text(json.dumps(result.run, indent=2, default=str) + "\n")
