"""Compile kernels for an H100 (sm_90) on a machine without a GPU: a stand-in Triton driver whose launches do
nothing, so a whole fused MoE layer's launches go through Triton's real compiler (TTIR -> PTX -> ptxas) and its
shared-memory check against the H100's 227 KB — the GPU-only paths (TMA descriptors, wgmma pipelines) that the
interpreter never compiles. Run as a script without TRITON_INTERPRET (test_sm90_compile.py does):

    python tests/kernels/sm90_compile.py CASE      (CASE: a key of CASES, gluon-gemms, dense-lora-partials,
                                                   prefix-attention, batch-invariant, batch-shapes or
                                                   compile-clock;
                                                   prints one line per compiled kernel)
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import replace

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

H100_SHARED = 232448  # bytes of shared memory one block may use on an H100 (227 KB)


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": H100_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    def load_binary(self, name, kernel, shared, device):
        # the binary's digest: a refactor that must not change the code compares it before and after (with
        # TRITON_DISABLE_LINE_INFO=1, as line numbers are part of the binary)
        print(f"compiled {name}: {shared} bytes of shared memory, cubin {hashlib.sha256(kernel).hexdigest()[:16]}",
              flush=True)
        return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads


class StandInHopper:
    """The parts of Triton's CUDA driver a launch touches, for an sm_90 target; launches do nothing."""
    utils = _Utils()

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def _layer(T: int, config_change: dict, R: int = 16, shared_outer: bool = False, hopper: bool = False):
    """One fused MoE layer at Qwen3-30B-A3B shapes with a rank-R LoRA, 4 adapter slots: per-expert factors (PEFT's
    layout) or shared_outer (gate_up A and down B shared by all experts). hopper: the host checks see a Hopper GPU
    (the Gluon kernels' conditions apply)."""
    from lora_eval.adapters.stack import ExpertLoRA
    from lora_eval.kernels import fused_moe as fm
    from lora_eval.kernels import moe_gemm_gluon as mg

    if hopper:
        mg.on_hopper = lambda t: True
    E, k, H, I, S = 128, 8, 2048, 768, 4
    bf16 = dict(dtype=torch.bfloat16)
    Ea = 1 if shared_outer else E
    lora = ExpertLoRA(gate_up_A=torch.empty(S, Ea, 2 * R, H, **bf16),
                      gate_up_B=torch.empty(S, E, 2 * I, 2 * R, **bf16), down_A=torch.empty(S, E, R, I, **bf16),
                      down_B=torch.empty(S, Ea, H, R, **bf16), slots=frozenset(range(S)))
    config = replace(fm.pick_config(T, k, E), **config_change)
    x = torch.empty(T, H, **bf16)
    ids = torch.zeros(T, k, dtype=torch.long)
    weights = torch.empty(T, k, **bf16)
    w_gu, w_d = torch.empty(E, 2 * I, H, **bf16), torch.empty(E, H, I, **bf16)
    slots = torch.zeros(T, dtype=torch.long)
    fm.fused_moe(x, ids, weights, w_gu, w_d, lora, slots, config=config)


def _gluon_gemms(T: int):
    """Both persistent Gluon GEMMs (kernels/moe_gemm_gluon.py) at Qwen3-30B-A3B shapes."""
    from lora_eval.kernels import moe_gemm_gluon as mg
    from lora_eval.kernels.moe_align import MoeAlignment
    from lora_eval.kernels.tiles import GLUON_BLOCK_M

    E, k, H, I, BM = 128, 8, 2048, 768, GLUON_BLOCK_M
    blocks = T * k // BM + E
    align = MoeAlignment(sorted_pairs=torch.zeros(blocks * BM, dtype=torch.int32),
                         block_expert=torch.zeros(blocks, dtype=torch.int32), block_slot_lo=None, block_slot_hi=None,
                         token_slots=None, num_padded=torch.zeros(1, dtype=torch.int32), block_m=BM, num_pairs=T * k)
    bf16 = dict(dtype=torch.bfloat16)
    act = torch.empty(blocks * BM, I, **bf16)
    x, w_gu = torch.empty(T, H, **bf16), torch.empty(E, 2 * I, H, **bf16)
    mg.moe_gate_up_gluon(x, w_gu, act, align, k)
    align.token_slots = torch.zeros(T, dtype=torch.long)
    align.block_slot_lo = align.block_slot_hi = torch.zeros(blocks, dtype=torch.int32)
    for by_token, R in ((False, 32), (True, 16)):  # per-expert A (PEFT: gate and up stacked), a shared A
        # (by token: dense_lora_shrink's float32 partial sums)
        shrunk = torch.empty(T, R, dtype=torch.float32) if by_token else torch.empty(blocks * BM, R, **bf16)
        mg.moe_gate_up_gluon(x, w_gu, act, align, k, (shrunk, torch.empty(4, E, 2 * I, R, **bf16), by_token))
    down = (act, torch.empty(E, H, I, **bf16), torch.empty(T * k, H, **bf16), align, k, torch.empty(T * k, **bf16))
    mg.moe_down_gluon(*down)
    for R in (16, 32):  # a per-expert down B (its expand), the pair shrink of a shared one (4 slots x 16)
        mg.moe_down_gluon(*down, lora=(torch.empty(blocks * BM, R, **bf16), torch.empty(4, E, H, R, **bf16)))
    mg.moe_down_gluon(*down, pair_shrink=(torch.empty(4, E, 16, I, **bf16), torch.empty(T * k, 16, **bf16)))


