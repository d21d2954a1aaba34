"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models."""

from .compare import compare
from .diagnose import diagnose
from .engine import Batch, Engine, EngineOptions
from .errors import InputError, Interrupted, UnsupportedError
from .mmlu import mmlu
from .results import CompareResult, MmluResult, read_run
from .trainer import dump_reference

__all__ = ["Batch", "CompareResult", "Engine", "EngineOptions", "InputError", "Interrupted", "MmluResult",
           "UnsupportedError", "compare", "diagnose", "dump_reference", "mmlu", "read_run"]
__version__ = "0.1.0"
