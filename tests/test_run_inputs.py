"""What a run reads and where it writes (issue 42): impossible reference numbers, outputs onto inputs or onto files
lora-eval did not write, dead ends, the lock taken before any input is read, and messages that name the right thing.

1. reference logprobs and sampler logprobs that no log-probability can be (> 0, NaN, +inf, -inf), in every reference
   format, refused with one line naming the file, the row and the column;
2. no output onto an input of the run (the model folder, an adapter, the prompts, a reference, the MMLU data,
   --against-model) nor onto a file or folder lora-eval did not write, --overwrite or not: exit 2, the user's file
   byte-identical, nothing left beside it;
3. dead ends: prompts that score no token refused before the model loads, leaving nothing; a working folder of
   other inputs that holds no finished work is replaced; a run that fails before finishing any unit takes back its
   folder; the demo never suggests an --overwrite it does not have;
4. the lock first: against a held lock every task stops before reading any input;
5. messages: a pickled .pt refused in our words; reference siblings (lengths, masks, duplicates across files, an
   unknown adapter, empty and malformed files) named by file and row.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import pickle
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lora_eval import Engine
from lora_eval.cli import cli
from lora_eval.inputs.references import SCHEMA, read_reference, write_reference
from lora_eval.results.runfolder import RunFolder
from lora_eval.tasks.dump_reference import DumpReferenceTask
from tests.builders import random_sequences, save_random_peft_adapter
from tests.cli_checks import assert_input_error, assert_no_traceback
from tests.test_reports import write_mmlu_run

VOCAB = 96  # tests.builders' tiny vocabulary
LOCK_HELD = "another lora-eval run is writing here"


class Picklable:
    """Not a tensor, list or dict: a .pt holding it needs unpickling, which lora-eval never does."""


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def frame(seed: int, n: int = 6, sampler: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ids = random_sequences(n, VOCAB, seed=seed, min_len=6, max_len=14)
    data = dict(sample_id=[f"s{i}" for i in range(n)], adapter=[None] * n, input_ids=ids,
                logprobs=[(-rng.uniform(0.01, 8, len(x) - 1)).tolist() for x in ids])
    if sampler:
        data["sampler_logprobs"] = [(-rng.uniform(0.01, 8, len(x) - 1)).tolist() for x in ids]
    return pd.DataFrame(data)


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def art(tmp_path_factory, moe_model, session_seed):
    root = tmp_path_factory.mktemp("inputs")
    model = root / "model"
    shutil.copytree(moe_model, model)  # a copy: tests that must find it unchanged compare its bytes
    adapter = save_random_peft_adapter(model, root / "peft", seed=session_seed + 1, r=4, lora_alpha=8,
                                       target_modules="all-linear")
    return dict(root=root, model=model, adapter=adapter, seed=session_seed)


@pytest.fixture
def no_model(monkeypatch):
    """A refusal must come before any model is loaded (the engine's, or transformers' for dump-reference)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(Engine, "load", refuse)
    monkeypatch.setattr(DumpReferenceTask, "run", refuse)


def compare_args(art, out, *refs) -> list:
    return ["compare", "--model", art["model"], "--adapter", f"peft={art['adapter']}",
            *[a for ref in refs for a in ("--reference", ref)], "--out", out, "--quiet"]


def dump_args(art, prompts, out, *extra) -> list:
    return ["dump-reference", "--model", art["model"], "--adapter", f"peft={art['adapter']}", "--prompts", prompts,
            "--out", out, "--quiet", "--device", "cpu", *extra]


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_prompts(path: Path, seed: int) -> Path:
    ids = random_sequences(3, VOCAB, seed=seed, min_len=5, max_len=9)
    return write_prompts(path, [dict(sample_id=f"p{i}", adapter=None if i % 2 else "peft", input_ids=x)
                                for i, x in enumerate(ids)])


