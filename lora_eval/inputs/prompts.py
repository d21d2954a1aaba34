"""Prompts for dump-reference: JSONL, one object per sample, checked strictly before any model is loaded.

Each object holds `input_ids` (a list of token ids), or `text`, or `prompt` and `response` (tokenised with the
model's tokenizer; the mask then covers the response tokens only); optional `sample_id` (string or integer;
default: the object's number, from 1), `mask` (len(input_ids) - 1 booleans, with `input_ids` or `text`) and
`adapter`: an adapter name, or null (or "base") for the base model. A prompt without an `adapter` field runs under
the default adapter: `--default-adapter NAME`, else the only `--adapter` given, else the base model; with several
adapters and no default, such a prompt is refused. A line giving more than one of `input_ids`, `text` and `prompt`
(or a `response` without `prompt`) is refused: which would be the sample is never guessed. Other fields are ignored.
A prompt and response without a response token, or a file whose masks leave no token to score, is refused here too,
before the model loads.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd

from ..errors import InputError
from ..names import BASE
from .checks import read_jsonl
from .tokenizer import load_tokenizer


def read_prompts(path: str | Path, model_dir: str | Path, adapters: dict, vocab_size: int,
                 default_adapter: str | None = None, notice=print) -> pd.DataFrame:
    """Rows of sample_id, adapter (None = base), input_ids, mask, each checked; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "prompts file not found")
    if default_adapter is not None and default_adapter != BASE and default_adapter not in adapters:
        raise InputError("--default-adapter", f"'{default_adapter}' is not one of the adapters given "
                         f"({', '.join(sorted(adapters)) or 'none'}) nor '{BASE}'")
    tokenizer = functools.cache(lambda: load_tokenizer(model_dir, needed_for="prompts given as text"))
    rows, defaulted, seen = [], 0, {}
    for count, (line, item) in enumerate(read_jsonl(path), start=1):
        where = f"line {line}"

        def bad(problem):
            return InputError(path, problem, key=where)

        ids, mask = _tokens(item, bad, tokenizer)
        _check_tokens(ids, mask, item, bad, vocab_size, Path(model_dir) / "config.json", f"{path} {where}")
        adapter = _adapter(item, bad, adapters, default_adapter, path, where)
        defaulted += "adapter" not in item
        sample_id = item.get("sample_id", count)
        if isinstance(sample_id, bool) or not isinstance(sample_id, (str, int)):
            raise bad(f"sample_id must be a string or an integer, found {sample_id!r}")
        if str(sample_id) in seen:
            raise bad(f"sample_id {sample_id} is also used on line {seen[str(sample_id)]}")
        seen[str(sample_id)] = line
        rows.append(dict(sample_id=str(sample_id), adapter=None if adapter == BASE else adapter, input_ids=ids,
                         mask=None if mask is None else [bool(m) for m in mask]))
    if not rows:
        raise InputError(path, "no prompts in the file")
    if not any(row["mask"] is None or any(row["mask"]) for row in rows):
        raise InputError(path, "no prompt scores a token: every mask is all false (nothing to dump)", key="mask")
    if defaulted and rows and adapters:
        name = default_adapter or next(iter(adapters))
        notice(f"note: {defaulted} prompts without an 'adapter' field run under "
               f"{'the base model' if name == BASE else repr(name)}"
               f"{'' if default_adapter else ', the only --adapter given'}")
    return pd.DataFrame(rows, columns=["sample_id", "adapter", "input_ids", "mask"])


