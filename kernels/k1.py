"""K1: attention as in a textbook, in three kernels.

    S = Q K^T          one thread per score, written to global memory   (scores_kernel)
    P = softmax(S)     one warp per row, in place, LSE written          (softmax_kernel)
    O = P V            one thread per output element                    (pv_kernel)

Everything is FP32 on CUDA cores; inputs are bf16/fp16 and converted on load. Masked scores
(causal, bottom-right aligned) are stored as -inf.

Where it stops scaling: S is materialised, batch * heads * seqlen_q * seqlen_k * 4 bytes (17 GB at
batch 1, 16 heads, 16k x 16k), and it is written once and read three times, so the kernel is bound
by global-memory traffic long before arithmetic. It is the correctness baseline of the ladder.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import mask, softmax

SCORE_THREADS = 128
ROWS_PER_CTA = 4  # softmax: one warp per row


class NaiveAttention:
    def __init__(self, dtype, head_dim: int, causal: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mS: cute.Tensor, scale_log2: Float32, stream):
        batch, seqlen_q, heads_q, _ = mQ.shape
        seqlen_k = mK.shape[1]
        rows = batch * heads_q * seqlen_q
        self.scores_kernel(mQ, mK, mS, scale_log2).launch(
            grid=[rows, cute.ceil_div(seqlen_k, SCORE_THREADS), 1], block=[SCORE_THREADS, 1, 1],
            stream=stream)
        self.softmax_kernel(mS, mLSE, scale_log2).launch(
            grid=[cute.ceil_div(rows, ROWS_PER_CTA), 1, 1], block=[32 * ROWS_PER_CTA, 1, 1],
            stream=stream)
        self.pv_kernel(mS, mV, mO).launch(
            grid=[rows, 1, 1], block=[self.head_dim, 1, 1], stream=stream)

    @staticmethod
    @cute.jit
    def _row_coords(row: Int32, heads_q: Int32, seqlen_q: Int32):
        """Flat row index -> (batch, head, query index)."""
        return row // (heads_q * seqlen_q), (row // seqlen_q) % heads_q, row % seqlen_q

    @cute.kernel
    def scores_kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mS: cute.Tensor, scale_log2: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, col_block, _ = cute.arch.block_idx()
        _, seqlen_q, heads_q, _ = mQ.shape
        seqlen_k, heads_kv = mK.shape[1], mK.shape[2]
        b, h, i = self._row_coords(row, heads_q, seqlen_q)
        h_kv = h // (heads_q // heads_kv)
        j = col_block * SCORE_THREADS + tidx
        if j < seqlen_k:
            s = -Float32.inf
            if j < mask.col_limit(i, seqlen_q, seqlen_k, self.causal):
                s = Float32(0.0)
                for d in cutlass.range(self.head_dim, unroll=8):
                    s += mQ[b, i, h, d].to(Float32) * mK[b, j, h_kv, d].to(Float32)
            mS[b, h, i, j] = s

    @cute.kernel
    def softmax_kernel(self, mS: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32):
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        batch, heads_q, seqlen_q, seqlen_k = mS.shape
        row = bidx * ROWS_PER_CTA + warp
        if row < batch * heads_q * seqlen_q:
            b, h, i = self._row_coords(row, heads_q, seqlen_q)
            row_max = -Float32.inf
            for j in cutlass.range(lane, seqlen_k, 32):
                row_max = cute.arch.fmax(row_max, mS[b, h, i, j])
            row_max = cute.arch.warp_reduction_max(row_max)
            offset = softmax.max_offset(row_max, scale_log2)
            row_sum = Float32(0.0)
            for j in cutlass.range(lane, seqlen_k, 32):
                p = cute.math.exp2(mS[b, h, i, j] * scale_log2 - offset, fastmath=True)
                mS[b, h, i, j] = p
                row_sum += p
            inv_sum, lse = softmax.finalize(row_max, row_sum, scale_log2, 32)
            for j in cutlass.range(lane, seqlen_k, 32):
                mS[b, h, i, j] = mS[b, h, i, j] * inv_sum
            if lane == 0:
                mLSE[b, h, i] = lse

    @cute.kernel
    def pv_kernel(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor):
        d, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        _, heads_q, seqlen_q, seqlen_k = mS.shape
        heads_kv = mV.shape[2]
        b, h, i = self._row_coords(row, heads_q, seqlen_q)
        h_kv = h // (heads_q // heads_kv)
        acc = Float32(0.0)
        for j in cutlass.range(seqlen_k, unroll=4):
            acc += mS[b, h, i, j] * mV[b, j, h_kv, d].to(Float32)
        mO[b, i, h, d] = acc.to(self.dtype)
