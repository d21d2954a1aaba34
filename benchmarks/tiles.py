"""Launch settings (tiles, warps, stages, operand layouts) of the Triton kernels, one sweep per kernel family, at
Qwen3-30B-A3B shapes; each sweep prints the current settings' time beside the best. The question it answers: are the
tiles the kernels ship with (kernels/tiles.py, picked from these sweeps) still the fastest on this GPU? Each sweep
passes its settings to the op as arguments; no module constant is changed.

    python benchmarks/tiles.py moe --tokens 2048,4096,16384 [--group-m 8] [--out tiles.csv]
    python benchmarks/tiles.py moe --tokens 4096 --lora [--layouts w_tma] [--out tiles.csv]
    python benchmarks/tiles.py dense [--tokens 4096] [--sections shrink,expand,head-norm]
    python benchmarks/tiles.py shrinks [--tokens 128,4096] [--sections moe,dense]
    python benchmarks/tiles.py logprobs [--rows 128,1024,4096,8192]
    python benchmarks/tiles.py attention [--rows 200] [--prefix 600] [--suffix 110]
    python benchmarks/tiles.py matmul [--tokens 4096]
    python benchmarks/tiles.py small [--tokens 4096,16384]
    (a dry run on the CPU, any of them: TRITON_INTERPRET=1 python benchmarks/tiles.py OP --device cpu --shape tiny
     --dtype float32 ...; the times then mean nothing)

`moe` (was moe_tiles.py): the two grouped GEMMs of the fused MoE (kernels/fused_moe.moe_gemm), each on its own
(gate_up N=2*768 K=2048, down N=2048 K=768), at every tile of a grid and every operand layout, outputs checked
against an einsum; then where one layer's time goes, component by component, beside a dense cuBLAS GEMM of the same
FLOPs. Layouts: `ptr` loads both operands through pointers (rows gathered by pair id); `w_tma` loads the expert
weights through a TMA tensor descriptor; `sorted` (down only) reads the activation written in block order by the
gate_up GEMM, through a descriptor too. `--lora`: each GEMM with a per-expert LoRA expand (PEFT's layout: gate_up
rank 32, down rank 16, every row under one adapter, its shrink computed beforehand) at every tile and one pipeline
stage less, against the same GEMM at the default tiles with and without the LoRA.

`dense` (was dense_lora_tiles.py): the dense multi-LoRA shrink and expand (kernels/dense_lora.py), 4 adapter slots
with every row in one (the end-to-end bench's lora-1 case). Shrinks: q/k/v's shared one (in 2048, R 48), o_proj
(in 4096, R 16), router (in 2048, R 16); expands: q (out 4096), k or v (out 512), o (out 2048), router (out 128), R
16; each against a copy of the same bytes. `head-norm`: q's and k's per-head RMSNorm + RoPE in one kernel
(kernels/head_norm_rope.py) by tokens per program (its argument tokens_per_program; TOKENS_PER_PROGRAM ships), after
the LoRA expand or without one, against the separate kernels.

`shrinks` (was lora_shrinks.py): the LoRA shrinks of the lora-1 case (4 slots, every row in slot 0, rank 16):
`moe`, the per-block MoE shrinks with PEFT's per-expert factors (kernels/fused_moe.moe_lora_shrink: gate_up, x
gathered by pair, R 32; down, the activation, R 16) by warps / stages / BLOCK_K, against the bytes they read at the
copy bandwidth and a gather copy x[rows] of the same rows; `dense`, the dense shrinks against cuBLAS computing the
same shrink as extra output columns of the base GEMM (x @ [W; A]^T with one or all slots' A rows appended).

`logprobs` (was logprobs_kernel.py): the fused lm_head + log-softmax + gather (kernels/logprobs.py, H 2048, V
151936) by its launch settings (TMA, NUM_STAGES, BLOCK_V over LOGPROBS_TILES, passed as `tiles`), against cuBLAS
computing only the logits and against the weight's read floor at 3 TB/s.

`attention`: the prefixed attention (kernels/prefix_attention.py) of one MMLU-like group (ROWS questions of up to
SUFFIX tokens after one PREFIX-token 5-shot prefix, q/kv heads of the shape) by tile, against the torch form it
replaced (the prefix's keys and values concatenated in front of every row, SDPA with an offset causal mask) and
against causal SDPA over the full prompts (what running without the prefix cache costs in attention). With
--prefix 0 --rows 4 --suffix 1024: the batch-invariant mode's attention of the bench's batch against causal SDPA.

`matmul`: the batch-invariant mode's dense GEMM (kernels/matmul.py, fixed tiles, K never split) at the attention
projections' and router's shapes by tile, against cuBLAS (F.linear, what the default mode runs).

`small`: the three small kernels' rows per program — the router's top-k (kernels/router.py, logits [T, E]), RMSNorm
(kernels/rms_norm.py, [T, H]) and RoPE (kernels/rope.py, positions of [4, T / 4, q heads, D]) — each against its torch
reference and a copy of the bytes it reads and writes.

bf16 unless --dtype; times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph) on a GPU, of a few
wall-clock calls on the CPU. Findings: BENCHMARKS-history.md, sections 1 (moe, logprobs) and 3 (dense, shrinks).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
import triton

from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels import head_norm_rope as hnr
from lora_eval.kernels import logprobs as lp
from lora_eval.kernels.dense_lora import dense_lora_expand, dense_lora_shrink
from lora_eval.kernels.lora_meta import lora_metadata
from lora_eval.kernels.matmul import matmul
from lora_eval.kernels.moe_align import moe_align
from lora_eval.kernels.prefix_attention import one_prefix, prefix_attention
from lora_eval.kernels.rms_norm import rms_norm, rms_norm_ref
from lora_eval.kernels.rope import rope, rope_ref
from lora_eval.kernels.router import router_topk, router_topk_ref
from lora_eval.kernels.tiles import (DENSE_LORA_BLOCKS, MATMUL_TILES, POSITIONS_PER_PROGRAM, PREFIX_ATTENTION_TILES,
                                     RMS_NORM_ROWS_PER_PROGRAM, ROUTER_ROWS_PER_PROGRAM)
from lora_eval.engine.forward import row_attention
from lora_eval.models.layers import rope_cos_sin


@dataclass(frozen=True)
class Shape:
    """The model shapes the sweeps run at: experts E, top-k, hidden H, expert intermediate I, attention heads (q, kv)
    of head_dim D, the o_proj input (q heads x D) and the vocabulary V."""
    E: int
    K_TOP: int
    H: int
    I: int
    HEADS_Q: int
    HEADS_KV: int
    D: int
    V: int

    @property
    def Q(self) -> int:  # q's output features, o_proj's input
        return self.HEADS_Q * self.D

    @property
    def KV(self) -> int:
        return self.HEADS_KV * self.D


SHAPES = {"qwen3-30b-a3b": Shape(E=128, K_TOP=8, H=2048, I=768, HEADS_Q=32, HEADS_KV=4, D=128, V=151936),
          "tiny": Shape(E=8, K_TOP=2, H=64, I=32, HEADS_Q=4, HEADS_KV=1, D=32, V=512)}  # a CPU dry run
SLOTS, RANK = 4, 16


class Bench:
    """Device, dtype, shape and timer of one run."""

    def __init__(self, device: str, dtype: str, shape: str):
        self.dev = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.s = SHAPES[shape]
        self.cuda = self.dev.type == "cuda"

    def generator(self, seed: int = 0) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(seed)

    def randn(self, *shape, g=None, scale=1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=self.dev)).to(self.dtype)

    def ms(self, fn, rep: int = 40) -> float:
        """Median ms of fn: CUDA-graph replays on a GPU, three wall-clock calls after one elsewhere."""
        fn()
        if self.cuda:
            return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def bandwidth_gbs(self) -> float:
        """Measured device-to-device copy bandwidth (GB/s, read + write)."""
        a = torch.empty(1 << (30 if self.cuda else 26), dtype=torch.uint8, device=self.dev)
        b = torch.empty_like(a)
        if self.cuda:
            ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
        else:
            ms = self.ms(lambda: b.copy_(a))
        return 2 * a.numel() / ms / 1e6


# ---------------------------------------------------------------------------------------------------- moe (GEMMs)

LAYOUTS = {"gate_up": ("ptr", "w_tma"), "down": ("ptr", "w_tma", "sorted")}


def tile_grid(b: Bench, T, group_ms=(8,)):
    block_m = fm.pick_config(T, b.s.K_TOP, b.s.E, b.dtype).block_m
    grid = []
    for bn, bk, nw, gm in itertools.product((64, 128, 256), (64, 128), (4, 8), group_ms):
        grid.append(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw,
                         num_stages=4 if bk == 64 else 3))
    return grid


def layout_args(layout):
    if layout == "ptr":
        return {}
    if layout == "w_tma":
        return dict(w_tma=True)
    return dict(w_tma=True, a_tma=True, a_sorted=True)


def gemm_inputs(b: Bench, T, g):
    """Random operands of both GEMMs at T tokens: expert weights w_gu [E, 2I, H] and w_d [E, H, I], x [T, H], top-k
    expert ids [T, k], routing weights w [P] (1/k each) and an activation act [P, I]."""
    E, K_TOP, H, I = b.s.E, b.s.K_TOP, b.s.H, b.s.I
    return dict(w_gu=b.randn(E, 2 * I, H, g=g, scale=H**-0.5), w_d=b.randn(E, H, I, g=g, scale=I**-0.5),
                x=b.randn(T, H, g=g), ids=torch.topk(torch.randn(T, E, generator=g, device=b.dev), K_TOP).indices,
                w=torch.full((T * K_TOP,), 1.0 / K_TOP, device=b.dev, dtype=b.dtype),
                act=b.randn(T * K_TOP, I, g=g))


def timed(b: Bench, fn, out, rel_err, what):
    """(median ms, rel_err(out)) of fn, its output first poisoned with NaN; None (printed) for a config that does not
    fit the GPU."""
    try:
        out.fill_(float("nan"))
        fn()
        err = rel_err(out)
        ms = b.ms(fn)
        b.sync()
    except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
        print(f"{what}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        if "illegal" in str(e):
            raise
        return None
    return ms, err


def moe_lora_sweep(b: Bench, T, g, rows, out_csv, layouts=None):
    """Time each GEMM with a per-expert LoRA expand at every tile of the grid (and one pipeline stage less), against
    the default tiles with and without the LoRA; outputs checked against the default tiles' LoRA output."""
    E, K_TOP, H, I = b.s.E, b.s.K_TOP, b.s.H, b.s.I
    R_GU, R_D = 32, 16
    t = gemm_inputs(b, T, g)
    w_gu, w_d, x, ids, w, act = (t[k] for k in ("w_gu", "w_d", "x", "ids", "w", "act"))
    slots = torch.zeros(T, dtype=torch.int32, device=b.dev)  # every row under adapter slot 0 of 1
    a_gu, b_gu = b.randn(1, E, R_GU, H, g=g, scale=0.02), b.randn(1, E, 2 * I, R_GU, g=g, scale=0.02)
    a_d, b_d = b.randn(1, E, R_D, I, g=g, scale=0.02), b.randn(1, E, H, R_D, g=g, scale=0.02)
    config = fm.pick_config(T, K_TOP, E, b.dtype)
    align = moe_align(ids, E, config.block_m, slots, 1)
    shrunk_gu = fm.moe_lora_shrink(x, a_gu, align, rows_are_tokens=True, top_k=K_TOP)  # [NB * BM, 32]
    shrunk_d = fm.moe_lora_shrink(act, a_d, align, rows_are_tokens=False, top_k=K_TOP)  # [NB * BM, 16]
    out = {"gate_up": torch.empty(T * K_TOP, I, device=b.dev, dtype=b.dtype),
           "down": torch.empty(T * K_TOP, H, device=b.dev, dtype=b.dtype)}
    common = dict(expand_first=config.expand_first, half_tail=config.half_tail)

    def run(gemm, tiles, layout, lora=True):
        kw = {**common, **layout_args(layout)}
        if gemm == "gate_up":
            extra = dict(lora_B=b_gu, shrunk=shrunk_gu) if lora else {}
            return lambda: fm.moe_gemm(x, w_gu, out[gemm], align, gated=True,  # noqa: E731
                                       rows_are_tokens=True, top_k=K_TOP, config=tiles, **kw, **extra)
        extra = dict(lora_B=b_d, shrunk=shrunk_d) if lora else {}
        return lambda: fm.moe_gemm(act, w_d, out[gemm], align, gated=False, rows_are_tokens=False,  # noqa: E731
                                   top_k=K_TOP, topk_weights=w, config=tiles, **kw, **extra)

    for gemm in ("gate_up", "down"):
        default_layout = "w_tma" if config.w_tma else "ptr"
        default = config.tiles(gemm)
        run(gemm, default, default_layout)()
        ref = out[gemm].float().clone()
        base_ms = b.ms(run(gemm, default, default_layout, lora=False))
        lora_ms = b.ms(run(gemm, default, default_layout))
        print(f"T={T} {gemm} default {default} ({default_layout}): base {base_ms:.4f} ms, LoRA {lora_ms:.4f} ms "
              f"({lora_ms / base_ms:.3f}x)", flush=True)
        grid = [dict(cfg, num_stages=stages) for cfg in tile_grid(b, T)
                for stages in (cfg["num_stages"], cfg["num_stages"] - 1)]
        for cfg in grid:
            if gemm == "gate_up" and cfg["BLOCK_N"] == 256:
                continue  # two 128 x 256 fp32 accumulators do not fit the registers
            for layout in layouts or LAYOUTS[gemm]:
                if layout == "sorted":
                    continue  # the shrink rows are by block row either way; the activation layout is the layer's
                result = timed(b, run(gemm, cfg, layout), out[gemm],
                               lambda o: ((o.float() - ref).norm() / ref.norm()).item(), f"T={T} {gemm} {layout} {cfg}")
                if result is None:
                    continue
                ms, err = result
                rows.append(dict(tokens=T, gemm=gemm, layout=layout, ms=ms, rel_err=err, base_default_ms=base_ms,
                                 lora_default_ms=lora_ms, **cfg))
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)


