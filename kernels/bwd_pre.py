"""The backward's preprocess: per query row, D = rowsum(dO * O) and LSE in the exp2 domain, and
the dQ accumulator zeroed.

    D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]       (FP32)
    LSE2[b, h, i] = LSE[b, h, i] * log2(e)                      (so P = exp2(S * scale_log2 - LSE2))
    dQacc[b, i, h, :] = 0                                       (the main kernel adds into it)

Both statistics are written for rows_out >= seqlen_q rows (the main kernel's Q tiles rounded up),
so the main kernel reads them without bounds checks: rows past seqlen_q, and rows that saw no key
(LSE = -inf), get LSE2 = +inf (P = 0: they add nothing and get zero gradient) and D = 0. The
zeroing rides along (one launch and one pass fewer than a separate fill): every row of dQacc.

Memory-bound; it reads dO and O once, in 16-byte vectors: a row's d / 8 vectors go to a group of
`group` lanes (d / 8 rounded up to a power of two, at most 32: d = 96 and 192 leave lanes of each
group idle), the group sums its products with a butterfly. Each thread first loads every row it
owns in the CTA (`PASSES` of them), so their loads are in flight together.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .common.softmax import LOG2E

VEC = 8  # bf16/fp16 elements in 16 bytes
WARPS = 4
PASSES = 4  # rows a thread group handles per CTA


class BackwardPreprocess:
    def __init__(self, dtype, head_dim: int, head_dim_v: int | None = None):
        """head_dim: dQ's columns; head_dim_v: O's and dO's (default head_dim)."""
        head_dim_v = head_dim_v or head_dim
        assert head_dim % VEC == 0 and head_dim_v % VEC == 0 and max(head_dim, head_dim_v) <= 32 * VEC
        self.dtype, self.head_dim, self.head_dim_v = dtype, head_dim, head_dim_v
        self.vectors = head_dim // VEC  # per row of dQ
        self.vectors_v = head_dim_v // VEC  # per row of O and dO
        self.group = min(32, 1 << (max(self.vectors, self.vectors_v) - 1).bit_length())
        self.rows_per_cta = WARPS * (32 // self.group) * PASSES

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mdQacc: cute.Tensor, stream):
        """mO, mdO: (batch, seqlen_q, heads, head_dim_v); mLSE: (batch, heads, seqlen_q);
        mLSE2, mD: (batch, heads, rows_out) FP32 outputs; mdQacc: (batch, dq_rows, heads, d) FP32,
        zeroed."""
        batch, heads, rows_out = mLSE2.shape
        rows = cutlass.max(rows_out, mdQacc.shape[1])
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQacc).launch(
            grid=[cute.ceil_div(rows, self.rows_per_cta), heads, batch], block=[32 * WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQacc: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        vec, sub = lane % self.group, lane // self.group  # the vector in the row, the row in the warp
        seqlen_q, rows_out, dq_rows = mO.shape[1], mLSE2.shape[2], mdQacc.shape[1]
        groups_per_pass = WARPS * (32 // self.group)
        first = block * self.rows_per_cta + warp * (32 // self.group) + sub
        o = cute.make_rmem_tensor((VEC, PASSES), self.dtype)  # a row's vector contiguous
        do = cute.make_rmem_tensor((VEC, PASSES), self.dtype)
        o.fill(0.0)
        do.fill(0.0)
        for p in cutlass.range_constexpr(PASSES):
            row = first + p * groups_per_pass
            if row < seqlen_q and vec < self.vectors_v:
                cute.autovec_copy(cute.local_tile(mO[batch, row, head, None], (VEC,), (vec,)), o[None, p])
                cute.autovec_copy(cute.local_tile(mdO[batch, row, head, None], (VEC,), (vec,)), do[None, p])
        zeros = cute.make_rmem_tensor((VEC,), Float32)
        zeros.fill(0.0)
        for p in cutlass.range_constexpr(PASSES):
            row = first + p * groups_per_pass
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                dot += Float32(do[i, p]) * Float32(o[i, p])
            dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.group)
            if row < rows_out and vec == 0:
                lse2 = Float32.inf
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2E)
                mD[batch, head, row] = dot
                mLSE2[batch, head, row] = lse2
            if row < dq_rows and vec < self.vectors:
                cute.autovec_copy(zeros, cute.local_tile(mdQacc[batch, row, head, None], (VEC,), (vec,)))
