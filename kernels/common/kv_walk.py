"""Which K/V tiles a Q tile visits, and in which order: the walk that K5's producer warp and its
consumer warpgroups both follow (one home, so that the two sides cannot disagree).

Visit j (0 <= j < count) names one K/V tile. The producer loads K_j and V_j in that order, the
consumers wait for them in the same order; each side reads the walk from the same values, so
their loads and waits, and with them every ring's stage and phase, stay in step.

DenseWalk: K5's own, tiles n_max - 1 down to n_max - count (the masked tiles of the causal
    diagonal and the ragged end come first; `masked_tiles` in kernels/k5_mainloop.py splits them).
BlockMaskWalk: flex attention's block sparsity, torch's BlockMask lists (kv_num_blocks,
    kv_indices and, where present, full_kv_num_blocks, full_kv_indices): first the partial blocks
    (the mask mod runs on them), then the full blocks (no mask mod), each list from its last entry
    to its first (torch lists a row's blocks in ascending order, so the ragged last K/V block, if
    listed, comes first). A Q tile with no block has count 0: the kernel's empty-tile path
    (O = 0, LSE = -inf).

BlockMask's constraints: its blocks are the kernel's tiles (BLOCK_SIZE == (tile_m, tile_n)); the
tensors are int32, (B or 1, H or 1, q_blocks[, kv_blocks]), contiguous; a batch or head dimension
of 1 broadcasts (its index is clamped to 0: no stride-0 views); H counts query heads. Counts are
clamped to [0, kv_blocks] so that a bad count never reads past a row; indices must be < kv_blocks,
as torch's are (a larger one reads keys past the sequence: TMA fills them with zeros).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# Frozen dataclasses: the DSL carries an object whose methods a runtime loop calls through the
# loop as a loop variable, unless it is a frozen dataclass (read-only).


@dataclass(frozen=True)
class DenseWalk:
    """Tiles n_max - 1 down to n_max - count."""

    n_max: Int32
    count: Int32
    sparse = False

    def first(self) -> Int32:
        return self.n_max - 1

    def block(self, j: Int32) -> Int32:
        return self.n_max - 1 - j

    partial_block = full_block = block


@dataclass(frozen=True)
class BlockMaskWalk:
    """One Q tile's blocks from a BlockMask's lists: visits 0 .. partial_count - 1 are the partial
    blocks (`partial`, that Q tile's row of kv_indices), partial_count .. count - 1 the full ones
    (`full`, its row of full_kv_indices; None without full lists). `ragged`: the sequence's last
    K/V tile is cut short, so a full block may still need the sequence-end mask."""

    partial_count: Int32
    partial: cute.Tensor
    count: Int32
    full: object
    ragged: object
    sparse = True

    @property
    def has_full(self) -> bool:
        return self.full is not None

    def first(self) -> Int32:
        return self.block(Int32(0))

    def block(self, j: Int32) -> Int32:
        """Visit j's tile, from whichever list holds it (the producer's walk, the prologue)."""
        return _either(self, j)

    def partial_block(self, j: Int32) -> Int32:
        """Visit j < partial_count: a partial block."""
        return self.partial[self.partial_count - 1 - j]

    def full_block(self, j: Int32) -> Int32:
        """Visit j >= partial_count: a full block."""
        return self.full[self.count - 1 - j]


@cute.jit
def _either(walk: BlockMaskWalk, j: Int32) -> Int32:
    n_block = Int32(0)
    if cutlass.const_expr(walk.has_full):
        if j < walk.partial_count:
            n_block = walk.partial_block(j)
        else:
            n_block = walk.full_block(j)
    else:
        n_block = walk.partial_block(j)
    return n_block


@cute.jit
def _row(counts: cute.Tensor, indices: cute.Tensor, batch: Int32, head: Int32, block: Int32):
    """(count, the row of indices) of row `block` (a Q tile's; the backward's lists: a K/V tile's)
    of (batch, head), a dimension of 1 broadcast."""
    b = cutlass.min(batch, Int32(counts.shape[0]) - 1)
    h = cutlass.min(head, Int32(counts.shape[1]) - 1)
    count = cutlass.max(cutlass.min(counts[b, h, block], Int32(indices.shape[3])), 0)
    return count, indices[b, h, block, None]


def tile_walk(lists, n_max: Int32, n_blocks: Int32, batch: Int32, head: Int32, m_block: Int32,
              seqlen_k: Int32, tile_n: int):
    """The walk of one Q tile: DenseWalk over kv_range's (n_max, n_blocks) without block lists;
    else BlockMaskWalk over `lists`, (kv_num_blocks, kv_indices) or those and (full_kv_num_blocks,
    full_kv_indices)."""
    if lists is None:
        return DenseWalk(n_max, n_blocks)
    partial_count, partial, count, full = list_rows(lists, batch, head, m_block)
    return BlockMaskWalk(partial_count, partial, count, full, seqlen_k % tile_n != 0)


def list_rows(lists, batch: Int32, head: Int32, block: Int32):
    """(partial count, partial row, partial + full count, full row or None) of row `block` of a
    BlockMask's lists, (counts, indices) or (counts, indices, full counts, full indices): the
    forward's rows (kv_num_blocks, kv_indices, ... at a Q tile) or the backward's transposed ones
    (q_num_blocks, q_indices, ... at a K/V tile: common/q_walk.py)."""
    partial_count, partial = _row(lists[0], lists[1], batch, head, block)
    count, full = partial_count, None
    if len(lists) == 4:
        full_count, full = _row(lists[2], lists[3], batch, head, block)
        count = partial_count + full_count
    return partial_count, partial, count, full