def moe_sweep(b: Bench, T, g, rows, out_csv, group_ms=(8,), layouts=None):
    """Time every (tile, layout) of both GEMMs; each result is also checked against the einsum of the same pairs."""
    E, K_TOP, H, I = b.s.E, b.s.K_TOP, b.s.H, b.s.I
    t = gemm_inputs(b, T, g)
    w_gu, w_d, x, ids, w, act = (t[k] for k in ("w_gu", "w_d", "x", "ids", "w", "act"))
    flat = ids.reshape(-1)
    sample = torch.arange(0, T * K_TOP, max(1, T * K_TOP // 64), device=b.dev)  # 64 pairs checked
    gu = torch.einsum("ph,pnh->pn", x[sample // K_TOP].float(), w_gu[flat[sample]].float())
    ref = {"gate_up": torch.nn.functional.silu(gu[:, :I]) * gu[:, I:],
           "down": torch.einsum("pi,phi->ph", act[sample].float(), w_d[flat[sample]].float()) / K_TOP}
    half_tail = fm.pick_config(T, K_TOP, E, b.dtype).half_tail  # as the layer runs them
    for cfg in tile_grid(b, T, group_ms):
        align = moe_align(ids, E, cfg["BLOCK_M"])
        act_sorted = act[align.sorted_pairs.long().clamp(0, T * K_TOP - 1)]  # [NB * BM, I] block order
        out_gu = torch.empty(T * K_TOP, I, device=b.dev, dtype=b.dtype)
        out_d = torch.empty(T * K_TOP, H, device=b.dev, dtype=b.dtype)
        for gemm in ("gate_up", "down"):
            if gemm == "gate_up" and cfg["BLOCK_N"] == 256 and cfg["BLOCK_M"] == 128:
                continue  # two 128 x 256 fp32 accumulators do not fit the registers
            for layout in (name for name in LAYOUTS[gemm] if not layouts or name in layouts):
                kw = layout_args(layout)
                if gemm == "gate_up":
                    out = out_gu
                    fn = lambda: fm.moe_gemm(x, w_gu, out_gu, align, gated=True, rows_are_tokens=True,  # noqa: E731
                                             top_k=K_TOP, config=cfg, half_tail=half_tail, **kw)
                else:
                    out = out_d
                    a = act_sorted if layout == "sorted" else act
                    fn = lambda: fm.moe_gemm(a, w_d, out_d, align, gated=False, rows_are_tokens=False,  # noqa: E731
                                             top_k=K_TOP, topk_weights=w, config=cfg, half_tail=half_tail, **kw)
                result = timed(b, fn, out, lambda o: ((o[sample].float() - ref[gemm]).norm() / ref[gemm].norm()).item(),
                               f"T={T} {gemm} {layout} {cfg}")
                if result is None:
                    continue
                ms, err = result
                rows.append(dict(tokens=T, gemm=gemm, layout=layout, ms=ms, rel_err=err, **cfg))
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)
    return t


def moe_components(b: Bench, T, t):
    """Median times of the default layer's parts: alignment, gate_up, down, sum over k, whole layer."""
    E, K_TOP, H, I = b.s.E, b.s.K_TOP, b.s.H, b.s.I
    cfg = fm.pick_config(T, K_TOP, E, b.dtype)
    align = moe_align(t["ids"], E, cfg.block_m)
    act = torch.empty(align.num_blocks * cfg.block_m, I, device=b.dev, dtype=b.dtype)
    y = torch.empty(T * K_TOP, H, device=b.dev, dtype=b.dtype)
    weights = torch.softmax(torch.randn(T, K_TOP, device=b.dev), -1).to(b.dtype)
    sort = dict(a_sorted=cfg.sorted_act, a_tma=cfg.sorted_act and cfg.w_tma, half_tail=cfg.half_tail)
    parts = {  # the default tiles and layout
        "alignment": lambda: moe_align(t["ids"], E, cfg.block_m),
        "gate_up": lambda: fm.moe_gemm(t["x"], t["w_gu"], act, align, gated=True, rows_are_tokens=True, top_k=K_TOP,
                                       config=cfg.tiles("gate_up"), w_tma=cfg.w_tma, out_sorted=cfg.sorted_act,
                                       half_tail=cfg.half_tail),
        "down": lambda: fm.moe_gemm(act, t["w_d"], y, align, gated=False, rows_are_tokens=False, top_k=K_TOP,
                                    topk_weights=t["w"], config=cfg.tiles("down"), w_tma=cfg.w_tma, **sort),
        "sum over k": lambda: fm.moe_sum(y.view(T, K_TOP, H)),
        "layer": lambda: fm.fused_moe(t["x"], t["ids"], weights, t["w_gu"], t["w_d"]),
    }
    times = {name: b.ms(fn) for name, fn in parts.items()}
    flops = 2 * T * K_TOP * 3 * H * I
    print(f"T={T} components (ms): " + ", ".join(f"{k} {v:.4f}" for k, v in times.items())
          + f"; parts sum {sum(v for k, v in times.items() if k != 'layer'):.4f}; "
          f"layer {flops / times['layer'] / 1e9:.0f} TFLOP/s")
    a = torch.randn(max(1, T * K_TOP // 8), H, device=b.dev, dtype=b.dtype)
    w = torch.randn(H, 3 * I * 8, device=b.dev, dtype=b.dtype)
    dense = b.ms(lambda: a @ w)
    print(f"T={T} dense cuBLAS GEMM of the same FLOPs ({a.shape[0]}x{H} @ {H}x{w.shape[1]}): {dense:.4f} ms, "
          f"{flops / dense / 1e9:.0f} TFLOP/s")


def moe(b: Bench, args):
    group_ms = tuple(int(v) for v in args.group_m.split(","))
    layouts = args.layouts.split(",") if args.layouts else None
    g = b.generator()
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        if args.lora:
            moe_lora_sweep(b, T, g, rows, args.out, layouts)
            continue
        tensors = moe_sweep(b, T, g, rows, args.out, group_ms, layouts)
        moe_components(b, T, tensors)
    table = pd.DataFrame(rows)
    keys = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"]
    best = table.sort_values("ms").groupby(["tokens", "gemm", "layout"]).head(2)
    print(f"largest relative error against the reference: {table['rel_err'].max():.2e}")
    print(best.sort_values(["tokens", "gemm", "ms"])[["tokens", "gemm", "layout", "ms", *keys]]
          .to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    for (T, gemm), group in table.groupby(["tokens", "gemm"]):
        best = group.loc[group["ms"].idxmin()]
        print(f"T={T} {gemm}: best {best['ms']:.4f} ms ({best['layout']}, "
              + "/".join(str(best[k]) for k in keys) + ")")
    if args.out:
        table.to_csv(args.out, index=False)


# ------------------------------------------------------------------------------------------ dense (LoRA kernels)

def dense(b: Bench, args):
    T = args.tokens
    meta = lora_metadata(torch.zeros(T, dtype=torch.long, device=b.dev), SLOTS)
    sections = args.sections.split(",")
    if "shrink" in sections:
        dense_shrinks(b, T, meta)
    if "expand" in sections:
        dense_expands(b, T, meta)
    if "head-norm" in sections:
        head_norms(b, T, meta)


def head_norms(b: Bench, T, meta, batch=4):
    """q's / k's per-head norm + RoPE (kernels/head_norm_rope.py) by tokens per program, without and after the LoRA
    expand (in place, as the forward runs it), against the separate kernels (expand, rms_norm, rope)."""
    D = b.s.D
    L = T // batch
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32, device=b.dev) / D))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(L, device=b.dev).expand(batch, L), b.dtype)
    for name, heads in (("q", b.s.HEADS_Q), ("k", b.s.HEADS_KV)):
        y = b.randn(T, heads * D)
        shrunk = torch.randn(T, 16, device=b.dev)
        B = b.randn(SLOTS, heads * D, 16, scale=0.25)
        w = (torch.rand(D, device=b.dev) + 0.5).to(b.dtype)

        def apart(with_lora):
            z = y.clone()  # the expand writes into the projection: the clone is timed too, and subtracted below
            if with_lora:
                dense_lora_expand(z, shrunk, B, meta)
            return rope(rms_norm(z.view(T, heads, D), w, 1e-6).view(batch, L, heads, D), cos, sin)

        clone = b.ms(lambda: y.clone())
        cells = [f"apart: base {(b.ms(lambda: apart(False)) - clone) * 1e3:.1f} us, "
                 f"LoRA {(b.ms(lambda: apart(True)) - clone) * 1e3:.1f} us"]
        for tokens in (16, 32, 64):
            base = b.ms(lambda: hnr.head_norm_rope(y, w, 1e-6, cos, sin, tokens_per_program=tokens))

            def after_expand():
                z = y.clone()
                dense_lora_expand(z, shrunk, B, meta)
                return hnr.head_norm_rope(z, w, 1e-6, cos, sin, tokens_per_program=tokens)

            lora = b.ms(after_expand) - clone
            cells.append(f"fused at {tokens} tokens: base {base * 1e3:.1f} us, "
                         f"after the LoRA expand {lora * 1e3:.1f} us")
        print(f"{name} norm + rope ({heads} heads): " + "; ".join(cells), flush=True)


def dense_sweep(b: Bench, name: str, second: str, seconds: tuple, stages: tuple, run, current: dict, copy) -> None:
    """Time `run(blocks)` at every BLOCK_M x `second` (BLOCK_K or BLOCK_N) x warps x stages, beside the shipped
    `current` tiles (run(None)) and `copy` (the bytes' copy), and print the best."""
    results = {}
    for bm, b2, nw, ns in itertools.product((32, 64, 128), seconds, (4, 8), stages):
        blocks = {"BLOCK_M": bm, second: b2, "num_warps": nw, "num_stages": ns}
        try:
            results[(bm, b2, nw, ns)] = b.ms(lambda: run(blocks))
        except Exception as e:  # noqa: BLE001 - tiles that do not fit are skipped
            print(f"{name} {blocks}: {type(e).__name__}")
    shipped = b.ms(lambda: run(None))
    best = min(results, key=results.get)
    print(f"{name}: current {current} {shipped * 1e3:.1f} us; best BLOCK_M/{second}/warps/stages {best} "
          f"{results[best] * 1e3:.1f} us; copy {b.ms(copy) * 1e3:.1f} us", flush=True)


def dense_shrinks(b: Bench, T, meta):
    s = b.s
    for name, K, R in (("q/k/v shrink", s.H, 3 * RANK), ("o shrink", s.Q, RANK), ("router shrink", s.H, RANK)):
        x = b.randn(T, K)
        A = b.randn(SLOTS, R, K, scale=K**-0.5)
        dense_sweep(b, name, "BLOCK_K", (64, 128, 256), (2, 3, 4),
                    lambda blocks: dense_lora_shrink(x, A, meta, **({} if blocks is None else {"blocks": blocks})),
                    DENSE_LORA_BLOCKS["shrink"], lambda: x.clone())


def dense_expands(b: Bench, T, meta):
    s = b.s
    for name, N in (("q expand", s.Q), ("k/v expand", s.KV), ("o expand", s.H), ("router expand", s.E)):
        y = b.randn(T, N)
        shrunk = torch.randn(T, 16, device=b.dev)
        B = b.randn(SLOTS, N, 16, scale=0.25)
        dense_sweep(b, name, "BLOCK_N", (64, 128, 256), (1,),
                    lambda blocks: dense_lora_expand(y, shrunk, B, meta, **({} if blocks is None else
                                                                            {"blocks": blocks})),
                    DENSE_LORA_BLOCKS["expand"], lambda: y.clone())


# ---------------------------------------------------------------------------------------- shrinks (MoE and dense)

def moe_inputs(b: Bench, T, g):
    """moe_layer.py's inputs: x [T, H], top-k ids and renormalised routing weights of softmaxed Gaussian logits."""
    x = b.randn(T, b.s.H, g=g)
    logits = torch.randn(T, b.s.E, generator=g, device=b.dev)
    w, ids = torch.topk(logits.softmax(-1), b.s.K_TOP)
    return x, ids, (w / w.sum(-1, keepdim=True)).to(b.dtype)


def moe_shrinks(b: Bench, T, g, gbs):
    E, K_TOP, H, I = b.s.E, b.s.K_TOP, b.s.H, b.s.I
    x, ids, _ = moe_inputs(b, T, g)
    slots = torch.zeros(T, dtype=torch.long, device=b.dev)
    config = fm.pick_config(T, K_TOP, E, b.dtype)
    align = moe_align(ids, E, config.block_m, slots, SLOTS)
    act_rows = align.num_blocks * config.block_m if config.sorted_act else T * K_TOP
    act = b.randn(act_rows, I, g=g)
    gate_up_A = b.randn(SLOTS, E, 2 * RANK, H, g=g, scale=0.02)
    down_A = b.randn(SLOTS, E, RANK, I, g=g, scale=0.02)
    rows = ids.reshape(-1).argsort() // K_TOP  # the pairs' tokens, pairs by expert
    gather = 1e3 * b.ms(lambda: x.index_select(0, rows), rep=50)
    P, size = T * K_TOP, x.element_size()
    cases = {"gate_up": (x, gate_up_A, dict(rows_are_tokens=True), P * H * size),
             "down": (act, down_A, dict(rows_are_tokens=False, a_sorted=config.sorted_act), P * I * size)}
    current = {name: config.shrink_tiles(name) for name in cases}
    out = []
    for name, (a, A, kw, nbytes) in cases.items():
        for warps, stages, bk in itertools.product((4, 8), (2, 3, 4), (64, 128, 256)):
            tiles = dict(num_warps=warps, num_stages=stages, BLOCK_K=bk)
            try:
                us = 1e3 * b.ms(lambda: fm.moe_lora_shrink(a, A, align, top_k=K_TOP, tiles=tiles, **kw), rep=50)
            except Exception as e:  # noqa: BLE001 - a setting that does not fit shared memory
                print(f"  {name} w{warps} s{stages} bk{bk}: {type(e).__name__}")
                continue
            out.append(dict(tokens=T, shrink=name, warps=warps, stages=stages, block_k=bk, us=round(us, 1),
                            current=tiles == current[name], read_floor_us=round(nbytes / gbs / 1e3, 1),
                            gather_copy_us=round(gather, 1)))
    return out


def dense_vs_cublas(b: Bench, T, g):
    s = b.s
    meta = lora_metadata(torch.zeros(T, dtype=torch.long, device=b.dev), SLOTS)
    out = []
    for name, n_in, n_out, R in (("q/k/v", s.H, s.Q + 2 * s.KV, 3 * RANK), ("o", s.Q, s.H, RANK),
                                 ("router", s.H, s.E, RANK)):
        x = b.randn(T, n_in, g=g)
        W = b.randn(n_out + SLOTS * R, n_in, g=g, scale=0.02)
        A = W[n_out:].view(SLOTS, R, n_in)
        base = 1e3 * b.ms(lambda: F.linear(x, W[:n_out]), rep=50)
        row = dict(tokens=T, proj=name, base_gemm_us=round(base, 1),
                   shrink_kernel_us=round(1e3 * b.ms(lambda: dense_lora_shrink(x, A, meta), rep=50), 1))
        for slots in (1, SLOTS):
            fused = 1e3 * b.ms(lambda: F.linear(x, W[:n_out + slots * R]), rep=50)
            row[f"gemm_with_{slots}_slot_cols_us"] = round(fused, 1)
        out.append(row)
    return out


def shrinks(b: Bench, args):
    g = b.generator()
    sections = args.sections.split(",")
    gbs = b.bandwidth_gbs()
    print(f"copy bandwidth {gbs:.0f} GB/s")
    pd.set_option("display.width", 200)
    for T in [int(t) for t in args.tokens.split(",")]:
        if "moe" in sections:
            table = pd.DataFrame(moe_shrinks(b, T, g, gbs))
            for name, part in table.groupby("shrink", sort=False):
                print(part.sort_values("us").head(8).to_string(index=False))
                print("current:", part[part.current].us.tolist())
        if "dense" in sections:
            print(pd.DataFrame(dense_vs_cublas(b, T, g)).to_string(index=False))


# ------------------------------------------------------------------------------------------------------ logprobs

LOGPROBS_SETTINGS = {  # name: launch settings of token_logprobs over LOGPROBS_TILES (its `tiles`)
    "pointers": dict(TMA=False),
    "tma": dict(TMA=True),
    "tma, 4 stages": dict(TMA=True, NUM_STAGES=4),
    "tma, BLOCK_V 128": dict(TMA=True, BLOCK_V=128),
}


def logprobs(b: Bench, args):
    H, V = b.s.H, b.s.V
    g = b.generator()
    weight = b.randn(V, H, g=g, scale=0.02)
    floor_ms = weight.numel() * weight.element_size() / 3.0e12 * 1e3
    for N in [int(n) for n in args.rows.split(",")]:
        hidden = b.randn(N, H, g=g)
        targets = torch.randint(0, V, (N,), generator=g, device=b.dev)
        cublas = b.ms(lambda: hidden @ weight.T, rep=100)
        row = [f"N={N}: cuBLAS logits {cublas:.3f} ms ({2 * N * H * V / cublas / 1e9:.0f} TFLOP/s), weight read "
               f"floor {floor_ms:.3f}"]
        reference = None
        for name, settings in LOGPROBS_SETTINGS.items():
            try:
                ms = b.ms(lambda: lp.token_logprobs(hidden, weight, targets, tiles=settings), rep=100)
                out = lp.token_logprobs(hidden, weight, targets, tiles=settings)
                reference = out if reference is None else reference
                row.append(f"{name} {ms:.3f} ({cublas / ms:.2f}x cuBLAS, max diff {(out - reference).abs().max():.1e})")
            except Exception as e:  # noqa: BLE001 - a setting that does not fit
                row.append(f"{name}: {type(e).__name__}")
        print("\n  ".join(row))


# ------------------------------------------------------------------------------------------ prefixed attention

ATTENTION_TILES = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                   for m, n, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2),
                                       (128, 128, 8, 2), (32, 64, 4, 2)]]


