"""`python -m lora_eval ...`: the same as the `lora-eval` command."""

from .cli import main

main()
