"""What an adapter does to a model, as a DataFrame: layout, targets per module kind, ranks, scalings, sizes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from ..adapters import load_adapter
from ..models import load_model

COLUMNS = ["adapter", "layout", "kind", "part", "layers", "rank", "scaling", "params", "writer"]


def inspect_adapters(model_dir: str | Path, adapters: dict[str, str | Path],
                     gate_up_layout: str | None = None) -> tuple[dict, pd.DataFrame]:
    """(model summary, one row per adapter x module kind x part). Reads only shapes of the base weights."""
    model = load_model(model_dir, dtype=torch.float32, device="meta")
    args = model.args
    summary = dict(model_type=args.model_type, layers=args.num_layers, hidden=args.hidden_size,
                   experts=args.num_experts, top_k=args.top_k, sparse_layers=len(args.sparse_layers),
                   vocab=args.vocab_size, quantization=args.quantization,
                   linear_attention_layers=sum(t == "linear_attention" for t in getattr(args, "layer_types", ())))
    rows = []
    for name, path in adapters.items():
        adapter = load_adapter(path, name, model, gate_up_layout)
        layout = ", ".join(sorted(adapter.layouts)) or "dense targets only"
        # the writer (adapters/writers.py) and how its expert layout was read: one line each, the same on every row
        writer = "\n".join([adapter.config.writer.describe(), *adapter.decisions])
        targets = pd.DataFrame(adapter.targets)
        if targets.empty:
            rows.append(dict(adapter=name, layout=layout, kind="(none)", part="", layers=0, rank="", scaling="",
                             params=0, writer=writer))
            continue
        for (kind, part), group in targets.groupby(["kind", "part"], sort=True):
            rows.append(dict(
                adapter=name, layout=layout, kind=kind, part=part,
                layers=group["layer"].nunique() if group["layer"].notna().any() else 1,
                rank=_values(group["rank"]), scaling=_values(group["scaling"]),
                params=int(group["params"].sum()), writer=writer,
            ))
    return summary, pd.DataFrame(rows, columns=COLUMNS)


def _values(series: pd.Series) -> str:
    """'4' or '2,4' (or '-' when none apply): the distinct values of a column, for a compact table."""
    values = sorted(series.dropna().unique())
    return ",".join(f"{v:.6g}" for v in values) if values else "-"
