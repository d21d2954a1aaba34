"""Kernel tests: without CUDA, Triton runs through its interpreter (set before anything imports triton)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
