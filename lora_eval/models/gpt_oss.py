"""GPT-OSS: one decoder family with attention sinks, alternating sliding-window attention and biased MoE layers.

Attention: GQA with q/k/v/o biases, YaRN rope, and a learned per-head logit ("sink") in every softmax
denominator; layers marked "sliding_attention" in `layer_types` see only the last `sliding_window` positions.
Every layer is an MoE: a biased router (top-k on the logits, then softmax over the k) over biased experts with
the clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.

On disk (transformers' layout) the experts are fused, transposed, with gate/up interleaved:
  mlp.experts.gate_up_proj [E, H, 2I] (x @ W; gate = [..., ::2], up = [..., 1::2]), gate_up_proj_bias [E, 2I],
  mlp.experts.down_proj [E, I, H], down_proj_bias [E, H].
gpt-oss releases store the experts in MXFP4 (`gate_up_proj_blocks` / `_scales`, ...): models/quantized.py
dequantises them into exactly this layout, so nothing below knows about it.
In memory they take the engine's usual layout (FusedExperts: gate_up [E, 2I, H] gate rows then up rows, down
[E, H, I]): `load_weights` de-interleaves and transposes them once, the one place where the on-disk layout differs
from our modules. Module paths equal the Hugging Face ones, so adapter keys address our modules directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..errors import InputError
from . import qwen3
from .checkpoint import load_tensor
from .layers import (EPSILON_BELOW, DecoderArgs, FusedExperts, Linear, config_reader, deinterleave_gate_up,
                     read_max_positions, rope_parameters, yarn_rope)
from .layers import rope_inv_freq as default_rope_inv_freq

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig defaults when config.json has no rope settings
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)

# expert tensor (same key on disk and in memory) -> (transposed on disk, gate/up interleaved on disk)
CHECKPOINT_EXPERT_KEYS = {
    "gate_up_proj": (True, True),  # disk [E, H, 2I] -> ours [E, 2I, H]
    "gate_up_proj_bias": (False, True),  # [E, 2I]
    "down_proj": (True, False),  # disk [E, I, H] -> ours [E, H, I]
    "down_proj_bias": (False, False),  # [E, H]
}


@dataclass
class ModelArgs(DecoderArgs):
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    rope_scale: float = 1.0  # the rope's attention factor, multiplied into cos and sin

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))  # every layer is an MoE

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def qk_norm(self) -> bool:
        return False  # (qwen3.Attention's per-head q/k norm)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        read = config_reader(config, where)
        heads = read("num_attention_heads", int, minimum=1)
        hidden = read("hidden_size", int, minimum=1)
        layers = read("num_hidden_layers", int, minimum=1)
        num_experts = read("num_local_experts", int, "num_experts", minimum=1)
        top_k = read("num_experts_per_tok", int, "experts_per_token", minimum=1)
        if top_k > num_experts:
            raise InputError(where, f"{top_k} is more than num_local_experts ({num_experts})", key="num_experts_per_tok")
        layer_types = config.get("layer_types")
        if layer_types is None:  # transformers' default: sliding on even layers
            layer_types = [LAYER_TYPES[i % 2] for i in range(layers)]
        if not isinstance(layer_types, list) or len(layer_types) != layers or \
                not all(t in LAYER_TYPES for t in layer_types):
            raise InputError(where, f"expected a list of {layers} entries from {', '.join(LAYER_TYPES)}, found "
                             f"{layer_types!r}", key="layer_types")
        window = None
        if "sliding_attention" in layer_types:
            window = read("sliding_window", int, default=128, minimum=1)
        args = cls(
            model_type=config["model_type"], vocab_size=read("vocab_size", int, minimum=1), hidden_size=hidden,
            num_layers=layers, num_heads=heads,
            num_kv_heads=read("num_key_value_heads", int, default=heads, minimum=1),
            head_dim=read("head_dim", int, default=hidden // heads, minimum=1),
            intermediate_size=read("intermediate_size", int, minimum=1), num_experts=num_experts, top_k=top_k,
            rms_norm_eps=read("rms_norm_eps", float, default=1e-5, positive=True, below=EPSILON_BELOW),
            layer_types=tuple(layer_types),
            sliding_window=window, swiglu_alpha=read("swiglu_alpha", float, default=1.702, positive=True),
            swiglu_limit=read("swiglu_limit", float, default=7.0, positive=True),
            attention_bias=read("attention_bias", bool, default=True),
            tie_word_embeddings=read("tie_word_embeddings", bool, default=False),
            max_position_embeddings=read_max_positions(read, config), where=where,
        )
        if heads % args.num_kv_heads:
            raise InputError(where, f"{heads} attention heads do not split into {args.num_kv_heads} key/value heads",
                             key="num_key_value_heads")
        if args.head_dim % 2:  # RoPE rotates pairs of dims
            raise InputError(where, f"RoPE needs an even head_dim, found {args.head_dim}", key="head_dim")
        args.rope, args.rope_scale = _rope(config, args.head_dim, where)
        return args


def _rope(config: dict, head_dim: int, where: str) -> tuple[dict, float]:
    """(rope settings: rope_parameters, or the legacy rope_scaling, or transformers' default yarn, with rope_theta
    and max_position_embeddings folded in and `key` naming their place in config.json; the attention factor)."""
    key, rope = rope_parameters(config, where, default=DEFAULT_ROPE, default_theta=DEFAULT_ROPE_THETA)
    rope.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    rope["key"] = key
    return rope, yarn_rope(head_dim, rope, where, key)[1] if rope["rope_type"] == "yarn" else 1.0


def rope_inv_freq(head_dim: int, rope: dict, where: str = "config.json") -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] for ModelArgs.rope: yarn, or the shared default/linear/llama3."""
    if rope["rope_type"] == "yarn":
        return yarn_rope(head_dim, rope, where, rope["key"])[0]
    return default_rope_inv_freq(head_dim, {rope["key"]: rope}, where)


