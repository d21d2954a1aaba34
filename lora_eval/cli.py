"""The `lora-eval` command line (Click): its grammar, and one exit-code contract for every command (errors.py): 0 pass,
1 a threshold crossed, 2 bad usage or input (one line naming the file and the key), 3 an internal error, 130 / 143
interrupted; under `lora-eval launch` (launch.py) on any number of processes too.

This module imports nothing heavy: a usage error is answered before torch loads (about 2 s of imports on a CPU), and
the signal handlers are in place from main()'s first instruction. A command's work (commands.py, which imports the
tasks and torch) is imported once its arguments are parsed (`run`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import math
import os
import signal
import sys
import threading
from pathlib import Path

import click

from .errors import EXIT_CODES, EXIT_INPUT, EXIT_INTERNAL, InputError, Interrupted, PeerFailed
from .names import AGAINST_ADAPTERS, DTYPE_NAMES

LAUNCHED = ("compare", "mmlu", "dump-reference")  # the commands that run on several processes (diagnose: one)


def speaks() -> bool:
    """Whether this process talks: always, but for the ranks other than 0 of a multi-process job (distributed.py)."""
    return os.environ.get("RANK", "0") == "0"


def run(command: str, /, **arguments) -> None:
    """Do `command` (commands.py's `<command>_command`), imported only now that the arguments are parsed. A SIGINT /
    SIGTERM during the import is held and acted on once it is done: raised inside torch's import machinery, the
    exception can be swallowed there (the run goes on and exits 0) or break the import (exit 3, or an abort;
    BENCHMARKS-history 18.3)."""
    with held_signals() as held:
        commands = importlib.import_module(".commands", __package__)
    if held:
        raise Interrupted(held[0])
    getattr(commands, f"{command.replace('-', '_')}_command")(**arguments)


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM recorded (in the list yielded), not handled, inside the block; the handlers before it are
    back afterwards. (distributed.held_signals does the same around a collective, but imports torch.)"""
    held: list[int] = []
    before = {} if threading.current_thread() is not threading.main_thread() else {  # (signals reach no other)
        signum: signal.signal(signum, lambda signum, frame: held.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield held
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


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


def parse_references(values: tuple[str, ...]) -> list:
    """FILE or NAME=FILE (NAME: whose logprobs a .pt dump holds; 'base' for the base model)."""
    refs = []
    for value in values:
        name, sep, path = value.partition("=")
        refs.append((name, path) if sep and name and path and not Path(value).exists() else value)
    return refs


class Number(click.ParamType):
    """A finite number >= 0, or > 0 with `positive` (NaN and infinite values are refused as the arguments are
    parsed: a NaN compares false with every limit, and an infinite GPU memory "fits" every model)."""

    name = "number"

    def __init__(self, positive: bool = False):
        self.positive = positive

    def convert(self, value, param, ctx):
        expected = "a finite number > 0" if self.positive else "a finite number >= 0"
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"expected {expected}, got '{value}'", param, ctx)
        if not math.isfinite(number) or number < 0 or (self.positive and number == 0):
            self.fail(f"expected {expected}, got '{value}'", param, ctx)
        return number


def epilog(*examples: str) -> str:
    return EXIT_CODES + "\n\n\b\nExamples:\n" + "\n".join(f"  {e}" for e in examples)


def model_and_adapters(command):
    """--model and --adapter (repeatable; parsed into {name: dir})."""
    command = click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR",
                           callback=lambda ctx, param, values: parse_named_paths(values, "--adapter"),
                           help="A PEFT adapter folder (repeatable).")(command)
    return click.option("--model", "model_dir", required=True, type=click.Path(),
                        help="Local Hugging Face checkpoint folder.")(command)


def device_options(command):
    """--device, --dtype and --gate-up-layout: what every engine or trainer run needs."""
    command = click.option(
        "--gate-up-layout", type=click.Choice(["interleaved", "concatenated"]), default=None,
        help="Row order of a fused 3D gate_up LoRA: gate/up alternating, or all gate rows then all up rows "
             "(needed for such adapters on GPT-OSS; PEFT target_parameters adapters are detected).")(command)
    command = click.option("--dtype", default="auto", type=click.Choice(["auto", *DTYPE_NAMES]), show_default=True,
                           help="auto: bfloat16 on cuda, float32 on cpu.")(command)
    return click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]), show_default=True,
                        help="auto: cuda when torch sees a GPU, else cpu.")(command)


