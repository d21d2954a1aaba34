"""The Gated DeltaNet ops (kernels/gated_delta.py): the references against transformers' Qwen3-Next torch functions
(the oracle: `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`), a sequence
split anywhere and continued from its states against the whole run (how shared prefixes are reused); on the GPU,
flash-linear-attention's kernels in bf16 at the published widths against the references in float32, a row against
itself alone, and the whole op (conv + gated delta) replayed from a CUDA graph against eager."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from lora_eval.kernels.gated_delta import (_fla, causal_conv1d, causal_conv1d_fla, causal_conv1d_ref,
                                           gated_delta_rule, gated_delta_rule_ref)

def _hf(name):
    """transformers' torch function itself (unwrapped: with fla installed, transformers routes the name to fla)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    return inspect.unwrap(getattr(modeling_qwen3_next, name))


def _inputs(gen, B, L, Hk, Hv, K, V, dtype=torch.float32, device="cpu"):
    """q, k [B, L, Hk, K], v [B, L, Hv, V] in dtype; g [B, L, Hv] float32 as the model makes it
    (-exp(A_log) softplus(a + dt_bias), A log-uniform over 1e-3 .. 16: heads that forget within a few tokens and heads
    that remember thousands); beta = sigmoid(b) [B, L, Hv] in dtype."""
    draw = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = draw(B, L, Hk, K), draw(B, L, Hk, K), draw(B, L, Hv, V)
    A = torch.exp(torch.empty(Hv).uniform_(math.log(1e-3), math.log(16), generator=gen))  # [Hv]
    g = -A * F.softplus(draw(B, L, Hv) + 0.5 * draw(Hv))  # [B, L, Hv]
    beta = torch.sigmoid(draw(B, L, Hv))  # [B, L, Hv]
    return [t.to(device, dtype) for t in (q, k, v)] + [g.to(device), beta.to(device, dtype)]


def _state(gen, B, Hv, K, V, device="cpu"):
    return (0.3 * torch.randn(B, Hv, K, V, generator=gen)).to(device)  # [B, Hv, K, V] float32


def _rel(out, ref):
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("B,L,Hk,Hv,K,V", [(2, 130, 2, 4, 32, 24), (2, 1, 2, 4, 32, 24), (1, 128, 3, 3, 16, 16)],
                         ids=["gva-ragged", "one-token", "two-chunks"])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zeros"])
def test_reference_equals_transformers(seed, B, L, Hk, Hv, K, V, with_state):
    """Bit for bit against transformers' chunked torch path in float32 (Hv = 2 Hk: repeat_interleave heads; L not a
    multiple of 64; L = 1), output and final state; and within float32 rounding of its per-token recurrence."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, B, L, Hk, Hv, K, V)
    h0 = _state(gen, B, Hv, K, V) if with_state else None
    out, state = gated_delta_rule_ref(q, k, v, g, beta, h0, output_final_state=True)
    assert out.shape == (B, L, Hv, V) and out.dtype == q.dtype and state.shape == (B, Hv, K, V)
    assert state.dtype == torch.float32
    hf_out, hf_state = _hf("torch_chunk_gated_delta_rule")(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, hf_out) and torch.equal(state, hf_state)
    rec_out, rec_state = _hf("torch_recurrent_gated_delta_rule")(q, k, v, g, beta, initial_state=h0,
                                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _rel(out, rec_out) < 1e-5 and _rel(state, rec_state) < 1e-5
    assert gated_delta_rule_ref(q, k, v, g, beta, h0)[1] is None  # no final state unless asked
    if with_state:  # the initial state is read
        assert _rel(gated_delta_rule_ref(q, k, v, g, beta)[0], out) > 1e-2


@pytest.mark.parametrize("n", [1, 37, 64, 100, 149])
def test_reference_split_equals_whole(seed, n):
    """[:n] with its final state, then [n:] from it, equals the whole run (float32 rounding: the chunks fall
    elsewhere); so does the final state."""
    gen = torch.Generator().manual_seed(seed)
    B, L, Hk, Hv, K, V = 2, 150, 2, 4, 32, 24
    q, k, v, g, beta = _inputs(gen, B, L, Hk, Hv, K, V)
    h0 = _state(gen, B, Hv, K, V)
    whole, whole_state = gated_delta_rule_ref(q, k, v, g, beta, h0, output_final_state=True)
    first, mid = gated_delta_rule_ref(*(t[:, :n] for t in (q, k, v, g, beta)), h0, output_final_state=True)
    second, end = gated_delta_rule_ref(*(t[:, n:] for t in (q, k, v, g, beta)), mid, output_final_state=True)
    # float32 rounding: at most 6e-6 over 150 seeds x these 5 splits
    assert _rel(torch.cat([first, second], dim=1), whole) < 3e-5
    assert _rel(end, whole_state) < 3e-5


def _within_silu_rounding(a, b):
    """Equal up to torch's CPU SiLU, which rounds differently in its vectorised loop and its scalar tail (1-2 ulp of
    a's dtype; up to 2.2e-7 relative in float32 over 200 seeds)."""
    return torch.allclose(a.float(), b.float(), rtol=4 * torch.finfo(a.dtype).eps, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [64, 37])
