"""Which (row, column) scores are visible.

Causal attention is aligned to the bottom right, as in flash-attn: with seqlen_q != seqlen_k, query
row i sees keys j <= i + (seqlen_k - seqlen_q). Rows with no visible key (i < seqlen_q - seqlen_k)
produce O = 0 and LSE = -inf.

Sliding-window (local) attention, flash-attn's `window_size=(left, right)`, is the same diagonal
with two offsets: row i sees keys j in [i + shift - left, i + shift + right], shift = seqlen_k -
seqlen_q. `window` is None (no window: the predicates compile to the plain or causal ones) or a
(left, right) pair of runtime Int32, an unbounded side passed as UNBOUNDED; the host folds
`causal` into right = min(right, 0) and compiles local kernels with causal=False.

`rows_per_query`: a packed GQA tile (decode) holds that many rows (query heads) per query position;
the predicates then take the query position, row // rows_per_query.

Score and mask mods (flex attention, `apply_mods`): Python functions of DSL values inlined into the
softmax step, score_mod(score, b, h, q_idx, kv_idx) -> Float32 on the scaled score and
mask_mod(b, h, q_idx, kv_idx) -> Boolean (False: the score becomes -inf). They run on every tile,
before the positional masks above, which then hide the ragged end whatever a mod returned there.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

UNBOUNDED = 1 << 30  # a window side of -1: far past any sequence, and row + shift + it fits Int32


@cute.jit
def col_limit(row: Int32, seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
              window=None) -> Int32:
    """One past the last visible column of `row` (global coordinates)."""
    limit = seqlen_k
    if cutlass.const_expr(window is not None):
        limit = cutlass.min(seqlen_k, row + 1 + seqlen_k - seqlen_q + window[1])
    elif cutlass.const_expr(causal):
        limit = cutlass.min(seqlen_k, row + 1 + seqlen_k - seqlen_q)
    return limit


@cute.jit
def col_start(row: Int32, seqlen_q: Int32, seqlen_k: Int32, window=None) -> Int32:
    """The first visible column of `row`: 0, or the left edge of its window."""
    start = Int32(0)
    if cutlass.const_expr(window is not None):
        start = cutlass.max(row + seqlen_k - seqlen_q - window[0], 0)
    return start


@cute.jit
def _query(packed_row: Int32, seqlen_q: Int32, rows_per_query):
    """The query position of a tile row (clamped to the last query: rows past it see what it sees)."""
    row = packed_row
    if cutlass.const_expr(rows_per_query is not None):
        row = cutlass.min(seqlen_q - 1, packed_row // rows_per_query)
    return row


@cute.jit
def n_block_max(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                rows_per_query=None, window=None) -> Int32:
    """One past the last K/V tile a Q tile must visit: all of them, or up to the causal diagonal
    (or window edge) of its last query (`rows_per_query`: a packed GQA tile, as in `apply`)."""
    n_end = seqlen_k
    if cutlass.const_expr(causal or window is not None):
        last_query = _query((m_block + 1) * tile_m - 1, seqlen_q, rows_per_query)
        n_end = cutlass.max(col_limit(last_query, seqlen_q, seqlen_k, causal, window), 0)
    return (n_end + tile_n - 1) // tile_n


@cute.jit
def n_block_min(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, rows_per_query=None, window=None) -> Int32:
    """The first K/V tile a Q tile must visit: 0, or the one holding its first row's window start."""
    first = Int32(0)
    if cutlass.const_expr(window is not None):
        first_query = _query(m_block * tile_m, seqlen_q, rows_per_query)
        first = cutlass.min(col_start(first_query, seqlen_q, seqlen_k, window), seqlen_k) // tile_n
    return first


@cute.jit
def n_block_unmasked_min(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                         seqlen_q: Int32, seqlen_k: Int32, rows_per_query=None, window=None) -> Int32:
    """The first K/V tile that no row's window start cuts: tiles below it (down to n_block_min)
    need the mask again. Without a window, 0."""
    first = Int32(0)
    if cutlass.const_expr(window is not None):
        last_query = _query((m_block + 1) * tile_m - 1, seqlen_q, rows_per_query)
        first = (col_start(last_query, seqlen_q, seqlen_k, window) + tile_n - 1) // tile_n
    return first


@cute.jit
def apply(scores: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32, seqlen_q: Int32,
          seqlen_k: Int32, causal: cutlass.Constexpr, rows_per_query=None, window=None):
    """Set invisible scores to -inf. `scores` and `coords` are matching (rows, cols) register views
    (the accumulator and the identity tensor partitioned the same way); row0/col0 place the tile."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        row = row0 + coords[r, 0][0]
        if cutlass.const_expr(rows_per_query is not None):
            row = row // rows_per_query
        limit = col_limit(row, seqlen_q, seqlen_k, causal, window) - col0
        if cutlass.const_expr(window is None):
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                # a select, not a branch: a branch per element makes the DSL yield the whole tile
                scores[r, c] = -cutlass.Float32.inf if coords[r, c][1] >= limit else scores[r, c]
        else:
            start = col_start(row, seqlen_q, seqlen_k, window) - col0
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                col = coords[r, c][1]
                scores[r, c] = -cutlass.Float32.inf if (col >= limit) | (col < start) else scores[r, c]


def _score_result(value, score_mod):
    """A score mod's return value as Float32; anything else is the mod's error, named."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return cutlass.Float32(value)
    if not isinstance(value, cutlass.Float32):
        raise TypeError(f"score_mod {_name(score_mod)} returned {type(value).__name__}, not a float32 score "
                        f"(convert a captured table's values with .to(cutlass.Float32), or keep it float32)")
    return value