def _dense_consumers(T: int = 128):
    """Every consumer of a dense LoRA shrink at MAX_SPLITS partial sums, Qwen3-30B-A3B shapes (bf16): the expand
    and o_proj's residual add (the router's top-k and q/k's norm + RoPE took one too, until their expands moved out:
    issues #23 and 41)."""
    from lora_eval.kernels.dense_lora import dense_lora_expand, lora_residual_add
    from lora_eval.kernels.lora_meta import lora_metadata
    from lora_eval.kernels.tiles import MAX_SPLITS

    R, S = 16, 4
    bf16 = dict(dtype=torch.bfloat16)
    parts = torch.empty(MAX_SPLITS, T, R)
    meta = lora_metadata(torch.arange(T) % (S + 1) - 1, S)
    dense_lora_expand(torch.empty(T, 4096, **bf16), parts, torch.empty(S, 4096, R, **bf16), meta)
    lora_residual_add(torch.empty(T, 2048, **bf16), torch.empty(T, 2048, **bf16), parts,
                      torch.empty(S, 2048, R, **bf16), meta)


def _prefix_attention():
    """The prefixed attention at Qwen3-30B-A3B's heads (32 query heads over 4, head dim 128) and MLA's (query/key
    192, value 128), bf16."""
    from lora_eval.kernels.prefix_attention import one_prefix, prefix_attention

    bf16 = dict(dtype=torch.bfloat16)
    for nh, nkv, D, DV in ((32, 4, 128, 128), (16, 16, 192, 128)):
        q, k = torch.empty(8, nh, 100, D, **bf16), torch.empty(8, nkv, 100, D, **bf16)
        v = torch.empty(8, nkv, 100, DV, **bf16)
        prefix_attention(q, k, v, torch.empty(8, nh, 100, DV, **bf16), torch.arange(8), D ** -0.5,
                         one_prefix(torch.empty(nkv, 600, D, **bf16), torch.empty(nkv, 600, DV, **bf16), 8, "cpu"))
    q, k = torch.empty(8, 64, 100, 64, **bf16), torch.empty(8, 8, 100, 64, **bf16)  # GPT-OSS: sinks, window
    prefix_attention(q, k, k, torch.empty_like(q), torch.arange(8), 0.125, sinks=torch.empty(64, **bf16), window=128)


def _batch_invariant():
    """The batch-invariant mode's GEMM at Qwen3-30B-A3B's q projection, in bf16 and float32."""
    from lora_eval.kernels.matmul import matmul

    for dtype in (torch.bfloat16, torch.float32):
        matmul(torch.empty(300, 2048, dtype=dtype), torch.empty(4096, 2048, dtype=dtype),
               torch.empty(4096, dtype=dtype))


def _batch_shapes():
    """Batches of varying shape, as MMLU and compare make (token counts, pair counts, sequence and prefix lengths
    of every divisibility class by 16): each kernel must compile once, not once per class (kernels/__init__.py)."""
    from lora_eval.kernels.head_norm_rope import head_norm_rope
    from lora_eval.kernels.logprobs import token_logprobs
    from lora_eval.kernels.matmul import matmul
    from lora_eval.kernels.prefix_attention import one_prefix, prefix_attention
    from lora_eval.kernels.rms_norm import rms_norm
    from lora_eval.kernels.router import router_topk

    bf16 = dict(dtype=torch.bfloat16)
    for T in (3001, 3008, 3010, 4000):  # pairs per expert 188-250: one MoeConfig
        _layer(T, {})
        rms_norm(torch.empty(T, 2048, **bf16), torch.empty(2048, **bf16), 1e-6)
        router_topk(torch.empty(T, 128), 8, True)
        matmul(torch.empty(T, 2048, **bf16), torch.empty(512, 2048, **bf16))
        token_logprobs(torch.empty(T, 2048, **bf16), torch.empty(4096, 2048, **bf16), torch.zeros(T, dtype=torch.long),
                       v_splits=8)
    for T in (127, 128, 130):
        _dense_consumers(T)
        cos = sin = torch.empty(1, T, 128, **bf16)
        head_norm_rope(torch.empty(T, 32 * 128, **bf16), torch.empty(128, **bf16), 1e-6, cos, sin)
    for L, P in ((100, 600), (112, 601), (113, 608)):
        q, k = torch.empty(8, 32, L, 128, **bf16), torch.empty(8, 4, L, 128, **bf16)
        prefix_attention(q, k, k, torch.empty_like(q), torch.arange(8), 0.1,
                         one_prefix(torch.empty(4, P, 128, **bf16), torch.empty(4, P, 128, **bf16), 8, "cpu"))


