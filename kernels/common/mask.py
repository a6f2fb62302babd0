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
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                rows_per_query=None) -> Int32:
    """Number of K/V tiles a Q tile must visit: all of them, or up to the causal diagonal of its
    last query (`rows_per_query`: a packed GQA tile, as in `apply`)."""
    n_end = seqlen_k
    if cutlass.const_expr(causal):
        if cutlass.const_expr(rows_per_query is None):
            n_end = cutlass.max(cutlass.min(seqlen_k, (m_block + 1) * tile_m + seqlen_k - seqlen_q), 0)
        else:
            last_query = cutlass.min(seqlen_q - 1, ((m_block + 1) * tile_m - 1) // rows_per_query)
            n_end = cutlass.max(col_limit(last_query, seqlen_q, seqlen_k, causal), 0)
    return (n_end + tile_n - 1) // tile_n


@cute.jit
def apply(scores: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32, seqlen_q: Int32,
          seqlen_k: Int32, causal: cutlass.Constexpr, rows_per_query=None):
    """Set invisible scores to -inf. `scores` and `coords` are matching (rows, cols) register views
    (the accumulator and the identity tensor partitioned the same way); row0/col0 place the tile.
    `rows_per_query`: packed GQA tiles hold that many rows (query heads) per query position."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        row = row0 + coords[r, 0][0]
        if cutlass.const_expr(rows_per_query is not None):
            row = row // rows_per_query
        limit = col_limit(row, seqlen_q, seqlen_k, causal) - col0
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            # a select, not a branch: a branch per element makes the DSL yield the whole tile
            scores[r, c] = -cutlass.Float32.inf if coords[r, c][1] >= limit else scores[r, c]


@cute.jit
def tile_needs_mask(m_block: Int32, n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                    seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                    rows_per_query=None) -> cutlass.Boolean:
    """Whether any score of this tile is invisible: the ragged last tile, or one crossing the
    causal diagonal. The tile's first row has the smallest column limit."""
    first_row = m_block * tile_m
    if cutlass.const_expr(rows_per_query is not None):
        first_row = first_row // rows_per_query
    return (n_block + 1) * tile_n > col_limit(first_row, seqlen_q, seqlen_k, causal)


@cute.jit
def m_block_min(n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr) -> Int32:
    """First Q tile that sees any key of K/V tile `n_block` (the backward's loop start): 0, or under
    causal the tile holding row n_block * tile_n + seqlen_q - seqlen_k. The Q tiles that see K/V
    tile n are exactly those m with n < n_block_max(m): the same predicate, inverted."""
    first = 0
    if cutlass.const_expr(causal):
        first = cutlass.max(n_block * tile_n + seqlen_q - seqlen_k, 0) // tile_m
    return first
