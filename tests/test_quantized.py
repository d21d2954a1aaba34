"""Quantized checkpoints (lora_eval/quantized.py): MXFP4 experts (gpt-oss) and block FP8, dequantised on load.

Checkpoints are tiny random models written by transformers, quantized here as a release would be
(tests/builders.py `save_quantized_copy`), beside a plain float32 copy of the values they encode, dequantised
independently of lora_eval.

1. dequantisation: MXFP4 equals transformers' `convert_moe_packed_tensors` bit for bit (bf16, fp16, fp32; random
   bytes: every code, scales over the whole E8M0 range), also read through a checkpoint file; block FP8 equals a
   plain loop over fixed blocks, ragged edges and multi-block matrices (300 x 200) included, and transformers' FP8
   dequantisation on shapes that are multiples of the block (on ragged multi-block ones transformers derives the
   block from the scale grid and is wrong: not our oracle);
2. whole models: `Engine.load` on the quantized checkpoint, base rows and rows under a PEFT adapter (random non-zero
   factors, experts included), within 1e-5 of transformers (+ PEFT) on the dequantised weights in float32, for
   every family; the MXFP4 checkpoint is also read by transformers itself (`Mxfp4Config(dequantize=True)`), and
   MXFP4 in bf16 is lossless; `modules_to_not_convert` is honoured; `model.args.quantization` names the numerics;
3. what we do not compute is refused by name, naming the file and key, in one line.
"""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import lora_eval
from lora_eval import Batch, Engine, InputError, UnsupportedError
from lora_eval.models.checkpoint import TensorFiles
from lora_eval.cli import cli
from lora_eval.models import load_model
from lora_eval.models.gpt_oss import to_our_layout
from lora_eval.models.quantized import QuantizedFiles, dequantize_fp8, dequantize_mxfp4, read_quantization
from lora_eval.inputs.references import write_reference
from tests.builders import GPT_OSS_NOT_CONVERTED, dequantize_fp8_loop, hf_logprobs, quantize_fp8_blocks, \
    random_sequences, save_quantized_copy, save_random_model, save_random_peft_adapter
from tests.cli_checks import assert_input_error
from tests.conftest import CPU

VOCAB = 96  # tests/builders.py's tiny vocabulary
TOL = 1e-5  # max abs logprob difference from a float32 oracle
MIN_EFFECT = 1e-3  # an adapter must move some logprob at least this much
BLOCK = (128, 128)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Qwen3-30B-A3B-FP8's modules_to_not_convert, cut to 3 layers (the router and the norms of every layer, lm_head)
QWEN_NOT_CONVERTED = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(3)
                                    for m in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]

# family -> save_random_model overrides: a dense model with 300 x 200 / 200 x 300 MLP weights (several blocks,
# both edges ragged), a Qwen3-MoE with hidden 136 (every weight two blocks wide or tall, ragged); tiny otherwise
FP8_FAMILIES = {
    "qwen3": dict(hidden_size=200, intermediate_size=300),
    "llama": {},
    "qwen3_moe": dict(hidden_size=136, moe_intermediate_size=8),
    "mixtral": {},
    "olmoe": {},
    "qwen2_moe": {},
    "gpt_oss": {},  # attention projections in fp8; the experts are not Linear modules and stay as they are
}


# --- helpers --------------------------------------------------------------------------------------------------


def sequences(seed: int) -> list[list[int]]:
    """Short and long rows together (long ones past gpt_oss's sliding window of 5)."""
    return random_sequences(3, VOCAB, seed=seed, min_len=2, max_len=8) + \
        random_sequences(2, VOCAB, seed=seed + 1, min_len=16, max_len=24)


def hf_model(model_dir, family: str, **kwargs):
    """transformers' model of `model_dir` in float32 (gpt_oss with its eager attention, sinks included)."""
    eager = dict(attn_implementation="eager") if family == "gpt_oss" else {}
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **eager, **kwargs).eval()


def max_diff(xs, ys) -> float:
    assert [x.shape for x in xs] == [y.shape for y in ys]
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


