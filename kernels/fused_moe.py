"""Fused MoE with per-(adapter, expert) LoRA: the math every MoE path must reproduce.

For token t routed to expert e with weight w, under adapter slot s (-1 = none):
  gate_up = W_gu[e] x + B_gu[s, e] (A_gu[s, e] x)      (no routing weight, before the activation)
  a       = silu(gate) * up
  y[t]   += w * (W_d[e] a + B_d[s, e] (A_d[s, e] a))
Shapes: x [T, H], topk_ids/topk_weights [T, k], w_gate_up [E, 2I, H], w_down [E, H, I];
LoRA (ExpertLoRA): gate_up_A [S, Ea, R, H], gate_up_B [S, Eb, 2I, R], down_A [S, Ea, R, I], down_B [S, Eb, H, R]
where an expert dim of 1 is shared by all experts (broadcast), scaling folded into B.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import linear_ref


def fused_moe_ref(x, topk_ids, topk_weights, w_gate_up, w_down, lora=None, token_slots=None) -> torch.Tensor:
    """Plain-torch reference: loop over experts that got tokens, then over adapter slots among those tokens."""
    T, k = topk_ids.shape
    I = w_down.shape[-1]
    out = torch.zeros_like(x)  # [T, H]
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)  # [n] indices into T*k
        tokens = pairs // k  # [n]
        xe = x[tokens]  # [n, H]
        gate_up = linear_ref(xe, w_gate_up[e])  # [n, 2I]
        groups = _slot_groups(lora, token_slots[tokens]) if lora is not None else []
        for slot, rows in groups:
            A, B = lora.gate_up_A[slot], lora.gate_up_B[slot]
            delta = linear_ref(linear_ref(xe[rows], A[e % A.shape[0]]), B[e % B.shape[0]])  # [m, 2I]
            gate_up.index_add_(0, rows, delta)
        act = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        ye = linear_ref(act, w_down[e])  # [n, H]
        for slot, rows in groups:
            A, B = lora.down_A[slot], lora.down_B[slot]
            ye.index_add_(0, rows, linear_ref(linear_ref(act[rows], A[e % A.shape[0]]), B[e % B.shape[0]]))  # [m, H]
        out.index_add_(0, tokens, ye * topk_weights.reshape(-1)[pairs, None])
    return out


def _slot_groups(lora, slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, positions) for each adapter slot among `slots` that has expert weights in `lora`."""
    present = torch.unique(slots).tolist()
    return [(s, (slots == s).nonzero().squeeze(1)) for s in present if s in lora.slots]
