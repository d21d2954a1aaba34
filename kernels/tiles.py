"""Tile and launch tables of every Triton kernel (kernels/*.py), each value with one line naming the
BENCHMARKS-history.md section that chose it (section 18.1: the figures these comments carried until issue 43). The ops
read their defaults here and take other settings as arguments (a benchmark sweeping tiles passes them in); nothing
assigns to these names at run time."""

from __future__ import annotations

from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------- fused MoE (fused_moe.py)

# the per-block shrink's defaults (MoeConfig.shrink): BENCHMARKS-history 1, "LoRA slot strategies"
MOE_SHRINK_TILES = dict(BLOCK_K=256, num_warps=4, num_stages=3)
# widest side-by-side shrink pass over a block's slots (slots x padded rank; else a pass per slot): BENCHMARKS-history 1
ALL_SLOTS_MAX = 128


@dataclass(frozen=True)
class MoeConfig:
    """Launch settings of one fused MoE call. `block_m` is shared (one alignment serves both GEMMs); `gate_up`
    and `down` hold each GEMM's BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages. `w_tma`: the expert weights
    load through TMA tensor descriptors; `sorted_act`: the gate_up GEMM writes the activation in block order
    and the down GEMM reads it by block row (through a descriptor too when `w_tma`). Both fall back to
    pointer loads where TMA is not available (before Hopper, or a tensor TMA cannot describe). `expand_first`: the
    GEMMs add the LoRA delta into their accumulators before the main loop instead of after it. `half_tail`: a
    block with pairs in its first half only (an expert group's last block) computes half the rows. `pair_shrink`:
    with a down B shared by all experts, the down GEMM's N tile 0 computes the down LoRA shrink from the activation
    tiles it loads anyway (else a separate shrink kernel reads the activation again). `shrink`: by GEMM ("gate_up",
    "down"), the per-block LoRA shrink's launch settings over MOE_SHRINK_TILES (its BLOCK_K the longest step tried).
    `gluon`: the GEMMs run as persistent Gluon kernels (kernels/moe_gemm_gluon.py) where they can (a Hopper GPU, the
    block-ordered activation, no bias; gate_up: SiLU gate, its LoRA expand up to rank 32 (gate and up together);
    down: its LoRA expand up to rank 32, or the pair shrink with slots x rank up to 64), else moe_gemm.
    `all_slots_max`: the widest side-by-side pass over the adapter slots (ALL_SLOTS_MAX: the per-block shrink's
    and the pair shrink's)."""
    block_m: int
    gate_up: dict
    down: dict
    w_tma: bool = False
    sorted_act: bool = False
    expand_first: bool = False
    half_tail: bool = False
    pair_shrink: bool = False
    shrink: dict = field(default_factory=dict)
    gluon: bool = False
    all_slots_max: int = ALL_SLOTS_MAX

    def tiles(self, gemm: str) -> dict:
        return dict(BLOCK_M=self.block_m, **getattr(self, gemm))

    def shrink_tiles(self, gemm: str) -> dict:
        return {**MOE_SHRINK_TILES, **self.shrink.get(gemm, {})}


def _tiles(n, k, warps, stages, group_m=8):
    return dict(BLOCK_N=n, BLOCK_K=k, GROUP_M=group_m, num_warps=warps, num_stages=stages)


# the per-block shrinks' settings at 128-row blocks: BENCHMARKS-history 3, "Per-GEMM launch settings"
_SHRINK_128 = {"gate_up": dict(num_stages=4), "down": dict(BLOCK_K=64)}
# By most pairs per expert (T * k / E); the tiles: the tile x layout sweep, BENCHMARKS-history 1 (`tiles.py moe`)
MOE_CONFIGS = {
    # the LoRA switches within noise at 16-row blocks: BENCHMARKS-history 1
    16: MoeConfig(16, gate_up=_tiles(128, 128, 8, 4), down=_tiles(128, 128, 8, 4)),
    # TMA weights, the expand before the main loop: BENCHMARKS-history 1
    64: MoeConfig(64, gate_up=_tiles(64, 64, 4, 3), down=_tiles(128, 64, 4, 4), w_tma=True, expand_first=True),
    # half-height tails and the pair shrink at 128-row blocks: BENCHMARKS-history 1
    256: MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True, expand_first=True,
                   half_tail=True, pair_shrink=True, shrink=_SHRINK_128),
    # the block-ordered activation and the Gluon GEMMs from 8192 tokens: BENCHMARKS-history 1
    None: MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True, sorted_act=True,
                    expand_first=True, half_tail=True, pair_shrink=True, shrink=_SHRINK_128, gluon=True),
}

MOE_SHRINK_SMEM = 160 * 1024  # bytes for the LoRA shrink's pipelined tiles: stages x (BLOCK_M + BLOCK_R) x BLOCK_K
GEMM_SMEM = 227 * 1024  # shared memory one block of the grouped GEMM may use (H100 / H200)

SUM_BLOCKS = dict(BLOCK_H=1024, num_warps=4)  # columns per program of the sum over k (one token per program)
SUM_LORA_BLOCKS = dict(BLOCK_T=16, BLOCK_H=256, num_warps=4)  # tokens x columns per program with a LoRA expand

# ------------------------------------------------------------------------------------ MoE alignment (moe_align.py)

ALIGN_BLOCK = 1024  # pairs per program of both kernels
ALIGN_BLOCKS = 64  # aligned blocks per program whose maps the place kernel writes

# --------------------------------------------------------------------- persistent Gluon GEMMs (moe_gemm_gluon.py)