def _mask_result(value, mask_mod):
    """A mask mod's return value as a Boolean; anything else is the mod's error, named."""
    if not isinstance(value, (bool, cutlass.Boolean)):
        raise TypeError(f"mask_mod {_name(mask_mod)} returned {type(value).__name__}, not a boolean "
                        f"(True: the score is kept)")
    return value


def _name(mod) -> str:
    return getattr(mod, "name", None) or getattr(mod, "__qualname__", None) or repr(mod)


@cute.jit
def apply_mods(scores: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32, batch: Int32,
               head: Int32, seqlen_q: Int32, seqlen_k: Int32, score_scale: cutlass.Float32,
               score_mod, mask_mod, ragged: cutlass.Constexpr):
    """score = score_mod(score * score_scale, b, h, q_idx, kv_idx), then -inf where
    mask_mod(b, h, q_idx, kv_idx) is False, in place (either mod None: skipped; without a score mod
    the scores stay unscaled). `scores`/`coords`/`row0`/`col0` as in `apply`; `head` is the query
    head. Indices past the sequences (the Q tile's ragged rows, and with `ragged` the K/V tile's
    ragged columns) reach the mods clamped to the last position, so that a mod's table reads stay
    in bounds: those rows are never stored and those columns are hidden by `apply` afterwards."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        q_idx = cutlass.min(row0 + coords[r, 0][0], seqlen_q - 1)
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            kv_idx = col0 + coords[r, c][1]
            if cutlass.const_expr(ragged):
                kv_idx = cutlass.min(kv_idx, seqlen_k - 1)
            if cutlass.const_expr(score_mod is not None):
                scores[r, c] = _score_result(score_mod(scores[r, c] * score_scale, batch, head, q_idx, kv_idx),
                                             score_mod)
            if cutlass.const_expr(mask_mod is not None):
                keep = _mask_result(mask_mod(batch, head, q_idx, kv_idx), mask_mod)
                scores[r, c] = scores[r, c] if keep else -cutlass.Float32.inf


@cute.jit
def apply_transposed(scores_t: cute.Tensor, coords: cute.Tensor, key0: Int32, query0: Int32,
                     seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr, window=None):
    """`apply` on a transposed tile S^T (rows are keys, columns queries: the backward's K Q^T).
    The limits are the same per query, so they are computed once per column."""
    for c in cutlass.range_constexpr(cute.size(scores_t, mode=[1])):
        query = query0 + coords[0, c][1]
        limit = col_limit(query, seqlen_q, seqlen_k, causal, window) - key0
        start = col_start(query, seqlen_q, seqlen_k, window) - key0
        for r in cutlass.range_constexpr(cute.size(scores_t, mode=[0])):
            key = coords[r, c][0]
            hidden = key >= limit
            if cutlass.const_expr(window is not None):
                hidden = hidden | (key < start)
            scores_t[r, c] = -cutlass.Float32.inf if hidden else scores_t[r, c]


@cute.jit
def tile_needs_mask(m_block: Int32, n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                    seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr,
                    rows_per_query=None, window=None) -> cutlass.Boolean:
    """Whether any score of this tile is invisible: the ragged last tile, one crossing the causal
    diagonal or the window's right edge (the tile's first row has the smallest column limit), or
    one below its last row's window start."""
    first_row = m_block * tile_m
    if cutlass.const_expr(rows_per_query is not None):
        first_row = first_row // rows_per_query
    needs = (n_block + 1) * tile_n > col_limit(first_row, seqlen_q, seqlen_k, causal, window)
    if cutlass.const_expr(window is not None):
        needs = needs | (n_block < n_block_unmasked_min(m_block, tile_m, tile_n, seqlen_q, seqlen_k,
                                                        rows_per_query, window))
    return needs


@cute.jit
def m_block_min(n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr, window=None) -> Int32:
    """First Q tile that sees any key of K/V tile `n_block` (the backward's loop start): 0, or under
    causal (a window's right edge) the tile holding row n_block * tile_n + seqlen_q - seqlen_k
    (- right). The Q tiles that see K/V tile n are exactly those m with n_block_min(m) <= n <
    n_block_max(m): the same predicates, inverted (m_block_max is the other end)."""
    first = Int32(0)
    if cutlass.const_expr(window is not None):
        first = cutlass.max(n_block * tile_n + seqlen_q - seqlen_k - window[1], 0) // tile_m
    elif cutlass.const_expr(causal):
        first = cutlass.max(n_block * tile_n + seqlen_q - seqlen_k, 0) // tile_m
    return first


@cute.jit
def m_block_max(n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                seqlen_q: Int32, seqlen_k: Int32, window=None) -> Int32:
    """One past the last Q tile that sees K/V tile `n_block`: all of them, or with a window the
    tiles whose first row's window start (n_block_min) is at most the tile's last key."""
    end = (seqlen_q + tile_m - 1) // tile_m
    if cutlass.const_expr(window is not None):
        reach = cutlass.max((n_block + 1) * tile_n + seqlen_q - seqlen_k + window[0], 0)
        end = cutlass.min(end, (reach + tile_m - 1) // tile_m)
    return end
