"""Mixtral: Llama attention and a top-k MoE in every layer; the router always renormalises its top-k weights.

The model is the Qwen3-MoE code (lora_eval/models/qwen3.py) with other config fields and other checkpoint
names. Our module paths are transformers 5's in-memory ones (`model.layers.{i}.mlp.gate`, `mlp.experts`
fused: gate_up [E, 2I, H], down [E, H, I]), which is how PEFT addresses them today. Published checkpoints and
adapters trained with transformers 4 say `block_sparse_moe` and keep experts apart as w1 (gate), w3 (up),
w2 (down); both mappings are below.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedError
from . import qwen3
from .qwen3 import CausalLM

MODEL_TYPES = ("mixtral",)

# checkpoint key mapping: our name -> the published on-disk name (a fused name is also read as is)
CHECKPOINT_RENAMES = ((".mlp.", ".block_sparse_moe."),)
CHECKPOINT_EXPERT_KEYS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
# adapters trained with transformers 4 -> our module paths: lora_eval/adapters/load.py replaces this substring
# in their keys and in the module names and patterns of their adapter_config.json
ADAPTER_RENAMES = (("block_sparse_moe", "mlp"),)
# MixtralConfig defaults for fields a published config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6}

__all__ = ["MODEL_TYPES", "ModelArgs", "CausalLM", "load_weights"]


@dataclass
class ModelArgs(qwen3.ModelArgs):
    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        return super().from_config({**DEFAULTS, **config}, where)

    def read_family(self, config: dict, read) -> None:
        if config.get("sliding_window") is not None:
            raise UnsupportedError(self.where, f"sliding-window attention ({config['sliding_window']}) is not "
                                   "supported for mixtral; only sliding_window null is", key="sliding_window")
        self.attention_bias = False  # MixtralAttention has no biases, whatever the config says
        self.read_experts(config, read, intermediate_key="intermediate_size")  # num_local_experts, expert size
        self.norm_topk_prob = True  # Mixtral always renormalises the top-k weights
        self.sparse_layers = tuple(range(self.num_layers))


def load_weights(model: CausalLM, files, dtype, device):
    return qwen3.load_weights(model, files, dtype, device, CHECKPOINT_EXPERT_KEYS, CHECKPOINT_RENAMES)
