"""GLM-4.5 / 4.6 / 4.5-Air (`glm4_moe`): Qwen3-MoE's decoder with partial rotary, optional q/k norm, q/k/v biases,
dense first layers, and a sigmoid group-limited router beside always-on shared experts.

Differences from the Qwen3-MoE code (lora_eval/models/qwen3.py), each as transformers' Glm4Moe computes it:
- Attention: q/k/v biases when `attention_bias` (o_proj never has one); per-head q/k RMSNorm only when
  `use_qk_norm` (GLM-4.5: yes, 4.5-Air: no), before RoPE; RoPE turns only the first
  int(head_dim * partial_rotary_factor) dims of each head (`partial_rotary_factor`, in rope_parameters or at the
  top level, 0.5 when absent as in the published configs); the rest pass through.
- Layers 0 .. first_k_dense_replace-1 have a dense MLP (`intermediate_size`); the others an MoE.
- MoE: routed experts (fused, `moe_intermediate_size`, through the engine's fused experts path) plus
  `shared_experts`, a SiLU-gated MLP of moe_intermediate_size * n_shared_experts that every token passes:
  y = experts(x) + shared_experts(x). LoRA on the shared experts is dense LoRA (ordinary Linear sites).
- Router `mlp.gate` (weight [E, H], `e_score_correction_bias` [E]): logits in float32 (x and weight upcast, as
  transformers keeps the gate in float32), then layers.group_topk_sigmoid_routing: sigmoid scores, the correction
  bias for selection only, `n_group` groups of which `topk_group` stay eligible, top-k, renormalised if
  `norm_topk_prob`, times `routed_scaling_factor`. The router's weight and correction bias are held in float32 in
  every compute dtype; a router LoRA (PEFT's all-linear puts one on `mlp.gate.weight`) adds its delta computed in
  the compute dtype (Forward.linear_float32).

Checkpoint keys are the Hugging Face ones (per-expert `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` as
published, or transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`, both read by qwen3.load_weights).
The multi-token-prediction layers of the releases (`num_nextn_predict_layers`, stored as layers
num_hidden_layers .. num_hidden_layers + n - 1, e.g. GLM-4.5's `model.layers.92.*`) take no part in scoring
tokens: their keys are skipped, as transformers skips them.
PEFT 0.21 converts target_modules for this family: `all-linear` becomes attention + the router's weight + the
routed experts (target_parameters), so LoRA on the shared experts and the dense MLP comes only from trainers' own
exports (per-module keys `mlp.shared_experts.gate_proj.lora_A.weight`, ...); both load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from ..errors import InputError
from . import qwen3
from .layers import FusedExperts, Linear, route_sigmoid_group_limited, rope_parameters
from .layers import rope_inv_freq as default_rope_inv_freq

MODEL_TYPES = ("glm4_moe",)
# Glm4MoeConfig defaults for fields a config.json may leave out (partial_rotary_factor: see rope_params)
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "norm_topk_prob": True, "n_shared_experts": 1,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
            "use_qk_norm": False, "attention_bias": False, "num_nextn_predict_layers": 1}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig's, for configs that name none
# held in float32 whatever the compute dtype (transformers' _keep_in_fp32_modules_strict for Glm4Moe)
FLOAT32_KEYS = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    skipped_key_prefixes: tuple[str, ...] = ()  # checkpoint keys that are no weights of ours (the MTP layers)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        return super().from_config({**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}, where)

    def read_family(self, config: dict, read) -> None:
        self.qk_norm = read("use_qk_norm", bool)  # per head (Glm4MoeRMSNorm(head_dim)), before RoPE
        self.mlp_bias = False  # Glm4MoeMLP has no biases
        self.num_experts = read("n_routed_experts", int, "num_local_experts", minimum=1)
        self.top_k = read("num_experts_per_tok", int, minimum=1)
        self.moe_intermediate_size = read("moe_intermediate_size", int, minimum=1)
        self.norm_topk_prob = read("norm_topk_prob", bool)
        self.n_shared_experts = read("n_shared_experts", int, minimum=1)
        self.routed_scaling_factor = read("routed_scaling_factor", float, positive=True)
        self.n_group = read("n_group", int, minimum=1)
        self.topk_group = read("topk_group", int, minimum=1)
        E, G = self.num_experts, self.n_group
        if E % G or E // G < 2:
            raise InputError(self.where, f"{E} experts do not split into {G} groups of 2 or more", key="n_group")
        if self.topk_group > G:
            raise InputError(self.where, f"{self.topk_group} is more than n_group ({G})", key="topk_group")
        if self.top_k > self.topk_group * (E // G):
            raise InputError(self.where, f"{self.top_k} is more than the {self.topk_group * (E // G)} experts of "
                             f"topk_group ({self.topk_group}) groups", key="num_experts_per_tok")
        self.first_k_dense_replace = read("first_k_dense_replace", int, minimum=0)
        if self.first_k_dense_replace > self.num_layers:  # transformers would build no MoE layer: say so
            raise InputError(self.where, f"{self.first_k_dense_replace} is more than num_hidden_layers "
                             f"({self.num_layers})", key="first_k_dense_replace")
        self.sparse_layers = tuple(range(self.first_k_dense_replace, self.num_layers))
        mtp = read("num_nextn_predict_layers", int, "num_mtp_layers", minimum=0)
        self.skipped_key_prefixes = tuple(f"model.layers.{self.num_layers + i}." for i in range(mtp))
        self.rope = rope_params(config, self.head_dim, self.where)


def rope_params(config: dict, head_dim: int, where: str) -> dict:
    """{config key: rope parameters} with rope_theta and partial_rotary_factor in them, as transformers standardises
    them (the dict's value first, then the top-level field, then the default), checked here so that a bad value
    is refused by name."""
    key, params = rope_parameters(config, where)
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    factor = params["partial_rotary_factor"]
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1
    dim = int(head_dim * factor) if ok else 0
    if not ok or dim < 2 or dim % 2:
        raise InputError(where, f"partial_rotary_factor {factor!r} gives {dim} rotary dims of head_dim {head_dim}; "
                         "expected an even number >= 2", key="partial_rotary_factor")
    return {key: params}


def rotary_dim(head_dim: int, rope: dict) -> int:
    """How many leading dims of each head RoPE turns."""
    return int(head_dim * next(iter(rope.values()))["partial_rotary_factor"])


def rope_inv_freq(head_dim: int, rope: dict, where: str = "config.json") -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] (default, linear or llama3 rope over the rotary dims only)."""
    return default_rope_inv_freq(rotary_dim(head_dim, rope), rope, where)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fwd) -> torch.Tensor:
    """x [B, L, heads, D] -> [B, heads, L, D]: RoPE on the first rd dims (cos/sin [B, L, rd]), the rest as it is."""
    rd = cos.shape[-1]
    rotated = fwd.rope(x[..., :rd], cos, sin)  # [B, heads, L, rd]
    return torch.cat([rotated, x[..., rd:].transpose(1, 2)], dim=-1)  # [B, heads, L, D]


