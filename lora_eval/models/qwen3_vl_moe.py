"""Qwen3-VL-MoE (`qwen3_vl_moe`), text path: the language model inside Qwen3VLMoeForConditionalGeneration
checkpoints, scored on text-only input.

The language model is Qwen3-MoE (lora_eval/models/qwen3.py: per-head q/k norm, GQA, a softmax top-k router over
fused experts, dense MLP layers per `mlp_only_layers` / `decoder_sparse_step`) with four differences:
- config.json nests it under `text_config` (the top level holds `tie_word_embeddings`, default false, and the
  vision tower's `vision_config`); errors name nested keys as `text_config.<key>`.
- Its modules live under `model.language_model.` (`model.language_model.layers.{i}.self_attn.q_proj`, ...; lm_head
  stays `lm_head`): checkpoint keys and the module paths a trainer's PEFT model sees
  (`base_model.model.model.language_model.layers.{i}...`) address our modules directly, with no renaming.
- The router always renormalises its top-k weights (transformers' Qwen3VLMoeTextTopKRouter ignores
  norm_topk_prob).
- RoPE is the multimodal one (mrope): cos/sin from three position streams (temporal, height, width), interleaved
  per `mrope_section` (mrope_cos_sin, transformers' recomposition). For text-only input all three streams are the
  plain positions, which makes it equal to plain RoPE bit for bit; we still compute transformers' recomposition.
Experts on disk: the published checkpoints store `mlp.experts.gate_up_proj` [E, H, 2I] (x @ W; gate columns, then
up) and `down_proj` [E, I, H]; transformers 5's save_pretrained writes its in-memory [E, 2I, H] / [E, H, I]. Both
are read (load_weights tells them apart by shape, a square tensor by its layer's other one).
The vision tower (`model.visual.*` in checkpoints; `model.visual.*` LoRA in adapters, which PEFT's all-linear puts
there) never sees text-only input: its weights are skipped, not refused as unknown keys, and so is its LoRA
(adapter target_modules entries naming only vision modules, VISION_MODULES, are accepted for that reason).
Image and video input, and DeepStack's injection of visual features into the first layers, are not computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InputError, UnsupportedError
from . import qwen3
from .checkpoint import load_tensor
from .layers import Embedding, Linear, RMSNorm, rope_parameters

MODEL_TYPES = ("qwen3_vl_moe",)
PREFIX = "model.language_model"  # where the checkpoint and a trainer's model keep the language model
# checkpoint keys and adapter keys (after `base_model.model.`) of the vision tower: skipped, see the notes above
VISION_PREFIX = "model.visual."
ADAPTER_SKIPPED_PREFIXES = (VISION_PREFIX,)
# names of the vision tower's Linear modules that PEFT writes into target_modules (all-linear on the full model)
VISION_MODULES = ("qkv", "proj", "attn.qkv", "attn.proj", "linear_fc1", "linear_fc2", "mlp.linear_fc1",
                  "mlp.linear_fc2")
ADAPTER_SKIPPED_MODULES = VISION_MODULES  # adapters/load.py: such entries may match none of our modules
# Qwen3VLMoeTextConfig defaults for fields a text_config may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 500000.0}
DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' when rope parameters name none
EXPERT_TENSORS = ("gate_up_proj", "down_proj")

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    mrope_section: tuple[int, ...] = tuple(DEFAULT_MROPE_SECTION)
    skipped_key_prefixes: tuple[str, ...] = (VISION_PREFIX,)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise InputError(where, f"expected the language model's config as an object, found {text!r}",
                             key="text_config")
        merged = {**DEFAULTS, **text, "model_type": config["model_type"],
                  "tie_word_embeddings": config.get("tie_word_embeddings")}
        try:
            return super().from_config(merged, where)
        except InputError as e:  # UnsupportedError too: name the key where it is, under text_config
            key = e.key if e.key in (None, "tie_word_embeddings") else f"text_config.{e.key}"
            raise type(e)(e.where, e.problem, key=key) from None

    def read_family(self, config: dict, read) -> None:
        self.qk_norm = True  # per head, as Qwen3
        self.mlp_bias = False
        self.read_experts(config, read)
        self.norm_topk_prob = True  # Qwen3VLMoeTextTopKRouter always renormalises
        self.read_sparse_layers(config, read)
        key, params = rope_parameters(config, self.where)
        rope_type = params["rope_type"]
        if rope_type != "default":
            raise UnsupportedError(self.where, f"rope type '{rope_type}' is not supported for qwen3_vl_moe "
                                   "(default mrope is)", key=key)
        section = params.get("mrope_section", DEFAULT_MROPE_SECTION)
        if not (isinstance(section, list) and len(section) == 3
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
            raise InputError(self.where, f"expected three section sizes, found {section!r}", key=f"{key}.mrope_section")
        self.mrope_section = tuple(section)


def mrope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, section, dtype: torch.dtype):
    """Multimodal RoPE as transformers' Qwen3VLMoeTextRotaryEmbedding: positions [3, B, L] (temporal, height, width)
    -> cos, sin [B, L, D]. Each frequency j takes the temporal stream, except j = 1, 4, 7, ... < 3 * section[1]
    (height) and j = 2, 5, 8, ... < 3 * section[2] (width): the interleaved layout."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [3, B, L, D/2]
    out = []
    for part in (freqs.cos(), freqs.sin()):
        mixed = part[0].clone()  # [B, L, D/2]: temporal
        for stream, offset in ((1, 1), (2, 2)):
            idx = slice(offset, section[stream] * 3, 3)
            mixed[..., idx] = part[stream, ..., idx]
        out.append(torch.cat((mixed, mixed), dim=-1).to(dtype))  # [B, L, D]
    return out[0], out[1]


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = Embedding(f"{PREFIX}.embed_tokens", args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(qwen3.DecoderLayer(args, i, layers_path=f"{PREFIX}.layers")
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(f"{PREFIX}.norm", args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    """Qwen3VLMoeModel without its vision tower: `language_model` only."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.language_model = LanguageModel(args)


class CausalLM(qwen3.CausalLM):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model = Model(args)
        self.lm_head = Linear("lm_head", args.hidden_size, args.vocab_size)
        self.register_buffer("inv_freq", self.rope_inv_freq(args.head_dim, args.rope, args.where),
                             persistent=False)  # [D/2]

    def forward(self, input_ids: torch.Tensor, fwd) -> torch.Tensor:
        B, L = input_ids.shape
        text = self.model.language_model
        positions = fwd.positions(B, L, input_ids.device).expand(3, B, L)  # [3, B, L]: text-only, equal streams
        h = text.embed_tokens(input_ids.reshape(-1), fwd)  # [T, H]
        cos, sin = mrope_cos_sin(self.inv_freq, positions, self.args.mrope_section, h.dtype)  # [B, L, D]
        for i, layer in enumerate(text.layers):
            h = fwd.observe(i, "residual", layer(fwd.observe(i, "input", h), cos, sin, fwd))  # [T, H]
        return text.norm(h, fwd)  # [T, H]


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter of `model` read from checkpoint `files` in `dtype`, one tensor in memory at a time, under its
    own name; fused experts in either layout (published [E, in, out] or transformers 5's [E, out, in]). On the meta
    device only the keys and shapes are checked and nothing is read."""
    def experts(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if ".mlp.experts." not in name or name.rsplit(".", 1)[-1] not in EXPERT_TENSORS:
            return None
        transposed = _stored_transposed(files, name, shape)  # [E, in, out] (published), else [E, out, in]
        return load_tensor(files, name, shape, dtype, device, (shape[0], shape[2], shape[1]) if transposed else shape,
                           lambda t: t.transpose(1, 2) if transposed else t)

    return qwen3.load_weights(model, files, dtype, device, expert_keys={}, read_own=experts,
                              embedding=f"{PREFIX}.embed_tokens.weight")


def _stored_transposed(files, name: str, shape: tuple[int, int, int]) -> bool:
    """Whether the expert tensor `name` (ours: [E, out, in]) is stored as the published [E, in, out]. A square one
    ([E, H, H] gate_up when H = 2I) takes the layout of its layer's other expert tensor."""
    E, out, inp = shape
    published = (E, inp, out)
    if name not in files:
        files.check(name, shape)  # raises: missing tensor
    stored = files.shape(name)
    if stored not in (shape, published):
        raise InputError(files.file_of(name), f"shape {list(stored)}, expected {list(shape)} (transformers 5) or "
                         f"{list(published)} (published layout)", key=name)
    if shape != published:
        return stored == published
    kind = name.rsplit(".", 1)[-1]
    other = name[:-len(kind)] + ("down_proj" if kind == "gate_up_proj" else "gate_up_proj")
    other_shape = (E, inp, out // 2) if kind == "gate_up_proj" else (E, 2 * inp, out)  # ours, [E, out, in]
    return _stored_transposed(files, other, other_shape)
