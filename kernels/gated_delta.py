"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3.6 MoE, Qwen3-Next): the short causal convolution + SiLU over the
concatenated q, k, v channels, and the chunked gated delta rule, each with its plain-torch reference.

Layout: the padded [B, L] batch (no cu_seqlens): each row is its own sequence, started from its own state (zeros
when none is given). A shared prefix is carried as the states at its end: the recurrent state [B, Hv, K, V] float32
and the conv state [B, W-1, C] (the last W-1 inputs), so that running [:n] then [n:] from those states equals the
whole run: the convolution and the states bit for bit, the delta rule to float32 rounding (its chunks fall
elsewhere).

Backends (measured on an H200, bf16, 1 x 4,096 tokens at Qwen3.5-35B-A3B / Qwen3-Next-80B widths: 16 query/key
heads, 32 value heads, K = V = 128, 8,192 conv channels, W = 4; BENCHMARKS-history section 20):
- CPU, and CUDA without fla: the references, float32 inside. `gated_delta_rule_ref` is the chunked algorithm
  (64-token chunks) of transformers' `torch_chunk_gated_delta_rule` and equals it bit for bit in float32;
  `causal_conv1d_ref` is transformers' `causal_conv1d_fn` torch path: the convolution bit for bit, the SiLU too
  except in transformers' own scalar tail (its docstring).
- CUDA, the delta rule: flash-linear-attention (fla-core 0.6.0, the optional extra `gpu`), its Triton
  `chunk_gated_delta_rule`: 0.709 ms eager, 0.268 ms replayed from a CUDA graph, against 9.81 / 4.88 ms for the
  torch reference, which runs its chunks one after another (a state read, a state update and their small matmuls
  per 64 tokens, after two batched triangular solves). Issue 44's 0.69 ms for transformers' torch path (same
  algorithm as the reference) did not reproduce. fla in bf16 is within 6e-3 of the float32 reference (max |d| over
  max |ref|), gives a row the same bits alone or in a batch, and replays from a graph bit for bit.
- CUDA, the convolution: fla's Triton causal conv1d (float32 sums, SiLU fused, one rounding, on the [B, L, C]
  layout as it comes): 0.196 ms eager, 0.058 ms replayed, against 0.891 / 0.871 ms for F.conv1d, which needs
  [B, C, L] and back and a separate SiLU.
fla is imported on first use, so this module imports without it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 64  # the chunk length of transformers' torch path (and fla's)


