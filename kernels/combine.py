"""The split-KV combine: one warp per query row merges the FP32 partials of S1's splits.

S1 (kernels/decode.py) splits each sequence's keys across CTAs when batch x heads cannot fill the
SMs; each split writes its O_i (normalised by its own row sum) and lse_i. The exact result is the
softmax-weighted sum of the parts: LSE = log sum_i exp(lse_i), O = sum_i exp(lse_i - LSE) O_i.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


class SplitKVCombine:
    """O and LSE from the splits' FP32 partials: one warp per (batch, query, head) row.

    LSE = m + log(sum_i exp(lse_i - m)) with m = max_i lse_i; O = sum_i exp(lse_i - LSE) O_i. Splits
    that saw no key carry lse = -inf and weigh 0; a row no split saw keeps O = 0, LSE = -inf.
    `sinks`: the head's sink is one more term of the sum, with no O (mSinks (heads_q,) FP32)."""

    warps = 4

    def __init__(self, dtype, head_dim: int, sinks: bool = False):
        self.dtype, self.head_dim, self.sinks = dtype, head_dim, sinks

    @cute.jit
    def __call__(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSinks: cute.Tensor, stream):
        _, batch, seqlen_q, heads_q, _ = mOacc.shape
        rows = batch * seqlen_q * heads_q
        self.kernel(mOacc, mLSEacc, mO, mLSE, mSinks).launch(
            grid=[cute.ceil_div(rows, self.warps), 1, 1], block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSinks: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        splits, batch_size, seqlen_q, heads_q, _ = mOacc.shape
        row = block * self.warps + tidx // 32
        if row < batch_size * seqlen_q * heads_q:
            head = row % heads_q
            query = row // heads_q % seqlen_q
            batch = row // (heads_q * seqlen_q)
            top = -Float32.inf
            for s in cutlass.range(lane, splits, 32, unroll=1):
                top = cute.arch.fmax(top, mLSEacc[s, batch, head, query])
            top = cute.arch.warp_reduction_max(top, threads_in_group=32)
            sink = -Float32.inf
            if cutlass.const_expr(self.sinks):
                sink = mSinks[head]
                top = cute.arch.fmax(top, sink)
            offset = top
            if top == -Float32.inf:
                offset = Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, splits, 32, unroll=1):
                total += cute.math.exp(mLSEacc[s, batch, head, query] - offset, fastmath=True)
            total = cute.arch.warp_reduction_sum(total, threads_in_group=32)
            if cutlass.const_expr(self.sinks):
                total += cute.math.exp(sink - offset, fastmath=True)
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = offset + cute.math.log(total, fastmath=True)
            acc = cute.make_rmem_tensor((self.head_dim // 32,), Float32)
            acc.fill(0.0)
            if total > Float32(0.0):
                for s in cutlass.range(splits, unroll=1):
                    weight = cute.math.exp(mLSEacc[s, batch, head, query] - lse, fastmath=True)
                    for i in cutlass.range_constexpr(self.head_dim // 32):
                        acc[i] += weight * mOacc[s, batch, query, head, lane + 32 * i]
            for i in cutlass.range_constexpr(self.head_dim // 32):
                mO[batch, query, head, lane + 32 * i] = acc[i].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, query] = lse
