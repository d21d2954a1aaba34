"""Names shared by the command line and the layers below it, kept free of imports so that the CLI can parse its
arguments before torch loads: the rows of result tables that are not an adapter (no adapter may take their names),
the compute dtypes and diagnose's side-B adapter choices."""

BASE = "base"  # the base model (adapter None in references and batches)
OVERALL = "overall"  # compare's summary row over every token
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # compute dtypes (engine.DTYPES maps them to torch's)
AGAINST_ADAPTERS = ("same", "none")  # diagnose's side B with side A's adapters, or without them (a merged checkpoint)
