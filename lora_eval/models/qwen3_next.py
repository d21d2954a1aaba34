"""Qwen3-Next (`qwen3_next`) and Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`, and `qwen3_5_moe_text` for the text model
saved alone): hybrids of Gated DeltaNet linear attention and gated full attention over a routed MoE with a shared
expert. The two families differ only where the flag `split_projections` and the config reader say.

Every layer, as transformers' Qwen3NextDecoderLayer computes it:
- Norms are zero-centred (models.layers.RMSNorm unit_offset: x / rms(x) * (1 + w), in float32): the layers'
  input / post-attention norms, the final norm and attention's per-head q/k norms.
- Token mixing by `layer_types` (absent in Qwen3-Next's release: every `full_attention_interval`-th layer is full
  attention, the others linear):
  * linear_attention, `linear_attn` (GatedDeltaNet): projections of the normed input to queries / keys (Hk heads x
    K), values (Hv heads x V), the output gate z (Hv x V) and per value head b and a; a causal depthwise conv
    (width W, SiLU) over the q / k / v channels; the gated delta rule with beta = sigmoid(b) and log decay
    -exp(A_log) * softplus(a + dt_bias), q and k L2-normalised (Forward.linear_attention, kernels/gated_delta.py);
    then a gated RMSNorm per head (norm(o) * silu(z)) and `out_proj`.
    Qwen3.5 projects with `in_proj_qkv` (q, k, v channels in conv order), `in_proj_z`, `in_proj_b`, `in_proj_a`;
    Qwen3-Next with `in_proj_qkvz` and `in_proj_ba`, whose rows are grouped per key head ([q_j, k_j, v_j, z_j] and
    [b_j, a_j] for key head j, each value part Hv / Hk heads wide): regrouped here into the conv's channel order.
  * full_attention, `self_attn`: GQA whose q_proj is twice as wide, per head [query; gate]; per-head q/k norms,
    RoPE on the first partial_rotary_factor of each head (0.25 in the releases), and the output multiplied by
    sigmoid(gate) before o_proj.
- MLP: the router (softmax, top-k, renormalised: Qwen3.5 always, Qwen3-Next per norm_topk_prob) over fused experts,
  plus a shared expert scaled by sigmoid(shared_expert_gate(x)) (models/qwen2_moe.py SharedExpertMoe). Qwen3-Next
  layers outside `decoder_sparse_step` / in `mlp_only_layers` have a dense MLP; every Qwen3.5 layer is MoE
  (transformers drops mlp_only_layers for it).

Qwen3.5's RoPE is the interleaved multimodal one; for text-only input its three position streams are the token
positions and it equals plain RoPE bit for bit (tests/test_qwen3_vl_moe.py shows it for the same recomposition), so
plain RoPE is computed.

Checkpoints. Module paths are those of the text model (`model.layers.{i}...`, what AutoModelForCausalLM builds and
what most trainers' PEFT keys name). The released Qwen3.5 checkpoints wrap it in the vision-language model: their
keys sit under `model.language_model.` and are read from there; the vision tower (`model.visual.*`) and the
multi-token-prediction layers (`mtp.*`, in every release) take no part in scoring text and are skipped by those
names, as transformers skips them. Experts per expert (`mlp.experts.{e}.gate_proj.weight`, as released) or fused
(transformers 5's in-memory names): both are read. Adapters made on the vision-language model name the same modules
under `model.language_model.` (ADAPTER_RENAMES) and may target the vision tower (skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InputError, UnsupportedError
from . import qwen3
from .glm4_moe import partial_rope, rope_inv_freq, rope_params
from .layers import Linear, RMSNorm, read_layer_types
from .qwen2_moe import SharedExpertMoe

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
# Qwen3NextConfig's defaults for fields a config.json may leave out (the 80B-A3B's shapes)
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "norm_topk_prob": True, "head_dim": 256,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
            "decoder_sparse_step": 1, "attention_bias": False}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
VL_PREFIX = "model.language_model."  # where the vision-language checkpoints (and their trainers) keep the text model
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
ADAPTER_RENAMES = ((VL_PREFIX, "model."),)
ADAPTER_SKIPPED_PREFIXES = (VISION_PREFIX,)
# names of the vision tower's Linear modules that PEFT writes into target_modules (all-linear on the full model)
ADAPTER_SKIPPED_MODULES = ("qkv", "proj", "attn.qkv", "attn.proj", "linear_fc1", "linear_fc2", "mlp.linear_fc1",
                           "mlp.linear_fc2")
# How PEFT 0.21 reads target_modules on these models (adapters/targets.py peft_view). transformers' routers are no
# nn.Linear, so "all-linear" leaves them out. PEFT converts qwen3_next's target_modules as transformers 5 fused its
# MoE (peft.utils.transformers_weight_conversion, as for Qwen2-MoE): the names gate_proj / up_proj / down_proj and
# gate become target_parameters of the fused experts and of the router, so "all-linear" there reaches experts and
# router but neither the shared expert's nor a dense MLP's projections (and a list naming shared_expert.gate_proj
# reaches the routed experts). qwen3_5_moe has no such conversion: its "all-linear" reaches neither routed experts
# nor router.
ADAPTER_NOT_NN_LINEAR = ("mlp.gate",)
ADAPTER_PEFT_CONVERTED = ("qwen3_next",)
# What takes no LoRA, refused by name. PEFT 0.21 refuses these too: the depthwise conv unless r is a multiple of its
# channels (then as a grouped-conv LoRA, which lora-eval does not compute), and A_log / dt_bias because its
# ParamWrapper takes only 2-D and 3-D parameters.
ADAPTER_UNSUPPORTED = {"conv1d": "a depthwise convolution", "A_log": "a 1-D per-head decay parameter",
                       "dt_bias": "a 1-D per-head decay bias"}

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    conv_kernel: int = 0
    shared_expert_intermediate_size: int = 0
    split_projections: bool = False  # Qwen3.5's in_proj_qkv / z / b / a (else Qwen3-Next's in_proj_qkvz / ba)
    skipped_key_prefixes: tuple[str, ...] = (MTP_PREFIX, VISION_PREFIX)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        model_type = config.get("model_type")
        nested = model_type == "qwen3_5_moe"
        text = config.get("text_config") if nested else config
        if not isinstance(text, dict):
            raise InputError(where, f"expected the language model's config as an object, found {text!r}",
                             key="text_config")
        merged = {**DEFAULTS, **{k: v for k, v in text.items() if v is not None}, "model_type": model_type}
        if nested:
            merged["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
        # the base reader knows only attention layer types: the hybrid pattern is read in read_family
        merged["_layer_types"] = merged.pop("layer_types", None)
        try:
            return super().from_config(merged, where)
        except InputError as e:  # UnsupportedError too: name a nested key where it is, under text_config
            key = e.key.replace("_layer_types", "layer_types") if e.key else e.key
            if nested and key not in (None, "tie_word_embeddings"):
                key = f"text_config.{key}"
            raise type(e)(e.where, e.problem, key=key) from None

    def read_family(self, config: dict, read) -> None:
        self.qk_norm = True
        self.mlp_bias = False
        self.split_projections = self.model_type != "qwen3_next"
        self.read_experts(config, read)
        if self.split_projections:  # Qwen3_5MoeTextConfig: every layer MoE, the router always renormalises
            self.norm_topk_prob = True
            self.sparse_layers = tuple(range(self.num_layers))
        else:
            self.read_sparse_layers(config, read)
        self.shared_expert_intermediate_size = read("shared_expert_intermediate_size", int, minimum=1)
        self.linear_num_key_heads = read("linear_num_key_heads", int, minimum=1)
        self.linear_num_value_heads = read("linear_num_value_heads", int, minimum=1)
        self.linear_key_head_dim = read("linear_key_head_dim", int, minimum=1)
        self.linear_value_head_dim = read("linear_value_head_dim", int, minimum=1)
        self.conv_kernel = read("linear_conv_kernel_dim", int, minimum=1)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise InputError(self.where, f"{self.linear_num_value_heads} value heads do not split into "
                             f"{self.linear_num_key_heads} key heads", key="linear_num_value_heads")
        self.layer_types = tuple(self._read_layer_types(config, read))
        self.rope = rope_params({"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR, **config}, self.head_dim,
                                self.where)
        rope_type = next(iter(self.rope.values()))["rope_type"]
        if rope_type != "default" and self.split_projections:
            raise UnsupportedError(self.where, f"rope type '{rope_type}' is not supported for {self.model_type} "
                                   "(default is)", key=next(iter(self.rope)))

    def _read_layer_types(self, config: dict, read) -> list[str]:
        given = {**config, "layer_types": config.get("_layer_types")}
        types = read_layer_types(given, self.num_layers, self.where, LAYER_TYPES)
        if types is None:  # transformers: every full_attention_interval-th layer is full attention
            interval = read("full_attention_interval", int, minimum=1)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(self.num_layers)]
        return types


class GatedAttention(qwen3.Attention):
    """GQA with an output gate: q_proj gives per head [query; gate]; zero-centred per-head q/k norms; partial RoPE."""

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__(args, prefix)  # k / v / o projections and the q / k norms
        H, D, nh = args.hidden_size, args.head_dim, args.num_heads
        self.q_proj = Linear(f"{prefix}.q_proj", H, nh * D * 2, args.attention_bias)  # [2*nh*D, H]
        self.q_norm.unit_offset = self.k_norm.unit_offset = True

    def forward(self, x, cos, sin, fwd, residual=None):
        B, L, _ = cos.shape
        T, nh, nkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = fwd.linears((self.q_proj, self.k_proj, self.v_proj), x)  # [T, 2*nh*D], [T, nkv*D] x2
        q_gate = q_gate.view(T, nh, 2 * D)
        q = fwd.norm(self.q_norm, q_gate[..., :D])  # [T, nh, D]
        gate = q_gate[..., D:].reshape(T, nh * D)  # [T, nh*D]
        k = fwd.norm(self.k_norm, k.view(T, nkv, D))  # [T, nkv, D]
        q = partial_rope(q.view(B, L, nh, D), cos, sin, fwd)  # [B, nh, L, D]
        k = partial_rope(k.view(B, L, nkv, D), cos, sin, fwd)  # [B, nkv, L, D]
        v = v.view(B, L, nkv, D).transpose(1, 2)  # [B, nkv, L, D]
        out = fwd.attention(q, k, v, D**-0.5)  # [B, nh, L, D]
        out = out.transpose(1, 2).reshape(T, nh * D) * fwd.pointwise(torch.sigmoid, gate)  # [T, nh*D]
        return self.o_proj(out, fwd, residual=residual)  # [T, H]


class DepthwiseConv(nn.Module):
    """The weight [C, 1, W] of a depthwise causal conv (no bias), under the checkpoint's `conv1d.weight`."""

    def __init__(self, site: str, channels: int, width: int):
        super().__init__()
        self.site = site
        self.weight = nn.Parameter(torch.empty(channels, 1, width), requires_grad=False)  # [C, 1, W]


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        H, Hk, Hv = args.hidden_size, args.linear_num_key_heads, args.linear_num_value_heads
        K, V = args.linear_key_head_dim, args.linear_value_head_dim
        self.head_k_dim, self.value_shape = K, (Hv, V)
        self.qkv_split = [Hk * K, Hk * K, Hv * V]  # the conv's channels: queries, keys, values
        self.split = args.split_projections
        if self.split:
            self.in_proj_qkv = Linear(f"{prefix}.in_proj_qkv", H, 2 * Hk * K + Hv * V)
            self.in_proj_z = Linear(f"{prefix}.in_proj_z", H, Hv * V)
            self.in_proj_b = Linear(f"{prefix}.in_proj_b", H, Hv)
            self.in_proj_a = Linear(f"{prefix}.in_proj_a", H, Hv)
            self.input_groups = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),)
        else:
            self.in_proj_qkvz = Linear(f"{prefix}.in_proj_qkvz", H, 2 * Hk * K + 2 * Hv * V)
            self.in_proj_ba = Linear(f"{prefix}.in_proj_ba", H, 2 * Hv)
            self.input_groups = (("in_proj_qkvz", "in_proj_ba"),)
        self.conv1d = DepthwiseConv(f"{prefix}.conv1d", 2 * Hk * K + Hv * V, args.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(Hv), requires_grad=False)  # [Hv]
        self.A_log = nn.Parameter(torch.empty(Hv), requires_grad=False)  # [Hv]
        self.norm = RMSNorm(f"{prefix}.norm", V, args.rms_norm_eps)  # gated: Forward.gated_norm
        self.out_proj = Linear(f"{prefix}.out_proj", Hv * V, H)

    def conv_state(self, like: torch.Tensor) -> torch.Tensor:
        """The conv inputs before a sequence's first position: zeros [W-1, C] in `like`'s dtype and device."""
        C, _, W = self.conv1d.weight.shape
        return like.new_zeros(W - 1, C)

    def recurrent_state(self, like: torch.Tensor) -> torch.Tensor:
        """The delta rule's state before a sequence's first position: zeros [Hv, K, V] float32."""
        Hv, V = self.value_shape
        return torch.zeros(Hv, self.head_k_dim, V, dtype=torch.float32, device=like.device)

    def projections(self, x, fwd):
        """x [T, H] -> qkv [T, C] (the conv's channel order), z [T, Hv*V], b and a [T, Hv]."""
        if self.split:
            return fwd.linears((self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), x)
        T = x.shape[0]
        Hv, V = self.value_shape
        Hk, K = self.qkv_split[0] // self.head_k_dim, self.head_k_dim
        r = Hv // Hk  # value heads per key head
        qkvz, ba = fwd.linears((self.in_proj_qkvz, self.in_proj_ba), x)  # [T, 2HkK + 2HvV], [T, 2Hv]
        q, k, v, z = qkvz.view(T, Hk, 2 * K + 2 * r * V).split([K, K, r * V, r * V], dim=-1)  # per key head
        b, a = ba.view(T, Hk, 2 * r).split([r, r], dim=-1)  # [T, Hk, r] each
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)  # [T, C]
        return qkv, z.reshape(T, Hv * V), b.reshape(T, Hv), a.reshape(T, Hv)

    def forward(self, x, B: int, L: int, fwd, residual=None):
        """Gated DeltaNet's output projection, added to `residual` [T, H] when given."""
        T = x.shape[0]
        Hv, V = self.value_shape
        qkv, z, b, a = self.projections(x, fwd)
        core = fwd.linear_attention(self, qkv, b, a, B, L)  # [T, Hv, V]
        out = fwd.gated_norm(self.norm, core, z.view(T, Hv, V))  # [T, Hv, V]
        return self.out_proj(out.reshape(T, Hv * V), fwd, residual=residual)  # [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm", args.hidden_size, args.rms_norm_eps, True)
        self.linear = args.layer_types[index] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(args, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm", args.hidden_size,
                                                args.rms_norm_eps, True)
        if index in args.sparse_layers:
            self.mlp = SharedExpertMoe(args, f"{prefix}.mlp")
        else:
            self.mlp = qwen3.MLP(args, f"{prefix}.mlp")

    def forward(self, h, cos, sin, fwd):
        x = self.input_layernorm(h, fwd)  # [T, H]
        if self.linear:
            h = self.linear_attn(x, *cos.shape[:2], fwd, residual=h)  # [T, H]: h + linear attention
        else:
            h = self.self_attn(x, cos, sin, fwd, residual=h)  # [T, H]: h + attention
        return self.mlp(self.post_attention_layernorm(h, fwd), fwd, residual=h)  # [T, H]: h + MoE


