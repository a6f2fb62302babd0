"""B7: B6 with B4's dQ hand-off (each warpgroup's half through its own two buffers).

B6 computes dQ_i^T = K^T dS^T with the warpgroups stacked along d, so warpgroup w holds the
transposed share of dQ_i's columns 64 w .. 64 w + 63: exactly B4's half. B6 hands the whole tile
to the writer at barriers of 256 + 32 threads, through one buffer, as B3 does; B7 hands each half
over on its own, through two buffers returned a tile late, as B4 does:

    consumer warpgroup w, Q tile i (buffer b = i % 2):
        dQ_i^T's share (64 of d, tile_m) -> wait EMPTY[w, b] -> stored in fragment order (B4's,
        16-byte stores) -> arrive FULL[w, b]
    writer warp: B4's, one bulk reduce-add per half

Everything else is B6 (S^T, dP^T, P^T and dS^T from registers for dV and dK, dV after dS^T).

And the per-query statistics come through SMEM (`stats_in_smem`, fixed-length batches): the loader
brings each Q tile's LSE * log2 e and D (tile_m FP32 each) with its Q and dO, on the same barrier,
and a consumer thread reads each column's value where it uses it (`ld.shared.v2`: its two adjacent
columns), in place of two global loads a statistic and a shuffle a column (B3's). Measured on an
H100 (three rounds, d128, 2k / 8k / 16k): 1.04 / 0.98 / 1.04 non-causal and 1.04 / 1.01 / 1.04
causal against the same kernel with B3's statistics. Packed batches keep B3's (their statistic
rows need not be 16-byte aligned for a TMA box), and so does the deterministic walk (24 B of
spills with them).

Constraints: B6's (head_dim 128, two Q stages, tile_m a multiple of 16). SMEM (bf16, 64 rows): B4's
224 KB and 1 KB of statistics. Registers a consumer thread: B6's.
"""
from .bwd_dq_t import TransposedDqBackward
from .bwd_split_dq import SplitDqBackward


class SplitTransposedDqBackward(SplitDqBackward, TransposedDqBackward):
    """B4's SMEM halves, barriers, writer and hand-off (first in the MRO); B6's dQ^T MMA,
    fragments and GEMM, and its dV order."""
    stats_in_smem = True
    # B4's LSE read-ahead measured mixed here (0.90-1.04x at d128, one run, H200): off
    prefetch_stats = False
    head_groups = True  # B4 launches without them; here they save 2-5% (d128 causal, H100)
