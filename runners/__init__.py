"""Execution of the engine's forward (imported as `lora_eval.runners`): the eager path lives in the engine
today; the CUDA-graph runner (issue #5) goes here."""