class CausalLM(qwen3.CausalLM):
    """qwen3's causal LM (its backbone, forward and lm_head) with this file's decoder layers, partial RoPE and the
    zero-centred final norm."""

    decoder_layer = DecoderLayer
    rope_inv_freq = staticmethod(rope_inv_freq)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model.norm.unit_offset = True


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's loader (per-expert or fused experts), reading the text model's keys where the checkpoint has
    them and else under the vision-language model's `model.language_model.` (see the module notes)."""
    wrapped = any(key.startswith(VL_PREFIX) for key in files.keys())
    return qwen3.load_weights(model, files, dtype, device, renames=(("model.", VL_PREFIX),) if wrapped else ())


def adapter_split_projections(model: CausalLM) -> dict[str, tuple[tuple[str, int], ...]]:
    """The projections that trainers split where the checkpoint fuses them: Tinker's Qwen3.5 exports carry LoRA on
    `linear_attn.in_proj_q`, `in_proj_k`, `in_proj_v` for the fused `in_proj_qkv` (rows: queries, keys, values).
    {fused site: ((part site, rows), ...) in row order}; adapters/load.py loads the parts as one LoRA of it."""
    found = {}
    for layer in model.model.layers:
        if layer.linear and layer.linear_attn.split:
            site = layer.linear_attn.in_proj_qkv.site
            parts = (site.removesuffix("_qkv") + f"_{part}" for part in "qkv")
            found[site] = tuple(zip(parts, layer.linear_attn.qkv_split))
    return found
