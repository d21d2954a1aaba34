"""The Gated DeltaNet ops on the GPU at the published linear-attention widths, bf16: flash-linear-attention's
chunk_gated_delta_rule against our torch reference (and transformers' own torch path, which it copies), and fla's
causal conv1d against the torch F.conv1d one; each timed as eager calls and as CUDA-graph replays (the engine
replays graphs, where the torch path's ~5 launches per 64-token chunk cost no host time).

    python benchmarks/gated_delta.py [--iters 50] [--warmup 5]

Timing: after warm-up (Triton's compilation and autotuning included), each call between two CUDA events, the
median of --iters. Writes $OUT/gated_delta.json when OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F

from lora_eval.kernels.gated_delta import (_fla, causal_conv1d_fla, causal_conv1d_ref, gated_delta_rule,
                                           gated_delta_rule_ref)

D, W = 128, 4  # head dim (K = V) and conv width of every published Qwen3.5 / Qwen3-Next config
# (name, query/key heads, value heads, rows, tokens a row)
SHAPES = [("Qwen3.5-35B-A3B / Qwen3-Next-80B", 16, 32, 1, 4096),
          ("Qwen3.5-35B-A3B / Qwen3-Next-80B", 16, 32, 4, 1024),
          ("Qwen3.5-35B-A3B / Qwen3-Next-80B", 16, 32, 8, 300),
          ("issue 44's figure: 32 heads", 32, 32, 1, 4096),
          ("Qwen3.5-122B / 397B", 16, 64, 4, 1024)]


def median_ms(fn, iters: int, warmup: int, graph: bool) -> float | None:
    """Median ms of fn over iters calls (or replays of fn captured in a CUDA graph), each between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if graph:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                fn()
        except Exception as e:  # noqa: BLE001 - reported, the row goes on
            print(f"  capture failed: {type(e).__name__}: {str(e)[:120]}")
            return None
        fn = g.replay
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(gen, B, L, hk, hv):
    """bf16 q, k [B, L, hk, D], v [B, L, hv, D], beta [B, L, hv]; g float32 as the model computes it."""
    draw = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = draw(B, L, hk, D), draw(B, L, hk, D), draw(B, L, hv, D)
    A = torch.exp(torch.empty(hv).uniform_(math.log(1e-3), math.log(16), generator=gen))  # [hv]
    g = -A * F.softplus(draw(B, L, hv))  # [B, L, hv]
    beta = torch.sigmoid(draw(B, L, hv))  # [B, L, hv]
    return [t.to("cuda", torch.bfloat16) for t in (q, k, v)] + [g.cuda(), beta.to("cuda", torch.bfloat16)]


def transformers_torch_path():
    """transformers' torch_chunk_gated_delta_rule itself (unwrapped: with fla installed, 5.24 routes the name to
    fla). q and k go in repeated to the value heads, as transformers 5.17's model repeats them before the call (its
    function, unlike 5.24's, does not)."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next
    except ImportError:
        return None
    fn = inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule)

    def call(q, k, v, g, beta):
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)  # [B, L, Hv, K]
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

    return call


def row_invariance(gen, hk, hv, B, L):
    """max |row in the batch - row alone| for fla and the reference on the GPU."""
    q, k, v, g, beta = inputs(gen, B, L, hk, hv)
    found = {}
    for name, op in (("fla", gated_delta_rule), ("ref", gated_delta_rule_ref)):
        out = op(q, k, v, g, beta)[0]
        found[name] = max((op(*(t[b:b + 1] for t in (q, k, v, g, beta)))[0].float() - out[b:b + 1].float())
                          .abs().max().item() for b in range(B))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.is_available() and _fla() is not None, "needs CUDA and fla-core (pip install .[gpu])"
    import fla
    import triton

    device = torch.cuda.get_device_name()
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, fla=fla.__version__,
                flash_qla=importlib.util.find_spec("flash_qla") is not None, iters=args.iters, warmup=args.warmup)
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    hf = transformers_torch_path()
    gen = torch.Generator().manual_seed(0)
    rows = []
    torch.inference_mode().__enter__()  # as the engine runs: no autograd bookkeeping in fla's Function
    for name, hk, hv, B, L in SHAPES:
        q, k, v, g, beta = inputs(gen, B, L, hk, hv)
        C = 2 * hk * D + hv * D
        x = torch.randn(B, L, C, generator=gen).to("cuda", torch.bfloat16)  # [B, L, C]
        weight = (0.5 * torch.randn(C, W, generator=gen)).to("cuda", torch.bfloat16)  # [C, W]
        ops = {"gdr fla": lambda: gated_delta_rule(q, k, v, g, beta),
               "gdr ref": lambda: gated_delta_rule_ref(q, k, v, g, beta),
               "conv fla": lambda: causal_conv1d_fla(x, weight),
               "conv torch": lambda: causal_conv1d_ref(x, weight)}
        if hf is not None:
            ops["gdr transformers"] = lambda: hf(q, k, v, g, beta)
        for op, fn in ops.items():
            row = dict(shape=name, hk=hk, hv=hv, B=B, L=L, op=op)
            try:
                row.update(eager_ms=median_ms(fn, args.iters, args.warmup, graph=False),
                           graph_ms=median_ms(fn, args.iters, args.warmup, graph=True))
            except Exception as e:  # noqa: BLE001 - one op failing leaves the others' figures
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            write(meta, rows)
            where = f"{name:34s} {hk:2d}/{hv:2d} heads {B} x {L:4d}  {op:17s}"
            if "error" in row:
                print(f"{where} failed: {row['error']}", flush=True)
                continue
            graph = "n/a" if row["graph_ms"] is None else f"{row['graph_ms']:.3f}"
            print(f"{where} eager {row['eager_ms']:.3f} ms  graph {graph} ms", flush=True)
        del q, k, v, g, beta, x, weight
        torch.cuda.empty_cache()
    invariance = row_invariance(gen, 16, 32, 8, 300)
    print(f"row alone vs in a batch of 8 x 300, max |d|: {invariance}")
    write(meta, rows, row_invariance_8x300=invariance)


def write(meta, rows, **more):
    """$OUT/gated_delta.json after every row, so that a run cut short keeps what it measured."""
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gated_delta.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows, **more), f, indent=1)


if __name__ == "__main__":
    main()
