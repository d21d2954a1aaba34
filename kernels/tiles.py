"""Tile and launch tables of every Triton kernel (kernels/*.py), each beside the measurement that chose it. The ops
read their defaults here and take other settings as arguments (a benchmark sweeping tiles passes them in); nothing
assigns to these names at run time."""

from __future__ import annotations

from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------- fused MoE (fused_moe.py)

MOE_SHRINK_TILES = dict(BLOCK_K=256, num_warps=4, num_stages=3)  # the per-block shrink's defaults (MoeConfig.shrink)

# The per-block LoRA shrink computes a block's adapter slots side by side in one pass over K (BLOCK_S * BLOCK_R
# columns, each row keeping its own slot's) while that is at most ALL_SLOTS_MAX wide, else one pass per slot; a
# block of one slot (most blocks at large M) always takes the one narrow pass.
# H100, Qwen3-30B-A3B shapes, 4 adapters (the retired benchmarks/moe_variants.py): LoRA overhead 1.071-1.117 against
# 1.085-1.126 one pass per slot. The same side-by-side trick for the expand measured slower at every M
# (1.076-1.405 against 1.071-1.117): blocks of large M hold one or two slots, and the wide dot costs more there.
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


# By pairs per expert (T * k / E): the fastest per GEMM of the tile x layout sweep on an H100 at Qwen3-30B-A3B
# shapes (benchmarks/tiles.py moe; BENCHMARKS-history 1). TMA weights paid from 1024 tokens on (down) and
# 2048 (gate_up); the block-ordered activation from 8192 on, with the GEMMs as persistent Gluon kernels there
# (gate_up 809 against 843 us, down 407 against 445 at 8192 tokens, retired gluon_moe_gemm.py; the layer with
# LoRA 1.427 / 1.467 ms against 1.477 / 1.540 in Triton, 4 adapters shared-outer / 1 per-expert). The Gluon GEMMs at
# 4096 tokens: base 3% faster, LoRA 1-2% (overhead 1.104 against 1.080), not taken; at 2048 slower. A/B in one
# process (the retired benchmarks/moe_variants.py):
# the LoRA expand before the main loop paid from 64-row blocks on (LoRA overhead 1.100 / 1.091 against
# 1.148 / 1.125 at 1024 tokens, 4 adapters mixed / one; 1.108 / 1.115 against 1.134 / 1.136 at 4096), not at
# 16-row blocks (within +-0.01 either way); half-height tail blocks paid at 128-row blocks (base 1.2-4% faster
# from 2048 tokens on), not at 64-row ones; the down shrink inside the down GEMM (pair_shrink, shared down B) paid
# at 128-row blocks (1.083 against 1.110 at 4096 tokens, 4 adapters mixed), not at 16 / 64 (1.116 / 1.128 against
# 1.101 / 1.094 at 256 / 1024).
# The per-block shrinks at 128-row blocks, PEFT's per-expert factors, 4096 tokens (benchmarks/tiles.py shrinks):
# gate_up (K 2048, R 32) 32.8 us at 4 stages against 34.4 at 3; down (K 768, R 16) 23.1 us with 64-wide K steps
# against 26.2 with 128. At 16-row blocks (128 tokens) the defaults were the fastest.
_SHRINK_128 = {"gate_up": dict(num_stages=4), "down": dict(BLOCK_K=64)}
MOE_CONFIGS = {
    16: MoeConfig(16, gate_up=_tiles(128, 128, 8, 4), down=_tiles(128, 128, 8, 4)),
    64: MoeConfig(64, gate_up=_tiles(64, 64, 4, 3), down=_tiles(128, 64, 4, 4), w_tma=True, expand_first=True),
    256: MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True, expand_first=True,
                   half_tail=True, pair_shrink=True, shrink=_SHRINK_128),
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

# The GEMMs' times against moe_gemm's: kernels/moe_gemm_gluon.py's module notes (no sweep of these tiles recorded).
GLUON_BLOCK_M, GLUON_BLOCK_K, GLUON_NUM_BUFFERS, GLUON_NUM_WARPS = 128, 64, 4, 8  # BLOCK_M: the alignment's block rows
GLUON_GATE_UP_BLOCK_N, GLUON_DOWN_BLOCK_N = 128, 256  # gate_up holds two accumulators (gate, up)
GLUON_PAIR_SHRINK_WIDE = 64  # down's pair shrink: adapter slots x padded rank side by side (one wgmma's N)