def left_beside(out: Path) -> list[str]:
    """Our working names beside `out` (lock, working folder, temporary names): none may be left by a refusal."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name + "."))


# ---- 1. impossible reference numbers ---------------------------------------------------------------------


def write_as(fmt: str, data: pd.DataFrame, folder: Path) -> str:
    """`data` as a reference file of `fmt`, as a trainer would write it (not validated), and the --reference argument
    that names it."""
    if fmt == "parquet":
        path = folder / "ref.parquet"
        pq.write_table(pa.Table.from_pandas(data.assign(mask=None), schema=SCHEMA, preserve_index=False), path)
        return str(path)
    if fmt == "jsonl":
        path = folder / "ref.jsonl"
        rows = [{k: v for k, v in r.items() if v is not None} for r in data.to_dict("records")]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # (Python's json writes NaN and Infinity)
        return str(path)
    path = folder / "ref.pt"
    dump = dict(tokens=[torch.tensor(x) for x in data["input_ids"]],
                training_logprobs=[torch.tensor(x, dtype=torch.float32) for x in data["logprobs"]])
    if "sampler_logprobs" in data:
        dump["sampling_logprobs"] = [torch.tensor(x, dtype=torch.float32) for x in data["sampler_logprobs"]]
    torch.save(dump, path)
    return f"base={path}"


IMPOSSIBLE = [(0.5, "0.5", "above 0"), (float("nan"), "nan", "not a finite number"),
              (float("inf"), "inf", "not a finite number"), (float("-inf"), "-inf", "probability 0")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "pt"])
@pytest.mark.parametrize("column", ["logprobs", "sampler_logprobs"])
@pytest.mark.parametrize("value,shown,why", IMPOSSIBLE, ids=[c[1] for c in IMPOSSIBLE])
def test_impossible_logprobs_are_refused_in_every_format(art, tmp_path, no_model, fmt, column, value, shown, why):
    data = frame(art["seed"] + 3, sampler=True)
    row = 2
    values = list(data.at[row, column])
    values[3] = value
    data.at[row, column] = values
    ref = write_as(fmt, data, tmp_path)
    path = ref.split("=", 1)[-1]
    where = {"parquet": "row 2 (sample s2)", "jsonl": "line 3 (sample s2)", "pt": "sample 2"}[fmt]
    # (a .pt dump's sampling_logprobs are read, and named, as sampler_logprobs)
    assert_input_error(run_cli(*compare_args(art, tmp_path / "run", ref)), path, where,
                       f"{column} must hold finite numbers <= 0", f"found {shown} at position 3", why)
    assert left_beside(tmp_path / "run") == [] and not (tmp_path / "run").exists()


def test_a_logprob_of_zero_is_possible(art, tmp_path):
    """Probability 1 (log 0) is a possible logprob: only values above 0 are refused."""
    data = frame(art["seed"] + 4)
    data.at[0, "logprobs"] = [0.0] + list(data.at[0, "logprobs"])[1:]
    assert read_reference(write_reference(data, tmp_path / "ref.parquet"))["logprobs"][0][0] == 0.0


# ---- 2. no write onto an input, nor onto what lora-eval did not write -------------------------------------


def test_dump_reference_never_writes_into_the_model(art, tmp_path, no_model):
    """The issue's reproducer: --out model/config.json --overwrite replaced the model's config with Parquet bytes."""
    prompts = good_prompts(tmp_path / "prompts.jsonl", art["seed"])
    before = files_under(art["model"])
    for out, needle in [(art["model"] / "config.json", "--model"), (art["model"] / "new.parquet", "--model"),
                        (art["adapter"] / "ref.parquet", "--adapter peft"), (prompts, "--prompts")]:
        for extra in ([], ["--overwrite"]):
            line = assert_input_error(run_cli(*dump_args(art, prompts, out, *extra)), "--out", needle,
                                      "never writes to its inputs")
            assert str(out) in line
    assert files_under(art["model"]) == before
    assert left_beside(art["model"] / "config.json") == []
    assert_input_error(run_cli(*dump_args(art, prompts, tmp_path / "ref.jsonl")), "--out", "name the file .parquet")
    assert not (tmp_path / "ref.jsonl").exists()


def test_no_output_onto_an_input_of_any_command(art, tmp_path, no_model):
    data = frame(art["seed"] + 5)
    refs = tmp_path / "refs"
    refs.mkdir()
    ref = write_reference(data, refs / "ref.parquet")
    mmlu_data = tmp_path / "mmlu"
    (mmlu_data / "test").mkdir(parents=True)
    (mmlu_data / "test" / "anatomy_test.csv").write_text("q,a,b,c,d,A\n")
    link = tmp_path / "link"
    link.symlink_to(art["model"], target_is_directory=True)
    before = {p: files_under(p) for p in (art["model"], art["adapter"], refs, mmlu_data)}
    cases = [
        (compare_args(art, art["model"] / "run", ref), "--model"),
        (compare_args(art, link / "run", ref), "--model"),  # through a link
        (compare_args(art, art["adapter"], ref), "--adapter peft"),
        (compare_args(art, refs, ref) + ["--overwrite"], "--reference"),  # a folder that holds a reference
        (["mmlu", "--model", art["model"], "--data", mmlu_data, "--out", mmlu_data / "run"], "--data"),
        (["diagnose", "--model", art["model"], "--reference", ref, "--out", refs], "--reference"),
        (["diagnose", "--model", art["model"], "--reference", f"base={tmp_path / 'x.pt'}", "--against-model",
          art["adapter"], "--out", art["adapter"] / "why"], "--against-model"),
    ]
    for args, needle in cases:
        assert_input_error(run_cli(*args), "--out", needle, "never writes to its inputs")
    assert {p: files_under(p) for p in before} == before


def test_overwrite_replaces_only_what_lora_eval_wrote(art, tmp_path, no_model):
    prompts = good_prompts(tmp_path / "prompts.jsonl", art["seed"] + 6)
    theirs = write_reference(frame(art["seed"] + 7), tmp_path / "theirs.parquet")  # a valid reference, not ours
    kept = theirs.read_bytes()
    assert_input_error(run_cli(*dump_args(art, prompts, theirs, "--overwrite")), str(theirs),
                       "was not written by lora-eval dump-reference", "--overwrite or not")
    assert theirs.read_bytes() == kept and left_beside(theirs) == []
    folder = tmp_path / "results"  # a folder with a run.json of another tool
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps(dict(status="complete", fingerprint={}, tool="theirs")))
    ref = write_reference(frame(art["seed"] + 8), tmp_path / "ref.parquet")
    assert_input_error(run_cli(*compare_args(art, folder, ref), "--overwrite"), str(folder),
                       "not a lora-eval run folder")
    assert json.loads((folder / "run.json").read_text())["tool"] == "theirs"
    lock = tmp_path / "run.lock"  # a file of the lock's name that no lora-eval run wrote
    lock.write_text("my notes")
    assert_input_error(run_cli(*compare_args(art, tmp_path / "run", ref)), str(lock), "not a lora-eval lock file")
    assert lock.read_text() == "my notes" and not (tmp_path / "run").exists()


def test_files_beside_a_run_never_replace_an_input_or_a_users_file(art, tmp_path, no_model):
    """--junit, report --out and bench --out: never onto an input of the command, nor onto a file lora-eval did not
    write (the report once replaced a model's config.json with HTML); a file of ours (a re-run's JUnit or report) is
    replaced."""
    ref = write_reference(frame(art["seed"] + 11), tmp_path / "ref.parquet")
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's own notes")
    before = files_under(art["model"])
    run_dir = tmp_path / "mmlu-run"
    write_mmlu_run(run_dir, np.random.default_rng(art["seed"]))
    cases = [(compare_args(art, tmp_path / "run", ref) + ["--junit", art["model"] / "config.json"], "--model"),
             (compare_args(art, tmp_path / "run", ref) + ["--junit", ref], "--reference"),
             (compare_args(art, tmp_path / "run", ref) + ["--junit", notes], "did not write"),
             (["report", run_dir, "--out", art["model"] / "config.json"], "did not write"),
             (["report", run_dir, "--out", run_dir / "mmlu.md"], "RUN_DIR"),
             (["report", run_dir, "--out", notes], "did not write"),
             (["bench", "--config", art["model"] / "config.json", "--out", art["model"] / "config.json"], "--config"),
             (["bench", "--config", art["model"] / "config.json", "--out", notes], "did not write")]
    for args, needle in cases:
        assert_input_error(run_cli(*args), needle)
    assert files_under(art["model"]) == before and notes.read_text() == "the user's own notes"
    assert not (tmp_path / "run").exists()
    for _ in range(2):  # the second time replaces the first's file: lora-eval wrote it
        result = run_cli("report", run_dir, "--format", "md", "--out", tmp_path / "mmlu.md")
        assert result.exit_code == 0, result.stderr
    assert (tmp_path / "mmlu.md").read_bytes() == (run_dir / "mmlu.md").read_bytes()


# ---- 3. dead ends ----------------------------------------------------------------------------------------


def test_prompts_that_score_no_token_are_refused_before_the_model(art, tmp_path, no_model):
    ids = random_sequences(2, VOCAB, seed=art["seed"] + 9, min_len=4, max_len=8)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(input_ids=x, adapter=None, mask=[0] * (len(x) - 1))
                                                         for x in ids])
    out = tmp_path / "ref.parquet"
    before = files_under(tmp_path)
    assert_input_error(run_cli(*dump_args(art, prompts, out)), str(prompts), "mask", "no prompt scores a token")
    assert files_under(tmp_path) == before and left_beside(out) == []


def word_tokenizer_model(art, folder: Path, beyond: bool = False) -> Path:
    """A copy of the model folder with a word-level tokenizer inside its vocabulary (`beyond`: 'world' outside)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(art["model"], folder)
    words = ["[UNK]", "hello", "world", "what", "is", "it"]
    ids = {w: i for i, w in enumerate(words)}
    if beyond:
        ids["world"] = VOCAB + 4
    core = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(str(folder))
    return folder


