"""A model checkpoint's inputs refused by name (issue 42, classes 2, 4 and 6 for checkpoints and file reading): one
`error: <file>: <key>: <problem>` line and exit 2 from every command that reads them, never exit 3, never a
threshold computed from bad numbers, never a message blaming something else.

Every bad input is a copy of one good tiny checkpoint (Qwen3-MoE with a one-token-per-line tokenizer that MMLU
prompts can use), its PEFT adapter, a reference and a two-question MMLU folder, with one edit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lora_eval.cli import cli
from lora_eval.errors import InputError
from lora_eval.models import load_model
from lora_eval.engine.plan import plan
from tests.builders import save_random_model, save_random_peft_adapter
from tests.cli_checks import assert_input_error
from tests.conftest import MOE_OVERRIDES

VOCAB = {"[UNK]": 0, "<|endoftext|>": 1, "\n": 2, "Answer:": 3, " A": 4, " B": 5, " C": 6, " D": 7}
EMBED = "model.embed_tokens.weight"
Q_PROJ = "model.layers.2.self_attn.q_proj.weight"  # in an MoE layer (layer 1 is dense)
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"  # per-expert on disk, stacked into a fused tensor on load


def line_tokenizer(out: Path):
    """One token per line, with "Answer:" and a final " A".." D" split off (tests/test_mmlu.py's): MMLU prompts
    score one token per letter."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
                                                 pre_tokenizers.Split(Regex(" [ABCD]$"), behavior="isolated")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|endoftext|>").save_pretrained(out)


class Inputs:
    """The good inputs every test copies and breaks."""


@pytest.fixture(scope="module")
def good(tmp_path_factory, session_seed) -> Inputs:
    root = tmp_path_factory.mktemp("checkpoint_inputs")
    g = Inputs()
    g.model = root / "model"
    line_tokenizer(g.model)
    save_random_model(g.model, "qwen3_moe", seed=session_seed, vocab_size=len(VOCAB), **MOE_OVERRIDES)
    g.sharded = save_random_model(root / "sharded", "qwen3_moe", seed=session_seed + 1, vocab_size=len(VOCAB),
                                  max_shard_size="20KB", **MOE_OVERRIDES)
    g.adapter = save_random_peft_adapter(g.model, root / "adapter", seed=session_seed + 2, r=2, lora_alpha=4,
                                         target_modules=["q_proj", "v_proj"])
    gen = torch.Generator().manual_seed(session_seed)
    rows = []
    for i in range(4):  # fresh random token ids over the whole vocabulary, the top one included
        ids = torch.randint(0, len(VOCAB), (6,), generator=gen).tolist() + [len(VOCAB) - 1]
        lps = (-torch.rand(len(ids) - 1, generator=gen) * 3).tolist()
        rows.append(dict(sample_id=f"s{i}", adapter="a" if i % 2 else None, input_ids=ids, logprobs=lps))
    g.reference = root / "reference.jsonl"
    g.reference.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g.prompts = root / "prompts.jsonl"
    g.prompts.write_text("".join(json.dumps({k: r[k] for k in ("sample_id", "adapter", "input_ids")}) + "\n"
                                 for r in rows))
    g.text_prompts = root / "text_prompts.jsonl"
    g.text_prompts.write_text(json.dumps(dict(sample_id="t", adapter=None, text="Answer:\n A")) + "\n")
    g.mmlu = root / "mmlu"
    for split, rows in (("test", ["What is 1+1?,1,2,3,4,B", "What is 2+2?,4,5,6,7,A"]), ("dev", ["0+1?,1,2,3,4,A"])):
        (g.mmlu / split).mkdir(parents=True)
        (g.mmlu / split / f"abstract_algebra_{split}.csv").write_text("\n".join(rows) + "\n")
    return g


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_tensor(path: Path, key: str, edit) -> None:
    tensors = load_file(str(path))
    tensors[key] = edit(tensors[key])
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))  # NaN and Infinity written as Python's json writes them


def poke(value: float):
    """An edit that puts `value` at a random place of a tensor (a copy)."""
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[int(torch.randint(t.numel(), ()))] = value
        return t
    return edit


