"""The commands' work, each a thin layer over one Engine and the run protocol of tasks/run.py: compare,
mmlu, diagnose, dump-reference; bench, demo and inspect-adapters beside them.
May import anything below: inputs, models, adapters, engine, results, render."""
