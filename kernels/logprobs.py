"""Fused lm_head + log_softmax + gather: per-token logprobs without the [N, V] logits.

  logprobs[i] = log_softmax((hidden[i] @ weight^T (+ bias)) / temperature[i])[targets[i]]

Shapes: hidden [N, H] and weight [V, H] (bf16 / fp16 / fp32, one dtype), bias [V] or None (same dtype),
targets [N] int64 (or int32), temperature [N] float32 or None (1) -> logprobs [N] float32.
The temperature scales the fp32 logits inside the kernel (by its reciprocal, one per row): a sampler's logprobs at
T != 1 are those of the tempered distribution (the sampler samples from it and RL trainers score at it), and scaling
the hidden states instead would round them to the input dtype and also scale a bias the wrong way.

Kernel 1 (`_partial_kernel`), grid (cdiv(N, BLOCK_N), V_SPLITS): each program owns BLOCK_N rows and
TILES consecutive BLOCK_V tiles of V; per tile it computes the logits with tl.dot (fp32 accumulation over
BLOCK_H steps of H) and keeps per row an online (max, sum of exp) plus the target's logit if the target
falls in its range (else -inf). It writes these to fp32 scratch [V_SPLITS, N]. hidden and weight load
through TMA descriptors where they allow it (kernels/tma.py), else through pointers.
Kernel 2 (`_combine_kernel`), grid (cdiv(N, COMBINE_BLOCK),): merges the V_SPLITS partials per row.
V_SPLITS is chosen on the host from shapes only; no host sync, so the op can be captured in a CUDA graph.
H, TILES and V_SPLITS are compile-time constants (loop bounds; TILES is a power of two unless `v_splits`
is forced), so a model compiles a handful of variants, one per TILES.

Precision: the kernel keeps the logits in fp32 (never rounded to the input dtype), whereas the torch
reference `token_logprobs_ref` rounds `hidden @ weight.T` to the input dtype before the softmax, as a
plain bf16 model does. For bf16 / fp16 inputs the kernel is therefore closer to the fp32 computation on
the same inputs than the reference is. fp32 inputs use FP32_DOT (tf32x3: about fp32 accuracy, not TF32's).
A target outside [0, V) gives -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .tiles import LOGPROBS_TILES
from .tma import tma_ready

FP32_DOT = "tf32x3"  # fp32 inputs: 3 TF32 tensor-core products, about fp32 accuracy ("ieee" is ~10x slower)


@triton.jit(do_not_specialize=["N"])
def _partial_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr, temp_ptr,  # [N, H], [V, H], [V] (or dummy), [N], [N] fp32 (or dummy)
    m_ptr, l_ptr, t_ptr,  # fp32 scratch [V_SPLITS, N]: running max, sum of exp(logit - max), target logit
    N, V,
    stride_hn, stride_hh, stride_wv, stride_wh,
    H: tl.constexpr, TILES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr,  # TILES: per split
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,  # TMA: h_ptr and w_ptr are tensor descriptors
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Online (max, sum-exp, target logit) over one V range for BLOCK_N rows."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)
    tgt = tl.load(tgt_ptr + rows_safe, mask=row_ok, other=-1).to(tl.int64)  # [BN]
    if HAS_TEMP:  # one reciprocal per row: a division per logit cost 12% of a forward (BENCHMARKS-history 23)
        inv_temp = 1.0 / tl.load(temp_ptr + rows_safe, mask=row_ok, other=1.0)  # [BN]
    offs_h = tl.arange(0, BLOCK_H)  # [BH]
    offs_v = tl.arange(0, BLOCK_V)  # [BV]

    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    t = tl.full([BLOCK_N], float("-inf"), tl.float32)

    v_begin = pid_s * (TILES * BLOCK_V)
    for j in range(TILES):  # tiles past V (last split only) come out all -inf
        cols = v_begin + j * BLOCK_V + offs_v  # [BV]
        col_ok = cols < V
        cols_safe = tl.where(col_ok, cols, 0).to(tl.int64)  # row 0 stands in past V
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            if TMA:  # rows past N, columns past V and features past H read as zeros
                a = h_ptr.load([pid_n * BLOCK_N, h0])  # [BN, BH]
                b = w_ptr.load([v_begin + j * BLOCK_V, h0]).T  # [BH, BV]
            else:
                hh = h0 + offs_h  # [BH]
                h_ok = hh < H
                a = tl.load(h_ptr + rows_safe[:, None] * stride_hn + hh[None, :] * stride_hh,
                            mask=h_ok[None, :], other=0.0)  # [BN, BH]
                b = tl.load(w_ptr + cols_safe[None, :] * stride_wv + hh[:, None] * stride_wh,
                            mask=h_ok[:, None], other=0.0)  # [BH, BV]
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols_safe).to(tl.float32)[None, :]
        if HAS_TEMP:
            acc = acc * inv_temp[:, None]
        logits = tl.where(col_ok[None, :], acc, float("-inf"))  # [BN, BV]
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf when a row is all -inf
        l = l * tl.exp(m - m_ref) + tl.sum(tl.exp(logits - m_ref[:, None]), axis=1)
        m = m_new
        hit = cols[None, :] == tgt[:, None]
        t = tl.maximum(t, tl.max(tl.where(hit, logits, float("-inf")), axis=1))

    out = pid_s.to(tl.int64) * N + rows_safe
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(l_ptr + out, l, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(m_ptr, l_ptr, t_ptr, out_ptr, N, V_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = max_s t[s, i] - logsumexp over splits of (m[s, i], l[s, i])."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    t = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(V_SPLITS):
        off = s * N + rows
        ms = tl.load(m_ptr + off, mask=ok, other=0.0)  # rows past N: finite filler, never stored
        ls = tl.load(l_ptr + off, mask=ok, other=1.0)
        t = tl.maximum(t, tl.load(t_ptr + off, mask=ok, other=0.0))
        m_new = tl.maximum(m, ms)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_ref) + ls * tl.exp(ms - m_ref)
        m = m_new
    tl.store(out_ptr + rows, t - m - tl.log(l), mask=ok)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: programs run one after another, fewer is faster


def split_vocab(n: int, v: int, device: torch.device, v_splits: int | None = None, *,
                block_n: int = LOGPROBS_TILES["BLOCK_N"], block_v: int = LOGPROBS_TILES["BLOCK_V"]) -> tuple[int, int]:
    """(V_SPLITS, TILES). TILES, a power of two (bounding recompiles), minimises waves * (TILES + 1): whole
    waves of one program per SM, each program paying its tiles plus about one tile of fixed cost.
    `v_splits` forces the split count instead."""
    tiles = triton.cdiv(v, block_v)
    if v_splits is not None:
        per_split = triton.cdiv(tiles, min(v_splits, tiles))
        return triton.cdiv(tiles, per_split), per_split
    sms, row_blocks = _num_sms(device), triton.cdiv(n, block_n)
    best = None
    for per_split in (1 << k for k in range(tiles.bit_length())):
        splits = triton.cdiv(tiles, per_split)
        cost = triton.cdiv(row_blocks * splits, sms) * (per_split + 1)
        if best is None or cost <= best[0]:  # ties go to fewer, longer programs
            best = (cost, splits, per_split)
    return best[1], best[2]


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   bias: torch.Tensor | None = None, *, temperature: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, v_splits: int | None = None, tiles: dict | None = None
                   ) -> torch.Tensor:
    """float32 [N] log_softmax((hidden @ weight.T + bias) / temperature)[targets], fp32 logits, no [N, V] tensor.

    `temperature`: float32 [N], one per row (None: 1); `out` (float32 [N]) is written in place if given;
    `v_splits` overrides the host-side choice; `tiles`: launch settings over LOGPROBS_TILES (kernels/tiles.py).
    """
    t = {**LOGPROBS_TILES, **(tiles or {})}
    N, H = hidden.shape
    V = weight.shape[0]
    assert weight.shape == (V, H), f"weight {tuple(weight.shape)} does not match hidden {tuple(hidden.shape)}"
    assert hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert targets.shape == (N,) and targets.dtype in (torch.int64, torch.int32)
    if bias is not None:
        assert bias.shape == (V,) and bias.dtype == hidden.dtype
        bias = bias.contiguous()
    if temperature is not None:
        assert temperature.shape == (N,) and temperature.dtype == torch.float32
        temperature = temperature.contiguous()
    targets = targets.contiguous()
    if out is None:
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    assert out.shape == (N,) and out.dtype == torch.float32 and out.is_contiguous()
    if N == 0:
        return out

    splits, v_tiles = split_vocab(N, V, hidden.device, v_splits, block_n=t["BLOCK_N"], block_v=t["BLOCK_V"])
    scratch = torch.empty(3, splits, N, dtype=torch.float32, device=hidden.device)  # m, l, t
    stages = t["NUM_STAGES_FP32"] if hidden.dtype == torch.float32 else t["NUM_STAGES"]
    tma = t["TMA"] and tma_ready(hidden) and tma_ready(weight)
    h_arg = TensorDescriptor.from_tensor(hidden, [t["BLOCK_N"], t["BLOCK_H"]]) if tma else hidden
    w_arg = TensorDescriptor.from_tensor(weight, [t["BLOCK_V"], t["BLOCK_H"]]) if tma else weight
    _partial_kernel[(triton.cdiv(N, t["BLOCK_N"]), splits)](
        h_arg, w_arg, bias if bias is not None else hidden, targets,
        temperature if temperature is not None else scratch[0],
        scratch[0], scratch[1], scratch[2],
        N, V,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        H=H, TILES=v_tiles, HAS_BIAS=bias is not None, HAS_TEMP=temperature is not None,
        DOT_PRECISION=FP32_DOT if hidden.dtype == torch.float32 else "ieee",  # ignored for 2-byte inputs
        TMA=tma, BLOCK_N=t["BLOCK_N"], BLOCK_V=t["BLOCK_V"], BLOCK_H=t["BLOCK_H"],
        num_warps=t["NUM_WARPS"], num_stages=stages,
    )
    _combine_kernel[(triton.cdiv(N, t["COMBINE_BLOCK"]),)](
        scratch[0], scratch[1], scratch[2], out, N, V_SPLITS=splits, BLOCK=t["COMBINE_BLOCK"],
    )
    return out


def token_logprobs_ref(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       bias: torch.Tensor | None = None, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch; the logits are rounded to the input dtype before the fp32 softmax (as a bf16 model), then
    divided by the row's temperature (float32 [N], None: 1)."""
    logits = hidden @ weight.T  # [N, V], input dtype
    if bias is not None:
        logits = logits + bias
    logits = logits.float() if temperature is None else logits.float() / temperature[:, None]  # [N, V]
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