def test_a_prompt_without_a_response_token_is_refused(art, tmp_path, no_model):
    model = word_tokenizer_model(art, tmp_path / "model")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(prompt="what is it", response=" hello world"),
                                                         dict(prompt="hello world", response="")])
    args = ["dump-reference", "--model", model, "--prompts", prompts, "--out", tmp_path / "ref.parquet", "--quiet"]
    assert_input_error(run_cli(*args), str(prompts), "line 2", "response is missing or gives no token")
    assert left_beside(tmp_path / "ref.parquet") == []


def test_dump_reference_leaves_no_dead_end(art, tmp_path, monkeypatch):
    """A refused or failed dump leaves nothing that blocks the corrected command; a working folder of other inputs
    that finished nothing is replaced (with a note), one that finished work names what to do."""
    prompts = good_prompts(tmp_path / "prompts.jsonl", art["seed"] + 10)
    out = tmp_path / "ref.parquet"
    module = sys.modules["lora_eval.tasks.dump_reference"]
    original = module._sequence_logprobs

    def failing(*args):
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(module, "_sequence_logprobs", failing)  # fails before finishing any prompt
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 3 and "fell off the bus" in result.stderr, result.stderr
    assert left_beside(out) == [] and not out.exists()
    monkeypatch.setattr(module, "_sequence_logprobs", original)
    with RunFolder(out, "dump-reference", {"command": "dump-reference", "other": 1}, single_file=True,
                   notice=lambda _: None) as folder:  # a run of other inputs that made its folder, then died
        folder.work([1, 1], "dump-reference", "sample", quiet=True).flush()
    assert left_beside(out) == ["ref.parquet.partial"]
    result = run_cli(*dump_args(art, prompts, out))
    assert result.exit_code == 0, result.stderr
    assert "replacing" in result.stderr and "finished no unit" in result.stderr
    assert left_beside(out) == [] and len(pd.read_parquet(out)) == 3


