"""Online softmax in the exp2 domain (FlashAttention's running max and sum).

Scores arrive unscaled; `scale_log2` = softmax_scale * log2(e) is folded into the exponent so that
one FFMA + one ex2 gives each probability: p = exp2(s * scale_log2 - m * scale_log2). When a new
tile raises the running max from m_old to m_new, the running sum and the output accumulator are
rescaled by exp2((m_old - m_new) * scale_log2). A row whose every score is masked keeps m = -inf;
its offset is taken as 0 so that no (-inf) - (-inf) = NaN appears, and it finalizes to O = 0,
LSE = -inf.

The scalar form here serves rungs whose scores live in plain per-thread arrays (K2, K3); the
register-fragment form for WGMMA accumulators sits beside it.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)  # natural-log values (LSE) to the exp2 domain


@cute.jit
def max_offset(row_max: Float32, scale_log2: Float32) -> Float32:
    """m * scale_log2, or 0 for a row that has seen no visible score yet (m = -inf)."""
    offset = row_max * scale_log2
    if row_max == -Float32.inf:
        offset = Float32(0.0)
    return offset


def _reduce(scores: cute.Tensor, r: int, op):
    """op over row r with up to four independent chains: a single chain of dependent
    instructions would serialise on their latency."""
    cols = cute.size(scores, mode=[1])
    chains = min(4, cols)
    acc = [scores[r, c] for c in range(chains)]
    for c in range(chains, cols):
        acc[c % chains] = op(acc[c % chains], scores[r, c])
    while len(acc) > 1:
        acc = [op(acc[i], acc[i + 1]) if i + 1 < len(acc) else acc[i] for i in range(0, len(acc), 2)]
    return acc[0]


@cute.jit
def online_update(scores: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                  scale_log2: Float32, threads_per_row: cutlass.Constexpr,
                  p_offset_log2: cutlass.Constexpr = 0) -> cute.Tensor:
    """Turn one tile of scores into probabilities, in place; return each row's rescale factor.

    `scores`: (rows, cols) register view, this thread's share of `rows` rows (masked entries
    -inf); each row is spread over `threads_per_row` adjacent lanes (a quad for 4) and reduced by
    butterfly shuffles. `row_max`/`row_sum`: (rows,) register tensors carried across tiles; the
    sum stays a per-thread partial until `finalize`. `p_offset_log2` (FP8): the probabilities come
    out times 2^p_offset_log2, lifting small ones out of e4m3's subnormals (P <= 256 < 448, e4m3's
    largest); the sums carry the same factor, and `finalize` takes it out of the LSE (1/l cancels it).
    """
    rows, cols = cute.size(scores, mode=[0]), cute.size(scores, mode=[1])
    correction = cute.make_rmem_tensor((rows,), Float32)
    for r in cutlass.range_constexpr(rows):
        tile_max = _reduce(scores, r, cute.arch.fmax)
        tile_max = cute.arch.warp_reduction_max(tile_max, threads_in_group=threads_per_row)
        old_max = row_max[r]
        new_max = cute.arch.fmax(old_max, tile_max)
        offset = max_offset(new_max, scale_log2)
        factor = cute.math.exp2(max_offset(old_max, scale_log2) - offset, fastmath=True)
        if old_max == -Float32.inf:
            factor = Float32(0.0)
        if cutlass.const_expr(p_offset_log2 != 0):
            offset = offset - Float32(p_offset_log2)
        for c in cutlass.range_constexpr(cols):
            scores[r, c] = cute.math.exp2(scores[r, c] * scale_log2 - offset, fastmath=True)
        tile_sum = _reduce(scores, r, lambda a, b: a + b)
        row_max[r] = new_max
        row_sum[r] = row_sum[r] * factor + tile_sum
        correction[r] = factor
    return correction


@cute.jit
def softcap(scores: cute.Tensor, scale: Float32):
    """Gemma-2's capped scores, s -> tanh(s * softmax_scale / softcap), in place: the host passes
    scale = softmax_scale / softcap and folds the cap into scale_log2 = softcap * log2(e), so that
    the softmax and the LSE see softcap * tanh(s * softmax_scale / softcap) unscaled."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            scores[r, c] = cute.math.tanh(scores[r, c] * scale, fastmath=True)


@cute.jit
def rescale(acc_mn: cute.Tensor, factors: cute.Tensor):
    """acc *= factor of its row: the output accumulator (a (rows, cols) view) follows the running
    max (`online_update`'s correction) or is normalised (1/l)."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * factors[r]


def row_state(rows: int):
    """The running (max, sum) of `rows` rows before any tile: (-inf, 0)."""
    row_max = cute.make_rmem_tensor((rows,), Float32)
    row_max.fill(-Float32.inf)
    row_sum = cute.make_rmem_tensor((rows,), Float32)
    row_sum.fill(0.0)
    return row_max, row_sum


@cute.jit
def finalize(row_max: Float32, row_sum: Float32, scale_log2: Float32,
             threads_per_row: cutlass.Constexpr, sink_log2=None,
             p_offset_log2: cutlass.Constexpr = 0):
    """(1/l, lse) for a row: the output scale (0 for an empty row) and the natural-log LSE.

    `sink_log2` (compile-time optional): an attention sink, a logit that joins the row's
    denominator with no value (gpt-oss), in the exp2 domain (sink * log2 e). The row's sum is then
    taken relative to m = max(row max, sink), so that neither term overflows:
        l = sum_j 2^(s_j - m) + 2^(sink - m),   O = acc * 2^(max - m) / l,   LSE = (m + log2 l) ln 2.
    A row that sees no key gives O = 0 and LSE = sink; a sink of -inf is no sink.
    `p_offset_log2`: online_update's, taken out of the LSE (the sink's term carries it too, as the
    row sums do; 1/l cancels it in O)."""
    total = cute.arch.warp_reduction_sum(row_sum, threads_in_group=threads_per_row)
    inv_sum = Float32(0.0)
    lse = -Float32.inf
    if cutlass.const_expr(sink_log2 is None):
        if total > Float32(0.0):
            inv_sum = Float32(1.0) / total
            log2_sum = cute.math.log2(total, fastmath=True)
            if cutlass.const_expr(p_offset_log2 != 0):
                log2_sum = log2_sum - Float32(p_offset_log2)
            lse = (row_max * scale_log2 + log2_sum) * Float32(LN2)
    else:
        offset = max_offset(row_max, scale_log2)  # (an empty row: 0, and total = 0)
        top = cute.arch.fmax(offset, sink_log2)
        rows_share = cute.math.exp2(offset - top, fastmath=True)
        sink_term = sink_log2 - top
        if cutlass.const_expr(p_offset_log2 != 0):
            sink_term = sink_term + Float32(p_offset_log2)
        total = total * rows_share + cute.math.exp2(sink_term, fastmath=True)
        if total > Float32(0.0):
            inv_sum = rows_share / total
            log2_sum = cute.math.log2(total, fastmath=True)
            if cutlass.const_expr(p_offset_log2 != 0):
                log2_sum = log2_sum - Float32(p_offset_log2)
            lse = (top + log2_sum) * Float32(LN2)
    return inv_sum, lse