def _tokens(item: dict, bad, tokenizer) -> tuple[list, list | None]:
    """A line's token ids and mask, as given (checked by _check_tokens): `input_ids`, or `text`, or `prompt` and
    `response` tokenised by `tokenizer()` (the model's, loaded on first use; the mask then covers the response).
    `bad(problem)`: the error naming the line."""
    given = [name for name in ("input_ids", "text", "prompt") if name in item]
    if len(given) > 1:  # (which one would be the sample? never guessed)
        raise bad(f"gives both {given[0]} and {given[1]}: a prompt is 'input_ids', 'text', or 'prompt' and "
                  "'response', exactly one of them")
    if "response" in item and "prompt" not in item:
        raise bad(f"gives a response without a prompt (with {given[0] if given else 'nothing else'}): a response "
                  "goes with 'prompt' only")
    mask = item.get("mask")
    if "input_ids" in item:
        ids = item["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad(f"input_ids must be a list of integer token ids, found {str(ids)[:40]}")
        return ids, mask
    if "text" not in item and "prompt" not in item:
        raise bad("expected 'input_ids', 'text', or 'prompt' and 'response'")
    for name in ["text"] if "text" in item else ["prompt", "response"]:
        if name in item and not isinstance(item[name], str):
            raise bad(f"{name} must be a string, found {type(item[name]).__name__}")
    encode = tokenizer()
    if "text" in item:
        return encode(item["text"])["input_ids"], mask
    if mask is not None:
        raise bad("give either mask or prompt and response (whose mask is the response tokens)")
    prompt = encode(item["prompt"])["input_ids"]
    response = encode(item.get("response", ""), add_special_tokens=False)["input_ids"]
    if not response:  # (its mask would be all false)
        raise bad("response is missing or gives no token: only the response tokens are scored, so this "
                  "prompt would score none")
    ids = prompt + response
    return ids, [i + 1 >= len(prompt) for i in range(len(ids) - 1)]


def _check_tokens(ids: list, mask, item: dict, bad, vocab_size: int, config_path: Path, origin: str) -> None:
    """At least 2 token ids, each in the vocabulary (one the tokenizer made outside it: the tokenizer is not the
    model's, named in config.json's vocab_size; `origin`: the file and line), and a mask of len(ids) - 1 booleans."""
    tokenized = "input_ids" not in item
    if len(ids) < 2:
        raise bad(f"a sample needs at least 2 tokens, found {len(ids)}"
                  + (f" ({'text' if 'text' in item else 'prompt and response'} tokenised)" if tokenized else ""))
    outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None and tokenized:  # the tokenizer's fault, not the line's
        raise InputError(config_path, f"the tokenizer makes token id {outside} (from {origin}), outside the model's "
                         f"vocabulary ({vocab_size}): the tokenizer in the model folder does not belong to this model",
                         key="vocab_size")
    if outside is not None:
        raise bad(f"token id {outside} is outside the model's vocabulary [0, {vocab_size})")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids) - 1 or not all(
            isinstance(m, bool) or (type(m) is int and m in (0, 1)) for m in mask)):
        raise bad(f"mask must be a list of len(input_ids)-1 = {len(ids) - 1} booleans (true/false or 0/1)")


def _adapter(item: dict, bad, adapters: dict, default_adapter: str | None, path: Path, where: str) -> str | None:
    """The line's adapter: its `adapter` field (a name given, null or "base"), else the default (_default)."""
    if "adapter" not in item:
        return _default(adapters, default_adapter, path, where)
    adapter = item["adapter"]
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise bad(f"adapter must be an adapter name or null, found {adapter!r}")
    if adapter is not None and adapter != BASE and adapter not in adapters:
        raise bad(f"names adapter '{adapter}', which was not given; known adapters: "
                  f"{', '.join(sorted(adapters)) or 'none'}")
    return adapter


def _default(adapters: dict, default_adapter: str | None, path: Path, where: str) -> str | None:
    """The adapter of a prompt without an `adapter` field (None: the base model)."""
    if default_adapter is not None:
        return default_adapter
    if len(adapters) == 1:
        return next(iter(adapters))
    if adapters:
        raise InputError(path, f"no 'adapter' field, and {len(adapters)} adapters were given: add the field (null for "
                         "the base model) or pass --default-adapter NAME", key=where)
    return None