def test_conv_reference_equals_transformers(seed, dtype, L):
    """Against transformers' causal_conv1d_fn (torch path, silu) on [B, C, L]: bit for bit where its SiLU runs
    vectorised (every position when L is a multiple of 32; the first 32 of 37), within SiLU's rounding in its scalar
    tail (the rest); the new state is the last W-1 inputs."""
    gen = torch.Generator().manual_seed(seed)
    B, C, W = 2, 32, 4
    x = torch.randn(B, L, C, generator=gen).to(dtype)  # [B, L, C]
    weight = (0.5 * torch.randn(C, W, generator=gen)).to(dtype)  # [C, W]
    y, state = causal_conv1d_ref(x, weight)
    hf = _hf("causal_conv1d_fn")(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)  # [B, L, C]
    assert y.dtype == dtype and torch.equal(y[:, :32], hf[:, :32])
    assert torch.equal(y, hf) if L % 32 == 0 else _within_silu_rounding(y, hf)
    assert torch.equal(state, x[:, -(W - 1):])
    assert torch.equal(causal_conv1d(x, weight)[0], y)  # the CPU dispatch is the reference


@pytest.mark.parametrize("n", [1, 2, 3, 6, 30, 35, 36])
def test_conv_split_equals_whole(seed, n):
    """[:n] from a prefix's state, then [n:] from the state it returns, equals the whole sequence run from zeros
    (transformers' call) bit for bit, output and states; also where a part is shorter than the state (W-1 = 3), and
    zeros as the state equal no state."""
    gen = torch.Generator().manual_seed(seed)
    B, L, C, W = 2, 37, 32, 4
    x, weight = torch.randn(B, L, C, generator=gen), 0.5 * torch.randn(C, W, generator=gen)
    before = torch.randn(B, W - 1, C, generator=gen)  # a prefix's state: its last W-1 inputs
    whole, whole_state = causal_conv1d_ref(torch.cat([before, x], dim=1), weight)
    first, mid = causal_conv1d_ref(x[:, :n], weight, before)
    second, end = causal_conv1d_ref(x[:, n:], weight, mid)
    assert torch.equal(torch.cat([first, second], dim=1), whole[:, W - 1:])
    assert torch.equal(end, whole_state) and torch.equal(mid, torch.cat([before, x], dim=1)[:, n:n + W - 1])
    assert torch.equal(causal_conv1d_ref(x, weight, torch.zeros(B, W - 1, C))[0], causal_conv1d_ref(x, weight)[0])


# ---- GPU: flash-linear-attention at the published widths (Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B: 16 query/key
# heads, 32 value heads, K = V = 128, conv over 2*16*128 + 32*128 = 8192 channels, W = 4; Qwen3.5-122B/397B: 64
# value heads) ----

HK, HV, D, W = 16, 32, 128, 4
C = 2 * HK * D + HV * D
SIZES = [(1, 4096), (4, 1024), (8, 300)]
needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or _fla() is None, reason="needs CUDA and fla-core")


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("B,L", SIZES, ids=[f"{b}x{n}" for b, n in SIZES])
@pytest.mark.parametrize("hv", [HV, 2 * HV], ids=["hv32", "hv64"])
def test_fla_matches_reference_bf16(seed, B, L, hv):
    """fla in bf16 against the reference in float32 on the same inputs, from a random initial state: output and final
    state within bf16 rounding (max |d| over max |ref|)."""
    if hv != HV and B != 4:
        pytest.skip("the 64-value-head width at one size")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, B, L, HK, hv, D, D, torch.bfloat16, "cuda")
    h0 = _state(gen, B, hv, D, D, "cuda")
    out, state = gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True)
    ref, ref_state = gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), h0, output_final_state=True)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and state.dtype == torch.float32
    errs = _rel(out, ref), _rel(state, ref_state)
    print(f"fla bf16 vs float32 reference: output {errs[0]:.2e}, final state {errs[1]:.2e} (max |ref| "
          f"{ref.abs().max().item():.3g})")
    assert errs[0] < 2e-2 and errs[1] < 2e-2