def graph_options(command):
    """--no-cuda-graphs, --graph-buckets, --max-graph-memory (runners/graphs.py), and --expert-parallel, for commands
    that run the engine."""
    command = click.option("--expert-parallel", is_flag=True,
                           help="Under lora-eval launch: spread every MoE layer's experts over the processes (a model "
                           "larger than one GPU); attention, routers and the rest are replicated.")(command)
    command = click.option("--max-graph-memory", default=None, type=Number(), metavar="GB",
                           help="Stop capturing new graphs once their memory pool reaches this (default: no limit)."
                           )(command)
    command = click.option("--graph-buckets", default=32, type=click.IntRange(min=0), show_default=True,
                           help="At most this many captured CUDA graphs (shape bucket x LoRA/plain); batches past "
                           "it, or beyond the largest bucket, run eagerly.")(command)
    return click.option("--no-cuda-graphs", is_flag=True,
                        help="Run every batch eagerly on the GPU (the CPU never uses graphs).")(command)


def invariant_option(command):
    """--batch-invariant: for commands that run the engine (EngineOptions.batch_invariant)."""
    return click.option("--batch-invariant", is_flag=True,
                        help="A row's logprobs bitwise the same whatever else is in its batch, where it sits and "
                        "however much padding there is (GPU: fixed tiles, no cuBLAS; the CPU is so already). "
                        "Results then do not depend on --batch-tokens or the number of data-parallel ranks.")(command)


def prefix_option(command):
    """--no-prefix-cache: for commands whose rows share leading tokens (engine/prefixes.py)."""
    return click.option("--no-prefix-cache", is_flag=True,
                        help="Run every prompt whole instead of computing leading tokens that rows share once per "
                        "(prefix, adapter).")(command)


def references_and_out(command):
    """--reference (repeatable) and --out: for commands that read trainer reference dumps into a run folder."""
    command = click.option("--out", required=True, type=click.Path(),
                           help="Run folder to write (its parent must exist).")(command)
    return click.option("--reference", "references", multiple=True, required=True, metavar="[NAME=]FILE",
                        callback=lambda ctx, param, values: parse_references(values),
                        help="Reference dump (.parquet, .jsonl, or NAME=FILE.pt); repeatable.")(command)


def run_options(command):
    """--overwrite and --quiet: for commands that write a run folder or file."""
    command = click.option("--quiet", is_flag=True, help="No progress bar (also quiet under CI=true).")(command)
    return click.option("--overwrite", is_flag=True,
                        help="Replace what --out holds when lora-eval wrote it (a run of other inputs, or of another "
                        "command); never a file or folder lora-eval did not write; a partial run of these very inputs "
                        "is resumed either way.")(command)


def engine_run_options(command):
    """device_options, graph_options, invariant_option, prefix_option and run_options: for commands that run the
    engine into a run folder (compare, mmlu)."""
    for options in (run_options, prefix_option, invariant_option, graph_options, device_options):
        command = options(command)  # (as decorators stacked bottom-up: --help lists device_options' first)
    return command


