"""GPU tests at the published widths of every supported family (issue 41 item 5): tiny models hide what tiles, graph
buckets, expert counts and head sizes of released models do (a defect that changed one value in two million at
Qwen3-30B-A3B's q width never showed on them).

Per family, a published config (benchmarks/configs/, or the family's tests where bench does not build it) cut to a
few decoder layers that keep its pattern (a dense first
layer before the MoE ones, a sliding-window layer beside a full one), random bf16 weights written to disk by
transformers, a PEFT all-linear adapter and a Tinker-style shared-outer expert adapter, and a reference whose base
and adapter rows are interleaved, with RL-style groups sharing a prompt. Then, through the CLI as a user runs it:
- `compare --batch-invariant` at `--batch-tokens` 1024, 4096 and 16384 with the prefix cache, 1024 and 16384 without:
  tokens.parquet, samples.csv and summary.csv byte-identical within each setting;
- the default mode: the base rows of mixed batches bit for bit what a run with no adapters loaded gives them, eagerly
  through the CLI (whose batches depend on the lengths alone without prefixes) and by graph replay (the engine, on
  the same padded batches).
The Gated DeltaNet hybrids (Qwen3.5 in its released vision-language layout, Qwen3-Next) keep one period of their
layer pattern plus one (3 linear-attention layers, 1 gated attention, 1 linear) and are also checked, in bf16, against
transformers + PEFT: our compare's logprobs (the default mode: graphs and prefix reuse) as close to transformers +
PEFT in float32 as transformers + PEFT's own bf16 run is (the median |d| within 1.5x; k2 within 10x or 1e-3, as
tests/test_families.py's assert_bf16_like_cpu), and a graph replay equal to the eager forward of the same padded
batch, bit for bit (tests/test_graphs_gpu.py's check, at these widths).
The models are sized to keep the GPU suite near its budget (at most 4 minutes on one H100): the widths, heads, expert
intermediate sizes and top-k are the published ones, and so are the expert counts except DeepSeek-V3's,
Kimi-K2's (64 of 256 and of 384: one MoE layer of the full count is 23 / 34 GB; both pass this test at their full
counts too: BENCHMARKS-history.md) and Qwen3-Next's (256 of 512: its five layers at 512 are 17.7 GB in bf16; the
float32 oracle is twice that). They run in XDIST_GROUPS pytest-xdist groups (with `--dist loadgroup`, as
benchmarks/gpu_suite.sh runs the GPU tests): at most that many at once beside the other GPU tests, so that their
models (up to 12 GB) fit an H100 together. `bench` on every config is
tests/test_bench.py's."""

from __future__ import annotations

import gc
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from lora_eval import Batch, Engine
from lora_eval.adapters import load_adapter
from lora_eval.tasks.bench import ADAPTER_STRENGTH, hf_logprobs, make_peft_adapters, randomise_weights
from lora_eval.cli import cli
from lora_eval.models import load_model
from lora_eval.inputs.references import write_reference
from tests.builders import HF_MODEL_CLASSES
from tests.cli_checks import assert_input_error
from tests.conftest import eager_on_the_bucket
from tests.test_deepseek_v3 import PUBLISHED as DEEPSEEK_PUBLISHED
from tests.test_qwen3_vl_moe import PUBLISHED as QWEN3_VL_PUBLISHED

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
RANK = 16
DEVICE = "cuda"


@dataclass(frozen=True)
class Spec:
    config: str | dict  # a file of benchmarks/configs, or a published config.json as a dict
    layers: int  # the first decoder layers kept
    seconds: float  # the test's time in the GPU suite (H200, 6 processes, 2026-11-27): to share them out evenly
    changes: dict = field(default_factory=dict)  # config changes beyond the layer count (see the module notes)
    # False: the family refuses --batch-invariant by name (exit 2), which the test then asserts instead of the tables
    batch_invariant: bool = True


