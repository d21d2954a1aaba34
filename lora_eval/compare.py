"""`compare`: the engine's logprobs against trainer reference dumps, per token, sample, adapter and overall.

A thin layer over `Engine.logprobs`: read and check the references, batch them by length under a token
budget (adapters mixed in a batch), run, and turn the differences into the metrics of `metrics.py`.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .batching import make_batches, padding_waste
from .engine import Batch, Engine
from .runners.graphs import BucketPlan
from .errors import InputError
from .html_report import load_tokenizer, worst_tokens
from .metrics import check_thresholds, group_metrics
from .progress import progress
from .references import BASE, read_reference

OVERALL = "overall"
SUMMARY_COLUMNS = ["adapter", "n_samples", "n_tokens", "mean_abs_diff", "max_abs_diff", "k1", "k2", "k3",
                   "mult_prob_error", "passed"]


@dataclass
class CompareResult:
    summary: pd.DataFrame  # one row per adapter ('base' for the base model) plus 'overall'
    samples: pd.DataFrame  # one row per sample
    tokens: pd.DataFrame  # one row per predicted token
    run: dict = field(default_factory=dict)  # arguments, versions, timings, file hashes
    worst: pd.DataFrame = field(default_factory=pd.DataFrame)  # worst tokens per adapter, decoded with context

    @property
    def passed(self) -> bool:
        return bool(self.summary["passed"].all())


def compare(model: str | Path, adapters: dict[str, str | Path] | None = None,
            references: list | tuple = (), *, out: str | Path | None = None, device: str = "cpu",
            dtype: str = "float32", batch_tokens: int = 4096, max_k2: float | None = 5e-3,
            max_mean_abs_diff: float | None = None, quiet: bool = False,
            gate_up_layout: str | None = None, cuda_graphs: bool = True,
            graph_plan: BucketPlan | None = None) -> CompareResult:
    """Run the engine on every reference sample under the adapter it names; return (and, with `out`, write)
    the summary, per-sample and per-token tables. `references` holds paths or (adapter name, path) pairs.
    `gate_up_layout`: the row order of fused 3D gate_up LoRA where the files do not fix it (adapters/load.py).
    `cuda_graphs`, `graph_plan`: CUDA graphs on a GPU, as for `Engine.load` (runners/graphs.py)."""
    adapters = dict(adapters or {})
    arguments = dict(model=str(model), adapters={k: str(v) for k, v in adapters.items()},
                     references=[_ref_arg(r) for r in references], device=device, dtype=dtype,
                     batch_tokens=batch_tokens, max_k2=max_k2, max_mean_abs_diff=max_mean_abs_diff,
                     gate_up_layout=gate_up_layout)
    for name in adapters:
        if name in (BASE, OVERALL):
            raise InputError("--adapter", f"'{name}' is reserved for reports; choose another adapter name")
    if not references:
        raise InputError("--reference", "at least one reference dump is needed")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise InputError("--out", f"{out} exists and is not a folder")
    if batch_tokens < 1:
        raise InputError("--batch-tokens", f"must be positive, got {batch_tokens}")
    timings = {}
    t0 = time.perf_counter()
    refs = _read_references(references, adapters)
    engine = Engine.load(model, adapters, dtype=dtype, device=device, gate_up_layout=gate_up_layout,
                         cuda_graphs=cuda_graphs, graph_plan=graph_plan)
    vocab = engine.model.args.vocab_size
    for row in refs.itertuples():
        bad = [t for t in row.input_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(row.file, f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})",
                             key=f"sample {row.sample_id}")
    timings["load_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    lengths = [len(ids) for ids in refs["input_ids"]]
    batches = make_batches(lengths, batch_tokens)
    engine_lp: list = [None] * len(refs)
    with progress(sum(lengths), "compare", "tok", quiet) as bar:
        for batch in batches:
            rows = refs.iloc[batch]
            tags = [a if isinstance(a, str) else None for a in rows["adapter"]]
            result = engine.logprobs(Batch(list(rows["input_ids"]), tags))
            for i, lp in zip(batch, result):
                engine_lp[i] = lp.numpy()
            bar.update(sum(lengths[i] for i in batch))
    timings["forward_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokens = _token_table(refs, engine_lp)
    samples = group_metrics(tokens, ["adapter", "sample_id"])
    per_adapter = group_metrics(tokens, ["adapter"])
    overall = group_metrics(tokens, []).assign(adapter=OVERALL)
    summary = check_thresholds(pd.concat([per_adapter, overall], ignore_index=True), max_k2, max_mean_abs_diff)
    summary = summary[SUMMARY_COLUMNS + [c for c in summary.columns if c not in SUMMARY_COLUMNS]]
    tokenizer = load_tokenizer(model)
    worst = worst_tokens(tokens, dict(zip(refs["sample_id"], refs["input_ids"])), tokenizer)
    timings["metrics_s"] = time.perf_counter() - t0
    run = dict(arguments=arguments, versions=_versions(), timings=timings,
               batches=len(batches), padding_waste=padding_waste(lengths, batches),
               tokens_per_s=sum(lengths) / max(timings["forward_s"], 1e-9),
               files=_hashes(model, adapters, references), tokenizer=str(model) if tokenizer else None,
               cuda_graphs=engine.graph_stats())
    result = CompareResult(summary=summary, samples=samples, tokens=tokens, run=run, worst=worst)
    if out is not None:
        write_outputs(result, Path(out))
    return result


def _ref_arg(ref) -> str:
    return f"{ref[0]}={ref[1]}" if isinstance(ref, tuple) else str(ref)


def _read_references(references, adapters: dict) -> pd.DataFrame:
    frames = []
    for ref in references:
        name, path = ref if isinstance(ref, tuple) else (None, ref)
        frame = read_reference(path, adapter=name)
        frame["file"] = str(path)
        unknown = sorted({a for a in frame["adapter"].dropna() if a not in adapters})
        if unknown:
            known = ", ".join(sorted(adapters)) or "none (only the base model)"
            raise InputError(path, f"names adapter '{unknown[0]}', which was not given; known adapters: {known}",
                             key="adapter")
        frames.append(frame)
    refs = pd.concat(frames, ignore_index=True)
    duplicated = refs[refs["sample_id"].duplicated(keep=False)]
    if len(duplicated):
        files = sorted(set(duplicated["file"]))
        raise InputError(", ".join(files), "sample_id appears in more than one reference file",
                         key=f"sample {duplicated['sample_id'].iloc[0]}")
    return refs


def _token_table(refs: pd.DataFrame, engine_lp: list) -> pd.DataFrame:
    """One row per predicted token: adapter, sample_id, position, token_id, ref, engine, d, mask, sampler."""
    parts = []
    for row, lp in zip(refs.itertuples(), engine_lp):
        n = len(lp)
        ref = np.asarray(row.logprobs, dtype=np.float64)
        part = dict(adapter=np.full(n, row.adapter if isinstance(row.adapter, str) else BASE, dtype=object),
                    sample_id=np.full(n, row.sample_id, dtype=object), position=np.arange(n),
                    token_id=np.asarray(row.input_ids[1:]), ref=ref, engine=lp.astype(np.float64),
                    mask=np.asarray(row.mask if row.mask is not None else [True] * n, dtype=bool))
        part["d"] = part["ref"] - part["engine"]
        sampler = row.sampler_logprobs
        part["sampler"] = np.asarray(sampler, dtype=np.float64) if sampler is not None else np.full(n, np.nan)
        part["sampler_d"] = part["ref"] - part["sampler"]
        parts.append(pd.DataFrame(part))
    return pd.concat(parts, ignore_index=True)


def _versions() -> dict:
    import peft
    import torch
    import transformers

    from . import __version__
    return {"lora_eval": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


def _hashes(model, adapters: dict, references) -> dict:
    """sha256 of the reference files, adapter files and model config; sizes of the model's weight files."""
    def sha(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    files = {}
    model = Path(model)
    files[str(model / "config.json")] = sha(model / "config.json")
    for weights in sorted(model.glob("*.safetensors")):
        files[str(weights)] = f"{weights.stat().st_size} bytes"
    for path in adapters.values():
        for f in sorted(Path(path).glob("adapter_*")):
            files[str(f)] = sha(f)
    for ref in references:
        path = Path(ref[1] if isinstance(ref, tuple) else ref)
        files[str(path)] = sha(path)
    return files


def write_outputs(result: CompareResult, out: Path) -> None:
    """summary.csv, samples.csv, tokens.parquet, worst_tokens.parquet, report.md, report.html and run.json
    under `out`."""
    from .html_report import compare_html
    from .report import markdown_report

    out.mkdir(parents=True, exist_ok=True)
    result.summary.to_csv(out / "summary.csv", index=False)
    result.samples.to_csv(out / "samples.csv", index=False)
    result.tokens.to_parquet(out / "tokens.parquet", index=False)
    result.worst.to_parquet(out / "worst_tokens.parquet", index=False)
    (out / "report.md").write_text(markdown_report(result), encoding="utf-8")
    (out / "report.html").write_text(compare_html(result), encoding="utf-8")
    (out / "run.json").write_text(json.dumps(result.run, indent=2, default=str) + "\n")