class Main(click.Group):
    """Turns InputError into one line on stderr and exit code 2, Interrupted and Ctrl-C into 130 / 143, and any
    other failure into one line and exit code 3 (never 1, which means "a threshold was crossed");
    LORA_EVAL_DEBUG=1 shows the traceback instead. Of a multi-process job, one rank says why (distributed.py)."""

    def make_context(self, info_name, args, parent=None, **extra):
        """The group's own options (`lora-eval --bad`) refused in one line too (Click writes three)."""
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `lora-eval` alone: the help, as Click gives it
                raise
            click.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(EXIT_INPUT)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PeerFailed as e:  # another rank of the job failed and said so
            sys.exit(e.code)
        except InputError as e:
            click.echo(f"error: {_rank_of(e)}{e}", err=True)
            sys.exit(EXIT_INPUT)
        except (Interrupted, KeyboardInterrupt) as e:
            stopped(e)
        except click.UsageError as e:  # a bad option value: one line, like every other refusal (Click lists the
            click.echo(f"error: {' '.join(e.format_message().split())}", err=True)  # choices one a line)
            sys.exit(EXIT_INPUT)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:  # noqa: BLE001 - a failure we do not check for yet: say so in one line
            if os.environ.get("LORA_EVAL_DEBUG"):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            click.echo(f"error: {_rank_of(e)}unexpected {type(e).__name__}: {first} (a lora-eval bug or an input it "
                       "does not check; LORA_EVAL_DEBUG=1 shows the traceback)", err=True)
            sys.exit(EXIT_INTERNAL)


def stopped(error: BaseException) -> None:
    """Interrupted (SIGTERM, or a run's own stop) or Ctrl-C: one line (rank 0's, of a job: every rank got the
    signal), exit code 130 / 143."""
    if not isinstance(error, Interrupted):
        error = Interrupted(signal.SIGINT)
    if speaks():
        click.echo(f"{error}", err=True)
    sys.exit(error.exit_code)


def _rank_of(error: Exception) -> str:
    """'rank 1: ' for an error that one rank of a multi-process job had alone (distributed.Ranks.exchange)."""
    return f"rank {error.rank}: " if hasattr(error, "rank") else ""


@click.group(cls=Main, epilog=EXIT_CODES)
@click.version_option(package_name="lora-eval")
def cli():
    """Evaluate LoRA adapters on Mixture-of-Experts models against trainer references."""


def command(name: str, examples: tuple[str, ...]):
    """The decorated function (its docstring and options) as `cli`'s command `name`, with `examples` under its help;
    the command does commands.py's `<name>_command` with the parsed options (`run`)."""
    def register(function):
        @functools.wraps(function)  # (the help, and the options Click's decorators stored on the function)
        def do(**arguments):
            run(name, **arguments)

        return cli.command(name=name, epilog=epilog(*examples))(do)

    return register


@cli.command(name="inspect", epilog=epilog(
    "lora-eval inspect --model Qwen3-30B-A3B --adapter mine=runs/adapter-1200",
    "lora-eval inspect --model gpt-oss-20b --adapter a=ADAPTER --gate-up-layout interleaved",
    "lora-eval inspect --reference logs/train_data_step3.jsonl"))
@click.option("--model", "model_dir", default=None, type=click.Path(), help="Local Hugging Face checkpoint folder.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=DIR",
              callback=lambda ctx, param, values: parse_named_paths(values, "--adapter"),
              help="A PEFT adapter folder (repeatable; with --model).")
@click.option("--gate-up-layout", type=click.Choice(["interleaved", "concatenated"]), default=None,
              help="Row order of a fused 3D gate_up LoRA (see compare --help).")
@click.option("--reference", default=None, type=click.Path(), metavar="FILE",
              help="A reference dump (native or an RL framework's): say what it holds.")
@click.option("--temperature", default=None, type=Number(positive=True), metavar="T",
              help="With --reference: the sampling temperature of a file that records none (as compare's).")