def test_the_demo_suggests_nothing_it_does_not_have(tmp_path):
    """The demo has no --overwrite: a re-run builds and computes again, and says nothing about --overwrite; a folder
    the demo did not make is refused, its files unchanged."""
    out = tmp_path / "demo"
    for _ in range(2):
        result = run_cli("demo", "--out", out, "--quiet")
        assert_no_traceback(result)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        assert "--overwrite" not in result.stdout + result.stderr, result.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    result = run_cli("demo", "--out", mine, "--quiet")
    assert_no_traceback(result)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "lora-eval demo did not make" in lines[0], result.stderr
    assert files_under(mine) == {"config.json": b"{}"}


# ---- 4. the lock first -----------------------------------------------------------------------------------


def hold_lock(out: Path) -> int:
    """OUT.lock held as a live run holds it (flock and its record); returns the descriptor (close it to let go)."""
    fd = os.open(out.with_name(out.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), started="now",
                                 command="compare")).encode())
    return fd


def test_the_lock_is_taken_before_any_input_is_read(art, tmp_path, no_model):
    """Every task against a held lock stops at once, before reading an input: here each input is missing or bad,
    and the lock is what it names (before, mmlu read and tokenised every question, then lost the race)."""
    missing = tmp_path / "missing"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    cases = [
        ["compare", "--model", art["model"], "--reference", bad, "--out", tmp_path / "run"],
        ["mmlu", "--model", art["model"], "--data", missing, "--out", tmp_path / "run"],
        ["diagnose", "--model", art["model"], "--reference", bad, "--out", tmp_path / "run"],
        ["dump-reference", "--model", art["model"], "--prompts", bad, "--out", tmp_path / "run.parquet"],
    ]
    held = [hold_lock(tmp_path / "run"), hold_lock(tmp_path / "run.parquet")]
    try:
        for args in cases:
            assert_input_error(run_cli(*args), str(args[-1]), LOCK_HELD, f"pid {os.getpid()}")
    finally:
        for fd in held:
            os.close(fd)
    locks = ["run.lock", "run.parquet.lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", *locks]  # nothing made, the locks kept
    for name in locks:
        (tmp_path / name).unlink()  # (as a holder does when it ends)
    # with the lock free, the same commands name their inputs and leave nothing
    for args, needle in zip(cases, [str(bad), str(missing), str(bad), str(bad)]):
        assert_input_error(run_cli(*args), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


# ---- 5. messages and siblings ----------------------------------------------------------------------------


def test_a_pickled_pt_is_refused_in_our_words(art, tmp_path, no_model):
    cases = []
    with_object = tmp_path / "object.pt"
    torch.save(dict(tokens=[[1, 2, 3]], training_logprobs=[[-1.0, -2.0]], extra=Picklable()), with_object)
    cases.append((with_object, "refused: not a plain tensor file"))
    plain_pickle = tmp_path / "pickle.pt"
    plain_pickle.write_bytes(pickle.dumps(collections.Counter(a=1), protocol=4))
    cases.append((plain_pickle, "refused: not a plain tensor file"))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    cases.append((empty, "empty file"))
    truncated = tmp_path / "truncated.pt"
    torch.save(dict(tokens=torch.ones(2, 4, dtype=torch.long), training_logprobs=-torch.ones(2, 3)), truncated)
    truncated.write_bytes(truncated.read_bytes()[:60])
    cases.append((truncated, "not a readable torch file"))
    for path, needle in cases:
        line = assert_input_error(run_cli(*compare_args(art, tmp_path / "run", f"base={path}")), str(path), needle)
        assert "weights_only" not in line and "\x1b" not in line, line


def test_reference_siblings_name_the_file_and_row(art, tmp_path, no_model):
    good = frame(art["seed"] + 11)
    one = write_reference(good, tmp_path / "one.parquet")
    two = write_reference(good.head(2), tmp_path / "two.parquet")
    named = write_reference(good.assign(adapter="ghost"), tmp_path / "named.parquet")
    short = tmp_path / "short.pt"
    torch.save(dict(tokens=torch.ones(3, 5, dtype=torch.long), training_logprobs=-torch.ones(2, 4)), short)
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps(dict(input_ids=[1, 2], logprobs=[-1.0])) + "\n[1, 2]\n")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"input_ids": [1, 2], "logprobs": [-1.0], "sample_id": "caf\xe9"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    masks = tmp_path / "masks.jsonl"
    masks.write_text(json.dumps(dict(input_ids=[1, 2, 3], logprobs=[-1.0, -2.0], mask=[1, 0.5])) + "\n")
    cases = [
        ([one, two], "sample_id appears in more than one reference file"),
        ([named], "names adapter 'ghost', which was not given"),
        ([f"base={short}"], "3 token rows but 2 training_logprobs rows"),
        ([listed], "line 2: expected a JSON object, found list"),
        ([latin], "line 1: not UTF-8"),
        ([empty], "no samples"),
        ([masks], "mask must hold booleans"),
    ]
    for refs, needle in cases:
        assert_input_error(run_cli(*compare_args(art, tmp_path / "run", *refs)), needle)
    assert not (tmp_path / "run").exists() and left_beside(tmp_path / "run") == []


