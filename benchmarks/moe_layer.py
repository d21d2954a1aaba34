"""One MoE layer at Qwen3-30B-A3B shapes on the GPU: our Triton fused MoE (base and with LoRA) beside a
transformers' own `grouped_mm` experts module (Qwen3MoeExperts, torch._grouped_mm) holding the same
weights, in the same run.

    python benchmarks/moe_layer.py [--out results.csv] [--tokens 64,1024] [--eager]

E=128 experts, top-8, H=2048, I=768, bf16; LoRA rank 16 on gate_up and down, 4 adapters, every token under
one of them. TFLOP/s counts the expert GEMMs only: 2 * M * k * 3 * H * I. The memory floor is every
touched expert's weights read once at the measured device-to-device copy bandwidth. Each layer is timed as
CUDA-graph replays (median), so host launch gaps of the small ops around the GEMMs do not count; `--eager`
times plain calls instead. The LoRA layer gets the batch's rows-by-slot metadata precomputed, as in the engine,
where one copy serves every layer of a forward.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
import triton

from lora_eval.adapters.stack import ExpertLoRA
from lora_eval.kernels.fused_moe import fused_moe, fused_moe_ref, pick_config
from lora_eval.kernels.lora_meta import lora_metadata
from lora_eval.kernels.moe_align import moe_align

E, K_TOP, H, I, RANK, SLOTS = 128, 8, 2048, 768, 16, 4
TOKENS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def grouped_mm_layer(x, topk_ids, topk_weights, w_gate_up, w_down):
    """The transformers v5 `grouped_mm` experts forward, written out (used only where transformers' own
    module cannot be built)."""
    T, k = topk_ids.shape
    expert = topk_ids.reshape(-1)
    expert_sorted, perm = torch.sort(expert)
    offs = torch.cumsum(torch.histc(expert_sorted.int(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
    xs = x[perm // k]  # [P, H]
    gu = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)  # [P, 2I]
    act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    y = torch._grouped_mm(act, w_down.transpose(-2, -1), offs=offs)  # [P, H]
    y = y * topk_weights.reshape(-1)[perm, None]
    out = torch.empty_like(y)
    out[perm] = y
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def transformers_layer(w_gate_up, w_down):
    """(callable, name): transformers' own Qwen3MoeExperts with `experts_implementation="grouped_mm"`
    holding our weights, or the written-out copy above when this transformers cannot build it."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(num_experts=E, num_experts_per_tok=K_TOP, hidden_size=H, moe_intermediate_size=I)
        config._experts_implementation = "grouped_mm"
        experts = Qwen3MoeExperts(config).to("cuda", torch.bfloat16)
        experts.gate_up_proj.data, experts.down_proj.data = w_gate_up, w_down
        if getattr(experts, "has_gate", None) is None:
            raise RuntimeError("this transformers has no experts_implementation switch")
        return (lambda x, ids, w: experts(x, ids, w)), "transformers Qwen3MoeExperts (grouped_mm)"
    except Exception as e:  # noqa: BLE001 - say so and use the written-out copy
        print(f"transformers' experts module unavailable ({type(e).__name__}: {e}); using the written-out copy")
        return (lambda x, ids, w: grouped_mm_layer(x, ids, w, w_gate_up, w_down)), "written-out grouped_mm"


def config_label(cfg) -> str:
    """BLOCK_M | gate_up tiles | down tiles (BLOCK_N/BLOCK_K/warps/stages) and the operand layout."""
    tiles = ["{BLOCK_N}/{BLOCK_K}/w{num_warps}/s{num_stages}".format(**getattr(cfg, g)) for g in ("gate_up", "down")]
    layout = "+".join(n for n, on in (("w_tma", cfg.w_tma), ("sorted_act", cfg.sorted_act)) if on) or "ptr"
    return f"{cfg.block_m}|{tiles[0]}|{tiles[1]}|{layout}"


