"""Every shell command in README.md and docs/ runs here, on the CPU against tiny models, and exits as documented: the
docs cannot rot.

What counts as a command: each line of a fenced block tagged ```bash, ```sh or ```console in README.md and
docs/**/*.md (a console block's `$ ` prompt is dropped; a line ending in `\\` goes on with the next; `&&` chains
commands, each checked; `#` starts a comment). A command's documented exit code is 0 unless its comment says
`# exit N`. A fenced block with another tag, or none, may hold no line that starts like a command (COMMAND_START):
a command hidden from this test fails it.

How they run: a file's commands in document order (a page's `report` reads the run its `compare` wrote), in a fresh
copy of one workspace built per session, which is the current directory. It holds what the docs' placeholders name
(PLACEHOLDERS: `MODEL`, `ADAPTER`, `ref.parquet`, `mmlu/` ...), linked to tiny artefacts: the demo's seeded model,
tokenizer and adapters committed in tests/data/runs-10ede6b/inputs (its tokenizer makes " A".." D" one token, so
mmlu runs too) and files made from them here. `lora-eval ...` and `python -m lora_eval[.golden] ...` run in this
process through Click's CliRunner (torch imported once); `lora-eval launch` in a child process, as the other tests
start it, since its launcher spawns the workers. `ref.parquet` is there before any command runs (MAKE_REFERENCE,
README's dump-reference example, made it): a docs command that writes a reference under that name must be that one
(it finds its own output and recomputes nothing); another writes another file, as a run of other options into an
existing output exits 2.

What cannot run here as written is declared: SUBSTITUTIONS and APPENDED (arguments for a GPU replaced or added, with
the reason), PARSE_ONLY (parsed and checked by the CLI up to where it would start processes) and NOT_RUN (with the
reason and a check of what can be checked). Each entry must still match a docs command (test_declared_commands_exist).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import lora_eval.cli
from lora_eval.cli import cli
from lora_eval.golden import golden
from lora_eval.inputs.references import read_reference
from lora_eval.tasks.bench import small_config
from lora_eval.tasks.demo import PROMPTS
from tests.rl_dumps import framework_kit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
KIT = ROOT / "tests" / "data" / "runs-10ede6b" / "inputs"
SHELL_TAGS = {"bash", "sh", "console"}
COMMAND_START = re.compile(r"^\s*(\$ )?(lora-eval|python3?|pip|bash|torchrun|pytest)\b")

# placeholder in the docs -> what it is in the workspace: a link to a tiny artefact (a Path), or what `kit` makes
PLACEHOLDERS = {
    "MODEL": KIT / "model",  # the demo's seeded 4-layer Qwen3-MoE with an MMLU-ready tokenizer
    "ADAPTER": KIT / "adapters" / "peft-all-linear",
    "A": KIT / "adapters" / "peft-all-linear",
    "B": KIT / "adapters" / "tinker-shared-outer",
    "mmlu": KIT / "mmlu",  # two subjects of synthetic questions, dev/ and test/ CSVs
    "Qwen3-235B-A22B": "a folder holding only benchmarks/configs/Qwen3-235B-A22B.json as config.json (plan)",
    "benchmarks/configs": "each published config at small widths (bench.small_config)",
    "prompts.jsonl": "the demo's prompts, each under the base model and `mine`",
    "p.jsonl": "the demo's prompts without an adapter field",
    "ref.parquet": "README's dump-reference of prompts.jsonl",
    "ref.jsonl": "ref.parquet as JSONL",
    "dump.pt": "ref.parquet's base rows as a serving-engine .pt dump",
    "references": "references/demo-golden.parquet (python -m lora_eval.golden reads ./references)",
    "runs": "an empty folder for run folders",
    "logs": "ref.parquet's `mine` rows as NeMo-RL's train_data_step3.jsonl (tests/rl_dumps.py, as the next four)",
    "token_exports": "the same as prime-rl's token export step_3/rank_0.jsonl",
    "rollouts": "the same as prime-rl's rollouts step_3/rank_0.bin",
    "dump": "the same as slime's train dump train_data/3.pt",
    "gen_batch.dp": "a pickle naming verl's DataProto (refused unopened)",
}
MAKE_REFERENCE = ("lora-eval dump-reference --model MODEL --adapter mine=ADAPTER --prompts prompts.jsonl "
                  "--out ref.parquet")


# arguments as written -> as run here, and why
SUBSTITUTIONS = {
    ("--device", "cuda"): (("--device", "cpu"), "no GPU here; the CPU runs the same command path"),
    ("--nproc-per-node", "8"): (("--nproc-per-node", "2"), "eight processes on two cores; two take the same data- "
                                "or expert-parallel path"),
}
# commands starting so -> arguments added at the end, and why
APPENDED = {
    "lora-eval bench": (("--repeat", "1", "--warmup", "0"), "bench times real widths on a GPU; here the workspace's "
                        "configs are at small widths (PLACEHOLDERS) and one timed call shows it runs"),
}
# run with lora_eval.cli.run replaced: Click parses the command and launch checks its arguments (and the inner
# command's), then stops where it would start the processes
PARSE_ONLY = {
    "lora-eval launch --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8 mmlu --model MODEL "
    "--data mmlu/ --out runs/mmlu": "needs a second machine (node0) to meet",
}


def _ci_runs(line: str) -> bool:
    return line in (ROOT / ".ci" / "run").read_text()


def _bash_parses(script: str) -> bool:
    return subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


# command -> (why it does not run here, a check of what can be checked)
NOT_RUN = {
    "pip install torch==2.13.0": ("would reinstall torch into this environment",
                                  lambda: _ci_runs("torch==2.13.0")),
    'pip install -e ".[test]"': ("would reinstall the package into this environment",
                                 lambda: _ci_runs('-e ".[test]"') and "\ntest = [" in _pyproject()),
    "python3 -m pytest -q": ("the suite this test is part of", lambda: _ci_runs("python3 -m pytest -q")),
    "bash benchmarks/gpu_suite.sh": ("GPU tests and benchmarks", lambda: _bash_parses("benchmarks/gpu_suite.sh")),
    "python3 -m pytest -m gpu -q -rfs -n 6 --dist loadgroup tests": (
        "GPU tests (they skip without CUDA)", lambda: '"gpu: ' in _pyproject() and "pytest-xdist" in _pyproject()),
    "TRITON_DISABLE_LINE_INFO=1 python tests/kernels/sm90_compile.py CASE": (
        "CASE is one of the script's cases, each compiled through Triton's real compiler for tens of seconds; "
        "tests/kernels/test_sm90_compile.py runs them",
        lambda: "sm90_compile.py CASE" in (ROOT / "tests/kernels/sm90_compile.py").read_text()),
}


# ---- reading the docs ------------------------------------------------------------------------------------


@dataclass
class Command:
    file: str
    line: int
    text: str  # as written, comments and the `&&` chain split off
    expected: int

    def __str__(self):
        return f"{self.file}:{self.line}: {self.text}"


def fenced_blocks(path: Path):
    """(tag, first line number, lines) of each fenced block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^\s*```(\S*)", lines[i])
        if opening:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            yield opening.group(1).lower(), i + 2, lines[i + 1:end]
            i = end
        i += 1


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment starts at a `#` outside quotes after a blank or at the start."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(path: Path) -> list[Command]:
    found = []
    name = str(path.relative_to(ROOT))
    for tag, first, lines in fenced_blocks(path):
        if tag not in SHELL_TAGS:
            continue
        joined, start = "", None
        for number, raw in enumerate(lines, first):
            line = raw[2:] if tag == "console" and raw.startswith("$ ") else raw
            start = number if start is None else start
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            code, comment = split_comment(joined + line)
            joined, at, start = "", start, None
            if not code.strip():
                continue
            exit_code = re.match(r"exit (\d+)\b", comment)
            for part in re.split(r"\s&&\s", code.strip()):
                found.append(Command(name, at, " ".join(part.split()), int(exit_code.group(1)) if exit_code else 0))
    return found


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in commands(path)]