@pytest.mark.gpu
@needs_fla
def test_fla_split_equals_whole_bf16(seed):
    """The prefix path on the GPU: [:n] then [n:] from its state against the whole run, both through fla, within
    bf16 rounding."""
    gen = torch.Generator().manual_seed(seed)
    B, L, n = 2, 1500, 1000
    q, k, v, g, beta = _inputs(gen, B, L, HK, HV, D, D, torch.bfloat16, "cuda")
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    first, mid = gated_delta_rule(*(t[:, :n] for t in (q, k, v, g, beta)), output_final_state=True)
    second, end = gated_delta_rule(*(t[:, n:] for t in (q, k, v, g, beta)), mid, output_final_state=True)
    errs = _rel(torch.cat([first, second], dim=1), whole), _rel(end, whole_state)
    print(f"split at {n} vs whole (fla, bf16): output {errs[0]:.2e}, final state {errs[1]:.2e}")
    assert errs[0] < 2e-2 and errs[1] < 2e-2


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("B,L", SIZES, ids=[f"{b}x{n}" for b, n in SIZES])
def test_fla_conv_matches_reference_bf16(seed, B, L):
    """fla's convolution in bf16 against the reference in float32 on the same inputs: within one bf16 rounding (fla
    sums in float32 and rounds once); with a state, the continuation equals the whole run bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, C, generator=gen).to("cuda", torch.bfloat16)  # [B, L, C]
    weight = (0.5 * torch.randn(C, W, generator=gen)).to("cuda", torch.bfloat16)  # [C, W]
    y, state = causal_conv1d(x, weight)
    ref, ref_state = causal_conv1d_ref(x.float(), weight.float())
    err = ((y.float() - ref).abs() - ref.abs() * 2 ** -8).max().item()
    print(f"fla conv bf16 vs float32 reference: max |d| {(y.float() - ref).abs().max().item():.3g}")
    assert err <= 1e-6 and torch.equal(state.float(), ref_state)
    n = L // 3
    first, mid = causal_conv1d(x[:, :n], weight)
    second, end = causal_conv1d(x[:, n:], weight, mid)
    assert torch.equal(torch.cat([first, second], dim=1), y) and torch.equal(end, state)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("B,L", SIZES[1:], ids=[f"{b}x{n}" for b, n in SIZES[1:]])
def test_fla_row_alone_equals_row_in_batch(seed, B, L):
    """A row's result does not depend on its neighbours: each row of the batch run alone, from its own initial state,
    gives the same bits (output and final state; the convolution too)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _inputs(gen, B, L, HK, HV, D, D, torch.bfloat16, "cuda")
    h0 = _state(gen, B, HV, D, D, "cuda")
    x = torch.randn(B, L, C, generator=gen).to("cuda", torch.bfloat16)
    weight = (0.5 * torch.randn(C, W, generator=gen)).to("cuda", torch.bfloat16)
    out, state = gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True)
    y, _ = causal_conv1d_fla(x, weight)
    worst = []
    for b in range(B):
        one, one_state = gated_delta_rule(*(t[b:b + 1] for t in (q, k, v, g, beta, h0)), output_final_state=True)
        worst.append(max((one.float() - out[b:b + 1].float()).abs().max().item(),
                         (one_state - state[b:b + 1]).abs().max().item()))
        assert torch.equal(causal_conv1d_fla(x[b:b + 1], weight)[0], y[b:b + 1])
    print(f"row alone vs in a batch of {B}: max |d| per row {worst}")
    assert max(worst) == 0.0


def _layer_op(x, weight, conv_state, g, beta, h0):
    """The linear layer's core as the model runs it: conv + SiLU over q|k|v, then the gated delta rule."""
    B, L, _ = x.shape
    y, new_conv = causal_conv1d(x, weight, conv_state)  # [B, L, C]
    q, k, v = y.split([HK * D, HK * D, HV * D], dim=-1)
    q, k, v = q.reshape(B, L, HK, D), k.reshape(B, L, HK, D), v.reshape(B, L, HV, D)
    out, state = gated_delta_rule(q, k, v, g, beta, h0, output_final_state=True)
    return out, state, new_conv


@pytest.mark.gpu
@needs_fla
def test_graph_replay_equals_eager(seed):
    """conv + gated delta captured in a CUDA graph (after warm-up: Triton's autotuning before the capture) and
    replayed on new inputs copied into its buffers equals eager on those inputs, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    B, L = 2, 300

    def draw():
        x = torch.randn(B, L, C, generator=gen).to("cuda", torch.bfloat16)
        _, _, _, g, beta = _inputs(gen, B, L, HK, HV, D, D, torch.bfloat16, "cuda")
        conv_state = torch.randn(B, W - 1, C, generator=gen).to("cuda", torch.bfloat16)
        return [x, conv_state, g, beta, _state(gen, B, HV, D, D, "cuda")]

    weight = (0.5 * torch.randn(C, W, generator=gen)).to("cuda", torch.bfloat16)
    static = draw()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _layer_op(static[0], weight, *static[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer_op(static[0], weight, *static[1:])
    replayed = []
    for _ in range(2):
        fresh = draw()
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        graph.replay()
        eager = _layer_op(fresh[0], weight, *fresh[1:])
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))
        replayed.append(outs[0].clone())
    assert not torch.equal(*replayed)  # the replays read the new inputs