def check_engine(quant_dir, adapter_dir, base_oracle, seqs) -> Engine:
    """Our base rows and adapter rows on the quantized checkpoint within TOL of the oracles; the adapter matters."""
    engine = Engine.load(quant_dir, {"lora": adapter_dir}, CPU)
    base = engine.logprobs(Batch(seqs, [None] * len(seqs)))
    tuned = engine.logprobs(Batch(seqs, ["lora"] * len(seqs)))
    base_ref = hf_logprobs(base_oracle, seqs)
    tuned_ref = hf_logprobs(PeftModel.from_pretrained(base_oracle, adapter_dir).eval(), seqs)
    print(f"max |diff|: base {max_diff(base, base_ref):.3g}, adapter {max_diff(tuned, tuned_ref):.3g}")
    assert max_diff(base, base_ref) <= TOL
    assert max_diff(tuned, tuned_ref) <= TOL
    assert max_diff(tuned, base) > MIN_EFFECT
    return engine


def edited(src, dst, **quantization_edits):
    """A copy of checkpoint `src` whose quantization_config has `quantization_edits` (None removes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    quant = config.setdefault("quantization_config", {})
    for key, value in quantization_edits.items():
        quant.pop(key, None) if value is None else quant.update({key: value})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def rewrite_tensors(folder, edit):
    """Rewrite `folder`'s model.safetensors as edit(its tensors)."""
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def one_line_error(error, *needles):
    message = str(error.value)
    assert "\n" not in message and all(n in message for n in needles), message


# --- 1. dequantisation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_equals_transformers_bit_for_bit(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 40, 3, 16), generator=g, dtype=torch.uint8)  # [E, rows, cols/32, 16]
    scales = torch.randint(0, 255, (3, 40, 3), generator=g, dtype=torch.uint8)  # E8M0 0..254 (255 is NaN)
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, rows, cols]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, cols, rows]
    assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)
    blocks[0, 0, 0, 0], scales[0, 0, 0] = 0x2F, 128  # low nibble first: code 0xF = -6, then code 0x2 = 1.0; x 2
    assert dequantize_mxfp4(blocks, scales, dtype)[0, 0, :2].tolist() == [-12.0, 2.0]


