"""`lora-eval mmlu` on the real MMLU release (../shared/data/mmlu; on the GPU machine the copy its calls carry,
.mmlu-data) with tiny random models and tokenizers.

1. the reader: every CSV of every split equals an independent pandas read (strings kept as written, e.g.
   "None" and "0.40"); 14,042 test questions over 57 subjects; the paper's category table covers them;
   the cais/mmlu parquet layout and a `save_to_disk` folder give the same questions;
2. the whole pipeline on all 14,042 test questions (zero-shot, a one-token-per-line tokenizer so that it
   is cheap): every question in every table;
3. one known 5-shot prompt equals a hand-written string byte for byte; shots are dropped until a prompt fits;
   the prompts tokenised in a child process (mmlu_tokenize.py) are those tokenised here, errors alike;
4. a model rigged to always answer one letter scores exactly that letter's share of the answers per subject;
   an lm_head adapter rigged to another letter gives deltas and paired intervals equal to a hand computation,
   and `--max-drop` turns them into exit 1 or 0; a run tokenised beside the model's load equals one tokenised
   first, byte for byte;
5. bad data: a missing column, an answer outside A-D, an empty file, a subject without dev examples name the
   file and the line (CSV) or row; a tokenizer that splits " A" is refused;
6. the engine's last-position scores against transformers (+ PEFT) float32 full logits; mixed batches.

Seeds are fresh every run (the `seed` / `session_seed` fixtures print them).
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, get_peft_model

import lora_eval
from lora_eval import Batch, Engine, InputError, UnsupportedError
from lora_eval.cli import cli
from lora_eval.tasks.mmlu.task import subject_prefixes
from lora_eval.hf import quiet_libraries
from lora_eval.inputs.mmlu_data import CATEGORIES, LETTERS, read_split, select
from lora_eval.tasks.mmlu.prompts import answer_tokens, encode, prompts, tokenize, tokenize_prompts
from lora_eval.tasks.mmlu.tokenize import TokenizeBeside
from lora_eval.results.mmlu_stats import mcnemar_p, paired_interval, passes
from lora_eval.results.tables import MMLU_SUMMARY_COLUMNS as SUMMARY_COLUMNS
from lora_eval.results.tables import QUESTION_COLUMNS, SUBJECT_COLUMNS
from lora_eval.inputs.tokenizer import load_tokenizer
from tests.builders import load_hf, peft_oracle, random_sequences, save_random_model, save_random_peft_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback, assert_phases
from tests.conftest import CPU, MOE_OVERRIDES
from tests.test_distributed import finish, torchrun

ROOT = Path(__file__).resolve().parents[1]
# the release beside the checkout, or where the GPU machine's calls carry it (the benchmarks' default folder)
DATA = next((p for p in (ROOT.parent / "shared" / "data" / "mmlu", Path("/work/shared/data/mmlu"), ROOT / ".mmlu-data")
             if p.is_dir()), ROOT.parent / "shared" / "data" / "mmlu")
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="the MMLU release is neither in ../shared/data/mmlu nor in "
                                "./.mmlu-data")

TEST_QUESTIONS, DEV_QUESTIONS, VAL_QUESTIONS = 14_042, 285, 1_531  # the published split sizes
ORACLE_TOL = 1e-5  # our float32 engine vs transformers float32
# one subject per category, short dev examples; the first RIG_LIMIT questions of each
RIG_SUBJECTS = ["abstract_algebra", "global_facts", "high_school_geography", "philosophy"]
RIG_LIMIT = 8
mmlu_task = importlib.import_module("lora_eval.tasks.mmlu.task")


# ---- builders ----------------------------------------------------------------------------------------


def bpe_tokenizer(out: Path, vocab_size: int = 1024):
    """A byte-level BPE (Qwen / GPT-2 style, covers any text) trained on the real dev and val questions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [p.read_text(encoding="utf-8") for split in ("dev", "val") for p in sorted((DATA / split).glob("*.csv"))]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return fast


def line_tokenizer(out: Path):
    """One token per line ([UNK] for any other line), with "Answer:" and a final " A".." D" split off: MMLU
    prompts of ~15 tokens zero-shot, so that a tiny model runs all 14,042 questions in seconds."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "\n": 2, "Answer:": 3, " A": 4, " B": 5, " C": 6, " D": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                                                 pre_tokenizers.Split(Regex(" [ABCD]$"), behavior="isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return fast


def bytes_tokenizer(out: Path):
    """Byte-level BPE without merges: " A" is two tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(str(out))
    return fast


def model_with_tokenizer(out: Path, make_tokenizer, family: str, seed: int, **overrides) -> tuple[Path, object]:
    tokenizer = make_tokenizer(out)
    save_random_model(out, family, seed=seed, vocab_size=len(tokenizer), **overrides)
    return out, tokenizer


@torch.no_grad()
def rig(model_dir: Path, token: int, level: float = 100.0, gain: float = 100.0) -> None:
    """Make `token` win at every position: hidden dimension 0 holds `level` for every token (embedding column 0;
    nothing writes to it: row 0 of every o_proj and down projection, experts included, is zero), and only
    lm_head row `token` reads it, with weight `gain`."""
    model = load_hf(model_dir)
    model.model.embed_tokens.weight[:, 0] = level
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
            param[0] = 0  # [H, in]
        elif name.endswith("experts.down_proj"):
            param[:, 0] = 0  # [E, H, I]
    model.model.norm.weight[0] = 1.0
    model.lm_head.weight[:, 0] = 0
    model.lm_head.weight[token, 0] = gain
    model.save_pretrained(model_dir)


@torch.no_grad()
def lm_head_adapter(model_dir: Path, out: Path, token: int, gain: float = 200.0) -> Path:
    """A rank-1 PEFT LoRA on lm_head adding `gain` * h[0] to `token`'s logit (beats rig()'s letter)."""
    model = get_peft_model(load_hf(model_dir), LoraConfig(r=1, lora_alpha=1, target_modules=["lm_head"]))
    head = model.base_model.model.lm_head
    head.lora_A["default"].weight.zero_()[0, 0] = 1.0  # [1, H]
    head.lora_B["default"].weight.zero_()[token, 0] = gain  # [V, 1]
    model.save_pretrained(out, save_embedding_layers=False)  # the LoRA only, no copies of lm_head
    return out


