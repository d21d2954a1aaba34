"""Qwen3-MoE, Qwen3 and Llama: one decoder family (GQA, RoPE, RMSNorm, SiLU-gated MLP or top-k MoE).

Qwen3 and Qwen3-MoE add per-head q/k RMSNorm; Qwen3-MoE replaces the MLP of sparse layers with a router
(softmax -> top-k -> renormalise if `norm_topk_prob`) over experts held fused: gate_up [E, 2I, H] (gate rows
first) and down [E, H, I]. Module paths equal the Hugging Face ones, so checkpoint keys and adapter keys
address our modules directly; CHECKPOINT_EXPERT_KEYS below is the one place where on-disk names differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError, UnsupportedError
from .checkpoint import check_weight, load_tensor, read_weight
from .layers import (EPSILON_BELOW, DecoderArgs, Embedding, FusedExperts, Linear, RMSNorm, config_reader,
                     read_layer_list, read_layer_types, read_max_positions, rope_cos_sin, rope_inv_freq)

MODEL_TYPES = ("qwen3_moe", "qwen3", "llama")

# fused in-memory expert tensor -> the per-expert on-disk projections stacked into it (in row order)
# (other families: lora_eval/models/*.py, each with its own mapping passed to load_weights)
CHECKPOINT_EXPERT_KEYS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class ModelArgs(DecoderArgs):
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qk_norm: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        read = config_reader(config, where)

        model_type = config["model_type"]
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedError(where, f"hidden_act '{config['hidden_act']}' is not supported (silu is)", key="hidden_act")
        if read("use_sliding_window", bool, default=False):
            raise UnsupportedError(where, "sliding-window attention is not supported for this family",
                                   key="use_sliding_window")
        heads = read("num_attention_heads", int, minimum=1)
        hidden = read("hidden_size", int, minimum=1)
        layers = read("num_hidden_layers", int, minimum=1)
        args = cls(
            model_type=model_type, vocab_size=read("vocab_size", int, minimum=1), hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=read("num_key_value_heads", int, default=heads, minimum=1),
            head_dim=read("head_dim", int, default=hidden // heads, minimum=1),
            intermediate_size=read("intermediate_size", int, default=0, minimum=0),
            rms_norm_eps=read("rms_norm_eps", float, default=1e-6, positive=True, below=EPSILON_BELOW),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=read("attention_bias", bool, default=False), mlp_bias=read("mlp_bias", bool, default=False),
            tie_word_embeddings=read("tie_word_embeddings", bool, default=False),
            rope={k: config.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")},
            max_position_embeddings=read_max_positions(read, config), where=where,
        )
        read_layer_types(config, layers, where, ("full_attention", "sliding_attention"))
        if heads % args.num_kv_heads:
            raise InputError(where, f"{heads} attention heads do not split into {args.num_kv_heads} key/value heads",
                             key="num_key_value_heads")
        if args.head_dim % 2:  # RoPE rotates pairs of dims
            raise InputError(where, f"RoPE needs an even head_dim, found {args.head_dim}", key="head_dim")
        args.read_family(config, read)
        if len(args.sparse_layers) < layers and args.intermediate_size <= 0:
            raise InputError(where, "dense MLP layers need a positive intermediate_size", key="intermediate_size")
        return args

    def read_family(self, config: dict, read) -> None:
        """The family's own fields (`read`: from_config's validated reader). Other families subclass ModelArgs
        and override this (lora_eval/models/mixtral.py, olmoe.py, qwen2_moe.py)."""
        if self.model_type == "qwen3_moe":
            self.read_experts(config, read)
            self.read_sparse_layers(config, read)

    def read_experts(self, config: dict, read, intermediate_key: str = "moe_intermediate_size") -> None:
        """Router and expert sizes: num_experts (or num_local_experts), num_experts_per_tok, norm_topk_prob."""
        self.num_experts = read("num_experts", int, "num_local_experts", minimum=1)
        self.top_k = read("num_experts_per_tok", int, minimum=1)
        self.moe_intermediate_size = read(intermediate_key, int, minimum=1)
        self.norm_topk_prob = read("norm_topk_prob", bool, default=False)
        if self.top_k > self.num_experts:
            raise InputError(self.where, f"{self.top_k} is more than num_experts ({self.num_experts})",
                             key="num_experts_per_tok")

    def read_sparse_layers(self, config: dict, read) -> None:
        """Which layers are MoE: every `decoder_sparse_step`-th one, except those in `mlp_only_layers`."""
        step = read("decoder_sparse_step", int, default=1, minimum=1)
        dense = read_layer_list(config, "mlp_only_layers", self.num_layers, self.where)
        self.sparse_layers = tuple(i for i in range(self.num_layers) if i not in dense and (i + 1) % step == 0)


class Attention(nn.Module):
    input_groups = (("q_proj", "k_proj", "v_proj"),)  # projections of one input (adapters/stack.py SharedShrink)

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        H, D, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, D
        self.q_proj = Linear(f"{prefix}.q_proj", H, args.num_heads * D, bias)
        self.k_proj = Linear(f"{prefix}.k_proj", H, args.num_kv_heads * D, bias)
        self.v_proj = Linear(f"{prefix}.v_proj", H, args.num_kv_heads * D, bias)
        self.o_proj = Linear(f"{prefix}.o_proj", args.num_heads * D, H, bias)
        self.q_norm = RMSNorm(f"{prefix}.q_norm", D, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(f"{prefix}.k_norm", D, args.rms_norm_eps) if args.qk_norm else None
        self.sinks, self.window = None, None  # GPT-OSS's (models/gpt_oss.py): a logit per head, a sliding window

    def project(self, x, cos, sin, fwd):
        """q [B, nh, L, D] and k [B, nkv, L, D] after their norms (Qwen3's per head) and RoPE, v [T, nkv, D]
        (families with other q/k norms override this)."""
        T = x.shape[0]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.q_norm is not None:  # norm and RoPE in one pass (kernels/head_norm_rope.py)
            q, k, v = fwd.linears(projections, x, head_norms=(self.q_norm, self.k_norm, None), rope=(cos, sin))
        else:
            q, k, v = fwd.linears(projections, x)  # [T, nh*D], [T, nkv*D], [T, nkv*D]
            q, k = self.rope(q, k, cos, sin, fwd)
        return q, k, v.view(T, self.num_kv_heads, self.head_dim)

    def rope(self, q, k, cos, sin, fwd):
        """q [T, nh*D], k [T, nkv*D] -> with RoPE, [B, nh, L, D] and [B, nkv, L, D]."""
        B, L, _ = cos.shape
        return (fwd.rope(q.reshape(B, L, self.num_heads, self.head_dim), cos, sin),
                fwd.rope(k.reshape(B, L, self.num_kv_heads, self.head_dim), cos, sin))

    def forward(self, x, cos, sin, fwd, residual=None):
        """Attention's output projection, added to `residual` [T, H] when given (the layer's residual stream)."""
        B, L, _ = cos.shape
        T = x.shape[0]
        q, k, v = self.project(x, cos, sin, fwd)
        v = v.view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, L, D]
        out = fwd.attention(q, k, v, self.head_dim**-0.5, sinks=self.sinks, window=self.window)  # [B, nh, L, D]
        out = out.transpose(1, 2).reshape(T, self.num_heads * self.head_dim)  # [T, nh*D], a view (attention_layout)
        return self.o_proj(out, fwd, residual=residual)  # [T, H]


class MLP(nn.Module):
    input_groups = (("gate_proj", "up_proj"),)

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        H, I, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = Linear(f"{prefix}.gate_proj", H, I, bias)
        self.up_proj = Linear(f"{prefix}.up_proj", H, I, bias)
        self.down_proj = Linear(f"{prefix}.down_proj", I, H, bias)

    def forward(self, x, fwd, residual=None):
        """The MLP's output, added to `residual` [T, H] when given (the layer's residual stream)."""
        gate, up = fwd.linears((self.gate_proj, self.up_proj), x)  # [T, I], [T, I]
        # silu through Forward.pointwise: over [T, I] torch gives the last (T * I mod 32) values, and with threads the
        # end of each thread's range, other bits (deepseek_v3's and glm4_moe's shared experts, I = 8: up to the
        # batch's last 3 tokens)
        return self.down_proj(fwd.pointwise(F.silu, gate) * up, fwd, residual=residual)  # [T, H]


class SparseMoe(nn.Module):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        self.top_k, self.norm_topk_prob = args.top_k, args.norm_topk_prob
        self.gate = Linear(f"{prefix}.gate", args.hidden_size, args.num_experts)  # the router
        self.experts = FusedExperts(f"{prefix}.experts", args.num_experts, args.hidden_size, args.moe_intermediate_size)

    def forward(self, x, fwd, residual=None):
        """The routed experts' output, added to `residual` [T, H] when given (the layer's residual stream)."""
        weights, ids = fwd.route(self.gate, x, self.top_k, self.norm_topk_prob)  # [T, k] float32, [T, k]
        return fwd.moe(self.experts, x, ids, weights.to(x.dtype), residual=residual)  # [T, H]


class DecoderLayer(nn.Module):
    """Normed attention, then a normed MLP (an MoE on `sparse_layers`), each added to the residual stream. Other
    families pass their own `attention` and `sparse_mlp` classes (built as `cls(args, prefix)`) and, where the
    checkpoint keeps the layers elsewhere, `layers_path`."""

    def __init__(self, args: ModelArgs, index: int, attention=Attention, sparse_mlp=SparseMoe,
                 layers_path: str = "model.layers"):
        super().__init__()
        prefix = f"{layers_path}.{index}"
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm", args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention(args, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm", args.hidden_size,
                                                args.rms_norm_eps)
        mlp = sparse_mlp if index in args.sparse_layers else MLP
        self.mlp = mlp(args, f"{prefix}.mlp")

    def forward(self, h, cos, sin, fwd):
        h = self.self_attn(self.input_layernorm(h, fwd), cos, sin, fwd, residual=h)  # [T, H]: h + attention
        return self.mlp(self.post_attention_layernorm(h, fwd), fwd, residual=h)  # [T, H]: h + MoE / MLP


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, decoder_layer=DecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding("model.embed_tokens", args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm("model.norm", args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """input_ids [B, L] (rows right-padded; `fwd` knows their lengths) -> final hidden states [B*L, H]
    (padding rows are garbage); `logits` applies lm_head to some of them. Other families subclass it with their
    own `decoder_layer` and `rope_inv_freq` (and `args.rope_scale`, the rope's attention factor, where not 1)."""

    decoder_layer = DecoderLayer
    rope_inv_freq = staticmethod(rope_inv_freq)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args, self.decoder_layer)
        self.lm_head = Linear("lm_head", args.hidden_size, args.vocab_size)
        self.register_buffer("inv_freq", self.rope_inv_freq(args.head_dim, args.rope, args.where),
                             persistent=False)  # [D/2]

    def forward(self, input_ids: torch.Tensor, fwd) -> torch.Tensor:
        B, L = input_ids.shape
        positions = fwd.positions(B, L, input_ids.device)  # [B, L]: after a row's cached prefix, if any
        h = self.model.embed_tokens(input_ids.reshape(-1), fwd)  # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, positions, h.dtype, getattr(self.args, "rope_scale", 1.0))  # [B, L, D]
        for i, layer in enumerate(self.model.layers):
            h = fwd.observe(i, "residual", layer(fwd.observe(i, "input", h), cos, sin, fwd))  # [T, H]
        return self.model.norm(h, fwd)  # [T, H]

    def logits(self, h: torch.Tensor, fwd) -> torch.Tensor:
        return self.lm_head(h, fwd)  # [N, V]


