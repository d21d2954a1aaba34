"""The tokenizer saved in a model folder (never downloaded): required (mmlu, text prompts) or optional (decoding the
worst tokens of a report, where token ids stand in without one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import InputError
from ..hf import quiet_libraries
from ..models.checkpoint import readable_file

# the files a tokenizer is saved in (transformers: fast, sentencepiece, BPE and WordPiece vocabularies); without
# any of them transformers still builds one from config.json's model_type, which turns every text into no tokens
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(model_dir: str | Path, needed_for: str | None = None):
    """The model folder's tokenizer. Without `needed_for`, None when the folder has none or it cannot be read;
    with it (e.g. "mmlu"), an InputError naming the folder, what needs it and what is wrong."""
    model_dir = Path(model_dir)
    if needed_for is not None:  # a tokenizer file that is a folder, a broken link or unreadable: named as such
        for path in (model_dir / name for name in TOKENIZER_FILES):
            if path.exists() or path.is_symlink():
                readable_file(path)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        if needed_for is None:
            return None  # (before importing transformers' tokenizers: that alone takes ~1.6 s)
        raise InputError(model_dir, f"{needed_for} needs the model's tokenizer, and the model folder has none (no "
                         f"{', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    with quiet_libraries():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            if not tokenizer("The answer is A.", add_special_tokens=False)["input_ids"]:
                raise ValueError("it turns text into no tokens")  # a vocabulary of special tokens only
            return tokenizer
        except Exception as e:  # transformers raises several types for a missing or broken tokenizer
            if needed_for is None:
                return None  # an unreadable tokenizer only costs the decoded text
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]  # the message is one line
            raise InputError(model_dir, f"{needed_for} needs the model's tokenizer, and the one in the model folder "
                             f"cannot be used ({reason})") from None


def load_decoder(model_dir: str | Path) -> Callable[[list[int]], str] | None:
    """Token ids -> their text, for reports (compare's worst tokens), or None when the folder has no readable
    tokenizer. A tokenizer.json is read by the `tokenizers` library alone: transformers' fast tokenizers decode
    through that same object (special tokens kept, no clean-up of spaces), and importing transformers costs seconds
    of a compare command (BENCHMARKS-history 12 and 18.3).
    Without one (a slow, sentencepiece-only tokenizer), transformers' tokenizer decodes."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001 - tokenizers raises its own exception type for an unreadable file
            return None  # an unreadable tokenizer only costs the decoded text
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
