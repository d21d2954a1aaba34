"""The `lora-eval` command line (Click). Bad input exits 2 with one line naming the file and the key."""

from __future__ import annotations

import os
import sys

import click

from .errors import InputError


def parse_named_paths(values: tuple[str, ...], option: str) -> dict[str, str]:
    """NAME=DIR pairs -> {name: dir}; a malformed or repeated pair is a usage error."""
    named = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=PATH, got '{value}'", param_hint=option)
        if name in named:
            raise click.BadParameter(f"adapter name '{name}' given twice", param_hint=option)
        named[name] = path
    return named


def graph_options(command):
    """--no-cuda-graphs, --graph-buckets, --max-graph-memory (runners/graphs.py) for commands that run the engine."""
    command = click.option("--max-graph-memory", default=None, type=click.FloatRange(min=0), metavar="GB",
                           help="Stop capturing new graphs once their memory pool reaches this (default: no limit)."
                           )(command)
    command = click.option("--graph-buckets", default=32, type=click.IntRange(min=0), show_default=True,
                           help="At most this many captured CUDA graphs (shape bucket x LoRA/plain); batches past "
                           "it, or beyond the largest bucket, run eagerly.")(command)
    return click.option("--no-cuda-graphs", is_flag=True,
                        help="Run every batch eagerly on the GPU (the CPU never uses graphs).")(command)


def graph_settings(no_cuda_graphs: bool, graph_buckets: int, max_graph_memory: float | None) -> dict:
    """`cuda_graphs` and `graph_plan` arguments (Engine.load) for the graph options."""
    from .runners.graphs import BucketPlan

    plan = BucketPlan(max_buckets=graph_buckets,
                      max_memory=None if max_graph_memory is None else int(max_graph_memory * 2**30))
    return dict(cuda_graphs=not no_cuda_graphs, graph_plan=plan)


# the row order of fused 3D gate_up LoRA B, where the adapter files do not fix it (lora_eval/adapters/load.py)
GATE_UP_LAYOUT = click.option(
    "--gate-up-layout", type=click.Choice(["interleaved", "concatenated"]), default=None,
    help="Row order of a fused 3D gate_up LoRA: gate/up alternating, or all gate rows then all up rows "
         "(needed for such adapters on GPT-OSS; PEFT target_parameters adapters are detected).")


class Main(click.Group):
    """Turns InputError into one line on stderr and exit code 2, and any other failure into one line and exit code
    3 (never 1, which means "a threshold was crossed"); LORA_EVAL_DEBUG=1 shows the traceback instead."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - a failure we do not check for yet: say so in one line
            if os.environ.get("LORA_EVAL_DEBUG"):
                raise
            click.echo(f"error: unexpected {type(e).__name__}: {e} (a lora-eval bug or an input it does not check; "
                       "LORA_EVAL_DEBUG=1 shows the traceback)", err=True)
            sys.exit(3)


@click.group(cls=Main)
@click.version_option(package_name="lora-eval")
def cli():
    """Evaluate LoRA adapters on Mixture-of-Experts models against trainer references."""


@cli.command()
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Local Hugging Face checkpoint folder.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR", help="A PEFT adapter folder (repeatable).")
@GATE_UP_LAYOUT
def inspect(model_dir, adapters, gate_up_layout):
    """Show each adapter's layout, targets per module kind, ranks, scalings and parameter counts."""
    import pandas as pd

    from .inspection import inspect_adapters

    summary, table = inspect_adapters(model_dir, parse_named_paths(adapters, "--adapter"), gate_up_layout)
    moe = f", {summary['experts']} experts top-{summary['top_k']} in {summary['sparse_layers']} layers" \
        if summary["experts"] else ""
    click.echo(f"model: {summary['model_type']}, {summary['layers']} layers, hidden {summary['hidden']}{moe}, "
               f"vocab {summary['vocab']}")
    for name, group in table.groupby("adapter", sort=False):
        click.echo(f"\nadapter {name}: layout {group['layout'].iloc[0]}, "
                   f"{int(group['params'].sum()):,} parameters")
        with pd.option_context("display.width", 200, "display.max_rows", 500):
            click.echo(group.drop(columns=["adapter", "layout"]).to_string(index=False))


def parse_references(values: tuple[str, ...]) -> list:
    """FILE or NAME=FILE (NAME: whose logprobs a .pt dump holds; 'base' for the base model)."""
    from pathlib import Path

    refs = []
    for value in values:
        name, sep, path = value.partition("=")
        refs.append((name, path) if sep and name and path and not Path(value).exists() else value)
    return refs


DTYPE = click.Choice(["float32", "bfloat16", "float16"])


@cli.command(name="dump-reference")
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Local Hugging Face checkpoint folder.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR", help="A PEFT adapter folder (repeatable).")
@click.option("--prompts", required=True, type=click.Path(), help="JSONL: input_ids | text | prompt+response, "
              "optional sample_id, adapter, mask.")
