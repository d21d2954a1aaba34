"""The `lora-eval` command line (Click). Bad input exits 2 with one line naming the file and the key."""

from __future__ import annotations

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


class Main(click.Group):
    """Turns InputError into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=Main)
@click.version_option(package_name="lora-eval")
def cli():
    """Evaluate LoRA adapters on Mixture-of-Experts models against trainer references."""


@cli.command()
@click.option("--model", "model_dir", required=True, type=click.Path(), help="Local Hugging Face checkpoint folder.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR", help="A PEFT adapter folder (repeatable).")
def inspect(model_dir, adapters):
    """Show each adapter's layout, targets per module kind, ranks, scalings and parameter counts."""
    import pandas as pd

    from .inspection import inspect_adapters

    summary, table = inspect_adapters(model_dir, parse_named_paths(adapters, "--adapter"))
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
@click.option("--device", default="cpu", show_default=True)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def dump_reference_cmd(model_dir, adapters, prompts, out, dtype, device, quiet):
    """Trainer-side reference logprobs from transformers + PEFT, in the native Parquet format."""
    from .trainer import dump_reference

    frame = dump_reference(model_dir, parse_named_paths(adapters, "--adapter"), prompts, out, dtype=dtype,
                           device=device, quiet=quiet)
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
@click.option("--quiet", is_flag=True, help="No progress bar.")
def compare_cmd(model_dir, adapters, references, out, device, dtype, batch_tokens, max_k2, max_mean_abs_diff, quiet):
    """Engine logprobs against trainer reference dumps; exit 1 when a threshold is crossed."""
    from .compare import compare

    result = compare(model_dir, parse_named_paths(adapters, "--adapter"), parse_references(references), out=out,
                     device=device, dtype=dtype, batch_tokens=batch_tokens, max_k2=max_k2,
                     max_mean_abs_diff=max_mean_abs_diff, quiet=quiet)
    _finish(result, out)


@cli.command()
@click.option("--out", default="lora-eval-demo", type=click.Path(), show_default=True, help="Folder to build in.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def demo(out, quiet):
    """Build a tiny MoE model, two adapters and a trainer reference, then run compare on them."""
    from .demo import run_demo

    click.echo(f"building a tiny Qwen3-MoE model, two adapters and a reference dump in {out}/ ...")
    result = run_demo(out, quiet=quiet)
    _finish(result, f"{out}/report")


def _finish(result, out):
    from .report import summary_table

    click.echo(summary_table(result.summary))
    click.echo(f"\nreport: {out}/report.md")
    if not result.passed:
        failed = [f"{r.adapter} ({r.failed})" for r in result.summary.itertuples() if not r.passed]
        click.echo("FAILED: " + "; ".join(failed), err=True)
        sys.exit(1)


def main():
    cli(prog_name="lora-eval")