@functools.cache
def _fla():
    """(chunk_gated_delta_rule, causal_conv1d) from fla-core, or None where it is not installed (the CPU install)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, causal_conv1d


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim (fla's and transformers' form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, output_final_state=False):
    """q, k [B, L, Hk, K]; v [B, L, Hv, V] (Hv a multiple of Hk: query/key head j serves value heads
    j*Hv/Hk .. (j+1)*Hv/Hk-1, i.e. repeat_interleave); g (log decay, <= 0) and beta [B, L, Hv] (any float dtype);
    initial_state [B, Hv, K, V] float32 or None (zeros).
    q and k are L2-normalised over K inside (x * rsqrt(sum(x*x) + 1e-6)) and q scaled by K**-0.5, all in float32.
    -> (out [B, L, Hv, V] in q's dtype, final state [B, Hv, K, V] float32, or None unless output_final_state).

    Per step t: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t. Computed per 64-token chunk:
    the chunk's updates solved at once through the unit lower-triangular system (I + tril(beta k k^T decay, -1)),
    then one state read and one state update per chunk."""
    dtype = q.dtype
    B, L, Hk, K = k.shape
    Hv, V = v.shape[-2:]
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=2)  # [B, L, Hv, K]
        k = k.repeat_interleave(Hv // Hk, dim=2)  # [B, L, Hv, K]
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))  # [B, Hv, L, K|V], beta and g [B, Hv, L]
    q = _l2norm(q)
    k = _l2norm(k)
    q = q * K ** -0.5

    pad = (CHUNK - L % CHUNK) % CHUNK  # zero rows after the end: g = 0, beta = 0 leave the state as it is
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [B, Hv, Lp, K|V]
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))  # [B, Hv, Lp]
    n = (L + pad) // CHUNK
    vb = v * beta.unsqueeze(-1)  # [B, Hv, Lp, V]
    kb = k * beta.unsqueeze(-1)  # [B, Hv, Lp, K]
    q, k, kb, vb = (t.reshape(B, Hv, n, CHUNK, t.shape[-1]) for t in (q, k, kb, vb))  # [B, Hv, n, C, K|V]
    gc = g.reshape(B, Hv, n, CHUNK).cumsum(dim=3)  # [B, Hv, n, C]: log decay from the chunk's start through t

    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)  # [C, C]: j > i, the future
    decay = gc.unsqueeze(4) - gc.unsqueeze(3)  # [B, Hv, n, C, C]: log decay from j to i
    decay = decay.masked_fill(above, float("-inf")).exp()  # 0 above the diagonal (and no overflow there)
    system = (kb @ k.transpose(-1, -2)) * decay  # [B, Hv, n, C, C]: its strict lower part is the system's
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, Hv, n, C, C]: causal, the diagonal included
    kb_decayed = kb * gc.exp().unsqueeze(-1)  # [B, Hv, n, C, K]
    # unitriangular: the diagonal (beta k.k) and everything above it are ignored, as the system wants
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # [B, Hv, n, C, V]
    w = torch.linalg.solve_triangular(system, kb_decayed, upper=False, unitriangular=True)  # [B, Hv, n, C, K]

    if initial_state is None:
        state = torch.zeros(B, Hv, K, V, dtype=u.dtype, device=u.device)  # [B, Hv, K, V]
    else:
        state = initial_state.to(u)  # [B, Hv, K, V]
    out = torch.zeros_like(u)  # [B, Hv, n, C, V]
    q_decayed = q * gc.exp().unsqueeze(-1)  # [B, Hv, n, C, K]: reads the state as it was at the chunk's start
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)  # [B, Hv, n, C, K]: decayed to the chunk's end
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [B, Hv, n, 1, 1]
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state  # [B, Hv, C, V]: what the state does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ v_new  # [B, Hv, C, V]
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new  # [B, Hv, K, V]

    out = out.reshape(B, Hv, -1, V)[:, :, :L]  # [B, Hv, L, V]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)  # [B, L, Hv, V]
    return out, (state if output_final_state else None)


def gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False):
    """Same contract as gated_delta_rule_ref; on CUDA through flash-linear-attention's chunk_gated_delta_rule
    (use_qk_l2norm_in_kernel, [B, L, H, D] layout) when it is importable, else gated_delta_rule_ref.
    The padded [B, L] layout (no cu_seqlens): each row is its own sequence."""
    fla = _fla() if q.is_cuda else None
    if fla is None:
        return gated_delta_rule_ref(q, k, v, g, beta, initial_state, output_final_state)
    out, state = fla[0](q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
    return out, state  # [B, L, Hv, V] in q's dtype, [B, Hv, K, V] float32 or None


def _conv_state_after(x: torch.Tensor, state: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last width-1 inputs of state ++ x: [B, W-1, C] in x's dtype, a copy (never a view of x, whose buffer a
    caller may reuse while it keeps the state)."""
    B, L, C = x.shape
    if L >= width - 1:
        return x[:, L - (width - 1):].to(x.dtype, memory_format=torch.contiguous_format, copy=True)
    before = x.new_zeros(B, width - 1, C) if state is None else state.to(x.dtype)  # [B, W-1, C]
    return torch.cat([before[:, L:], x], dim=1)  # [B, W-1, C]


def causal_conv1d_ref(x, weight, state=None):
    """Depthwise causal convolution + SiLU, as transformers' Qwen3-Next `causal_conv1d_fn` (activation silu) computes
    it: x [B, L, C], weight [C, W] (the checkpoint's conv1d.weight [C, 1, W] squeezed), state [B, W-1, C] or None
    (the W-1 inputs before position 0; zeros when None) -> (y [B, L, C] in x's dtype, new state [B, W-1, C]: the
    last W-1 inputs of state ++ x, in x's dtype). Computed in weight's dtype, as transformers does.

    The convolution is transformers' call, bit for bit. The SiLU runs on the contiguous [B, L, C] output: torch's CPU
    SiLU rounds differently (1-2 ulp) in its vectorised body and its scalar tail, so on transformers' [B, C, L] slice
    a value's bits depend on its place in the row (the last L mod 32 positions on AVX-512), and a sequence continued
    from a state would differ from the whole run there. Over [B, L, C] with C a multiple of 32 (every published
    width) no element falls in a tail: a position's bits do not depend on where the run started, and equal
    transformers' wherever its own SiLU took the vectorised path."""
    B, L, C = x.shape
    W = weight.shape[1]
    xt = x.transpose(1, 2).to(weight.dtype)  # [B, C, L]
    if state is None:  # transformers' call: zeros on both sides, the right-hand outputs dropped
        y = F.conv1d(xt, weight.unsqueeze(1), padding=W - 1, groups=C)[:, :, :L]  # [B, C, L]
    else:
        xt = torch.cat([state.transpose(1, 2).to(weight.dtype), xt], dim=2)  # [B, C, W-1+L]
        y = F.conv1d(xt, weight.unsqueeze(1), groups=C)  # [B, C, L]
    y = F.silu(y.transpose(1, 2).contiguous()).to(x.dtype)  # [B, L, C]
    return y, _conv_state_after(x, state, W)


def causal_conv1d_fla(x, weight, state=None):
    """causal_conv1d_ref's contract through fla's Triton causal_conv1d (float32 inside, one rounding at the end).
    fla keeps a state of W inputs [B, C, W] whose first column the convolution never reads: ours goes in its last
    W-1 columns."""
    B, L, C = x.shape
    W = weight.shape[1]
    initial = None
    if state is not None:
        initial = torch.cat([state.new_zeros(B, 1, C), state.to(x.dtype)], dim=1)  # [B, W, C]
        initial = initial.transpose(1, 2).contiguous()  # [B, C, W]
    y, _ = _fla()[1](x, weight, initial_state=initial, activation="silu")  # [B, L, C]
    return y, _conv_state_after(x, state, W)


def causal_conv1d(x, weight, state=None):
    """Same contract as causal_conv1d_ref; on CUDA through fla's Triton convolution (4.5x F.conv1d's speed eager,
    15x replayed: the module's docstring) when it is importable, else the ref."""
    if x.is_cuda and _fla() is not None:
        return causal_conv1d_fla(x, weight, state)
    return causal_conv1d_ref(x, weight, state)