@click.option("--out", required=True, type=click.Path(), help="Reference dump to write (.parquet).")
@click.option("--dtype", default="float32", type=DTYPE, show_default=True)
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]), show_default=True)
@GATE_UP_LAYOUT
@click.option("--quiet", is_flag=True, help="No progress bar.")
def dump_reference_cmd(model_dir, adapters, prompts, out, dtype, device, gate_up_layout, quiet):
    """Trainer-side reference logprobs from transformers + PEFT, in the native Parquet format."""
    from .trainer import dump_reference

    frame = dump_reference(model_dir, parse_named_paths(adapters, "--adapter"), prompts, out, dtype=dtype,
                           device=device, quiet=quiet, gate_up_layout=gate_up_layout)
    click.echo(f"wrote {len(frame)} samples ({sum(len(i) - 1 for i in frame['input_ids'])} logprobs) to {out}")


@cli.command(name="compare")
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Local Hugging Face checkpoint folder.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR", help="A PEFT adapter folder (repeatable).")
@click.option("--reference", "references", multiple=True, required=True, metavar="[NAME=]FILE",
              help="Reference dump (.parquet, .jsonl, or NAME=FILE.pt); repeatable.")
@click.option("--out", required=True, type=click.Path(), help="Run folder for the reports.")
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]), show_default=True)
@click.option("--dtype", default="float32", type=DTYPE, show_default=True)
@click.option("--batch-tokens", default=4096, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per forward batch.")
@click.option("--max-k2", default=5e-3, type=float, show_default=True, help="Fail when k2 exceeds this.")
@click.option("--max-mean-abs-diff", default=None, type=float, help="Fail when mean |d| exceeds this.")
@click.option("--junit", "junit_path", default=None, type=click.Path(dir_okay=False),
              help="Also write JUnit XML here: one testcase per adapter x threshold.")
@GATE_UP_LAYOUT
@graph_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
def compare_cmd(model_dir, adapters, references, out, device, dtype, batch_tokens, max_k2, max_mean_abs_diff,
                junit_path, gate_up_layout, no_cuda_graphs, graph_buckets, max_graph_memory, quiet):
    """Engine logprobs against trainer reference dumps; exit 1 when a threshold is crossed."""
    from .compare import compare

    result = compare(model_dir, parse_named_paths(adapters, "--adapter"), parse_references(references), out=out,
                     device=device, dtype=dtype, batch_tokens=batch_tokens, max_k2=max_k2,
                     max_mean_abs_diff=max_mean_abs_diff, quiet=quiet, gate_up_layout=gate_up_layout,
                     **graph_settings(no_cuda_graphs, graph_buckets, max_graph_memory))
    if junit_path:
        from .junit import compare_junit, write_junit

        write_junit(compare_junit(result.summary, result.run), junit_path)
    _finish(result, out)


@cli.command(name="mmlu")
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Local Hugging Face checkpoint folder "
              "(with its tokenizer).")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR", help="A PEFT adapter folder (repeatable).")
@click.option("--data", required=True, type=click.Path(), help="MMLU folder: dev/ val/ test/ CSVs (the original "
              "release), cais/mmlu parquet files, or a folder saved by datasets.")