# no sweep of these tiles recorded; the GEMMs against moe_gemm: BENCHMARKS-history 1 (ninth session)
GLUON_BLOCK_M, GLUON_BLOCK_K, GLUON_NUM_BUFFERS, GLUON_NUM_WARPS = 128, 64, 4, 8  # BLOCK_M: the alignment's block rows
GLUON_GATE_UP_BLOCK_N, GLUON_DOWN_BLOCK_N = 128, 256  # gate_up holds two accumulators (gate, up)
GLUON_PAIR_SHRINK_WIDE = 64  # down's pair shrink: adapter slots x padded rank side by side (one wgmma's N)

# ------------------------------------------------------------------------------------ dense LoRA (dense_lora.py)

# shrink and expand tiles: BENCHMARKS-history 3, "Dense LoRA tiles" (`tiles.py dense`)
DENSE_LORA_BLOCKS = {
    "shrink": dict(BLOCK_M=64, BLOCK_K=256, num_warps=4, num_stages=4),  # grid (cdiv(T, BLOCK_M), S)
    "expand": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1),  # grid (cdiv(T, BM), cdiv(out, BN), S)
}
DENSE_SHRINK_SMEM = 160 * 1024  # bytes: num_stages * (BLOCK_M + BLOCK_R) * BLOCK_K * element size (BLOCK_K halves)
# the shrink's split of `in` (dense_lora.shrink_splits): BENCHMARKS-history 3, "The dense shrink splits"
SPLIT_MIN_K, MAX_SPLITS = 128, 16
# rows x columns per program of lora_residual_add, grid (cdiv(T, BLOCK_M), cdiv(out, BLOCK_N))
RESIDUAL_BLOCKS = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4)

# --------------------------------------------------------------------------- head norm + RoPE (head_norm_rope.py)

# grid (cdiv(T, TOKENS_PER_PROGRAM), heads): BENCHMARKS-history 3 (`tiles.py dense --sections head-norm`)
TOKENS_PER_PROGRAM = 32

# ------------------------------------------------------------- batch-invariant mode (--batch-invariant, issue #23)

# Every launch setting that otherwise follows the batch's size is fixed, so that a row's result does not depend on
# the rows around it or the padding (engine/forward.py `invariant`); the split counts sit inside the ranges the
# default picks by batch size (shrink 1-16, vocabulary 1-594). The fused MoE: MOE_CONFIGS' 128-row blocks less the
# choices that would change a row's sums — the side-by-side shrink of a block's slots (all_slots_max 0: one pass per
# slot, the same dot for a row whatever slots share its block) and the Gluon GEMMs of the largest batches. The
# half-height tile of an expert's half-empty last block (half_tail) and the down shrink inside the down GEMM
# (pair_shrink) stay: the same K steps in the same order. Its cost: BENCHMARKS.md "cost of `--batch-invariant`".
# half_tail and pair_shrink kept, bit-equal and faster: BENCHMARKS-history 12
INVARIANT_MOE = MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True,
                          expand_first=True, half_tail=True, pair_shrink=True, shrink=_SHRINK_128, all_slots_max=0)
INVARIANT_SHRINK_SPLITS = 4  # the dense LoRA shrink's partial sums over `in` (else shrink_splits, by batch size)
INVARIANT_VOCAB_SPLITS = 8  # the fused logprobs' vocabulary splits (else logprobs.split_vocab, by rows)
# The dense projections' GEMM (matmul.py) in place of cuBLAS, whose kernel choice follows the batch's size; the tiles
# follow the weight's shape and dtype alone, never the batch. 128-wide tiles for outputs narrower than 256 (the
# router) and in float32, whose 256-wide tiles would exceed the 227 KB of shared memory.
# 256-wide tiles through TMA on a persistent grid: BENCHMARKS-history 12, `tiles.py matmul`
MATMUL_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True,
                    PERSISTENT=True)
MATMUL_NARROW = dict(BLOCK_N=128)  # outputs narrower than 256, and float32: BENCHMARKS-history 12

# --------------------------------------------------------------------- prefixed attention (prefix_attention.py)

# query rows x keys per step; a program's query rows are heads x positions (prefix_attention.heads_per_program).
# `tiles.py attention`: BENCHMARKS-history 8 and 11 (BENCHMARKS.md "prefixed attention (#24)")
PREFIX_ATTENTION_TILES = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)

# ------------------------------------------------------------------------ router, RMSNorm, RoPE (router.py, ...)

# Each the fastest of `tiles.py small` at 4096 and 16384 tokens: BENCHMARKS.md "router top-k, RMSNorm, RoPE rows per
# program", BENCHMARKS-history 11 (the figures: 18.1)
ROUTER_ROWS_PER_PROGRAM = 4  # rows per program of router_topk (router.py)
RMS_NORM_ROWS_PER_PROGRAM = 1  # rows per program of rms_norm (rms_norm.py): at the speed of a copy
POSITIONS_PER_PROGRAM = 1  # positions per program of rope (rope.py): at the speed of a copy

# --------------------------------------------------------------------------- lm_head log-probs (logprobs.py)

# Block sizes and launch parameters (the only tuning knobs) of token_logprobs:
#   BLOCK_N        rows of hidden per program
#   BLOCK_V        vocab entries per logits tile
#   BLOCK_H        reduction step over the hidden dim
#   NUM_STAGES     software pipelining depth for 2-byte inputs; NUM_STAGES_FP32: fp32 tiles take twice the shared
#                  memory
#   COMBINE_BLOCK  rows per program of the combine kernel
#   TMA            load through TMA descriptors where hidden and weight allow it
# TMA, 3 stages, 256-wide vocab tiles: BENCHMARKS-history 1, last entry (`tiles.py logprobs`)
LOGPROBS_TILES = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, NUM_WARPS=8, NUM_STAGES=3, NUM_STAGES_FP32=2,
                      COMBINE_BLOCK=256, TMA=True)
