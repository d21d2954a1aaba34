"""DeepSeek-V3 / V3.1 / R1 and Kimi-K2 (model_type deepseek_v3, and kimi_k2 for Kimi's own config.json): multi-head
latent attention (MLA), dense first layers, then MoE layers with shared experts and a sigmoid, group-limited router.
transformers' DeepseekV3ForCausalLM is the oracle; every formula below is its.

Attention (MLA), per layer, T tokens, nh heads, each q/k head = nope + rope dims, each v head = v dims:
  q         = q_b_proj(q_a_layernorm(q_a_proj(x)))   [T, nh*(nope+rope)]  (q_proj(x) where q_lora_rank is null)
  latent    = kv_a_proj_with_mqa(x)                  [T, kv_lora_rank + rope] = [kv | k_rot (one head for all)]
  k_nope, v = split(kv_b_proj(kv_a_layernorm(kv)))   [T, nh*(nope+v)]
  RoPE on the rope dims only (q's per head, k_rot once); `rope_interleave` (true in transformers' config) pairs
  dims (0,1), (2,3), ...: we de-interleave them (evens, then odds) and apply the ordinary rotate-half RoPE, which
  is transformers' apply_rotary_pos_emb_interleave term for term. Softmax scale (nope+rope)^-0.5, times
  mscale(factor, mscale_all_dim)^2 for a scaled rope (yarn); YaRN's attention factor mscale/mscale_all_dim
  multiplies cos and sin. Attention runs over the decompressed keys and values (ordinary causal attention, v head
  size != q/k head size; fine for prefill, which is all this engine does). q_a_layernorm and kv_a_layernorm use
  eps 1e-6 whatever rms_norm_eps says (transformers builds them with DeepseekV3RMSNorm's default).
MLP: layers < first_k_dense_replace a dense SiLU MLP (intermediate_size); the others an MoE:
  scores = sigmoid(x W_gate^T) in float32; experts chosen by scores + e_score_correction_bias among the topk_group
  best of n_group groups (layers.group_topk_sigmoid_routing); weights = chosen unbiased scores, renormalised if
  norm_topk_prob, times routed_scaling_factor; y = routed experts (FusedExperts, the engine's fused MoE path and
  its expert LoRA) + shared_experts(x) (one SiLU MLP of n_shared_experts * moe_intermediate_size, dense LoRA sites).
The router runs in plain torch on both backends: the Triton router kernel (kernels/router.py) does softmax top-k
only, so the triton backend falls back to torch here (sigmoid, group masks, top-k: a handful of small ops, no host
sync, CUDA-graph safe). Its weight and e_score_correction_bias are kept in float32 whatever the compute dtype, as
transformers does (_keep_in_fp32_modules_strict): logits are x.float() @ W^T (Forward.linear_float32); a router
LoRA (PEFT all-linear targets `mlp.gate.weight` through target_parameters) adds its delta computed in the compute
dtype.

Adapters address our modules by transformers' paths: self_attn.{q_proj | q_a_proj, q_b_proj}, kv_a_proj_with_mqa,
kv_b_proj, o_proj; mlp.gate_proj/up_proj/down_proj (dense layers); mlp.shared_experts.gate_proj/...; mlp.gate (the
router); mlp.experts (every expert layout lora_eval reads). PEFT 0.21 turns gate_proj/up_proj/down_proj in
target_modules (even fully qualified shared_experts.* names) into target_parameters on the routed experts, so LoRA
on shared experts and dense MLPs only comes from per-module exports of other trainers.

Checkpoint keys (CHECKPOINT_EXPERT_KEYS; everything else under its in-memory name): routed experts per expert
`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight` as published and as transformers 5 writes them, or fused
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]; the router `mlp.gate.weight` [E, H] and
`mlp.gate.e_score_correction_bias` [E]. Published DeepSeek-V3 checkpoints also hold the multi-token-prediction
module as layer `num_hidden_layers` (num_nextn_predict_layers of them): not part of the causal LM, skipped on load
(transformers ignores `model.layers.61.*` too). Block-FP8 releases are dequantised by models/quantized.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from ..errors import InputError, UnsupportedError
from . import qwen3
from .checkpoint import load_tensor
from .layers import (EPSILON_BELOW, DecoderArgs, FusedExperts, Linear, RMSNorm, config_reader, read_max_positions,
                     rope_number, rope_parameters, route_sigmoid_group_limited, yarn_mscale, yarn_rope)
from .layers import rope_inv_freq as default_rope_inv_freq

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# fused in-memory expert tensor -> the per-expert on-disk projections stacked into it (Qwen3-MoE's names)
CHECKPOINT_EXPERT_KEYS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# kept in float32 whatever the compute dtype (transformers' _keep_in_fp32_modules_strict)
FLOAT32_KEYS = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (DeepseekV3RMSNorm's default; rms_norm_eps is not used)
# DeepseekV3Config defaults for fields a config.json may leave out (an explicit null q_lora_rank means q_proj)
DEFAULTS = dict(intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1)
DEFAULT_ROPE_THETA = 10000.0
# config fields whose other values describe models transformers' DeepseekV3 does not compute (it ignores them)
ONLY = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu"}

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(DecoderArgs):
    q_lora_rank: int | None  # None: a direct q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # one routed expert; the shared experts are n_shared_experts times this
    num_experts: int
    top_k: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj (never q_proj, q_b_proj, kv_b_proj)
    rope_interleave: bool = True
    num_mtp_layers: int = 0  # num_nextn_predict_layers: checkpoint layers after the last one, skipped on load
    mlp_bias: bool = False  # for qwen3.MLP: DeepSeek's MLPs have no biases
    # (rope: rope_type, rope_theta, dim (= qk_rope_head_dim) and its parameters)
    rope_scale: float = 1.0  # the rope's attention factor (YaRN), multiplied into cos and sin
    softmax_scale: float = 1.0

    @property
    def head_dim(self) -> int:
        """The q/k head size (nope + rope dims); v heads have v_head_dim, RoPE covers qk_rope_head_dim only."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # MLA decompresses one key and value per query head

    @property
    def skipped_key_prefixes(self) -> tuple[str, ...]:
        """Checkpoint keys that are no weights of ours (models/__init__.py passes over them): the MTP layers."""
        return tuple(f"model.layers.{self.num_layers + i}." for i in range(self.num_mtp_layers))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_layers))

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        config = {**DEFAULTS, **config}
        read = config_reader(config, where)
        for key, value in ONLY.items():
            if config.get(key) is not None and config[key] != value:
                raise UnsupportedError(where, f"{config[key]!r} is not supported for {config['model_type']} "
                                       f"(only {value!r}, which transformers' DeepseekV3 computes)", key=key)
        heads = read("num_attention_heads", int, minimum=1)
        if config.get("num_key_value_heads") not in (None, heads):
            raise UnsupportedError(where, f"{config['num_key_value_heads']} key/value heads for {heads} attention "
                                   "heads: MLA decompresses one per query head (equal counts only)",
                                   key="num_key_value_heads")
        q_lora_rank = None if config.get("q_lora_rank") is None else read("q_lora_rank", int, minimum=1)
        args = cls(
            model_type=config["model_type"], vocab_size=read("vocab_size", int, minimum=1),
            hidden_size=read("hidden_size", int, minimum=1), num_layers=read("num_hidden_layers", int, minimum=1),
            num_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=read("kv_lora_rank", int, minimum=1),
            qk_nope_head_dim=read("qk_nope_head_dim", int, minimum=1),
            qk_rope_head_dim=read("qk_rope_head_dim", int, minimum=2), v_head_dim=read("v_head_dim", int, minimum=1),
            intermediate_size=read("intermediate_size", int, minimum=1),
            moe_intermediate_size=read("moe_intermediate_size", int, minimum=1),
            num_experts=read("n_routed_experts", int, minimum=1),
            top_k=read("num_experts_per_tok", int, minimum=1),
            n_shared_experts=read("n_shared_experts", int, minimum=0), n_group=read("n_group", int, minimum=1),
            topk_group=read("topk_group", int, minimum=1), norm_topk_prob=read("norm_topk_prob", bool),
            routed_scaling_factor=read("routed_scaling_factor", float, positive=True),
            first_k_dense_replace=read("first_k_dense_replace", int, minimum=0),
            rms_norm_eps=read("rms_norm_eps", float, positive=True, below=EPSILON_BELOW),
            attention_bias=read("attention_bias", bool), rope_interleave=read("rope_interleave", bool),
            tie_word_embeddings=read("tie_word_embeddings", bool, default=False),
            num_mtp_layers=read("num_nextn_predict_layers", int, minimum=0),
            max_position_embeddings=read_max_positions(read, config), where=where,
        )
        if args.first_k_dense_replace > args.num_layers:  # transformers would build no MoE layer: say so
            raise InputError(where, f"{args.first_k_dense_replace} is more than num_hidden_layers ({args.num_layers})",
                             key="first_k_dense_replace")
        args.check_router()
        if args.qk_rope_head_dim % 2:
            raise InputError(where, f"RoPE needs an even number of dims, found {args.qk_rope_head_dim}",
                             key="qk_rope_head_dim")
        args.rope, args.rope_scale, args.softmax_scale = _rope(config, args.qk_rope_head_dim, args.head_dim, where)
        return args

    def check_router(self) -> None:
        E, where = self.num_experts, self.where
        if self.n_shared_experts < 1:
            raise UnsupportedError(where, "MoE layers without shared experts are not supported (transformers' "
                                   "DeepseekV3 builds them of size 0)", key="n_shared_experts")
        if E % self.n_group or E // self.n_group < 2:
            raise InputError(where, f"{E} routed experts do not split into {self.n_group} groups of 2 or more "
                             "(the group score is the sum of a group's best two)", key="n_group")
        if self.topk_group > self.n_group:
            raise InputError(where, f"{self.topk_group} is more than n_group ({self.n_group})", key="topk_group")
        if self.top_k > self.topk_group * (E // self.n_group):
            raise InputError(where, f"{self.top_k} experts cannot be chosen from {self.topk_group} groups of "
                             f"{E // self.n_group}", key="num_experts_per_tok")


def _rope(config: dict, rope_dim: int, qk_head_dim: int, where: str) -> tuple[dict, float, float]:
    """(rope settings: rope_parameters or the legacy rope_scaling, with rope_theta, max_position_embeddings, the
    rotated `dim` and `key` (its place in config.json) folded in; YaRN's attention factor on cos / sin; the softmax
    scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a scaled rope, as transformers'
    yarn_apply_mscale)."""
    key, rope = rope_parameters(config, where, default_theta=DEFAULT_ROPE_THETA)
    rope.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    rope.update(key=key, dim=rope_dim)
    rope_inv_freq(rope_dim, rope, where)  # refuses the rope types we do not compute, by name
    attention_factor = yarn_rope(rope_dim, rope, where, key)[1] if rope["rope_type"] == "yarn" else 1.0
    scale = qk_head_dim ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        factor = rope_number(rope, "factor", where, key) if rope.get("factor") is not None else \
            rope_number(rope, "max_position_embeddings", where, key) / \
            rope_number(rope, "original_max_position_embeddings", where, key)
        m = yarn_mscale(factor, rope_number(rope, "mscale_all_dim", where, key, minimum=0))
        scale = scale * m * m
    return rope, attention_factor, scale


def rope_inv_freq(head_dim: int, rope: dict, where: str = "config.json") -> torch.Tensor:
    """Rotary inverse frequencies [qk_rope_head_dim/2] for ModelArgs.rope (yarn, or default / linear / llama3).
    MLA rotates only `rope["dim"]` dims of each head: `head_dim` (the whole q/k head, what CausalLM passes) is not
    used."""
    if rope["rope_type"] == "yarn":
        return yarn_rope(rope["dim"], rope, where, rope["key"])[0]
    return default_rope_inv_freq(rope["dim"], {rope["key"]: rope}, where)


class Attention(nn.Module):
    """Multi-head latent attention (see the module notes)."""

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        H, nh, bias = args.hidden_size, args.num_heads, args.attention_bias
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = nh, args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.interleaved, self.scale = args.rope_interleave, args.softmax_scale
        qk = self.nope + self.rope_dim
        if args.q_lora_rank is None:
            self.q_proj = Linear(f"{prefix}.q_proj", H, nh * qk)  # never a bias
        else:
            self.q_a_proj = Linear(f"{prefix}.q_a_proj", H, args.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(f"{prefix}.q_a_layernorm", args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(f"{prefix}.q_b_proj", args.q_lora_rank, nh * qk)
        first = "q_proj" if args.q_lora_rank is None else "q_a_proj"
        self.input_groups = ((first, "kv_a_proj_with_mqa"),)  # projections of x: one GEMM / shrink on Triton
        self.kv_a_proj_with_mqa = Linear(f"{prefix}.kv_a_proj_with_mqa", H, args.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(f"{prefix}.kv_a_layernorm", args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(f"{prefix}.kv_b_proj", args.kv_lora_rank, nh * (self.nope + self.v_dim))
        self.o_proj = Linear(f"{prefix}.o_proj", nh * self.v_dim, H, bias)

    def rope(self, x: torch.Tensor, cos, sin, fwd) -> torch.Tensor:
        """RoPE on x [B, L, heads, rope] -> [B, heads, L, rope]; interleaved pairs are de-interleaved first."""
        if self.interleaved:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [B, L, heads, rope]: evens, then odds
        return fwd.rope(x, cos, sin)

    def forward(self, x, cos, sin, fwd, residual=None):
        """Attention's output projection, added to `residual` [T, H] when given (the layer's residual stream)."""
        B, L, _ = cos.shape
        T = x.shape[0]
        nh, nope, rope, vd = self.num_heads, self.nope, self.rope_dim, self.v_dim
        if self.q_lora_rank is None:
            q, latent = fwd.linears((self.q_proj, self.kv_a_proj_with_mqa), x)  # [T, nh*(nope+rope)], [T, kv+rope]
        else:
            q_latent, latent = fwd.linears((self.q_a_proj, self.kv_a_proj_with_mqa), x)  # [T, q_rank], [T, kv+rope]
            q = self.q_b_proj(self.q_a_layernorm(q_latent, fwd), fwd)  # [T, nh*(nope+rope)]
        q_nope, q_rot = q.view(B, L, nh, nope + rope).split([nope, rope], dim=-1)  # [B, L, nh, nope], [.., rope]
        kv_latent, k_rot = latent.split([self.kv_lora_rank, rope], dim=-1)  # [T, kv_rank], [T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent, fwd), fwd)  # [T, nh*(nope+v)]
        k_nope, v = kv.view(B, L, nh, nope + vd).split([nope, vd], dim=-1)  # [B, L, nh, nope], [B, L, nh, v]
        q_rot = self.rope(q_rot, cos, sin, fwd)  # [B, nh, L, rope]
        k_rot = self.rope(k_rot.view(B, L, 1, rope), cos, sin, fwd)  # [B, 1, L, rope]: one head shared by all
        q = torch.cat([q_nope.transpose(1, 2), q_rot], dim=-1)  # [B, nh, L, nope+rope]
        k = torch.cat([k_nope.transpose(1, 2), k_rot.expand(B, nh, L, rope)], dim=-1)  # [B, nh, L, nope+rope]
        out = fwd.attention(q, k, v.transpose(1, 2), self.scale)  # [B, nh, L, v]
        out = out.transpose(1, 2).reshape(T, nh * vd)  # [T, nh*v]
        return self.o_proj(out, fwd, residual=residual)  # [T, H]


class MoE(nn.Module):
    """Routed experts (sigmoid, group-limited top-k) plus shared experts (see the module notes)."""

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        E, H = args.num_experts, args.hidden_size
        self.top_k, self.n_group, self.topk_group = args.top_k, args.n_group, args.topk_group
        self.norm_topk_prob, self.scaling = args.norm_topk_prob, args.routed_scaling_factor
        self.gate = Linear(f"{prefix}.gate", H, E)  # the router, weight [E, H] kept in float32 (load_weights)
        self.gate.register_buffer("e_score_correction_bias", torch.empty(E))  # [E] float32, a checkpoint tensor
        self.experts = FusedExperts(f"{prefix}.experts", E, H, args.moe_intermediate_size)
        shared = replace(args, intermediate_size=args.moe_intermediate_size * args.n_shared_experts)
        self.shared_experts = qwen3.MLP(shared, f"{prefix}.shared_experts")

    def forward(self, x, fwd, residual=None):
        """Routed plus shared experts, added to `residual` [T, H] when given (the layer's residual stream)."""
        weights, ids = route_sigmoid_group_limited(self.gate, x, fwd, self.top_k, self.n_group, self.topk_group,
                                                   self.norm_topk_prob, self.scaling)  # [T, k] float32, [T, k]
        routed = fwd.moe(self.experts, x, ids, weights.to(x.dtype))  # [T, H]
        out = self.shared_experts(x, fwd, residual=routed)  # [T, H]: routed + shared, transformers' order
        return out if residual is None else residual + out


class CausalLM(qwen3.CausalLM):
    """Qwen3's causal LM (lora_eval/models/qwen3.py) over DeepSeek-V3 decoder layers; RoPE over the rope dims."""

    decoder_layer = partial(qwen3.DecoderLayer, attention=Attention, sparse_mlp=MoE)  # (dense layers: qwen3.MLP)
    rope_inv_freq = staticmethod(rope_inv_freq)


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `model` (parameters and e_score_correction_bias) read from `files`, in `dtype`
    except the router's (float32). On the meta device only the keys and shapes are checked and nothing is read.
    (The multi-token-prediction layers after the last one: ModelArgs.skipped_key_prefixes.)"""
    weights = qwen3.load_weights(model, files, dtype, device, CHECKPOINT_EXPERT_KEYS, float32_keys=FLOAT32_KEYS)
    for name, buffer in model.named_buffers():  # e_score_correction_bias (a buffer: not a parameter)
        if name.endswith(FLOAT32_KEYS):
            weights[name] = load_tensor(files, name, tuple(buffer.shape), torch.float32, device)
    return weights
