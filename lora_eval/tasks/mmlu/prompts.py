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

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ...errors import InputError, UnsupportedError
from ...hf import quiet_libraries
from ...inputs.mmlu_data import LETTERS
from ...inputs.tokenizer import load_tokenizer


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
    return _prompts(questions.to_dict("records"), prompt_prefixes(questions, dev, shots), shots)


def _prompts(records: list[dict], prefixes: dict[str, list[str]], shots: int) -> list[str]:
    """`prompts` of question records, given their subjects' prefixes (prompt_prefixes)."""
    return [prefixes[q["subject"]][shots] + format_question(q, False) for q in records]


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
    with quiet_libraries():  # "sequence longer than the model maximum": checked here
        ids = encode(tokenizer, _prompts(records, prefixes, shots))  # (records and prefixes made once)
        used = [shots] * len(ids)
        for i, q in enumerate(records):
            while max_len is not None and len(ids[i]) > max_len:
                if used[i] == 0:
                    raise InputError(q["file"], f"the prompt is {len(ids[i])} tokens even without shots, more than "
                                     f"the model's max_position_embeddings ({max_len})", key=q["key"])
                used[i] -= 1
                ids[i] = encode(tokenizer, [prefixes[q["subject"]][used[i]] + format_question(q, False)])[0]
    return ids, used


@dataclass
class Tokenized:
    """Every question's prompt as token ids, the shots each kept, and the answer letters' token ids and names."""
    ids: list[list[int]]
    used: list[int]
    candidates: list[int]
    candidate_tokens: list[str]


def tokenize(model: str | Path, questions: pd.DataFrame, dev: pd.DataFrame | None, shots: int,
             max_len: int | None) -> Tokenized:
    """The model folder's tokenizer loaded, the answer letters' tokens found and every prompt tokenised."""
    tokenizer = load_tokenizer(model, needed_for="mmlu")
    candidates = answer_tokens(tokenizer, model)
    ids, used = tokenize_prompts(tokenizer, questions, dev, shots, max_len)
    return Tokenized(ids=ids, used=used, candidates=candidates,
                     candidate_tokens=[tokenizer.convert_ids_to_tokens(t) for t in candidates])
