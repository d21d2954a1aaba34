"""Tile and operand-layout sweep for the two grouped GEMMs of the fused MoE, each on its own (they have different
shapes: gate_up N=2*768 K=2048, down N=2048 K=768), and where one layer's time goes, component by component.

    python benchmarks/moe_tiles.py --tokens 2048,4096,16384 [--group-m 8] [--out tiles.csv]
    python benchmarks/moe_tiles.py --tokens 4096 --lora [--layouts w_tma] [--out tiles.csv]

`--lora`: each GEMM with a per-expert LoRA expand (PEFT's layout: gate_up rank 32, down rank 16, every row under one
adapter, its shrink computed beforehand) as the fused MoE runs it (expand before the main loop, the pipeline depth
cut where the operands need the shared memory: gemm_stages), compared against the same GEMM at the default tiles;
the base GEMM at the default tiles is timed alongside, so a tile that only pays with LoRA shows as one.

Layouts (kernels/fused_moe.py): `ptr` loads both operands through pointers (rows gathered by pair id);
`w_tma` loads the expert weights through a TMA tensor descriptor; `sorted` (down only) reads the activation
written in block order by the gate_up GEMM, through a descriptor too, so that both operands of the down GEMM
are TMA loads. Qwen3-30B-A3B layer shapes, bf16, CUDA-graph replays (median).
"""

from __future__ import annotations

import argparse
import itertools

import pandas as pd
import torch
import triton

from lora_eval.kernels.fused_moe import fused_moe, moe_gemm, moe_lora_shrink, moe_sum, pick_config
from lora_eval.kernels.moe_align import moe_align

E, K_TOP, H, I = 128, 8, 2048, 768
LAYOUTS = {"gate_up": ("ptr", "w_tma"), "down": ("ptr", "w_tma", "sorted")}


def time_graph(fn):
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def tile_grid(T, group_ms=(8,)):
    block_m = pick_config(T, K_TOP, E).block_m
    grid = []
    for bn, bk, nw, gm in itertools.product((64, 128, 256), (64, 128), (4, 8), group_ms):
        grid.append(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=nw,
                         num_stages=4 if bk == 64 else 3))
    return grid


def layout_args(gemm, layout):
    if layout == "ptr":
        return {}
    if layout == "w_tma":
        return dict(w_tma=True)
    return dict(w_tma=True, a_tma=True, a_sorted=True)