def inspect_cmd(**arguments):
    """Show each adapter's layout, targets per module kind, ranks, scalings and parameter counts (--model); or what
    a reference file holds: its format, samples, tokens, sides, temperatures and routes (--reference)."""
    if arguments["model_dir"] is None:  # (answered here, before the work and torch are imported)
        if arguments["adapters"] or arguments["gate_up_layout"] or arguments["reference"] is None:
            raise click.UsageError("Missing option '--model'." if arguments["reference"] is not None
                                   or arguments["adapters"] else "Missing option '--model' or '--reference'.")
    run("inspect", **arguments)


@command("dump-reference", examples=(
    "lora-eval dump-reference --model MODEL --adapter mine=ADAPTER --prompts prompts.jsonl --out ref.parquet",
    "lora-eval dump-reference --model MODEL --adapter a=A --adapter b=B --default-adapter a --prompts p.jsonl "
    "--out ref.parquet --dtype float32"))
@model_and_adapters
@click.option("--prompts", required=True, type=click.Path(), help="JSONL: input_ids | text | prompt+response, "
              "optional sample_id, adapter (null: the base model), mask.")
@click.option("--out", required=True, type=click.Path(), help="Reference dump to write (.parquet).")
@click.option("--temperature", default=1.0, type=Number(), show_default=True, metavar="T",
              help="Score at this sampling temperature: log_softmax(logits / T), recorded in the dump.")
@click.option("--default-adapter", default=None, metavar="NAME",
              help="Adapter of prompts without an 'adapter' field (default: the only --adapter given; 'base': the "
                   "base model).")
@device_options
@run_options
def dump_reference_cmd(**arguments):
    """Trainer-side reference logprobs from transformers + PEFT, in the native Parquet format."""


@command("compare", examples=(
    "lora-eval compare --model MODEL --adapter mine=ADAPTER --reference ref.parquet --out runs/mine",
    "lora-eval compare --model MODEL --adapter mine=ADAPTER --reference ref.jsonl --out runs/mine --max-k2 1e-3 "
    "--junit junit.xml",
    "lora-eval compare --model MODEL --reference base=dump.pt --out runs/base --device cpu --dtype float32"))