# ------------------------------------------------------------------------------------ dense LoRA (dense_lora.py)

# H100, T = 4096, S = 4 with every row in one slot, bf16 (benchmarks/tiles.py dense): the shrink at 64 rows
# per program takes 9.5 / 12.7 / 6.6 us for q/k/v together (in 2048, R 48) / o (in 4096) / router (in 2048)
# against 15.1 / 14.0 / 8.2 at 32 rows; the expand is as fast as any tile tried (q 20.7 us, about a plain copy of
# y). The shrink halves BLOCK_K until its pipelined x and A tiles fit DENSE_SHRINK_SMEM (large R, float32).
DENSE_LORA_BLOCKS = {
    "shrink": dict(BLOCK_M=64, BLOCK_K=256, num_warps=4, num_stages=4),  # grid (cdiv(T, BLOCK_M), S)
    "expand": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1),  # grid (cdiv(T, BM), cdiv(out, BN), S)
}
DENSE_SHRINK_SMEM = 160 * 1024  # bytes: num_stages * (BLOCK_M + BLOCK_R) * BLOCK_K * element size
# Split `in` while the programs of one slot's rows x splits fit the SMs once and each split keeps SPLIT_MIN_K
# features: H100, 128 tokens, S = 4 with every row in one slot, bf16 (benchmarks/tiles.py shrinks): q/k/v 9.3 /
# o 10.3 / router 6.4 us unsplit (two programs each, latency of one SM streaming x and A).
SPLIT_MIN_K, MAX_SPLITS = 128, 16
# rows x columns per program of lora_residual_add, grid (cdiv(T, BLOCK_M), cdiv(out, BLOCK_N))
RESIDUAL_BLOCKS = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4)

# --------------------------------------------------------------------------- head norm + RoPE (head_norm_rope.py)

# grid (cdiv(T, TOKENS_PER_PROGRAM), heads). H100, 4 x 1024 tokens, q of Qwen3-30B-A3B (benchmarks/tiles.py dense
# --sections head-norm): 16 and 32 tie (26 us), 64 is slower
TOKENS_PER_PROGRAM = 32

# ------------------------------------------------------------- batch-invariant mode (--batch-invariant, issue #23)

# Every launch setting that otherwise follows the batch's size is fixed, so that a row's result does not depend on
# the rows around it or the padding (lora_eval/forward.py `invariant`). The mode cost 15-19% end to end before the
# GEMM below went through TMA on a persistent grid and the MoE kept its half-height tail tiles and its down pair
# shrink (H200, 48 layers, 4 x 1024: base 60.2 -> 71.4 ms, lora-1 68.1 -> 78.7 ms; BENCHMARKS-history.md sections 9
# and 12). The split counts sit inside the ranges the default picks by batch size (shrink 1-16, vocabulary 1-594).
# The fused MoE: MOE_CONFIGS' 128-row blocks less the choices that would change a row's sums — the side-by-side
# shrink of a block's slots (all_slots_max 0: one pass per slot, the same dot for a row whatever slots share its
# block) and the Gluon GEMMs of the largest batches. The half-height tile of an expert's half-empty last block
# (half_tail) and the down shrink inside the down GEMM (pair_shrink) stay: the same K steps in the same order, and
# the GPU tests that shuffle, split and pad batches stay bit-equal with them (H100: invariant base 73.52 -> 71.96
# ms, lora-1 82.71 -> 81.93 with them; section 12).
INVARIANT_MOE = MoeConfig(128, gate_up=_tiles(128, 64, 8, 4), down=_tiles(256, 64, 8, 4), w_tma=True,
                          expand_first=True, half_tail=True, pair_shrink=True, shrink=_SHRINK_128, all_slots_max=0)