def attention(b: Bench, args):
    s, g = b.s, b.generator()
    B, P, L = args.rows, args.prefix, args.suffix
    q = b.randn(B, L, s.HEADS_Q, s.D, g=g).transpose(1, 2)  # [B, nh, L, D], the forward's layout
    k, v = b.randn(B, s.HEADS_KV, L, s.D, g=g), b.randn(B, s.HEADS_KV, L, s.D, g=g)
    pk, pv = b.randn(s.HEADS_KV, P, s.D, g=g), b.randn(s.HEADS_KV, P, s.D, g=g)
    rows = torch.arange(B, device=b.dev)
    table = one_prefix(pk, pv, B, b.dev) if P else None
    scale = s.D ** -0.5

    def torch_form():
        kk = torch.cat([pk[None].expand(B, -1, -1, -1), k], dim=2)
        vv = torch.cat([pv[None].expand(B, -1, -1, -1), v], dim=2)
        return row_attention(q, kk, vv, scale, offset=P)

    reference = torch_form()
    full_q = b.randn(B, s.HEADS_Q, P + L, s.D, g=g)
    full_kv = b.randn(B, s.HEADS_KV, P + L, s.D, g=g)
    full = b.ms(lambda: F.scaled_dot_product_attention(full_q, full_kv, full_kv, is_causal=True, scale=scale,
                                                       enable_gqa=True))
    old = b.ms(torch_form)
    print(f"{B} rows x {L} tokens after a {P}-token prefix: torch form {old:.3f} ms, causal SDPA over the full "
          f"prompts {full:.3f} ms")
    for tiles in ATTENTION_TILES:
        out = torch.empty_like(reference)
        try:
            ms = b.ms(lambda: prefix_attention(q, k, v, out, rows, scale, table, tiles=tiles))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit
            print(f"  {tiles}: {type(e).__name__}")
            continue
        mark = " (ships)" if tiles == PREFIX_ATTENTION_TILES else ""
        print(f"  {tiles}{mark}: {ms:.3f} ms, {old / ms:.2f}x the torch form, max diff "
              f"{(out.float() - reference.float()).abs().max().item():.1e}")