def cais_frame(questions: pd.DataFrame) -> pd.DataFrame:
    """Our question rows in the cais/mmlu columns: question, subject, choices, answer (0-3)."""
    return pd.DataFrame(dict(question=questions["question"], subject=questions["subject"],
                             choices=[list(r) for r in questions[list(LETTERS)].itertuples(index=False)],
                             answer=[LETTERS.index(a) for a in questions["answer"]]))


def write_cais_parquet(root: Path, splits: dict[str, pd.DataFrame]) -> Path:
    """`<subject>/<split>-00000-of-00001.parquet` per subject, plus `all/` (which the reader must skip)."""
    for split, frame in splits.items():
        name = "validation" if split == "val" else split
        cais = cais_frame(frame)
        for subject, rows in cais.groupby("subject"):
            (root / subject).mkdir(parents=True, exist_ok=True)
            rows.to_parquet(root / subject / f"{name}-00000-of-00001.parquet", index=False)
        (root / "all").mkdir(parents=True, exist_ok=True)
        cais.to_parquet(root / "all" / f"{name}-00000-of-00001.parquet", index=False)
    return root


def write_saved_dataset(root: Path, splits: dict[str, pd.DataFrame]) -> Path:
    """A DatasetDict with cais/mmlu features (answer a ClassLabel A-D) written by save_to_disk."""
    with quiet_libraries(datasets=True) as datasets:
        features = datasets.Features(dict(question=datasets.Value("string"), subject=datasets.Value("string"),
                                          choices=datasets.List(datasets.Value("string")),
                                          answer=datasets.ClassLabel(names=list(LETTERS))))
        dd = datasets.DatasetDict({("validation" if s == "val" else s): datasets.Dataset.from_pandas(
            cais_frame(f), features=features, preserve_index=False) for s, f in splits.items()})
        dd.save_to_disk(str(root))
    return root


def copy_subjects(out: Path, subjects: list[str], splits=("dev", "test")) -> Path:
    for split in splits:
        (out / split).mkdir(parents=True, exist_ok=True)
        for s in subjects:
            shutil.copy(DATA / split / f"{s}_{split}.csv", out / split / f"{s}_{split}.csv")
    return out


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def pandas_read(path: Path) -> pd.DataFrame:
    """The independent reader: pandas, every field a string exactly as written."""
    return pd.read_csv(path, header=None, names=["question", *LETTERS, "answer"], dtype=str, keep_default_na=False)


# ---- 1. the reader -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> dict[str, tuple]:
    """(layout, files, questions) of each split of the real release, read once."""
    return {split: read_split(DATA, split) for split in ("dev", "val", "test")}


def test_categories_cover_the_57_real_subjects():
    subjects = {p.name[:-len("_test.csv")] for p in (DATA / "test").glob("*_test.csv")}
    assert len(subjects) == 57 and set(CATEGORIES) == subjects
    counts = pd.Series(CATEGORIES).value_counts().to_dict()
    assert counts == {"STEM": 18, "other": 14, "humanities": 13, "social sciences": 12}  # the paper's table
    assert CATEGORIES["anatomy"] == "other" and CATEGORIES["econometrics"] == "social sciences"


