"""`lora-eval bench` on a scaled-down Qwen3-30B-A3B config (CPU, float32): every case for both systems with
positive finite numbers, FLOPs counted by hand, our in-memory-built engine equal to transformers + PEFT on the
same batch, and `load_model_from_tensors` sharing (not copying) the transformers weights. Every config in
benchmarks/configs/ runs through the CLI at small widths (bench.small_config) against transformers + PEFT, and on
the GPU at its real widths (marker gpu)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from lora_eval import Batch, Engine
from lora_eval.adapters import load_adapter
from lora_eval.tasks.bench import (bench, make_peft_adapters, random_hf_model, read_model_config, small_config,
                             time_interleaved, warm_up)
from lora_eval.cli import cli
from lora_eval.errors import InputError
from lora_eval.models import family_and_args, load_model_from_tensors
from tests.builders import hf_logprobs
from tests.cli_checks import assert_input_error, assert_no_traceback

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
REAL_CONFIG = CONFIGS / "Qwen3-30B-A3B.json"
PUBLISHED = sorted(CONFIGS.glob("*.json"))  # a config added to the folder is covered by the tests below
# the real config with small sizes; 2I (48) != H (64) and I != H, so a swapped or transposed expert factor
# cannot pass by coincidence
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=96, vocab_size=128,
            bos_token_id=None, eos_token_id=None)
CASES = {"base", "lora-1", "lora-4-mixed", "no-lora-rows"}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    config = json.loads(REAL_CONFIG.read_text())
    config.update(TINY)
    path = tmp_path_factory.mktemp("bench") / "tiny-qwen3-moe.json"
    path.write_text(json.dumps(config))
    return path


def write_small(config_file: Path, folder: Path) -> Path:
    """bench.small_config of a published config, written under its own file name (the model column keeps it)."""
    path = folder / config_file.name
    path.write_text(json.dumps(small_config(json.loads(config_file.read_text()))))
    return path


def layer_counts(config_file: Path) -> list[int]:
    """First layers to bench a config at: 2 (gpt-oss: a sliding and a full attention layer) and the fewest that reach
    its first MoE layer (DeepSeek-V3: 3 dense, then MoE: 4) and, in a hybrid, one past its first attention layer
    (Qwen3.5, Qwen3-Next: 3 linear-attention layers, 1 attention, 1 linear: one period of the pattern plus one)."""
    args = family_and_args(read_model_config(config_file), config_file)[1]
    moe = args.sparse_layers[0] + 1 if args.sparse_layers else 2
    return sorted({min(n, args.num_layers) for n in (2, max(2, moe), hybrid_layers(args))})


def hybrid_layers(args) -> int:
    """One past the first full-attention layer of a hybrid (linear-attention layers first); 2 for other models."""
    types = list(getattr(args, "layer_types", ()) or ())
    if "linear_attention" not in types or "full_attention" not in types:
        return 2
    return types.index("full_attention") + 2


def expected_flops(rows: int, length: int, rank: int | None) -> int:
    """FLOPs of one batch counted by hand from TINY: 2 x active params x tokens + causal attention (+ LoRA, with
    PEFT's all-linear: q/k/v/o and the router at rank r, expert gate_up at 2r (gate and up), down at r)."""
    H, nh, nkv, D, E, k, I, V, layers = (TINY[key] for key in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "vocab_size", "num_hidden_layers"))
    per_layer = 2 * H * nh * D + 2 * H * nkv * D + H * E + k * 3 * H * I
    params = layers * per_layer + H * V
    tokens = rows * length
    flops = 2 * params * tokens + rows * layers * 4 * (length * (length + 1) // 2) * nh * D
    if rank is not None:
        r = rank
        lora = r * (H + nh * D) * 2 + r * (H + nkv * D) * 2 + r * (H + E)  # q, o, k, v, router
        lora += k * (2 * r * H + 2 * I * 2 * r) + k * (r * I + H * r)  # experts: gate_up (rank 2r), down
        flops += 2 * layers * lora * tokens
    return flops


def test_bench_reports_every_case_and_matches_peft(tiny_config, seed):
    rows, length, rank = 4, 12, 3
    frame = bench(tiny_config, adapters=4, rank=rank, batches=(f"{rows}x{length}",), dtype="float32", device="cpu",
                  repeat=2, warmup=1, seed=seed, quiet=True)
    assert set(zip(frame["system"], frame["case"])) == {(s, c) for s in ("ours", "hf") for c in CASES}
    assert len(frame) == 8
    assert (frame["status"] == "ok").all()
    for column in ("ms_per_batch", "tokens_per_s", "tflops"):
        values = frame[column].to_numpy()
        assert ((values > 0) & np.isfinite(values)).all(), (column, values)
    assert frame["peak_mem_gb"].isna().all()  # CPU: no peak-memory counter
    assert (frame["tokens"] == rows * length).all()
    # the mixed batch: one forward for us, one PEFT pass per adapter
    passes = frame.set_index(["system", "case"])["passes"]
    assert passes["hf", "lora-4-mixed"] == 4 and passes["ours", "lora-4-mixed"] == 1
    assert all(passes["hf", c] == 1 for c in CASES - {"lora-4-mixed"})
    # like for like: our logprobs equal transformers + PEFT's on the same batch, in every case
    ours = frame[frame["system"] == "ours"]
    assert (ours["max_abs_diff"] < 1e-5).all(), ours[["case", "max_abs_diff"]]
    assert frame[frame["system"] == "hf"]["max_abs_diff"].isna().all()
    # FLOPs: tflops x seconds gives back the hand count
    flops = frame["tflops"] * 1e12 * frame["ms_per_batch"] / 1e3
    for (system, case), value in zip(zip(frame["system"], frame["case"]), flops):
        want = expected_flops(rows, length, None if case in ("base", "no-lora-rows") else rank)
        assert value == pytest.approx(want, rel=1e-9), (system, case)
    # ratios
    by = frame.set_index(["system", "case"])
    for system in ("ours", "hf"):
        assert by.loc[(system, "base"), "cost_vs_base"] == 1.0
        for case in CASES:
            assert by.loc[(system, case), "cost_vs_base"] == pytest.approx(
                by.loc[(system, case), "ms_per_batch"] / by.loc[(system, "base"), "ms_per_batch"])
    for case in CASES:
        assert by.loc[("ours", case), "vs_hf"] == pytest.approx(
            by.loc[("ours", case), "tokens_per_s"] / by.loc[("hf", case), "tokens_per_s"])


def test_cases_are_timed_interleaved_and_out_of_memory_is_recorded():
    """warm_up then time_interleaved: every case warmed first, then one call of each per round (a clock drift
    falls on all cases alike); a case that runs out of memory while warming up is recorded and not timed."""
    order = []

    def call(name):
        def run():
            order.append(name)
            if name == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
            return torch.tensor([len(order)])
        return run

    calls = {name: call(name) for name in ("a", "b", "oom")}
    timings = warm_up(calls, torch.device("cpu"), warmup=2)
    assert order == ["a", "a", "b", "b", "oom"]
    assert timings["oom"].status.startswith("oom: CUDA out of memory")
    time_interleaved(calls, timings, torch.device("cpu"), repeat=3)
    assert order[5:] == ["a", "b"] * 3
    assert timings["a"].seconds > 0 and timings["b"].seconds > 0 and timings["oom"].seconds != timings["oom"].seconds
    assert timings["b"].output.item() == 11  # the last round's output


def test_engine_on_shared_weights_equals_peft_per_row(tiny_config, tmp_path, seed):
    """The bench's building blocks: our model over the transformers tensors and adapters made by PEFT give PEFT's
    logprobs on rows of different lengths and adapters (and the adapters do change them)."""
    config = read_model_config(tiny_config)
    hf = random_hf_model(config, torch.float32, torch.device("cpu"), seed)
    ours = load_model_from_tensors(config, hf.state_dict(), torch.float32, "cpu")
    assert ours.model.layers[1].mlp.experts.gate_up_proj.data_ptr() == \
        hf.model.layers[1].mlp.experts.gate_up_proj.data_ptr()
    peft_model, note = make_peft_adapters(hf, ["a0", "a1"], 3, "all", seed)
    assert note == ""  # PEFT resolved the experts itself
    peft_model.save_pretrained(tmp_path)
    engine = Engine(ours, [load_adapter(tmp_path / name, name, ours) for name in ("a0", "a1")])
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist() for n in (9, 14, 5, 11)]
    tags = ["a0", "a1", None, "a1"]
    got = engine.logprobs(Batch(rows, tags))
    with peft_model.disable_adapter():
        base = hf_logprobs(peft_model, rows)
    for i, (row, tag) in enumerate(zip(rows, tags)):
        if tag is None:
            want = base[i]
        else:
            peft_model.set_adapter(tag)
            want = hf_logprobs(peft_model, [row])[0]
            assert (want - base[i]).abs().max() > 1e-2  # the adapter matters
        assert (got[i] - want).abs().max() < 1e-5, (i, tag, float((got[i] - want).abs().max()))


