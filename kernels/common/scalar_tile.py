"""Attention's math on CUDA cores in FP32, four threads a query row: K2's compute body, which K3 runs
on each stage of its TMA ring and K4.1 keeps beside its WGMMA for S.

Threads: 4 per query row (256 for tile_m = 64), a "quad" as in the WGMMA accumulator of K4: each
thread holds tile_n/4 scores and d/4 output columns, interleaved (column = lane + 4 * i), and row
max/sum are reduced across the quad with two butterfly shuffles. Per K/V tile:
    scores: S = Q K_j^T for this thread's row (FP32 FMAs from SMEM)
    softmax_step: mask; online softmax (running max m, sum l; O *= exp2((m_old - m_new) * scale_log2))
    store_p, accumulate_pv: P through SMEM, O += P V_j
    epilogue: O /= l; O and LSE written once.
compute_setup and compute_epilogue package this thread's row state for a kernel with staged tiles
(common/tma_ring.py: K3, K4.1).

A rung sets what it reads (the constructor's): dtype, head_dim, causal, tile_m, tile_n.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import mask, softmax

THREADS_PER_ROW = 4


class ScalarTileMath:
    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 64, tile_n: int = 64):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim  # V's and O's (K5 takes another)
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_threads = tile_m * THREADS_PER_ROW

    @cute.jit
    def thread_row(self, tidx, m_block, seqlen_q, seqlen_k):
        """(row in tile, lane in quad, global row, one past its last visible key column)."""
        row = tidx // THREADS_PER_ROW
        row_global = m_block * self.tile_m + row
        return row, tidx % THREADS_PER_ROW, row_global, mask.col_limit(row_global, seqlen_q, seqlen_k, self.causal)

    def row_accumulators(self):
        """O accumulator (d/4 columns), running max and running (partial) sum of this thread's row."""
        acc_o = cute.make_rmem_tensor((self.head_dim // THREADS_PER_ROW,), Float32)
        acc_o.fill(0.0)
        return (acc_o, *softmax.row_state(1))

    @cute.jit
    def scores(self, sQ: cute.Tensor, sK: cute.Tensor, row: Int32, lane: Int32) -> cute.Tensor:
        """This thread's tile_n/4 scores of its row: s[i] = Q[row, :] . K[lane + 4 i, :] (unscaled)."""
        s = cute.make_rmem_tensor((1, self.tile_n // THREADS_PER_ROW), Float32)  # (rows, cols)
        s.fill(0.0)
        for d in cutlass.range(self.head_dim, unroll=4):
            q = sQ[row, d].to(Float32)
            for i in cutlass.range_constexpr(self.tile_n // THREADS_PER_ROW):
                s[0, i] += q * sK[lane + THREADS_PER_ROW * i, d].to(Float32)
        return s

    @cute.jit
    def softmax_step(self, s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                     acc_o: cute.Tensor, visible_cols: Int32, lane: Int32, scale_log2: Float32):
        """Mask columns >= visible_cols (tile-relative), update m and l, turn s into P, rescale O."""
        for i in cutlass.range_constexpr(self.tile_n // THREADS_PER_ROW):
            if lane + THREADS_PER_ROW * i >= visible_cols:
                s[0, i] = -Float32.inf
        correction = softmax.online_update(s, row_max, row_sum, scale_log2, THREADS_PER_ROW)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * correction[0]

    @cute.jit
    def store_p(self, p: cute.Tensor, sP: cute.Tensor, row: Int32, lane: Int32):
        for i in cutlass.range_constexpr(self.tile_n // THREADS_PER_ROW):
            sP[row, lane + THREADS_PER_ROW * i] = p[0, i]

    @cute.jit
    def accumulate_pv(self, sP: cute.Tensor, sV: cute.Tensor, acc_o: cute.Tensor, row: Int32, lane: Int32):
        """O[row, lane + 4 i] += sum_c P[row, c] V[c, lane + 4 i]."""
        for c in cutlass.range(self.tile_n, unroll=4):
            p = sP[row, c]
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] += p * sV[c, lane + THREADS_PER_ROW * i].to(Float32)

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, batch: Int32, head: Int32, row_global: Int32,
                 lane: Int32, scale_log2: Float32):
        """O = acc / l and LSE, written once; rows past seqlen_q are dropped."""
        inv_sum, lse = softmax.finalize(row_max[0], row_sum[0], scale_log2, THREADS_PER_ROW)
        if row_global < mO.shape[1]:
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                mO[batch, row_global, head, lane + THREADS_PER_ROW * i] = (acc_o[i] * inv_sum).to(self.dtype)
            if lane == 0:
                mLSE[batch, head, row_global] = lse

    # ---------------------------------------------------------------- a staged kernel's row state
    def compute_setup(self, sQ, sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k):
        """What the compute hooks share across tiles: SMEM views, this thread's row, accumulators."""
        row, lane, row_global, limit = self.thread_row(tidx, m_block, seqlen_q, seqlen_k)
        acc_o, row_max, row_sum = self.row_accumulators()
        return SimpleNamespace(sQ=sQ, sK=sK, sV=sV, sP=sP, row=row, lane=lane, row_global=row_global,
                               limit=limit, acc_o=acc_o, row_max=row_max, row_sum=row_sum)

    @cute.jit
    def compute_epilogue(self, ctx, mO, mLSE, batch, head, scale_log2: Float32):
        """The epilogue of compute_setup's row."""
        self.epilogue(ctx.acc_o, ctx.row_max, ctx.row_sum, mO, mLSE, batch, head, ctx.row_global,
                      ctx.lane, scale_log2)