@model_and_adapters
@references_and_out
@click.option("--batch-tokens", default=4096, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per forward batch.")
@click.option("--max-k2", default=5e-3, type=Number(), show_default=True, help="Fail when k2 exceeds this.")
@click.option("--max-mean-abs-diff", default=None, type=Number(), help="Fail when mean |d| exceeds this.")
@click.option("--max-k2-over-floor", default=None, type=Number(), metavar="X",
              help="Fail a row whose k2 exceeds X times the sampler's noise floor: k2 of ref - sampler over the "
                   "references' base rows (off when they carry no sampler logprobs).")
@click.option("--max-routing-flip-rate", default=None, type=Number(), metavar="X",
              help="Fail a row whose share of (scored position, MoE layer) pairs routed to another expert set than "
                   "the references' routed_experts exceeds X (off when they carry none).")
@click.option("--temperature", default=None, type=Number(), metavar="T",
              help="The sampling temperature of references that record none (required for RL framework dumps "
                   "that apply one without recording it); logprobs are those of logits / T.")
@click.option("--no-adapter-check", is_flag=True,
              help="Skip the adapter applied gate (which fails an adapter whose files or logprobs show it changes "
                   "nothing), e.g. for an adapter that is meant to be the identity.")
@click.option("--junit", "junit_path", default=None, type=click.Path(dir_okay=False),
              help="Also write JUnit XML here: one testcase per adapter x threshold or gate.")
@engine_run_options
def compare_cmd(**arguments):
    """Engine logprobs against trainer reference dumps; exit 1 when a threshold is crossed or a gate fails (an
    adapter that changes nothing). A run into a folder that holds this very run prints its summary; a killed run
    resumes where it stopped."""


@command("mmlu", examples=(
    "lora-eval mmlu --model MODEL --adapter mine=ADAPTER --data mmlu/ --out runs/mmlu --max-drop 1",
    "lora-eval mmlu --model MODEL --adapter a=A --data mmlu/ --out runs/quick --subjects anatomy,virology --limit 20"))
@model_and_adapters
@click.option("--data", required=True, type=click.Path(), help="MMLU folder: dev/ val/ test/ CSVs (the original "
              "release), cais/mmlu parquet files, or a folder saved by datasets.")
@click.option("--out", required=True, type=click.Path(), help="Run folder to write (its parent must exist).")
@click.option("--split", default="test", type=click.Choice(["test", "val"]), show_default=True)
@click.option("--shots", default=5, type=click.IntRange(min=0), show_default=True, help="Dev examples per prompt.")
@click.option("--subjects", default=None, metavar="A,B,...", help="Only these subjects (default: all).")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Only the first N questions per subject.")
@click.option("--max-drop", default=None, type=Number(), metavar="POINTS",
              help="Exit 1 when an adapter's micro accuracy is more than this many percentage points below base.")
@click.option("--batch-tokens", default=16384, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per forward batch.")
@click.option("--junit", "junit_path", default=None, type=click.Path(dir_okay=False),
              help="Also write JUnit XML here: one testcase per adapter for --max-drop.")
@engine_run_options
def mmlu_cmd(**arguments):
    """MMLU accuracy of the base model and every adapter in one pass; exit 1 when an adapter drops too much."""


@command("demo", examples=("lora-eval demo", "lora-eval demo --out /tmp/lora-eval-demo --quiet"))
@click.option("--out", default="lora-eval-demo", type=click.Path(), show_default=True, help="Folder to build in.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def demo_cmd(**arguments):
    """Build a tiny MoE model, two adapters and a trainer reference, then run compare on them."""


@command("report", examples=("lora-eval report runs/mine > report.html",
                              "lora-eval report runs/mmlu --format md --out mmlu.md"))
@click.argument("run_dir", type=click.Path())
@click.option("--format", "fmt", default="html", type=click.Choice(["html", "md"]), show_default=True)
@click.option("--out", "out_path", default="-", type=click.Path(dir_okay=False, allow_dash=True),
              help="File to write; default: standard output.")
def report_cmd(**arguments):
    """Re-render a complete run folder's report (compare, mmlu or diagnose) from its saved files, without
    recomputing."""


@command("plan", examples=(
    "lora-eval plan --model Qwen3-235B-A22B --gpus 8",
    "lora-eval plan --model gpt-oss-120b --adapter mine=ADAPTER --gpus 4 --batch-tokens 16384 --gpu-memory 141"))
@model_and_adapters
@click.option("--gpus", default=1, type=click.IntRange(min=1), show_default=True, help="GPUs to spread over.")
@click.option("--batch-tokens", default=4096, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per forward batch.")
@click.option("--dtype", default="bfloat16", type=click.Choice(DTYPE_NAMES), show_default=True,
              help="Compute dtype (quantized releases are dequantised to it).")
@click.option("--gpu-memory", default=None, type=Number(positive=True), metavar="GB",
              help="Memory of one GPU (default: this machine's GPU, else an H100's 80 GB).")
def plan_cmd(**arguments):
    """Per-GPU memory of a model and its adapters on one GPU, data parallel and expert parallel over --gpus, from
    config.json and file headers alone (a folder with only config.json will do); exit 1 when no layout fits."""


@command("bench", examples=(
    "lora-eval bench --config benchmarks/configs/Qwen3-30B-A3B.json --layers 4 --batch 4x1024",
    "lora-eval bench --config benchmarks/configs/Qwen3-30B-A3B.json --skip-hf --batch 1x128 --batch 8x2048"))
@click.option("--config", "config_path", required=True, type=click.Path(),
              help="A published config.json (e.g. benchmarks/configs/Qwen3-30B-A3B.json); weights are random.")
@click.option("--layers", default=None, type=click.IntRange(min=1), help="Keep only the first N decoder layers.")
@click.option("--adapters", default=4, type=click.IntRange(min=1), show_default=True)
@click.option("--rank", default=16, type=click.IntRange(min=1), show_default=True)
@click.option("--targets", default="all", type=click.Choice(["all", "attn", "experts"]), show_default=True,
              help="all: PEFT all-linear (attention, router, experts); attn: q/k/v/o; experts: experts and router.")
@click.option("--batch", "batches", multiple=True, default=("4x1024",), show_default=True, metavar="ROWSxTOKENS",
              help="Batch shape (repeatable: one model build serves every shape).")
@click.option("--dtype", default="auto", type=click.Choice(["auto", *DTYPE_NAMES]), show_default=True,
              help="auto: bfloat16 on cuda, float32 on cpu.")
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]), show_default=True,
              help="auto: cuda when torch sees a GPU, else cpu.")
@click.option("--repeat", default=5, type=click.IntRange(min=1), show_default=True, help="Timed calls (median).")
@click.option("--warmup", default=2, type=click.IntRange(min=0), show_default=True)
@click.option("--skip-hf", is_flag=True, help="Time our engine only.")
@click.option("--also-eager", is_flag=True, help="Also time our engine with CUDA graphs off (system ours-eager).")
@click.option("--also-invariant", is_flag=True,
              help="Also time our engine in its batch-invariant mode (system ours-invariant; see --batch-invariant).")
@click.option("--seed", default=0, type=int, show_default=True)
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False), help="Write the table as CSV.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench_cmd(**arguments):
    """Our engine against transformers + PEFT on a random-weight model of a config's real shape."""