def test_load_model_from_tensors_shares_storage_and_copies_on_cast(tiny_config, seed):
    config = read_model_config(tiny_config)
    hf = random_hf_model(config, torch.float32, torch.device("cpu"), seed)
    tensors = hf.state_dict()
    ours = load_model_from_tensors(config, tensors, torch.float32, "cpu")
    params = dict(ours.named_parameters())
    assert params.keys() == tensors.keys()
    grouped = set()
    for name, param in params.items():
        if getattr(ours.get_submodule(name.rsplit(".", 1)[0]), "group", None) is not None:
            grouped.add(name)  # projections of one input: copied into their group's buffer (layers.ProjectionGroup)
            assert torch.equal(param, tensors[name]) and param.data_ptr() != tensors[name].data_ptr(), name
        else:
            assert param.data_ptr() == tensors[name].data_ptr(), name
    assert "model.layers.0.self_attn.k_proj.weight" in grouped and len(grouped) < len(params)
    before = {k: v.clone() for k, v in tensors.items()}
    half = load_model_from_tensors(config, tensors, torch.bfloat16, "cpu")
    for name, param in half.named_parameters():
        assert param.dtype == torch.bfloat16 and param.data_ptr() != tensors[name].data_ptr(), name
        assert torch.equal(param, tensors[name].to(torch.bfloat16)), name
    for name, value in tensors.items():  # the inputs are untouched
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name