def run(command: str, g: Inputs, tmp_path: Path, model: Path | None = None, adapter: Path | None = None,
        *extra: str):
    """`lora-eval COMMAND` on the good inputs, with `model` / `adapter` in their place, in-process."""
    model = model or g.model
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = [command, "--model", str(model)]
    args += ["--adapter", f"a={adapter or g.adapter}"]
    device = ["--device", "cpu"]
    if command == "compare":
        args += ["--reference", str(g.reference), "--out", str(tmp_path / "run"), "--quiet", *device]
    elif command == "diagnose":
        args += ["--reference", str(g.reference), "--out", str(tmp_path / "run"), "--quiet", *device]
    elif command == "mmlu":
        args += ["--data", str(g.mmlu), "--shots", "0", "--out", str(tmp_path / "run"), "--quiet", *device]
    elif command == "dump-reference":
        args += ["--prompts", str(g.prompts), "--out", str(tmp_path / "ref.parquet"), "--quiet", *device]
    return CliRunner().invoke(cli, [*args, *extra])


LOADING = ["compare", "mmlu", "diagnose"]  # the commands that load our engine's weights
ALL = LOADING + ["dump-reference", "plan", "inspect"]


def test_the_good_inputs_pass(good, tmp_path):
    for command in ALL:
        result = run(command, good, tmp_path / command)
        assert result.exit_code in (0, 1), (command, result.exit_code, result.stderr)


# ---- class 2: non-finite numbers in the weights ------------------------------------------------------------------