def layer_weights(g):
    """bf16 expert weights w_gate_up [E, 2I, H], w_down [E, H, I] and a SLOTS-adapter rank-RANK expert LoRA in the
    shared-outer layout (gate_up A and down B shared by all experts; gate and up joined at rank 2R)."""
    def randn(*shape, scale=0.02):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    lora = ExpertLoRA(gate_up_A=randn(SLOTS, 1, 2 * RANK, H), gate_up_B=randn(SLOTS, E, 2 * I, 2 * RANK),
                      down_A=randn(SLOTS, E, RANK, I), down_B=randn(SLOTS, 1, H, RANK), slots=frozenset(range(SLOTS)))
    return randn(E, 2 * I, H, scale=H**-0.5), randn(E, H, I, scale=I**-0.5), lora


def inputs(T, g):
    dev = "cuda"
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g, device=dev)
    w, ids = torch.topk(logits.softmax(-1), K_TOP)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    return x, ids, w


def timer(eager: bool):
    """Median ms of fn: eager calls, or replays of fn captured in a CUDA graph (falls back to eager)."""
    def measure(fn):
        if not eager:
            try:
                return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001 - report and time eagerly
                print(f"graph capture failed ({type(e).__name__}: {e}); timing eagerly")
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return measure


def _float(lora):
    return ExpertLoRA(**{n: getattr(lora, n).float() for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")},
                      slots=lora.slots)


def bandwidth_gbs():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    return 2 * a.numel() / ms / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--eager", action="store_true", help="time eager calls instead of graph replays")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS
    bench = timer(args.eager)
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu, w_d, lora = layer_weights(g)
    bw = bandwidth_gbs()
    baseline, baseline_name = transformers_layer(w_gu, w_d)
    rows = []
    for T in tokens:
        x, ids, w = inputs(T, g)
        slots = torch.randint(0, SLOTS, (T,), generator=g, device="cuda")
        meta = lora_metadata(slots, SLOTS)  # per batch, shared by every layer in the engine
        ref = fused_moe_ref(x.float(), ids, w.float(), w_gu.float(), w_d.float())
        err = ((fused_moe(x, ids, w, w_gu, w_d).float() - ref).norm() / ref.norm()).item()
        err_gmm = ((baseline(x, ids, w).float() - ref).norm() / ref.norm()).item()
        ref_lora = fused_moe_ref(x.float(), ids, w.float(), w_gu.float(), w_d.float(), _float(lora), slots)
        out_lora = fused_moe(x, ids, w, w_gu, w_d, lora, slots, lora_meta=meta).float()
        err_lora = ((out_lora - ref_lora).norm() / ref_lora.norm()).item()
        cfg = pick_config(T, K_TOP, E)
        fused_moe(x, ids, w, w_gu, w_d, config=cfg)  # compile outside the capture
        ms_base = bench(lambda: fused_moe(x, ids, w, w_gu, w_d, config=cfg))
        fused_moe(x, ids, w, w_gu, w_d, lora, slots, config=cfg, lora_meta=meta)
        ms_lora = bench(lambda: fused_moe(x, ids, w, w_gu, w_d, lora, slots, config=cfg, lora_meta=meta))
        ms_gmm = bench(lambda: baseline(x, ids, w))
        ms_align = bench(lambda: moe_align(ids, E, cfg.block_m))
        ms_align_lora = bench(lambda: moe_align(ids, E, cfg.block_m, slots, SLOTS))
        flops = 2 * T * K_TOP * 3 * H * I
        touched = torch.unique(ids).numel()
        floor_ms = touched * 3 * H * I * 2 / (bw * 1e6)
        rows.append(dict(tokens=T, base_ms=ms_base, lora_ms=ms_lora, grouped_mm_ms=ms_gmm,
                         base_tflops=flops / ms_base / 1e9, grouped_mm_tflops=flops / ms_gmm / 1e9,
                         speedup_vs_grouped_mm=ms_gmm / ms_base, lora_overhead=ms_lora / ms_base,
                         weight_floor_ms=floor_ms, base_over_floor=ms_base / floor_ms, align_ms=ms_align,
                         align_lora_ms=ms_align_lora, rel_err=err, rel_err_lora=err_lora, rel_err_grouped_mm=err_gmm, config=config_label(cfg)))
        print(pd.DataFrame(rows[-1:]).to_string(index=False, float_format=lambda v: f"{v:.3g}"), flush=True)
    table = pd.DataFrame(rows)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {bw:.0f} GB/s, timed as {'eager calls' if args.eager else 'CUDA-graph replays'}, "
          f"baseline: {baseline_name}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
