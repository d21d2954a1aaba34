"""RL frameworks' dump files read as references (lora_eval/inputs/frameworks/), with no model: each fixture is built
to the framework's published schema (the writer below names the source file and commit) from the same random samples
as a native Parquet file, and both read to the same frame; malformed files of each format are refused in one line;
pickles never execute; the temperature rules; `inspect --reference`; the export snippets of references/README.md.

Truth: random samples (fresh per seed), logprobs float32-exact so that the native Parquet (float32) and the
frameworks' float64 JSON / msgpack / tensors hold the same numbers.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import msgpack
import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from lora_eval.cli import cli
from lora_eval.errors import InputError
from lora_eval.inputs.references import read_reference, write_reference
from lora_eval.tasks.inspect_reference import describe_reference
from tests.cli_checks import assert_input_error
from tests.rl_dumps import (nemo_rl_file, prime_export_file, prime_rollouts_file, slime_rollout_file,
                             slime_train_file)

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LAYERS, TOP_K = 50, 3, 2


def samples(seed: int, count: int = 4, prompt: int = 3) -> list[dict]:
    """Random samples: N tokens, the first `prompt` of them the prompt; trainer and sampler logprobs (float32-exact,
    < 0), a response mask with a hole (a tool token), per-token temperatures, routes [N-1, L, K]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        size = int(rng.integers(prompt + 3, prompt + 9))
        n = size - 1
        mask = np.arange(n) >= prompt - 1  # position p scores token p+1: the response's tokens
        mask[int(rng.integers(prompt, n))] = False
        out.append(dict(
            ids=rng.integers(0, VOCAB, size), mask=mask,
            trainer=-rng.uniform(0.01, 6, n).astype(np.float32).astype(np.float64),
            sampler=-rng.uniform(0.01, 6, n).astype(np.float32).astype(np.float64),
            temperature=rng.uniform(0.5, 1.5, n), routes=rng.integers(0, 8, (n, LAYERS, TOP_K)), prompt=prompt))
    return out


def native(path: Path, rows: list[dict]) -> Path:
    return write_reference(pd.DataFrame(rows), path)


def same(got: pd.DataFrame, expected: pd.DataFrame):
    assert list(got.columns) == list(expected.columns)
    assert len(got) == len(expected) > 0
    for a, b in zip(got.to_dict("records"), expected.to_dict("records")):
        for key in ("sample_id", "adapter", "input_ids", "logprobs", "mask", "sampler_logprobs", "temperature"):
            assert a[key] == b[key], key
        if b["routed_experts"] is None:
            assert a["routed_experts"] is None
        else:
            assert a["routed_experts"].dtype == np.int32 and np.array_equal(a["routed_experts"], b["routed_experts"])


def row(path, i, t, logprobs, sampler=None, mask=None, temperature=None, routes=None, adapter="mine"):
    return dict(sample_id=f"{path}:{i}", adapter=adapter, input_ids=t["ids"].tolist(), logprobs=logprobs.tolist(),
                mask=(t["mask"] if mask is None else mask).tolist(),
                sampler_logprobs=None if sampler is None else sampler.tolist(), temperature=temperature,
                routed_experts=routes)


def response_only(t, values: np.ndarray, filler=0.0) -> np.ndarray:
    """What a slime reader gives for response-only values: the filler on the prompt's positions."""
    out = values.copy()
    out[:t["prompt"] - 1] = filler
    return out


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_nemo_rl_reads_as_the_same_samples_in_native_form(seed, tmp_path, nested):
    truth = samples(seed)
    path = nemo_rl_file(tmp_path / "train_data_step3.jsonl", truth, nested)
    expected = native(tmp_path / "native.parquet", [row(path, i, t, t["trainer"], t["sampler"], temperature=0.7)
                                                     for i, t in enumerate(truth)])
    same(read_reference(path, adapter="mine", temperature=0.7), read_reference(expected))
    renamed = path.rename(tmp_path / "dump.txt")  # by content, whatever its name
    assert read_reference(renamed, adapter="mine", temperature=0.7)["logprobs"][0] == truth[0]["trainer"].tolist()


def test_prime_rl_token_export_reads_as_native(seed, tmp_path):
    truth = samples(seed)
    path = prime_export_file(tmp_path / "rank_0.jsonl", truth)
    expected = native(tmp_path / "native.parquet", [row(path, i, t, t["trainer"], t["sampler"], temperature=1.0)
                                                     for i, t in enumerate(truth)])
    same(read_reference(path, adapter="mine", temperature=1.0), read_reference(expected))