# ---- the workspace -----------------------------------------------------------------------------------------


def cli_run(group, args: list[str]):
    return CliRunner().invoke(group, args, catch_exceptions=True)


@pytest.fixture(scope="session")
def kit(tmp_path_factory) -> Path:
    """The workspace every docs file starts from (PLACEHOLDERS)."""
    root = tmp_path_factory.mktemp("docs-kit")
    for name, target in PLACEHOLDERS.items():
        if isinstance(target, Path):
            (root / name).symlink_to(target)
    (root / "runs").mkdir()
    (root / "references").mkdir()
    shutil.copy(ROOT / "references" / "demo-golden.parquet", root / "references")
    configs = root / "benchmarks" / "configs"
    configs.mkdir(parents=True)
    for config in (ROOT / "benchmarks" / "configs").glob("*.json"):
        (configs / config.name).write_text(json.dumps(small_config(json.loads(config.read_text()))))
    (root / "Qwen3-235B-A22B").mkdir()
    shutil.copy(ROOT / "benchmarks" / "configs" / "Qwen3-235B-A22B.json", root / "Qwen3-235B-A22B" / "config.json")
    rows = [dict(sample_id=f"{adapter or 'base'}-{j}", adapter=adapter, prompt=prompt, response=response)
            for adapter in (None, "mine") for j, (prompt, response) in enumerate(PROMPTS[:2])]
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "p.jsonl").write_text("".join(json.dumps(dict(prompt=p, response=r)) + "\n" for p, r in PROMPTS[:2]))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        result = cli_run(cli, shlex.split(MAKE_REFERENCE)[1:] + ["--quiet"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, (result.output, result.stderr)
    ref = read_reference(root / "ref.parquet")
    with open(root / "ref.jsonl", "w") as f:  # (read_reference gives lists, and NaN or None where a value is missing)
        for row in ref.to_dict("records"):
            f.write(json.dumps({k: v for k, v in row.items() if not (v is None or v != v)}) + "\n")
    framework_kit(root, ref[ref["adapter"] == "mine"], json.loads((KIT / "model" / "config.json").read_text()))
    base = ref[ref["adapter"].isna()]
    torch.save({"tokens": [torch.tensor(list(ids)) for ids in base["input_ids"]],
                "training_logprobs": [torch.tensor(list(lp)) for lp in base["logprobs"]]}, root / "dump.pt")
    return root


# ---- running a command -------------------------------------------------------------------------------------


def find(argv: list[str], part: tuple[str, ...]) -> int | None:
    return next((i for i in range(len(argv) - len(part) + 1) if tuple(argv[i:i + len(part)]) == part), None)


def substituted(command: Command) -> list[str]:
    argv = shlex.split(command.text)
    for old, (new, _) in SUBSTITUTIONS.items():
        at = find(argv, old)
        if at is not None:
            argv[at:at + len(old)] = new
    for start, (added, _) in APPENDED.items():
        if command.text.startswith(start + " "):
            argv += added
    return argv


def run_command(command: Command, monkeypatch) -> tuple[int | None, str]:
    """(exit code, what it printed) of one docs command in the current directory; None: not runnable here."""
    if command.text in NOT_RUN:
        reason, check = NOT_RUN[command.text]
        return (command.expected, "") if check() else (-1, f"not run ({reason}), and its check failed")
    argv = substituted(command)
    env = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    redirect = None
    if len(argv) >= 2 and argv[-2] == ">":
        argv, redirect = argv[:-2], argv[-1]
    if any(token in ("|", "||", ";", "<", ">", "&") for token in argv):
        return None, "shell syntax this test does not run"
    if argv[:1] == ["lora-eval"]:
        group, args = cli, argv[1:]
    elif argv[:2] in (["python", "-m"], ["python3", "-m"]) and argv[2] in ("lora_eval", "lora_eval.golden"):
        group, args = (cli if argv[2] == "lora_eval" else golden), argv[3:]
    else:
        return None, "not a lora-eval command, and not in NOT_RUN"
    with monkeypatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        if command.text in PARSE_ONLY:
            calls = []
            patch.setattr(lora_eval.cli, "run", lambda name, /, **arguments: calls.append(name))
            result = cli_run(group, args)
            return (result.exit_code if calls == ["launch"] else -1), result.output
        if group is cli and args[:1] == ["launch"]:  # its launcher starts worker processes: from a child process
            child = subprocess.run([sys.executable, "-m", "lora_eval", *args], capture_output=True, text=True,
                                   env={**os.environ, "CI": "true"})
            return child.returncode, child.stdout + child.stderr
        result = cli_run(group, args)
    if redirect is not None:
        Path(redirect).write_bytes(result.stdout_bytes)
    return result.exit_code, result.output


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_exits_as_documented(doc, kit, tmp_path, monkeypatch):
    workspace = tmp_path / "workspace"
    shutil.copytree(kit, workspace, symlinks=True)
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("CI", "true")  # no progress bars
    failures = []
    for command in commands(doc):
        code, output = run_command(command, monkeypatch)
        if code != command.expected:
            why = "cannot run: " + output if code is None else f"exit {code}, documented {command.expected}"
            failures.append(f"{command}\n  {why}\n  " + "\n  ".join(output.strip().splitlines()[-8:]))
    assert not failures, "\n".join(failures)


def test_declared_commands_exist():
    """Each NOT_RUN, PARSE_ONLY, SUBSTITUTIONS and APPENDED entry still matches a docs command (or it goes)."""
    texts = [c.text for c in all_commands()]
    assert [t for t in NOT_RUN if t not in texts] == []
    assert [t for t in PARSE_ONLY if t not in texts] == []
    assert MAKE_REFERENCE in texts
    assert [old for old in SUBSTITUTIONS if not any(find(shlex.split(t), old) is not None for t in texts)] == []
    assert [start for start in APPENDED if not any(t.startswith(start + " ") for t in texts)] == []


def test_no_command_hides_outside_a_shell_block():
    hidden = [f"{path.relative_to(ROOT)}:{first + i}: {line}" for path in DOCS
              for tag, first, lines in fenced_blocks(path) if tag not in SHELL_TAGS
              for i, line in enumerate(lines) if COMMAND_START.match(line)]
    assert hidden == []


def test_readme_is_a_guide():
    """Under 250 lines, its set-up commands as .ci/run and the issue keep them, and a link to every docs page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    setup = [c.text for c in commands(ROOT / "README.md")][:4]
    assert setup == ["pip install torch==2.13.0", 'pip install -e ".[test]"', "lora-eval demo", "python3 -m pytest -q"]
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in DOCS[1:]:
        if page.name != "README.md" or page.parent != ROOT / "docs":
            assert f"({page.relative_to(ROOT / 'docs')})" in index, page


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve():
    """Every relative link of README.md and docs/ names a file that exists, and a heading of it where it says #."""
    broken = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            linked = (path.parent / target).resolve() if target else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = {slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), re.M)}
                if anchor not in headings:
                    broken.append(f"{path.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []


def test_named_files_and_python_names_exist():
    """A repository path (`lora_eval/results/runfolder.py`) or Python name (`lora_eval.tasks.bench.small_config`) in
    README.md, docs/ or references/README.md names something that exists: a module moved is a docs change too."""
    missing = []
    for path in [*DOCS, ROOT / "references" / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for name in re.findall(r"`((?:lora_eval|kernels|runners|tests|benchmarks|references|reports|\.ci|\.github)"
                               r"/[\w./-]*)", text):
            if not (ROOT / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        for name in re.findall(r"`(lora_eval(?:\.\w+)+)", text):
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    value = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            for attribute in parts[cut:]:
                value = getattr(value, attribute, None)
            if value is None:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []
