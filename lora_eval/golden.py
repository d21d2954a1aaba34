"""Golden trainer references for the CI regression job, and the regression run itself.

The demo model and adapters (lora_eval/tasks/demo.py, seeded) are rebuilt on the spot; the golden dump in
`references/` holds what transformers + PEFT computed for the demo prompts in float32 (the trainer), with the
same model run in bfloat16 as `sampler_logprobs` (a bf16 sampler: the noise floor the report shows beside
the engine). The regression runs `lora-eval compare` on it with tight thresholds and writes JUnit XML.

    python -m lora_eval.golden write references/     # regenerate the golden dump (commit the result)
    python -m lora_eval.golden check OUT             # the regression: OUT/run/ (reports) and OUT/junit.xml
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from pathlib import Path

import click
import pandas as pd

from .cli import cli
from .engine.engine import EngineOptions
from .errors import InputError
from .hf import quiet_libraries
from .inputs.references import read_reference, write_reference
from .tasks import demo
from .tasks.dump_reference import dump_reference

GOLDEN = "demo-golden.parquet"
# float32 engine against float32 transformers + PEFT: k2 ~ 1e-13 and mean |d| ~ 5e-7 on the demo model, so
# these hold with a margin of >1000x (k2) and ~20x (mean |d|) while any real regression crosses them.
MAX_K2 = 1e-8
MAX_MEAN_ABS_DIFF = 1e-5


def build_inputs(out: str | Path) -> tuple[Path, dict[str, Path]]:
    """The demo's tokenizer, model and two adapters under `out` (seeded, as `lora-eval demo` builds them)."""
    out = Path(out)
    model_dir = out / "model"
    with quiet_libraries():
        tokenizer = demo.build_tokenizer(model_dir)
        demo.build_model(model_dir, vocab_size=len(tokenizer))
        adapters = {demo.ADAPTERS[0]: demo.build_peft_adapter(model_dir, out / "adapters" / demo.ADAPTERS[0]),
                    demo.ADAPTERS[1]: demo.build_tinker_adapter(model_dir, out / "adapters" / demo.ADAPTERS[1])}
    return model_dir, adapters


def golden_frame(work: str | Path, inputs: tuple[Path, dict[str, Path]] | None = None,
                 quiet: bool = True) -> pd.DataFrame:
    """The golden reference rows: float32 logprobs from transformers + PEFT, bf16 ones as sampler_logprobs.
    `inputs`: (model_dir, adapters) already made by `build_inputs`; built in `work` when None."""
    work = Path(work)
    model_dir, adapters = inputs if inputs is not None else build_inputs(work)
    prompts = demo.write_prompts(work / "prompts.jsonl")
    for dtype in ("float32", "bfloat16"):
        dump_reference(model_dir, adapters, prompts, work / f"{dtype}.parquet",
                       options=EngineOptions(device="cpu", dtype=dtype), quiet=quiet, notice=lambda _: None)
    trainer, sampler = read_reference(work / "float32.parquet"), read_reference(work / "bfloat16.parquet")
    assert list(trainer["sample_id"]) == list(sampler["sample_id"])  # same prompts file, same order
    return trainer.assign(sampler_logprobs=sampler["logprobs"])


def write_golden(references_dir: str | Path, quiet: bool = True) -> Path:
    """Regenerate references/demo-golden.parquet (everything built in a temporary folder)."""
    references_dir = Path(references_dir)
    references_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        return write_reference(golden_frame(work, quiet=quiet), references_dir / GOLDEN)


def regression_args(references_dir: str | Path, out: str | Path, model_dir: Path,
                    adapters: dict[str, Path]) -> list[str]:
    """The `lora-eval compare` arguments of the regression run."""
    out = Path(out)
    args = ["compare", "--model", str(model_dir)]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    return args + ["--reference", str(Path(references_dir) / GOLDEN), "--device", "cpu", "--dtype", "float32",
                   "--max-k2", f"{MAX_K2:g}",
                   "--max-mean-abs-diff", f"{MAX_MEAN_ABS_DIFF:g}", "--out", str(out / "run"),
                   "--junit", str(out / "junit.xml"), "--quiet"]


@click.group()
def golden():
    """Golden references for the regression job."""


@golden.command()
@click.argument("references_dir", type=click.Path(file_okay=False))
def write(references_dir):
    """Regenerate the golden dump in REFERENCES_DIR (seeded: the same bytes on the same platform)."""
    path = write_golden(references_dir)
    click.echo(f"wrote {path}")


@golden.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--references", "references_dir", default="references", show_default=True,
              type=click.Path(file_okay=False), help="Folder holding the golden dump.")
def check(out, references_dir):
    """The regression: build the demo model and adapters in OUT/inputs, then `lora-eval compare` them against
    the golden dump with tight thresholds (reports in OUT/run, JUnit in OUT/junit.xml). Exits as compare does."""
    golden_path = Path(references_dir) / GOLDEN
    if not golden_path.is_file():
        click.echo(f"error: {InputError(golden_path, 'golden dump not found')}", err=True)
        sys.exit(2)
    model_dir, adapters = build_inputs(Path(out) / "inputs")
    args = regression_args(references_dir, out, model_dir, adapters)
    click.echo("lora-eval " + shlex.join(args))
    cli.main(args=args, prog_name="lora-eval")


if __name__ == "__main__":
    golden(prog_name="python -m lora_eval.golden")