def test_prime_rl_rollouts_read_as_native(seed, tmp_path):
    truth = samples(seed, count=5)
    path = prime_rollouts_file(tmp_path / "rank_0.bin", truth)
    expected = native(tmp_path / "native.parquet", [
        row(path, i, t, t["sampler"], temperature=t["temperature"].tolist(), routes=t["routes"])
        for i, t in enumerate(truth)])
    same(read_reference(path, adapter="mine"), read_reference(expected))
    assert describe_reference(path)["compared"] == "sampler"


@pytest.mark.parametrize("dump", ["rollout", "train"])
def test_slime_dumps_read_as_native(seed, tmp_path, dump):
    truth = samples(seed)
    if dump == "rollout":
        path = slime_rollout_file(tmp_path / "3.pt", truth)
        rows = [row(path, i, t, response_only(t, t["sampler"]), routes=t["routes"], temperature=0.8)
                for i, t in enumerate(truth)]
    else:
        path = slime_train_file(tmp_path / "3.pt", truth)
        rows = [row(path, i, t, response_only(t, t["trainer"]), response_only(t, t["sampler"]),
                    routes=t["routes"], temperature=0.8) for i, t in enumerate(truth)]
    same(read_reference(path, adapter="mine", temperature=0.8), read_reference(native(tmp_path / "n.parquet", rows)))


# ---- refusals ------------------------------------------------------------------------------------------------------


def edit_json_line(path: Path, **changes) -> Path:
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first.update(changes)
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    return path


