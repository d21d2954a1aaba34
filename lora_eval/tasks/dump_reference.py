"""The trainer side: reference logprobs computed with transformers + PEFT (never our engine).

Adapters PEFT can load run through PEFT. Expert layouts PEFT cannot load into transformers' fused experts
(per-expert 2D, fused or shared-outer 3D exports) are applied the way a trainer merges them: each delta
s * B @ A added into a copy of the transformers weights, which transformers then runs.

Prompts come as JSONL (prompts.py). Each prompt is one unit of work of a run folder: a killed dump resumes, and
torchrun ranks share the prompts (distributed.py). On the CPU the thread count is part of the fingerprint
(EngineOptions.record).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open

from ..adapters import load_adapter
from ..engine.engine import DTYPES, EngineOptions, first_non_finite, overflow_error
from ..errors import InputError
from ..hf import quiet_libraries
from ..inputs.checks import adapter_names, check_lengths, model_config, temperature_option
from ..inputs.prompts import read_prompts
from ..inputs.references import read_reference, reference_bytes
from ..models import check_loaded_weights, load_model
from ..models.layers import interleave_gate_up
from ..results.runfolder import RECORD_KEY, Work, run_inputs
from .run import Hashed, Plan, Run, Task, Units, run_task

# expert layouts today's PEFT itself loads into transformers v5 models as their writer meant them (older PEFT
# versions' swapped and Unsloth's or Megatron-Bridge's expert-slowest layouts are merged from our factors instead)
PEFT_LAYOUTS = {"PEFT target_parameters"}
VL_ADAPTER_PREFIX = "base_model.model.model.language_model."  # keys of an adapter trained on a vision-language model


def dump_reference(model_dir: str | Path, adapters: dict[str, str | Path] | None, prompts: str | Path,
                   out: str | Path | None, *, options: EngineOptions | None = None, quiet: bool = False,
                   overwrite: bool = False, default_adapter: str | None = None, temperature: float = 1.0,
                   notice=print) -> pd.DataFrame:
    """Reference logprobs of every prompt under its adapter, from transformers + PEFT, written as one Parquet file
    through the run protocol (tasks/run.py: resumable, never half-written; the fingerprint goes into the file's
    metadata, and an `out` that already holds this very dump is returned as it is). `options`: device, dtype and
    gate_up_layout (the row order of fused 3D gate_up LoRA, adapters/load.py). `default_adapter`: for prompts
    without an `adapter` field (inputs/prompts.py). `temperature`: the logprobs are log_softmax(logits / T), as a
    trainer scores at its sampling temperature; written into the dump's `temperature` column (T != 1)."""
    task = DumpReferenceTask(model_dir, adapters, prompts, options=options, default_adapter=default_adapter,
                             temperature=temperature)
    return run_task(task, out, overwrite=overwrite, quiet=quiet, notice=notice)


