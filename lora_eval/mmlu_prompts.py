"""MMLU prompts: the paper's k-shot format, tokenised with the model's own tokenizer, and the answer tokens.

Prompt — byte for byte lm-evaluation-harness's default `mmlu` task (tests/test_mmlu.py checks a sample it built), so
accuracies compare with lm-eval's; one space after "about", where the paper's script printed two:
    The following are multiple choice questions (with answers) about {subject, _ as spaces}.\\n\\n
    then k dev examples, each  {question, stripped}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer: {letter}\\n\\n
    then the test question      {question, stripped}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\nAnswer:
The shots are the subject's first k dev rows. When the tokenised prompt is longer than the model's
`max_position_embeddings`, shots are dropped from the end until it fits (the paper's rule).

Scored token. The dev examples continue "Answer:" with " A"; so the candidates are the tokens that the
model's own tokenizer produces for the letter right after "\\nAnswer:" in the text "\\nAnswer: A" — " A" (one
token, `ĠA`) for byte-level BPE tokenizers (Qwen, Llama 3, GPT-2), `▁A` for SentencePiece ones. That is
the token the model saw after "Answer:" in every shot, so it is the natural next token; the bare "A" is a
different token that the prompt never shows in that position. A tokenizer that splits " A" there into more than
one token is refused (UnsupportedError): lora-eval scores exactly one token per letter.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from .errors import InputError, UnsupportedError
from .mmlu_data import LETTERS


def subject_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def format_question(row, with_answer: bool) -> str:
    """One question block; `row` maps question, A-D and answer (a dev example shows its answer). The question is
    stripped of surrounding whitespace, the choices are not: lm-evaluation-harness's `mmlu` task does the same."""
    text = row["question"].strip() + "".join(f"\n{x}. {row[x]}" for x in LETTERS) + "\nAnswer:"
    return text + f" {row['answer']}\n\n" if with_answer else text


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


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's special tokens (e.g. BOS), as `tokenizer(texts)` gives them. A
    fast tokenizer's `tokenizers` object encodes them itself without character offsets (`encode_batch_fast`): the
    same ids, the object transformers' call encodes through, 18% faster on the full test split's 42 MB of prompts
    (6.19 against 7.53 s on two CPU cores, 9.9M tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts)]
    return tokenizer(texts)["input_ids"]


def tokenize_prompts(tokenizer, questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int,
                     max_len: int | None) -> tuple[list[list[int]], list[int]]:
    """Token ids of every question's prompt (with the tokenizer's special tokens, e.g. BOS) and the shots it
    kept: a prompt longer than `max_len` drops shots from the end until it fits."""
    prefixes = prompt_prefixes(questions, dev, shots)
    records = questions.to_dict("records")
    with _quiet_transformers():  # "sequence longer than the model maximum": checked here
        ids = encode(tokenizer, prompts(questions, dev, shots))
        used = [shots] * len(ids)
        for i, q in enumerate(records):
            while max_len is not None and len(ids[i]) > max_len:
                if used[i] == 0:
                    raise _too_long(q, len(ids[i]), max_len)
                used[i] -= 1
                ids[i] = encode(tokenizer, [prefixes[q["subject"]][used[i]] + format_question(q, False)])[0]
    return ids, used


class PromptTokens:
    """`tokenize_prompts` started before the model loads and finished beside it: `result()` -> (ids, used).

    What can make the prompts an input error is checked at construction, before any weight loads: every question's
    shortest prompt (its 0-shot prompt, tokenised exactly as a prompt with its shots dropped) against `max_len`, and
    the largest token id the tokenizer can make (its vocabulary's and that of every special token those prompts
    carry) against the model's `vocab_size`. The prompts with shots (85% of the 5-shot test split's tokens) are then
    tokenised on a background thread while the model loads: `tokenizers` encodes in Rust without the GIL. Where the
    vocabulary bound does not hold, the prompts are tokenised whole at once and their ids checked one by one.
    `seconds`: the background tokenising's own time (0 where nothing ran beside the load)."""

    def __init__(self, tokenizer, questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int,
                 max_len: int | None, vocab_size: int, model):
        self.seconds = 0.0
        records = questions.to_dict("records")
        with _quiet_transformers():
            shortest = encode(tokenizer, [subject_header(q["subject"]) + format_question(q, False) for q in records])
        for q, row in zip(records, shortest):
            if max_len is not None and len(row) > max_len:
                raise _too_long(q, len(row), max_len)
        largest = max((max(row) for row in shortest if row), default=0)  # (special tokens included)
        bound = max(largest, _largest_vocabulary_id(tokenizer))
        self._future: Future = Future()
        if shots == 0:
            self._future.set_result((shortest, [0] * len(shortest)))
        elif bound < vocab_size:
            largest = bound
            pool = ThreadPoolExecutor(1, thread_name_prefix="lora-eval-tokenize")
            self._future = pool.submit(self._timed, tokenize_prompts, tokenizer, questions, dev, shots, max_len)
            pool.shutdown(wait=False)
        else:  # (some vocabulary id is out of range: the prompts' own ids decide, now)
            ids, used = tokenize_prompts(tokenizer, questions, dev, shots, max_len)
            largest = max(max(row) for row in ids if row)
            self._future.set_result((ids, used))
        check_vocabulary(largest, vocab_size, model)

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds = time.perf_counter() - t0

    def result(self) -> tuple[list[list[int]], list[int]]:
        return self._future.result()


def check_vocabulary(largest: int, vocab_size: int, model) -> None:
    """InputError unless token id `largest` (the largest the tokenizer makes) is inside the model's vocabulary."""
    if largest >= vocab_size:
        raise InputError(Path(model) / "config.json", f"the tokenizer makes token id {largest}, outside the model's "
                         f"vocabulary ({vocab_size}): the tokenizer in the model folder does not belong to this model",
                         key="vocab_size")


def _largest_vocabulary_id(tokenizer) -> int:
    """The largest id `tokenizer` can make from text: its vocabulary's, added tokens included."""
    return max(tokenizer.get_vocab().values(), default=0)


def _too_long(q, n: int, max_len: int) -> InputError:
    return InputError(q["file"], f"the prompt is {n} tokens even without shots, more than the model's "
                      f"max_position_embeddings ({max_len})", key=f"row {q['row']}")


@contextmanager
def _quiet_transformers():
    """Transformers logs errors only meanwhile (a tokenizer called directly warns of sequences longer than its
    maximum: the prompts' lengths are checked here)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