INVARIANT_SHRINK_SPLITS = 4  # the dense LoRA shrink's partial sums over `in` (else shrink_splits, by batch size)
INVARIANT_VOCAB_SPLITS = 8  # the fused logprobs' vocabulary splits (else logprobs.split_vocab, by rows)
# The dense projections' GEMM (matmul.py) in place of cuBLAS, whose kernel choice follows the batch's size. H100,
# 4096 tokens (benchmarks/tiles.py matmul; BENCHMARKS-history.md section 12), ms against cuBLAS's 0.1281 / 0.1014 /
# 0.0060 at q/k/v's, o_proj's and the router's shapes, every tile bit-equal to cuBLAS:
#   128 x 256 x 64, 8 warps, 3 stages, TMA loads, persistent grid   0.1323 / 0.0997 / 0.0215
#   the same with pointer loads, one program a tile                  0.1526 / 0.1226 / 0.0255
#   128 x 128 x 64, TMA, persistent                                  0.1798 / 0.1350 / 0.0122
#   128 x 128 x 64, pointer loads, one program a tile (before)       0.1681 / 0.1300 / 0.0160
# so 256-wide tiles, but 128 for outputs narrower than 256 (the router) and in float32 (whose 256-wide tiles pass
# the 227 KB of shared memory). The choice follows the weight's shape and dtype alone, never the batch.
MATMUL_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True,
                    PERSISTENT=True)
MATMUL_NARROW = dict(BLOCK_N=128)  # outputs narrower than 256, and float32

# --------------------------------------------------------------------- prefixed attention (prefix_attention.py)

# query rows x keys per step; a program's query rows are heads x positions (prefix_attention.heads_per_program).
# Chosen before the heads were packed (one head a program, grid (cdiv(L, BLOCK_M), rows x heads)), H200, bf16, one
# MMLU-like group (200 rows x 110 tokens after a 600-token prefix, 32 / 4 heads of 128; benchmarks/tiles.py
# attention): 64 x 64, 4 warps 0.898 ms (0.883 at 3 stages: noise), 128 x 64 1.014, 128 x 128 1.008, 64 x 128 1.363,
# 32 x 64 1.797; the torch form it replaced (the prefix concatenated in front of every row, SDPA with an offset mask)
# 1.620 ms. Packed (8 heads x 8 positions at 64 rows), H200, 2026-11-26, the same sweep (old kernel in brackets):
# 64 x 64 0.774 ms (0.910), 3 stages 0.745 (0.894), 128 x 64 0.841, 128 x 128 0.856, 64 x 128 1.253, 32 x 64 1.546;
# 40 rows x 150 after 2400: 64 x 64 0.691 (0.860), 3 stages 0.626 (0.839), 128 x 128 0.747. 64 x 64 stays (3 stages
# is 4-9% faster at the kernel, one more compile variant; not taken while kernel tuning is paused).
PREFIX_ATTENTION_TILES = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)

# ------------------------------------------------------------------------ router, RMSNorm, RoPE (router.py, ...)

# H200, bf16, Qwen3-30B-A3B's shapes, 2026-11-26 (`python benchmarks/tiles.py small`), ms at 4096 / 16384 tokens for
# 1, 2, 4, 8, 16, 32 rows (positions) per program; a plain copy of the input beside it:
#   router_topk  0.0233 0.0123 0.0060 0.0063 0.0075 0.0087 / 0.0855 0.0424 0.0185 0.0186 0.0197 0.0234 (copy 0.0016)
#   rms_norm     0.0063 0.0066 0.0067 0.0071 0.0083 0.0321 / 0.0339 0.0350 0.0352 0.0351 0.0424 0.1162 (copy 0.0057)
#   rope         0.0182 0.0229 0.0230 0.0223 0.0373 0.0774 / 0.0688 0.0792 0.0832 0.0809 0.1369 0.2609 (copy 0.0176)
# Each takes its fastest at both sizes (16 / 4 / 4 shipped before: 5-25% slower, microseconds a layer).
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
#   TMA            load through TMA descriptors where hidden and weight allow it: H100, Qwen3-30B-A3B's lm_head,
#                  bf16 (benchmarks/tiles.py logprobs): 4.21 against 4.63 ms at 4096 rows, 8.68 against 9.72 at
#                  8192, 1.13 against 1.22 at 1024 (0.86-0.90x cuBLAS computing the logits alone), 0.282 against
#                  0.275 at 128.
LOGPROBS_TILES = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, NUM_WARPS=8, NUM_STAGES=3, NUM_STAGES_FP32=2,
                      COMBINE_BLOCK=256, TMA=True)