@pytest.mark.parametrize("command", [*LOADING, "dump-reference", "diagnose --layer-by-layer"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_is_refused_naming_file_and_key(good, tmp_path, command, value):
    """Every command that loads weights: ours (compare, mmlu, diagnose; diagnose's side B one layer at a time), and
    transformers' for dump-reference (which wrote a reference from NaN weights). Nothing is left beside the output."""
    model = copy(good.model, tmp_path / "model")
    edit_tensor(model / "model.safetensors", Q_PROJ, poke(value))
    name, *extra = command.split()
    line = assert_input_error(run(name, good, tmp_path / "out", model, None, *extra),
                              f"{model / 'model.safetensors'}: {Q_PROJ}: ", "must be finite")
    assert str(value) in line and not list((tmp_path / "out").iterdir())


def test_a_non_finite_expert_weight_in_a_shard_names_that_shard(good, tmp_path):
    model = copy(good.sharded, tmp_path / "model")
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = model / index[EXPERT]
    edit_tensor(shard, EXPERT, poke(math.nan))
    assert_input_error(run("compare", good, tmp_path, model), f"{shard}: {EXPERT}: nan at index", "must be finite")


def test_a_weight_beyond_float16_is_refused_in_float16(good, tmp_path):
    model = copy(good.model, tmp_path / "model")
    edit_tensor(model / "model.safetensors", Q_PROJ, poke(1e6))  # finite in float32, inf in float16
    assert run("compare", good, tmp_path / "f32", model).exit_code in (0, 1)
    assert_input_error(run("compare", good, tmp_path / "f16", model, None, "--dtype", "float16"),
                       f"{model / 'model.safetensors'}: {Q_PROJ.removesuffix('.weight')}", "not once read in float16")


@pytest.mark.parametrize("command", ["compare", "dump-reference", "inspect"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_weight_that_is_not_floating_point_is_refused(good, tmp_path, command, dtype):
    model = copy(good.model, tmp_path / "model")
    edit_tensor(model / "model.safetensors", "model.norm.weight", lambda t: (t * 10).to(dtype))
    assert_input_error(run(command, good, tmp_path, model), f"{model / 'model.safetensors'}: model.norm.weight: ",
                       f"dtype {str(dtype).removeprefix('torch.')}, expected floating-point weights")


def test_a_nan_block_fp8_scale_is_refused(good, tmp_path):
    """A block-FP8 copy of one projection whose scale holds a NaN: the dequantised weight would be NaN."""
    model = copy(good.model, tmp_path / "model")
    path = model / "model.safetensors"
    tensors = load_file(str(path))
    w = tensors[Q_PROJ]
    scale = torch.rand(math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)) + 0.5
    tensors[Q_PROJ] = (w / scale.max()).to(torch.float8_e4m3fn)
    scale_key = Q_PROJ.removesuffix(".weight") + ".weight_scale_inv"
    tensors[scale_key] = scale
    save_file(tensors, str(path), metadata={"format": "pt"})
    edit_config(model, quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                 weight_block_size=[128, 128]))
    assert run("compare", good, tmp_path / "ok", model).exit_code in (0, 1)
    edit_tensor(path, scale_key, poke(math.nan))
    assert_input_error(run("compare", good, tmp_path / "nan", model), f"{path}: {scale_key}: nan", "must be finite")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_nan_weight_is_refused_on_the_device_it_loads_to(good, tmp_path, device):
    model = copy(good.model, tmp_path / "model")
    edit_tensor(model / "model.safetensors", EXPERT, poke(math.nan))
    with pytest.raises(InputError) as e:
        load_model(model, dtype=torch.bfloat16, device=device)
    assert (e.value.where, e.value.key) == (str(model / "model.safetensors"), EXPERT) and "nan" in e.value.problem


def test_a_nan_weight_is_refused_on_the_cpu(good, tmp_path):
    model = copy(good.model, tmp_path / "model")
    edit_tensor(model / "model.safetensors", EXPERT, poke(math.nan))
    with pytest.raises(InputError) as e:
        load_model(model, dtype=torch.bfloat16, device="cpu")
    assert (e.value.where, e.value.key) == (str(model / "model.safetensors"), EXPERT) and "nan" in e.value.problem


# ---- class 2: the numbers of config.json ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ALL)
def test_a_nan_rms_norm_eps_is_refused(good, tmp_path, command):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, rms_norm_eps=math.nan)
    assert_input_error(run(command, good, tmp_path, model), f"{model / 'config.json'}: rms_norm_eps: ",
                       "finite number", "nan")


@pytest.mark.parametrize("changes,key,needle", [
    (dict(rms_norm_eps=0), "rms_norm_eps", "> 0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps", "> 0"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=math.inf)), "rope_parameters.rope_theta", "inf"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4)), "rope_parameters", "'factor'"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor="2")), "rope_parameters", "'factor'"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8, low_freq_factor=4,
                               high_freq_factor=4, original_max_position_embeddings=64)), "rope_parameters",
     "high_freq_factor"),
    (dict(head_dim=7), "head_dim", "even"),
    (dict(num_experts_per_tok=99), "num_experts_per_tok", "more than"),
    (dict(max_position_embeddings=-math.inf), "max_position_embeddings", "-inf"),
    (dict(initializer_range=math.nan), "initializer_range", "nan"),  # read by no one, refused all the same
])
def test_config_numbers_are_checked(good, tmp_path, changes, key, needle):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, **changes)
    for command in ("compare", "plan"):
        assert_input_error(run(command, good, tmp_path / command, model), f"{model / 'config.json'}: {key}: ",
                           needle)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_routed_scaling_factor_must_be_positive(family):
    from lora_eval.models import family_and_args
    from tests.builders import tiny_deepseek_v3_config, tiny_glm4_moe_config

    make = tiny_deepseek_v3_config if family == "deepseek_v3" else tiny_glm4_moe_config
    family_and_args(dict(make(), model_type=family), "config.json")  # the good one reads
    for value in (0, -2.5, math.nan):
        with pytest.raises(InputError, match="config.json: routed_scaling_factor: expected a finite number"):
            family_and_args(dict(make(routed_scaling_factor=value), model_type=family), "config.json")


# ---- class 4: file errors, each named with its path and reason ------------------------------------------------------


@pytest.mark.parametrize("command", ALL)
@pytest.mark.parametrize("size", ["half", "empty"])
def test_a_truncated_adapter_file_is_named(good, tmp_path, command, size):
    adapter = copy(good.adapter, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if size == "half" else b"")
    assert_input_error(run(command, good, tmp_path, None, adapter), f"{weights}: not a readable safetensors file")


