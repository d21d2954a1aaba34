"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models.

The public names are imported on first use (PEP 562), so that `lora-eval` answers a usage error before torch loads
(about 2 s of imports on a CPU); `from lora_eval import compare` works as ever."""

import sys
import types
from importlib import import_module

_PUBLIC = {"Batch": "engine", "Engine": "engine", "EngineOptions": "engine", "CompareResult": "results",
           "MmluResult": "results", "read_run": "results", "InputError": "errors", "Interrupted": "errors",
           "UnsupportedError": "errors", "compare": "compare", "diagnose": "diagnose", "mmlu": "mmlu",
           "dump_reference": "trainer"}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lora_eval' has no attribute '{name}'")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


class _Package(types.ModuleType):
    """Python's import sets `lora_eval.compare` to the submodule it loads; three public functions share their
    module's name (compare, diagnose, mmlu), and `lora_eval.compare` is the function, however the modules were
    imported (as it was when this file imported them eagerly)."""

    def __setattr__(self, name, value):
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
