"""Readers of the per-token logprob dumps that RL frameworks write, each giving our reference columns (sample_id,
adapter, input_ids, logprobs, mask, sampler_logprobs, temperature, routed_experts; references.py validates them).
One module per framework, each naming the framework's source file and commit it follows; a file is recognised by its
content (`detect`), never by its name alone. Nothing here unpickles: a .pt file goes through
torch.load(weights_only=True) only (common.load_torch), and a plain pickle is refused unopened."""