def test_a_model_that_computes_nan_is_named_not_the_output(art, tmp_path):
    """Logprobs that transformers computes non-finite (a NaN weight) are the model's fault, not a bad output file."""
    model = tmp_path / "model"
    shutil.copytree(art["model"], model)
    for path in model.glob("*.safetensors"):
        tensors = load_file(str(path))
        name = next(k for k in sorted(tensors) if k.endswith("norm.weight"))
        tensors[name][0] = float("nan")
        save_file(tensors, str(path), metadata={"format": "pt"})
    prompts = good_prompts(tmp_path / "prompts.jsonl", art["seed"] + 12)
    out = tmp_path / "ref.parquet"
    args = ["dump-reference", "--model", model, "--prompts", prompts, "--out", out, "--quiet", "--device", "cpu"]
    rows = [dict(r, adapter=None) for r in map(json.loads, prompts.read_text().splitlines())]
    write_prompts(prompts, rows)
    assert_input_error(run_cli(*args), str(model))
    assert not out.exists() and left_beside(out) == []


def test_a_tokenizer_of_another_model_is_blamed_not_the_prompt(art, tmp_path, no_model):
    model = word_tokenizer_model(art, tmp_path / "model", beyond=True)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(prompt="what is it", response=" hello world")])
    args = ["dump-reference", "--model", model, "--prompts", prompts, "--out", tmp_path / "ref.parquet", "--quiet"]
    assert_input_error(run_cli(*args), str(model / "config.json"), "vocab_size",
                       f"tokenizer makes token id {VOCAB + 4}", "does not belong to this model")


# ---- issue 42, second audit: outputs on the run's own paths or on links, dead ends, overflow, .pt forms --------


def compare_cmd(art, out, ref, *extra) -> list:
    return ["compare", "--model", art["model"], "--adapter", f"peft={art['adapter']}", "--reference", ref,
            "--out", out, "--quiet", "--device", "cpu", *extra]


def test_samples_beyond_the_models_positions_are_refused(art, tmp_path, no_model):
    """A reference or prompt longer than config.json's max_position_embeddings (which no trainer with this config
    made) was computed and compared: refused before the model loads, naming the file and the sample."""
    model = tmp_path / "model"
    shutil.copytree(art["model"], model)
    config = json.loads((model / "config.json").read_text())
    data = frame(art["seed"] + 30)
    longest = max(len(x) for x in data["input_ids"])
    (model / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=longest - 1)))
    sample = data["sample_id"][[len(x) for x in data["input_ids"]].index(longest)]
    ref = write_reference(data, tmp_path / "ref.parquet")
    needle = f"sample_id {sample}: {longest} tokens, more than the model's max_position_embeddings ({longest - 1}"
    assert_input_error(run_cli("compare", "--model", model, "--reference", ref, "--out", tmp_path / "run"),
                       f"error: {ref}: ", needle)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(sample_id=i, adapter=None, input_ids=list(map(int, x)))
                                                         for i, x in zip(data["sample_id"], data["input_ids"])])
    assert_input_error(run_cli("dump-reference", "--model", model, "--prompts", prompts, "--out",
                               tmp_path / "ref2.parquet"), f"error: {prompts}: ", needle)
    assert left_beside(tmp_path / "run") == [] and left_beside(tmp_path / "ref2.parquet") == []