def test_load_model_from_tensors_reads_per_expert_names(tiny_config, seed):
    """On-disk per-expert keys in memory are stacked into the fused experts, as from a checkpoint."""
    config = read_model_config(tiny_config)
    hf = random_hf_model(config, torch.float32, torch.device("cpu"), seed)
    fused = hf.state_dict()
    I = TINY["moe_intermediate_size"]
    per_expert = {}
    for key, value in fused.items():
        prefix, _, param = key.rpartition(".")
        if param == "gate_up_proj":
            for e in range(value.shape[0]):
                per_expert[f"{prefix}.{e}.gate_proj.weight"] = value[e, :I]
                per_expert[f"{prefix}.{e}.up_proj.weight"] = value[e, I:]
        elif param == "down_proj" and prefix.endswith("experts"):
            for e in range(value.shape[0]):
                per_expert[f"{prefix}.{e}.down_proj.weight"] = value[e]
        else:
            per_expert[key] = value
    ours = load_model_from_tensors(config, per_expert, torch.float32, "cpu")
    for name, param in ours.named_parameters():
        assert torch.equal(param, fused[name]), name
    # a missing or a foreign tensor is refused by name
    missing = dict(per_expert)
    missing.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight: missing tensor"):
        load_model_from_tensors(config, missing, torch.float32, "cpu", where="tiny.json")
    with pytest.raises(InputError, match=r"tiny\.json \(in-memory tensors\): model\.extra\.weight: not a weight"):
        load_model_from_tensors(config, {**per_expert, "model.extra.weight": torch.ones(2)}, torch.float32, "cpu",
                                where="tiny.json")