# ----------------------------------------------------------------------------------- matmul (batch-invariant)

MATMUL_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, TMA=tma, PERSISTENT=persistent)
                for m, n, k, w, st in [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                       (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]
                for tma, persistent in [(False, False), (True, False), (True, True)]]


def matmul_sweep(b: Bench, args):
    s, g = b.s, b.generator()
    projections = {"qkv": (s.H, s.Q + 2 * s.KV), "o": (s.Q, s.H), "router": (s.H, s.E)}
    for T in (int(t) for t in args.tokens.split(",")):
        for name, (K, N) in projections.items():
            x, w = b.randn(T, K, g=g), b.randn(N, K, g=g, scale=K ** -0.5)
            reference = F.linear(x, w)
            cublas = b.ms(lambda: F.linear(x, w))
            print(f"{name} T={T} K={K} N={N}: cuBLAS {cublas:.4f} ms", flush=True)
            for tiles in MATMUL_SWEEP:
                try:
                    ms = b.ms(lambda: matmul(x, w, tiles=tiles))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit
                    print(f"  {tiles}: {type(e).__name__}")
                    continue
                mark = " (ships)" if {**MATMUL_TILES, **tiles} == MATMUL_TILES else ""
                diff = (matmul(x, w, tiles=tiles).float() - reference.float()).abs().max().item()
                print(f"  {tiles}{mark}: {ms:.4f} ms, {cublas / ms:.2f}x cuBLAS, max diff {diff:.1e}")


