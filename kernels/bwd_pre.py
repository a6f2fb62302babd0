"""The backward's preprocess: per query row, D = rowsum(dO * O) and LSE in the exp2 domain.

    D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]       (FP32)
    LSE2[b, h, i] = LSE[b, h, i] * log2(e)                      (so P = exp2(S * scale_log2 - LSE2))

Both are written for rows_out >= seqlen_q rows (the main kernel's Q tiles rounded up), so the main
kernel reads them without bounds checks: rows past seqlen_q, and rows that saw no key (LSE = -inf),
get LSE2 = +inf (P = 0: they add nothing and get zero gradient) and D = 0.

One warp per row at a time: lane l reads elements l, l + 32, ... (each load instruction covers 64
contiguous bytes of the row), then a butterfly sum. Memory-bound; it reads dO and O once.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .common.softmax import LOG2E

ROWS_PER_CTA = 32
WARPS = 4


class BackwardPreprocess:
    def __init__(self, dtype, head_dim: int):
        self.dtype, self.head_dim = dtype, head_dim

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, stream):
        """mO, mdO: (batch, seqlen_q, heads, d); mLSE: (batch, heads, seqlen_q);
        mLSE2, mD: (batch, heads, rows_out) FP32 outputs."""
        batch, heads, rows_out = mLSE2.shape
        self.kernel(mO, mdO, mLSE, mLSE2, mD).launch(
            grid=[cute.ceil_div(rows_out, ROWS_PER_CTA), heads, batch], block=[32 * WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        seqlen_q, rows_out = mO.shape[1], mLSE2.shape[2]
        for i in cutlass.range_constexpr(ROWS_PER_CTA // WARPS):
            row = block * ROWS_PER_CTA + i * WARPS + warp
            if row < rows_out:
                dot = Float32(0.0)
                lse2 = Float32.inf
                if row < seqlen_q:
                    for c in cutlass.range_constexpr(self.head_dim // 32):
                        col = c * 32 + lane
                        dot += Float32(mdO[batch, row, head, col]) * Float32(mO[batch, row, head, col])
                    lse = mLSE[batch, head, row]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2E)
                dot = cute.arch.warp_reduction_sum(dot, threads_in_group=32)
                if lane == 0:
                    mD[batch, head, row] = dot
                    mLSE2[batch, head, row] = lse2
