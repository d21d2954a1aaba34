"""The router top-k Triton kernel against its plain-torch reference (softmax -> topk -> renormalise): the
interpreter on the CPU (float32 and float16 logits); on the GPU also bf16 logits at Qwen3-30B-A3B's router."""

from __future__ import annotations

import pytest
import torch

from lora_eval.kernels.router import router_topk, router_topk_ref
from lora_eval.kernels.tiles import ROUTER_ROWS_PER_PROGRAM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def distinct_logits(T, E, g, dtype, scale=2.0):
    """Random logits with no two equal in a row (after rounding to dtype), so that the top-k is unambiguous."""
    order = torch.argsort(torch.rand(T, E, generator=g), dim=1)  # [T, E] a random permutation per row
    logits = (order.float() - E / 2) * (scale / E) + 0.01 * torch.rand(T, E, generator=g) * (scale / E)
    return logits.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("E,k", [(60, 4), (8, 2), (128, 8)])  # Qwen2-MoE (not a power of two), Mixtral, Qwen3
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_topk_matches_reference(seed, dtype, E, k, renormalize):
    g = torch.Generator().manual_seed(seed)
    T = 2 * ROUTER_ROWS_PER_PROGRAM + 5  # a ragged last program
    logits = distinct_logits(T, E, g, dtype)
    weights, ids = router_topk(logits, k, renormalize)
    ref_w, ref_ids = router_topk_ref(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(T, device=DEVICE), rtol=1e-6, atol=1e-6)
    else:
        assert (weights.sum(1) < 0.999).all()  # the plain softmax share of the k, so renormalising would show


def test_router_topk_ties_take_the_lower_expert():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0]], device=DEVICE)
    weights, ids = router_topk(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_topk_bf16_qwen3_30b_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    logits = distinct_logits(4096, 128, g, torch.float32, scale=8.0)
    weights, ids = router_topk(logits.bfloat16(), 8, True)
    ref_w, ref_ids = router_topk_ref(logits.bfloat16(), 8, True)
    # bf16 logits can tie: compare the chosen probabilities, and the experts wherever the row has no tie
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.bfloat16().float(), -1)
    no_tie = (probs.unsqueeze(2) == probs.unsqueeze(1)).sum((1, 2)) == probs.shape[1]
    assert no_tie.float().mean() > 0.5
    assert torch.equal(ids[no_tie], ref_ids[no_tie])