def test_junit_is_none_of_the_run_folders_paths(art, tmp_path, no_model):
    """--junit equal to --out exited 3 (IsADirectoryError), leaving OUT and OUT.tmp-NNN; inside OUT, or OUT.lock or
    OUT.partial, it would be written where the run folder lives. Refused before anything runs, for mmlu too."""
    ref = write_reference(frame(art["seed"] + 21), tmp_path / "ref.parquet")
    out = tmp_path / "run"
    for junit, needle in [(out, "is the run folder of this run"), (out / "junit.xml", "lies inside the run folder"),
                          (tmp_path / "run.lock", "is the run's lock file"),
                          (tmp_path / "run.partial", "is the run's working folder")]:
        for command in (compare_cmd(art, out, ref), mmlu_cmd(art["model"], tmp_path / "data", out)):
            if junit.parent == out:
                out.mkdir()
            assert_input_error(run_cli(*command, "--junit", junit), "--junit", needle)
            if junit.parent == out:
                out.rmdir()
            assert not out.exists() and left_beside(out) == [], left_beside(out)


def mmlu_cmd(model, data, out, *extra) -> list:
    return ["mmlu", "--model", model, "--data", data, "--out", out, "--shots", "0", "--quiet", "--device", "cpu",
            *extra]


def test_outputs_that_are_links_fifos_or_not_ours_are_refused(art, tmp_path, no_model):
    """A dangling link as --out exited 3 (NotADirectoryError) leaving link.partial. A link is refused whole, naming it
    and its target: the run is renamed onto OUT (replacing the link, not filling its target) and its lock would lie
    beside the link, not beside the target. A fifo or device file is no file to write; OUT.lock or OUT.partial of
    the wrong kind is named, not crashed on."""
    ref = write_reference(frame(art["seed"] + 22), tmp_path / "ref.parquet")
    prompts = good_prompts(tmp_path / "prompts.jsonl", art["seed"] + 22)
    target = tmp_path / "elsewhere"
    (tmp_path / "folder").mkdir()
    dangling, linked, dump_link = tmp_path / "dangling", tmp_path / "linked", tmp_path / "dangling.parquet"
    dangling.symlink_to(target)
    linked.symlink_to(tmp_path / "folder")
    dump_link.symlink_to(tmp_path / "elsewhere.parquet")
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    lock_link = tmp_path / "locked"
    (tmp_path / "locked.lock").symlink_to(tmp_path / "victim")
    (tmp_path / "victim").write_text("the user's\n")
    (tmp_path / "staged.partial").write_text("a file\n")
    cases = [
        (compare_cmd(art, dangling, ref), ["--out", f"{dangling} is a symbolic link (to {target}, which does not "
                                           "exist)"]),
        (compare_cmd(art, linked, ref), ["--out", f"{linked} is a symbolic link (to {tmp_path / 'folder'})"]),
        (dump_args(art, prompts, dump_link), ["--out", f"{dump_link} is a symbolic link"]),
        (compare_cmd(art, tmp_path / "run", ref, "--junit", dangling), ["--junit", "is a symbolic link"]),
        (compare_cmd(art, tmp_path / "run", ref, "--junit", fifo), ["--junit", "not a regular file"]),
        (dump_args(art, prompts, fifo), ["--out", "not a regular file"]),
        (compare_cmd(art, lock_link, ref), ["--out", "locked.lock is a symbolic link"]),
        (compare_cmd(art, tmp_path / "staged", ref), ["--out", "staged.partial (the run's working folder) exists "
                                                      "and is not a folder"]),
    ]
    for command, needles in cases:
        assert_input_error(run_cli(*command), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ref.parquet", "prompts.jsonl", "folder", "dangling", "linked", "dangling.parquet", "fifo.parquet",
         "locked.lock", "victim", "staged.partial"])
    assert not any((tmp_path / "folder").iterdir()) and (tmp_path / "victim").read_text() == "the user's\n"


