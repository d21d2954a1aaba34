"""Kernels of the engine (imported as `lora_eval.kernels`): one module per op, each with its plain-torch
reference beside it. The references are the CPU path of the engine and the oracle for the Triton kernels.

Arguments that follow the batch (token, row, pair and block counts, sequence and prefix lengths) are named in each
kernel's `do_not_specialize`: Triton otherwise compiles a variant per value class of every integer argument (equal
to 1, a multiple of 16, other), and batches of varying shape (MMLU's, compare's) would then compile the large kernels
again inside the timed forward (issue #24; BENCHMARKS-history 18.2). Strides and model
sizes stay specialised: they are fixed per model and their divisibility lets loads and stores vectorise."""