@command("diagnose", examples=(
    "lora-eval diagnose --model MODEL --adapter mine=ADAPTER --reference ref.parquet --out runs/why",
    "lora-eval diagnose --model MODEL --adapter mine=ADAPTER --reference ref.parquet --out runs/fp8 "
    "--against-model MODEL_FP8",
    "lora-eval diagnose --model MODEL --adapter mine=ADAPTER --reference ref.parquet --out runs/merged "
    "--against-model MERGED_MODEL --against-adapters none",
    "lora-eval diagnose --model MODEL --reference ref.parquet --out runs/bf16 --dtype bfloat16 --samples 4 "
    "--layer-by-layer"))
@model_and_adapters
@references_and_out
@click.option("--samples", default=8, type=click.IntRange(min=1), show_default=True,
              help="Per adapter (and base): the samples with the largest k2 against the reference.")
@click.option("--against-model", default=None, type=click.Path(),
              help="Side B: this checkpoint of the same architecture (a quantized release or another revision of "
              "the base; or one with an adapter merged into its weights: --against-adapters none). Default: the "
              "--model checkpoint.")
@click.option("--against-adapters", default="same", type=click.Choice(AGAINST_ADAPTERS), show_default=True,
              help="Side B with the same adapters as the engine, or with none: --against-model has the one --adapter "
              "given merged into its weights (as a server runs it); only that adapter's rows are compared.")
@click.option("--against-dtype", default="float32", type=click.Choice(DTYPE_NAMES), show_default=True,
              help="Side B's dtype (side B runs on the plain-torch backend).")
@click.option("--layer-by-layer", is_flag=True,
              help="Run side B one decoder layer at a time on the engine's input to that layer (the default when "
              "both sides do not fit the device together).")