def break_file(path: Path, how: str) -> str:
    """Make `path` unreadable `how`; the reason the error line must give."""
    path.unlink()
    if how == "folder":
        path.mkdir()
        return "a folder where a file is expected"
    if how == "dangling link":
        os.symlink(path.parent / "gone" / path.name, path)
        return "which does not exist"
    if os.geteuid() == 0:
        pytest.skip("root reads a file whatever its permissions")
    path.write_text("{}")
    path.chmod(0)
    return "Permission denied"


@pytest.mark.parametrize("how", ["folder", "dangling link", "unreadable"])
@pytest.mark.parametrize("command", ["compare", "plan", "inspect", "dump-reference"])
def test_an_unreadable_config_json_is_named(good, tmp_path, command, how):
    model = copy(good.model, tmp_path / "model")
    reason = break_file(model / "config.json", how)
    assert_input_error(run(command, good, tmp_path, model), f"{model / 'config.json'}: ", reason)


@pytest.mark.parametrize("how", ["folder", "dangling link", "unreadable"])
@pytest.mark.parametrize("command", ["compare", "mmlu", "inspect"])
def test_an_unreadable_adapter_config_json_is_named(good, tmp_path, command, how):
    adapter = copy(good.adapter, tmp_path / "adapter")
    reason = break_file(adapter / "adapter_config.json", how)
    assert_input_error(run(command, good, tmp_path, None, adapter), f"{adapter / 'adapter_config.json'}: ", reason)


@pytest.mark.parametrize("how", ["folder", "dangling link", "unreadable"])
@pytest.mark.parametrize("command", ["compare", "plan", "dump-reference"])
def test_an_unreadable_weights_file_is_named(good, tmp_path, command, how):
    model = copy(good.model, tmp_path / "model")
    reason = break_file(model / "model.safetensors", how)
    assert_input_error(run(command, good, tmp_path, model), f"{model / 'model.safetensors'}: ", reason)


@pytest.mark.parametrize("how", ["missing", "folder", "dangling link"])
def test_a_shard_the_index_names_must_be_readable(good, tmp_path, how):
    model = copy(good.sharded, tmp_path / "model")
    shard = sorted(model.glob("model-*-of-*.safetensors"))[1]
    if how == "missing":
        shard.unlink()
        reason = "file not found"
    else:
        reason = break_file(shard, how)
    for command in ("compare", "plan"):
        assert_input_error(run(command, good, tmp_path / command, model), f"{shard}: ", reason)


def test_a_tensor_in_two_shards_is_refused(good, tmp_path):
    model = copy(good.sharded, tmp_path / "model")
    shards = sorted(model.glob("model-*-of-*.safetensors"))
    first = load_file(str(shards[0]))
    key = next(iter(first))
    last = load_file(str(shards[-1]))
    last[key] = first[key] + 1  # another value: which one a reader took would depend on the order of the files
    save_file(last, str(shards[-1]), metadata={"format": "pt"})
    assert_input_error(run("compare", good, tmp_path, model), f"{shards[-1]}: {key}: also in {shards[0]}")


@pytest.mark.parametrize("name", ["../model.safetensors", "/etc/passwd", 7])
def test_an_index_naming_a_file_outside_the_folder_is_refused(good, tmp_path, name):
    model = copy(good.sharded, tmp_path / "model")
    index = model / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][EMBED] = name
    index.write_text(json.dumps(data))
    assert_input_error(run("inspect", good, tmp_path, model), f"{index}: weight_map.{EMBED}: ",
                       "expected the name of a .safetensors file in the model folder")


# ---- class 6: messages that blame the right thing --------------------------------------------------------------


@pytest.mark.parametrize("command", ALL)
def test_a_config_vocab_size_that_disagrees_with_the_weights_blames_the_config(good, tmp_path, command):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, vocab_size=len(VOCAB) - 1)  # the reference's top token id is then "outside" it
    assert_input_error(run(command, good, tmp_path, model), f"{model / 'config.json'}: vocab_size: {len(VOCAB) - 1}, "
                       f"but the weights have {len(VOCAB)} rows", str(model / "model.safetensors"))


