"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models."""

from .engine import Batch, Engine
from .errors import InputError, UnsupportedError

__all__ = ["Batch", "Engine", "InputError", "UnsupportedError"]
__version__ = "0.1.0"