class Attention(qwen3.Attention):
    """Qwen3's attention without q/k norm, with q/k/v/o biases, a learned logit per head in every softmax denominator
    (`sinks`) and, on sliding-attention layers, a window (set by DecoderLayer)."""

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)
        self.sinks = nn.Parameter(torch.empty(args.num_heads), requires_grad=False)  # [nh] logit per head


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        self.top_k = args.top_k
        self.router = Linear(f"{prefix}.router", args.hidden_size, args.num_experts, bias=True)
        self.experts = FusedExperts(f"{prefix}.experts", args.num_experts, args.hidden_size, args.intermediate_size,
                                    bias=True, activation="clamped_swiglu", swiglu_alpha=args.swiglu_alpha,
                                    swiglu_limit=args.swiglu_limit, interleaved_gate_up=True)

    def forward(self, x, fwd, residual=None):
        """The experts' output, added to `residual` [T, H] when given (the layer's residual stream)."""
        logits = self.router(x, fwd)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [T, k], [T, k]
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)  # [T, k] over the chosen k only
        fwd.observe_routing(self.router.site, logits, ids, weights)
        return fwd.moe(self.experts, x, ids, weights.to(x.dtype), residual=residual)  # [T, H]


class DecoderLayer(qwen3.DecoderLayer):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__(args, index, attention=Attention, sparse_mlp=MoE)  # (every layer is sparse)
        if args.layer_types[index] == "sliding_attention":
            self.self_attn.window = args.sliding_window  # this layer sees only the last `sliding_window` positions


class CausalLM(qwen3.CausalLM):
    """Qwen3's causal LM (lora_eval/models/qwen3.py) over GPT-OSS decoder layers, with YaRN rope."""

    decoder_layer = DecoderLayer
    rope_inv_freq = staticmethod(rope_inv_freq)


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every parameter of `model` read from checkpoint `files` in `dtype`, one tensor in memory at a time; expert
    tensors brought from transformers' layout into ours (CHECKPOINT_EXPERT_KEYS). On the meta device only the keys
    and shapes are checked and nothing is read."""
    def experts(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        kind = name.rsplit(".", 1)[-1]
        if ".mlp.experts." not in name or kind not in CHECKPOINT_EXPERT_KEYS:
            return None
        transposed, _ = CHECKPOINT_EXPERT_KEYS[kind]
        stored = (shape[0], shape[2], shape[1]) if transposed else shape  # [E, in, out] on disk
        return load_tensor(files, name, shape, dtype, device, stored, partial(to_our_layout, kind))

    return qwen3.load_weights(model, files, dtype, device, expert_keys={}, read_own=experts)


def to_our_layout(kind: str, t: torch.Tensor) -> torch.Tensor:
    """One on-disk expert tensor in our layout: [E, in, out] -> [E, out, in], interleaved gate/up -> gate, then up."""
    transposed, interleaved = CHECKPOINT_EXPERT_KEYS[kind]
    if transposed:
        t = t.transpose(1, 2)  # [E, out, in]
    if interleaved:
        t = deinterleave_gate_up(t, dim=1)  # [E, 2I, ...]
    return t.contiguous()

