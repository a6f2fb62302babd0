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

The consumers of a block-sparse walk do not read the lists per visit: the loader hands them each
visit's tile through SMEM (`TileHandoff`: an Int32 slot per Q stage, each with a full and an empty
mbarrier, after the dQ turns' mbarriers: bwd_setup.py, bwd_ws.py), as the tile scheduler hands
out its next tile (scheduler.py) and M1 its P (pipeline.create_handoff): a ring beside the Q ring,
stepped by the Q ring's own states (visit i: stage i % q_stages, its phase). Before it acquires
visit i's Q stage the loader waits for the slot's empty barrier (every consumer thread has read
visit i - q_stages), lane 0 stores the tile and arrives on the slot's full barrier (one arrival);
once the stage has landed (`landed` in the consume steps) each consumer thread waits for the full
barrier, reads the slot and arrives on the empty one (one arrival a thread). So plain arrive/wait
pairs order the store before the reads and the reads before the next store, which
compute-sanitizer's racecheck follows. (The slot stored before the stage's arrive.expect_tx and
read after its wait is ordered on the GPU as well, but the tool follows neither a barrier that TMA
completes nor bar.warp.sync: it reported 27,776 RAW hazards.) The loader never waits on a slot
longer than on the Q ring: the consumers read visit i - q_stages's slot before they release its
stage, which the loader waits for next. Reading the lists' row per visit beside the five
accumulators (a row pointer, a count, the clamp's bound) spilled registers at d128 (b7). The
counts the consumers still read, once. The dQ writer reads the lists itself (it runs up to a tile
behind the consumers).

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
    handoff: object = None  # the loader's and the consumers': the tiles' SMEM hand-off (TileHandoff)
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

    def publish(self, q_state, m_block: Int32):
        """Loader warp (every lane), before it acquires the visit's Q stage (`q_state`, its
        producer state): the visit's tile to the consumers (`consumer_tile`)."""
        _publish(self.handoff, q_state, m_block)

    def consumer_tile(self, i: Int32):
        """Consumers: visit i's tile, taken from the loader's hand-off once the visit's stage has
        landed (`landed`); without a hand-off, read here."""
        return self.m_block(i) if self.handoff is None else PublishedTile(self.handoff)

    def _entry(self, i: Int32) -> Int32:
        """The block (counted over both lists) of visit i."""
        return i >> (self.split.bit_length() - 1) if self.split > 1 else i


@dataclass(frozen=True)
class TileHandoff:
    """The loader's hand-off of a block-sparse walk's tiles to the consumers (the module docstring):
    an Int32 slot per Q stage (`slots`) and, at `barriers`, their mbarriers: stage k's full at k (one
    arrival: the loader's lane 0, after its store), its empty at stages + k (one arrival per
    consumer thread, after its read). Stepped by the Q ring's states (index, phase)."""

    barriers: object  # cute.Pointer to 2 x stages Int64 mbarriers
    slots: cute.Tensor  # stages Int32s

    def full(self, state):
        return self.barriers + state.index

    def empty(self, state):
        return self.barriers + cute.size(self.slots) + state.index


def handoff_words(stages: int) -> int:
    """Int64 words of SMEM a hand-off of `stages` takes (its mbarriers, then its Int32 slots)."""
    return 2 * stages + (stages + 1) // 2


@cute.jit
def init_handoff(barriers, stages: cutlass.Constexpr, consumer_threads: cutlass.Constexpr):
    """Thread 0, beside the kernel's other barriers (made visible by pipeline.init_done): full
    barriers of one arrival, empty ones of one per consumer thread."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        for k in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(barriers + k, 1)
            cute.arch.mbarrier_init(barriers + stages + k, consumer_threads)


def make_handoff(barriers, stages: int) -> TileHandoff:
    """The hand-off whose `stages` slots follow its mbarriers at `barriers` (handoff_words of them)."""
    return TileHandoff(barriers, cute.make_tensor(cute.recast_ptr(barriers + 2 * stages, dtype=Int32),
                                                  cute.make_layout(stages)))


@cute.jit
def _publish(handoff: TileHandoff, q_state, m_block: Int32):
    """Loader warp (every lane): wait until every consumer thread has read the slot's last tile (the
    producer state's phase starts at 1: the first round passes), then lane 0 stores this one and
    arrives on the slot's full barrier."""
    cute.arch.mbarrier_wait(handoff.empty(q_state), q_state.phase)
    if cute.arch.lane_idx() == 0:
        handoff.slots[q_state.index] = m_block
        cute.arch.mbarrier_arrive(handoff.full(q_state))


@dataclass(frozen=True)
class PublishedTile:
    """A visit's Q tile as the loader published it (BlockMaskQWalk.publish): taken once the visit's
    Q stage has landed (`landed`), so the consumers keep no walk of their own (a row of the lists
    and its count beside five accumulators spilled registers at d128)."""

    handoff: TileHandoff

    @cute.jit
    def take(self, q_state) -> Int32:
        """Every consumer thread, once per visit (`q_state`: the visit's consumer state): wait for
        the slot's full barrier, read the slot, free it (one arrival on its empty barrier). The
        wait tries once first, as pipeline.consume_wait does: the loader arrived before it issued
        the stage's copies, so it has passed (this shape also spilled the fewest registers at d128)."""
        if not cute.arch.mbarrier_try_wait(self.handoff.full(q_state), q_state.phase):
            cute.arch.mbarrier_wait(self.handoff.full(q_state), q_state.phase)
        m_block = self.handoff.slots[q_state.index]
        cute.arch.mbarrier_arrive(self.handoff.empty(q_state))
        return cute.arch.make_warp_uniform(m_block)


def landed(m_block, q_state):
    """A consume step's Q tile once its stage (`q_state`) has landed: a published tile taken from
    the hand-off, else as it is (the dense walk's, and a walk's without a hand-off)."""
    return m_block.take(q_state) if isinstance(m_block, PublishedTile) else m_block


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


def block_mask_walk(lists, batch: Int32, head: Int32, n_block: Int32, split: int, handoff=None) -> BlockMaskQWalk:
    """The walk of K/V tile n_block of (batch, query head) over `lists`, (q_num_blocks, q_indices)
    or those and (full_q_num_blocks, full_q_indices); `split` Q tiles a block; `handoff`: the SMEM
    hand-off through which the loader gives each visit's tile to the consumers (TileHandoff; None:
    the writer)."""
    assert split >= 1 and split & (split - 1) == 0, "a block is a power of two of Q tiles"
    partial_count, partial, blocks, full = list_rows(lists, batch, head, n_block)
    return BlockMaskQWalk(partial_count, partial, blocks, full, split, handoff)
