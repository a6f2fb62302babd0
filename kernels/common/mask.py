"""Which (row, column) scores are visible.

Causal attention is aligned to the bottom right, as in flash-attn: with seqlen_q != seqlen_k, query
row i sees keys j <= i + (seqlen_k - seqlen_q). Rows with no visible key (i < seqlen_q - seqlen_k)
produce O = 0 and LSE = -inf.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def col_limit(row: Int32, seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr) -> Int32:
    """One past the last visible column of `row` (global coordinates)."""
    limit = seqlen_k
    if cutlass.const_expr(causal):
        limit = cutlass.min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    return limit


@cute.jit
def n_block_max(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr) -> Int32:
    """Number of K/V tiles a Q tile must visit: all of them, or up to the causal diagonal."""
    n_end = seqlen_k
    if cutlass.const_expr(causal):
        n_end = cutlass.max(cutlass.min(seqlen_k, (m_block + 1) * tile_m + seqlen_k - seqlen_q), 0)
    return (n_end + tile_n - 1) // tile_n
