"""The engine's sampling temperature and recorded routes against transformers + PEFT in float32 (CPU).

- temperature: the engine's logprobs of a batch with per-row and per-position temperatures equal
  log_softmax(logits / T) of the PEFT oracle; with shared prefixes the same as without (the prefix cache keys the
  prefix's temperatures: two rows sharing tokens but not temperatures get each their own);
- routes: the experts the engine records per MoE layer equal transformers' own router top-k (a forward hook on each
  layer's gate), and the routing weights its scores;
- results/routing.route_flips on hand-made sets: order within the k does not count, a flip's weight is the engine's
  weight outside the sampler's set;
- through compare (CLI): a reference dumped at T = 0.7 compares at k2 <= 1e-10, and the same file without its
  temperature column fails; routes recorded from transformers' own routers give 0 flips, and routes changed at a
  known share of (position, layer) pairs report exactly that share (summary, routing.csv, JUnit) and fail
  --max-routing-flip-rate; routes that do not fit the model exit 2 in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from lora_eval.cli import cli
from lora_eval.engine.engine import Batch, Engine
from lora_eval.errors import InputError
from lora_eval.inputs.references import read_reference, write_reference
from lora_eval.results.routing import route_flips
from lora_eval.results.tables import read_run
from tests.builders import load_hf, peft_oracle, random_sequences, save_random_peft_adapter
from tests.cli_checks import assert_input_error
from tests.conftest import CPU

VOCAB = 96
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(moe_model, tmp_path_factory, session_seed):
    adapter = save_random_peft_adapter(moe_model, tmp_path_factory.mktemp("peft") / "a", seed=session_seed + 1,
                                       r=4, lora_alpha=8, target_modules="all-linear")
    engine = Engine.load(moe_model, {"a": adapter}, CPU)
    return moe_model, adapter, engine


@torch.no_grad()
def _oracle(model, seq, temps):
    """log_softmax(logits / T)[next token] of one sequence; temps [len-1]."""
    ids = torch.tensor([seq])
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [L-1, V]
    return torch.log_softmax(logits / torch.tensor(temps)[:, None], -1).gather(1, ids[0, 1:, None])[:, 0]


def test_temperature_matches_the_tempered_oracle(setup, seed):
    model_dir, adapter, engine = setup
    seqs = random_sequences(4, VOCAB, seed=seed, min_len=6, max_len=14)
    g = torch.Generator().manual_seed(seed)
    per_token = (0.4 + torch.rand(len(seqs[3]) - 1, generator=g)).tolist()
    temps = [0.7, None, 1.3, per_token]
    tags = ["a", None, "a", None]
    got = engine.logprobs(Batch(seqs, tags, temperatures=temps))
    plain = engine.logprobs(Batch(seqs, tags))
    oracles = {None: load_hf(model_dir), "a": peft_oracle(model_dir, adapter)}
    for seq, tag, t, lp, lp1 in zip(seqs, tags, temps, got, plain):
        t = [1.0] * (len(seq) - 1) if t is None else [t] * (len(seq) - 1) if isinstance(t, float) else t
        ref = _oracle(oracles[tag], seq, t)
        assert (lp - ref).abs().max().item() < TOL
        if any(x != 1 for x in t):
            assert (lp - lp1).abs().max().item() > 1e-2  # the temperature was used
        else:
            assert torch.equal(lp, lp1)


def test_temperature_with_shared_prefixes(setup, seed):
    """Rows sharing 8 leading tokens: prefix reuse gives the whole-row numbers, also when the rows' temperatures
    differ over the prefix (each gets its own prefix pass), per row or per position."""
    _, _, engine = setup
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB, (8,), generator=g).tolist()
    seqs = [head + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 5, 4)]
    seqs.append(seqs[2])  # the same tokens at other temperatures: its own prefix pass
    per_token = (0.5 + torch.rand(len(seqs[3]) - 1, generator=g)).tolist()
    temps = [0.6, 0.6, 1.4, per_token]
    whole = engine.logprobs(Batch(seqs, ["a"] * 4, temperatures=temps))
    shared = engine.logprobs(Batch(seqs, ["a"] * 4, prefixes=[7] * 4, temperatures=temps))
    assert (whole[2] - whole[3]).abs().max().item() > 1e-2
    for w, s in zip(whole, shared):
        assert (w - s).abs().max().item() < TOL


def test_bad_temperatures_are_refused():
    with pytest.raises(InputError, match="above 0"):
        Batch([[1, 2, 3]], [None], temperatures=[0.0])
    with pytest.raises(InputError, match="2 predicted positions"):
        Batch([[1, 2, 3]], [None], temperatures=[[0.5, 0.5, 0.5]])


def test_recorded_routes_are_transformers_routes(setup, seed):
    """The engine's recorded experts and weights per MoE layer (layer 1 is dense: not recorded) against the
    transformers model's own router (hooked), for a base row and an adapter row (the adapter's router LoRA moves
    its routes)."""
    model_dir, adapter, engine = setup
    seqs = random_sequences(2, VOCAB, seed=seed, min_len=8, max_len=12)
    (lps, routes) = engine.logprobs(Batch(seqs, [None, "a"], routes=True))
    plain = engine.logprobs(Batch(seqs, [None, "a"]))
    for oracle, seq, (ids, weights), lp, lp1 in zip([load_hf(model_dir), peft_oracle(model_dir, adapter)], seqs,
                                                      routes, lps, plain):
        assert torch.equal(lp, lp1)
        seen = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out))
                 for name, m in oracle.named_modules() if name.endswith("mlp.gate")]
        with torch.no_grad():
            oracle(input_ids=torch.tensor([seq]), use_cache=False)
        for h in hooks:
            h.remove()
        assert ids.shape == (len(seq) - 1, len(seen), engine.model.args.top_k)
        for layer, (_, scores, indices) in enumerate(seen):
            want = indices[:-1].sort(-1)  # [n, k]: the last position predicts nothing
            order = ids[:, layer].sort(-1)
            assert torch.equal(order.values, want.values)
            got_w = weights[:, layer].gather(1, order.indices)
            assert (got_w - scores[:-1].gather(1, want.indices)).abs().max().item() < TOL


def test_routes_with_shared_prefixes(setup, seed):
    """Rows sharing 9 leading tokens: their routes (the prefix's from its pass, cached with them) equal the whole
    rows' experts, their weights and logprobs within rounding (the suffix attends to the cached keys and values); a
    prefix cached without routes is not served to a batch that asks for them."""
    _, _, engine = setup
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    seqs = [head + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 2, 6)]
    engine.logprobs(Batch(seqs, ["a"] * 3, prefixes=[8, 8, 8]))  # the prefix cached without routes
    whole_lp, whole = engine.logprobs(Batch(seqs, ["a"] * 3, routes=True))
    shared_lp, shared = engine.logprobs(Batch(seqs, ["a"] * 3, prefixes=[8, 8, 8], routes=True))
    for (wi, ww), (si, sw), wl, sl in zip(whole, shared, whole_lp, shared_lp):
        assert si.shape == wi.shape and torch.equal(si, wi)
        assert (sw - ww).abs().max().item() < TOL and (wl - sl).abs().max().item() < TOL


def test_route_flips_on_known_sets():
    engine_ids = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [n=2, L=2, k=2]
    weights = np.array([[[0.5, 0.5], [0.9, 0.1]], [[0.25, 0.75], [1.0, 0.0]]])
    sampler = np.array([[[1, 0], [2, 4]], [[5, 6], [0, 1]]])  # same set, one of two, one of two, none
    flip, weight = route_flips(engine_ids, weights, sampler)
    assert flip.tolist() == [[False, True], [True, True]]
    assert np.allclose(weight, [[0.0, 0.1], [0.25, 1.0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_temperature_and_routes_at_published_widths_on_the_gpu(tmp_path, session_seed):
    """Qwen3-30B-A3B's published widths (2 layers: vocabulary 151,936, 128 experts, top-8), float32 on the GPU: the
    Triton path (fused logprob kernel with per-position temperatures, graphs on, routes recorded eagerly) against
    the torch path on the same GPU. Temperatures: per row and per position; routes: the same experts but at exact
    ties (none expected in float32 at random weights: at most 1 in 1,000 (position, layer) pairs)."""
    from lora_eval.engine.engine import EngineOptions
    from tests.test_real_shapes_gpu import SPECS, write_model

    model_dir, adapters, vocab = write_model(SPECS["qwen3-30b-a3b"], tmp_path, session_seed)
    g = torch.Generator().manual_seed(session_seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (700, 300, 1200, 90)]
    tags = [None, "a", "a", None]
    temps = [0.7, (0.3 + torch.rand(299, generator=g)).tolist(), 1.0, 1.6]
    engines = {backend: Engine.load(model_dir, {"a": adapters["a"]}, EngineOptions(
        device="cuda", dtype="float32", backend=backend)) for backend in ("triton", "torch")}
    got = {b: e.logprobs(Batch(seqs, tags, temperatures=temps)) for b, e in engines.items()}
    for t, r in zip(got["triton"], got["torch"]):
        assert (t - r).abs().max().item() < 2e-3
    plain = engines["triton"].logprobs(Batch(seqs, tags))
    assert (got["triton"][0] - plain[0]).abs().max().item() > 1e-2  # the temperature was used
    routes = {b: e.logprobs(Batch(seqs, tags, routes=True)) for b, e in engines.items()}
    pairs = flips = 0
    for (ti, tw), (ri, rw), lp, lp_plain in zip(routes["triton"][1], routes["torch"][1], routes["triton"][0], plain):
        assert ti.shape == (len(lp), 2, 8)
        assert (lp - lp_plain).abs().max().item() < 2e-3  # the eager route-recording forward = the graph replay's
        flip, _ = route_flips(ti.numpy(), tw.numpy(), ri.numpy())
        pairs, flips = pairs + flip.size, flips + int(flip.sum())
    assert flips <= pairs / 1000


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@torch.no_grad()
def _hf_routes(model, seq) -> np.ndarray:
    """transformers' own routing of `seq`: [len-1, MoE layers, k] expert ids (forward hooks on every gate)."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(out[2]))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    model(input_ids=torch.tensor([seq]), use_cache=False)
    for h in hooks:
        h.remove()
    return torch.stack([ids[:-1] for ids in seen], 1).numpy()  # [n, L, k]


@pytest.fixture(scope="module")
def tempered(setup, tmp_path_factory, session_seed):
    """A reference of base and adapter rows dumped by dump-reference (transformers + PEFT) at T = 0.7, its rows
    carrying transformers' routes, and with a mask."""
    model_dir, adapter, _ = setup
    folder = tmp_path_factory.mktemp("tempered")
    seqs = random_sequences(6, VOCAB, seed=session_seed + 5, min_len=8, max_len=20)
    prompt = random_sequences(1, VOCAB, seed=session_seed + 6, min_len=34, max_len=34)[0]
    seqs += [prompt + s[:5] for s in seqs[:2]]  # an RL group: two completions of one prompt (a shared prefix)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(dict(sample_id=f"s{i}", input_ids=s, adapter="a" if i % 2 or i > 5 else None,
                                               mask=[j % 3 != 0 for j in range(len(s) - 1)])) + "\n"
                               for i, s in enumerate(seqs)))
    out = folder / "ref.parquet"
    result = _run("dump-reference", "--model", model_dir, "--adapter", f"a={adapter}", "--prompts", prompts,
                  "--out", out, "--temperature", 0.7, "--quiet", "--device", "cpu", "--dtype", "float32")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    frame = read_reference(out)
    oracles = {None: load_hf(model_dir), "a": peft_oracle(model_dir, adapter)}
    frame["routed_experts"] = [_hf_routes(oracles[a if isinstance(a, str) else None], list(ids)).tolist()
                               for a, ids in zip(frame["adapter"], frame["input_ids"])]
    return folder, frame


