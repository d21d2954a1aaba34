"""Builders for tests: tiny random checkpoints, LoRA adapters and reference log-probabilities.

Everything is built from seeded random weights, so tests need no model hub. The references
("oracles") are plain transformers / PEFT models run in float32:

* ``save_random_model`` writes a tiny checkpoint of a family in ``FAMILIES`` (Qwen3-MoE, Qwen3, Llama, Mixtral,
  OLMoE, Qwen2-MoE, GPT-OSS).
* ``save_random_peft_adapter`` writes an adapter through PEFT itself; ``peft_oracle`` loads it back.
* ``write_expert_adapter`` hand-writes MoE expert adapters in the layouts found in the wild and
  returns a ``MergedOracle``: the base model with the same deltas merged into its weights.
* ``hf_logprobs`` turns any of these models into per-token log-probabilities.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.utils import ModulesToSaveWrapper
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

# Relative size of adapter deltas: each delta has about this fraction of the norm of the weight it
# adapts, which moves log-probabilities by roughly 0.1-1 nats on the tiny models.
ADAPTER_STRENGTH = 0.2
# Relative multiplicative noise on modules_to_save copies (norm weights become about 1 + 0.2 * N(0, 1)).
MODULES_TO_SAVE_NOISE = 0.2
# Gain on the router and lm_head init, so that routing and next-token distributions are peaked.
ROUTER_GAIN = 2.0
LM_HEAD_GAIN = 2.0

LAYOUTS = ("per_expert_2d", "fused_3d", "split_3d", "peft_target_parameters")
PEFT_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _common_config(**overrides) -> dict:
    config = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    config.update(overrides)
    return config


def tiny_qwen3_moe_config(**overrides) -> dict:
    """Qwen3MoeConfig kwargs: 6 experts, top-2, layer 1 dense (mlp_only_layers=[1])."""
    moe = dict(
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )
    return _common_config(**{**moe, **overrides})


def tiny_qwen3_config(**overrides) -> dict:
    """Qwen3Config kwargs (dense, with q/k norm)."""
    return _common_config(**overrides)


def tiny_llama_config(**overrides) -> dict:
    """LlamaConfig kwargs."""
    return _common_config(**overrides)


def tiny_mixtral_config(**overrides) -> dict:
    """MixtralConfig kwargs: 6 experts, top-2 in every layer; intermediate_size is the expert size (2I != H)."""
    return _common_config(**{**dict(intermediate_size=12, num_local_experts=6, num_experts_per_tok=2), **overrides})


def tiny_olmoe_config(**overrides) -> dict:
    """OlmoeConfig kwargs: 6 experts, top-2 in every layer, norm_topk_prob false as released; head_dim is H / heads."""
    config = _common_config(**{**dict(intermediate_size=12, num_experts=6, num_experts_per_tok=2,
                                      norm_topk_prob=False, eos_token_id=0), **overrides})
    config.pop("head_dim")
    return config


def tiny_qwen2_moe_config(**overrides) -> dict:
    """Qwen2MoeConfig kwargs: 6 experts, top-2, a shared expert of 20, qkv biases, layer 1 dense (mlp_only_layers)."""
    moe = dict(moe_intermediate_size=8, shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
               norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[1])
    config = _common_config(**{**moe, **overrides})
    config.pop("head_dim")
    return config


# A yarn rope with a short original context (max_position_embeddings = factor * original, as transformers expects)
GPT_OSS_YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=16, rope_theta=10000.0)


def tiny_gpt_oss_config(**overrides) -> dict:
    """GptOssConfig kwargs: 6 experts, top-2 in every layer (expert size 8, so 2I != H), a sliding window of 5 on
    layers 0 and 2, yarn rope, and swiglu_limit 1 so that both clamps of the activation bite."""
    gpt_oss = dict(intermediate_size=8, num_local_experts=6, num_experts_per_tok=2, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=1.0,
                   rope_parameters=GPT_OSS_YARN, max_position_embeddings=64)
    return _common_config(**{**gpt_oss, **overrides})


# DeepSeek-V3's yarn (with mscale and mscale_all_dim) on a short original context; mscale_all_dim != mscale, so both
# the softmax scale (mscale_all_dim) and the rope's attention factor (mscale / mscale_all_dim) differ from 1
DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5,
                     original_max_position_embeddings=16, rope_theta=10000.0)


def tiny_deepseek_v3_config(**overrides) -> dict:
    """DeepseekV3Config kwargs: MLA with q_lora_rank 16, kv_lora_rank 12, q/k heads of 8 nope + 8 rope dims, v heads of
    6; layer 0 dense (first_k_dense_replace 1); layers 1-2 MoE: 8 routed experts in 4 groups, top-2 from the best 2
    groups, one shared expert, routed_scaling_factor 2.5; yarn rope with mscale. Router correction biases are
    transformers' zeros until ``set_random_correction_bias``."""
    deepseek = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=6, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                    topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, rope_parameters=DEEPSEEK_YARN, max_position_embeddings=64)
    config = _common_config(**{**deepseek, **overrides})
    config.pop("head_dim")  # transformers derives it (qk_rope_head_dim)
    return config