class Attention(qwen3.Attention):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)  # q/k/v with bias = attention_bias; per-head q/k norm when use_qk_norm
        self.o_proj = Linear(f"{prefix}.o_proj", args.num_heads * args.head_dim, args.hidden_size)  # no bias

    def project(self, x, cos, sin, fwd):
        if cos.shape[-1] == self.head_dim:  # rotary over the whole head: Qwen3's path (fused norm + RoPE)
            return super().project(x, cos, sin, fwd)
        B, L, _ = cos.shape
        T, nh, nkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = fwd.linears((self.q_proj, self.k_proj, self.v_proj), x)  # [T, nh*D], [T, nkv*D], [T, nkv*D]
        q, k = q.view(T, nh, D), k.view(T, nkv, D)
        if self.q_norm is not None:
            q, k = fwd.norm(self.q_norm, q), fwd.norm(self.k_norm, k)  # [T, nh, D], [T, nkv, D]: over each head
        q = partial_rope(q.view(B, L, nh, D), cos, sin, fwd)  # [B, nh, L, D]
        k = partial_rope(k.view(B, L, nkv, D), cos, sin, fwd)  # [B, nkv, L, D]
        return q, k, v.view(T, nkv, D)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.top_k, self.n_group, self.topk_group = args.top_k, args.n_group, args.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = args.norm_topk_prob, args.routed_scaling_factor
        self.gate = Linear(f"{prefix}.gate", H, E)  # the router: weight [E, H] float32
        # selection-only bias of the router, under its checkpoint name `mlp.gate.e_score_correction_bias`
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(E), requires_grad=False)  # [E] float32
        self.experts = FusedExperts(f"{prefix}.experts", E, H, I)
        shared = replace(args, intermediate_size=I * args.n_shared_experts, mlp_bias=False)
        self.shared_experts = qwen3.MLP(shared, f"{prefix}.shared_experts")

    def forward(self, x, fwd, residual=None):
        """Routed plus shared experts, added to `residual` [T, H] when given (the layer's residual stream)."""
        weights, ids = route_sigmoid_group_limited(self.gate, x, fwd, self.top_k, self.n_group, self.topk_group,
                                                   self.norm_topk_prob,
                                                   self.routed_scaling_factor)  # [T, k] float32, [T, k]
        routed = fwd.moe(self.experts, x, ids, weights.to(x.dtype))  # [T, H]
        out = routed + self.shared_experts(x, fwd)  # [T, H]: transformers adds the shared experts, then the residual
        return out if residual is None else residual + out


class CausalLM(qwen3.CausalLM):
    decoder_layer = partial(qwen3.DecoderLayer, attention=Attention, sparse_mlp=MoE)  # (dense layers: qwen3.MLP)
    rope_inv_freq = staticmethod(rope_inv_freq)


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's loader (same keys, per-expert or fused experts); the routers' weights and correction biases stay
    float32 in every compute dtype (FLOAT32_KEYS), as transformers keeps them."""
    return qwen3.load_weights(model, files, dtype, device, float32_keys=FLOAT32_KEYS)
