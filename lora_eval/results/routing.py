"""Routing agreement: the experts the engine chose against the sampler's recorded routes (a reference's
`routed_experts`), per position and MoE layer, then per adapter and per layer.

A flip at (position, layer): the engine's top-k expert set differs from the sampler's (order within the k does not
count). Its weight: the share of the engine's routing weight that went to experts the sampler did not choose (0 when
the sets agree; 1 when they share no expert) — a flip between two near-tied experts of small weight weighs little,
one that moves most of a token's expert output weighs much. Both are averaged over the scored positions (the
reference's mask) and MoE layers that carry routes: `routing_flip_rate` and `routing_flip_weight`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..names import OVERALL

ROUTING_COLUMNS = ["adapter", "layer", "positions", "flips", "flip_rate", "flip_weight"]


def route_flips(engine_ids: np.ndarray, engine_weights: np.ndarray, sampler_ids: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """engine ids and weights [n, L, k], the sampler's ids [n, L, k] -> (flip [n, L] bool, flip weight [n, L]
    float64: the engine's weight outside the sampler's set over its whole weight)."""
    flip = (np.sort(engine_ids, axis=-1) != np.sort(sampler_ids, axis=-1)).any(-1)  # [n, L]
    shared = (engine_ids[..., :, None] == sampler_ids[..., None, :]).any(-1)  # [n, L, k]
    weights = engine_weights.astype(np.float64)  # [n, L, k]
    total = weights.sum(-1)  # [n, L]
    outside = np.where(shared, 0.0, weights).sum(-1)  # [n, L]
    return flip, np.divide(outside, total, out=flip.astype(np.float64), where=total > 0)


def routing_table(adapters: list[str], masks: list[np.ndarray], flips: list[np.ndarray | None],
                  weights: list[np.ndarray | None], layers: list[int]) -> pd.DataFrame:
    """Per adapter (and overall) and MoE layer (`layers`: their model indices): scored positions, flips, flip rate
    and mean flip weight, over the samples that carry routes (flips[i] [n, L] or None; masks[i] [n] bool)."""
    rows = []
    by_adapter: dict[str, list[int]] = {}
    for i, a in enumerate(adapters):
        if flips[i] is not None:
            by_adapter.setdefault(a, []).append(i)
    groups = list(by_adapter.items())
    if groups:
        groups.append((OVERALL, [i for _, members in groups for i in members]))
    for adapter, members in groups:
        f = np.concatenate([flips[i][masks[i]] for i in members])  # [positions, L]
        w = np.concatenate([weights[i][masks[i]] for i in members])  # [positions, L]
        for j, layer in enumerate(layers):
            n = len(f)
            rows.append(dict(adapter=adapter, layer=layer, positions=n, flips=int(f[:, j].sum()),
                             flip_rate=float(f[:, j].mean()) if n else np.nan,
                             flip_weight=float(w[:, j].mean()) if n else np.nan))
    return pd.DataFrame(rows, columns=ROUTING_COLUMNS)
