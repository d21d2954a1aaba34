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


def main():
    cli(prog_name="lora-eval")
