"""MMLU: prompts built as lm-eval builds them, tokenised (beside the model's load on a GPU), scored
through the run protocol. Its data reader is inputs/mmlu_data.py, its statistics results/mmlu_stats.py.
May import what tasks/ may."""