def test_bench_cli_writes_csv(tiny_config, tmp_path):
    out = tmp_path / "bench.csv"
    result = CliRunner().invoke(cli, ["bench", "--config", str(tiny_config), "--device", "cpu", "--dtype", "float32",
                                      "--batch", "2x6", "--batch", "1x5", "--adapters", "2", "--rank", "2",
                                      "--repeat", "1", "--warmup", "0", "--skip-hf", "--quiet", "--out", str(out),
                                      "--also-invariant"])
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    frame = pd.read_csv(out)
    # 2x6: base, lora-1, lora-2-mixed, no-lora-rows; 1x5: no mixed case with a single row; per system
    cases = [("2x6", "base"), ("2x6", "lora-1"), ("2x6", "lora-2-mixed"), ("2x6", "no-lora-rows"),
             ("1x5", "base"), ("1x5", "lora-1"), ("1x5", "no-lora-rows")]
    assert list(zip(frame["system"], frame["batch"], frame["case"])) == [
        (system, *case) for system in ("ours", "ours-invariant") for case in cases]
    assert frame["vs_hf"].isna().all()
    assert (frame["tokens_per_s"] > 0).all()
    assert "tiny-qwen3-moe: 2 layers, 2 adapters of rank 2 (all), float32" in result.stdout


@pytest.mark.parametrize("args, needles", [
    (["--batch", "4by8"], ("--batch", "ROWSxTOKENS", "4by8")),
    (["--batch", "4x1"], ("--batch", "tokens >= 2")),
    (["--layers", "3"], ("--layers", "3 is not within 1..2")),
])
def test_bench_cli_bad_input_is_one_line(tiny_config, args, needles):
    result = CliRunner().invoke(cli, ["bench", "--config", str(tiny_config), "--device", "cpu", *args])
    assert_input_error(result, *needles)


def test_bench_experts_target_needs_experts(tmp_path):
    config = json.loads(REAL_CONFIG.read_text())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        config.pop(key)
    config["model_type"] = "qwen3"
    path = tmp_path / "dense.json"
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["bench", "--config", str(path), "--device", "cpu", "--targets", "experts"])
    assert_input_error(result, "--targets", "needs a model with MoE layers")


@pytest.mark.parametrize("change, needles", [
    (dict(model_type="foo"), ("model_type", "'foo'", "not supported")),
    (dict(model_type=None), ("model_type", "architecture name")),
    (dict(vocab_size=None), ("vocab_size",)),
    (dict(vocab_size="128"), ("vocab_size",)),
    (dict(quantization_config={"quant_method": "awq"}), ("quantization_config.quant_method", "'awq'", "not supported")),
])
def test_bench_bad_config_is_one_line(tmp_path, change, needles):
    """Our own config checks run before transformers sees the config."""
    config = json.loads(REAL_CONFIG.read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["bench", "--config", str(path), "--device", "cpu", "--layers", "1"])
    assert_input_error(result, "bad.json", *needles)


def test_missing_config_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["bench", "--config", str(tmp_path / "nope.json"), "--device", "cpu"])
    assert_input_error(result, "nope.json", "file not found")


@pytest.mark.parametrize("config_file, layers", [(p, n) for p in PUBLISHED for n in layer_counts(p)],
                         ids=[f"{p.stem}-L{n}" for p in PUBLISHED for n in layer_counts(p)])
