"""The Hugging Face libraries (transformers, PEFT, datasets) kept off our output: their logs below errors, their
progress bars and their Python warnings, for the length of a block. The libraries are imported inside it, never at
import time: they take seconds to import, and the command line answers a usage error before any of them loads."""

from __future__ import annotations

import contextlib
import os
import warnings


@contextlib.contextmanager
def quiet_libraries(datasets: bool = False):
    """Inside the block: transformers' logs below errors and its (and huggingface_hub's) progress bars off, Python
    warnings ignored (PEFT's advice comes as warnings); with `datasets`, the datasets library too, offline, and
    yielded (else None). Everything is as it was after the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (first: importing the libraries warns too)
        with _transformers_quiet(), (_datasets_quiet() if datasets else contextlib.nullcontext()) as module:
            yield module


@contextlib.contextmanager
def _transformers_quiet():
    from transformers.utils import logging as hf_logging

    verbosity, bars_on = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _datasets_quiet():
    """`datasets` offline (HF_DATASETS_OFFLINE=1 for the block: data is never downloaded), without its progress bars
    and logs; yields the module. The user's setting is back afterwards."""
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
