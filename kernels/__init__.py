"""Kernels of the engine (imported as `lora_eval.kernels`): one module per op, each with its plain-torch
reference beside it. The references are the CPU path of the engine and the oracle for the Triton kernels.

Arguments that follow the batch (token, row, pair and block counts, sequence and prefix lengths) are named in each
kernel's `do_not_specialize`: Triton otherwise compiles a variant per value class of every integer argument (equal
to 1, a multiple of 16, other), and batches of varying shape (MMLU's, compare's) compiled the large kernels up to 12
times each inside the timed forward (counted on the CPU from the launches' signatures, issue #24). Strides and model
sizes stay specialised: they are fixed per model and their divisibility lets loads and stores vectorise."""
