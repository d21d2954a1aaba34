"""The engine: a loaded model with its adapters turning batches of token ids into logprobs (forward,
prefix cache, batching, expert parallel, the memory plan). Tasks drive it; it knows no task.
May import: errors, names, distributed, progress, inputs, models, adapters, kernels, runners."""
