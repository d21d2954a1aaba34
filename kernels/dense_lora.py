"""Dense multi-LoRA: y[rows of slot s] += (x @ A[s]^T) @ B[s]^T, rows grouped by adapter slot.

Shapes: x [T, in], y [T, out], A [S, R, in], B [S, out, R] (the adapter's scaling already folded into B),
groups: (slot, row indices) for each slot present in the batch that has weights here.
The plain-torch references come first; the Triton kernels follow, on the batch's rows grouped by slot
(lora_meta.LoraMeta: its metadata and the shrink's partial sums described there; BLOCK_R = max(16, next_pow2(R)),
R padding masked). The shrink writes only the rows of (unmasked) slots.
lora_residual_add: h + (y + shrunk @ B[slot]^T) in one pass, for a projection whose output goes straight into the
residual stream (o_proj): the expand without its own read-add-write of y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear import linear_ref
from .lora_meta import LoraMeta, load_shrunk, partials, row_slots
from .tiles import DENSE_LORA_BLOCKS, DENSE_SHRINK_SMEM, MAX_SPLITS, RESIDUAL_BLOCKS, SPLIT_MIN_K


def dense_lora_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Plain-torch segmented shrink/expand; rows outside `groups` are left untouched (bit for bit)."""
    for slot, rows in groups:
        shrunk = linear_ref(x[rows], A[slot])  # [n, R]
        y.index_add_(0, rows, linear_ref(shrunk, B[slot]))  # [n, out]
    return y


def embedding_lora_ref(h: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Embedding LoRA: h[rows] += A[s][ids[rows]] @ B[s]^T with A [S, V, R] (PEFT's lora_embedding_A, transposed)
    and B [S, H, R] (scaling folded in)."""
    for slot, rows in groups:
        h.index_add_(0, rows, linear_ref(A[slot][ids[rows]], B[slot]))  # [n, H]
    return h


# ---------------------------------------------------------------------------------------------------------
# Triton path.
#
# Shrink and expand are two kernels with a float32 [T, R] intermediate, as in vLLM's punica ops. A fused
# kernel that tiles the output would redo the whole shrink (the read of x over `in`) once per output tile,
# cdiv(out, BLOCK_N) times (32x at out = 4096); one that loops over all of `out` in each program has only
# cdiv(T, BLOCK_M) programs working, too few to fill the GPU at moderate T. Split apart, the shrink reads x
# once, the [T, R] intermediate is small (256 KiB at T = 4096, R = 16) and stays in L2, and the expand is a
# streaming read-add-write of y. Few rows (small batches) would leave most SMs idle while a few programs stream
# x and A over `in`, so the shrink then splits `in` across programs (shrink_splits) and stores one partial sum
# per split, which every consumer adds in order (load_shrunk). No kernel uses atomics: a row's result does not
# depend on the run (its rounding does depend on the batch's row count, through the split count). The shrink
# output also serves several output slices sharing x (q/k/v): shrink once with the A's stacked along R, then
# expand each slice from a column view of `shrunk` into a column view of y (both kernels take any strides).
#
# Grids come from host-known shapes only, sized for the worst case (every row in one slot): a program whose
# tile lies beyond its slot's segment returns at once, and rows with slot -1 belong to no segment. Nothing
# in the launch path reads a device value on the host, so the launches can be captured in a CUDA graph.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, sorted_rows_ptr, slot_start_ptr, slot_mask_ptr, K, R, SPLIT_K,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_ok, stride_om, stride_or,
    HAS_SLOT_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[split, rows, :R] = x[rows, ks] @ A[slot, :, ks]^T (fp32) for BLOCK_M rows of one slot's segment and
    the split's range ks of SPLIT_K input features (program_id(2) = split)."""
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_start_ptr + slot + 1) - start
    if HAS_SLOT_MASK:
        count = tl.where(tl.load(slot_mask_ptr + slot) != 0, count, 0)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    k_start = split * SPLIT_K
    k_end = tl.minimum(K, k_start + SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + offs_k[None, :]) * stride_xk
    a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
              + (k_start + offs_k[:, None]) * stride_ak)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & (offs_r[None, :] < R), other=0.0)
        acc += tl.dot(x, a, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    out_ptrs = out_ptr + split * stride_ok + rows[:, None] * stride_om + offs_r[None, :] * stride_or
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & (offs_r[None, :] < R))