@pytest.mark.parametrize("split,total", [("test", TEST_QUESTIONS), ("dev", DEV_QUESTIONS), ("val", VAL_QUESTIONS)])
def test_reader_equals_pandas_on_every_file(real, split, total):
    layout, files, frame = real[split]
    assert layout == "csv" and len(files) == 57 and len(frame) == total and frame["subject"].nunique() == 57
    for path in files:
        subject = path.name[:-len(f"_{split}.csv")]
        mine = frame[frame["subject"] == subject].reset_index(drop=True)
        expected = pandas_read(path)
        pd.testing.assert_frame_equal(mine[["question", *LETTERS, "answer"]].astype(object),
                                      expected.astype(object), check_dtype=False)
        assert mine["question_index"].tolist() == list(range(len(expected)))
        assert (mine["file"] == str(path)).all() and mine["row"].tolist() == list(range(len(expected)))
    if split == "test":  # strings a default CSV read would turn into NaN or 0.4
        cs = frame[frame["subject"] == "college_computer_science"].set_index("question_index")
        stats = frame[frame["subject"] == "high_school_statistics"].set_index("question_index")
        assert cs.loc[10, "A"] == "None" and stats.loc[66, "B"] == "0.40"


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_cais_layouts_read_the_same_questions(real, tmp_path, layout):
    subjects = ["abstract_algebra", "virology", "world_religions"]
    splits = {s: select(real[s][2], subjects, None, DATA, s) for s in ("dev", "val", "test")}
    root = (write_cais_parquet if layout == "parquet" else write_saved_dataset)(tmp_path / "cais", splits)
    for split, expected in splits.items():
        _, files, frame = read_split(root, split)
        assert all("all" not in f.relative_to(root).parts for f in files)  # all/ repeats the subjects
        columns = ["subject", "question_index", "question", *LETTERS, "answer"]
        got = frame[columns].sort_values(["subject", "question_index"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(got.astype(object), expected[columns].astype(object))


# ---- 2. all 14,042 test questions through the whole pipeline ------------------------------------------


@pytest.fixture(scope="module")
def line_model(tmp_path_factory, session_seed):
    out = tmp_path_factory.mktemp("mmlu_line_model")
    return model_with_tokenizer(out, line_tokenizer, "qwen3", session_seed, num_hidden_layers=1, hidden_size=16,
                                intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)[0]


def test_all_test_questions_are_in_the_tables(line_model, tmp_path):
    out = tmp_path / "run"
    result = lora_eval.mmlu(line_model, {}, DATA, out=out, shots=0, quiet=True)
    questions = pd.read_parquet(out / "mmlu_questions.parquet")
    subjects = pd.read_csv(out / "mmlu_subjects.csv")
    summary = pd.read_csv(out / "mmlu_summary.csv")
    assert list(questions.columns) == QUESTION_COLUMNS and list(subjects.columns) == SUBJECT_COLUMNS
    assert list(summary.columns) == SUMMARY_COLUMNS
    assert len(questions) == TEST_QUESTIONS and questions["subject"].nunique() == 57
    assert (questions["model"] == "base").all()
    expected = {p.name[:-len("_test.csv")]: len(pandas_read(p)) for p in (DATA / "test").glob("*_test.csv")}
    assert questions.groupby("subject").size().to_dict() == expected
    assert not questions.duplicated(["subject", "question_index"]).any()
    assert dict(zip(subjects["subject"], subjects["questions"])) == expected
    assert subjects["questions"].sum() == TEST_QUESTIONS and len(subjects) == 57
    by_group = summary.set_index("group")
    assert by_group.loc["micro", "questions"] == by_group.loc["macro", "questions"] == TEST_QUESTIONS
    assert by_group.loc[["STEM", "humanities", "social sciences", "other"], "questions"].sum() == TEST_QUESTIONS
    # the tables agree with each other
    lp = questions[[f"lp_{x}" for x in LETTERS]].to_numpy()
    assert (questions["prediction"] == np.array(LETTERS)[lp.argmax(axis=1)]).all()
    assert (questions["correct"] == (questions["prediction"] == questions["answer"])).all()
    assert np.isfinite(lp).all() and (np.exp(lp).sum(axis=1) <= 1 + 1e-6).all()
    assert by_group.loc["micro", "accuracy"] == pytest.approx(questions["correct"].mean(), abs=1e-12)
    assert by_group.loc["macro", "accuracy"] == pytest.approx(subjects["accuracy"].mean(), abs=1e-12)
    assert summary["delta"].isna().all() and summary["passed"].all()
    pd.testing.assert_frame_equal(result.questions, questions)
    run = json.loads((out / "run.json").read_text())
    assert run["questions"] == TEST_QUESTIONS and run["data"]["files"] == 57 and run["data"]["layout"] == "csv"
    assert run["answer_tokens"]["A"]["token"] == " A" and run["arguments"]["shots"] == 0
    assert "# lora-eval mmlu: PASSED" in (out / "mmlu.md").read_text()


# ---- 3. prompts --------------------------------------------------------------------------------------


# abstract_algebra test row 0 after the subject's five dev examples, written out by hand
ABSTRACT_ALGEBRA_0 = (
    "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n"
    "Statement 1 | If aH is an element of a factor group, then |aH| divides |a|. Statement 2 | If H and K are "
    "subgroups of G then HK is a subgroup of G.\nA. True, True\nB. False, False\nC. True, False\nD. False, True\n"
    "Answer: B\n\n"
    "Statement 1 | Every element of a group generates a cyclic subgroup of the group. Statement 2 | The symmetric "
    "group S_10 has 10 elements.\nA. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer: C\n\n"
    "Statement 1| Every function from a finite set onto itself must be one to one. Statement 2 | Every subgroup of "
    "an abelian group is abelian.\nA. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer: A\n\n"
    "Find the characteristic of the ring 2Z.\nA. 0\nB. 3\nC. 12\nD. 30\nAnswer: A\n\n"
    "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\n"
    "Answer:"
)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mmlu_bpe")
    bpe_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return load_tokenizer(bpe_dir, needed_for="mmlu")


@pytest.mark.parametrize("layout", ["csv", "parquet", "save_to_disk"])
def test_known_prompt_byte_for_byte(real, bpe, tmp_path, layout):
    root = DATA
    if layout != "csv":
        splits = {s: select(real[s][2], ["abstract_algebra"], None, DATA, s) for s in ("dev", "test")}
        root = (write_cais_parquet if layout == "parquet" else write_saved_dataset)(tmp_path / "cais", splits)
    questions = select(read_split(root, "test")[2], ["abstract_algebra"], 1, root, "test")
    dev = read_split(root, "dev")[2]
    assert prompts(questions, dev, 5) == [ABSTRACT_ALGEBRA_0]
    ids, used = tokenize_prompts(bpe, questions, dev, 5, None)
    assert ids == [bpe(ABSTRACT_ALGEBRA_0)["input_ids"]] and used == [5]


def test_prompts_equal_lm_evaluation_harness(real):
    """Our 5-shot prompts are byte for byte what lm-evaluation-harness's default `mmlu` task builds (its description,
    `question.strip()`, choice lines, "Answer:", the first dev examples, delimiters), and our scored continuations
    are its " A".." D": the first two test questions of all 57 subjects, as lm-eval 0.4.13 built them
    (tests/data/make_lmeval_mmlu_sample.py says how the sample was made)."""
    sample = json.loads((Path(__file__).parent / "data" / "lmeval_mmlu_contexts.json").read_text(encoding="utf-8"))
    questions = select(real["test"][2], None, 2, DATA, "test")
    ours = dict(zip(zip(questions["subject"], questions["question_index"]), prompts(questions, real["dev"][2], 5)))
    assert len(sample["contexts"]) == 114 and {c["subject"] for c in sample["contexts"]} == set(CATEGORIES)
    for c in sample["contexts"]:
        assert ours[c["subject"], c["question_index"]] == c["context"], (c["subject"], c["question_index"])
        assert c["continuations"] == [f" {x}" for x in LETTERS]
    shown = pd.concat([questions, real["dev"][2].groupby("subject").head(5)])
    assert (shown["question"] != shown["question"].str.strip()).sum() >= 3  # the strip is exercised


@pytest.mark.parametrize("post", ["none", "bos-template", "bert-pair"])
def test_encode_equals_the_tokenizers_call(real, bpe_dir, tmp_path, seed, post):
    """mmlu_prompts.encode (the `tokenizers` object's encode_batch_fast) gives exactly the ids of transformers'
    `tokenizer(texts)["input_ids"]`, saved and loaded back as a user's tokenizer is: with no special tokens, a BOS
    added by a template post-processor, a BERT-like [CLS] ... [SEP]; special tokens written inside the text too."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    special = {"none": [], "bos-template": ["<s>"], "bert-pair": ["[CLS]", "[SEP]"]}[post]
    tok.add_special_tokens(special)
    if post == "bos-template":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
            ("<s>", tok.token_to_id("<s>"))])
    elif post == "bert-pair":
        tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                       ("[CLS]", tok.token_to_id("[CLS]")))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path, needed_for="mmlu")
    rng = np.random.default_rng(seed)
    questions = real["test"][2].sample(40, random_state=int(rng.integers(2**31)))
    texts = prompts(questions, real["dev"][2], int(rng.integers(0, 6)))
    texts += [t[:k] + rng.choice(special + ["<|endoftext|>"]) + t[k:] for t in texts[:10]
              for k in [int(rng.integers(0, len(t)))]]
    expected = loaded(texts)["input_ids"]
    assert encode(loaded, texts) == expected
    added = {"none": 0, "bos-template": 1, "bert-pair": 2}[post]  # the special tokens the post-processor adds
    assert len(expected[0]) - len(_raw_ids(bpe_dir, texts[0])) == added


def _raw_ids(bpe_dir, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bpe_dir / "tokenizer.json")).encode(text).ids


def test_answer_tokens_follow_answer_colon(bpe, tmp_path):
    ids = answer_tokens(bpe, "bpe")
    assert bpe.convert_ids_to_tokens(ids) == ["ĠA", "ĠB", "ĠC", "ĠD"]  # " A": the dev examples' continuation
    stub = bpe("D. 6\nAnswer:")["input_ids"]
    for letter, token in zip(LETTERS, ids):  # exactly the token that follows "Answer:" inside a shot
        shot = bpe(f"D. 6\nAnswer: {letter}\n\nWhich")["input_ids"]
        assert shot[:len(stub)] == stub and shot[len(stub)] == token
    bytes_tokenizer(tmp_path)
    with pytest.raises(UnsupportedError, match="' A' after 'Answer:' one token"):
        answer_tokens(load_tokenizer(tmp_path, needed_for="mmlu"), tmp_path)


def test_shots_are_dropped_until_the_prompt_fits(real, bpe):
    questions = select(real["test"][2], ["high_school_geography"], 40, DATA, "test")
    dev = real["dev"][2]
    lengths = np.array([[len(ids) for ids in bpe(prompts(questions, dev, k))["input_ids"]] for k in range(6)]).T
    max_len = int(np.median(lengths[:, 5]))  # about half the 5-shot prompts are too long
    ids, used = tokenize_prompts(bpe, questions, dev, 5, max_len)
    expected = [max(k for k in range(6) if row[k] <= max_len) for row in lengths]
    assert used == expected and 0 < sum(u < 5 for u in used) < len(used)
    for i, k in enumerate(used):
        assert ids[i] == bpe(prompts(questions.iloc[[i]], dev, k)[0])["input_ids"] and len(ids[i]) <= max_len
    with pytest.raises(InputError, match=r"high_school_geography_test.csv: line \d+: the prompt is \d+ tokens even "
                                         r"without shots"):
        tokenize_prompts(bpe, questions, dev, 5, int(lengths[:, 0].min()) - 1)


def test_subject_prefixes_are_the_groups_longest_common_runs(real, bpe, seed):
    """subject_prefixes gives each question the longest run of leading ids that every prompt of its (subject, shots
    kept) group shares, short of each prompt's last token: checked against every pair counted one token at a time,
    with rows edited inside the shared part (at random places) so that a group's run shrinks after its first rows."""
    rng = np.random.default_rng(seed)
    questions = select(real["test"][2], ["anatomy", "virology", "sociology"], 12, DATA, "test")
    ids, _ = tokenize_prompts(bpe, questions, real["dev"][2], 5, None)
    used = [int(u) for u in rng.integers(4, 6, len(ids))]  # two groups per subject
    for q in rng.choice(len(ids), 4, replace=False):  # a token changed inside the shared part
        at = int(rng.integers(1, 200))
        ids[q] = ids[q][:at] + [(ids[q][at] + 1) % len(bpe)] + ids[q][at + 1:]
    groups, shared = subject_prefixes(questions, used, ids)

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for q, g in enumerate(groups):
        members = [r for r, h in enumerate(groups) if h == g]
        expected = 0 if len(members) < 2 else min(min(common(ids[a], ids[b]) for a in members for b in members
                                                      if a != b), min(len(ids[r]) for r in members) - 1)
        assert shared[q] == expected
    assert len({(g, n) for g, n in zip(groups, shared)}) == len(set(groups))
    # not vacuous: every group of two or more shares a run (a group of one, 12 draws all alike but one, shares none:
    # seed 1317363863)
    assert all(n > 0 for g, n in zip(groups, shared) if groups.count(g) > 1) and max(shared) > 0


def test_tokenizing_beside_gives_what_tokenizing_here_gives(real, bpe_dir, bpe, tmp_path):
    """The child process (mmlu_tokenize.TokenizeBeside) hands back exactly mmlu_prompts.tokenize's ids, shots kept
    and answer tokens, here with some prompts cut to fewer shots; its input errors come back as the same errors."""
    questions = select(real["test"][2], ["high_school_geography", "abstract_algebra", "virology"], 12, DATA, "test")
    dev = real["dev"][2]
    max_len = int(np.median([len(ids) for ids in bpe(prompts(questions, dev, 5))["input_ids"]]))
    here = tokenize(bpe_dir, questions, dev, 5, max_len)
    assert 0 < sum(u < 5 for u in here.used) < len(here.used)  # some prompts dropped shots
    with TokenizeBeside(bpe_dir, questions, dev, 5, max_len) as child:
        beside = child.result()
    assert beside == here and child.seconds > 0
    assert not child.dir.exists()  # its folder is gone once read
    shortest = min(len(ids) for ids in tokenize(bpe_dir, questions, None, 0, None).ids)
    for model, limit, error in ((bpe_dir, shortest - 1, InputError), (tmp_path, None, InputError)):
        with pytest.raises(error) as expected:
            tokenize(model, questions, dev, 5, limit)
        with TokenizeBeside(model, questions, dev, 5, limit) as child, pytest.raises(error) as got:
            child.result()
        assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_tokenizing_beside_reports_a_crash_and_stops_when_cancelled(real, bpe_dir):
    questions = select(real["test"][2], ["virology"], 4, DATA, "test")
    with TokenizeBeside(bpe_dir, questions.drop(columns="question"), None, 0, None) as child:
        with pytest.raises(RuntimeError, match="(?s)child process failed.*KeyError: 'question'"):
            child.result()  # not an input error: the child's traceback, for exit code 3
    child = TokenizeBeside(bpe_dir, questions, None, 0, None)
    child.cancel()
    assert child.process.poll() is not None and not child.dir.exists()
    child = TokenizeBeside(bpe_dir, questions, None, 0, None)  # dropped on an error's way out, never waited for
    process, folder = child.process, child.dir
    del child
    gc.collect()
    assert process.poll() is not None and not folder.exists()


# ---- 4. a rigged model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rigged(tmp_path_factory, session_seed, bpe_dir, bpe, real):
    """A Qwen3-MoE always answering letter X, adapters: q/v LoRA (still X) and an lm_head LoRA answering Y;
    X and Y drawn at random among the pairs where X is the more common answer in the subset (so Y drops)."""
    root = tmp_path_factory.mktemp("mmlu_rigged")
    questions = select(real["test"][2], RIG_SUBJECTS, RIG_LIMIT, DATA, "test")
    counts = questions["answer"].value_counts()
    pairs = [(i, j) for i in range(4) for j in range(4) if counts.get(LETTERS[i], 0) > counts.get(LETTERS[j], 0)]
    x, y = pairs[np.random.default_rng(session_seed).integers(len(pairs))]
    model_dir = shutil.copytree(bpe_dir, root / "model")
    save_random_model(model_dir, "qwen3_moe", seed=session_seed, vocab_size=len(bpe), max_position_embeddings=1024,
                      **MOE_OVERRIDES)
    letters = answer_tokens(load_tokenizer(model_dir, needed_for="mmlu"), model_dir)
    rig(model_dir, letters[x])
    adapters = {"attn": save_random_peft_adapter(model_dir, root / "attn", seed=session_seed + 1, r=4, lora_alpha=8,
                                                 target_modules=["q_proj", "v_proj"]),
                "flip": lm_head_adapter(model_dir, root / "flip", letters[y])}
    return dict(model=model_dir, adapters=adapters, x=LETTERS[x], y=LETTERS[y], answers=questions)


def agresti_min(fixed: int, broken: int, n: int) -> tuple[float, float, float]:
    """(low, high, se): Wald on the 2x2 table of (adapter, base) right/wrong over n questions with half a question
    added to each of its four cells, clipped to [-1, 1] (Agresti and Min 2005)."""
    total = n + 2
    up, down = (fixed + 0.5) / total, (broken + 0.5) / total
    se = math.sqrt((up + down - (up - down) ** 2) / total)
    return max(up - down - 1.96 * se, -1), min(up - down + 1.96 * se, 1), se


def hand_numbers(answers: pd.DataFrame, x: str, y: str) -> dict:
    """Accuracies and deltas for 'base and attn answer x, flip answers y', computed from the answer key."""
    out = {}
    for subject, rows in answers.groupby("subject"):
        d = (rows["answer"] == y).to_numpy(float) - (rows["answer"] == x).to_numpy(float)
        low, high, se = agresti_min(int((d > 0).sum()), int((d < 0).sum()), len(d))
        out[subject] = dict(base=(rows["answer"] == x).mean(), flip=(rows["answer"] == y).mean(), delta=d.mean(),
                            low=low, high=high, se=se, d=d)
    return out


def test_rigged_letter_scores_its_share(rigged, tmp_path):
    x, y, answers = rigged["x"], rigged["y"], rigged["answers"]
    drop = 100 * ((answers["answer"] == x).sum() - (answers["answer"] == y).sum()) / len(answers)  # flip's loss
    result = run_cli("mmlu", "--model", rigged["model"], "--adapter", f"attn={rigged['adapters']['attn']}",
                     "--adapter", f"flip={rigged['adapters']['flip']}", "--data", DATA, "--out", tmp_path / "run",
                     "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--max-drop", drop + 1e-9,
                     "--quiet")
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    questions = pd.read_parquet(tmp_path / "run" / "mmlu_questions.parquet")
    subjects = pd.read_csv(tmp_path / "run" / "mmlu_subjects.csv").set_index(["model", "subject"])
    summary = pd.read_csv(tmp_path / "run" / "mmlu_summary.csv").set_index(["model", "group"])
    assert len(questions) == 3 * len(RIG_SUBJECTS) * RIG_LIMIT
    for model, letter in (("base", x), ("attn", x), ("flip", y)):
        assert (questions.loc[questions["model"] == model, "prediction"] == letter).all(), model
    hand = hand_numbers(answers, x, y)
    for subject, h in hand.items():
        assert subjects.loc[("base", subject), "accuracy"] == h["base"]  # exactly the letter's share
        assert subjects.loc[("attn", subject), "accuracy"] == h["base"]
        assert subjects.loc[("flip", subject), "accuracy"] == h["flip"]
        unchanged = 1.96 / (len(h["d"]) + 2)  # no answer changed: Agresti-Min's 1.96 * sqrt(1 / (n + 2)) / sqrt(n + 2)
        assert subjects.loc[("attn", subject), ["delta", "delta_low", "delta_high"]].tolist() == pytest.approx(
            [0, -unchanged, unchanged], abs=1e-12)
        assert subjects.loc[("flip", subject), ["delta", "delta_low", "delta_high"]].tolist() == pytest.approx(
            [h["delta"], h["low"], h["high"]], abs=1e-12)
        assert math.isnan(subjects.loc[("base", subject), "delta"])
    d_all = np.concatenate([h["d"] for h in hand.values()])
    low, high, _ = agresti_min(int((d_all > 0).sum()), int((d_all < 0).sum()), len(d_all))
    assert summary.loc[("flip", "micro"), ["accuracy", "delta", "delta_low", "delta_high"]].tolist() == pytest.approx(
        [(answers["answer"] == y).mean(), d_all.mean(), low, high], abs=1e-12)
    macro_delta = np.mean([h["delta"] for h in hand.values()])
    macro_se = math.sqrt(sum(h["se"] ** 2 for h in hand.values())) / len(hand)
    assert summary.loc[("flip", "macro"), ["accuracy", "delta", "delta_low", "delta_high"]].tolist() == pytest.approx(
        [np.mean([h["flip"] for h in hand.values()]), macro_delta, max(macro_delta - 1.96 * macro_se, -1),
         min(macro_delta + 1.96 * macro_se, 1)], abs=1e-12)
    for subject in RIG_SUBJECTS:  # one subject per category here: the category row is that subject's
        category = CATEGORIES[subject]
        assert summary.loc[("flip", category), "delta"] == pytest.approx(hand[subject]["delta"], abs=1e-12)
        assert summary.loc[("base", category), "accuracy"] == pytest.approx(hand[subject]["base"], abs=1e-12)
    assert summary["passed"].all()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["rows"] == len(questions) and run["arguments"]["subjects"] == RIG_SUBJECTS
    assert_phases(result, tmp_path / "run", ["data", "tokenize", "load", "compile", "forward", "metrics", "write"])
    assert {"model/config.json", "adapter flip/adapter_model.safetensors"} <= set(run["fingerprint"]["files"])
    report = (tmp_path / "run" / "mmlu.md").read_text()
    assert report.startswith("# lora-eval mmlu: PASSED") and "## Subjects with the largest drops" in report


def test_max_drop_exit_code_and_api(rigged, tmp_path):
    """flip (always Y) loses `drop` points against base (always X): exit 1 under a threshold just below it;
    the Python API returns what the CLI wrote."""
    x, y, answers = rigged["x"], rigged["y"], rigged["answers"]
    drop = 100 * ((answers["answer"] == x).sum() - (answers["answer"] == y).sum()) / len(answers)
    assert drop > 0
    failed = run_cli("mmlu", "--model", rigged["model"], "--adapter", f"flip={rigged['adapters']['flip']}", "--data",
                     DATA, "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--shots", 1, "--quiet",
                     "--out", tmp_path / "fail", "--max-drop", drop * 0.999)
    assert_no_traceback(failed)
    assert failed.exit_code == 1 and "FAILED: flip" in failed.stderr
    assert "# lora-eval mmlu: FAILED: flip" in (tmp_path / "fail" / "mmlu.md").read_text()
    result = lora_eval.mmlu(rigged["model"], {"flip": rigged["adapters"]["flip"]}, DATA, subjects=RIG_SUBJECTS,
                            limit=RIG_LIMIT, shots=1, max_drop=drop * 1.001, quiet=True)
    assert result.passed
    written = pd.read_csv(tmp_path / "fail" / "mmlu_summary.csv")
    pd.testing.assert_frame_equal(written.drop(columns="passed"), result.summary.drop(columns="passed"))
    assert not written.loc[written["model"] == "flip", "passed"].any()
    assert written.loc[written["model"] == "base", "passed"].all()


def test_an_interrupted_run_resumes_to_the_same_files(rigged, tmp_path, monkeypatch):
    """mmlu's batches are the units of its run folder: Ctrl-C after a few batches exits 130 and keeps them; the same
    command then scores only the rest, and every table equals an uninterrupted run's byte for byte."""
    args = ["mmlu", "--model", rigged["model"], "--adapter", f"flip={rigged['adapters']['flip']}", "--data", DATA,
            "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--shots", 1, "--batch-tokens", 512, "--quiet"]
    whole = run_cli(*args, "--out", tmp_path / "whole")
    assert whole.exit_code == 0, (whole.stdout, whole.stderr)
    original, calls = Engine.start_next_token_logprobs, []

    def stopping(self, batch, candidates):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, batch, candidates)

    monkeypatch.setattr(Engine, "start_next_token_logprobs", stopping)
    assert run_cli(*args, "--out", tmp_path / "run").exit_code == 130
    monkeypatch.setattr(Engine, "start_next_token_logprobs", original)
    resumed = run_cli(*args, "--out", tmp_path / "run")
    assert resumed.exit_code == 0 and "resuming: 2 of " in resumed.stderr, resumed.stderr
    work = json.loads((tmp_path / "run" / "run.json").read_text())["work"]
    assert work["resumed_units"] == 2 and work["units"] > 3
    for name in ("mmlu_questions.parquet", "mmlu_subjects.csv", "mmlu_summary.csv"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_data_parallel_equals_one_process(rigged, tmp_path):
    """`lora-eval launch --nproc-per-node 2 mmlu`: the ranks share the batches, rank 0 merges; every table equals
    one process's byte for byte (the torch backend is batch-invariant)."""
    args = ["mmlu", "--model", rigged["model"], "--adapter", f"flip={rigged['adapters']['flip']}", "--data", DATA,
            "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--shots", 1, "--batch-tokens", 512, "--quiet"]
    assert run_cli(*args, "--out", tmp_path / "one").exit_code == 0
    code, stdout, stderr = finish(torchrun(2, [*args, "--out", tmp_path / "two"]))
    assert code == 0, (stdout, stderr)
    assert len(json.loads((tmp_path / "two" / "run.json").read_text())["work"]["ranks"]) == 2
    for name in ("mmlu_questions.parquet", "mmlu_subjects.csv", "mmlu_summary.csv"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    # the exit codes of one process (lora-eval launch): 1 with one verdict (flip drops), 2 with one line
    code, stdout, stderr = finish(torchrun(2, [*args, "--out", tmp_path / "strict", "--max-drop", 0]))
    assert code == 1 and stdout.count("report: ") == 1 and len(stderr.splitlines()) == 1, (stdout, stderr)
    assert stderr.startswith("FAILED: flip"), stderr
    bad = [tmp_path / "nowhere" if a == DATA else a for a in args]
    code, stdout, stderr = finish(torchrun(2, [*bad, "--out", tmp_path / "three"]))
    assert (code, stdout) == (2, "") and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"error: {tmp_path / 'nowhere'}") and not (tmp_path / "three").exists()


def test_max_drop_boundary_is_exact():
    rows = pd.DataFrame(dict(correct=[True] * 6 + [False] * 2, base_correct=[True] * 8))  # 8 questions, 2 lost
    assert passes(rows, 25.0) and not passes(rows, 24.99) and passes(rows, None)  # 25 points: not more than 25


def test_paired_interval_and_exact_test_by_hand():
    # 8 questions: 4 fixed, 1 broken, 3 unchanged; half a question more in each cell: 10, 0.45 up, 0.15 down
    low, high, se = paired_interval(4, 1, 8)
    assert se == pytest.approx(math.sqrt((0.6 - 0.3 ** 2) / 10), rel=1e-12)
    assert (low, high) == pytest.approx((0.3 - 1.96 * se, 0.3 + 1.96 * se), rel=1e-12)
    low, high, _ = paired_interval(0, 2, 2)  # two questions both broken: no longer [-1, -1], and 0 inside
    assert low == -1 and high == pytest.approx(-0.5 + 1.96 * math.sqrt(0.125), rel=1e-12) and high > 0
    assert all(math.isnan(v) for v in paired_interval(0, 0, 0))
    assert mcnemar_p(6, 0) == 2 / 64 and mcnemar_p(0, 5) == 2 / 32 and mcnemar_p(1, 9) == 2 * 11 / 1024
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0


def test_the_prompts_tokenised_beside_the_load_give_the_same_run(rigged, tmp_path, monkeypatch):
    """With the prompts tokenised in the child process beside the model's load (what a GPU run does), the run's
    tables are byte for byte those of the run that tokenised them first; a complete run is then handed back
    without loading the model."""
    args = ["--model", rigged["model"], "--adapter", f"flip={rigged['adapters']['flip']}", "--data", DATA,
            "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--shots", 2, "--quiet"]
    here = run_cli("mmlu", *args, "--out", tmp_path / "here")
    assert here.exit_code == 0, (here.stdout, here.stderr)
    monkeypatch.setattr(mmlu_task, "tokenizes_beside", lambda engine, options: engine is None)
    beside = run_cli("mmlu", *args, "--out", tmp_path / "beside")
    assert_no_traceback(beside)
    assert beside.exit_code == 0, (beside.stdout, beside.stderr)
    for name in ("mmlu_questions.parquet", "mmlu_subjects.csv", "mmlu_summary.csv"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "beside" / name).read_bytes(), name
    prompts_here = json.loads((tmp_path / "here" / "run.json").read_text())["prompts"]
    prompts_beside = json.loads((tmp_path / "beside" / "run.json").read_text())["prompts"]
    assert prompts_here.pop("tokenized_beside_load_s") is None and prompts_beside.pop("tokenized_beside_load_s") > 0
    assert prompts_here == prompts_beside
    assert_phases(beside, tmp_path / "beside", ["data", "tokenize", "load", "compile", "forward", "metrics", "write"])

    def no_load(*a, **k):
        raise AssertionError("the model was loaded for a run the folder holds complete")

    monkeypatch.setattr(Engine, "load", no_load)
    again = run_cli("mmlu", *args, "--out", tmp_path / "beside")
    assert again.exit_code == 0 and "holds this run already" in again.stdout + again.stderr, again.stderr


# ---- 5. bad data -------------------------------------------------------------------------------------


def edit_lines(path: Path, row: int, replace) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[row] = replace(lines[row])
    path.write_text("".join(lines), encoding="utf-8")


def test_datasets_is_offline_only_while_reading(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with quiet_libraries(datasets=True) as datasets:
        assert datasets.config.HF_DATASETS_OFFLINE and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_quiet_libraries_keeps_the_libraries_quiet_inside_the_block_only():
    import datasets
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as hf_logging

    def state():
        return (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), ds_logging.get_verbosity(),
                datasets.is_progress_bar_enabled(), list(warnings.filters))

    before = state()
    with quiet_libraries(datasets=True):
        assert state()[:4] == (hf_logging.ERROR, False, ds_logging.ERROR, False)
        with warnings.catch_warnings(record=True) as seen:  # (records what the block's filters let through)
            warnings.warn("advice")
        assert seen == []
    assert state() == before


@pytest.fixture
def small_data(tmp_path):
    """global_facts (no quoted newlines: one line per row) and abstract_algebra, dev and test."""
    return copy_subjects(tmp_path / "mmlu", ["global_facts", "abstract_algebra"])


def check_error(data: Path, *needles, split="test", shots=5):
    with pytest.raises(InputError) as info:
        lora_eval.mmlu(data / "no-model-needed", {}, data, shots=shots, split=split)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_bad_csv_rows(small_data):
    path = small_data / "test" / "global_facts_test.csv"
    original = path.read_text(encoding="utf-8")
    edit_lines(path, 3, lambda line: line.rstrip("\n").rsplit(",", 1)[0] + "\n")  # answer column missing
    check_error(small_data, f"{path}: line 4: 5 fields, expected 6 (question, A, B, C, D, answer)")
    path.write_text(original, encoding="utf-8")
    edit_lines(path, 5, lambda line: line.rstrip("\n") + ",extra\n")
    check_error(small_data, f"{path}: line 6: 7 fields, expected 6")
    path.write_text(original, encoding="utf-8")
    edit_lines(path, 7, lambda line: line.rstrip("\n")[:-1] + "E\n")
    check_error(small_data, f"{path}: line 8: answer must be one of A, B, C, D, found 'E'")


def test_empty_files_and_missing_dev(small_data):
    dev = small_data / "dev" / "abstract_algebra_dev.csv"
    dev.write_text("")
    check_error(small_data, f"{dev}: no questions (empty file)")
    dev.unlink()
    check_error(small_data, f"{dev}: subject 'abstract_algebra' has no dev examples; --shots 5 needs 5")
    shutil.copy(DATA / "dev" / "abstract_algebra_dev.csv", dev)
    edit_lines(small_data / "dev" / "global_facts_dev.csv", 0, lambda line: "")
    check_error(small_data, "global_facts_dev.csv: subject 'global_facts' has only 4 dev examples")
    test = small_data / "test" / "global_facts_test.csv"
    test.write_text("\n")
    check_error(small_data, f"{test}: no questions (empty file)", shots=0)
    assert_input_error(run_cli("mmlu", "--model", small_data, "--data", small_data, "--out", small_data.parent / "o",
                               "--shots", 0), str(test), "empty file")


def test_bad_cais_data(real, tmp_path):
    splits = {s: select(real[s][2], ["virology"], None, DATA, s) for s in ("dev", "test")}
    root = write_cais_parquet(tmp_path / "cais", splits)
    path = root / "virology" / "test-00000-of-00001.parquet"
    good = pd.read_parquet(path)
    good.drop(columns="answer").to_parquet(path, index=False)
    check_error(root, f"{path}: answer: missing column")
    good.assign(answer=[*good["answer"][:4], 4, *good["answer"][5:]]).to_parquet(path, index=False)
    check_error(root, f"{path}: row 4: answer must be an integer 0-3 or a letter A-D, found 4")
    good.assign(choices=[*good["choices"][:2], ["x", "y", "z"], *good["choices"][3:]]).to_parquet(path, index=False)
    check_error(root, f"{path}: row 2: choices must be a list of 4 answers, found 3")
    good.iloc[:0].to_parquet(path, index=False)
    check_error(root, f"{path}: no questions (empty file)")
    good.to_parquet(path, index=False)
    (root / "virology" / "dev-00000-of-00001.parquet").unlink()
    (root / "all" / "dev-00000-of-00001.parquet").unlink()
    check_error(root, "no dev parquet files")
    saved = write_saved_dataset(tmp_path / "saved", {"dev": splits["dev"],
                                                     "test": splits["test"].assign(subject="virus_studies")})
    check_error(saved, f"{saved / 'test'}: row 0: subject 'virus_studies' is not one of MMLU's 57 subjects")


def test_bad_usage(small_data):
    for args, needles in [(["--subjects", "astrology"], ["--subjects", "'astrology' has no test questions"]),
                          (["--adapter", f"base={small_data}"], ["--adapter", "'base' is reserved for reports"])]:
        assert_input_error(run_cli("mmlu", "--model", small_data, "--data", small_data,
                                   "--out", small_data.parent / "o", *args), *needles)
    result = run_cli("mmlu", "--model", small_data, "--data", small_data, "--out", small_data.parent / "o",
                     "--limit", 0)
    assert result.exit_code == 2 and "--limit" in result.stderr


# ---- 6. the engine's last-position scores --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_adapters(moe_model, tmp_path_factory, session_seed):
    root = tmp_path_factory.mktemp("mmlu_engine_adapters")
    return {"peft": save_random_peft_adapter(moe_model, root / "peft", seed=session_seed + 5, r=4, lora_alpha=8,
                                             target_modules="all-linear"),
            "heads": save_random_peft_adapter(moe_model, root / "heads", seed=session_seed + 6, r=4, lora_alpha=8,
                                              target_modules=["lm_head", "q_proj"])}


@torch.no_grad()
def last_position_oracle(model, sequences, candidates) -> torch.Tensor:
    """transformers float32: the full logits of each sequence, then the last position's candidate logprobs."""
    rows = []
    for seq in sequences:
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()  # [L, V]
        rows.append(torch.log_softmax(logits, dim=-1)[-1, candidates])
    return torch.stack(rows)  # [B, C]


def test_next_token_logprobs_match_transformers(moe_model, engine_adapters, seed):
    sequences = random_sequences(6, 96, seed=seed, min_len=1, max_len=30)
    candidates = torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:4].tolist()
    engine = Engine.load(moe_model, engine_adapters, CPU)
    for name, oracle in [(None, load_hf(moe_model)), ("peft", peft_oracle(moe_model, engine_adapters["peft"])),
                         ("heads", peft_oracle(moe_model, engine_adapters["heads"]))]:
        got = engine.next_token_logprobs(Batch(sequences, [name] * len(sequences)), candidates)
        expected = last_position_oracle(oracle, sequences, candidates)
        assert got.shape == (6, 4) and got.dtype == torch.float32
        diff = (got - expected).abs().max().item()
        print(f"{name}: max |diff| {diff:.2e}")
        assert diff < ORACLE_TOL, name
    full = engine.logprobs(Batch([s + [c] for s in sequences for c in candidates], ["peft"] * 24))
    last = torch.stack([lp[-1] for lp in full]).view(6, 4)  # the same numbers through logprobs()
    assert torch.allclose(engine.next_token_logprobs(Batch(sequences, ["peft"] * 6), candidates), last, atol=1e-6)


def test_mixed_batch_equals_each_run_alone(moe_model, engine_adapters, seed):
    sequences = random_sequences(9, 96, seed=seed, min_len=2, max_len=40)
    tags = [None, "peft", "heads"] * 3
    candidates = [3, 17, 42, 95]
    engine = Engine.load(moe_model, engine_adapters, CPU)
    mixed = engine.next_token_logprobs(Batch(sequences, tags), candidates)
    for i, (seq, tag) in enumerate(zip(sequences, tags)):
        assert torch.equal(mixed[i], engine.next_token_logprobs(Batch([seq], [tag]), candidates)[0]), (i, tag)
    base = Engine.load(moe_model, None, CPU).next_token_logprobs(Batch(sequences, [None] * 9), candidates)
    assert torch.equal(mixed[0::3], base[0::3])  # base rows are the base model exactly
    assert (mixed[1::3] - base[1::3]).abs().max() > 1e-3 and (mixed[2::3] - base[2::3]).abs().max() > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu test runs the kernels compiled")
def test_next_token_logprobs_triton_backend_in_the_interpreter(moe_model, engine_adapters, seed):
    sequences = random_sequences(6, 96, seed=seed, min_len=2, max_len=14)
    tags = [None, "peft", "heads", "peft", None, "heads"]
    ref = Engine.load(moe_model, engine_adapters, CPU).next_token_logprobs(Batch(sequences, tags), [1, 2, 3, 4])
    triton = Engine.load(moe_model, engine_adapters, replace(CPU, backend="triton"))
    triton = triton.next_token_logprobs(Batch(sequences, tags), [1, 2, 3, 4])
    assert (ref - triton).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_next_token_logprobs_cuda(moe_model, engine_adapters, seed):
    sequences = random_sequences(12, 96, seed=seed, min_len=2, max_len=40)
    tags = [None, "peft", "heads"] * 4
    ref = Engine.load(moe_model, engine_adapters, CPU).next_token_logprobs(Batch(sequences, tags), [1, 2, 3, 4])
    cuda = Engine.load(moe_model, engine_adapters, replace(CPU, device="cuda"))
    cuda = cuda.next_token_logprobs(Batch(sequences, tags), [1, 2, 3, 4])
    assert (ref - cuda).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_prompts_tokenised_beside_the_load_on_the_gpu(rigged, tmp_path, monkeypatch):
    """On the GPU the prompts are tokenised in the child process beside the model's load (tokenizes_beside): the
    tables equal, byte for byte, those of a run that tokenised them first in its own process."""
    args = ["--model", rigged["model"], "--adapter", f"flip={rigged['adapters']['flip']}", "--data", DATA,
            "--subjects", ",".join(RIG_SUBJECTS), "--limit", RIG_LIMIT, "--device", "cuda", "--dtype", "float32",
            "--quiet"]
    beside = run_cli("mmlu", *args, "--out", tmp_path / "beside")
    assert beside.exit_code == 0, (beside.stdout, beside.stderr)
    assert json.loads((tmp_path / "beside" / "run.json").read_text())["prompts"]["tokenized_beside_load_s"] > 0
    monkeypatch.setattr(mmlu_task, "tokenizes_beside", lambda engine, options: False)
    here = run_cli("mmlu", *args, "--out", tmp_path / "here")
    assert here.exit_code == 0, (here.stdout, here.stderr)
    assert json.loads((tmp_path / "here" / "run.json").read_text())["prompts"]["tokenized_beside_load_s"] is None
    for name in ("mmlu_questions.parquet", "mmlu_subjects.csv", "mmlu_summary.csv"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "beside" / name).read_bytes(), name