def malformed(tmp_path: Path, truth) -> list[tuple[Path, str]]:
    """(file, a needle of its one-line refusal) for each format."""
    cases = []
    nemo = edit_json_line(nemo_rl_file(tmp_path / "nemo.jsonl", truth), input_lengths=[999])
    cases.append((nemo, "fewer than input_lengths = 999"))
    zeros = nemo_rl_file(tmp_path / "zeros.jsonl", [dict(t, trainer=t["trainer"] * 0) for t in truth])
    cases.append((zeros, "force_on_policy_ratio"))
    export = edit_json_line(prime_export_file(tmp_path / "export.jsonl", truth), schema_version=2)
    cases.append((export, "schema_version 2"))
    lines = prime_export_file(tmp_path / "null.jsonl", truth).read_text().splitlines()
    first = json.loads(lines[0])
    first["trainer_logprobs"][1 + int(np.flatnonzero(truth[0]["mask"])[-1])] = None  # on a scored token
    (tmp_path / "null.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]))
    cases.append((tmp_path / "null.jsonl", "trainer_logprobs is null"))
    rollouts = prime_rollouts_file(tmp_path / "rollouts.bin", truth)
    batches = msgpack.unpackb(rollouts.read_bytes())
    batches[0][5][0] += 1  # sequence_lengths disagree with position_ids
    (tmp_path / "lengths.bin").write_bytes(msgpack.packb(batches, use_bin_type=True))
    cases.append((tmp_path / "lengths.bin", "sequence_lengths says"))
    (tmp_path / "cut.bin").write_bytes(rollouts.read_bytes()[:40])
    cases.append((tmp_path / "cut.bin", "not a readable msgpack file"))
    slime = slime_rollout_file(tmp_path / "slime.pt", truth)
    data = torch.load(slime, weights_only=True)
    data["samples"][1]["rollout_log_probs"] = data["samples"][1]["rollout_log_probs"][:-1]
    torch.save(data, tmp_path / "short.pt")
    cases.append((tmp_path / "short.pt", "expected response_length"))
    data["samples"][1]["rollout_log_probs"] = [0.5] * data["samples"][1]["response_length"]
    torch.save(data, tmp_path / "positive.pt")
    cases.append((tmp_path / "positive.pt", "rollout_log_probs must hold finite numbers <= 0"))
    train = torch.load(slime_train_file(tmp_path / "train.pt", truth), weights_only=True)
    train["samples"][0]["rollout_routed_experts"] = train["samples"][0]["rollout_routed_experts"][:-1]
    torch.save(train, tmp_path / "routes.pt")
    cases.append((tmp_path / "routes.pt", "expected len(input_ids)-1"))
    (tmp_path / "text.bin").write_text("hello")
    cases.append((tmp_path / "text.bin", "not a reference file lora-eval reads; tried native Parquet"))
    return cases


def test_malformed_files_of_each_format_are_refused_in_one_line(seed, tmp_path):
    for path, needle in malformed(tmp_path, samples(seed)):
        with pytest.raises(InputError) as caught:
            read_reference(path, adapter="mine", temperature=1.0)
        message = str(caught.value)
        assert str(path) in message and needle in message and "\n" not in message, (path, message)


def test_inspect_refuses_a_malformed_file_with_exit_2(seed, tmp_path):
    path, needle = malformed(tmp_path, samples(seed))[0]
    assert_input_error(CliRunner().invoke(cli, ["inspect", "--reference", str(path)]), str(path), needle)


class Payload:
    """Pickled, it asks to create `marker` when loaded: a file appearing means the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_pickle_payload_never_executes(tmp_path):
    marker = tmp_path / "marker"
    payload = pickle.dumps(dict(samples=[Payload(marker)]), protocol=4)
    files = [tmp_path / name for name in ("gen_batch.dp", "dump.pt", "rank_0.bin", "ref.jsonl", "ref.parquet")]
    for path in files:
        path.write_bytes(payload)
    torch.save(dict(rollout_id=1, samples=[dict(tokens=[1, 2], meta=Payload(marker))]), tmp_path / "zip.pt")
    torch.save(dict(samples=[Payload(marker)]), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for path in [*files, tmp_path / "zip.pt", tmp_path / "legacy.pt"]:
        with pytest.raises(InputError, match="refused: not a plain tensor file"):
            read_reference(path, adapter="mine", temperature=1.0)
        with pytest.raises(InputError, match="refused"):
            describe_reference(path)
        assert not marker.exists(), path
    pickle.loads(payload)  # the payload is live: loading it the unsafe way does create the marker
    assert marker.exists()


def test_refusals_of_verl_and_miles_point_at_the_export(tmp_path):
    dataproto = tmp_path / "gen_batch.dp"  # pickle.dump(DataProto): its class is named near the start
    dataproto.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\rverl.protocol\x94\x8c\tDataProto\x94")
    with pytest.raises(InputError, match=r"a pickled verl DataProto.*references/README.md \(verl\)"):
        read_reference(dataproto, adapter="mine")
    miles = tmp_path / "miles.pt"
    torch.save(dict(rollout_id=1, samples=[dict(tokens=[1, 2, 3], rollout_routed_experts=np.zeros((2, 1, 1)))]),
               miles)
    with pytest.raises(InputError, match=r"numpy.*will not unpickle.*references/README.md \(miles\)"):
        read_reference(miles, adapter="mine")


# ---- temperature rules -----------------------------------------------------------------------------------------


def test_a_framework_file_without_its_temperature_is_refused_naming_the_setting(seed, tmp_path):
    truth = samples(seed)
    for path, key in [(nemo_rl_file(tmp_path / "n.jsonl", truth), "policy.generation.temperature"),
                      (prime_export_file(tmp_path / "p.jsonl", truth), "sampling.temperature"),
                      (slime_train_file(tmp_path / "s.pt", truth), "--rollout-temperature")]:
        with pytest.raises(InputError, match=re.escape(key) + r".*--temperature 1.0 if it was 1"):
            read_reference(path, adapter="mine")
    assert read_reference(tmp_path / "n.jsonl", adapter="mine", temperature=0.7)["temperature"].tolist() == \
        [0.7] * len(truth)


def test_recorded_temperatures_conflicting_with_the_given_one_are_refused(seed, tmp_path):
    truth = samples(seed)
    rollouts = prime_rollouts_file(tmp_path / "r.bin", truth)
    with pytest.raises(InputError, match="records temperature .* but --temperature 0.9 was given"):
        read_reference(rollouts, adapter="mine", temperature=0.9)
    path = native(tmp_path / "n.parquet", [row("n", i, t, t["trainer"], temperature=0.7 if i else None)
                                           for i, t in enumerate(truth)])
    with pytest.raises(InputError, match="records temperature 0.7 but --temperature 1.2 was given"):
        read_reference(path, temperature=1.2)
    filled = read_reference(path, temperature=0.7)["temperature"].tolist()  # agrees, and fills the row without one
    assert filled == [0.7] * len(truth)
    assert read_reference(path)["temperature"].tolist() == [None] + [0.7] * (len(truth) - 1)  # None: T = 1


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_native_temperatures_and_routes_round_trip(seed, tmp_path, suffix):
    truth = samples(seed)
    rows = [row("n", 0, truth[0], truth[0]["trainer"], temperature=0.6, routes=truth[0]["routes"]),
            row("n", 1, truth[1], truth[1]["trainer"], temperature=truth[1]["temperature"].tolist()),
            row("n", 2, truth[2], truth[2]["trainer"], routes=truth[2]["routes"])]
    path = tmp_path / f"ref{suffix}"
    if suffix == ".parquet":
        native(path, rows)
    else:
        path.write_text("".join(json.dumps({**r, "routed_experts": None if r["routed_experts"] is None
                                            else r["routed_experts"].tolist()}) + "\n" for r in rows))
    got = read_reference(path)
    first = 0.6 if suffix == ".jsonl" else [0.6] * (len(truth[0]["ids"]) - 1)  # Parquet: one list column for all
    assert got["temperature"].tolist() == [first, truth[1]["temperature"].tolist(), None]
    assert np.array_equal(got["routed_experts"][0], truth[0]["routes"]) and got["routed_experts"][1] is None
    assert np.array_equal(got["routed_experts"][2], truth[2]["routes"]) and got["routed_experts"][2].dtype == np.int32
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        assert str(pq.read_schema(path).field("temperature").type) == "list<element: double>"
        scalar = native(tmp_path / "scalar.parquet", [rows[0], rows[2]])
        assert str(pq.read_schema(scalar).field("temperature").type) == "double"
        assert read_reference(scalar)["temperature"].tolist() == [0.6, None]


def test_bad_temperatures_and_routes_are_refused(seed, tmp_path):
    t = samples(seed)[0]
    n = len(t["ids"]) - 1
    cases = [(dict(temperature=0.0), "temperature must be finite and > 0"),
             (dict(temperature=[1.0] * (n - 1)), "temperature has"),
             (dict(temperature=[1.0] * (n - 1) + [float("nan")]), f"at position {n - 1}"),
             (dict(routed_experts=t["routes"][:-1].tolist()), "expected len(input_ids)-1"),
             (dict(routed_experts=(-t["routes"]).tolist()), "expert ids are integers >= 0"),
             (dict(routed_experts=t["routes"].astype(float).tolist()), "of floats"),
             (dict(routed_experts=[[[1, 2]], [[1]]] + [[[1, 2]]] * (n - 2)), "rows of one length")]
    for change, needle in cases:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({**row("n", 0, t, t["trainer"]), "routed_experts": None, **change}) + "\n")
        with pytest.raises(InputError, match=re.escape(needle)):
            read_reference(path)
    other = samples(seed + 1)[1]
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps({**row("n", i, s, s["trainer"]), "routed_experts": r}) + "\n" for i, (s, r) in
                            enumerate([(t, t["routes"].tolist()), (other, other["routes"][:, :2].tolist())])))
    with pytest.raises(InputError, match="a file's routes come from one model"):
        read_reference(path)


# ---- inspect --reference -----------------------------------------------------------------------------------------


def test_inspect_reference_says_what_it_found(seed, tmp_path):
    truth = samples(seed, count=3)
    path = slime_train_file(tmp_path / "3.pt", truth)
    result = CliRunner().invoke(cli, ["inspect", "--reference", str(path)])
    assert result.exit_code == 0, result.output
    n = sum(len(t["ids"]) for t in truth)
    scored = sum(int(t["mask"].sum()) for t in truth)
    assert f"samples: 3, tokens: {n}, scored tokens: {scored}" in result.stdout
    assert "format: slime train dump" in result.stdout and "THUDM/slime @ 624b824" in result.stdout
    assert "sides: trainer, sampler; compared: trainer" in result.stdout
    assert "not recorded: compare needs --temperature T (the run's --rollout-temperature)" in result.stdout
    assert f"3 samples, {n - 3} rows x {LAYERS} layers x top-{TOP_K}" in result.stdout
    rollouts = describe_reference(prime_rollouts_file(tmp_path / "r.bin", truth))
    temps = np.concatenate([t["temperature"] for t in truth])
    assert rollouts["temperature"] == dict(kind="per token", samples=3, min=temps.min(), max=temps.max(), needs=None)
    assert rollouts["sides"] == ["sampler"] and rollouts["adapters"] is None


# ---- the export snippets of references/README.md ---------------------------------------------------------------


def snippet(heading: str) -> str:
    """The ```python block under `heading` in references/README.md."""
    text = (ROOT / "references" / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_verl_export_snippet_gives_our_parquet(seed, tmp_path, monkeypatch):
    """The snippet, run as the user runs it (verl importable there), on a DataProto-like object pickled here: a
    trusted file of the test's own."""
    truth = samples(seed, count=3)
    p, r = 4, max(len(t["ids"]) for t in truth) - 3 + 1
    batch = dict(prompts=torch.zeros(3, p, dtype=torch.long), responses=torch.zeros(3, r, dtype=torch.long),
                 response_mask=torch.zeros(3, r, dtype=torch.long), rollout_log_probs=torch.zeros(3, r),
                 old_log_probs=torch.zeros(3, r), attention_mask=torch.zeros(3, p + r, dtype=torch.long),
                 routed_experts=torch.zeros(3, p + r, LAYERS, TOP_K, dtype=torch.int16))
    for i, t in enumerate(truth):  # left-padded prompts, right-padded responses
        size, plen = len(t["ids"]), t["prompt"]
        rl = size - plen
        batch["prompts"][i, p - plen:] = torch.tensor(t["ids"][:plen])
        batch["responses"][i, :rl] = torch.tensor(t["ids"][plen:])
        batch["response_mask"][i, :rl] = torch.tensor(t["mask"][plen - 1:].astype(int))
        batch["rollout_log_probs"][i, :rl] = torch.tensor(t["sampler"][plen - 1:])
        batch["old_log_probs"][i, :rl] = torch.tensor(t["trainer"][plen - 1:])
        batch["attention_mask"][i, p - plen:p + rl] = 1
        batch["routed_experts"][i, p - plen:p - plen + size - 1] = torch.tensor(t["routes"])
    (tmp_path / "gen_batch.dp").write_bytes(pickle.dumps(_DataProto(batch)))
    monkeypatch.chdir(tmp_path)
    exec(snippet("### verl"), {})
    expected = [row("gen_batch.dp", i, t, response_only(t, t["trainer"]), response_only(t, t["sampler"]),
                    temperature=1.0, routes=t["routes"], adapter=None) for i, t in enumerate(truth)]
    same(read_reference(tmp_path / "reference.parquet"), read_reference(native(tmp_path / "n.parquet", expected)))


class _DataProto:
    def __init__(self, batch):
        self.batch = batch


def test_the_miles_export_snippet_gives_our_parquet(seed, tmp_path, monkeypatch):
    truth = samples(seed, count=3)
    out = []
    for i, t in enumerate(truth):
        r = len(t["ids"]) - t["prompt"]
        out.append(dict(index=i, tokens=t["ids"].tolist(), response_length=r,
                        loss_mask=t["mask"][-r:].astype(int).tolist(), rollout_log_probs=t["sampler"][-r:].tolist(),
                        rollout_routed_experts=t["routes"].astype(np.int32)))
    torch.save(dict(rollout_id=3, metadata={}, samples=out), tmp_path / "3.pt")
    monkeypatch.chdir(tmp_path)
    exec(snippet("### miles"), {})
    expected = [row("3.pt", i, t, response_only(t, t["sampler"]), temperature=1.0, routes=t["routes"],
                    adapter=None) for i, t in enumerate(truth)]
    same(read_reference(tmp_path / "reference.parquet"), read_reference(native(tmp_path / "n.parquet", expected)))


def test_framework_files_need_the_adapter_named(seed, tmp_path):
    """No framework's file names its adapter: as for a serving-engine .pt, NAME=FILE says whose logprobs they are."""
    truth = samples(seed)
    for path, temperature in ((nemo_rl_file(tmp_path / "n.jsonl", truth), 1.0),
                              (prime_rollouts_file(tmp_path / "r.bin", truth), None),  # (it records its own)
                              (slime_rollout_file(tmp_path / "s.pt", truth), 1.0)):
        with pytest.raises(InputError, match=f"has no adapter column: give it as NAME={path.name}"):
            read_reference(path, temperature=temperature)
        assert read_reference(path, adapter="base", temperature=temperature)["adapter"].isna().all()


def test_inspect_needs_a_model_or_a_reference():
    for args, line in [(["inspect"], "error: Missing option '--model' or '--reference'."),
                       (["inspect", "--reference", "r.jsonl", "--adapter", "a=b"], "error: Missing option '--model'.")]:
        assert_input_error(CliRunner().invoke(cli, args), line)