# ------------------------------------------------------------------------------ small kernels (router, norm, rope)

SMALL_SWEEP = (1, 2, 4, 8, 16, 32)  # rows (positions) per program


def small(b: Bench, args):
    s, g = b.s, b.generator()
    for T in (int(t) for t in args.tokens.split(",")):
        logits = torch.randn(T, s.E, generator=g, device=b.dev)  # [T, E] float32, as the router's
        x, w = b.randn(T, s.H, g=g), b.randn(s.H, g=g)
        L = max(T // 4, 1)
        q = b.randn(4, L, s.HEADS_Q, s.D, g=g)  # [B, L, heads, D]
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, s.D, 2, device=b.dev).float() / s.D))  # [D/2]
        cos, sin = rope_cos_sin(inv_freq, torch.arange(L, device=b.dev).expand(4, L), b.dtype)  # [4, L, D]
        want_w, want_ids = router_topk_ref(logits, s.K_TOP, True)
        cases = {
            "router_topk": (ROUTER_ROWS_PER_PROGRAM, logits,
                            lambda n: router_topk(logits, s.K_TOP, True, rows_per_program=n),
                            lambda got: (got[0] - want_w).abs().max().item() + (got[1] != want_ids).sum().item()),
            "rms_norm": (RMS_NORM_ROWS_PER_PROGRAM, x, lambda n: rms_norm(x, w, 1e-6, rows_per_program=n),
                         lambda got: (got.float() - rms_norm_ref(x, w, 1e-6).float()).abs().max().item()),
            "rope": (POSITIONS_PER_PROGRAM, q, lambda n: rope(q, cos, sin, positions_per_program=n),
                     lambda got: (got.float() - rope_ref(q, cos, sin).float()).abs().max().item()),
        }
        for name, (ships, inp, run, diff) in cases.items():
            copy = torch.empty_like(inp)
            floor = b.ms(lambda: copy.copy_(inp))
            print(f"{name} T={T}: a copy of its input {floor:.4f} ms", flush=True)
            for n in SMALL_SWEEP:
                ms = b.ms(lambda: run(n))
                mark = " (ships)" if n == ships else ""
                print(f"  {n} per program{mark}: {ms:.4f} ms, max diff {diff(run(n)):.1e}")


