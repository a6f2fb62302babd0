"""The backward's per-query statistics: LSE * log2 e and D = rowsum(dO * O), FP32, from the preprocess.

The preprocess writes both as (batch, heads_q, rows), rows padded to whole Q tiles (a packed batch:
one entry, each sequence's Q tiles in whole-tile slots from `stat_offset`, rows past its end padded
as well, kernels/bwd_pre.py). Padded rows hold LSE2 = +inf (P = 0) and D = 0, so every Q tile reads
its statistics unchecked. A consumer thread needs the values of the queries its accumulator
fragments hold, in one of two ways:

    registers (every rung): `stats` loads this thread's `stat_count` values of Q tile m_block from
        global memory before the tile's GEMMs are issued (B1: its rows; the transposed scores,
        b3 on: 2 a 64-column block, the other columns fetched by shuffles where used,
        kernels/bwd_transposed_scores.py);
    SMEM (`stats_in_smem`: b4, b7, b8): the loader brings each Q tile's tile_m values of both with
        its Q and dO, on the same stage barrier, and the consumers read each value where they use it.
        Not in the ordered dQ walk (B7's deterministic variant spills 24 B with them).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import tma


class QueryStatistics:
    """Mixin of the backward kernels (their constructor, kernels/bwd_setup.py, sets tile_m,
    q_stages, varlen and ordered_dq; the warp-specialized one sets `stats_in_smem` by flag)."""
    stats_in_smem = False

    # ---------------------------------------------------------------- SMEM statistics (host side)
    @property
    def smem_stats(self) -> bool:
        """Whether this kernel reads the statistics from SMEM: `stats_in_smem`, and not in the
        ordered dQ walk (B7's deterministic variant spills 24 B with them)."""
        return self.stats_in_smem and not self.ordered_dq

    def stat_offset(self, seq, batch: Int32):
        """The row of the entry's first statistic in its (batch, head) plane: 0, or (varlen) its
        first Q tile's slot (kernels/bwd.py, packed_q_tile)."""
        if cutlass.const_expr(self.varlen):
            return self.packed_q_tile(seq, 0, batch) * self.tile_m
        return seq.offset_q

    def stat_smem_elems(self) -> int:
        return self.tile_m * self.q_stages if self.smem_stats else 4  # 4 keeps the fields valid

    def stat_layout(self):
        """A statistic's SMEM ring: (tile_m, 1, stages), the shape of Q's stages with d = 1."""
        return cute.make_layout((self.tile_m, 1, self.q_stages), stride=(1, self.tile_m, self.tile_m))

    def stat_major(self, mX: cute.Tensor) -> cute.Tensor:
        """(batch, heads, rows) FP32 -> a (rows, 1, heads, batch) view, tiled as tma.seq_major's
        (the unit mode takes the heads' stride: a TMA stride must be a multiple of 16 bytes)."""
        rows_stride, heads_stride, batch_stride = mX.layout.stride[2], mX.layout.stride[1], mX.layout.stride[0]
        return cute.make_tensor(mX.iterator, cute.make_layout(
            (mX.shape[2], 1, mX.shape[1], mX.shape[0]), stride=(rows_stride, heads_stride, heads_stride, batch_stride)))

    def make_stat_loads(self, mLSE2, mD):
        """(atom, TMA tensor) of LSE * log2 e and of D, Q tile by Q tile (None where unused)."""
        if not self.smem_stats:
            return None, None, None, None
        return (*tma.make_load(self.stat_major(mLSE2), self.stat_layout(), (self.tile_m, 1)),
                *tma.make_load(self.stat_major(mD), self.stat_layout(), (self.tile_m, 1)))

    # ---------------------------------------------------------------- register statistics
    def stat_rows(self, mX: cute.Tensor, head: Int32, batch: Int32, seq) -> cute.Tensor:
        """One head's rows of a per-row statistic (LSE * log2 e or D), from the entry's first one
        (`stat_offset`): sliced once before the walk, so a Q tile's loads cost one address add each."""
        if cutlass.const_expr(self.varlen):
            return cute.domain_offset((self.stat_offset(seq, batch),), mX[0, head, None])
        return mX[batch, head, None]

    @cute.jit
    def row_stats(self, ctx, rows: cute.Tensor, m_block: Int32):
        """This thread's rows of a per-row statistic (`stat_rows`) of Q tile m_block, into
        registers: loaded before the GEMMs are issued, the loads' latency hides under them."""
        vals = cute.make_rmem_tensor((self.stat_count(ctx),), Float32)
        for r in cutlass.range_constexpr(self.stat_count(ctx)):
            vals[r] = rows[m_block * self.tile_m + self.stat_index(ctx, r)]
        return vals

    def stat_count(self, ctx) -> int:
        """Values of a per-row statistic a thread holds for one Q tile (its rows)."""
        return cute.size(ctx.s_coords, mode=[0])

    def stat_index(self, ctx, r: int):
        """The row of the Q tile whose statistic is this thread's r-th value."""
        return ctx.s_coords[r, 0][0]

    @cute.jit
    def stats(self, ctx, m_block: Int32):
        """(LSE * log2 e, D) for this thread's rows of Q tile m_block (ctx.lse_rows, ctx.d_rows:
        `stat_rows`)."""
        return self.row_stats(ctx, ctx.lse_rows, m_block), self.row_stats(ctx, ctx.d_rows, m_block)
