"""Building blocks shared by the model families: adapter-aware Linear, RMSNorm and Embedding, and RoPE.

Each block knows its *site*: the Hugging Face / PEFT module path (`model.layers.3.self_attn.q_proj`), which
is how adapters address it. A block holds weights only: the Forward it is called with (lora_eval/forward.py)
computes the op on its backend and adds each row's adapter delta.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from ..errors import UnsupportedError


class Linear(nn.Module):
    """y = x W^T (+ b), plus per-row LoRA."""

    def __init__(self, site: str, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.site = site
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None  # [out]

    def forward(self, x: torch.Tensor, fwd) -> torch.Tensor:
        return fwd.linear(self, x)  # [T, out]


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 like transformers; adapters may carry their own w."""

    def __init__(self, site: str, dim: int, eps: float):
        super().__init__()
        self.site, self.eps = site, eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)  # [dim]

    def forward(self, x: torch.Tensor, fwd) -> torch.Tensor:
        return fwd.norm(self, x)


class FusedExperts(nn.Module):
    """All experts of one MoE layer: gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]."""

    def __init__(self, site: str, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.site = site
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        E, H, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)  # [E, H, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class Embedding(nn.Module):
    """Token embedding lookup, plus embedding LoRA per row."""

    def __init__(self, site: str, vocab_size: int, dim: int):
        super().__init__()
        self.site = site
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)  # [V, H]

    def forward(self, ids: torch.Tensor, fwd) -> torch.Tensor:
        return fwd.embedding(self, ids)  # [T, H]


def rope_inv_freq(head_dim: int, config: dict, where: str = "config.json") -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] for the rope types we compute (default, linear, llama3)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [D/2]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(where, f"rope type '{rope_type}' is not supported (default, linear, llama3 are)", key=key)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., D] for integer positions [...] (float32 math, then cast like transformers)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, heads, D] rotated by cos/sin [B, L, D] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]