# ---------------------------------------------------------------------------------------------------------- main

def main():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cuda")
    common.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    common.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ops = parser.add_subparsers(dest="op", required=True)
    p = ops.add_parser("moe", parents=[common],
                       help="the fused MoE's grouped GEMMs: tiles x operand layouts, then the layer's parts")
    p.add_argument("--tokens", default="2048,4096,16384")
    p.add_argument("--out", default=None)
    p.add_argument("--group-m", default="8", help="comma-separated GROUP_M values to sweep")
    p.add_argument("--lora", action="store_true", help="sweep the GEMMs with a per-expert LoRA expand")
    p.add_argument("--layouts", default=None, help="comma-separated layouts (ptr, w_tma, sorted; default all)")
    p = ops.add_parser("dense", parents=[common],
                       help="the dense multi-LoRA shrink / expand and the fused head norm + RoPE")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sections", default="shrink,expand,head-norm")
    p = ops.add_parser("shrinks", parents=[common],
                       help="the LoRA shrinks (MoE per-block, dense) against their floors and cuBLAS")
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--sections", default="moe,dense")
    p = ops.add_parser("logprobs", parents=[common],
                       help="the fused lm_head + log-softmax + gather against cuBLAS's logits")
    p.add_argument("--rows", default="128,1024,4096,8192")
    p = ops.add_parser("attention", parents=[common],
                       help="the prefixed attention by tile against the torch form and full-prompt SDPA")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--prefix", type=int, default=600)
    p.add_argument("--suffix", type=int, default=110)
    p = ops.add_parser("matmul", parents=[common],
                       help="the batch-invariant mode's dense GEMM (kernels/matmul.py) by tile against cuBLAS")
    p.add_argument("--tokens", default="4096")
    p = ops.add_parser("small", parents=[common],
                       help="rows per program of the router's top-k, RMSNorm and RoPE")
    p.add_argument("--tokens", default="4096,16384")
    args = parser.parse_args()
    b = Bench(args.device, args.dtype, args.shape)
    print(f"{args.op} on {torch.cuda.get_device_name(b.dev) if b.cuda else b.dev}, {args.dtype}, shape {args.shape}, "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    {"moe": moe, "dense": dense, "shrinks": shrinks, "logprobs": logprobs, "attention": attention,
     "matmul": matmul_sweep, "small": small}[args.op](b, args)


if __name__ == "__main__":
    main()