SPECS = {
    "gpt-oss-20b": Spec("gpt-oss-20b.json", 2, 106),  # a sliding-window layer, then a full one; sinks
    "kimi-k2": Spec(DEEPSEEK_PUBLISHED["Kimi-K2-Instruct"], 2, 63, {"n_routed_experts": 64}),  # first layer dense
    "qwen3-235b-a22b": Spec("Qwen3-235B-A22B.json", 1, 43),  # 64 query heads, experts of 1536
    "deepseek-v3": Spec("DeepSeek-V3.json", 2, 41, {"first_k_dense_replace": 1, "n_routed_experts": 64}),
    "glm-4.5-air": Spec("GLM-4.5-Air.json", 2, 36, {"first_k_dense_replace": 1}),
    "qwen3-30b-a3b": Spec("Qwen3-30B-A3B.json", 2, 26),
    "mixtral-8x7b": Spec("Mixtral-8x7B-v0.1.json", 1, 26),
    "olmoe-1b-7b": Spec("OLMoE-1B-7B-0924.json", 2, 25),
    "qwen1.5-moe-a2.7b": Spec("Qwen1.5-MoE-A2.7B.json", 2, 24),  # a shared expert beside 60 routed ones
    "qwen3-vl-30b-a3b": Spec(QWEN3_VL_PUBLISHED, 2, 21),  # the text path of the VL checkpoint
    "qwen3-8b": Spec("Qwen3-8B.json", 2, 18),  # dense
    # Gated DeltaNet hybrids, one period plus one: 3 linear-attention layers, 1 gated attention, 1 linear (seconds:
    # estimated, not yet measured in the suite)
    "qwen3.5-35b-a3b": Spec("Qwen3.5-35B-A3B.json", 5, 100),  # the vision-language checkpoint, as released
    "qwen3-next-80b-a3b": Spec("Qwen3-Next-80B-A3B-Instruct.json", 5, 100, {"num_experts": 256}),
}
HYBRIDS = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")  # also checked against transformers + PEFT (module notes)
XDIST_GROUPS = 3


def xdist_groups(specs: dict, groups: int) -> dict[str, str]:
    """family -> its group's name: the longest first, each to the group with the least time so far."""
    load, chosen = [0.0] * groups, {}
    for name in sorted(specs, key=lambda n: -specs[n].seconds):
        g = load.index(min(load))
        load[g] += specs[name].seconds
        chosen[name] = f"real-shapes-{g}"
    return chosen
TRANSFORMERS_TYPE = {"kimi_k2": "deepseek_v3"}  # model types transformers knows under another name
INVARIANT_TOKENS = {"": (1024, 4096, 16384), "--no-prefix-cache": (1024, 16384)}  # flag -> --batch-tokens
TABLES = ("tokens.parquet", "samples.csv", "summary.csv")


def published_config(spec: Spec) -> dict:
    """The spec's config.json: its first `layers` decoder layers (layer lists cut alike), the spec's changes, and no
    quantization_config (the weights are written in bf16)."""
    config = json.loads(json.dumps(spec.config)) if isinstance(spec.config, dict) \
        else json.loads((CONFIGS / spec.config).read_text())
    config.pop("quantization_config", None)
    text = config.get("text_config", config)  # (a VL checkpoint's language model is in text_config)
    text["num_hidden_layers"] = spec.layers
    for key in ("layer_types",):
        if isinstance(text.get(key), list):
            text[key] = text[key][:spec.layers]
    if isinstance(text.get("mlp_only_layers"), list):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < spec.layers]
    text.update(spec.changes)
    return config