def gemm_inputs(T, g):
    """Random bf16 operands of both GEMMs at T tokens: expert weights w_gu [E, 2I, H] and w_d [E, H, I], x [T, H],
    top-k expert ids [T, k], routing weights w [P] (1/k each) and an activation act [P, I]."""
    bf = torch.bfloat16
    return dict(w_gu=(torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(bf),
                w_d=(torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(bf),
                x=torch.randn(T, H, generator=g, device="cuda").to(bf),
                ids=torch.topk(torch.randn(T, E, generator=g, device="cuda"), K_TOP).indices,
                w=torch.full((T * K_TOP,), 1.0 / K_TOP, device="cuda", dtype=bf),
                act=torch.randn(T * K_TOP, I, generator=g, device="cuda").to(bf))


def timed(fn, out, rel_err, what):
    """(median ms, rel_err(out)) of fn, its output first poisoned with NaN; None (printed) for a config that does not
    fit the GPU."""
    try:
        out.fill_(float("nan"))
        fn()
        err = rel_err(out)
        ms = time_graph(fn)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - configs that do not fit are skipped
        print(f"{what}: {type(e).__name__}: {str(e)[:80]}", flush=True)
        if "illegal" in str(e):
            raise
        return None
    return ms, err


def lora_sweep(T, g, rows, out_csv, layouts=None):
    """Time each GEMM with a per-expert LoRA expand at every tile of the grid (and one pipeline stage less), against
    the default tiles with and without the LoRA; outputs checked against the default tiles' LoRA output."""
    bf = torch.bfloat16
    R_GU, R_D = 32, 16
    t = gemm_inputs(T, g)
    w_gu, w_d, x, ids, w, act = (t[k] for k in ("w_gu", "w_d", "x", "ids", "w", "act"))
    slots = torch.zeros(T, dtype=torch.int32, device="cuda")  # every row under adapter slot 0 of 1
    factor = lambda *shape: (0.02 * torch.randn(*shape, generator=g, device="cuda")).to(bf)  # noqa: E731
    a_gu, b_gu, a_d, b_d = factor(1, E, R_GU, H), factor(1, E, 2 * I, R_GU), factor(1, E, R_D, I), factor(1, E, H, R_D)
    config = pick_config(T, K_TOP, E)
    align = moe_align(ids, E, config.block_m, slots, 1)
    shrunk_gu = moe_lora_shrink(x, a_gu, align, rows_are_tokens=True, top_k=K_TOP)  # [NB * BM, 32]
    shrunk_d = moe_lora_shrink(act, a_d, align, rows_are_tokens=False, top_k=K_TOP)  # [NB * BM, 16]
    out = {"gate_up": torch.empty(T * K_TOP, I, device="cuda", dtype=bf),
           "down": torch.empty(T * K_TOP, H, device="cuda", dtype=bf)}
    common = dict(expand_first=config.expand_first, half_tail=config.half_tail)

    def run(gemm, tiles, layout, lora=True):
        kw = {**common, **layout_args(gemm, layout)}
        if gemm == "gate_up":
            extra = dict(lora_B=b_gu, shrunk=shrunk_gu) if lora else {}
            return lambda: moe_gemm(x, w_gu, out[gemm], align, gated=True,  # noqa: E731
                                    rows_are_tokens=True, top_k=K_TOP, config=tiles, **kw, **extra)
        extra = dict(lora_B=b_d, shrunk=shrunk_d) if lora else {}
        return lambda: moe_gemm(act, w_d, out[gemm], align, gated=False, rows_are_tokens=False,  # noqa: E731
                                top_k=K_TOP, topk_weights=w, config=tiles, **kw, **extra)

    for gemm in ("gate_up", "down"):
        default_layout = "w_tma" if config.w_tma else "ptr"
        default = config.tiles(gemm)
        run(gemm, default, default_layout)()
        ref = out[gemm].float().clone()
        base_ms = time_graph(run(gemm, default, default_layout, lora=False))
        lora_ms = time_graph(run(gemm, default, default_layout))
        print(f"T={T} {gemm} default {default} ({default_layout}): base {base_ms:.4f} ms, LoRA {lora_ms:.4f} ms "
              f"({lora_ms / base_ms:.3f}x)", flush=True)
        grid = [dict(cfg, num_stages=stages) for cfg in tile_grid(T)
                for stages in (cfg["num_stages"], cfg["num_stages"] - 1)]
        for cfg in grid:
            if gemm == "gate_up" and cfg["BLOCK_N"] == 256:
                continue  # two 128 x 256 fp32 accumulators do not fit the registers
            for layout in layouts or LAYOUTS[gemm]:
                if layout == "sorted":
                    continue  # the shrink rows are by block row either way; the activation layout is the layer's
                result = timed(run(gemm, cfg, layout), out[gemm],
                               lambda o: ((o.float() - ref).norm() / ref.norm()).item(), f"T={T} {gemm} {layout} {cfg}")
                if result is None:
                    continue
                ms, err = result
                rows.append(dict(tokens=T, gemm=gemm, layout=layout, ms=ms, rel_err=err, base_default_ms=base_ms,
                                 lora_default_ms=lora_ms, **cfg))
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)


def sweep(T, g, rows, out_csv, group_ms=(8,)):
    """Time every (tile, layout) of both GEMMs; each result is also checked against the einsum of the same pairs."""
    bf = torch.bfloat16
    t = gemm_inputs(T, g)
    w_gu, w_d, x, ids, w, act = (t[k] for k in ("w_gu", "w_d", "x", "ids", "w", "act"))
    flat = ids.reshape(-1)
    sample = torch.arange(0, T * K_TOP, max(1, T * K_TOP // 64), device="cuda")  # 64 pairs checked
    gu = torch.einsum("ph,pnh->pn", x[sample // K_TOP].float(), w_gu[flat[sample]].float())
    ref = {"gate_up": torch.nn.functional.silu(gu[:, :I]) * gu[:, I:],
           "down": torch.einsum("pi,phi->ph", act[sample].float(), w_d[flat[sample]].float()) / K_TOP}
    half_tail = pick_config(T, K_TOP, E).half_tail  # as the layer runs them
    for cfg in tile_grid(T, group_ms):
        align = moe_align(ids, E, cfg["BLOCK_M"])
        act_sorted = act[align.sorted_pairs.long().clamp(0, T * K_TOP - 1)]  # [NB * BM, I] block order
        out_gu = torch.empty(T * K_TOP, I, device="cuda", dtype=bf)
        out_d = torch.empty(T * K_TOP, H, device="cuda", dtype=bf)
        for gemm in ("gate_up", "down"):
            if gemm == "gate_up" and cfg["BLOCK_N"] == 256 and cfg["BLOCK_M"] == 128:
                continue  # two 128 x 256 fp32 accumulators do not fit the registers
            for layout in LAYOUTS[gemm]:
                kw = layout_args(gemm, layout)
                if gemm == "gate_up":
                    out = out_gu
                    fn = lambda: moe_gemm(x, w_gu, out_gu, align, gated=True, rows_are_tokens=True, top_k=K_TOP,  # noqa: E731
                                          config=cfg, half_tail=half_tail, **kw)
                else:
                    out = out_d
                    a = act_sorted if layout == "sorted" else act
                    fn = lambda: moe_gemm(a, w_d, out_d, align, gated=False, rows_are_tokens=False,  # noqa: E731
                                          top_k=K_TOP, topk_weights=w, config=cfg, half_tail=half_tail, **kw)
                result = timed(fn, out, lambda o: ((o[sample].float() - ref[gemm]).norm() / ref[gemm].norm()).item(),
                               f"T={T} {gemm} {layout} {cfg}")
                if result is None:
                    continue
                ms, err = result
                rows.append(dict(tokens=T, gemm=gemm, layout=layout, ms=ms, rel_err=err, **cfg))
                if out_csv:
                    pd.DataFrame(rows).to_csv(out_csv, index=False)
    return t


def components(T, t):
    """Median replay times of the default layer's parts: alignment, gate_up, down, sum over k, whole layer."""
    cfg = pick_config(T, K_TOP, E)
    align = moe_align(t["ids"], E, cfg.block_m)
    act = torch.empty(align.num_blocks * cfg.block_m, I, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(T * K_TOP, H, device="cuda", dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(T, K_TOP, device="cuda"), -1).to(torch.bfloat16)
    sort = dict(a_sorted=cfg.sorted_act, a_tma=cfg.sorted_act and cfg.w_tma, half_tail=cfg.half_tail)
    parts = {  # the default tiles and layout
        "alignment": lambda: moe_align(t["ids"], E, cfg.block_m),
        "gate_up": lambda: moe_gemm(t["x"], t["w_gu"], act, align, gated=True, rows_are_tokens=True, top_k=K_TOP,
                                    config=cfg.tiles("gate_up"), w_tma=cfg.w_tma, out_sorted=cfg.sorted_act,
                                    half_tail=cfg.half_tail),
        "down": lambda: moe_gemm(act, t["w_d"], y, align, gated=False, rows_are_tokens=False, top_k=K_TOP,
                                 topk_weights=t["w"], config=cfg.tiles("down"), w_tma=cfg.w_tma, **sort),
        "sum over k": lambda: moe_sum(y.view(T, K_TOP, H)),
        "layer": lambda: fused_moe(t["x"], t["ids"], weights, t["w_gu"], t["w_d"]),
    }
    times = {name: time_graph(fn) for name, fn in parts.items()}
    flops = 2 * T * K_TOP * 3 * H * I
    print(f"T={T} components (ms): " + ", ".join(f"{k} {v:.4f}" for k, v in times.items())
          + f"; parts sum {sum(v for k, v in times.items() if k != 'layer'):.4f}; layer {flops / times['layer'] / 1e9:.0f} "
          f"TFLOP/s")
    a = torch.randn(T * K_TOP // 8, H, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(H, 3 * I * 8, device="cuda", dtype=torch.bfloat16)
    dense = time_graph(lambda: a @ b)
    print(f"T={T} dense cuBLAS GEMM of the same FLOPs ({a.shape[0]}x{H} @ {H}x{b.shape[1]}): {dense:.4f} ms, "
          f"{flops / dense / 1e9:.0f} TFLOP/s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="2048,4096,16384")
    parser.add_argument("--out", default=None)
    parser.add_argument("--group-m", default="8", help="comma-separated GROUP_M values to sweep")
    parser.add_argument("--lora", action="store_true", help="sweep the GEMMs with a per-expert LoRA expand")
    parser.add_argument("--layouts", default=None, help="with --lora: comma-separated layouts (default all)")
    args = parser.parse_args()
    group_ms = tuple(int(v) for v in args.group_m.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        if args.lora:
            lora_sweep(T, g, rows, args.out, args.layouts.split(",") if args.layouts else None)
            continue
        tensors = sweep(T, g, rows, args.out, group_ms)
        components(T, tensors)
    table = pd.DataFrame(rows)
    keys = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"]
    best = table.sort_values("ms").groupby(["tokens", "gemm", "layout"]).head(2)
    print(f"largest relative error against the einsum: {table['rel_err'].max():.2e}")
    print(best.sort_values(["tokens", "gemm", "ms"])[["tokens", "gemm", "layout", "ms", *keys]]
          .to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    for (T, gemm), group in table.groupby(["tokens", "gemm"]):
        best = group.loc[group["ms"].idxmin()]
        print(f"T={T} {gemm}: best {best['ms']:.4f} ms ({best['layout']}, "
              + "/".join(str(best[k]) for k in keys) + ")")
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
