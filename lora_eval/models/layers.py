"""Building blocks shared by the model families: the fields of every family's ModelArgs, adapter-aware Linear (and
groups of them over one input sharing one weight buffer), RMSNorm and Embedding, RoPE, and the sigmoid router.

Each block knows its *site*: the Hugging Face / PEFT module path (`model.layers.3.self_attn.q_proj`), which
is how adapters address it. A block holds weights only: the Forward it is called with (engine/forward.py)
computes the op on its backend and adds each row's adapter delta.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch import nn

from ..errors import InputError, UnsupportedError


@dataclass
class DecoderArgs:
    """The fields every family's ModelArgs holds (each subclasses it and adds its own): the sizes config.json names
    for every family, and what from_config and the loader record beside them."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    _: KW_ONLY  # (so that a family's fields without a default may follow these)
    tie_word_embeddings: bool = False
    rope: dict = field(default_factory=dict)  # the family's rope settings (see its rope_inv_freq)
    max_position_embeddings: int | None = None  # None where config.json names none
    where: str = "config.json"  # the config file, for error messages
    quantization: str | None = None  # set on load: the numerics a quantized checkpoint's run emulates, or None


class Linear(nn.Module):
    """y = x W^T (+ b), plus per-row LoRA."""

    def __init__(self, site: str, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.site = site
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None  # [out]
        self.group: ProjectionGroup | None = None  # set by group_projections

    def forward(self, x: torch.Tensor, fwd, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual` [T, out]: return residual + the projection (Forward.linear fuses the LoRA expand into it)."""
        return fwd.linear(self, x, residual=residual)  # [T, out]


# Upper bounds of a config's integer sizes: far above any released model (Llama-3.1-405B: 126 layers, hidden 16384,
# intermediate 53248, 128 heads; DeepSeek-V3: 256 experts; Gemma: 262144 tokens), and low enough that no product of
# them we build from (an expert tensor E x 2I x H, the meta model of `plan`, rope tables) overflows int64 or takes
# more than a second: a config beyond them is a typo or an attack, refused by name instead of exit 3 or the OOM killer.
SIZE_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "first_k_dense_replace", "decoder_sparse_step", "num_nextn_predict_layers",
                     "num_mtp_layers"), 10_000),
    **dict.fromkeys(("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
                    2**20),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
                     "n_shared_experts", "n_group", "topk_group"), 2**16),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim"), 2**20),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_conv_kernel_dim"), 2**12),
    "full_attention_interval": 10_000,
    "vocab_size": 2**24,
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads"), 2**12),
    # positions: int32 in the kernels' position tensors; a rope table is computed for the positions a batch holds
    **dict.fromkeys(("max_position_embeddings", "sliding_window", "original_max_position_embeddings"), 2**31 - 1),
}
# Epsilons (rms_norm_eps) are added to mean(x^2) before its square root: one >= 1 swamps the hidden states' own scale
# (O(1) and below after a norm) and makes every norm's output a shrunken copy of its input, every output distribution
# near uniform (an exit 1 blamed on the adapters); released models use 1e-6 .. 1e-5.
EPSILON_BELOW = 1.0


def config_reader(config: dict, where: str):
    """`read(key, kind, *alts, default=None, minimum=None, positive=False, below=None)`: config[key] (or the first
    alternative name present) as `kind` (int, float or bool), `default` where none is present, or an InputError
    naming the key and what was expected: a finite number (a JSON integer for int, at most SIZE_LIMITS[key] where it
    names one), >= `minimum`, > 0 where `positive`, < `below`; for bool a JSON true or false (a string "false" is
    truthy in Python: refused, never read as true). The one validating reader every family's ModelArgs uses."""
    def read(key, kind, *alts, default=None, minimum=None, positive=False, below=None):
        for k in (key, *alts):
            if config.get(k) is not None:
                key, value = k, config[k]
                break
        else:
            if default is None:
                raise InputError(where, f"missing required field for model_type '{config.get('model_type')}'",
                                 key=key)
            return default
        if kind is bool:
            if not isinstance(value, bool):
                raise InputError(where, f"expected true or false, a JSON boolean, found {value!r}", key=key)
            return value
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = number and (kind is not int or isinstance(value, int))  # (64.0: transformers' modules take no float)
        maximum = SIZE_LIMITS.get(key) if kind is int else None
        if not ok or (minimum is not None and value < minimum) or (positive and value <= 0) \
                or (maximum is not None and value > maximum) or (below is not None and value >= below):
            bounds = [" > 0" if positive else f" >= {minimum}" if minimum is not None else "",
                      f" <= {maximum:_}" if maximum is not None else "", f" < {below}" if below is not None else ""]
            raise InputError(where, f"expected {'an integer' if kind is int else 'a finite number'}"
                             f"{' and'.join(b for b in bounds if b)}, found {value!r}", key=key)
        return kind(value)

    return read


def read_max_positions(read, config: dict) -> int | None:
    """max_position_embeddings (None where absent): an integer >= 2 (one position attends to another), for every
    command (MMLU fits its prompts to it; compare and dump-reference refuse samples longer than it)."""
    if config.get("max_position_embeddings") is None:
        return None
    return read("max_position_embeddings", int, minimum=2)


def read_layer_list(config: dict, key: str, num_layers: int, where: str) -> list[int]:
    """config[key] (absent: []) as a list of layer indices, each in 0 .. num_layers - 1 (an index beyond the model
    would be ignored by transformers' `i in mlp_only_layers`: a setting silently without effect)."""
    value = config.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError(where, f"expected a list of layer indices, found {value!r}", key=key)
    outside = [i for i in value if not 0 <= i < num_layers]
    if outside:
        raise InputError(where, f"layer {outside[0]} is not one of the model's {num_layers} layers "
                         f"(0 .. {num_layers - 1})", key=key)
    return value


def read_layer_types(config: dict, num_layers: int, where: str, allowed: tuple[str, ...]) -> list[str] | None:
    """config["layer_types"] (None where absent): one of `allowed` per layer, num_hidden_layers of them."""
    value = config.get("layer_types")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != num_layers or not all(t in allowed for t in value):
        raise InputError(where, f"expected a list of {num_layers} entries (num_hidden_layers) from "
                         f"{', '.join(allowed)}, found {value!r}", key="layer_types")
    return value


def rope_number(params: dict, name: str, where: str, key: str, default=None, minimum: float | None = None) -> float:
    """params[name] (a rope parameter; `default` where absent) as a finite float, > 0 (or >= `minimum`), or an
    InputError naming the rope's key in config.json and the parameter."""
    value = default if params.get(name) is None else params[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (value <= 0 if minimum is None else value < minimum):
        bound = "> 0" if minimum is None else f">= {minimum}"
        raise InputError(where, f"'{name}' must be a finite number {bound}, found {value!r}", key=key)
    return float(value)


ROPE_KEYS = ("rope_parameters", "rope_scaling")  # transformers 5 reads `rope_scaling or rope_parameters`


def rope_parameters(config: dict, where: str, default: dict | None = None,
                    default_theta: float = 10000.0) -> tuple[str, dict]:
    """(the key in config.json, the rope parameters) as transformers 5 reads them (`convert_rope_params_to_dict`:
    rope_scaling if given, else rope_parameters, else `default`; rope_type from the legacy `type`; rope_theta from
    the dict, else the top-level rope_theta, else `default_theta`). Every rope field is checked, the one transformers
    reads or not: each of rope_parameters and rope_scaling an object (or null), a top-level rope_theta a finite
    number > 0, and where both objects are given they must agree (else which one a trainer used is unknowable)."""
    theta = config.get("rope_theta")
    if theta is not None:
        theta = rope_number(config, "rope_theta", where, "rope_theta")
    given = {}
    for key in ROPE_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise InputError(where, f"expected an object of rope parameters (or null), found {value!r}", key=key)
        if value:
            given[key] = _standard_rope(value, theta, default_theta, where, key)
    if len(given) == 2 and given["rope_parameters"] != given["rope_scaling"]:
        raise InputError(where, f"rope_parameters {config['rope_parameters']!r} and rope_scaling "
                         f"{config['rope_scaling']!r} disagree (transformers reads rope_scaling); give one",
                         key="rope_scaling")
    if given:
        key = "rope_scaling" if "rope_scaling" in given else "rope_parameters"
        return key, given[key]
    return "rope_parameters", _standard_rope(default or {}, theta, default_theta, where, "rope_parameters")


def _standard_rope(params: dict, theta, default_theta: float, where: str, key: str) -> dict:
    """`params` with rope_type (from `type`, default "default") and rope_theta (`theta`, else `default_theta`) set,
    the legacy `type` dropped (two spellings of one rope compare equal); rope_theta checked."""
    out = {k: v for k, v in params.items() if k != "type"}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise InputError(where, f"expected a rope type name, found {rope_type!r}", key=f"{key}.rope_type")
    out["rope_type"] = rope_type
    out.setdefault("rope_theta", default_theta if theta is None else theta)
    rope_number(out, "rope_theta", where, key)
    return out


@dataclass(frozen=True, eq=False)
class ProjectionGroup:
    """Projections of one input (a module's `input_groups`, e.g. q / k / v) whose weights and biases are row slices
    of one buffer, so that the Triton path computes them in one GEMM (Forward.linears), faster than one each at
    small batches (BENCHMARKS-history 3, "q / k / v computed in one GEMM"; 18.3)."""
    sites: tuple[str, ...]  # the members, in buffer order
    outs: tuple[int, ...]  # their output features
    weight: torch.Tensor  # [sum(outs), in]
    bias: torch.Tensor | None  # [sum(outs)]

    def serves(self, modules) -> bool:
        """Whether `modules` are the members in order and their weights still the buffer's rows (not replaced or
        moved since)."""
        if tuple(m.site for m in modules) != self.sites:
            return False
        row_bytes = self.weight.stride(0) * self.weight.element_size()
        start = self.weight.data_ptr()
        for m, n in zip(modules, self.outs):
            if m.weight.data_ptr() != start:
                return False
            start += n * row_bytes
        return True


def group_projections(modules: list[Linear]) -> None:
    """Move the weights (and biases) of projections of one input into one buffer, each module's weight becoming a
    view of its rows, and record the group on each member. Modules that differ in input size, dtype, device or in
    having a bias stay apart."""
    first = modules[0]
    if len(modules) < 2 or any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                               or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None)
                               for m in modules):
        return
    weight = _stack_rows([m.weight for m in modules])  # [sum out, in]
    bias = _stack_rows([m.bias for m in modules]) if first.bias is not None else None  # [sum out]
    group = ProjectionGroup(tuple(m.site for m in modules), tuple(m.out_features for m in modules), weight, bias)
    start = 0
    for m in modules:
        rows = slice(start, start + m.out_features)
        m.weight = nn.Parameter(weight[rows], requires_grad=False)  # [out, in], a view
        if bias is not None:
            m.bias = nn.Parameter(bias[rows], requires_grad=False)
        m.group = group
        start = rows.stop


def _stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0; on the meta device an empty tensor of that shape, as torch.cat of meta tensors imports
    torch._dynamo (about 2 s of a process's first load: a shape-only model is built before every load)."""
    if tensors[0].is_meta:
        return torch.empty(sum(t.shape[0] for t in tensors), *tensors[0].shape[1:], dtype=tensors[0].dtype,
                           device="meta")
    return torch.cat([t.detach() for t in tensors])


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 like transformers; adapters may carry their own w. `unit_offset`: the
    zero-centred form of Qwen3-Next / Qwen3.5, x / rms(x) * (1 + w) all in float32, rounded once at the end."""

    def __init__(self, site: str, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.site, self.eps, self.unit_offset = site, eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)  # [dim]

    def forward(self, x: torch.Tensor, fwd) -> torch.Tensor:
        return fwd.norm(self, x)


class FusedExperts(nn.Module):
    """All experts of one MoE layer: gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I].

    Optional (GPT-OSS): biases gate_up [E, 2I] (gate, then up) and down [E, H]; `activation` "silu"
    (silu(gate) * up) or "clamped_swiglu" ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit)); `interleaved_gate_up`: the Hugging Face parameter these came from alternates gate and
    up columns, which is the order of a PEFT target_parameters LoRA on it.
    """

    def __init__(self, site: str, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 interleaved_gate_up: bool = False):
        super().__init__()
        self.site = site
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        E, H, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)  # [E, H, I]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False) if bias else None  # [E, 2I]
        self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False) if bias else None  # [E, H]
        if activation not in ("silu", "clamped_swiglu"):
            raise ValueError(f"unknown expert activation {activation!r}")
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        self.interleaved_gate_up = interleaved_gate_up

    def variant(self) -> dict:
        """The fused MoE kernel's (and its reference's) keyword arguments for these experts' biases and activation."""
        return dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias, activation=self.activation,
                    alpha=self.swiglu_alpha, limit=self.swiglu_limit)


def deinterleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Alternating gate/up entries along `dim` (gate0, up0, gate1, up1, ...) -> all gate entries, then all up."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)  # [2I]
    return t.index_select(dim, order)


def interleave_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of deinterleave_gate_up: gate entries, then up entries along `dim` -> alternating."""
    n = t.shape[dim]
    order = torch.arange(n).view(2, n // 2).T.reshape(-1).to(t.device)  # [2I]: 0, I, 1, I+1, ...
    return t.index_select(dim, order)


class Embedding(nn.Module):
    """Token embedding lookup, plus embedding LoRA per row."""

    def __init__(self, site: str, vocab_size: int, dim: int):
        super().__init__()
        self.site = site
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)  # [V, H]

    def forward(self, ids: torch.Tensor, fwd) -> torch.Tensor:
        return fwd.embedding(self, ids)  # [T, H]


def rope_inv_freq(head_dim: int, config: dict, where: str = "config.json") -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] for the rope types we compute (default, linear, llama3); on the CPU
    even inside a meta-device context (a meta arange imports sympy: about 2 s of a process's first load)."""
    key, params = rope_parameters(config, where)
    theta = rope_number(params, "rope_theta", where, key)
    rope_type = params["rope_type"]
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()  # [D/2]
    inv_freq = 1.0 / theta ** (steps / head_dim)  # [D/2]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_number(params, "factor", where, key)
    if rope_type == "llama3":
        factor, low, high = (rope_number(params, name, where, key)
                             for name in ("factor", "low_freq_factor", "high_freq_factor"))
        if high <= low:
            raise InputError(where, f"high_freq_factor ({high}) must exceed low_freq_factor ({low})", key=key)
        old_len = rope_number(params, "original_max_position_embeddings", where, key)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(where, f"rope type '{rope_type}' is not supported (default, linear, llama3 are)", key=key)


def yarn_rope(head_dim: int, params: dict, where: str = "config.json",
              key: str = "rope_parameters") -> tuple[torch.Tensor, float]:
    """YaRN rope as transformers computes it (`_compute_yarn_parameters`): inverse frequencies [head_dim/2] that
    blend interpolated (/ factor) and original frequencies over a linear ramp between the beta_fast / beta_slow
    correction dims, and the attention factor that multiplies cos and sin. `params`: the config's rope parameters
    with rope_theta, and max_position_embeddings (used when there is no factor)."""
    def number(name, default=None, minimum=None):
        return rope_number(params, name, where, key, default, minimum)

    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedError(where, "partial_rotary_factor with a yarn rope is not supported", key=key)
    theta = number("rope_theta")
    if theta <= 1:  # its logarithm divides the correction dims
        raise InputError(where, f"yarn rope needs rope_theta > 1, found {theta!r}", key=key)
    original = number("original_max_position_embeddings")
    factor = params.get("factor")
    factor = number("factor") if factor is not None else number("max_position_embeddings") / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = (number(name, 0, minimum=0) for name in ("mscale", "mscale_all_dim"))
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    attention_factor = number("attention_factor", attention_factor)
    beta_fast, beta_slow = number("beta_fast", 32), number("beta_slow", 1)
    dim = head_dim

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    truncate = True if params.get("truncate") is None else params["truncate"]
    if not isinstance(truncate, bool):  # a string "false" would be truthy
        raise InputError(where, f"expected true or false, a JSON boolean, found {truncate!r}", key=f"{key}.truncate")
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)  # [D/2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)  # [D/2]
    extrapolation = 1 - ramp  # share of the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation  # [D/2]
    return inv_freq, float(attention_factor)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos, sin [..., D] for integer positions [...] (float32 math, then cast like transformers); `scale` is the
    rope's attention factor (YaRN), multiplied into both."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def group_topk_sigmoid_routing(scores: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                               topk_group: int, norm_topk_prob: bool,
                               routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scoring with a selection-only correction bias and group-limited top-k (DeepSeek-V3's "noaux_tc"
    router, also GLM-4.5's), transformers' `Glm4MoeTopkRouter` / `DeepseekV3TopkRouter` op for op:

      choice = scores + correction_bias
      experts split into n_group equal groups, each group scored by the sum of its 2 best `choice` values;
      only the topk_group best groups stay eligible; top_k experts by `choice` among them;
      weights = their *uncorrected* scores, divided by their sum (+ 1e-20) if norm_topk_prob, times
      routed_scaling_factor.

    scores [T, E] float32: sigmoid of the router's logits (computed in float32 as transformers does; by the caller,
    through Forward.pointwise, so that on the CPU a row's scores do not depend on where it sits in the batch),
    correction_bias [E] float32 -> weights [T, k] float32, expert ids [T, k] (in no particular order, as
    transformers' sorted=False). Plain torch with no host sync, so it serves both backends and CUDA graphs."""
    T, E = scores.shape
    choice = scores + correction_bias  # [T, E]
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
    eligible = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)  # [T, E]
    choice = choice.masked_fill(~eligible.bool(), float("-inf"))  # [T, E]
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def route_sigmoid_group_limited(gate: Linear, x: torch.Tensor, fwd, top_k: int, n_group: int, topk_group: int,
                                norm_topk_prob: bool,
                                routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of DeepSeek-V3 and GLM-4.5 on x [T, H]: logits in float32 (`gate`'s weight and its
    `e_score_correction_bias` held in float32; a router LoRA adds its delta in the compute dtype), sigmoid scores,
    group_topk_sigmoid_routing; the routing observed -> weights [T, k] float32, expert ids [T, k]."""
    logits = fwd.linear_float32(gate, x)  # [T, E] float32
    scores = fwd.pointwise(torch.sigmoid, logits)  # [T, E] float32
    weights, ids = group_topk_sigmoid_routing(scores, gate.e_score_correction_bias, top_k, n_group, topk_group,
                                              norm_topk_prob, routed_scaling_factor)  # [T, k] float32, [T, k]
    fwd.observe_routing(gate.site, logits, ids, weights)
    return weights, ids


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor`: 0.1 * mscale * ln(factor) + 1 (1 where factor <= 1); as
    transformers' `yarn_get_mscale` / `get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