FAMILIES = {
    "qwen3_moe": (tiny_qwen3_moe_config, Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen3": (tiny_qwen3_config, Qwen3Config, Qwen3ForCausalLM),
    "llama": (tiny_llama_config, LlamaConfig, LlamaForCausalLM),
    "mixtral": (tiny_mixtral_config, MixtralConfig, MixtralForCausalLM),
    "olmoe": (tiny_olmoe_config, OlmoeConfig, OlmoeForCausalLM),
    "qwen2_moe": (tiny_qwen2_moe_config, Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "gpt_oss": (tiny_gpt_oss_config, GptOssConfig, GptOssForCausalLM),
    "deepseek_v3": (tiny_deepseek_v3_config, DeepseekV3Config, DeepseekV3ForCausalLM),
}


def _randn(shape, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _random_like(name: str, param: torch.Tensor, generator: torch.Generator, router_gain: float = ROUTER_GAIN,
                 lm_head_gain: float = LM_HEAD_GAIN) -> torch.Tensor:
    """A fresh value for one base-model parameter, scaled by its role."""
    noise = _randn(param.shape, generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if "embed_tokens" in name:
        return noise
    if name.endswith("self_attn.sinks"):  # GPT-OSS attention sinks: logits of the size of attention scores
        return noise
    if param.ndim == 1 or name.endswith("_bias"):  # biases (GPT-OSS expert biases are [E, out])
        return 0.1 * noise
    gain = 1.0
    if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # MoE router
        gain = router_gain
    elif "lm_head" in name:
        gain = lm_head_gain
    return noise * (gain / math.sqrt(param.shape[-1]))  # fan_in is the last dim, for 2D and 3D alike


def save_random_model(
    out_dir, family: str, *, seed: int, dtype=torch.float32, max_shard_size=None, fused_experts: bool = False,
    router_gain: float = ROUTER_GAIN, lm_head_gain: float = LM_HEAD_GAIN, **config_overrides,
) -> Path:
    """Write a tiny random checkpoint of ``family`` (a key of ``FAMILIES``) to ``out_dir``.

    By default experts are stored per expert under the family's published names, as transformers 5 writes them;
    ``fused_experts`` stores transformers 5's in-memory names instead (``save_original_format=False``).
    Lower gains give less peaked routing and next-token distributions (less sensitive to low precision)."""
    make_config, config_cls, model_cls = FAMILIES[family]
    model = model_cls(config_cls(**make_config(**config_overrides))).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_like(name, param, generator, router_gain, lm_head_gain))
        _centre_norms(model)
    model.to(dtype)
    out_dir = Path(out_dir)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, save_original_format=not fused_experts, **kwargs)
    return out_dir


def load_hf(model_dir):
    """The transformers model in ``model_dir``, in float32 and eval mode."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per-token log-probabilities, one unpadded sequence at a time: ``lp[i] = log p(seq[i+1] | seq[:i+1])``."""
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("the oracle model must be float32")
    model.eval()
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def random_sequences(n: int, vocab: int, *, seed: int, min_len: int = 5, max_len: int = 24) -> list[list[int]]:
    """``n`` random token sequences with lengths drawn from ``[min_len, max_len]``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
    return [torch.randint(0, vocab, (int(length),), generator=generator).tolist() for length in lengths]


# --- adapters written by PEFT -------------------------------------------------------------------


def _lora_factors(module: LoraLayer, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (A, B) parameters of one LoRA layer, for linear, parameter and embedding LoRA alike."""
    if adapter in module.lora_embedding_A:
        return module.lora_embedding_A[adapter], module.lora_embedding_B[adapter]
    return module.lora_A[adapter].weight, module.lora_B[adapter].weight


def _adapted_weight(module: LoraLayer) -> torch.Tensor:
    if isinstance(module, ParamWrapper):
        return module.get_param()
    return module.get_base_layer().weight


@torch.no_grad()
def _randomise_peft_model(model, adapter: str, generator: torch.Generator) -> None:
    """Overwrite every trainable adapter tensor; each LoRA delta gets ADAPTER_STRENGTH of its weight's norm."""
    touched = set()
    for module in model.modules():
        if isinstance(module, LoraLayer) and adapter in module.r:
            lora_a, lora_b = _lora_factors(module, adapter)
            lora_a.copy_(_randn(lora_a.shape, generator))
            lora_b.copy_(_randn(lora_b.shape, generator))
            target_norm = ADAPTER_STRENGTH * _adapted_weight(module).norm()
            lora_b.mul_(target_norm / module.get_delta_weight(adapter).norm())
            touched |= {id(lora_a), id(lora_b)}
        elif isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
            for param in module.modules_to_save[adapter].parameters():
                param.mul_(1.0 + MODULES_TO_SAVE_NOISE * _randn(param.shape, generator))
                touched.add(id(param))
    missed = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in touched]
    if missed:
        raise NotImplementedError(f"no random init for adapter parameters {missed}")


def save_random_peft_adapter(model_dir, out_dir, *, seed: int, **lora_config_kwargs) -> Path:
    """Save a PEFT LoRA adapter for the model in ``model_dir`` with every adapter tensor random."""
    model = get_peft_model(load_hf(model_dir), LoraConfig(**lora_config_kwargs))
    _randomise_peft_model(model, "default", torch.Generator().manual_seed(seed))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def peft_oracle(model_dir, adapter_dir):
    """A fresh base model from ``model_dir`` with the adapter in ``adapter_dir`` loaded by PEFT."""
    return PeftModel.from_pretrained(load_hf(model_dir), adapter_dir).eval()


# --- hand-written MoE expert adapters -----------------------------------------------------------


@dataclass
class MergedOracle:
    """The base transformers model with an adapter's deltas merged into its weights (float32)."""

    model: torch.nn.Module
    adapter_dir: Path


@dataclass
class _ExpertFactors:
    """LoRA factors of one MoE layer. A: [E or 1, r, in], B: [E or 1, out, r]; router A [r, H], B [E, r]."""

    gate_a: torch.Tensor
    gate_b: torch.Tensor
    up_a: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    router_a: torch.Tensor | None = None
    router_b: torch.Tensor | None = None


def _draw_factor_pair(n_a, n_b, out_dim, in_dim, rank, scaling, generator):
    """(A, B) whose product times ``scaling`` has about ADAPTER_STRENGTH of a base weight's scale."""
    a = _randn((n_a, rank, in_dim), generator) / math.sqrt(in_dim)
    b = _randn((n_b, out_dim, rank), generator) * (ADAPTER_STRENGTH / (scaling * math.sqrt(rank)))
    return a, b


def _draw_expert_factors(mlp, layout, rank, scaling, shared_outer, include_router, generator) -> _ExpertFactors:
    num_experts, two_i, hidden = mlp.experts.gate_up_proj.shape
    inter = two_i // 2
    n_outer = 1 if shared_outer else num_experts
    gate_a, gate_b = _draw_factor_pair(n_outer, num_experts, inter, hidden, rank, scaling, generator)
    up_a, up_b = _draw_factor_pair(n_outer, num_experts, inter, hidden, rank, scaling, generator)
    if layout in ("fused_3d", "peft_target_parameters"):
        up_a = gate_a  # gate and up are one fused projection with one A per expert
    down_a, down_b = _draw_factor_pair(num_experts, n_outer, hidden, inter, rank, scaling, generator)
    factors = _ExpertFactors(gate_a, gate_b, up_a, up_b, down_a, down_b)
    if include_router:
        router_a, router_b = _draw_factor_pair(1, 1, num_experts, hidden, rank, scaling, generator)
        factors.router_a, factors.router_b = router_a[0], router_b[0] * ROUTER_GAIN
    return factors


def _pack_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT ParamWrapper packing: A [E, r, in] -> [E*r, in] (expert-major), B [E, out, r] -> [out, r*E] (rank-major)."""
    num_experts, out_dim, rank = b.shape
    return a.reshape(num_experts * rank, -1), b.permute(1, 2, 0).reshape(out_dim, rank * num_experts)


def _layer_tensors(prefix: str, f: _ExpertFactors, layout: str, names: str) -> dict[str, torch.Tensor]:
    """Adapter tensors of one MoE layer in ``layout``, keyed relative to ``prefix`` (ending in "mlp." or
    "block_sparse_moe.")."""
    tensors = {}

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        tensors[f"{prefix}{module}.lora_A.weight"] = a
        tensors[f"{prefix}{module}.lora_B.weight"] = b

    if layout == "per_expert_2d":
        gate, up, down = ("w1", "w3", "w2") if names == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(f.gate_b.shape[0]):
            put(f"experts.{e}.{gate}", f.gate_a[e], f.gate_b[e])
            put(f"experts.{e}.{up}", f.up_a[e], f.up_b[e])
            put(f"experts.{e}.{down}", f.down_a[e], f.down_b[e])
    elif layout == "fused_3d":
        put("experts.gate_up_proj", f.gate_a, torch.cat([f.gate_b, f.up_b], dim=1))
        put("experts.down_proj", f.down_a, f.down_b)
    elif layout == "split_3d":
        put("experts.w1", f.gate_a, f.gate_b)
        put("experts.w3", f.up_a, f.up_b)
        put("experts.w2", f.down_a, f.down_b)
    else:  # peft_target_parameters: gate_up_proj is the inner ParamWrapper, down_proj the outer one
        put("experts.base_layer", *_pack_peft(f.gate_a, torch.cat([f.gate_b, f.up_b], dim=1)))
        put("experts", *_pack_peft(f.down_a, f.down_b))
    if f.router_a is not None:
        put("gate", f.router_a, f.router_b)
    return {key: value.contiguous() for key, value in tensors.items()}


@torch.no_grad()
def _merge(mlp, f: _ExpertFactors, scaling: float) -> None:
    """Add the layer's LoRA deltas to the fused transformers expert weights (and router)."""
    experts = mlp.experts
    inter = experts.down_proj.shape[-1]
    experts.gate_up_proj[:, :inter] += scaling * (f.gate_b @ f.gate_a)
    experts.gate_up_proj[:, inter:] += scaling * (f.up_b @ f.up_a)
    experts.down_proj += scaling * (f.down_b @ f.down_a)
    if f.router_a is not None:
        mlp.gate.weight += scaling * (f.router_b @ f.router_a)


def write_expert_adapter(
    model_dir,
    out_dir,
    *,
    layout: str,
    seed: int,
    rank: int = 4,
    alpha: float = 8,
    names: str = "qwen",
    shared_outer: bool = False,
    include_router: bool = False,
    layers=None,
    moe_module: str = "mlp",
) -> MergedOracle:
    """Hand-write a LoRA adapter on the MoE experts of ``model_dir`` in ``layout``; return its merged oracle.

    ``shared_outer`` shares the gate/up A and the down B across experts (stored with expert dim 1);
    ``layers`` restricts the adapter to those MoE layers (default: all of them); ``moe_module`` names the MoE
    block in the keys (Mixtral adapters trained with transformers 4 say "block_sparse_moe").
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if names not in ("qwen", "mixtral") or (names == "mixtral" and layout != "per_expert_2d"):
        raise ValueError(f"names={names!r} is not available for layout {layout!r}")
    if shared_outer and layout in ("per_expert_2d", "peft_target_parameters"):
        raise ValueError(f"shared_outer is not representable in layout {layout!r}")

    model = load_hf(model_dir)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    layers = moe_layers if layers is None else list(layers)
    if not set(layers) <= set(moe_layers):
        raise ValueError(f"layers {layers} are not all MoE layers {moe_layers}")

    scaling = alpha / rank
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        mlp = model.model.layers[i].mlp
        factors = _draw_expert_factors(mlp, layout, rank, scaling, shared_outer, include_router, generator)
        tensors.update(_layer_tensors(f"base_model.model.model.layers.{i}.{moe_module}.", factors, layout, names))
        _merge(mlp, factors, scaling)

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": "all-linear",
        "base_model_name_or_path": str(model_dir),
    }
    if layout == "peft_target_parameters":
        router = ["mlp.gate.weight"] if include_router else []
        config.update(target_modules=None, target_parameters=PEFT_EXPERT_PARAMETERS + router)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return MergedOracle(model=model, adapter_dir=out_dir)


# --- router correction biases and hand-written dense adapters --------------------------------------


CORRECTION_BIAS_SCALE = 0.3  # about the spread of sigmoid router scores: the bias changes which experts win


def set_random_correction_bias(model_dir, *, seed: int, scale: float = CORRECTION_BIAS_SCALE) -> Path:
    """Give every router ``e_score_correction_bias`` of the single-file checkpoint in ``model_dir`` (a buffer, so
    ``save_random_model`` leaves transformers' zeros) the values ``scale * N(0, 1)``, in its stored dtype."""
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    biases = [key for key in sorted(tensors) if key.endswith("e_score_correction_bias")]
    if not biases:
        raise ValueError(f"no e_score_correction_bias in {path}")
    for key in biases:
        tensors[key] = (scale * _randn(tensors[key].shape, generator)).to(tensors[key].dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(model_dir)


def write_dense_adapter(model_dir, out_dir, *, modules: list[str], seed: int, rank: int = 4,
                        alpha: float = 8) -> MergedOracle:
    """Hand-write LoRA (per-module keys, as trainers export them) on every ``nn.Linear`` of the decoder layers whose
    path ends with ``.{m}`` for an ``m`` in ``modules`` (also ``target_modules`` of the adapter_config.json); return
    its merged oracle. For modules PEFT 0.21 cannot target on transformers 5 models: it turns gate_proj / up_proj /
    down_proj entries (even ``shared_experts.gate_proj``) into target_parameters on the routed experts."""
    model = load_hf(model_dir)
    scaling = alpha / rank
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not (isinstance(module, torch.nn.Linear) and ".layers." in name
                    and name.endswith(tuple(f".{m}" for m in modules))):
                continue
            out_dim, in_dim = module.weight.shape
            a, b = _draw_factor_pair(1, 1, out_dim, in_dim, rank, scaling, generator)  # [1, r, in], [1, out, r]
            tensors[f"base_model.model.{name}.lora_A.weight"] = a[0].contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b[0].contiguous()
            module.weight += scaling * (b[0] @ a[0])
    if not tensors:
        raise ValueError(f"no nn.Linear of {model_dir} ends with any of {modules}")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(modules), "base_model_name_or_path": str(model_dir)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return MergedOracle(model=model, adapter_dir=out_dir)


# --- quantized checkpoints ----------------------------------------------------------------------


FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        dtype=torch.float64)  # value of each 4-bit code
FP8_MAX = 448.0  # largest float8_e4m3fn
# gpt-oss-20b's modules_to_not_convert (attention, router, embeddings and lm_head stay bf16)
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] (cols a multiple of 32) -> (blocks uint8 [..., rows, cols/32, 16], scales uint8
    [..., rows, cols/32], the values they encode [..., rows, cols] in float64): per 32 values the smallest E8M0
    scale that fits their largest magnitude in 6, each value the nearest E2M1 one."""
    *lead, rows, cols = w.shape
    w = w.double().reshape(*lead, rows, cols // 32, 32)
    amax = w.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # [..., rows, G, 1]
    magnitude = (w.abs() / 2.0**exponent).unsqueeze(-1).sub(FP4_E2M1[:8]).abs().argmin(-1)  # [..., rows, G, 32]
    codes = magnitude | (w < 0).long() << 3  # the sign bit
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    values = FP4_E2M1[codes] * 2.0**exponent
    return blocks, (exponent[..., 0] + 127).to(torch.uint8), values.reshape(*lead, rows, cols)


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/bm), ceil(in/bn)]): each fixed
    bm x bn block (the last ones of a ragged edge smaller) divided by its largest magnitude / 448."""
    bm, bn = block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-w.shape[0] // bm), -(-w.shape[1] // bn), dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            scale_inv[i, j] = tile.abs().max().clamp_min(1e-12) / FP8_MAX
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (tile / scale_inv[i, j]).clamp(-FP8_MAX, FP8_MAX)
    return q, scale_inv


def dequantize_fp8_loop(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """The oracle of block FP8: a plain loop over fixed bm x bn blocks (edge blocks partial), each block's float32
    values times its float32 scale."""
    bm, bn = block
    assert scale_inv.shape == (-(-q.shape[0] // bm), -(-q.shape[1] // bn)), (q.shape, scale_inv.shape)
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            out[rows, cols] = q[rows, cols].float() * scale_inv[i, j]
    return out


def _not_converted(module: str, patterns: list[str]) -> bool:
    """transformers' modules_to_not_convert match: from the start up to a module boundary, a regex, or a suffix."""
    import re

    return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p) for p in patterns)


def save_quantized_copy(model_dir, quant_dir, plain_dir, method: str, not_converted: list[str],
                        block=(128, 128)) -> tuple[Path, Path, list[str]]:
    """Quantize the float checkpoint in ``model_dir`` (written by ``save_random_model``) as a published release
    would, into ``quant_dir`` with its quantization_config; write the values the quantized checkpoint encodes,
    dequantised independently of lora_eval and transformers, as a plain float32 checkpoint in ``plain_dir`` (the
    oracle's weights). Returns (quant_dir, plain_dir, the keys stored quantized).

    ``method`` "mxfp4": gpt-oss experts (``mlp.experts.gate_up_proj`` [E, in, out] / ``down_proj``) as
    ``{key}_blocks`` / ``{key}_scales`` of the transposed [E, out, in]. "fp8": every 2-D Linear weight as
    float8_e4m3fn with ``weight_scale_inv`` per ``block``. Modules matching ``not_converted`` stay as they are."""
    from safetensors.torch import load_file

    model_dir, quant_dir, plain_dir = Path(model_dir), Path(quant_dir), Path(plain_dir)
    for out in (quant_dir, plain_dir):
        out.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (out / f.name).write_bytes(f.read_bytes())
    stored, plain, quantized = {}, {}, []
    for key, w in load_file(str(model_dir / "model.safetensors")).items():
        module = key.rsplit(".", 1)[0]
        if method == "mxfp4" and key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and \
                not _not_converted(module, not_converted):
            blocks, scales, values = quantize_mxfp4(w.transpose(1, 2))  # [E, out, in/32, 16], [E, out, in/32]
            stored[f"{key}_blocks"], stored[f"{key}_scales"] = blocks, scales
            plain[key], w = values.transpose(1, 2).float().contiguous(), None  # [E, in, out]
        elif method == "fp8" and key.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in key and \
                not _not_converted(module, not_converted):
            q, scale_inv = quantize_fp8_blocks(w, block)  # [out, in], [ceil(out/bm), ceil(in/bn)]
            stored[key], stored[f"{module}.weight_scale_inv"] = q, scale_inv
            plain[key], w = dequantize_fp8_loop(q, scale_inv, block), None
        if w is None:
            quantized.append(key)
        else:
            stored[key], plain[key] = w, w.float()
    config = json.loads((model_dir / "config.json").read_text())
    save_file(plain, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
    (plain_dir / "config.json").write_text(json.dumps(config, indent=2))
    quant = {"quant_method": method, "modules_to_not_convert": not_converted}
    if method == "fp8":
        quant.update(fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block))
    save_file(stored, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    return quant_dir, plain_dir, quantized


# --- GLM-4.5 (glm4_moe) and Qwen3-VL-MoE (qwen3_vl_moe, the text path) --------------------------

from transformers import (  # noqa: E402
    AutoConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

# A one-block vision tower: Qwen3-VL-MoE checkpoints carry one, text-only input never reaches it.
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                   num_position_embeddings=16, deepstack_visual_indexes=[0], patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2)
# multimodal rope of head_dim 8 (4 frequencies): sections of temporal / height / width as the published [24, 20, 20]
TINY_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True)


def tiny_glm4_moe_config(**overrides) -> dict:
    """Glm4MoeConfig kwargs: 8 routed experts top-2 in 2 groups of which 1 is eligible, a shared expert
    (moe_intermediate_size 8, so 2I != H), layer 0 dense (first_k_dense_replace), q/k norm, q/k/v biases, RoPE on
    half of each head (partial_rotary_factor 0.5 of head_dim 8), routed_scaling_factor 1.5."""
    glm = dict(moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
               topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, first_k_dense_replace=1,
               use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
    return _common_config(**{**glm, **overrides})


def tiny_qwen3_vl_moe_config(**overrides) -> dict:
    """Qwen3VLMoeConfig kwargs: the language model as tiny_qwen3_moe_config (6 experts top-2, layer 1 dense; expert
    size 8) with a multimodal rope, under text_config; a one-block vision tower. Overrides go to text_config, but
    tie_word_embeddings and vision_config, which are top-level fields."""
    top = {key: overrides.pop(key) for key in ("tie_word_embeddings", "vision_config") if key in overrides}
    text = tiny_qwen3_moe_config(**{**dict(moe_intermediate_size=8, rope_parameters=dict(TINY_MROPE)), **overrides})
    tie = text.pop("tie_word_embeddings")
    return {"text_config": text, "vision_config": dict(TINY_VISION), "tie_word_embeddings": tie, **top}


FAMILIES.update({
    "glm4_moe": (tiny_glm4_moe_config, Glm4MoeConfig, Glm4MoeForCausalLM),
    "qwen3_vl_moe": (tiny_qwen3_vl_moe_config, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration),
})
# transformers classes of a config.json's model_type, where AutoModelForCausalLM does not serve it
HF_MODEL_CLASSES = {"qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration}


def load_hf_model(model_dir):
    """``load_hf`` for any family here, Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) included."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    if model_type not in HF_MODEL_CLASSES:
        return load_hf(model_dir)
    return HF_MODEL_CLASSES[model_type].from_pretrained(model_dir, dtype=torch.float32).eval()


def save_random_model_from_config(out_dir, config: dict, *, seed: int, dtype=torch.float32,
                                  router_gain: float = ROUTER_GAIN, lm_head_gain: float = LM_HEAD_GAIN) -> Path:
    """``save_random_model`` for a config.json dict (a published config, shrunk): written by transformers from
    seeded random weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(out_dir)
    model_cls = HF_MODEL_CLASSES.get(config["model_type"])
    model = (model_cls(hf_config) if model_cls else AutoModelForCausalLM.from_config(hf_config)).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_like(name, param, generator, router_gain, lm_head_gain))
        _centre_norms(model)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


def transpose_experts_to_published(model_dir, out_dir) -> Path:
    """A copy of a Qwen3-VL-MoE checkpoint written by transformers 5 (fused experts [E, 2I, H] / [E, H, I]) with the
    experts as the published checkpoints store them: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    from safetensors.torch import load_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    for key in tensors:
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def save_random_peft_adapter_any(model_dir, out_dir, *, seed: int, **lora_config_kwargs) -> Path:
    """``save_random_peft_adapter`` on the model ``load_hf_model`` loads (Qwen3-VL-MoE's full model included)."""
    model = get_peft_model(load_hf_model(model_dir), LoraConfig(**lora_config_kwargs))
    _randomise_peft_model(model, "default", torch.Generator().manual_seed(seed))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def peft_oracle_any(model_dir, adapter_dir):
    """``peft_oracle`` on the model ``load_hf_model`` loads."""
    return PeftModel.from_pretrained(load_hf_model(model_dir), adapter_dir).eval()


def _adapter_config(model_dir, rank, alpha, **fields) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "base_model_name_or_path": str(model_dir), **fields}


def write_expert_adapter_vl(model_dir, out_dir, *, layout: str, seed: int, rank: int = 4, alpha: float = 8,
                            include_router: bool = False) -> MergedOracle:
    """``write_expert_adapter`` for a Qwen3-VL-MoE checkpoint: the keys as a trainer of the full model writes them
    (``base_model.model.model.language_model.layers.{i}.mlp...``), every MoE layer; the merged oracle is
    Qwen3VLMoeForConditionalGeneration."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    model = load_hf_model(model_dir)
    scaling = alpha / rank
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.model.language_model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        factors = _draw_expert_factors(layer.mlp, layout, rank, scaling, False, include_router, generator)
        tensors.update(_layer_tensors(f"base_model.model.model.language_model.layers.{i}.mlp.", factors, layout,
                                      "qwen"))
        _merge(layer.mlp, factors, scaling)
    config = _adapter_config(model_dir, rank, alpha, target_modules="all-linear")
    if layout == "peft_target_parameters":
        router = ["mlp.gate.weight"] if include_router else []
        config.update(target_modules=None, target_parameters=PEFT_EXPERT_PARAMETERS + router)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return MergedOracle(model=model, adapter_dir=out_dir)



# --- Gated DeltaNet hybrids: Qwen3-Next and Qwen3.5 MoE ----------------------------------------------------------

# model types whose RMSNorms compute x / rms(x) * (1 + w) (transformers initialises w to zeros): their random
# norm weights are drawn around 0, as _random_like draws the others' around 1, so that every norm keeps the scale
ZERO_CENTRED_NORMS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


# Gated DeltaNet's decay rates exp(A_log): drawn near 1 (A_log ~ N(0, 0.1)) a state remembers ~2 tokens, and the tiny
# models' chunked delta rule amplifies float32 rounding (it sums log decays over 64-token chunks, to about -45: an
# exponent off by ~4e-6), so that two float32 computations of one model (ours, transformers') differed by up to 4e-5;
# shifted to near 0.1 (a state remembering ~10 tokens) by at most 4.3e-6 (save_random_hybrid's measurements)
HYBRID_LOG_DECAY_SHIFT = -2.3


def _centre_norms(model) -> None:
    """For the zero-centred families: their norm weights (all but Gated DeltaNet's gated norm, a plain one) shifted
    from ~1 to ~0, and A_log shifted by HYBRID_LOG_DECAY_SHIFT."""
    types = {model.config.model_type, getattr(model.config, "text_config", model.config).model_type}
    if not types & set(ZERO_CENTRED_NORMS):
        return
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and ".linear_attn.norm." not in name and "visual" not in name:
            param.sub_(1.0)
        if name.endswith("linear_attn.A_log"):
            param.add_(HYBRID_LOG_DECAY_SHIFT)


# the linear-attention shapes of the releases, scaled down: 2 key heads serving 4 value heads (the releases' 16 / 32
# and 16 / 64 keep this 1:2 or 1:4 grouping), conv width 4; heads of 16 dims (8 makes the tiny model's delta rule
# amplify rounding several times more: tests/test_qwen3_next.py)
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4)
# three linear layers, then a full one, then one more linear: one period of the releases' pattern plus one
TINY_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention", "linear_attention"]


def tiny_qwen3_next_config(**overrides) -> dict:
    """Qwen3NextConfig kwargs: 5 layers (the pattern from full_attention_interval 4, as the release gives none), 6
    experts top-2 plus a shared expert, layer 1 dense (mlp_only_layers), gated attention of head_dim 16 with RoPE on a
    quarter of it, norm_topk_prob false (the release's is true: both are tested)."""
    hybrid = dict(num_hidden_layers=5, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=8, intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False,
                  full_attention_interval=4, partial_rotary_factor=0.25, **TINY_LINEAR)
    return _common_config(**{**hybrid, **overrides})


def tiny_qwen3_5_moe_config(**overrides) -> dict:
    """Qwen3_5MoeConfig kwargs: the text model (TINY_LAYER_TYPES, 6 experts top-2 plus a shared expert on every
    layer, gated attention of head_dim 16, interleaved mrope on a quarter of it) under text_config, and a one-block
    vision tower. Overrides go to text_config, but tie_word_embeddings, which is top-level."""
    top = {key: overrides.pop(key) for key in ("tie_word_embeddings",) if key in overrides}
    text = _common_config(**{**dict(
        num_hidden_layers=5, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, layer_types=TINY_LAYER_TYPES,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True), **TINY_LINEAR), **overrides})
    text.pop("intermediate_size")
    tie = text.pop("tie_word_embeddings")
    vision = {k: v for k, v in TINY_VISION.items() if k != "deepstack_visual_indexes"}
    return {"text_config": text, "vision_config": vision, "tie_word_embeddings": tie, **top}


FAMILIES.update({
    "qwen3_next": (tiny_qwen3_next_config, Qwen3NextConfig, Qwen3NextForCausalLM),
    "qwen3_5_moe": (tiny_qwen3_5_moe_config, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration),
})
HF_MODEL_CLASSES["qwen3_5_moe"] = Qwen3_5MoeForConditionalGeneration


# --- adapters on the Gated DeltaNet hybrids ----------------------------------------------------------------------

# save_random_hybrid's norms' eps (see there)
HYBRID_RMS_NORM_EPS = 1e-2


def save_random_hybrid(out_dir, family: str, *, seed: int, **overrides) -> Path:
    """``save_random_model`` of qwen3_next / qwen3_5_moe made well-conditioned enough for 1e-5 comparisons of rows
    up to 150 tokens with adapters: gains 1, rms_norm_eps 1e-2 and Gated DeltaNet decay rates exp(A_log) near 0.1.
    With the defaults (rates near 1, eps 1e-6), float32 noise of 1 ulp on the embeddings moved transformers' own
    logprobs on 17-150-token rows by 2.3e-5 on qwen3_next and 1.6e-5 on qwen3_5_moe (medians over 8 seeds; maxima
    3.4e-5, 5.9e-5), with these settings by 1.9e-6 and 2.4e-6 (maxima 2.4e-6, 3.8e-6): transformers' chunked delta
    rule sums log decays over 64-token chunks (to about -45, an exponent off by ~4e-6 in float32), and the gated
    RMSNorm rescales heads whose output is 100 times below the median (the larger eps damps those). Two
    implementations that round a LoRA differently differed by up to 4e-5 on such models: that noise, not an error;
    here by at most 4.3e-6 (552 comparisons of tests/test_qwen3_next_adapters.py, 24 seeds).
    """
    return save_random_model(out_dir, family, seed=seed, router_gain=1.0, lm_head_gain=1.0,
                             rms_norm_eps=HYBRID_RMS_NORM_EPS, **overrides)  # (A_log: _centre_norms)


def write_split_qkv_adapter(model_dir, out_dir, *, seed: int, parts: str = "qkv", rank: int = 4, alpha: float = 8,
                            rank_pattern: dict | None = None, layout: str = "text",
                            target_modules=None) -> MergedOracle:
    """A Tinker-style export for a Qwen3.5 checkpoint: LoRA on `linear_attn.in_proj_q` / `in_proj_k` / `in_proj_v`
    (those in ``parts``; A [r, H], B [rows of the part, r]) of every linear-attention layer, where the checkpoint
    fuses them into `in_proj_qkv` (rows: q = Hk*K, k = Hk*K, v = Hv*V). Keys in the text model's layout (``layout``
    "text": `base_model.model.model.layers.{i}`, as Tinker writes them) or the vision-language model's ("vl"); the
    ranks from ``rank_pattern`` (keyed `in_proj_q`, ...) else ``rank``. The oracle is
    Qwen3_5MoeForConditionalGeneration with each part's delta merged into its rows of in_proj_qkv."""
    model = load_hf_model(model_dir)
    text = model.config.text_config
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    rows = {"q": key_dim, "k": key_dim, "v": text.linear_num_value_heads * text.linear_value_head_dim}
    prefix = "base_model.model.model." + ("language_model." if layout == "vl" else "")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):
            if not hasattr(layer, "linear_attn"):  # a full-attention layer
                continue
            weight, start = layer.linear_attn.in_proj_qkv.weight, 0  # [2*Hk*K + Hv*V, H]
            for part in "qkv":
                if part in parts:
                    r = (rank_pattern or {}).get(f"in_proj_{part}", rank)
                    a, b = _draw_factor_pair(1, 1, rows[part], weight.shape[1], r, alpha / r, generator)
                    key = f"{prefix}layers.{i}.linear_attn.in_proj_{part}"
                    tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a[0], b[0]
                    weight[start:start + rows[part]] += (alpha / r) * b[0] @ a[0]
                start += rows[part]
    config = _adapter_config(model_dir, rank, alpha, rank_pattern=rank_pattern or {},
                             target_modules=target_modules or [f"in_proj_{part}" for part in parts])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return MergedOracle(model=model, adapter_dir=out_dir)
