"""Execution of the engine's forward (imported as `lora_eval.runners`): the CUDA-graph runner (graphs.py) and the
clock of Triton's compiles outside it (compile_clock.py). The eager path is the engine's own forward call."""