@pytest.mark.parametrize("command", ["dump-reference", "mmlu"])
def test_a_model_folder_without_a_tokenizer_says_so(good, tmp_path, command):
    model = copy(good.model, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    extra = ["--prompts", str(good.text_prompts)] if command == "dump-reference" else []
    line = assert_input_error(run(command, good, tmp_path, model, None, *extra), f"{model}: ",
                              "needs the model's tokenizer, and the model folder has none", "tokenizer.json")
    assert "tokens" not in line.split("tokenizer")[0]


def test_weights_transformers_loaded_are_checked_too(good, tmp_path):
    """dump-reference's model comes from transformers: its parameters, checked against the checkpoint's files."""
    from transformers import AutoModelForCausalLM

    from lora_eval.models import check_loaded_weights

    model = copy(good.model, tmp_path / "model")
    check_loaded_weights(model, dict(AutoModelForCausalLM.from_pretrained(model).named_parameters()))
    edit_tensor(model / "model.safetensors", EXPERT, poke(math.nan))
    with pytest.raises(InputError) as e:
        check_loaded_weights(model, dict(AutoModelForCausalLM.from_pretrained(model).named_parameters()))
    assert (e.value.where, e.value.key) == (str(model / "model.safetensors"), EXPERT) and "nan" in e.value.problem


def test_an_mxfp4_scale_out_of_range_is_refused(tmp_path, seed):
    """gpt-oss experts in MXFP4: an E8M0 scale of 255 (its NaN code) makes the dequantised experts infinite."""
    from safetensors import safe_open

    from tests.builders import GPT_OSS_NOT_CONVERTED, save_quantized_copy

    base = save_random_model(tmp_path / "base", "gpt_oss", seed=seed, hidden_size=96, intermediate_size=32)
    quant, _, quantized = save_quantized_copy(base, tmp_path / "mxfp4", tmp_path / "plain", "mxfp4",
                                              GPT_OSS_NOT_CONVERTED)
    load_model(quant, device="cpu")
    key = next(k for k in quantized if k.endswith("gate_up_proj"))
    with safe_open(str(quant / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(f"{key}_scales").dtype == torch.uint8
    edit_tensor(quant / "model.safetensors", f"{key}_scales", poke(255))
    with pytest.raises(InputError) as e:
        load_model(quant, device="cpu")
    assert (e.value.where, e.value.key) == (str(quant / "model.safetensors"), key), e.value
    assert "quantization scales out of range" in e.value.problem


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_plan_gpu_memory_must_be_a_finite_positive_number(good, tmp_path, value):
    """NaN 'did not fit' and inf 'fit' every model: refused by the command line as it parses, and by plan() itself
    (the Python API)."""
    assert run("plan", good, tmp_path, None, None, "--gpu-memory", "80").exit_code == 0
    assert_input_error(run("plan", good, tmp_path, None, None, "--gpu-memory", value), "'--gpu-memory'",
                       f"expected a finite number > 0, got '{value}'")
    with pytest.raises(InputError, match="--gpu-memory: expected a finite number of GB > 0"):
        plan(good.model, {}, gpu_memory_gb=float(value))


def test_a_tokenizer_file_that_cannot_be_read_is_named(good, tmp_path):
    model = copy(good.model, tmp_path / "model")
    reason = break_file(model / "tokenizer.json", "dangling link")
    assert_input_error(run("mmlu", good, tmp_path, model), f"{model / 'tokenizer.json'}: ", reason)


# ---- config.json fields a family reads: each checked, whatever its kind (the second audit) --------------------------


def assert_refused(good, tmp_path, model, *needles, commands=("compare", "plan")):
    for command in commands:
        assert_input_error(run(command, good, tmp_path / command, model), f"{model / 'config.json'}: ", *needles)


ROPE = dict(rope_type="default", rope_theta=1e4)


@pytest.mark.parametrize("changes,needles", [
    (dict(rope_parameters="default"), ["rope_parameters: expected an object of rope parameters", "'default'"]),
    (dict(rope_parameters=5), ["rope_parameters: expected an object of rope parameters", "found 5"]),
    (dict(rope_parameters=[["rope_theta", 1e4]]), ["rope_parameters: expected an object", "[['rope_theta'"]),
    (dict(rope_parameters=None, rope_scaling="x"), ["rope_scaling: expected an object", "'x'"]),
    (dict(rope_parameters=ROPE, rope_scaling="x"), ["rope_scaling: expected an object", "'x'"]),
    (dict(rope_parameters=ROPE, rope_scaling=dict(type="linear", factor=0)), ["rope_scaling: rope_parameters",
                                                                              "and rope_scaling", "disagree"]),
    (dict(rope_parameters=ROPE, rope_theta="x"), ["rope_theta: 'rope_theta' must be a finite number > 0", "'x'"]),
    (dict(rope_parameters=dict(rope_type=7)), ["rope_parameters.rope_type: expected a rope type name, found 7"]),
    (dict(rope_parameters=None, rope_scaling=dict(type="linear", factor=0)), ["rope_scaling: 'factor' must be"]),
])
def test_every_rope_field_is_an_object_with_valid_values(good, tmp_path, changes, needles):
    """Whichever of rope_parameters / rope_scaling transformers would read (rope_scaling first), and the other too:
    a string or number where an object belongs was exit 3, a list or an ignored rope_scaling silently accepted."""
    model = copy(good.model, tmp_path / "model")
    edit_config(model, **changes)
    assert_refused(good, tmp_path, model, *needles)


def test_rope_scaling_that_agrees_with_rope_parameters_is_accepted(good, tmp_path):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4),
                rope_scaling=dict(type="linear", factor=2.0), rope_theta=1e4)
    assert run("plan", good, tmp_path, model).exit_code == 0


@pytest.mark.parametrize("value", [-1, 1, "4096", 2.5, True, 2**40])
def test_max_position_embeddings_is_an_integer_of_at_least_2(good, tmp_path, value):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, max_position_embeddings=value)
    assert_refused(good, tmp_path, model, "max_position_embeddings: expected an integer >= 2", repr(value),
                   commands=("compare", "plan", "dump-reference"))


