"""Qwen2-MoE (Qwen1.5-MoE): Qwen3-MoE without q/k norm, with q/k/v biases (`qkv_bias`, o_proj never has one)
and a shared expert beside the routed ones.

Sparse layer: y = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x), where shared_expert is a
plain SiLU-gated MLP of `shared_expert_intermediate_size` and shared_expert_gate a Linear [1, H]. Both are
ordinary Linear sites (`mlp.shared_expert.gate_proj`, `mlp.shared_expert_gate`): LoRA on them is dense LoRA,
not expert LoRA. Layers are sparse per `decoder_sparse_step` / `mlp_only_layers` (dense MLP elsewhere); the
router renormalises only if `norm_topk_prob`. Checkpoint keys are the Qwen3-MoE ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from ..errors import UnsupportedError
from . import qwen3
from .layers import Linear, read_layer_types
from .qwen3 import load_weights

MODEL_TYPES = ("qwen2_moe",)
# Qwen2MoeConfig defaults for fields a published config.json may leave out (Qwen1.5-MoE-A2.7B has no qkv_bias)
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "qkv_bias": True, "norm_topk_prob": False}

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        return super().from_config({**DEFAULTS, **config}, where)

    def read_family(self, config: dict, read) -> None:
        types = read_layer_types(config, self.num_layers, self.where, ("full_attention", "sliding_attention"))
        sliding = [t for t in types or [] if t != "full_attention"]
        if sliding:
            raise UnsupportedError(self.where, f"layer type '{sliding[0]}' is not supported (full_attention is)",
                                   key="layer_types")
        self.attention_bias = read("qkv_bias", bool)  # q/k/v only, see Attention
        self.mlp_bias = False  # Qwen2MoeMLP has no biases
        self.read_experts(config, read)
        self.read_sparse_layers(config, read)
        self.shared_expert_intermediate_size = read("shared_expert_intermediate_size", int, minimum=1)


class Attention(qwen3.Attention):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)  # q/k/v/o with bias = qkv_bias
        self.o_proj = Linear(f"{prefix}.o_proj", args.num_heads * args.head_dim, args.hidden_size)  # no bias


class SharedExpertMoe(qwen3.SparseMoe):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)  # router `gate` and routed `experts`
        shared = replace(args, intermediate_size=args.shared_expert_intermediate_size)
        self.shared_expert = qwen3.MLP(shared, f"{prefix}.shared_expert")
        self.shared_expert_gate = Linear(f"{prefix}.shared_expert_gate", args.hidden_size, 1)  # [1, H]

    def forward(self, x, fwd, residual=None):
        routed = super().forward(x, fwd)  # [T, H]
        gate = fwd.pointwise(torch.sigmoid, self.shared_expert_gate(x, fwd))  # [T, 1]
        shared = gate * self.shared_expert(x, fwd)  # [T, H]
        out = routed + shared  # [T, H]: transformers adds the shared expert first, then the residual
        return out if residual is None else residual + out


class CausalLM(qwen3.CausalLM):
    decoder_layer = partial(qwen3.DecoderLayer, attention=Attention, sparse_mlp=SharedExpertMoe)