def _compile_clock():
    """runners/compile_clock.py through real compiles: a hook set before it still runs; a compile counts; one
    inside `paused` does not."""
    from triton import knobs

    from lora_eval.kernels.rms_norm import rms_norm
    from lora_eval.kernels.router import router_topk
    from lora_eval.runners.compile_clock import COMPILE_CLOCK

    seen = []
    knobs.runtime.jit_cache_hook = lambda *args, **kwargs: seen.append(kwargs["fn"].name)
    COMPILE_CLOCK.install()
    COMPILE_CLOCK.install()  # once per process
    rms_norm(torch.empty(300, 2048, dtype=torch.bfloat16), torch.empty(2048, dtype=torch.bfloat16), 1e-6)
    with COMPILE_CLOCK.paused():
        router_topk(torch.empty(300, 128), 8, True)
    print(f"clock: {COMPILE_CLOCK.compiles} compiles, {COMPILE_CLOCK.seconds:.6f} s; earlier hook saw {seen}")


CASES = {  # name: (tokens, MoeConfig changes, rank, shared_outer)
    "moe-4096": (4096, {}, 16, False),  # gathered activation rows, TMA weights, half-height tails, expand first
    "moe-8192": (8192, {}, 16, False),  # block-ordered activation through TMA, half-height tails, expand first
    "moe-8192-no-half-tail": (8192, {"half_tail": False}, 16, False),  # a TMA activation without half tails
    # rank 32 (gate and up: 64) overflowed shared memory before gemm_stages; the shared-outer down GEMM's pair
    # shrink with 4 slots x 32 side by side too
    "moe-64-rank-32": (64, {}, 32, False),
    "moe-4096-rank-32-shared-outer": (4096, {}, 32, True),
    "moe-8192-rank-32": (8192, {}, 32, False),
    # rank 64 (gate and up: 128) was refused above 1024 tokens; the expand now steps over two rank chunks of 64
    "moe-2048-rank-64": (2048, {}, 64, False),
    "moe-8192-rank-64-shared-outer": (8192, {}, 64, True),
}
HOPPER_CASES = {  # name: (LoRA rank, shared_outer); the 8192-token layer with the Gluon kernels' conditions
    "moe-8192-gluon-rank-16": (16, False),  # gate_up (gate and up: rank 32) and down's expand in Gluon
    "moe-8192-gluon-rank-32": (32, False),  # gate and up: 64, beyond MAX_EXPAND_RANK: gate_up stays in moe_gemm
    "moe-8192-gluon-shared-outer": (16, True),  # both in Gluon, down with the pair shrink (4 slots x 16)
}

if __name__ == "__main__":
    driver.set_active(StandInHopper())
    if sys.argv[1] != "compile-clock":  # as the engine runs: Triton's JIT hooks set (runners/compile_clock.py)
        from lora_eval.runners.compile_clock import COMPILE_CLOCK

        COMPILE_CLOCK.install()
    if sys.argv[1] == "gluon-gemms":
        _gluon_gemms(8192)
    elif sys.argv[1] == "dense-lora-partials":
        _dense_consumers()
    elif sys.argv[1] == "prefix-attention":
        _prefix_attention()
    elif sys.argv[1] == "batch-invariant":
        _batch_invariant()
    elif sys.argv[1] == "batch-shapes":
        _batch_shapes()
    elif sys.argv[1] == "compile-clock":
        _compile_clock()
    elif sys.argv[1] in HOPPER_CASES:
        rank, shared_outer = HOPPER_CASES[sys.argv[1]]
        _layer(8192, {}, rank, shared_outer, hopper=True)
    else:
        tokens, change, rank, shared_outer = CASES[sys.argv[1]]
        _layer(tokens, change, rank, shared_outer)