def test_samples_longer_than_max_position_embeddings_are_named():
    from lora_eval.inputs.checks import check_lengths

    check_lengths([3, 8], ["a", "b"], 8, "ref.parquet")
    check_lengths([10**6], ["a"], None, "ref.parquet")  # the config names none
    with pytest.raises(InputError) as e:
        check_lengths([3, 9, 12], ["a", "b", "c"], 8, "ref.parquet")
    assert str(e.value).startswith("ref.parquet: sample_id b: 9 tokens, more than the model's "
                                   "max_position_embeddings (8")


@pytest.mark.parametrize("changes,needles", [
    (dict(mlp_only_layers=[99]), ["mlp_only_layers: layer 99 is not one of the model's"]),
    (dict(mlp_only_layers=[-1]), ["mlp_only_layers: layer -1 is not one of the model's"]),
    (dict(mlp_only_layers=[True]), ["mlp_only_layers: expected a list of layer indices"]),
    (dict(mlp_only_layers=5), ["mlp_only_layers: expected a list of layer indices"]),
    (dict(layer_types=["full_attention"]), ["layer_types: expected a list of", "(num_hidden_layers)"]),
])
def test_layer_lists_are_checked_against_num_hidden_layers(good, tmp_path, changes, needles):
    model = copy(good.model, tmp_path / "model")
    edit_config(model, **changes)
    assert_refused(good, tmp_path, model, *needles)


@pytest.mark.parametrize("key,value", [("norm_topk_prob", "false"), ("tie_word_embeddings", "false"),
                                       ("attention_bias", "FALSE"), ("use_sliding_window", "false"),
                                       ("mlp_bias", 0)])
def test_a_boolean_given_as_a_string_is_refused(good, tmp_path, key, value):
    """"false" is truthy in Python: it was read as true (norm_topk_prob, tie_word_embeddings), silently."""
    model = copy(good.model, tmp_path / "model")
    edit_config(model, **{key: value})
    assert_refused(good, tmp_path, model, f"{key}: expected true or false, a JSON boolean, found {value!r}")


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "moe_intermediate_size"])
def test_an_integer_given_as_a_float_is_refused(good, tmp_path, key):
    """hidden_size 64.0 was read as 64 by us, and crashed transformers' modules in dump-reference (exit 3)."""
    model = copy(good.model, tmp_path / "model")
    value = float(json.loads((model / "config.json").read_text())[key])
    edit_config(model, **{key: value})
    assert_refused(good, tmp_path, model, f"{key}: expected an integer", f"found {value!r}",
                   commands=("compare", "plan", "dump-reference"))