@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, sorted_rows_ptr, slot_start_ptr, slot_mask_ptr, N, R,
    stride_ym, stride_yn, stride_sk, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
    HAS_SLOT_MASK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[rows, cols] += shrunk[rows] @ B[slot, cols]^T (fp32 accumulate) for a BLOCK_M x BLOCK_N tile of one slot."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_start_ptr + slot + 1) - start
    if HAS_SLOT_MASK:
        count = tl.where(tl.load(slot_mask_ptr + slot) != 0, count, 0)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(sorted_rows_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    s = load_shrunk(s_ptr, rows, offs_r, row_mask[:, None] & r_mask[None, :], stride_sk, stride_sm, stride_sr, SPLITS)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    delta = tl.dot(s.to(b.dtype), b, input_precision="ieee")  # shrunk rounded to the weights' dtype, as the reference
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_r(R: int) -> int:
    """R padded to a power of two >= 16 (tl.dot's minimum); the padding is masked, never read."""
    return max(16, 1 << (R - 1).bit_length())


def _mask_args(slot_mask: torch.Tensor | None, meta: LoraMeta):
    return (meta.slot_start, False) if slot_mask is None else (slot_mask, True)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def shrink_splits(T: int, K: int, block_m: int, device: torch.device) -> int:
    """How many ranges of the K input features the shrink splits into: doubling up to MAX_SPLITS while one slot's
    row programs (T rows, block_m per program) times the splits fit the SMs once and every split keeps SPLIT_MIN_K
    features (1 off CUDA)."""
    programs, splits = _cdiv(T, block_m), 1
    while 2 * splits <= MAX_SPLITS and K >= 2 * splits * SPLIT_MIN_K and programs * 2 * splits <= _sm_count(device):
        splits *= 2
    return splits


def dense_lora_shrink(x: torch.Tensor, A: torch.Tensor, meta: LoraMeta, out: torch.Tensor | None = None, *,
                      slot_mask: torch.Tensor | None = None, blocks: dict | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """shrunk[:, rows of slot s] = partial sums of x[rows] @ A[s]^T in float32; x [T, in], A [S, R, in] ->
    out [splits, T, R], split j over input features [j * c, (j + 1) * c) for c = cdiv(in, splits) rounded up to
    the K step (`splits`: out's first dim if given, else shrink_splits; other rows of `out` are not written)."""
    T, K = x.shape
    S, R, _ = A.shape
    assert A.shape[2] == K and x.dtype == A.dtype and meta.num_rows == T and meta.num_slots == S
    config = {**DENSE_LORA_BLOCKS["shrink"], **(blocks or {})}
    if out is not None:
        splits = out.shape[0]
    splits = splits or shrink_splits(T, K, config["BLOCK_M"], x.device)
    BLOCK_R = _block_r(R)
    tile_bytes = (config["BLOCK_M"] + BLOCK_R) * x.element_size() * config["num_stages"]
    while config["BLOCK_K"] > 16 and config["BLOCK_K"] * tile_bytes > DENSE_SHRINK_SMEM:
        config["BLOCK_K"] //= 2
    while config["BLOCK_K"] > 16 and config["BLOCK_K"] >= 2 * _cdiv(K, splits):
        config["BLOCK_K"] //= 2  # no step wider than a split needs
    split_k = _cdiv(_cdiv(K, splits), config["BLOCK_K"]) * config["BLOCK_K"]
    if out is None:
        out = torch.empty(splits, T, R, dtype=torch.float32, device=x.device)
    assert out.shape == (splits, T, R) and out.dtype == torch.float32
    if T == 0:
        return out
    mask, has_mask = _mask_args(slot_mask, meta)
    grid = (_cdiv(T, config["BLOCK_M"]), S, splits)
    _shrink_kernel[grid](
        x, A, out, meta.sorted_rows, meta.slot_start, mask, K, R, split_k,
        x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2), out.stride(0), out.stride(1),
        out.stride(2), HAS_SLOT_MASK=has_mask, BLOCK_R=BLOCK_R, **config,
    )
    return out


def dense_lora_expand(y: torch.Tensor, shrunk: torch.Tensor, B: torch.Tensor, meta: LoraMeta, *,
                      slot_mask: torch.Tensor | None = None, blocks: dict | None = None) -> torch.Tensor:
    """y[rows of slot s] += shrunk[rows] @ B[s]^T in place; y [T, out], shrunk [splits, T, R] or [T, R] (any
    float dtype), B [S, out, R]. Rows of no slot are not touched."""
    T, N = y.shape
    S, _, R = B.shape
    assert B.shape[1] == N and meta.num_rows == T and meta.num_slots == S
    parts = partials(shrunk, T, R, "dense_lora_expand")
    if T == 0:
        return y
    config = {**DENSE_LORA_BLOCKS["expand"], **(blocks or {})}
    mask, has_mask = _mask_args(slot_mask, meta)
    grid = (_cdiv(T, config["BLOCK_M"]), _cdiv(N, config["BLOCK_N"]), S)
    _expand_kernel[grid](
        y, parts, B, meta.sorted_rows, meta.slot_start, mask, N, R,
        y.stride(0), y.stride(1), parts.stride(0), parts.stride(1), parts.stride(2), B.stride(0), B.stride(1),
        B.stride(2), HAS_SLOT_MASK=has_mask, SPLITS=parts.shape[0], BLOCK_R=_block_r(R), **config,
    )
    return y


def dense_lora(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoraMeta, *,
               slot_mask: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """The Triton counterpart of `dense_lora_ref`: y[rows of slot s] += (x[rows] @ A[s]^T) @ B[s]^T, in place
    (`splits`: the shrink's, as dense_lora_shrink's)."""
    shrunk = dense_lora_shrink(x, A, meta, slot_mask=slot_mask, splits=splits)
    return dense_lora_expand(y, shrunk, B, meta, slot_mask=slot_mask)


def lora_residual_add_ref(h: torch.Tensor, y: torch.Tensor, shrunk: torch.Tensor, B: torch.Tensor,
                          groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """h + (y + shrunk @ B[slot]^T), the delta rounded into y's dtype first (as an in-place expand would leave
    it); rows outside `groups` get h + y."""
    y = y.clone()
    for slot, rows in groups:
        y.index_add_(0, rows, linear_ref(shrunk[rows].to(B.dtype), B[slot]))  # [n, out]
    return h + y


@triton.jit(do_not_specialize=["T"])
def _residual_add_kernel(h_ptr, y_ptr, s_ptr, b_ptr, out_ptr, row_slot_ptr, slot_mask_ptr, T, N, R, S,
                         stride_hm, stride_ym, stride_sk, stride_sm, stride_sr, stride_bs, stride_bn, stride_br,
                         stride_om, HAS_SLOT_MASK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out = h + (y + shrunk @ B[slot]^T) for a BLOCK_M x BLOCK_N tile; each row its own slot's delta (or none)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_r = tl.arange(0, BLOCK_R)  # [BR]
    row_mask = rows < T
    mask = row_mask[:, None] & (cols < N)[None, :]
    rows64 = rows[:, None].to(tl.int64)
    slot, lo, hi = row_slots(row_slot_ptr, slot_mask_ptr, rows, row_mask, S, HAS_SLOT_MASK)  # [BM], lo, hi
    y = tl.load(y_ptr + rows64 * stride_ym + cols[None, :], mask=mask, other=0.0)  # [BM, BN]
    acc = y.to(tl.float32)
    shrunk = load_shrunk(s_ptr, rows, offs_r, (slot >= 0)[:, None] & (offs_r < R)[None, :], stride_sk, stride_sm,
                         stride_sr, SPLITS)  # [BM, BR]: each row's own slot's
    for s in range(lo, hi + 1):  # a tile's rows nearly always share one slot
        part = tl.where((slot == s)[:, None], shrunk, 0.0)
        b = tl.load(b_ptr + s * stride_bs + cols[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=(offs_r < R)[:, None] & (cols < N)[None, :], other=0.0)  # [BR, BN]
        acc = tl.dot(part.to(b.dtype), b, acc, input_precision="ieee")  # rows of other slots add exact zeros
    y = acc.to(y.dtype)  # the projection with its delta, rounded as an in-place expand stores it
    h = tl.load(h_ptr + rows64 * stride_hm + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows64 * stride_om + cols[None, :],
             (h.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def lora_residual_add(h: torch.Tensor, y: torch.Tensor, shrunk: torch.Tensor, B: torch.Tensor, meta: LoraMeta, *,
                      slot_mask: torch.Tensor | None = None, blocks: dict | None = None) -> torch.Tensor:
    """The Triton counterpart of `lora_residual_add_ref`, one pass over y and h (an in-place expand then the add
    would read and write y once more): h [T, out], y [T, out] (last dims contiguous), shrunk [splits, T, R] or
    [T, R] (any strides), B [S, out, R] -> [T, out] in the dtype of h + y. Rows of no (or a masked) slot: h + y,
    bit for bit torch's sum. `blocks`: launch settings over RESIDUAL_BLOCKS."""
    T, N = y.shape
    S, _, R = B.shape
    if h.shape != y.shape or h.stride(-1) != 1 or y.stride(-1) != 1 or B.shape[1] != N:
        raise ValueError(f"lora_residual_add: h {tuple(h.shape)}, y {tuple(y.shape)}, B {tuple(B.shape)}")
    parts = partials(shrunk, T, R, "lora_residual_add")
    out = torch.empty(T, N, dtype=torch.promote_types(h.dtype, y.dtype), device=y.device)
    if T == 0:
        return out
    config = {**RESIDUAL_BLOCKS, **(blocks or {})}
    mask, has_mask = (slot_mask, True) if slot_mask is not None else (meta.row_slot, False)
    _residual_add_kernel[(_cdiv(T, config["BLOCK_M"]), _cdiv(N, config["BLOCK_N"]))](
        h, y, parts, B, out, meta.row_slot, mask, T, N, R, S, h.stride(0), y.stride(0), parts.stride(0),
        parts.stride(1), parts.stride(2), B.stride(0), B.stride(1), B.stride(2), out.stride(0),
        HAS_SLOT_MASK=has_mask, SPLITS=parts.shape[0], BLOCK_R=_block_r(R), **config)
    return out


def embedding_lora(h: torch.Tensor, ids: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoraMeta, *,
                   slot_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton counterpart of `embedding_lora_ref`: h[rows] += A[s][ids[rows]] @ B[s]^T, in place.
    The shrink is a gather (plain torch on the device; -1 rows read slot 0 and are then skipped)."""
    shrunk = A[meta.row_slot.clamp(min=0).long(), ids.long()]  # [T, R]
    return dense_lora_expand(h, shrunk, B, meta, slot_mask=slot_mask)
