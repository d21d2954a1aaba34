"""The trainer side: reference logprobs computed with transformers + PEFT (never our engine).

Adapters PEFT can load run through PEFT. Expert layouts PEFT cannot load into transformers' fused experts
(per-expert 2D, fused or shared-outer 3D exports) are applied the way a trainer merges them: each delta
s * B @ A added into a copy of the transformers weights, which transformers then runs.

Prompts come as JSONL (prompts.py). Each prompt is one unit of work of a run folder: a killed dump resumes, and
torchrun ranks share the prompts (distributed.py). On the CPU the thread count is part of the fingerprint
(EngineOptions.record).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..adapters import load_adapter
from ..distributed import Ranks, together
from ..engine.engine import DTYPES, EngineOptions, first_non_finite, overflow_error
from ..errors import InputError
from ..inputs.checks import adapter_names, check_lengths, model_config
from ..inputs.prompts import read_prompts
from ..inputs.references import read_reference, reference_bytes
from ..models import check_loaded_weights, load_model
from ..models.layers import interleave_gate_up
from ..results.runfolder import RECORD_KEY, InputDigests, RunFolder, Work, check_out, fingerprint, run_inputs, versions

PEFT_LAYOUTS = {"PEFT target_parameters"}  # expert layouts PEFT itself loads into transformers v5 models


def dump_reference(model_dir: str | Path, adapters: dict[str, str | Path] | None, prompts: str | Path,
                   out: str | Path | None, *, options: EngineOptions | None = None, quiet: bool = False,
                   overwrite: bool = False, default_adapter: str | None = None, notice=print) -> pd.DataFrame:
    """Reference logprobs of every prompt under its adapter, from transformers + PEFT, written as one Parquet file
    through a run folder (runfolder.py: resumable, never half-written; the fingerprint goes into the file's
    metadata, and an `out` that already holds this very dump is returned as it is). `options`: device, dtype and
    gate_up_layout (the row order of fused 3D gate_up LoRA, adapters/load.py). `default_adapter`: for prompts
    without an `adapter` field (prompts.py)."""
    ranks = Ranks.from_env()
    with together(ranks):  # every rank checks the same inputs; one line says what is wrong
        options = (options or EngineOptions()).resolved()
        adapters = adapter_names(adapters)
        out = check_out(out, single_file=True, inputs=run_inputs(model_dir, adapters, prompts=prompts))
        if out is not None and out.suffix.lower() != ".parquet":  # (read back by its suffix: references.py)
            raise InputError("--out", f"{out}: dump-reference writes the native Parquet format; name the file .parquet")
        arguments = dict(model=str(model_dir), adapters={k: str(v) for k, v in adapters.items()},
                         prompts=str(prompts), default_adapter=default_adapter)
    with RunFolder(out, "dump-reference", overwrite=overwrite, single_file=True, notice=notice,
                   ranks=ranks) as folder:  # the lock, first
        with together(ranks):  # the prompts and adapters checked before any folder is made or model loaded
            _, args = model_config(model_dir)
            notes = []  # (said once the inputs are checked: an input error stays the only line)
            frame = read_prompts(prompts, model_dir, adapters, args.vocab_size, default_adapter, notes.append)
            check_lengths(frame["input_ids"].map(len), frame["sample_id"], args.max_position_embeddings, prompts)
            shapes = load_model(model_dir, device="meta")  # our module map, to read adapter layouts (no weights)
            parsed = {name: load_adapter(path, name, shapes, options.gate_up_layout) for name, path in adapters.items()}
            record = options.record()
            task_options = dict(device=record["device"], device_name=record["device_name"], dtype=options.dtype,
                                gate_up_layout=options.gate_up_layout, default_adapter=default_adapter,
                                threads=record["threads"])
            files = InputDigests(model_dir, adapters, {f"prompts/{Path(prompts).name}": prompts}).result()
        folder.open(fingerprint("dump-reference", files, task_options, versions()), dict(arguments=arguments))
        if folder.stored is not None:
            return read_reference(out)
        for note in notes:
            notice(note)
        with quiet_libraries():
            work = _logprobs(model_dir, adapters, parsed, frame, options, folder, quiet)

        def merge(done: dict[int, pd.DataFrame]) -> pd.DataFrame:
            frame["logprobs"] = [done[i]["logprobs"].iloc[0].tolist() for i in range(len(frame))]
            if out is not None:
                meta = json.dumps(dict(command="dump-reference", arguments=arguments, fingerprint=folder.fingerprint))
                folder.commit_file(reference_bytes(frame, out, {RECORD_KEY: meta.encode()}))
            return frame

        return folder.finish(work, merge, lambda: read_reference(out))


def _logprobs(model_dir, adapters: dict, parsed: dict, frame: pd.DataFrame, options: EngineOptions,
              folder: RunFolder, quiet: bool) -> Work:
    """Each prompt's logprobs from transformers (+ PEFT or merged deltas), one sample per unit of work."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = None
    with folder.work([1] * len(frame), "dump-reference", "sample", quiet) as work:
        for name in [None] + sorted(adapters):
            rows = frame.index[frame["adapter"].isna()] if name is None else frame.index[frame["adapter"] == name]
            todo = work.pending(int(i) for i in rows)
            if not todo:
                continue
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[options.dtype])
                model = model.to(options.device).eval()
                check_loaded_weights(model_dir, dict(model.named_parameters()))  # a NaN / inf named by file and key
            adapter = None if name is None else parsed[name]
            if adapter is None:
                runner = model
            elif adapter.layouts <= PEFT_LAYOUTS:
                runner = PeftModel.from_pretrained(model, str(adapters[name])).eval()
            else:
                runner = merged_copy(model, adapter)
            for i in todo:
                lp = _sequence_logprobs(runner, frame.at[i, "input_ids"], options.device)
                if first_non_finite([lp]) is not None:  # (else the written file's check would blame the output)
                    raise overflow_error(model_dir, adapters, name, f"prompt {frame.at[i, 'sample_id']}",
                                         options.dtype, computed_by="transformers")
                work.record(i, pd.DataFrame(dict(logprobs=[np.asarray(lp, dtype=np.float32)])))
            if isinstance(runner, PeftModel):
                model = runner.unload()  # back to the plain base model for the next adapter
    return work


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
def _sequence_logprobs(model, ids: list[int], device) -> torch.Tensor:
    input_ids = torch.tensor([ids], device=device)
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float()  # [L-1, V]
    return torch.log_softmax(logits, dim=-1).gather(1, input_ids[0, 1:, None]).squeeze(1).cpu()  # [L-1]
