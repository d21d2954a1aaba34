"""Names the result tables give to rows that are not an adapter; no adapter may take them."""

BASE = "base"  # the base model (adapter None in references and batches)
OVERALL = "overall"  # compare's summary row over every token