def test_mxfp4_read_from_a_checkpoint_file(tmp_path, seed):
    """Read through QuantizedFiles under the parameter's plain name, in transformers' [E, in, out] layout."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (2, 64, 3, 16), generator=g, dtype=torch.uint8)  # [E, out, in/32, 16]
    scales = torch.randint(100, 150, (2, 64, 3), generator=g, dtype=torch.uint8)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({f"{key}_blocks": blocks, f"{key}_scales": scales}, str(tmp_path / "model.safetensors"))
    quant = read_quantization({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, "c")
    files = QuantizedFiles(TensorFiles([tmp_path / "model.safetensors"]), quant, torch.bfloat16, torch.device("cpu"))
    assert key in files
    ours = files.get(key, (2, 96, 64))  # [E, in, out]
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    assert files.read_keys == {f"{key}_blocks", f"{key}_scales"}
    assert files.numerics() == "mxfp4 experts dequantised to bfloat16 (w4a16)"
    with pytest.raises(InputError, match="gate_up_proj_blocks: shape"):
        files.check(key, (2, 64, 64))


def random_blocky(shape, generator) -> torch.Tensor:
    """Random values whose scale differs from one 128 x 128 block to the next (a wrong block shows)."""
    rows, cols = shape
    gains = 10.0 ** torch.empty(math.ceil(rows / 128), math.ceil(cols / 128)).uniform_(-3, 3, generator=generator)
    gains = gains.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]  # [rows, cols]
    return torch.randn(shape, generator=generator) * gains


@pytest.mark.parametrize("shape", [(300, 200), (200, 300), (129, 127), (1, 5), (128, 256), (256, 384)])
def test_fp8_equals_the_block_loop(shape, seed):
    q, scale_inv = quantize_fp8_blocks(random_blocky(shape, torch.Generator().manual_seed(seed)))
    oracle = dequantize_fp8_loop(q, scale_inv)  # [out, in] float32
    assert torch.equal(dequantize_fp8(q, scale_inv, BLOCK, torch.float32), oracle)
    assert torch.equal(dequantize_fp8(q, scale_inv, BLOCK, torch.bfloat16), oracle.to(torch.bfloat16))
    grid_derived = Fp8Dequantize(None)._dequantize_one  # transformers: block = shape / scale grid
    if shape[0] % 128 == 0 and shape[1] % 128 == 0:
        assert torch.equal(grid_derived(q, scale_inv, output_dtype=torch.float32), oracle)
    elif shape == (300, 200):  # grid [3, 2] read as 100 x 100 blocks: the wrong scale for most values
        assert not torch.equal(grid_derived(q, scale_inv, output_dtype=torch.float32), oracle)


def test_fp8_other_blocks_and_leading_dims(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 150, 70, generator=g)  # [E, out, in]
    pairs = [quantize_fp8_blocks(w[e], (64, 32)) for e in range(3)]
    q, scale_inv = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])  # [3, 150, 70], [3, 3, 3]
    ours = dequantize_fp8(q, scale_inv, (64, 32), torch.float32)
    assert torch.equal(ours, torch.stack([dequantize_fp8_loop(*p, (64, 32)) for p in pairs]))


# --- 2. whole models ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FP8_FAMILIES))
def test_fp8_model_matches_transformers_and_peft(family, tmp_path, seed):
    base = save_random_model(tmp_path / "base", family, seed=seed, **FP8_FAMILIES[family])
    not_converted = ["model.layers.*.mlp.router", "lm_head"] if family == "gpt_oss" else QWEN_NOT_CONVERTED
    quant_dir, plain_dir, quantized = save_quantized_copy(base, tmp_path / "fp8", tmp_path / "plain", "fp8",
                                                          not_converted)
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "lm_head.weight" not in quantized
    lora = dict(target_parameters=EXPERTS) if family == "gpt_oss" else {}
    adapter = save_random_peft_adapter(plain_dir, tmp_path / "lora", seed=seed + 2, r=4, lora_alpha=8,
                                       target_modules="all-linear", **lora)
    engine = check_engine(quant_dir, adapter, hf_model(plain_dir, family), sequences(seed + 3))
    assert engine.model.args.quantization == "block fp8 [128, 128] dequantised to float32 (w8a16)"
    assert load_model(quant_dir, device="meta").args.quantization == engine.model.args.quantization
    assert load_model(base).args.quantization is None
    plain = load_file(str(plain_dir / "model.safetensors"))
    original = load_file(str(base / "model.safetensors"))
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_proj, plain["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(q_proj, original["model.layers.0.self_attn.q_proj.weight"])  # fp8 did round
    if family == "qwen3":
        assert engine.model.model.layers[0].mlp.gate_proj.weight.shape == (300, 200)
        assert torch.equal(engine.model.model.layers[0].mlp.down_proj.weight,
                           plain["model.layers.0.mlp.down_proj.weight"])  # [200, 300]


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory, session_seed):
    """gpt_oss (hidden 96, experts of 32) in MXFP4 as released, but layer 1's experts kept in float32 by
    modules_to_not_convert: (original, quantized, plain dequantised) folders."""
    root = tmp_path_factory.mktemp("mxfp4")
    base = save_random_model(root / "base", "gpt_oss", seed=session_seed, hidden_size=96, intermediate_size=32)
    quant_dir, plain_dir, quantized = save_quantized_copy(
        base, root / "mxfp4", root / "plain", "mxfp4", GPT_OSS_NOT_CONVERTED + ["model.layers.1.mlp.experts"])
    assert sorted(quantized) == [f"model.layers.{i}.{e}" for i in (0, 2) for e in sorted(EXPERTS)]
    return base, quant_dir, plain_dir


def test_mxfp4_model_matches_transformers_and_peft(mxfp4_model, tmp_path, seed):
    base, quant_dir, plain_dir = mxfp4_model
    theirs = hf_model(quant_dir, "gpt_oss", quantization_config=Mxfp4Config(dequantize=True))  # their dequant
    plain = hf_model(plain_dir, "gpt_oss")
    for name, value in plain.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], value), name
    adapter = save_random_peft_adapter(plain_dir, tmp_path / "lora", seed=seed, r=4, lora_alpha=8,
                                       target_modules="all-linear", target_parameters=EXPERTS)
    engine = check_engine(quant_dir, adapter, theirs, sequences(seed + 1))
    assert engine.model.args.quantization == "mxfp4 experts dequantised to float32 (w4a16)"
    original = load_file(str(base / "model.safetensors"))
    experts = [layer.mlp.experts for layer in engine.model.model.layers]
    original_layer_1 = to_our_layout("gate_up_proj", original["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(experts[1].gate_up_proj, original_layer_1)  # modules_to_not_convert: as stored
    original_layer_0 = to_our_layout("gate_up_proj", original["model.layers.0.mlp.experts.gate_up_proj"])
    assert not torch.equal(experts[0].gate_up_proj, original_layer_0)  # mxfp4 did round


def test_mxfp4_in_bf16_is_lossless_and_equals_transformers(mxfp4_model):
    _, quant_dir, _ = mxfp4_model
    f32, bf16 = load_model(quant_dir), load_model(quant_dir, dtype=torch.bfloat16)
    assert bf16.args.quantization == "mxfp4 experts dequantised to bfloat16 (w4a16)"
    stored = load_file(str(quant_dir / "model.safetensors"))
    for i in (0, 2):
        for kind in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{kind}"
            ours = getattr(bf16.model.layers[i].mlp.experts, kind)
            theirs = convert_moe_packed_tensors(stored[f"{key}_blocks"], stored[f"{key}_scales"], dtype=torch.bfloat16)
            assert ours.dtype == torch.bfloat16 and torch.equal(ours, to_our_layout(kind, theirs))
            assert torch.equal(ours.float(), getattr(f32.model.layers[i].mlp.experts, kind))


def test_published_quantization_configs():
    """The release configs' quantization_config as published (../shared/data/model-configs/): what each reads as,
    and which modules their modules_to_not_convert keep unquantized."""
    per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    qwen = read_quantization({"model_type": "qwen3_moe", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(48) for m in per_layer]}},
        "Qwen3-30B-A3B-FP8.json")
    assert qwen.block == (128, 128) and qwen.describe(torch.bfloat16) == \
        "block fp8 [128, 128] dequantised to bfloat16 (w8a16)"
    assert not qwen.converts("model.layers.47.mlp.gate") and not qwen.converts("lm_head")
    assert qwen.converts("model.layers.4.mlp.experts.0.gate_proj") and qwen.converts("model.layers.4.self_attn.q_proj")
    deepseek = read_quantization({"model_type": "deepseek_v3", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}, "c")
    assert deepseek.block == (128, 128) and deepseek.converts("lm_head")  # its lm_head is stored bf16: read as is
    gpt_oss = read_quantization({"model_type": "gpt_oss", "quantization_config": {
        "modules_to_not_convert": GPT_OSS_NOT_CONVERTED, "quant_method": "mxfp4"}}, "gpt-oss-20b.json")
    assert gpt_oss.converts("model.layers.23.mlp.experts")
    assert not any(gpt_oss.converts(m) for m in ("model.layers.23.self_attn", "model.layers.3.mlp.router",
                                                 "model.embed_tokens", "lm_head"))


# --- 3. refusals ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory, session_seed):
    """A tiny Qwen3-MoE in block FP8 (Qwen's modules_to_not_convert)."""
    root = tmp_path_factory.mktemp("fp8")
    base = save_random_model(root / "base", "qwen3_moe", seed=session_seed)
    return save_quantized_copy(base, root / "fp8", root / "plain", "fp8", QWEN_NOT_CONVERTED)[0]


REFUSED = {  # quantization_config edits -> (error type, what the message names)
    "awq": (dict(quant_method="awq"), UnsupportedError, "quantization_config.quant_method: quant_method 'awq'"),
    "compressed-tensors": (dict(quant_method="compressed-tensors"), UnsupportedError, "'compressed-tensors'"),
    "no block": (dict(weight_block_size=None), UnsupportedError, "quantization_config.weight_block_size: fp8 without"),
    "static": (dict(activation_scheme="static"), UnsupportedError, "quantization_config.activation_scheme: "),
    "e5m2": (dict(fmt="e5m2"), UnsupportedError, "quantization_config.fmt: fp8 fmt 'e5m2'"),
    "mxfp4 here": (dict(quant_method="mxfp4"), UnsupportedError, "mxfp4 is supported for gpt_oss experts only"),
    "bad block": (dict(weight_block_size=[128]), InputError, "quantization_config.weight_block_size: expected"),
    "excluded": (dict(modules_to_not_convert=["q_proj"]), InputError,
                 "model.layers.0.self_attn.q_proj.weight: stored quantized, but"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_file_and_key(case, fp8_model, tmp_path):
    edits, error, needle = REFUSED[case]
    folder = edited(fp8_model, tmp_path / "m", **edits)
    for device in ("meta", "cpu"):
        with pytest.raises(error) as e:
            load_model(folder, device=device)
        one_line_error(e, needle, str(folder))


def test_other_blocks_are_read_by_the_config(tmp_path, seed):
    """A 64 x 64 block config over the 136-wide weights written with 128 x 128 blocks: the scale grid's shape
    does not match, caught from the headers with the key named."""
    base = save_random_model(tmp_path / "base", "qwen3", seed=seed, hidden_size=136)
    quant_dir = save_quantized_copy(base, tmp_path / "fp8", tmp_path / "plain", "fp8", QWEN_NOT_CONVERTED)[0]
    folder = edited(quant_dir, tmp_path / "m", weight_block_size=[64, 64])
    with pytest.raises(InputError) as e:
        load_model(folder, device="meta")
    one_line_error(e, "self_attn.q_proj.weight_scale_inv: shape [1, 2], expected [1, 3]")


def test_broken_quantized_tensors_are_named(fp8_model, mxfp4_model, tmp_path):
    key = "model.layers.0.self_attn.q_proj.weight"
    scale = f"{key}_scale_inv"  # model.layers.0.self_attn.q_proj.weight_scale_inv
    no_scale = edited(fp8_model, tmp_path / "no_scale")
    rewrite_tensors(no_scale, lambda t: t.pop(scale))  # an fp8 weight without its scale
    with pytest.raises(InputError) as e:
        load_model(no_scale)
    one_line_error(e, f"{scale}: missing tensor")
    int_scale = edited(fp8_model, tmp_path / "int_scale")
    rewrite_tensors(int_scale, lambda t: t.update({scale: t[scale].to(torch.int32)}))
    with pytest.raises(InputError) as e:
        load_model(int_scale)
    one_line_error(e, f"{scale}: dtype torch.int32, expected")
    blocks = edited(mxfp4_model[1], tmp_path / "blocks")
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    rewrite_tensors(blocks, lambda t: t.update({f"{gate_up}_scales": t[f"{gate_up}_scales"][:, :, :2].contiguous()}))
    with pytest.raises(InputError) as e:
        load_model(blocks, device="meta")
    one_line_error(e, f"{gate_up}_scales: shape")


def test_cli_refuses_in_one_line(fp8_model, tmp_path):
    folder = edited(fp8_model, tmp_path / "awq", quant_method="awq")
    result = CliRunner().invoke(cli, ["inspect", "--model", str(folder)])
    assert_input_error(result, "quant_method 'awq' is not supported", str(folder))


def test_inspect_run_record_and_reports_name_the_numerics(fp8_model, tmp_path, seed):
    numerics = "block fp8 [128, 128] dequantised to float32 (w8a16)"
    result = CliRunner().invoke(cli, ["inspect", "--model", str(fp8_model)])
    assert result.exit_code == 0 and f"; {numerics}" in result.stdout.splitlines()[0], result.stdout
    ids = random_sequences(3, 96, seed=seed)
    ref = write_reference(pd.DataFrame(dict(input_ids=ids, logprobs=[[-1.0] * (len(x) - 1) for x in ids])),
                          tmp_path / "ref.parquet")
    run = lora_eval.compare(fp8_model, references=[ref], out=tmp_path / "run", options=CPU, quiet=True).run
    assert run["quantization"] == numerics
    assert f"({numerics})" in (tmp_path / "run" / "report.md").read_text().splitlines()[2]
