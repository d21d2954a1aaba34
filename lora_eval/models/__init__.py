"""Model families and checkpoint loading: config.json -> family -> our model code with the checkpoint's weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import TensorFiles, read_json
from ..errors import InputError, UnsupportedError
from . import qwen3

# model_type in config.json -> the module holding that family's ModelArgs, CausalLM and load_weights
FAMILIES = {model_type: qwen3 for model_type in qwen3.MODEL_TYPES}
# transformers' in-memory names that are not checkpoint tensors
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Our model for the local Hugging Face checkpoint folder `model_dir`, weights in compute `dtype` on `device`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(model_dir, "model folder not found")
    config_path = model_dir / "config.json"
    config = read_json(config_path)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedError(config_path, f"'{model_type}' ({arch}) is not supported; supported model types: "
                               f"{', '.join(sorted(FAMILIES))}", key="model_type")
    family = FAMILIES[model_type]
    args = family.ModelArgs.from_config(config, where=str(config_path))
    files = TensorFiles.from_checkpoint_dir(model_dir)
    with torch.device("meta"):
        model = family.CausalLM(args)
    weights = family.load_weights(model, files, dtype, torch.device(device))
    unused = [k for k in files.keys() if k not in files.read_keys and not k.endswith(NOT_WEIGHTS)]
    if unused:
        raise InputError(files.file_of(unused[0]), f"not a weight of a {_describe(args)} model as config.json "
                         f"describes it ({len(unused)} such keys); does config.json match the weights?",
                         key=unused[0])
    model.load_state_dict(weights, strict=True, assign=True)
    model.inv_freq = qwen3.rope_inv_freq(args.head_dim, args.rope, args.where).to(device)
    model.eval()
    return model


def _describe(args) -> str:
    moe = f", {args.num_experts} experts" if args.num_experts else ""
    return f"{args.model_type} ({args.num_layers} layers, hidden {args.hidden_size}{moe})"