def _write_jsonl(frame: pd.DataFrame, path):
    def plain(v):
        return v.tolist() if hasattr(v, "tolist") else None if isinstance(v, float) and np.isnan(v) else v

    rows = frame.drop(columns=[c for c in frame.columns if frame[c].isna().all()]).to_dict("records")
    path.write_text("".join(json.dumps({k: plain(v) for k, v in r.items()}) + "\n" for r in rows))
    return path


def _compare(setup, ref, out, *extra):
    model_dir, adapter, _ = setup
    return _run("compare", "--model", model_dir, "--adapter", f"a={adapter}", "--reference", ref, "--out", out,
                "--quiet", "--device", "cpu", "--dtype", "float32", *extra)


def test_a_tempered_reference_compares_only_at_its_temperature(setup, tempered, tmp_path):
    folder, frame = tempered
    assert set(frame["temperature"]) == {0.7}
    ref = _write_jsonl(frame, tmp_path / "ref.jsonl")
    result = _compare(setup, ref, tmp_path / "run", "--max-k2", 1e-10)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert (summary["k2"] <= 1e-10).all()
    dropped = _write_jsonl(frame.drop(columns=["temperature"]), tmp_path / "dropped.jsonl")
    result = _compare(setup, dropped, tmp_path / "run2", "--max-k2", 1e-10)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert (pd.read_csv(tmp_path / "run2" / "summary.csv")["k2"] > 1e-4).all()
    conflicting = _compare(setup, ref, tmp_path / "run3", "--temperature", 1.0)
    assert_input_error(conflicting, str(ref), "temperature")