@pytest.mark.parametrize("value", [1e308, 1, 2.5])
def test_rms_norm_eps_must_be_below_1(good, tmp_path, value):
    """An epsilon >= 1 made every output near uniform: exit 1, blamed on the adapters."""
    model = copy(good.model, tmp_path / "model")
    edit_config(model, rms_norm_eps=value)
    assert_refused(good, tmp_path, model, "rms_norm_eps: expected a finite number > 0 and < 1", repr(value))


@pytest.mark.parametrize("key,value,bound", [
    ("hidden_size", 1e30, "1_048_576"), ("num_hidden_layers", 10**12, "10_000"), ("num_local_experts", 2**20, "65_536"),
    ("vocab_size", 2**30, "16_777_216"), ("num_attention_heads", 2**13, "4_096")])
def test_sizes_beyond_any_model_are_refused(good, tmp_path, key, value, bound):
    """hidden_size 1e30 overflowed (exit 3) and num_hidden_layers 10**12 got plan killed for memory."""
    model = copy(good.model, tmp_path / "model")
    edit_config(model, **{key: value})
    assert_refused(good, tmp_path, model, f"{key}: expected an integer >= 1 and <= {bound}")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_family_fields_are_read_checked(family):
    from lora_eval.models import family_and_args
    from tests.builders import tiny_deepseek_v3_config, tiny_glm4_moe_config

    make = tiny_deepseek_v3_config if family == "deepseek_v3" else tiny_glm4_moe_config
    for changes, needle in [(dict(norm_topk_prob="false"), "norm_topk_prob: expected true or false"),
                            (dict(attention_bias="true"), "attention_bias: expected true or false"),
                            (dict(first_k_dense_replace=99), "first_k_dense_replace: 99 is more than "
                                                             "num_hidden_layers"),
                            (dict(rms_norm_eps=1.0), "rms_norm_eps: expected a finite number > 0 and < 1"),
                            (dict(rope_scaling="yarn"), "rope_scaling: expected an object")]:
        with pytest.raises(InputError) as e:
            family_and_args(dict(make(**changes), model_type=family), "config.json")
        assert needle in str(e.value), (changes, str(e.value))


def test_gpt_oss_yarn_truncate_must_be_a_boolean():
    from lora_eval.models import family_and_args
    from tests.builders import tiny_gpt_oss_config

    rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate="false",
                original_max_position_embeddings=64, rope_theta=150000.0)
    with pytest.raises(InputError, match="rope_parameters.truncate: expected true or false, a JSON boolean"):
        family_and_args(dict(tiny_gpt_oss_config(rope_parameters=rope), model_type="gpt_oss"), "config.json")


def test_an_index_must_list_every_key_of_its_shards(good, tmp_path):
    """transformers loads only what weight_map lists: a key a shard holds beyond it was used silently."""
    model = copy(good.sharded, tmp_path / "model")
    path = model / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shard = index["weight_map"].pop(EXPERT)
    path.write_text(json.dumps(index))
    assert_input_error(run("compare", good, tmp_path, model), f"{path}: weight_map: lacks '{EXPERT}', which the "
                       f"listed shard {shard} holds")


@pytest.mark.parametrize("changes,needles", [
    (dict(r=0), ["adapter_config.json: r: expected a positive integer rank"]),
    (dict(layers_to_transform=[99], layers_pattern="layers"), ["adapter_config.json"]),
    (dict(r=4, lora_alpha=8), ["adapter_model.safetensors: ", "lora_A.weight: shape [2, ", "r=4 in adapter_config"]),
])
def test_plan_reads_adapters_as_every_command_does(good, tmp_path, changes, needles):
    """plan exited 0 on an adapter whose adapter_config.json every other command refuses."""
    adapter = copy(good.adapter, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    line = assert_input_error(run("plan", good, tmp_path / "plan", None, adapter), str(adapter), *needles)
    assert line == assert_input_error(run("compare", good, tmp_path / "compare", None, adapter)) or \
        "shape" in line  # compare names the first tensor it reads, which may be another of the same pair
