"""OLMoE: a top-k MoE in every layer, with q/k RMSNorm over the whole projection (all heads at once, not per
head as Qwen3) and an optional clip of q, k and v (`clip_qkv`).

Everything else is the Qwen3-MoE code (lora_eval/models/qwen3.py): the router is softmax -> top-k ->
renormalise only if `norm_topk_prob` (false in the published config); the expert size is `intermediate_size`.
Checkpoint keys are the Qwen3-MoE ones (per-expert gate_proj/up_proj/down_proj, or transformers 5's fused).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from . import qwen3
from .layers import RMSNorm
from .qwen3 import load_weights

MODEL_TYPES = ("olmoe",)
# OlmoeConfig defaults for fields a published config.json may leave out (the released OLMoE-1B-7B has no
# rms_norm_eps)
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "norm_topk_prob": False}

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    clip_qkv: float | None = None

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        return super().from_config({**DEFAULTS, **config}, where)

    def read_family(self, config: dict, read) -> None:
        self.read_experts(config, read, intermediate_key="intermediate_size")
        self.sparse_layers = tuple(range(self.num_layers))
        if config.get("clip_qkv") is not None:
            self.clip_qkv = read("clip_qkv", float, positive=True)


class Attention(qwen3.Attention):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)
        D, eps = args.head_dim, args.rms_norm_eps
        self.q_norm = RMSNorm(f"{prefix}.q_norm", args.num_heads * D, eps)  # over all query heads together
        self.k_norm = RMSNorm(f"{prefix}.k_norm", args.num_kv_heads * D, eps)
        self.clip = args.clip_qkv

    def project(self, x, cos, sin, fwd):
        T = x.shape[0]
        q, k, v = fwd.linears((self.q_proj, self.k_proj, self.v_proj), x)  # [T, nh*D], [T, nkv*D], [T, nkv*D]
        q, k = self.q_norm(q, fwd), self.k_norm(k, fwd)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = self.rope(q, k, cos, sin, fwd)  # [B, nh, L, D], [B, nkv, L, D]
        return q, k, v.view(T, self.num_kv_heads, self.head_dim)


class CausalLM(qwen3.CausalLM):
    decoder_layer = partial(qwen3.DecoderLayer, attention=Attention)