def overflowing_adapter(art, folder: Path) -> Path:
    """The test adapter with a finite lora_alpha so large that its deltas overflow float32."""
    shutil.copytree(art["adapter"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["lora_alpha"] = float(np.random.default_rng(art["seed"]).uniform(1, 9)) * 1e30
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def line_tokenizer_model(art, folder: Path) -> Path:
    """The test model with a tokenizer MMLU can use: a line a token, ' A'..' D' after 'Answer:' one token each."""
    from tests.test_mmlu import line_tokenizer

    shutil.copytree(art["model"], folder)
    line_tokenizer(folder)
    return folder


def write_mmlu(root: Path, rng) -> Path:
    (root / "test").mkdir(parents=True)
    rows = [[f"question {rng.integers(1000)} {i}", *(f"choice {rng.integers(100)}" for _ in range(4)),
             str(rng.choice(list("ABCD")))] for i in range(6)]
    (root / "test" / "global_facts_test.csv").write_text("".join(",".join(r) + "\n" for r in rows))
    return root


def test_logprobs_that_overflow_are_refused_naming_the_adapter(art, tmp_path):
    """A finite adapter whose numbers overflow in the compute dtype (lora_alpha 1e30 in float32): compare exited 1
    blaming k2 (and the gate on NaN), mmlu 0, diagnose picked its samples from NaN. Each exits 2 with one line naming
    the adapter's folder, a sample and the overflow, as dump-reference does, and leaves nothing."""
    big = overflowing_adapter(art, tmp_path / "big")
    model = line_tokenizer_model(art, tmp_path / "model")
    ref = write_reference(frame(art["seed"] + 23).assign(adapter="peft"), tmp_path / "ref.parquet")
    data = write_mmlu(tmp_path / "data", np.random.default_rng(art["seed"]))
    prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(sample_id="p1", adapter="peft", input_ids=x) for x in
                                                         random_sequences(1, VOCAB, seed=art["seed"], min_len=5)])
    common = ["--model", model, "--adapter", f"peft={big}", "--quiet", "--device", "cpu"]
    for command, sample in [(["compare", "--reference", ref, "--batch-tokens", "512"], "for sample "),
                            (["mmlu", "--data", data, "--shots", "0", "--batch-tokens", "512"],
                             "for global_facts question "),
                            (["diagnose", "--reference", ref, "--batch-tokens", "512"], "for sample "),
                            (["dump-reference", "--prompts", prompts], "for prompt p1")]:
        out = tmp_path / ("out.parquet" if command[0] == "dump-reference" else "out")
        assert_input_error(run_cli(*command, *common, "--out", out), f"error: {big}: ", "non-finite logprob",
                           sample, "under adapter 'peft' in float32", "overflows in the compute dtype")
        assert not out.exists() and left_beside(out) == [], (command[0], left_beside(out))


def test_diagnose_against_a_nan_model_leaves_no_dead_end(art, tmp_path):
    """--against-model with a NaN weight is found as side B loads, after the k2 pass finished units: OUT.partial was
    left, and the corrected command (another fingerprint) was refused by it. A run refused for its inputs takes back
    its working folder, parts included."""
    bad = tmp_path / "against"
    shutil.copytree(art["model"], bad)
    rng = np.random.default_rng(art["seed"] + 24)
    for path in bad.glob("*.safetensors"):
        tensors = load_file(str(path))
        name = sorted(k for k in tensors if k.endswith("mlp.gate.weight"))[-1]
        tensors[name].view(-1)[int(rng.integers(tensors[name].numel()))] = float("nan")
        save_file(tensors, str(path), metadata={"format": "pt"})
    ref = write_reference(frame(art["seed"] + 24).assign(adapter="peft"), tmp_path / "ref.parquet")
    out = tmp_path / "out"
    args = ["diagnose", "--model", art["model"], "--adapter", f"peft={art['adapter']}", "--reference", ref,
            "--out", out, "--quiet", "--device", "cpu", "--samples", "1"]
    assert_input_error(run_cli(*args, "--against-model", bad), str(bad), name, "must be finite")
    assert not out.exists() and left_beside(out) == []


