"""The split-KV merge: one warp merges a query row's FP32 partials from S1's splits.

S1 (kernels/decode.py) splits each sequence's keys across CTAs when batch x heads cannot fill the
SMs; each split writes its O_i (normalised by its own row sum) and lse_i. The exact result is the
softmax-weighted sum of the parts: LSE = log sum_i exp(lse_i), O = sum_i exp(lse_i - LSE) O_i.
`combine_row` is that merge for one row, by one warp: the last warp of S1's splits of a tile to
finish runs it for the tile's rows (S1's `combine_tile`; until the twenty-first session a kernel of
its own, launched after S1).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def combine_row(mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                mSinks: cute.Tensor, batch: Int32, query: Int32, head: Int32, lane: Int32,
                head_dim: cutlass.Constexpr, sinks: cutlass.Constexpr):
    """O[batch, query, head] and LSE[batch, head, query] from the partials of every split, by the
    calling warp (all 32 lanes). LSE = m + log(sum_i exp(lse_i - m)) with m = max_i lse_i; O = sum_i
    exp(lse_i - LSE) O_i. Splits that saw no key carry lse = -inf and weigh 0; a row no split saw
    gets O = 0, LSE = -inf. `sinks`: the head's sink (mSinks (heads_q,) FP32) is one more term of
    the sum, with no O."""
    splits = mOacc.shape[0]
    top = -Float32.inf
    for s in cutlass.range(lane, splits, 32, unroll=1):
        top = cute.arch.fmax(top, mLSEacc[s, batch, head, query])
    top = cute.arch.warp_reduction_max(top, threads_in_group=32)
    sink = -Float32.inf
    if cutlass.const_expr(sinks):
        sink = mSinks[head]
        top = cute.arch.fmax(top, sink)
    offset = top
    if top == -Float32.inf:
        offset = Float32(0.0)
    total = Float32(0.0)
    for s in cutlass.range(lane, splits, 32, unroll=1):
        total += cute.math.exp(mLSEacc[s, batch, head, query] - offset, fastmath=True)
    total = cute.arch.warp_reduction_sum(total, threads_in_group=32)
    if cutlass.const_expr(sinks):
        total += cute.math.exp(sink - offset, fastmath=True)
    lse = -Float32.inf
    if total > Float32(0.0):
        lse = offset + cute.math.log(total, fastmath=True)
    acc = cute.make_rmem_tensor((head_dim // 32,), Float32)
    acc.fill(0.0)
    if total > Float32(0.0):
        for s in cutlass.range(splits, unroll=1):
            weight = cute.math.exp(mLSEacc[s, batch, head, query] - lse, fastmath=True)
            for i in cutlass.range_constexpr(head_dim // 32):
                acc[i] += weight * mOacc[s, batch, query, head, lane + 32 * i]
    for i in cutlass.range_constexpr(head_dim // 32):
        mO[batch, query, head, lane + 32 * i] = acc[i].to(mO.element_type)
    if lane == 0:
        mLSE[batch, head, query] = lse
