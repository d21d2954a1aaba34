"""What the user gives, read and checked before any model loads: reference dumps, prompts, MMLU data,
the model folder's config and tokenizer, option values. An error here names the file, key or row.
May import: errors, names, models (config and checkpoint headers)."""