def test_pt_references_only_in_the_documented_forms(art, tmp_path, no_model):
    """tokens an int exited 3 (TypeError); 2-D tensors padded to one length (token id -1, logprob 0.0) were scored as
    tokens (exit 1). Anything but a 1-D or 2-D tensor, a list of 1-D tensors or of per-sample lists is refused,
    naming the file and key (and the row, or the sample of a list of dicts)."""
    rng = np.random.default_rng(art["seed"] + 25)
    cut = rng.permutation([5, 7, 9])  # lengths: one row unpadded, two padded
    ids = [torch.tensor(x[:n]) for x, n in zip(random_sequences(3, VOCAB, seed=art["seed"] + 25, min_len=9), cut)]
    lps = [-torch.tensor(rng.uniform(0.1, 5, len(x) - 1), dtype=torch.float32) for x in ids]
    longest = max(len(x) for x in ids)
    padded_ids = torch.full((3, longest), -1, dtype=torch.long)
    padded_lps = torch.zeros(3, longest - 1)
    for i, (x, lp) in enumerate(zip(ids, lps)):
        padded_ids[i, :len(x)], padded_lps[i, :len(lp)] = x, lp
    short = next(i for i in range(3) if len(ids[i]) < longest)  # the first padded row
    cases = [
        (dict(tokens=int(ids[0][0]), training_logprobs=lps[0]), "tokens must be a tensor or a list, found int"),
        (dict(tokens=padded_ids, training_logprobs=padded_lps), f"tokens row {short} holds a negative token id: "
                                                                "padding"),
        (dict(tokens=padded_ids.clamp(min=0), training_logprobs=padded_lps),
         f"training_logprobs row {short} ends with logprobs of exactly 0.0: padding"),
        (dict(tokens=padded_ids[None], training_logprobs=padded_lps), "tokens is a 3-D tensor"),
        (dict(tokens=[ids[0], 3], training_logprobs=lps[:2]), "tokens mixes samples"),
        (dict(tokens=[], training_logprobs=[]), "tokens is empty"),
        (dict(tokens=None, training_logprobs=lps), "tokens must be a tensor or a list, found NoneType"),
        (dict(tokens=ids, training_logprobs={"a": lps[0]}), "training_logprobs must be a tensor or a list, found dict"),
        ([dict(tokens=ids[0], training_logprobs=lps[0]), dict(tokens="abc", training_logprobs=lps[1])],
         "sample 1: tokens must be a tensor or a list, found str"),
        (dict(tokens=[x.float() for x in ids], training_logprobs=lps), "input_ids must hold integer token ids"),
        (dict(tokens=[x.bool() for x in ids], training_logprobs=lps), "input_ids must hold integer token ids"),
        (dict(tokens=[[*x.tolist()[:-1], None] for x in ids], training_logprobs=lps), "found None"),
        (dict(tokens=[[*x.tolist()[:-1], 2**70] for x in ids], training_logprobs=lps), f"token id {2**70} is outside"),
    ]
    for i, (dump, needle) in enumerate(cases):
        path = tmp_path / f"dump{i}.pt"
        torch.save(dump, path)
        assert_input_error(run_cli(*compare_cmd(art, tmp_path / "run", f"base={path}")), f"error: {path}: ", needle)
    assert not (tmp_path / "run").exists() and left_beside(tmp_path / "run") == []
    # one final logprob of exactly 0.0 in samples of one length is a model's (float32 gives it), not padding
    same = torch.stack([x[:5] for x in ids])
    certain = torch.stack([lp[:4] for lp in lps])
    certain[:, -1] = 0.0
    torch.save(dict(tokens=same, training_logprobs=certain), tmp_path / "certain.pt")
    assert read_reference(tmp_path / "certain.pt", adapter="base")["logprobs"][0][-1] == 0.0


def test_ambiguous_prompts_are_refused(art, tmp_path, no_model):
    """A prompt line with both text and prompt (or input_ids and text) silently took one of them."""
    ids = random_sequences(1, VOCAB, seed=art["seed"] + 26, min_len=5)[0]
    for extra, needle in [(dict(text="hello world", prompt="what is it", response=" hello"), "both text and prompt"),
                          (dict(input_ids=ids, text="hello world"), "both input_ids and text"),
                          (dict(input_ids=ids, prompt="what", response=" it"), "both input_ids and prompt"),
                          (dict(input_ids=ids, response=" it"), "a response without a prompt")]:
        prompts = write_prompts(tmp_path / "prompts.jsonl", [dict(sample_id="ok", adapter=None, input_ids=ids),
                                                             dict(adapter=None, **extra)])
        out = tmp_path / "ref.parquet"
        assert_input_error(run_cli(*dump_args(art, prompts, out)), f"error: {prompts}: line 2: ", needle)
        assert not out.exists() and left_beside(out) == []


def test_an_input_error_is_the_only_line_under_launch(art, tmp_path):
    """compare --expert-parallel under lora-eval launch with a truncated adapter printed its notice 'shared prefixes
    are off' before the error line: notices come only once the inputs are checked."""
    from tests.test_distributed import finish, torchrun

    bad = tmp_path / "bad"
    shutil.copytree(art["adapter"], bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:int(np.random.default_rng(art["seed"]).integers(1, 7))])
    ref = write_reference(frame(art["seed"] + 27).assign(adapter="peft"), tmp_path / "ref.parquet")
    out = tmp_path / "out"
    code, stdout, stderr = finish(torchrun(2, ["compare", "--model", art["model"], "--adapter", f"peft={bad}",
                                               "--reference", ref, "--out", out, "--quiet", "--device", "cpu",
                                               "--expert-parallel"]))
    assert code == 2 and stdout == "", (code, stdout)
    assert stderr.splitlines() == [stderr.splitlines()[0]] and stderr.startswith(f"error: {weights}: "), stderr
    assert not out.exists() and left_beside(out) == []
