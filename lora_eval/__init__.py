"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models."""

from .compare import CompareResult, compare
from .engine import Batch, Engine
from .errors import InputError, UnsupportedError

__all__ = ["Batch", "CompareResult", "Engine", "InputError", "UnsupportedError", "compare"]
__version__ = "0.1.0"
