"""lora-eval: offline batch evaluation of LoRA adapters on Mixture-of-Experts language models.

The public names are imported on first use (PEP 562), so that `lora-eval` answers a usage error before torch loads
(about 2 s of imports on a CPU); `from lora_eval import compare` works as ever. The layers, each a folder whose
`__init__` says what it may import (tests/test_layers.py holds them to it): inputs -> models, adapters -> engine ->
results -> render, and tasks over all of them; cli and commands on top."""

from importlib import import_module

_PUBLIC = {"Batch": "engine.engine", "Engine": "engine.engine", "EngineOptions": "engine.engine",
           "CompareResult": "results.tables", "MmluResult": "results.tables",
           "read_run": "results.tables", "InputError": "errors",
           "Interrupted": "errors", "UnsupportedError": "errors", "compare": "tasks.compare",
           "diagnose": "tasks.diagnose.task", "mmlu": "tasks.mmlu.task", "dump_reference": "tasks.dump_reference"}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lora_eval' has no attribute '{name}'")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