def test_routes_equal_to_the_engines_report_no_flip(setup, tempered, tmp_path):
    _, frame = tempered
    ref = _write_jsonl(frame, tmp_path / "ref.jsonl")
    result = _compare(setup, ref, tmp_path / "run", "--max-routing-flip-rate", 0)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert (summary["routing_flip_rate"] == 0).all() and (summary["routing_flip_weight"] == 0).all()
    routing = pd.read_csv(tmp_path / "run" / "routing.csv")
    assert sorted(set(routing["layer"])) == [0, 2]  # layer 1 is dense
    assert (routing["flips"] == 0).all()
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["prefix_cache"]["rows_with_prefix"] == 2  # the group's routes: its prefix pass's, then its own


def test_changed_routes_report_their_share(setup, tempered, tmp_path, seed):
    """Layer 2's routes changed at random scored positions of every sample (one chosen expert replaced by one
    outside the set): the flip rate is exactly changed / (scored positions x 2 MoE layers)."""
    _, frame = tempered
    rng = np.random.default_rng(seed)
    frame = frame.copy()
    changed = scored = 0
    routes = []
    for r, mask in zip(frame["routed_experts"], frame["mask"]):
        r = np.array(r)  # [n, 2, k]
        for p in range(len(r)):
            if rng.random() < 0.4:
                outside = [e for e in range(6) if e not in r[p, 1]]
                r[p, 1, 0] = outside[0]
                changed += int(mask[p])
        scored += int(np.sum(mask))
        routes.append(r.tolist())
    frame["routed_experts"] = routes
    ref = _write_jsonl(frame, tmp_path / "ref.jsonl")
    share = changed / (2 * scored)
    result = _compare(setup, ref, tmp_path / "run", "--max-routing-flip-rate", share / 2, "--junit",
                      tmp_path / "junit.xml")
    assert result.exit_code == 1, (result.stdout, result.stderr)
    summary = pd.read_csv(tmp_path / "run" / "summary.csv").set_index("adapter")
    assert summary.loc["overall", "routing_flip_rate"] == pytest.approx(share, rel=1e-12)
    assert summary.loc["overall", "routing_flip_weight"] > 0
    assert "routing_flip_rate >" in summary.loc["overall", "failed"]
    routing = pd.read_csv(tmp_path / "run" / "routing.csv").set_index(["adapter", "layer"])
    assert routing.loc[("overall", 2), "flips"] == changed and routing.loc[("overall", 0), "flips"] == 0
    junit = (tmp_path / "junit.xml").read_text()
    assert "routing_flip_rate &lt;=" in junit and "overall: routing_flip_rate =" in junit
    for report in ("report.md", "report.html"):
        text = (tmp_path / "run" / report).read_text()
        assert "Routing against the sampler's routed experts" in text and "routing_flip_rate" in text
    reread = read_run(tmp_path / "run")  # the tables read back as written
    assert reread.routing.set_index(["adapter", "layer"]).loc[("overall", 2), "flips"] == changed


