"""Model families and checkpoint loading: config.json -> family -> our model code with the checkpoint's weights
(or with in-memory tensors: `load_model_from_tensors`). Quantized checkpoints (MXFP4, block FP8) are dequantised
on load by models/quantized.py; `model.args.quantization` then says which numerics the run emulates."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from . import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3, qwen3_next, qwen3_vl_moe
from .checkpoint import TensorDict, TensorFiles, check_finite, check_finite_numbers, read_json
from .layers import Linear, group_projections
from .quantized import QuantizedFiles, read_quantization

# model_type in config.json -> the module holding that family's ModelArgs, CausalLM and load_weights
FAMILIES = {model_type: family for family in (qwen3, mixtral, olmoe, qwen2_moe, gpt_oss, glm4_moe, qwen3_vl_moe,
                                             deepseek_v3, qwen3_next)
            for model_type in family.MODEL_TYPES}
# transformers' in-memory names that are not checkpoint tensors
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               experts=None):
    """Our model for the local Hugging Face checkpoint folder `model_dir`, weights in compute `dtype` on `device`;
    with `experts` (lora_eval.engine.expert_parallel.ExpertParallel), only this rank's share of the routed experts."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(model_dir, "model folder not found")
    config_path = model_dir / "config.json"
    config = read_json(config_path)
    family, args, quant = _family_args_quantization(config, config_path)
    return _build(family, args, TensorFiles.from_checkpoint_dir(model_dir), dtype, device, quant, experts)


def load_model_from_tensors(config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                            device: str | torch.device, where: str = "<in-memory config>"):
    """Our model for a config.json dict and in-memory weights keyed as in a checkpoint (a transformers model's
    `state_dict()`: fused experts under transformers 5's names, or per-expert on-disk names; load_weights reads
    both). A tensor already in `dtype` on `device` becomes our parameter as it is, sharing its storage (no copy);
    others are copied, and so are projections of one input (models.layers.group_projections: q / k / v in one
    buffer). `where` names the source in error messages."""
    family, args, quant = _family_args_quantization(config, where)
    return _build(family, args, TensorDict(tensors, where=f"{where} (in-memory tensors)"), dtype, device, quant)


def family_and_args(config: dict, where):
    """The family module for config's model_type, and its ModelArgs read from `config` (a quantization_config
    we do not compute is refused here too)."""
    return _family_args_quantization(config, where)[:2]


def _family_args_quantization(config: dict, where):
    """(family module, its ModelArgs, lora_eval.models.quantized.Quantization or None) for `config`."""
    check_finite_numbers(config, where)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedError(where, f"'{model_type}' ({arch}) is not supported; supported model types: "
                               f"{', '.join(sorted(FAMILIES))}", key="model_type")
    family = FAMILIES[model_type]
    args = family.ModelArgs.from_config(config, where=str(where))
    # the rope's parameters checked now (by the family's own rope), not first when the model is built
    family.CausalLM.rope_inv_freq(args.head_dim, args.rope, args.where)
    return family, args, read_quantization(config, where)


def _build(family, args, files, dtype: torch.dtype, device: str | torch.device, quant=None, experts=None):
    """Our model of `args` with every weight read from `files` (TensorFiles or TensorDict), dequantised per
    `quant` (lora_eval.models.quantized.Quantization) where stored quantized."""
    with torch.device("meta"):
        model = family.CausalLM(args)
    if experts is not None:  # expert parallel: this rank's experts, read alone
        experts.shard_model(model)
        files = experts.shard_files(files)
    check_vocab(args, files)
    if quant is not None:
        files = QuantizedFiles(files, quant, dtype, torch.device(device))
    weights = family.load_weights(model, files, dtype, torch.device(device))
    check_finite(weights, files)
    args.quantization = files.numerics() if quant is not None else None
    # checkpoint parts that are no weights of our model, by the family's say (a vision tower, MTP layers)
    skipped = tuple(getattr(args, "skipped_key_prefixes", ()))
    unused = [k for k in files.keys() if k not in files.read_keys and not k.endswith(NOT_WEIGHTS)
              and not k.startswith(skipped)]
    if unused:
        raise InputError(files.file_of(unused[0]), f"not a weight of a {_describe(args)} model as config.json "
                         f"describes it ({len(unused)} such keys); does config.json match the weights?",
                         key=unused[0])
    model.load_state_dict(weights, strict=True, assign=True)
    for module in model.modules():  # projections of one input: one weight buffer, one GEMM on the Triton path
        for names in getattr(module, "input_groups", ()):
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, Linear) for m in members):
                group_projections(members)
    # the rope buffer is not a checkpoint tensor: computed again on the device (a family may bring its own rope)
    model.inv_freq = model.rope_inv_freq(args.head_dim, args.rope, args.where).to(device)
    model.eval()
    return model


def check_loaded_weights(model_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """`check_finite` for weights another loader read from the checkpoint in `model_dir` (transformers, for
    dump-reference): {name: tensor where it was loaded}; a non-finite one is named by its checkpoint file and key."""
    check_finite(tensors, TensorFiles.from_checkpoint_dir(Path(model_dir)))


def check_folder_vocab(model_dir: Path, args) -> None:
    """`check_vocab` against the weights' headers, where the folder holds weights (a plan may come before the
    download; a load reports weights that are missing)."""
    if TensorFiles.in_checkpoint_dir(model_dir):
        check_vocab(args, TensorFiles.from_checkpoint_dir(model_dir))


def check_vocab(args, files) -> None:
    """Refuse a config.json whose vocab_size disagrees with the rows of the checkpoint's token embedding or lm_head
    (read from the headers): blamed on the config against the weights, before any token id is checked against it."""
    for key in files.keys():
        if key == "lm_head.weight" or key.endswith("embed_tokens.weight") and key.count("layers.") == 0:
            rows = files.shape(key)[0]
            if rows != args.vocab_size:
                raise InputError(args.where, f"{args.vocab_size}, but the weights have {rows} rows ({key} in "
                                 f"{files.file_of(key)}); does config.json match the weights?", key="vocab_size")


def _describe(args) -> str:
    moe = f", {args.num_experts} experts" if args.num_experts else ""
    return f"{args.model_type} ({args.num_layers} layers, hidden {args.hidden_size}{moe})"