def load_weights(model: CausalLM, files, dtype: torch.dtype, device: torch.device,
                 expert_keys: dict = CHECKPOINT_EXPERT_KEYS, renames: tuple = (), *, float32_keys: tuple = (),
                 read_own=None, embedding: str = "model.embed_tokens.weight") -> dict[str, torch.Tensor]:
    """Every parameter of `model` read from checkpoint `files` in `dtype` (those whose names end in one of
    `float32_keys`: in float32), one tensor in memory at a time. On the meta device only the keys and shapes are
    checked and nothing is read.

    A parameter is read under its own name (fused experts included, as transformers 5 writes them with
    save_original_format=False) or else under its on-disk name: `renames` (ours, on disk) applied to it, and
    fused experts stacked from the per-expert projections `expert_keys` names. `read_own(name, shape)`: a family's
    own reading of the parameters it stores otherwise (None for the others). A tied lm_head the checkpoint lacks is
    the `embedding` weight."""
    weights = {}
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and name not in files and model.args.tie_word_embeddings:
            continue  # tied below
        shape = tuple(param.shape)
        own = None if read_own is None else read_own(name, shape)
        if own is not None:
            weights[name] = own
            continue
        key = name
        if name not in files:
            for ours, on_disk in renames:
                key = key.replace(ours, on_disk)
        kind = name.rsplit(".", 1)[-1]
        in_dtype = torch.float32 if name.endswith(float32_keys) else dtype
        if kind in expert_keys and key not in files:
            weights[name] = _read_experts(files, key, shape, expert_keys[kind], in_dtype, device)
        else:
            weights[name] = load_tensor(files, key, shape, in_dtype, device)
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights[embedding]
    return weights


def _read_experts(files, name, shape, projections, dtype, device) -> torch.Tensor:
    """Stack on-disk per-expert 2D weights `{prefix}.{e}.{proj}.weight` into one fused [E, rows, cols] tensor."""
    prefix = name.rsplit(".", 1)[0]
    E, rows, cols = shape
    part = rows // len(projections)
    fused = torch.empty(E, rows, cols, dtype=dtype, device=device)  # [E, rows, cols]
    for e in range(E):
        for j, proj in enumerate(projections):
            key = f"{prefix}.{e}.{proj}.weight"
            if device.type == "meta":
                check_weight(files, key, (part, cols))
            else:
                fused[e, j * part:(j + 1) * part] = read_weight(files, key, (part, cols))
    return fused
