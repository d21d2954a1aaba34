"""LoRA overhead of the fused MoE layer for launch settings of the per-block LoRA shrink (warps, pipeline stages,
shared-memory budget for its K step; kernels/fused_moe.py SHRINK_*). CUDA-graph replays, Qwen3-30B-A3B shapes.

    python benchmarks/moe_shrink_sweep.py
"""
import sys; sys.path.insert(0, "benchmarks")
import torch, triton
from moe_layer import E, H, I, K_TOP, RANK, SLOTS, inputs
from lora_eval.adapters.stack import ExpertLoRA
from lora_eval.kernels import fused_moe as fm
from lora_eval.kernels.dense_lora import lora_metadata
g = torch.Generator(device="cuda").manual_seed(0); bf = torch.bfloat16
w_gu = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5).to(bf)
w_d = (torch.randn(E, H, I, generator=g, device="cuda") / I**0.5).to(bf)
lora = ExpertLoRA(gate_up_A=(0.02 * torch.randn(SLOTS, 1, 2 * RANK, H, generator=g, device="cuda")).to(bf),
    gate_up_B=(0.02 * torch.randn(SLOTS, E, 2 * I, 2 * RANK, generator=g, device="cuda")).to(bf),
    down_A=(0.02 * torch.randn(SLOTS, E, RANK, I, generator=g, device="cuda")).to(bf),
    down_B=(0.02 * torch.randn(SLOTS, 1, H, RANK, generator=g, device="cuda")).to(bf), slots=frozenset(range(SLOTS)))
for T in [64, 1024, 2048, 4096, 16384]:
    x, ids, w = inputs(T, g); slots = torch.randint(0, SLOTS, (T,), generator=g, device="cuda"); meta = lora_metadata(slots, SLOTS)
    base = lambda: fm.fused_moe(x, ids, w, w_gu, w_d); base()
    b = triton.testing.do_bench_cudagraph(base, rep=100, return_mode="median")
    res = []
    for warps, stages, smem in ((4, 3, 160), (8, 3, 160), (4, 4, 200), (8, 2, 100), (4, 2, 100)):
        fm.SHRINK_WARPS, fm.SHRINK_STAGES, fm.SHRINK_SMEM = warps, stages, smem * 1024
        fn = lambda: fm.fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta)
        fn(); v = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        res.append(f"w{warps}s{stages}m{smem} {v/b:.3f}")
    print(T, f"base {b:.4f}", " ".join(res), flush=True)