def write_model(spec: Spec, out: Path, seed: int) -> tuple[Path, dict[str, Path], int]:
    """The checkpoint (model/), its adapters ({name: folder}) and the vocabulary size. The adapters: "a", PEFT's
    all-linear at rank 16 with random factors (bench.make_peft_adapters: attention, dense MLPs, router and the experts
    through target_parameters where PEFT resolves them), and for MoE models "t", a Tinker-style export on every MoE
    layer (w1 / w3 / w2 with the gate and up A and the down B shared by all experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = published_config(spec)
    model_type = config["model_type"]
    hf_config = AutoConfig.for_model(**{**config, "model_type": TRANSFORMERS_TYPE.get(model_type, model_type)})
    with torch.device(DEVICE):  # made in bf16 (a float32 model first would be twice the size on the device)
        cls = HF_MODEL_CLASSES.get(model_type, AutoModelForCausalLM)
        hf = (AutoModelForCausalLM.from_config if cls is AutoModelForCausalLM else cls._from_config)(
            hf_config, dtype=torch.bfloat16)
    randomise_weights(hf, seed)
    model_dir = out / "model"
    hf.save_pretrained(model_dir)
    if model_type in TRANSFORMERS_TYPE:  # the released config.json names its own type
        written = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**written, "model_type": model_type}))
    experts = {name: module for name, module in hf.named_modules()
               if name.endswith("mlp.experts") and hasattr(module, "down_proj")}
    adapters = {}
    if experts:
        adapters["t"] = write_tinker_adapter(out / "tinker", experts, text_config(config)["hidden_size"], seed)
    peft_model, _ = make_peft_adapters(hf, ["a"], RANK, "all", seed)
    peft_model.save_pretrained(out / "peft")
    adapters["a"] = out / "peft" / "a"
    del peft_model, hf
    torch.cuda.empty_cache()
    return model_dir, adapters, text_config(config)["vocab_size"]


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def write_tinker_adapter(out: Path, experts: dict, hidden: int, seed: int) -> Path:
    """A shared-outer 3D expert adapter as Tinker exports it: per MoE layer w1 / w3 (gate, up) with A [1, r, H]
    shared and B [E, I, r], w2 (down) with A [E, r, I] and B [1, H, r] shared; random factors drawn as
    bench.randomise_adapters draws PEFT's (each delta about ADAPTER_STRENGTH of its weight's size)."""
    g = torch.Generator().manual_seed(seed + 7)
    tensors = {}
    for name, module in experts.items():
        E = module.down_proj.shape[0]
        inter = module.down_proj.numel() // (E * hidden)

        def factor(*shape, std):
            return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

        prefix = f"base_model.model.{name}"
        b_std = ADAPTER_STRENGTH / (2 * RANK ** 0.5)  # lora_alpha 2r: scaling 2
        for proj in ("w1", "w3"):
            tensors[f"{prefix}.{proj}.lora_A.weight"] = factor(1, RANK, hidden, std=hidden ** -0.5)
            tensors[f"{prefix}.{proj}.lora_B.weight"] = factor(E, inter, RANK, std=b_std)
        tensors[f"{prefix}.w2.lora_A.weight"] = factor(E, RANK, inter, std=inter ** -0.5)
        tensors[f"{prefix}.w2.lora_B.weight"] = factor(1, hidden, RANK, std=b_std)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
         "target_modules": ["w1", "w2", "w3"]}))  # (all-linear reaches no routed expert in PEFT's Qwen3.5)
    return out


def write_reference_file(path: Path, vocab: int, names: list[str], seed: int) -> pd.DataFrame:
    """Samples of 40 to 3,000 tokens whose adapters cycle through base and `names`, and two RL-style groups (four
    completions of one 400-token prompt: one group under the first adapter, one under the base model): 13k tokens,
    one batch at 16384, about twenty at 1024; random ids and logprobs (the tests compare the engine's numbers between
    runs, not with these)."""
    rng = random.Random(seed)
    tags = [None, *names]
    rows = []

    def add(ids, adapter):
        rows.append(dict(sample_id=f"s{len(rows)}", adapter=adapter, input_ids=ids,
                         logprobs=[-rng.uniform(0.01, 8.0) for _ in ids[1:]]))

    for i, n in enumerate([40, 90, 150, 300, 600, 1000, 40, 1500, 300, 2200, 3000, 90]):
        add([rng.randrange(vocab) for _ in range(n)], tags[i % len(tags)])
    for adapter in (names[0], None):
        prompt = [rng.randrange(vocab) for _ in range(400)]
        for _ in range(4):
            add(prompt + [rng.randrange(vocab) for _ in range(rng.randint(50, 300))], adapter)
    frame = pd.DataFrame(rows)
    write_reference(frame, path)
    return frame


def compare(model_dir: Path, adapters: dict[str, Path], reference: Path, out: Path, *flags) -> Path:
    # (no "adapter applied" gate: a random model's next-token distributions are nearly flat, mean |lp| about ln(vocab)
    # = 12 nats, which puts the gate's bf16 noise bound, 16 eps x mean |lp|, at 1.5 nats: above a random adapter's
    # effect on such a model)
    args = ["compare", "--model", str(model_dir), "--reference", str(reference), "--out", str(out), "--device", DEVICE,
            "--max-k2", "1e9", "--no-adapter-check", "--quiet", *map(str, flags)]
    for name, folder in adapters.items():
        args += ["--adapter", f"{name}={folder}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.stdout, result.stderr)
    free_device()
    return out


def free_device() -> None:
    """The run's engine, graphs and cached prefixes back to the device (this process runs other tests too)."""
    gc.collect()
    torch.cuda.empty_cache()