@dataclass
class DumpReferenceTask(Task):
    """dump-reference through the run protocol, with the arguments of `dump_reference`. Units: one prompt each, run
    adapter by adapter (a model is loaded once, each adapter applied to it in turn)."""

    command = "dump-reference"
    single_file = True
    model_dir: str | Path
    adapters: dict | None
    prompts: str | Path
    options: EngineOptions | None
    default_adapter: str | None
    temperature: float = 1.0

    def check(self, run: Run) -> dict:
        self.options = (self.options or EngineOptions()).resolved()
        self.adapters = adapter_names(self.adapters)
        if self.temperature is None:
            raise InputError("--temperature", "expected a finite number above 0, found None")
        self.temperature = temperature_option(self.temperature)
        run.arguments = dict(model=str(self.model_dir), adapters={k: str(v) for k, v in self.adapters.items()},
                             prompts=str(self.prompts), default_adapter=self.default_adapter,
                             temperature=self.temperature)
        return run_inputs(self.model_dir, self.adapters, prompts=self.prompts)

    def check_out(self, out: Path | None) -> None:
        if out is not None and out.suffix.lower() != ".parquet":  # (read back by its suffix: inputs/references.py)
            raise InputError("--out", f"{out}: dump-reference writes the native Parquet format; name the file .parquet")

    def plan(self, run: Run) -> Plan:
        """The prompts and adapters checked before any folder is made or model loaded."""
        _, args = model_config(self.model_dir)
        self.notes = []  # (said once the inputs are checked: an input error stays the only line)
        self.frame = read_prompts(self.prompts, self.model_dir, self.adapters, args.vocab_size, self.default_adapter,
                                  self.notes.append)
        check_lengths(self.frame["input_ids"].map(len), self.frame["sample_id"], args.max_position_embeddings,
                      self.prompts)
        shapes = load_model(self.model_dir, device="meta")  # our module map, to read adapter layouts (no weights)
        self.parsed = {name: load_adapter(path, name, shapes, self.options.gate_up_layout)
                       for name, path in self.adapters.items()}
        record = self.options.record()
        task_options = dict(device=record["device"], device_name=record["device_name"], dtype=self.options.dtype,
                            gate_up_layout=self.options.gate_up_layout, default_adapter=self.default_adapter,
                            threads=record["threads"])
        if self.temperature != 1:  # (only when set: an older dump's fingerprint predates the option)
            task_options["temperature"] = self.temperature
        return Plan(task_options)

    def hashed(self) -> list[Hashed]:
        return [Hashed(self.model_dir, self.adapters, {f"prompts/{Path(self.prompts).name}": self.prompts})]

    def read(self, out: Path) -> pd.DataFrame:
        return read_reference(out)

    def load(self, run: Run) -> Units:
        """The model loads with the first prompt left to run (none, when every prompt is done)."""
        for note in self.notes:
            run.notice(note)
        return Units([1] * len(self.frame), "sample", phase=None)

    def run(self, work: Work, run: Run) -> None:
        """Each prompt's logprobs from transformers (+ PEFT or merged deltas), one sample per unit of work."""
        from peft import PeftModel

        frame, options, model, loaded_as = self.frame, self.options, None, None
        with quiet_libraries():
            for name in [None] + sorted(self.adapters):
                rows = frame.index[frame["adapter"].isna()] if name is None else frame.index[frame["adapter"] == name]
                todo = work.pending(int(i) for i in rows)
                if not todo:
                    continue
                wanted = loaded_as if name is None and model is not None else self._model_class(name)
                if model is None or wanted != loaded_as:
                    model, loaded_as = None, wanted
                    model = wanted.from_pretrained(str(self.model_dir), dtype=DTYPES[options.dtype])
                    model = model.to(options.device).eval()
                    check_loaded_weights(self.model_dir, dict(model.named_parameters()))  # NaN / inf by file and key
                runner = self._runner(model, name)
                for i in todo:
                    lp = _sequence_logprobs(runner, frame.at[i, "input_ids"], options.device, self.temperature)
                    if first_non_finite([lp]) is not None:  # (else the written file's check would blame the output)
                        raise overflow_error(self.model_dir, self.adapters, name, f"prompt {frame.at[i, 'sample_id']}",
                                             options.dtype, computed_by="transformers")
                    work.record(i, pd.DataFrame(dict(logprobs=[np.asarray(lp, dtype=np.float32)])))
                if isinstance(runner, PeftModel):
                    model = runner.unload()  # back to the plain base model for the next adapter

    def _model_class(self, name: str | None):
        """transformers' class for adapter `name`'s rows: the vision-language model where the adapter was trained on
        it (its keys under `model.language_model.`, e.g. Qwen3.5's) and AutoModelForCausalLM builds the text model
        alone, whose module paths PEFT would not match (it loads none of those keys, silently); else
        AutoModelForCausalLM."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        adapter = None if name is None else self.parsed[name]
        wfile = None if adapter is None else adapter.weights_file
        if wfile is None or wfile.suffix != ".safetensors" or not adapter.layouts <= PEFT_LAYOUTS:
            return AutoModelForCausalLM
        with safe_open(str(wfile), framework="pt") as f:
            vl = any(key.startswith(VL_ADAPTER_PREFIX) for key in f.keys())
        return AutoModelForImageTextToText if vl else AutoModelForCausalLM

    def _runner(self, model, name: str | None):
        """The base `model`, or it under adapter `name`: through PEFT where PEFT loads the layout, else merged."""
        from peft import PeftModel

        adapter = None if name is None else self.parsed[name]
        if adapter is None:
            return model
        if adapter.layouts <= PEFT_LAYOUTS:
            return PeftModel.from_pretrained(model, str(self.adapters[name])).eval()
        return merged_copy(model, adapter)

    def merge(self, frames: dict[int, pd.DataFrame], run: Run) -> pd.DataFrame:
        self.frame["logprobs"] = [frames[i]["logprobs"].iloc[0].tolist() for i in range(len(self.frame))]
        self.frame["temperature"] = None if self.temperature == 1 else self.temperature
        self.out, self.fingerprint, self.arguments = run.folder.out, run.folder.fingerprint, run.arguments
        return self.frame

    def files(self, frame: pd.DataFrame) -> bytes:
        meta = json.dumps(dict(command="dump-reference", arguments=self.arguments, fingerprint=self.fingerprint))
        return reference_bytes(frame, self.out, {RECORD_KEY: meta.encode()})


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
    for site, (ids, rows) in adapter.token_rows.items():  # trainable tokens: their rows replaced
        weight = merged.get_submodule(site).weight
        weight[ids] = rows.to(weight)
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
def _sequence_logprobs(model, ids: list[int], device, temperature: float = 1.0) -> torch.Tensor:
    input_ids = torch.tensor([ids], device=device)
    logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float() / temperature  # [L-1, V]
    return torch.log_softmax(logits, dim=-1).gather(1, input_ids[0, 1:, None]).squeeze(1).cpu()  # [L-1]
