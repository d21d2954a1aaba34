"""The tokenizer saved in a model folder (never downloaded): required (mmlu, text prompts) or optional (decoding the
worst tokens of a report, where token ids stand in without one)."""

from __future__ import annotations

import warnings
from pathlib import Path

from .errors import InputError


def load_tokenizer(model_dir: str | Path, needed_for: str | None = None):
    """The model folder's tokenizer. Without `needed_for`, None when the folder has none or it cannot be read;
    with it (e.g. "mmlu"), an InputError naming the folder and what needs it."""
    model_dir = Path(model_dir)
    if needed_for is None and not any((model_dir / name).is_file()
                                      for name in ("tokenizer.json", "tokenizer_config.json")):
        return None  # (before importing transformers' tokenizers: that alone takes ~1.6 s)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing or broken tokenizer
        if needed_for is None:
            return None  # an unreadable tokenizer only costs the decoded text
        raise InputError(model_dir, f"{needed_for} needs the model's tokenizer in the model folder ({e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
