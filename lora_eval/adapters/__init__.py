"""PEFT LoRA adapters: config validation, key and layout parsing, target resolution, stacked buffers."""

from .config import AdapterConfig
from .load import Adapter, load_adapter
from .stack import AdapterStack

__all__ = ["AdapterConfig", "Adapter", "load_adapter", "AdapterStack"]
