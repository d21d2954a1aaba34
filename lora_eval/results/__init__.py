"""What a run leaves: the tables and their columns, the metrics computed from logprobs, MMLU's statistics,
and the run folder (locks, parts, fingerprints, the atomic commit) that holds them.
May import: errors, names, distributed, progress, inputs. Never engine, tasks or render."""