def test_every_published_config_runs_through_bench(config_file, layers, tmp_path):
    """Each config of benchmarks/configs/ at small widths (bench.small_config: same family, layer pattern, rope,
    routing, quantization_config), through the CLI with two adapters: every case ok, our logprobs equal
    transformers + PEFT's, our adapter holds expert LoRA where the layers have experts (else the note says there
    are none), a quantization_config is named in the note. gpt-oss failed here (exit 3, issue 41): PEFT leaves its
    experts to target_parameters, the path that lost the adapter names; DeepSeek-V3-L2 (dense layers only) exited
    2 (PEFT's target_parameters named experts that the layers lack)."""
    path = write_small(config_file, tmp_path)
    family, args = family_and_args(read_model_config(path, layers), path)
    with torch.device("meta"):  # a config key small_config does not know would leave a real width here
        size = sum(p.numel() for p in family.CausalLM(args).parameters())
    assert size < 1_000_000, f"{config_file.name}: {size:,} parameters at small widths; extend bench.SMALL_SIZES"
    out = tmp_path / "bench.csv"
    rows, length, rank = 2, 12, 3  # 12 tokens: past small_config's sliding window (gpt-oss)
    result = CliRunner().invoke(cli, ["bench", "--config", str(path), "--layers", str(layers), "--adapters", "2",
                                      "--rank", str(rank), "--batch", f"{rows}x{length}", "--device", "cpu",
                                      "--dtype", "float32", "--repeat", "1", "--warmup", "0", "--quiet",
                                      "--out", str(out)])
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    frame = pd.read_csv(out)
    assert set(zip(frame["system"], frame["case"])) == {(s, c) for s in ("ours", "hf")
                                                        for c in ("base", "lora-1", "lora-2-mixed", "no-lora-rows")}
    assert (frame["status"] == "ok").all() and (frame["model"] == config_file.stem).all()
    for column in ("ms_per_batch", "tokens_per_s", "tflops"):
        assert ((frame[column] > 0) & np.isfinite(frame[column])).all(), (column, frame[column])
    ours = frame[frame["system"] == "ours"].set_index("case")
    assert (ours["max_abs_diff"] < 1e-5).all(), ours["max_abs_diff"]
    # the adapter's active LoRA (FLOPs of lora-1 over base) holds at least rank r on both expert parts, top-k
    # experts of every MoE layer: gate_up r (H + 2I), down r (I + H)
    flops = ours["tflops"] * 1e12 * ours["ms_per_batch"] / 1e3
    per_token = (flops["lora-1"] - flops["base"]) / (2 * rows * length)
    H, I = args.hidden_size, args.moe_intermediate_size
    assert per_token >= len(args.sparse_layers) * args.top_k * rank * (2 * H + 3 * I) * (1 - 1e-9), per_token
    assert per_token > 0
    if not args.sparse_layers and family_and_args(read_model_config(path), path)[1].sparse_layers:
        assert f"--layers {layers} keeps no MoE layer" in result.stdout
    quantization = json.loads(config_file.read_text()).get("quantization_config")
    if quantization:
        assert frame["note"].str.contains(f"quantization_config ({quantization['quant_method']}", regex=False).all()
        assert f"quantization_config ({quantization['quant_method']}" in result.stdout


def test_peft_fallback_keeps_the_adapter_names(tmp_path, seed):
    """gpt-oss: PEFT's all-linear leaves its experts alone (0.21), so make_peft_adapters names them in
    target_parameters; every adapter keeps its own name (the first was named after a model parameter: issue 41's
    KeyError "module name can't contain '.'")."""
    config = read_model_config(write_small(CONFIGS / "gpt-oss-20b.json", tmp_path), 2)
    config.pop("quantization_config")
    hf = random_hf_model(config, torch.float32, torch.device("cpu"), seed)
    model, note = make_peft_adapters(hf, ["a0", "a1"], 2, "all", seed)
    from peft.tuners.lora import ParamWrapper

    assert set(model.peft_config) == {"a0", "a1"}
    wrapped = {m.parameter_name for m in model.modules() if isinstance(m, ParamWrapper)}
    assert {"gate_up_proj", "down_proj"} <= wrapped, wrapped
    if note:  # this PEFT did not resolve them: named explicitly, router included
        assert "target_parameters" in note
        for name in ("a0", "a1"):
            assert set(model.peft_config[name].target_parameters) == {
                "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"}


