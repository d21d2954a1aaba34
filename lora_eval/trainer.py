"""The trainer side: reference logprobs computed with transformers + PEFT (never our engine).

Adapters PEFT can load run through PEFT. Expert layouts PEFT cannot load into transformers' fused experts
(per-expert 2D, fused or shared-outer 3D exports) are applied the way a trainer merges them: each delta
s * B @ A added into a copy of the transformers weights, which transformers then runs.

Prompts come as JSONL, one object per sample: `input_ids` (a list of token ids), or `text`, or `prompt` and
`response` (tokenised with the model's tokenizer; the mask then covers the response tokens only); optional
`sample_id`, `adapter` (null = base model) and `mask` (len(input_ids) - 1 booleans).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

import pandas as pd
import torch

from .adapters import load_adapter
from .checkpoint import read_jsonl
from .engine import DTYPES
from .errors import InputError
from .progress import progress
from .models import load_model
from .models.layers import interleave_gate_up
from .references import BASE, write_reference

PEFT_LAYOUTS = {"PEFT target_parameters"}  # expert layouts PEFT itself loads into transformers v5 models


def read_prompts(path: str | Path, model_dir: str | Path) -> pd.DataFrame:
    """Prompts as rows of sample_id, adapter, input_ids, mask (tokenising text with the model's tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "prompts file not found")
    tokenizer = None
    rows = []
    for n, item in enumerate(read_jsonl(path), start=1):
        mask = item.get("mask")
        if "input_ids" in item:
            ids = item["input_ids"]
        elif "text" in item or "prompt" in item:
            tokenizer = tokenizer or _tokenizer(model_dir)
            if "text" in item:
                ids = tokenizer(item["text"])["input_ids"]
            else:
                prompt = tokenizer(item["prompt"])["input_ids"]
                response = tokenizer(item.get("response", ""), add_special_tokens=False)["input_ids"]
                ids = prompt + response
                mask = [i + 1 >= len(prompt) for i in range(len(ids) - 1)]
        else:
            raise InputError(path, f"prompt {n}: expected 'input_ids', 'text', or 'prompt' and 'response'")
        rows.append(dict(sample_id=str(item.get("sample_id", n)), adapter=item.get("adapter"), input_ids=ids,
                         mask=mask))
    if not rows:
        raise InputError(path, "no prompts in the file")
    return pd.DataFrame(rows)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(model_dir, f"prompts given as text need a tokenizer in the model folder ({e})") from None


def dump_reference(model_dir: str | Path, adapters: dict[str, str | Path] | None, prompts: str | Path,
                   out: str | Path, *, dtype: str = "float32", device: str = "cpu", quiet: bool = False,
                   gate_up_layout: str | None = None) -> pd.DataFrame:
    """Reference logprobs of every prompt under its adapter, from transformers + PEFT; written as Parquet.
    `gate_up_layout`: the row order of fused 3D gate_up LoRA where the files do not fix it (adapters/load.py)."""
    adapters = dict(adapters or {})
    if dtype not in DTYPES:
        raise InputError("--dtype", f"'{dtype}' is not one of {', '.join(DTYPES)}")
    frame = read_prompts(prompts, model_dir)
    frame["adapter"] = frame["adapter"].where(frame["adapter"] != BASE, None)
    unknown = sorted({a for a in frame["adapter"].dropna() if a not in adapters})
    if unknown:
        raise InputError(prompts, f"names adapter '{unknown[0]}', which was not given; known adapters: "
                         f"{', '.join(sorted(adapters)) or 'none'}", key="adapter")
    with quiet_libraries():
        return _dump_reference(model_dir, adapters, prompts, out, frame, dtype, device, quiet, gate_up_layout)


def _dump_reference(model_dir, adapters, prompts, out, frame, dtype, device, quiet, gate_up_layout) -> pd.DataFrame:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shapes = load_model(model_dir, device="meta")  # our module map, to read adapter layouts (no weights)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).to(device).eval()
    vocab = model.config.vocab_size
    for row in frame.itertuples():
        ids = row.input_ids
        if not isinstance(ids, list) or len(ids) < 2 or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InputError(prompts, f"needs at least 2 token ids, all in [0, {vocab})", key=f"sample {row.sample_id}")
    logprobs: dict[int, list[float]] = {}
    with progress(len(frame), "dump-reference", "sample", quiet) as bar:
        for name in [None] + sorted(adapters):
            rows = frame[frame["adapter"].isna()] if name is None else frame[frame["adapter"] == name]
            if rows.empty:
                continue
            parsed = None if name is None else load_adapter(adapters[name], name, shapes, gate_up_layout)
            if parsed is None:
                runner = model
            elif parsed.layouts <= PEFT_LAYOUTS:
                runner = PeftModel.from_pretrained(model, str(adapters[name])).eval()
            else:
                runner = merged_copy(model, parsed)
            for i, ids in zip(rows.index, rows["input_ids"]):
                logprobs[i] = _sequence_logprobs(runner, ids, device)
                bar.update(1)
            if isinstance(runner, PeftModel):
                model = runner.unload()  # back to the plain base model for the next adapter
    frame["logprobs"] = [logprobs[i] for i in frame.index]
    write_reference(frame, out)
    return frame


@contextlib.contextmanager
def quiet_libraries():
    """transformers' and PEFT's loading bars and advice stay off our output."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


@torch.no_grad()
def merged_copy(model, adapter):
    """A copy of the transformers `model` with every delta of `adapter` merged into its weights."""
    merged = copy.deepcopy(model)
    for site, (A, B) in adapter.dense.items():  # A [r, in], B [out, r] (scaled)
        weight = merged.get_submodule(site).weight
        weight += (B @ A).to(weight)
    for site, (A, B) in adapter.embedding.items():  # A [V, r], B [H, r] (scaled)
        weight = merged.get_submodule(site).weight
        weight += (A @ B.T).to(weight)
    for site, params in adapter.overrides.items():
        for param, value in params.items():
            getattr(merged.get_submodule(site), param).copy_(value)
    for site, factors in adapter.experts.items():
        experts = merged.get_submodule(site)
        for name, part in (("gate_up_proj", factors.gate_up), ("down_proj", factors.down)):
            if part is None:
                continue
            A, B = part  # [Ea, r, in], [Eb, out, r]
            delta = torch.matmul(B, A)  # [E or 1, out, in] broadcast over experts; gate_up rows: gate, then up
            if name == "gate_up_proj" and not getattr(experts, "is_concatenated", True):
                delta = interleave_gate_up(delta, dim=1)  # transformers' own order (GPT-OSS: gate, up alternating)
            if getattr(experts, "is_transposed", False):
                delta = delta.transpose(1, 2)  # [E or 1, in, out] (GPT-OSS)
            weight = getattr(experts, name)
            weight += delta.to(weight)
    return merged.eval()


@torch.inference_mode()
def _sequence_logprobs(model, ids: list[int], device) -> list[float]:
    input_ids = torch.tensor([ids], device=device)
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float()  # [L-1, V]
    lp = torch.log_softmax(logits, dim=-1).gather(1, input_ids[0, 1:, None]).squeeze(1)  # [L-1]
    return lp.cpu().tolist()