def base_logprobs(run: Path, base_ids: set[str]) -> pd.DataFrame:
    tokens = pd.read_parquet(run / "tokens.parquet")
    return tokens[tokens["sample_id"].isin(base_ids)].sort_values(["sample_id", "position"]).reset_index(drop=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", [pytest.param(name, marks=pytest.mark.xdist_group(group))
                                    for name, group in xdist_groups(SPECS, XDIST_GROUPS).items()])
def test_published_widths_through_the_cli(family, tmp_path, session_seed):
    root = tmp_path / family
    try:
        model_dir, adapters, vocab = write_model(SPECS[family], root, session_seed)
        reference = root / "reference.parquet"
        frame = write_reference_file(reference, vocab, list(adapters), session_seed)

        if SPECS[family].batch_invariant:
            assert_batch_invariant_tables(model_dir, adapters, reference, root, frame, family)
        else:  # refused by name, never run with a promise it does not keep
            result = CliRunner().invoke(cli, ["compare", "--model", str(model_dir), "--reference", str(reference),
                                              "--out", str(root / "refused"), "--device", DEVICE, "--batch-invariant",
                                              "--quiet"])
            assert_input_error(result, "--batch-invariant")

        # the default mode, eagerly through the CLI: base rows of mixed batches as with no adapter loaded
        base_ids = set(frame.loc[frame["adapter"].isna(), "sample_id"])
        mixed = compare(model_dir, adapters, reference, root / "mixed", "--no-prefix-cache", "--no-cuda-graphs")
        plain_reference = root / "plain.parquet"
        write_reference(frame.assign(adapter=None), plain_reference)
        plain = compare(model_dir, {}, plain_reference, root / "plain", "--no-prefix-cache", "--no-cuda-graphs")
        a, b = base_logprobs(mixed, base_ids), base_logprobs(plain, base_ids)
        assert len(a) == len(b) > 0
        differ = a["engine"] != b["engine"]
        assert not differ.any(), f"{family}: {int(differ.sum())} base-row logprobs of mixed batches differ from a " \
                                 f"run without adapters (max {(a['engine'] - b['engine']).abs().max():.3g})"

        # ... and by graph replay, on the same padded batches
        assert_base_rows_replay_as_without_adapters(model_dir, adapters, frame, family)
        if family in HYBRIDS:
            default = compare(model_dir, adapters, reference, root / "default")
            assert_like_transformers_peft(model_dir, adapters["a"], frame, default, family)
            assert_replay_equals_eager(model_dir, adapters, frame, family)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        free_device()


