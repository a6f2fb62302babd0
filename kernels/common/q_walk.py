"""Which Q tiles a K/V tile visits, and in which order: the walk that the warp-specialized
backward's loader warp, dQ writer warp and consumer warpgroups all follow (kernels/bwd_ws.py; one
home, so that the three cannot disagree, as common/kv_walk.py is the forward's).

Visit i (0 <= i < count) names one Q tile. The loader loads Q_i and dO_i (and their statistics)
into the Q ring in that order, the consumers wait for them in the same order, and the dQ writer
adds visit i's dQ share from buffer i % dq_buffers, which the consumers filled at the same visit
(the Q stage's index): each role reads the walk from the same values, so the ring's stages and
phases and the dQ buffers stay in step.

DenseQWalk: the Q tiles that see the K/V tile, m_first .. m_end - 1 (mask.py), from `start`
    (bwd_ws.walk_start), wrapping past the last to m_first where the walk may start elsewhere
    (`wraps`: unordered walks, rotated ordered ones).
BlockMaskQWalk: flex attention's block sparsity, over the transposed lists of torch's BlockMask
    (q_num_blocks, q_indices and, where present, full_q_num_blocks, full_q_indices: per K/V block,
    the Q blocks that see it): first the partial blocks (the mask mod runs on them), then the full
    blocks (no mask mod), each list from its first entry to its last. torch lists them ascending,
    so under a causal-like mask each K/V tile starts at its diagonal block and the CTAs of a head
    reach a Q tile at different times, as the dense causal walk does (descending, they would all
    add into the last Q tile at once). A block of `split` Q tiles (the BlockMask's 128 rows over
    the kernel's 64-row tiles: 2) is `split` consecutive visits, its tiles in order. A K/V tile
    with no block has count 0: K and V are loaded and dK = dV = 0 stored (as for the dense walk's
    empty ones).

The consumers of a block-sparse walk do not read the lists per visit: the loader publishes visit
i's tile in SMEM slot i % slots (2 x q_stages Int32s after the dQ turns' mbarriers: bwd_setup.py)
before it acquires the visit's stage, every lane storing it and the warp synchronized, so the
stage's arrive (a release) orders the store; a consumer reads it once the stage has landed (its
wait an acquire; `landed` in the consume steps). A slot is rewritten for visit i + slots only
after the consumers released visit i + slots - q_stages - 1 >= i, so after they read it. Reading
the lists' row per visit beside the five accumulators (a row pointer, a count, the clamp's bound)
spilled registers at d128 (b7). The counts the consumers still read, once. The dQ writer reads the
lists itself (it runs up to a tile behind the consumers).

The lists' constraints are the forward's (kv_walk.py): int32, (B or 1, H or 1, kv_blocks[,
q_blocks]), contiguous, a dimension of 1 broadcast by clamping its index, counts clamped to [0,
q_blocks]. A listed Q block is clamped to [0, q_blocks - 1] as well (one min and max a visit): a bad
index would add dQ outside the accumulator. The last block's second tile lies wholly past seqlen_q
where seqlen_q % 128 is 1..64: it is visited like the others (Q and dO load as zeros, TMA's
out-of-bounds fill; its statistics are the preprocess's padding, LSE * log2 e = +inf, so P = 0;
its dQ share, zero, lands in the accumulator's padding rows: the host sizes the statistics and
the accumulator in whole blocks, fa3/backward.py), so that the count is a multiple of `split` and
no role has to test a tile.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .kv_walk import list_rows

# Frozen dataclasses, as kv_walk's: a runtime loop calls their methods without carrying them.


@dataclass(frozen=True)
class DenseQWalk:
    """Q tiles from `start` up to m_end - 1, then (`wraps`) from m_first up to start - 1."""

    start: Int32
    m_first: Int32
    m_end: Int32
    wraps: bool  # static: whether a walk may start past m_first
    sparse = False
    has_full = False

    def count(self) -> Int32:
        return self.m_end - self.m_first

    def nonempty(self):
        return self.m_end > self.m_first

    def first(self) -> Int32:
        """The walk's first tile where it does not wrap (the late counter bump's first tile)."""
        return self.m_first

    def m_block(self, i: Int32) -> Int32:
        """The i-th Q tile (a compare per tile: the walk's division is done once, in walk_start)."""
        return _wrapped(self, i)

    consumer_tile = m_block


@dataclass(frozen=True)
class BlockMaskQWalk:
    """One K/V tile's Q tiles from a BlockMask's transposed lists: visits 0 .. partial_tiles() - 1
    cover the partial blocks (`partial`, that K/V tile's row of q_indices), the rest the full ones
    (`full`, its row of full_q_indices; None without full lists), `split` visits a block."""

    partial_count: Int32  # partial blocks listed
    partial: cute.Tensor
    blocks: Int32  # partial and full blocks listed
    full: object
    split: int  # static: Q tiles a block (a power of two)
    slots: object = None  # the loader's and the consumers': SMEM Int32 slots (a power of two of them)
    sparse = True

    @property
    def has_full(self) -> bool:
        return self.full is not None

    def count(self) -> Int32:
        return self.blocks * self.split

    def partial_tiles(self) -> Int32:
        """Visits of partial blocks (they come first)."""
        return self.partial_count * self.split

    def nonempty(self):
        return self.blocks > 0

    def first(self) -> Int32:
        return Int32(0)  # (the late counter bump is ordered: no block-sparse walk is)

    def m_block(self, i: Int32) -> Int32:
        """Visit i's Q tile, from whichever list holds it (the loader, the writer)."""
        return _either(self, i)

    def partial_m_block(self, i: Int32) -> Int32:
        """Visit i < partial_tiles(): a tile of a partial block."""
        return _tile(self.partial, self._entry(i), i, self.split)

    def full_m_block(self, i: Int32) -> Int32:
        """Visit i >= partial_tiles(): a tile of a full block."""
        return _tile(self.full, self._entry(i) - self.partial_count, i, self.split)

    def publish(self, i: Int32, m_block: Int32):
        """Loader warp (every lane), before it acquires visit i's stage: visit i's tile into slot
        i % slots, for the consumers (`published`)."""
        self.slots[i & (cute.size(self.slots) - 1)] = m_block
        cute.arch.sync_warp()  # every lane's store before the stage's arrive (release) by any lane

    def published(self, i: Int32) -> "PublishedTile":
        """Consumers: visit i's tile, read from its slot once visit i's stage has landed (`landed`)."""
        return PublishedTile(self.slots, i)

    def consumer_tile(self, i: Int32):
        """Consumers: visit i's tile, published by the loader (or, without slots, read here)."""
        return self.m_block(i) if self.slots is None else self.published(i)

    def _entry(self, i: Int32) -> Int32:
        """The block (counted over both lists) of visit i."""
        return i >> (self.split.bit_length() - 1) if self.split > 1 else i


@dataclass(frozen=True)
class PublishedTile:
    """Visit i's Q tile as the loader published it in SMEM (BlockMaskQWalk.publish): read once the
    visit's Q stage has landed (`landed`), so the consumers keep no walk of their own (a row of
    the lists and its count beside five accumulators spilled registers at d128)."""

    slots: cute.Tensor
    i: Int32

    def read(self) -> Int32:
        return cute.arch.make_warp_uniform(self.slots[self.i & (cute.size(self.slots) - 1)])


def landed(m_block):
    """A consume step's Q tile once its stage has landed: a published tile read from its slot, else
    as it is (the dense walk's, and the slotless walk's)."""
    return m_block.read() if isinstance(m_block, PublishedTile) else m_block


@cute.jit
def _wrapped(walk: DenseQWalk, i: Int32) -> Int32:
    m_block = walk.start + i
    if cutlass.const_expr(walk.wraps):
        if m_block >= walk.m_end:
            m_block -= walk.m_end - walk.m_first
    return m_block


def _tile(row: cute.Tensor, entry: Int32, i: Int32, split: int) -> Int32:
    """Tile i % split of the block at `entry` of a list's row, the block clamped into the row (and
    marked warp-uniform: every lane read the same entry, and the tile's offsets then stay in
    uniform registers, as the dense walk's do)."""
    block = cutlass.max(cutlass.min(cute.arch.make_warp_uniform(row[entry]), Int32(row.shape[0]) - 1), 0)
    if split == 1:
        return block
    return block * split + (i & (split - 1))


@cute.jit
def _either(walk: BlockMaskQWalk, i: Int32) -> Int32:
    m_block = Int32(0)
    if cutlass.const_expr(walk.has_full):
        if i < walk.partial_tiles():
            m_block = walk.partial_m_block(i)
        else:
            m_block = walk.full_m_block(i)
    else:
        m_block = walk.partial_m_block(i)
    return m_block


def block_mask_walk(lists, batch: Int32, head: Int32, n_block: Int32, split: int, slots=None) -> BlockMaskQWalk:
    """The walk of K/V tile n_block of (batch, query head) over `lists`, (q_num_blocks, q_indices)
    or those and (full_q_num_blocks, full_q_indices); `split` Q tiles a block; `slots`: the SMEM
    slots through which the loader hands each visit's tile to the consumers (None: the writer)."""
    assert split >= 1 and split & (split - 1) == 0, "a block is a power of two of Q tiles"
    partial_count, partial, blocks, full = list_rows(lists, batch, head, n_block)
    return BlockMaskQWalk(partial_count, partial, blocks, full, split, slots)