def test_routes_that_do_not_fit_the_model_exit_2(setup, tempered, tmp_path):
    _, frame = tempered
    wide = frame.copy()
    wide["routed_experts"] = [np.array(r)[:, :, :1].tolist() for r in frame["routed_experts"]]  # top-1
    result = _compare(setup, _write_jsonl(wide, tmp_path / "k1.jsonl"), tmp_path / "run")
    assert_input_error(result, "k1.jsonl", "routed_experts holds 1 experts per token")
    big = frame.copy()
    big["routed_experts"] = [(np.array(r) + 6).tolist() for r in frame["routed_experts"]]
    result = _compare(setup, _write_jsonl(big, tmp_path / "e.jsonl"), tmp_path / "run")
    assert_input_error(result, "e.jsonl", "outside the model's 6 experts")


@pytest.mark.parametrize("framework", ["nemo_rl", "prime_rl_rollouts", "slime_train"])
def test_a_framework_dump_compares_as_its_native_twin(setup, tempered, tmp_path, framework):
    """The tempered reference's adapter rows written as the framework writes them (tests/rl_dumps.py, each writer
    naming its source) and, independently, as a native file of the same samples: compare gives the same summary,
    routing table and scored tokens (sample ids aside: the framework's are positions in its file)."""
    from tests.rl_dumps import nemo_rl_file, prime_rollouts_file, slime_train_file

    _, frame = tempered
    rows = frame[frame["adapter"] == "a"].reset_index(drop=True)
    prompt = 3  # slime's response starts after it: the positions before score nothing there
    truth = []
    for ids, lp, mask, routes in zip(rows["input_ids"], rows["logprobs"], rows["mask"], rows["routed_experts"]):
        n = len(ids) - 1
        mask = np.array(mask, dtype=bool) & (np.arange(n) >= prompt - 1)
        truth.append(dict(ids=np.array(ids), mask=mask, trainer=np.array(lp),
                          sampler=(np.array(lp) - 1e-3).astype(np.float32).astype(np.float64),  # (as Parquet holds it)
                          temperature=np.full(n, 0.7), routes=np.array(routes), prompt=prompt))
    write = {"nemo_rl": nemo_rl_file, "prime_rl_rollouts": prime_rollouts_file, "slime_train": slime_train_file}
    dump = write[framework](tmp_path / f"{framework}.dump", truth)
    compared = "sampler" if framework == "prime_rl_rollouts" else "trainer"
    twin = pd.DataFrame([dict(
        sample_id=f"t{i}", adapter="a", input_ids=t["ids"].tolist(), logprobs=t[compared].tolist(),
        mask=t["mask"].tolist(), sampler_logprobs=None if compared == "sampler" else t["sampler"].tolist(),
        temperature=0.7 if framework != "prime_rl_rollouts" else t["temperature"].tolist(),
        routed_experts=None if framework == "nemo_rl" else t["routes"]) for i, t in enumerate(truth)])
    native = write_reference(twin, tmp_path / "twin.parquet")
    extra = () if framework == "prime_rl_rollouts" else ("--temperature", 0.7)
    for name, ref in (("framework", f"a={dump}"), ("native", native)):
        result = _compare(setup, ref, tmp_path / name, *extra)
        assert result.exit_code == 0, (result.stdout, result.stderr)
    read = {name: (pd.read_csv(tmp_path / name / "summary.csv"),
                   pd.read_parquet(tmp_path / name / "tokens.parquet").query("mask").drop(columns="sample_id"))
            for name in ("framework", "native")}
    pd.testing.assert_frame_equal(read["framework"][0], read["native"][0])
    pd.testing.assert_frame_equal(read["framework"][1].reset_index(drop=True),
                                  read["native"][1].reset_index(drop=True))
    if framework != "nemo_rl":
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "framework" / "routing.csv"),
                                      pd.read_csv(tmp_path / "native" / "routing.csv"))


