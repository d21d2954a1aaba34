"""Kernels of the engine (imported as `lora_eval.kernels`): one module per op, each with its plain-torch
reference beside it. The references are the CPU path of the engine and the oracle for the Triton kernels."""