@click.option("--batch-tokens", default=4096, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens per batch of the pass that picks the samples.")
@click.option("--temperature", default=None, type=Number(), metavar="T",
              help="The sampling temperature of references that record none (as compare's): the samples are picked "
                   "by k2 at it.")
@device_options
@invariant_option
@run_options
def diagnose_cmd(**arguments):
    """Where the engine parts from a reference computation, layer by layer: per layer the error of attention, router
    (and its top-k flips), routed experts and residual stream on the samples with the largest k2, each adapter's
    effect per module, and the first divergent layer per adapter (layers.csv, modules.csv, diagnose.json,
    diagnose.md, diagnose.html)."""


@cli.command(name="launch", context_settings=dict(ignore_unknown_options=True, allow_interspersed_args=False),
             epilog=epilog("lora-eval launch --nproc-per-node 8 compare --model MODEL --adapter mine=ADAPTER "
                           "--reference ref.parquet --out runs/mine",
                           "lora-eval launch --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8 mmlu "
                           "--model MODEL --data mmlu/ --out runs/mmlu"))
@click.option("--nproc-per-node", default=1, type=click.IntRange(min=1), show_default=True,
              help="Processes on this machine (one per GPU).")
@click.option("--nnodes", default=1, type=click.IntRange(min=1), show_default=True, help="Machines in the job.")
@click.option("--node-rank", default=0, type=click.IntRange(min=0), show_default=True,
              help="This machine's place among them.")
@click.option("--master-addr", default=None, metavar="HOST", help="Node 0's address (needed with --nnodes > 1).")
@click.option("--master-port", default=None, type=click.IntRange(min=1, max=65535),
              help="Node 0's port (default: a free one, on one machine; 29500 across machines).")
@click.argument("command", type=click.Choice(LAUNCHED), metavar="COMMAND")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch_cmd(nproc_per_node, nnodes, node_rank, master_addr, master_port, command, args):
    """Run COMMAND (compare, mmlu or dump-reference) on several processes, data parallel (or expert parallel with
    --expert-parallel), keeping the exit codes of one process: torchrun's launcher, whose own exit
    code is 1 whenever a worker fails (an input error read as a regression) beside its own report of the failure.
    The command's arguments are checked before any process starts; every input error is one line, printed once."""
    if nnodes > 1 and master_addr is None:
        raise click.BadParameter("needed when --nnodes is more than 1", param_hint="--master-addr")
    if node_rank >= nnodes:
        raise click.BadParameter(f"{node_rank} is not below --nnodes {nnodes}", param_hint="--node-rank")
    arguments = list(args)
    # the same checks a worker's command line gets, once, here
    cli.get_command(click.get_current_context(), command).make_context(command, list(arguments))
    run("launch", command=[command, *arguments], nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
        master_addr=master_addr, master_port=master_port)


def main():
    """The console script. Signals are handled from its first instruction: SIGTERM like Ctrl-C (exit 143 / 130,
    one line, cleaning up as we go), even while torch is still being imported.
    Once the command has returned, its files written and closed, the process ends at once: exit handlers run
    (atexit: the process group's teardown, logging's flush), output is flushed, then os._exit (not under a profiler
    or debugger: `_observed`), faster than the interpreter's own teardown, which frees every tensor and the CUDA
    context one by one (BENCHMARKS-history 13 and 18.3)."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, even where a parent ignored it
    try:
        cli(prog_name="lora-eval")
        code = 0
    except SystemExit as e:
        code = e.code
    except (Interrupted, KeyboardInterrupt) as e:  # before or after a command ran (its own are caught in Main)
        try:
            stopped(e)
        except SystemExit as exit_:
            code = exit_.code
    for signum in (signal.SIGINT, signal.SIGTERM):  # the outcome is decided: a later signal (a launcher stopping
        signal.signal(signum, signal.SIG_IGN)        # every worker) must not break the way out (atexit below)
    if code is not None and not isinstance(code, int):  # sys.exit("text"): the text on stderr, exit code 1
        print(code, file=sys.stderr)
        code = 1
    if _observed():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`| head`), a closed stream: nothing to flush to
            pass
    os._exit(code or 0)


def _observed() -> bool:
    """Whether a profiler, tracer or debugger watches this process (cProfile, a debugger, coverage): some write what
    they saw only once the program has returned (`python -m cProfile -o FILE -m lora_eval ...`), so such a process
    ends the usual way."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile and coverage register a tool there
    return monitoring is not None and any(monitoring.get_tool(tool) is not None for tool in range(6))


def _terminate(signum, frame):
    raise Interrupted(signum)