def test_diagnose_picks_samples_by_k2_at_the_references_temperature(setup, tempered, tmp_path):
    """diagnose's sample-picking k2 is taken at the reference's temperature: the dump made at T = 0.7 gives k2 ~ 0
    for every sample it picks (at T = 1 they would be far off: test_a_tempered_reference_...)."""
    from lora_eval.tasks.diagnose.task import diagnose

    model_dir, adapter, _ = setup
    _, frame = tempered
    ref = _write_jsonl(frame.drop(columns=["routed_experts"]), tmp_path / "ref.jsonl")
    result = diagnose(model_dir, {"a": adapter}, [ref], out=tmp_path / "run", options=CPU, samples=2, quiet=True)
    picked = [s for entry in result.record["adapters"].values() for s in entry["samples"]]
    assert picked and all(s["k2"] <= 1e-10 for s in picked), picked


@pytest.mark.parametrize("command", ["compare", "diagnose"])
def test_a_temperature_of_zero_exits_2(setup, tempered, tmp_path, command):
    model_dir, adapter, _ = setup
    ref = _write_jsonl(tempered[1], tmp_path / "ref.jsonl")
    result = _run(command, "--model", model_dir, "--adapter", f"a={adapter}", "--reference", ref, "--out",
                  tmp_path / "run", "--temperature", 0, "--quiet")
    assert_input_error(result, "--temperature", "above 0")