def assert_batch_invariant_tables(model_dir, adapters, reference, root, frame, family) -> None:
    """The batch-invariant mode: the same files for any --batch-tokens, with the prefix cache and without."""
    for flag, sizes in INVARIANT_TOKENS.items():
        runs = {tokens: compare(model_dir, adapters, reference, root / f"inv{tokens}{flag}", "--batch-invariant",
                                "--batch-tokens", tokens, *filter(None, [flag])) for tokens in sizes}
        for name in TABLES:
            first = (runs[sizes[0]] / name).read_bytes()
            differ = [tokens for tokens, run in runs.items() if (run / name).read_bytes() != first]
            assert not differ, f"{family}: {name} of --batch-invariant {flag} differs at --batch-tokens {differ} " \
                               f"from {sizes[0]}{describe(runs[sizes[0]], runs[differ[0]], frame)}"


def transformers_logprobs(model_dir: Path, adapter_dir: Path, rows, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers + PEFT's logprobs of `rows` (reference rows, base or under the PEFT adapter "a") with the model
    in `dtype` on the GPU: sample_id -> [n-1] float32 on the CPU, one row a forward."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    cls = HF_MODEL_CLASSES.get(model_type, AutoModelForCausalLM)
    peft = PeftModel.from_pretrained(cls.from_pretrained(model_dir, dtype=dtype, device_map=DEVICE), adapter_dir,
                                     adapter_name="a").eval()
    out = {}
    # float32 in full: cuDNN would run transformers' torch convolution (the Gated DeltaNet conv1d) in TF32 by default
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for row in rows:
            if row.adapter is None:
                with peft.disable_adapter():
                    out[row.sample_id] = hf_logprobs(peft, [row.input_ids], DEVICE)[0]
            else:
                out[row.sample_id] = hf_logprobs(peft, [row.input_ids], DEVICE)[0]
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    del peft
    free_device()
    return out


def assert_like_transformers_peft(model_dir: Path, adapter_dir: Path, frame, run: Path, family: str) -> None:
    """Our bf16 logprobs from `run` (a compare in the default mode) against transformers + PEFT in float32 (the
    oracle), beside transformers + PEFT's own bf16 run: the median |d| within 1.5x, k2 below max(1e-3, 10x) (as
    tests/test_families.py's assert_bf16_like_cpu, transformers' bf16 in the place of our CPU's). Rows: the base
    model's and the PEFT adapter's (PEFT does not read the Tinker export)."""
    rows = [r for r in frame.assign(adapter=frame["adapter"].astype(object).where(frame["adapter"].notna(), None))
            .itertuples() if r.adapter in (None, "a")]
    assert {r.adapter for r in rows} == {None, "a"}
    tokens = pd.read_parquet(run / "tokens.parquet").sort_values(["sample_id", "position"])
    ours = {sid: torch.tensor(group["engine"].to_numpy(), dtype=torch.float32)
            for sid, group in tokens.groupby("sample_id")}
    half = transformers_logprobs(model_dir, adapter_dir, rows, torch.bfloat16)
    oracle = transformers_logprobs(model_dir, adapter_dir, rows, torch.float32)
    for r in rows:
        assert ours[r.sample_id].shape == half[r.sample_id].shape == oracle[r.sample_id].shape == (
            len(r.input_ids) - 1,), r.sample_id
    d_ours, d_half = (torch.cat([(got[r.sample_id] - oracle[r.sample_id]).abs() for r in rows])
                      for got in (ours, half))
    k2_ours, k2_half = (float((d * d / 2).mean()) for d in (d_ours, d_half))
    median_ours, median_half = d_ours.median().item(), d_half.median().item()
    print(f"{family} bf16 vs transformers + PEFT float32: ours median |d| {median_ours:.3g}, k2 {k2_ours:.3g}; "
          f"transformers + PEFT bf16 median |d| {median_half:.3g}, k2 {k2_half:.3g}")
    assert median_ours <= 1.5 * median_half, (median_ours, median_half)
    assert k2_ours < max(1e-3, 10 * k2_half), (k2_ours, k2_half)


def assert_replay_equals_eager(model_dir, adapters, frame, family) -> None:
    """A graph replay of mixed batches (base, PEFT and Tinker rows) equals the eager forward of the same padded
    batch, bit for bit (every position, padding included: tests/test_graphs_gpu.py's check)."""
    model = load_model(model_dir, dtype=torch.bfloat16, device=DEVICE)
    engine = Engine(model, [load_adapter(folder, name, model) for name, folder in adapters.items()])
    samples = list(frame.assign(adapter=frame["adapter"].astype(object).where(frame["adapter"].notna(), None))
                   .itertuples())
    for batch in (samples[0:4], samples[12:18]):  # mixed lengths and adapters; an RL group sharing its prompt
        seqs, tags = [s.input_ids for s in batch], [s.adapter for s in batch]
        slots = [engine._slot(t, i) for i, t in enumerate(tags)]
        replays = engine.graph_stats()["replays"]
        hidden, length = engine._forward(seqs, slots)[:2]
        assert engine.graph_stats()["replays"] == replays + 1, f"{family}: the batch did not replay a graph"
        replayed = hidden.clone()
        rows = replayed.shape[0] // length
        eager = eager_on_the_bucket(engine, seqs, slots, rows, length)
        differ = (replayed != eager).any(-1).view(rows, length)  # [rows, length]
        assert not differ.any(), f"{family}: tags {tags}: {int(differ.sum())} positions of the replay differ from " \
                                 f"eager, max |d| {(replayed.float() - eager.float()).abs().max().item():.3g}"
    del engine, model
    free_device()


def assert_base_rows_replay_as_without_adapters(model_dir, adapters, frame, family) -> None:
    model = load_model(model_dir, dtype=torch.bfloat16, device=DEVICE)
    loaded = [load_adapter(folder, name, model) for name, folder in adapters.items()]
    engine, plain = Engine(model, loaded), Engine(model, [])
    samples = list(frame.assign(adapter=frame["adapter"].astype(object).where(frame["adapter"].notna(), None))
                   .itertuples())
    batches = [samples[0:4], samples[4:9], samples[14:18], samples[9:20:2]]  # mixed lengths and adapters, each in a
    # graph bucket (at most 16,384 tokens)
    for batch in batches:
        ids, tags = [s.input_ids for s in batch], [s.adapter for s in batch]
        assert any(t is None for t in tags) and any(t is not None for t in tags), tags
        mixed = engine.logprobs(Batch(ids, tags))
        alone = plain.logprobs(Batch(ids, [None] * len(ids)))
        for s, m, p in zip(batch, mixed, alone):
            if s.adapter is None:
                assert torch.equal(m, p), f"{family}: base row {s.sample_id} ({len(s.input_ids)} tokens) of a " \
                                          f"mixed batch replays {(m - p).abs().max().item():.3g} away from no adapters"
    assert engine.graph_stats()["replays"] == plain.graph_stats()["replays"] == len(batches)
    del engine, plain, loaded, model
    free_device()


def describe(run: Path, other_run: Path, frame) -> str:
    """Where two runs' tokens.parquet differ, for the failure message: the samples (their adapters), by how much."""
    first = pd.read_parquet(run / "tokens.parquet")
    other = pd.read_parquet(other_run / "tokens.parquet")
    if len(first) != len(other):
        return ""
    bad = first["engine"].ne(other["engine"])
    samples = first.loc[bad, "sample_id"].unique()
    adapters = frame.set_index("sample_id").loc[samples, "adapter"].fillna("base").value_counts().to_dict()
    return f": {int(bad.sum())} tokens of {len(samples)} samples {adapters}, max " \
           f"{(first['engine'] - other['engine']).abs().max():.3g}"
