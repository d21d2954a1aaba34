"""Programmatic dependent launch (PDL) in CUDA-graph replays: a chain of small dependent Triton kernels (a
[T, H] row normalisation, each reading the previous one's output) captured with and without PDL, time per
kernel; and whether the chain's numbers stay the same.

    python benchmarks/pdl_probe.py [--tokens 128,4096] [--chain 200]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def step_kernel(x_ptr, y_ptr, H, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (cols < H)[None, :]
    x = tl.load(x_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + 1e-6)
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], (x * inv[:, None] * 1.01).to(y_ptr.dtype.element_ty),
             mask=mask)


def chain(x, bufs, n, pdl):
    a = x
    for i in range(n):
        b = bufs[i % 2]
        step_kernel[(x.shape[0] // 4,)](a, b, x.shape[1], ROWS=4, BLOCK_H=triton.next_power_of_2(x.shape[1]),
                                       USE_GDC=pdl, launch_pdl=pdl, num_warps=4)
        a = b
    return a


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--chain", type=int, default=200)
    args = parser.parse_args()
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        outs = {}
        for pdl in (False, True):
            bufs = [torch.empty_like(x), torch.empty_like(x)]
            chain(x, bufs, 2, pdl)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(x, bufs, args.chain, pdl)
            graph.replay()
            torch.cuda.synchronize()
            outs[pdl] = out.clone()
            ms = triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median")
            print(f"T={T} pdl={pdl}: {1000 * ms / args.chain:.2f} us per kernel")
        print(f"T={T}: same numbers with and without PDL: {torch.equal(outs[False], outs[True])}")


if __name__ == "__main__":
    main()