@click.option("--out", required=True, type=click.Path(), help="Run folder for the tables and reports.")
@click.option("--split", default="test", type=click.Choice(["test", "val"]), show_default=True)
@click.option("--shots", default=5, type=click.IntRange(min=0), show_default=True, help="Dev examples per prompt.")
@click.option("--subjects", default=None, metavar="A,B,...", help="Only these subjects (default: all).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Only the first N questions per subject.")
@click.option("--max-drop", default=None, type=click.FloatRange(min=0), metavar="POINTS",
              help="Exit 1 when an adapter's micro accuracy is more than this many percentage points below base.")
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]), show_default=True)
@click.option("--dtype", default="float32", type=DTYPE, show_default=True)
@click.option("--batch-tokens", default=16384, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per forward batch.")
@click.option("--junit", "junit_path", default=None, type=click.Path(dir_okay=False),
              help="Also write JUnit XML here: one testcase per adapter for --max-drop.")
@GATE_UP_LAYOUT
@graph_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
def mmlu_cmd(model_dir, adapters, data, out, split, shots, subjects, limit, max_drop, device, dtype, batch_tokens,
             junit_path, gate_up_layout, no_cuda_graphs, graph_buckets, max_graph_memory, quiet):
    """MMLU accuracy of the base model and every adapter in one pass; exit 1 when an adapter drops too much."""
    from .mmlu import mmlu, summary_text, verdict

    result = mmlu(model_dir, parse_named_paths(adapters, "--adapter"), data, out=out, split=split, shots=shots,
                  subjects=subjects, limit=limit, max_drop=max_drop, device=device, dtype=dtype,
                  batch_tokens=batch_tokens, quiet=quiet, gate_up_layout=gate_up_layout,
                  **graph_settings(no_cuda_graphs, graph_buckets, max_graph_memory))
    if junit_path:
        from .junit import mmlu_junit, write_junit

        write_junit(mmlu_junit(result.summary, result.run), junit_path)
    click.echo(summary_text(result))
    click.echo(f"\nreport: {out}/report.html (markdown: {out}/mmlu.md)")
    if not result.passed:
        click.echo(verdict(result, max_drop), err=True)
        sys.exit(1)


@cli.command()
@click.option("--out", default="lora-eval-demo", type=click.Path(), show_default=True, help="Folder to build in.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def demo(out, quiet):
    """Build a tiny MoE model, two adapters and a trainer reference, then run compare on them."""
    from .demo import run_demo

    click.echo(f"building a tiny Qwen3-MoE model, two adapters and a reference dump in {out}/ ...")
    result = run_demo(out, quiet=quiet)
    _finish(result, f"{out}/report")


@cli.command()
@click.argument("run_dir", type=click.Path())
@click.option("--format", "fmt", default="html", type=click.Choice(["html", "md"]), show_default=True)
@click.option("--out", "out_path", default="-", type=click.Path(dir_okay=False, allow_dash=True),
              help="File to write; default: standard output.")
def report(run_dir, fmt, out_path):
    """Re-render a run folder's report (compare or mmlu) from its saved files, without recomputing."""
    from pathlib import Path

    from .html_report import render

    data = render(run_dir, fmt).encode("utf-8")
    if out_path == "-":
        click.echo(data, nl=False)  # bytes go to the binary stdout unchanged
    else:
        if not Path(out_path).parent.is_dir():
            raise InputError("--out", f"folder {Path(out_path).parent} does not exist")
        Path(out_path).write_bytes(data)


@cli.command(name="bench")
@click.option("--config", "config_path", required=True, type=click.Path(),
              help="A published config.json (e.g. benchmarks/configs/Qwen3-30B-A3B.json); weights are random.")
@click.option("--layers", default=None, type=click.IntRange(min=1), help="Keep only the first N decoder layers.")
@click.option("--adapters", default=4, type=click.IntRange(min=1), show_default=True)
@click.option("--rank", default=16, type=click.IntRange(min=1), show_default=True)
@click.option("--targets", default="all", type=click.Choice(["all", "attn", "experts"]), show_default=True,
              help="all: PEFT all-linear (attention, router, experts); attn: q/k/v/o; experts: experts and router.")
@click.option("--batch", "batches", multiple=True, default=("4x1024",), show_default=True, metavar="ROWSxTOKENS",
              help="Batch shape (repeatable: one model build serves every shape).")
@click.option("--dtype", default="bfloat16", type=DTYPE, show_default=True)
@click.option("--device", default="cuda", type=click.Choice(["cpu", "cuda"]), show_default=True)
@click.option("--repeat", default=5, type=click.IntRange(min=1), show_default=True, help="Timed calls (median).")
@click.option("--warmup", default=2, type=click.IntRange(min=0), show_default=True)
@click.option("--skip-hf", is_flag=True, help="Time our engine only.")
@click.option("--also-eager", is_flag=True, help="Also time our engine with CUDA graphs off (system ours-eager).")
@click.option("--seed", default=0, type=int, show_default=True)
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False), help="Write the table as CSV.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_cmd(config_path, layers, adapters, rank, targets, batches, dtype, device, repeat, warmup, skip_hf,
              also_eager, seed, out_path, quiet):
    """Our engine against transformers + PEFT on a random-weight model of a config's real shape."""
    import pandas as pd
    import torch

    from .bench import bench

    try:
        frame = bench(config_path, layers=layers, adapters=adapters, rank=rank, targets=targets, batches=batches,
                      dtype=dtype, device=device, repeat=repeat, warmup=warmup, skip_hf=skip_hf,
                      also_eager=also_eager, seed=seed, quiet=quiet)
    except torch.OutOfMemoryError as e:
        click.echo(f"error: out of device memory building the model or adapters ({str(e).splitlines()[0][:120]}); "
                   "try fewer --layers or --adapters", err=True)
        sys.exit(1)
    first = frame.iloc[0]
    click.echo(f"{first['model']}: {first['layers']} layers, {adapters} adapters of rank {rank} ({targets}), "
               f"{dtype} on {first['device_name']}; torch {first['torch']}, transformers {first['transformers']} "
               f"(experts {first['hf_experts']}, attention {first['hf_attention']}), peft {first['peft']}")
    shown = ["system", "batch", "case", "passes", "ms_per_batch", "tokens_per_s", "tflops", "peak_mem_gb",
             "cost_vs_base", "vs_hf", "max_abs_diff", "status"]
    with pd.option_context("display.width", 200, "display.max_rows", 200, "display.float_format", "{:.4g}".format):
        click.echo(frame[shown].to_string(index=False))
    for note in dict.fromkeys(n for n in frame["note"] if n):
        click.echo(f"note: {note}")
    if out_path:
        frame.to_csv(out_path, index=False)
        click.echo(f"wrote {out_path}")


def _finish(result, out):
    from .report import summary_table

    click.echo(summary_table(result.summary))
    click.echo(f"\nreport: {out}/report.html (markdown: {out}/report.md)")
    if not result.passed:
        failed = [f"{r.adapter} ({r.failed})" for r in result.summary.itertuples() if not r.passed]
        click.echo("FAILED: " + "; ".join(failed), err=True)
        sys.exit(1)


def main():
    cli(prog_name="lora-eval")
