"""token_logprobs (fused lm_head + log_softmax + gather) against its plain-torch reference.

Without CUDA the kernels run in the Triton interpreter (tests/kernels/conftest.py), where bf16 is wrong,
so bf16 is checked on the GPU only. Shapes are deliberately ragged: N, V and H are not multiples of
BLOCK_N, BLOCK_V and BLOCK_H.
"""

from __future__ import annotations

import pytest
import torch

from lora_eval.kernels.logprobs import token_logprobs, token_logprobs_ref
from lora_eval.kernels.tiles import LOGPROBS_TILES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N, H, V = 75, 96, 1000  # interpreter-sized; none a multiple of its block
assert N % LOGPROBS_TILES["BLOCK_N"] and V % LOGPROBS_TILES["BLOCK_V"] and H % LOGPROBS_TILES["BLOCK_H"]


def _inputs(seed, n, h, v, dtype, max_logit=50.0, device=DEVICE):
    """Random hidden/weight with max |logit| == max_logit, and targets that include 0, V-1 and row argmaxes."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    logits = hidden @ weight.T
    hidden *= max_logit / logits.abs().max()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[0], targets[-1] = 0, v - 1
    targets[2::3] = logits[2::3].argmax(1)  # near-zero logprobs as well as very negative ones
    return hidden.to(device, dtype), weight.to(device, dtype), targets.to(device)


def _poisoned(n):
    return torch.full((n,), float("nan"), dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("v_splits", [None, 3, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)])
def test_matches_reference(seed, dtype, v_splits):
    hidden, weight, targets = _inputs(seed, N, H, V, dtype)
    out = _poisoned(N)
    got = token_logprobs(hidden, weight, targets, out=out, v_splits=v_splits)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()

    exact = token_logprobs_ref(hidden.float(), weight.float(), targets)  # fp32 logits, like the kernel
    rounded = token_logprobs_ref(hidden, weight, targets)  # logits rounded to `dtype` first
    err_exact = (got - exact).abs().max().item()
    err_rounded = (got - rounded).abs().max().item()
    print(f"{dtype} v_splits={v_splits}: max|err| vs fp32 logits {err_exact:.2e}, vs rounded {err_rounded:.2e}")
    assert err_exact < (1e-4 if dtype != torch.bfloat16 else 1e-3)
    # the reference's rounding moves a logit of 50 by up to 50 * eps / 2, the target and the logsumexp each
    assert err_rounded < 50 * torch.finfo(dtype).eps + 1e-4


def test_bias_and_masked_vocab(seed):
    """A bias, with a -inf block covering whole tiles (a split whose rows are all -inf for a while)."""
    hidden, weight, targets = _inputs(seed, N, H, V, torch.float32, max_logit=20.0)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    bias[: 3 * LOGPROBS_TILES["BLOCK_V"] + 5] = float("-inf")
    targets[3] = 7  # a masked token: -inf
    out = token_logprobs(hidden, weight, targets, bias, out=_poisoned(N), v_splits=4)
    ref = token_logprobs_ref(hidden, weight, targets, bias)
    assert out[0] == out[3] == float("-inf")  # target 0 and 7 sit in the masked block
    live = torch.isfinite(ref)
    assert torch.equal(live, torch.isfinite(out))
    assert (out[live] - ref[live]).abs().max().item() < 1e-4


def test_strided_inputs_and_int32_targets(seed):
    hidden, weight, targets = _inputs(seed, 2 * N, H, V, torch.float32)
    hidden = hidden[::2]  # row stride 2H
    weight = weight.T.contiguous().T  # [V, H] with strides (1, V)
    out = token_logprobs(hidden, weight, targets[::2].to(torch.int32).contiguous(), out=_poisoned(N))
    ref = token_logprobs_ref(hidden, weight, targets[::2])
    assert (out - ref).abs().max().item() < 1e-4


def test_small_and_empty(seed):
    hidden, weight, targets = _inputs(seed, 1, H, V, torch.float32)
    assert (token_logprobs(hidden, weight, targets) - token_logprobs_ref(hidden, weight, targets)).abs().max() < 1e-4
    assert token_logprobs(hidden[:0], weight, targets[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_real_shapes(seed):
    """Qwen3-30B-A3B lm_head shapes; logits with std ~3; half the targets are the row argmax."""
    n, h, v = 1024, 2048, 151936
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (3 / h**0.5)).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[0], targets[1] = 0, v - 1
    out = token_logprobs(hidden, weight, targets, out=torch.full((n,), float("nan"), device="cuda"))
    assert torch.isfinite(out).all()

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        logits32 = hidden.float() @ weight.float().T  # [n, v] fp32, the same bf16 inputs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    targets[::2] = logits32[::2].argmax(1)
    out = token_logprobs(hidden, weight, targets)
    exact = torch.log_softmax(logits32, -1).gather(1, targets[:, None])[:, 0]
    rounded = token_logprobs_ref(hidden, weight, targets)
    err_exact = (out - exact).abs().max().item()
    err_rounded = (out - rounded).abs().max().item()
    print(f"bf16 {n}x{h}x{v}: max|logit| {logits32.abs().max().item():.1f}; max|err| vs fp32 {err_exact:.2e}, "
          f"vs bf16-rounded reference {err_rounded:.2e} (reference vs fp32 {(rounded - exact).abs().max().item():.2e})")
    assert err_exact < 2e-2
    assert err_exact <= err_rounded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_no_host_sync(seed):
    hidden, weight, targets = _inputs(seed, 300, 256, 5000, torch.bfloat16)
    token_logprobs(hidden, weight, targets)  # compile outside the check
    out = torch.empty(300, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_logprobs(hidden, weight, targets, out=out)
        token_logprobs(hidden, weight, targets)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_replay_equals_eager(seed):
    n, h, v = 300, 256, 5000
    hidden, weight, targets = _inputs(seed, n, h, v, torch.bfloat16)
    out = torch.full((n,), float("nan"), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        token_logprobs(hidden, weight, targets, out=out)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token_logprobs(hidden, weight, targets, out=out)

    new_hidden, _, new_targets = _inputs(seed + 1, n, h, v, torch.bfloat16)
    hidden.copy_(new_hidden)
    targets.copy_(new_targets)
    out.fill_(float("nan"))
    graph.replay()
    eager = token_logprobs(hidden, weight, targets)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_temperature_per_row(seed, dtype):
    """Each row's logits divided by its own temperature (fp32, after the bias): against the reference, and not the
    untempered result (the temperature is used)."""
    hidden, weight, targets = _inputs(seed, N, H, V, dtype, max_logit=20.0)
    g = torch.Generator().manual_seed(seed + 2)
    bias = torch.randn(V, generator=g).to(DEVICE, dtype)
    temperature = (0.3 + 1.2 * torch.rand(N, generator=g)).to(DEVICE)  # [N] in [0.3, 1.5]
    out = token_logprobs(hidden, weight, targets, bias, temperature=temperature, out=_poisoned(N), v_splits=3)
    ref = token_logprobs_ref(hidden.float(), weight.float(), targets, bias.float(), temperature)
    assert (out - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 1e-3)
    plain = token_logprobs(hidden, weight, targets, bias)
    assert (out - plain).abs().max().item() > 0.1
    ones = token_logprobs(hidden, weight, targets, bias, temperature=torch.ones(N, device=DEVICE))
    assert torch.equal(ones, plain)  # dividing by 1 changes no bit