def test_experts_target_where_peft_cannot_wrap_the_router(tmp_path):
    """Qwen3.5's router is no Linear and PEFT 0.21 has no expert mapping for it, so `--targets experts` (MLP names
    in target_modules) makes PEFT refuse the module "gate": make_peft_adapters names the experts and the router in
    target_parameters instead, and our logprobs equal transformers + PEFT's on that adapter."""
    path = write_small(CONFIGS / "Qwen3.5-35B-A3B.json", tmp_path)
    frame = bench(path, layers=5, adapters=1, rank=3, targets="experts", batches=("2x12",), dtype="float32",
                  device="cpu", repeat=1, warmup=0, quiet=True)
    assert (frame["status"] == "ok").all()
    hf = frame[frame["system"] == "hf"]
    assert hf["note"].str.contains("target_parameters").all()
    ours = frame[frame["system"] == "ours"].set_index("case")
    assert (ours["max_abs_diff"] < 1e-5).all(), ours["max_abs_diff"]
    assert ours.loc["lora-1", "tflops"] * ours.loc["lora-1", "ms_per_batch"] > \
        ours.loc["base", "tflops"] * ours.loc["base", "ms_per_batch"]  # the adapter's FLOPs counted: it holds LoRA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config_file", [pytest.param(p, marks=pytest.mark.xdist_group("bench-configs"))
                                         for p in PUBLISHED], ids=[p.stem for p in PUBLISHED])
def test_every_published_config_benches_on_cuda(config_file, tmp_path):
    """The real shapes, bf16, two layers (a hybrid's: up to its first attention layer, 3 Gated DeltaNet layers and
    one attention), our engine only (--skip-hf): exit 0 and finite figures for every config of benchmarks/configs/
    (the largest, Qwen3-235B-A22B's two MoE layers, is 12.5 GB, Qwen3-Next-80B-A3B's four 14.4 GB; DeepSeek-V3's
    first two layers are dense, which the note says). One pytest-xdist group (`--dist loadgroup`): one such model at
    a time beside the other GPU tests (about 80 s in all on an H200, before the hybrids)."""
    out = tmp_path / "bench.csv"
    layers = max(2, hybrid_layers(family_and_args(read_model_config(config_file), config_file)[1]) - 1)
    try:
        result = CliRunner().invoke(cli, ["bench", "--config", str(config_file), "--layers", str(layers),
                                          "--adapters", "1", "--batch", "2x512", "--skip-hf", "--repeat", "1",
                                          "--warmup", "1", "--quiet", "--out", str(out)])
    finally:  # the other tests of this process share the GPU
        gc.collect()
        torch.cuda.empty_cache()
    assert_no_traceback(result)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    frame = pd.read_csv(out)
    assert list(frame["case"]) == ["base", "lora-1", "no-lora-rows"] and (frame["system"] == "ours").all()
    assert (frame["status"] == "ok").all()
    for column in ("ms_per_batch", "tokens_per_s", "tflops", "peak_mem_gb"):
        assert ((frame[column] > 0) & np.isfinite(frame[column])).all(), (column, frame[column])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_on_cuda_matches_peft_and_measures_memory(tiny_config, seed):
    """The GPU path: weights and adapters drawn on the device, peak memory per case, our engine with CUDA graphs
    and without (ours-eager) and in the batch-invariant mode (ours-invariant: its own GEMM and attention kernels)
    against transformers + PEFT, float32 (IEEE dots in our kernels; cuBLAS without TF32)."""
    frame = bench(tiny_config, adapters=4, rank=3, batches=("4x32", "1x16"), dtype="float32", device="cuda",
                  repeat=2, warmup=1, also_eager=True, also_invariant=True, seed=seed, quiet=True)
    assert set(frame["system"]) == {"ours", "ours-eager", "ours-invariant", "hf"}
    assert (frame["status"] == "ok").all()
    assert ((frame["peak_mem_gb"] > 0) & np.isfinite(frame["peak_mem_gb"])).all()
    assert (frame["peak_mem_gb"] >= frame["resident_gb"]).all()
    ours = frame[frame["system"] != "hf"]
    assert (ours["max_abs_diff"] < 1e-3).all(), ours[["system", "batch", "case", "max_abs_diff"]]
    assert ours[ours["system"] == "ours"]["note"].str.startswith("graphs:").all()
    assert (ours[ours["system"] == "ours-eager"]["note"] == "").all()
