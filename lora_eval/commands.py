"""What each `lora-eval` command does once its arguments are parsed (cli.py holds the grammar and imports this module
only then): call the task, print its summary, write JUnit, end with the result's exit code."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import click
import pandas as pd
import torch

from .distributed import Ranks, together
from .engine.engine import EngineOptions
from .engine.plan import plan, plan_text
from .errors import EXIT_INTERNAL, EXIT_PASS, EXIT_THRESHOLD
from .launch import launch
from .render.diagnose import diagnose_summary
from .render.files import phase_times, render, summary_text, verdict
from .render.junit import compare_junit, mmlu_junit
from .results.runfolder import atomic_write, check_out, check_replaceable, run_inputs
from .results.tables import CompareResult
from .tasks.bench import NOTE_SEPARATOR, bench
from .tasks.compare import compare
from .tasks.demo import claim_folder, run_demo
from .tasks.diagnose.task import diagnose
from .tasks.dump_reference import dump_reference
from .tasks.inspect_adapters import inspect_adapters
from .tasks.inspect_reference import describe_lines, describe_reference
from .tasks.mmlu.task import mmlu


def speaks() -> bool:
    """Whether this process talks: always, but for the ranks other than 0 of a multi-process job (distributed.py)."""
    return os.environ.get("RANK", "0") == "0"


def notice(text: str) -> None:
    """What a run says on the side (resuming, a lock taken over, a default applied): one line on stderr."""
    if speaks():
        click.echo(text, err=True)


def engine_options(device, dtype, gate_up_layout, no_cuda_graphs=False, graph_buckets=32, max_graph_memory=None,
                   expert_parallel=False, batch_invariant=False, no_prefix_cache=False) -> EngineOptions:
    memory = None if max_graph_memory is None else int(max_graph_memory * 2**30)
    return EngineOptions(device=device, dtype=dtype, gate_up_layout=gate_up_layout, cuda_graphs=not no_cuda_graphs,
                         graph_buckets=graph_buckets, max_graph_memory=memory, expert_parallel=expert_parallel,
                         batch_invariant=batch_invariant, prefix_cache=not no_prefix_cache)


def inspect_command(model_dir, adapters, gate_up_layout, reference=None, temperature=None):
    if reference is not None:
        click.echo("\n".join(describe_lines(describe_reference(reference, temperature))))
    if model_dir is not None:
        inspect_model(model_dir, adapters, gate_up_layout)


def inspect_model(model_dir, adapters, gate_up_layout):
    summary, table = inspect_adapters(model_dir, adapters, gate_up_layout)
    moe = f", {summary['experts']} experts top-{summary['top_k']} in {summary['sparse_layers']} layers" \
        if summary["experts"] else ""
    quantized = f"; {summary['quantization']}" if summary["quantization"] else ""
    linear = summary["linear_attention_layers"]
    layers = f"{summary['layers']} layers ({linear} Gated DeltaNet)" if linear else f"{summary['layers']} layers"
    click.echo(f"model: {summary['model_type']}, {layers}, hidden {summary['hidden']}{moe}, "
               f"vocab {summary['vocab']}{quantized}")
    for name, group in table.groupby("adapter", sort=False):
        click.echo(f"\nadapter {name}: layout {group['layout'].iloc[0]}, "
                   f"{int(group['params'].sum()):,} parameters")
        writer, *decisions = group["writer"].iloc[0].split("\n")
        click.echo(f"writer: {writer}" + "".join(f"\n  read: {d}" for d in decisions))
        with pd.option_context("display.width", 200, "display.max_rows", 500):
            click.echo(group.drop(columns=["adapter", "layout", "writer"]).to_string(index=False))


def dump_reference_command(model_dir, adapters, prompts, out, default_adapter, temperature, device, dtype,
                           gate_up_layout, overwrite, quiet):
    frame = dump_reference(model_dir, adapters, prompts, out, options=engine_options(device, dtype, gate_up_layout),
                           quiet=quiet, overwrite=overwrite, default_adapter=default_adapter, temperature=temperature,
                           notice=notice)
    if speaks():
        click.echo(f"{out}: {len(frame)} samples ({sum(len(i) - 1 for i in frame['input_ids'])} logprobs)")


def compare_command(model_dir, adapters, references, out, batch_tokens, max_k2, max_mean_abs_diff, max_k2_over_floor,
                    max_routing_flip_rate, temperature, no_adapter_check, junit_path, overwrite, quiet, **engine):
    with together(Ranks.from_env()):  # every rank checks it, one line says what is wrong (distributed.py)
        check_replaceable(check_out(junit_path, "--junit", single_file=True,
                                   inputs=run_inputs(model_dir, adapters, reference=references), run=out), "--junit")
    result = compare(model_dir, adapters, references, out=out, options=engine_options(**engine),
                     batch_tokens=batch_tokens, max_k2=max_k2, max_mean_abs_diff=max_mean_abs_diff,
                     max_k2_over_floor=max_k2_over_floor, max_routing_flip_rate=max_routing_flip_rate,
                     temperature=temperature, check_adapters=not no_adapter_check, quiet=quiet,
                     overwrite=overwrite, notice=notice)
    finish(result, out, junit_path)


def mmlu_command(model_dir, adapters, data, out, split, shots, subjects, limit, max_drop, batch_tokens, junit_path,
                 overwrite, quiet, **engine):
    with together(Ranks.from_env()):  # every rank checks it, one line says what is wrong (distributed.py)
        check_replaceable(check_out(junit_path, "--junit", single_file=True,
                                   inputs=run_inputs(model_dir, adapters, data=data), run=out), "--junit")
    result = mmlu(model_dir, adapters, data, out=out, split=split, shots=shots, subjects=subjects, limit=limit,
                  max_drop=max_drop, options=engine_options(**engine), batch_tokens=batch_tokens, quiet=quiet,
                  overwrite=overwrite, notice=notice)
    finish(result, out, junit_path)


def demo_command(out, quiet):
    claim_folder(Path(out))
    click.echo(f"building a tiny Qwen3-MoE model, two adapters and a reference dump in {out}/ ...")
    finish(run_demo(out, quiet=quiet, notice=notice), f"{out}/report", None)


def report_command(run_dir, fmt, out_path):
    if out_path != "-":
        check_replaceable(check_out(out_path, "--out", single_file=True, inputs={"RUN_DIR": run_dir}), "--out")
    data = render(run_dir, fmt).encode("utf-8")
    if out_path == "-":
        click.echo(data, nl=False)  # bytes go to the binary stdout unchanged
    else:
        atomic_write(Path(out_path), data)


def plan_command(model_dir, adapters, gpus, batch_tokens, dtype, gpu_memory):
    counts, rows = plan(model_dir, adapters, gpus=gpus, batch_tokens=batch_tokens, dtype=dtype,
                        gpu_memory_gb=gpu_memory)
    click.echo(plan_text(counts, rows))
    sys.exit(EXIT_PASS if rows["fits"].any() else EXIT_THRESHOLD)


def bench_command(config_path, layers, adapters, rank, targets, batches, dtype, device, repeat, warmup, skip_hf,
                  also_eager, also_invariant, seed, out_path, quiet):
    check_replaceable(check_out(out_path, "--out", single_file=True, inputs={"--config": config_path}), "--out")
    options = EngineOptions(device=device, dtype=dtype).resolved()
    try:
        frame = bench(config_path, layers=layers, adapters=adapters, rank=rank, targets=targets, batches=batches,
                      dtype=options.dtype, device=options.device, repeat=repeat, warmup=warmup, skip_hf=skip_hf,
                      also_eager=also_eager, also_invariant=also_invariant, seed=seed, quiet=quiet)
    except torch.OutOfMemoryError as e:
        click.echo(f"error: out of device memory building the model or adapters ({str(e).splitlines()[0][:120]}); "
                   "try fewer --layers or --adapters", err=True)
        sys.exit(EXIT_INTERNAL)
    first = frame.iloc[0]
    click.echo(f"{first['model']}: {first['layers']} layers, {adapters} adapters of rank {rank} ({targets}), "
               f"{options.dtype} on {first['device_name']}; torch {first['torch']}, transformers "
               f"{first['transformers']} (experts {first['hf_experts']}, attention {first['hf_attention']}), "
               f"peft {first['peft']}")
    shown = ["system", "batch", "case", "passes", "ms_per_batch", "tokens_per_s", "tflops", "peak_mem_gb",
             "cost_vs_base", "vs_hf", "max_abs_diff", "status"]
    with pd.option_context("display.width", 200, "display.max_rows", 200, "display.float_format", "{:.4g}".format):
        click.echo(frame[shown].to_string(index=False))
    for note in dict.fromkeys(part for n in frame["note"] if n for part in n.split(NOTE_SEPARATOR)):
        click.echo(f"note: {note}")
    if out_path:
        atomic_write(Path(out_path), frame.to_csv(index=False).encode("utf-8"))
        click.echo(f"wrote {out_path}")


def diagnose_command(model_dir, adapters, references, out, samples, against_model, against_adapters, against_dtype,
                     layer_by_layer, batch_tokens, temperature, device, dtype, gate_up_layout, batch_invariant,
                     overwrite, quiet):
    result = diagnose(model_dir, adapters, references, out=out,
                      options=engine_options(device, dtype, gate_up_layout, batch_invariant=batch_invariant),
                      samples=samples, against_model=against_model, against_dtype=against_dtype,
                      against_adapters=against_adapters, layer_by_layer=layer_by_layer, batch_tokens=batch_tokens,
                      temperature=temperature, quiet=quiet, overwrite=overwrite, notice=notice)
    if speaks():
        click.echo(diagnose_summary(result))
        click.echo(f"\ntime: {phase_times(result.run)}")
        click.echo(f"report: {out}/diagnose.html (markdown: {out}/diagnose.md)")
    sys.exit(result.exit_code)


def launch_command(command, **where):
    sys.exit(launch(command, **where))


def finish(result, out, junit_path) -> None:
    """The summary, phase times and where the reports are; JUnit XML if asked; the exit code of the result."""
    if not speaks():
        sys.exit(result.exit_code)
    if junit_path:
        xml = compare_junit(result.summary, result.run, result.gates) if isinstance(result, CompareResult) else \
            mmlu_junit(result.summary, result.run)
        atomic_write(Path(junit_path), xml.encode("utf-8"))
    click.echo(summary_text(result))
    click.echo(f"\ntime: {phase_times(result.run)}")
    md = "report.md" if isinstance(result, CompareResult) else "mmlu.md"
    click.echo(f"report: {out}/report.html (markdown: {out}/{md})")
    if not result.passed:
        click.echo(verdict(result), err=True)
    sys.exit(result.exit_code)
