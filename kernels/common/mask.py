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
before the positional masks above, which then hide the ragged end whatever a mod returned there
(its positions reach the mods as they are, their table reads clamped: ClampedReads).
The backward recomputes S the same way (`apply_mods` on S or, transposed, on S^T) and multiplies
dS by the score mod's derivative (`score_mod_grad`), which the mod carries (fa3/mods.py).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

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


def bind_mod(mod, aux: tuple):
    """A mod as the kernels call it: None, a number (a constant derivative) as it is, or
    `mod.bind(...)`, the user's function with its captured tensors replaced by the kernel's tensor
    arguments (fa3/mods.py's ModSource), each read through ClampedReads."""
    if mod is None or isinstance(mod, (int, float)):
        return mod
    return mod.bind(tuple(ClampedReads(t) for t in aux))


class ClampedReads:
    """A captured tensor as a mod reads it: each coordinate clamped into the tensor's extent. The
    mods see the positions of a tile's rows and columns past the sequences as they are (their
    scores are never used: rows past seqlen_q are not stored and have P = 0 in the backward, keys
    past seqlen_k are hidden by `apply`), and a table read there stays inside the table. Clamping
    the reads rather than the positions keeps q_idx and kv_idx affine in the tile's coordinates:
    kv_idx - q_idx then takes one register per diagonal, not one per element (clamped positions
    spilled registers in the backward). An index of the wrong rank goes to the tensor as it is
    (the compiler names it)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __getitem__(self, coord):
        coords = coord if isinstance(coord, tuple) else (coord,)
        if len(coords) != cute.rank(self.tensor.layout):
            return self.tensor[coord]
        clamped = tuple(cutlass.max(cutlass.min(Int32(x), Int32(self.tensor.shape[i]) - 1), 0)
                        for i, x in enumerate(coords))
        return self.tensor[clamped if isinstance(coord, tuple) else clamped[0]]

    def __getattr__(self, name):
        return getattr(self.tensor, name)


@cute.jit
def mod_index(coords: cute.Tensor, r: cutlass.Constexpr, c: cutlass.Constexpr, row0: Int32, col0: Int32,
              transposed: cutlass.Constexpr):
    """(q_idx, kv_idx) of element (r, c) of a (rows, cols) register view placed at (row0, col0):
    rows are queries, or keys where `transposed` (S^T: row0 is then the tile's first key and col0
    its first query)."""
    row, col = row0 + coords[r, c][0], col0 + coords[r, c][1]
    q_idx, kv_idx = row, col
    if cutlass.const_expr(transposed):
        q_idx, kv_idx = col, row
    return q_idx, kv_idx


@cute.jit
def apply_mods(scores: cute.Tensor, coords: cute.Tensor, row0: Int32, col0: Int32, batch: Int32,
               head: Int32, score_scale: cutlass.Float32, score_mod, mask_mod,
               transposed: cutlass.Constexpr = False):
    """score = score_mod(score * score_scale, b, h, q_idx, kv_idx), then -inf where
    mask_mod(b, h, q_idx, kv_idx) is False, in place (either mod None: skipped; without a score mod
    the scores stay unscaled). `scores`/`coords`/`row0`/`col0` as in `apply` (`transposed`: S^T,
    the backward's K Q^T, `mod_index`); `head` is the query head. Positions past the sequences
    reach the mods as they are, their tensor reads clamped (ClampedReads)."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            q_idx, kv_idx = mod_index(coords, r, c, row0, col0, transposed)
            _apply_mods_at(scores, r, c, batch, head, q_idx, kv_idx, score_scale, score_mod, mask_mod)


@cute.jit
def _apply_mods_at(scores: cute.Tensor, r: cutlass.Constexpr, c: cutlass.Constexpr, batch: Int32, head: Int32,
                   q_idx: Int32, kv_idx: Int32, score_scale: Float32, score_mod, mask_mod):
    """`apply_mods` on element (r, c), at (q_idx, kv_idx)."""
    if cutlass.const_expr(score_mod is not None):
        scores[r, c] = _score_result(score_mod(scores[r, c] * score_scale, batch, head, q_idx, kv_idx), score_mod)
    if cutlass.const_expr(mask_mod is not None):
        keep = _mask_result(mask_mod(batch, head, q_idx, kv_idx), mask_mod)
        scores[r, c] = scores[r, c] if keep else -cutlass.Float32.inf


LN2 = math.log(2.0)


@cute.jit
def score_mod_grad(grad, p: Float32, lse2: Float32, batch: Int32, head: Int32, q_idx: Int32,
                   kv_idx: Int32) -> Float32:
    """d score_mod(x) / dx at one element, for the backward's dS: `grad` (bind_mod's) is the mod's
    derivative, a number (constant) or a function (out, b, h, q_idx, kv_idx) of the mod's output.
    The output is recovered from P = exp2(out * log2 e - LSE * log2 e) (a kernel with a score mod
    runs with scale_log2 = log2 e) as out = ln 2 (log2 P + lse2), so that no register keeps the
    score meanwhile; where P = 0 (masked, or no weight) the derivative is taken as 0, since dS is 0
    there anyway (and 0 * inf would be NaN)."""
    if cutlass.const_expr(isinstance(grad, (int, float))):
        return Float32(grad)
    out = (cute.math.log2(p, fastmath=True) + lse2) * LN2
    g = _score_result(grad(out, batch, head, q_idx, kv_idx), grad)
    return g if p > 0.0 else Float32(0.0)


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
