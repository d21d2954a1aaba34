"""How much an adapter changes each module it targets, on real inputs: ‖ΔW x‖ and ‖W x‖ per module, summed over the
tokens of a forward pass (`lora-eval diagnose`, modules.csv).

`EffectRecorder` is a plain-torch `Forward` (forward.py) of one adapter slot that computes the forward exactly as the
torch backend does and, at each module the adapter targets, also sums in float64, over the rows:
  dense LoRA        ‖B (A x)‖²  and ‖W x + b‖²         (scaling folded into B; router and lm_head included)
  modules_to_save   ‖W' x + b' - (W x + b)‖² and ‖W x + b‖²   (linear; norms and embeddings likewise)
  embedding LoRA    ‖B A[ids]‖² and ‖W[ids]‖²
  expert LoRA       per (token, chosen expert) pair, over the layer's experts together: gate_up ‖B_gu (A_gu x)‖² and
                    ‖W_gu x + b‖²; down, on the activation the adapter row really computes (its gate_up delta
                    included), ‖B_d (A_d a)‖² and ‖W_d a + b‖² — routing weights left out
so a module the adapter targets but does not change (B = 0) sums exactly 0. The projections are computed again in
float32 from the layer weights and the adapter's factors; the forward itself is the engine's torch path, untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.forward import Forward
from ...kernels.fused_moe import activation_ref
from ...kernels.rms_norm import rms_norm_ref
from ...models.layers import Linear


class EffectRecorder(Forward):
    """The torch-backend forward of one row under adapter `slot` of `stack`, with `sums[site] = [Σ‖ΔW x‖², Σ‖W x‖²,
    rows]` for every module of the adapter that the pass runs (`head` adds lm_head)."""

    def __init__(self, stack, slot: int, adapter, length: int, device: torch.device):
        super().__init__("torch", [length], stack, torch.full((length,), slot, dtype=torch.long, device=device))
        self.slot, self.adapter = slot, adapter
        self.sums: dict[str, list[float]] = {}

    # ---- the ops, recorded -------------------------------------------------------------------------------
    def linear(self, module, x, with_lora=True, residual=None, y=None):
        self._dense(module, x)
        return super().linear(module, x, with_lora, residual, y)

    def linear_float32(self, module, x):
        self._dense(module, x)
        return super().linear_float32(module, x)

    def norm(self, module, x):
        override = self.stack.overrides.get(module.site)
        if override is not None and self.slot in override.slots:
            base = rms_norm_ref(x, module.weight, module.eps).float()  # [T, dim]
            own = rms_norm_ref(x, override.params[self.slot]["weight"], module.eps).float()
            self._add(module.site, own - base, base)
        return super().norm(module, x)

    def embedding(self, module, ids):
        base = F.embedding(ids, module.weight).float()  # [T, H]
        delta = torch.zeros_like(base)
        targeted = False
        lora = self.stack.embedding.get(module.site)
        if lora is not None and self.slot in lora.slots:
            delta += F.embedding(ids, lora.A[self.slot]).float() @ lora.B[self.slot].float().T  # [T, R] @ [R, H]
            targeted = True
        override = self.stack.overrides.get(module.site)
        if override is not None and self.slot in override.slots:
            delta += F.embedding(ids, override.params[self.slot]["weight"]).float() - base
            targeted = True
        if targeted:
            self._add(module.site, delta, base)
        return super().embedding(module, ids)

    def moe(self, experts, x, topk_ids, topk_weights, residual=None):
        lora = self.stack.experts.get(experts.site)
        factors = self.adapter.experts.get(experts.site)
        if lora is not None and factors is not None and self.slot in lora.slots:
            self._experts(experts, lora, factors, x, topk_ids)
        return super().moe(experts, x, topk_ids, topk_weights, residual)

    def head(self, lm_head: Linear, hidden: torch.Tensor, rows: int = 256) -> None:
        """lm_head's share, on the final hidden states [T, H], `rows` positions at a time."""
        for start in range(0, hidden.shape[0], rows):
            self._dense(lm_head, hidden[start:start + rows])

    # ---- the sums ----------------------------------------------------------------------------------------
    def _add(self, site: str, delta: torch.Tensor, base: torch.Tensor) -> None:
        sums = self.sums.setdefault(site, [0.0, 0.0, 0])
        sums[0] += float(delta.double().square().sum())
        sums[1] += float(base.double().square().sum())
        sums[2] += base.shape[0]

    def _dense(self, module, x: torch.Tensor) -> None:
        """A Linear's delta on x [T, in]: its LoRA and / or the adapter's own copy of its weights."""
        lora = self.stack.dense.get(module.site)
        override = self.stack.overrides.get(module.site)
        has_lora = lora is not None and self.slot in lora.slots
        has_copy = override is not None and self.slot in override.slots
        if not (has_lora or has_copy):
            return
        xf = x.float()  # [T, in]
        base = F.linear(xf, module.weight.float(), None if module.bias is None else module.bias.float())  # [T, out]
        delta = torch.zeros_like(base)
        if has_lora:
            delta += F.linear(F.linear(xf, lora.A[self.slot].float()), lora.B[self.slot].float())  # [T, R] -> [T, out]
        if has_copy:
            own = override.params[self.slot]
            bias = None if own.get("bias") is None else own["bias"].float()
            delta += F.linear(xf, own["weight"].float(), bias) - base
        self._add(module.site, delta, base)

    def _experts(self, experts, lora, factors, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Expert LoRA of one layer over every (token, chosen expert) pair (see the module notes)."""
        s, k = self.slot, topk_ids.shape[1]
        flat = topk_ids.reshape(-1)  # [T*k]
        I = experts.intermediate_size
        gate_up_bias, down_bias = experts.gate_up_proj_bias, experts.down_proj_bias
        for e in torch.unique(flat).tolist():
            xe = x[(flat == e).nonzero().squeeze(1) // k].float()  # [n, H] tokens routed to e
            gate_up = F.linear(xe, experts.gate_up_proj[e].float(),
                               None if gate_up_bias is None else gate_up_bias[e].float())  # [n, 2I]
            A, B = lora.gate_up_A[s], lora.gate_up_B[s]  # [Ea, R, H], [Eb, 2I, R]
            gate_up_delta = F.linear(F.linear(xe, A[e % A.shape[0]].float()), B[e % B.shape[0]].float())  # [n, 2I]
            adapted = gate_up + gate_up_delta  # [n, 2I]
            act = activation_ref(adapted[:, :I], adapted[:, I:], experts.activation, experts.swiglu_alpha,
                                 experts.swiglu_limit)  # [n, I]
            down = F.linear(act, experts.down_proj[e].float(), None if down_bias is None else down_bias[e].float())
            A, B = lora.down_A[s], lora.down_B[s]  # [Ea, R, I], [Eb, H, R]
            down_delta = F.linear(F.linear(act, A[e % A.shape[0]].float()), B[e % B.shape[0]].float())  # [n, H]
            if factors.gate_up is not None:
                self._add(f"{experts.site}.gate_up_proj", gate_up_delta, gate_up)
            if factors.down is not None:
                self._add(f"{experts.site}.down_proj", down_delta, down)
