"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models."""

from .compare import CompareResult, compare
from .engine import Batch, Engine
from .errors import InputError, UnsupportedError
from .mmlu import MmluResult, mmlu

__all__ = ["Batch", "CompareResult", "Engine", "InputError", "MmluResult", "UnsupportedError", "compare",
           "mmlu"]
__version__ = "0.1.0"
