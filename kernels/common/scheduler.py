"""Persistent tile schedules: which tiles a CTA works on, in which order (one home for tile orders).

A persistent grid launches one CTA per SM; CTA b takes linear tiles b, b + grid, b + 2 grid, ...
(or, dynamic, whatever a GMEM counter hands out next). The GEMM's linear order visits output tiles
in bands of `group_m` tile rows, going down each band's column before moving right:

    tile ids, group_m = 2, 3 x 4 tiles:     0  2  4  6
                                            1  3  5  7
                                            8  9 10 11     (a last, shorter band)

The CTAs running at one moment then cover a compact block of about group_m rows x grid/group_m
columns, so the A rows and B columns they read are fetched from DRAM once and shared through L2,
instead of a full row of B tiles per A row (row-major order).

Also here: the dynamic (work-stealing) hand-out, the tile numbering of packed variable-length
batches, and attention's order (AttentionTileSchedule: grouped heads, each head's Q tiles from the
last, and the K/V tiles a Q tile visits).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass import pipeline as dsl_pipeline

from . import mask, seqlen


def persistent_grid(num_tiles, sm_count):
    """CTAs to launch: one per SM, never more than there are tiles."""
    return cutlass.min(num_tiles, sm_count)


@cute.jit
def grouped_tile(tile_id: Int32, tiles_m: Int32, tiles_n: Int32, group_m: cutlass.Constexpr):
    """(m, n) tile coordinates of linear tile `tile_id`."""
    band_tiles = group_m * tiles_n
    band = tile_id // band_tiles
    first_m = band * group_m
    band_rows = cutlass.min(tiles_m - first_m, group_m)  # the last band may be shorter
    within = tile_id - band * band_tiles
    return first_m + within % band_rows, within // band_rows


# ---------------------------------------------------------------- dynamic (work-stealing) tiles
# A persistent CTA takes tile blockIdx first, then whatever the GMEM counter hands out next
# (grid + atomicAdd(counter, 1)): a CTA that finished short tiles takes more of them, which a static
# b, b + grid, ... assignment cannot do when tiles differ in length (causal attention). Within a
# CTA, the producer warp fetches the next tile and hands it to the consumers through one SMEM slot
# on a one-stage mbarrier pipeline (as FA3's and CUTLASS's schedulers do): *full* (one arrival, the
# producer's, after it wrote the slot) and *empty* (one arrival per consumer thread, after it read
# the slot). Every consumer thread reads every tile index, the "no more tiles" one (>= tiles)
# included, and releases it; the producer publishes exactly one index per tile it loaded, the
# last one being that sentinel, so both sides run the same number of hand-offs. The arrive/wait
# pairs order the slot's accesses (release/acquire at CTA scope) in a way compute-sanitizer's
# racecheck follows; named barriers (bar.arrive) order them too, but the tool reported hazards.
# One stage: the producer claims tile t + 1 only once the consumers have taken tile t, so a CTA
# never holds a claimed tile it cannot start (the counter's load balancing depends on it).
# With one stage, a side's pipeline state is just the parity of the hand-offs it has done so far
# (`done`, 0 or 1): callers that count their tiles anyway derive it from that count instead of
# carrying a state of its own across the tile loop (one more live register: the d64 packed
# kernel, three 160-register consumer warpgroups, spills it).
# The counter must read 0 at launch, and the kernel leaves it at 0: every CTA whose first tile is a
# tile fetches until it gets its sentinel, so a grid makes exactly `tiles` fetches (grid below the
# tile count: tiles - grid real ones and one sentinel a CTA; above: one sentinel each of the
# first `tiles` CTAs), and the one that returns tiles - 1 is the last. Its CTA subtracts `tiles`
# again: the next kernel on the stream finds 0, so the host keeps one counter a stream and never
# zeroes it between calls.
TILE_HANDOFF_BARRIERS = 2  # Int64 mbarriers (full, empty) the hand-off needs in SMEM


def tile_handoff(barrier_ptr, consumer_threads: int):
    """The next-tile pipeline on `barrier_ptr` (TILE_HANDOFF_BARRIERS mbarriers), created like the
    kernel's TMA rings (deferred: the kernel's pipeline.init_done() publishes the barriers)."""
    return dsl_pipeline.PipelineAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=1,
        producer_group=dsl_pipeline.CooperativeGroup(dsl_pipeline.Agent.Thread, 1),
        consumer_group=dsl_pipeline.CooperativeGroup(dsl_pipeline.Agent.Thread, consumer_threads),
        defer_sync=True,
    )


def _producer_state(done: Int32):
    """The producer's state after `done` (mod 2) hand-offs: its phase starts at 1, flips each one."""
    return dsl_pipeline.PipelineState(1, Int32(0), Int32(0), done ^ 1)


def _consumer_state(done: Int32):
    """The consumers' state after `done` (mod 2) hand-offs: phase 0 first."""
    return dsl_pipeline.PipelineState(1, Int32(0), Int32(0), done)


@cute.jit
def publish_next_tile(counter: cute.Tensor, slot: cute.Tensor, grid: Int32, tiles: Int32, handoff,
                      done: Int32) -> Int32:
    """Producer warp (all 32 lanes): fetch the next tile and publish it once the consumers have
    taken the previous one; `done`: the parity of the hand-offs before this one; `tiles`: the
    grid's tile count (the grid's last fetch resets the counter). Returns the tile."""
    lane = cute.arch.lane_idx()
    next_tile = Int32(0)
    if lane == 0:
        fetched = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        if fetched == tiles - 1:  # the grid's last fetch: back to 0 for the stream's next kernel
            cute.arch.atomic_add(counter.iterator, Int32(0) - tiles, sem="relaxed", scope="gpu")
        next_tile = grid + fetched
    next_tile = cute.arch.shuffle_sync(next_tile, 0)
    state = _producer_state(done)
    handoff.producer_acquire(state)  # every consumer thread has read the previous index
    if lane == 0:
        slot[0] = next_tile
        handoff.producer_commit(state)  # the one arrival on full, after the write
    return next_tile


@cute.jit
def take_next_tile(slot: cute.Tensor, handoff, done: Int32) -> Int32:
    """Consumer threads (every one): the tile the producer published, the sentinel included;
    `done`: the parity of the hand-offs before this one."""
    state = _consumer_state(done)
    handoff.consumer_wait(state, handoff.consumer_try_wait(state))
    next_tile = slot[0]
    handoff.consumer_release(state)  # one arrival per thread, after its read
    return next_tile


def handoff_tail(handoff, done: Int32):
    """Producer, before it exits (the rings' epilogue): wait until the consumers have taken the
    last index it published, the sentinel; `done`: the parity of all its hand-offs."""
    handoff.producer_tail(_producer_state(done))


# ---------------------------------------------------------------- variable-length batches
# A packed batch's Q tiles are numbered entry by entry (entry b owns ceil(seqlen_q[b] / tile_m) of
# them), so no tile is empty. A warp finds a tile's entry from flash-attn's cu_seqlens alone: each
# lane takes one entry of a chunk of 32, a shuffle scan gives the chunk's running tile counts and a
# ballot names the lane whose range holds the tile (one step per 32 entries; no host pass).
# `rows` (the packed tensor's total rows; None: trust the offsets) clamps each entry's span as
# seqlen.packed_span does, so that the tile numbering and the tiles' own lengths agree, and bad
# offsets can neither add tiles past the tensor nor make a count negative.
# `lengths` (static (low, high), or None): only entries of low <= length < high queries get tiles,
# so that two kernels can share one packed batch by its entries' lengths (a serving step's decodes
# on S1, its prompt chunks on K5: kernels/k5_cache.py), each writing only its own entries' rows.


@cute.jit
def _entry_blocks(mCuSeqlens: cute.Tensor, entry: Int32, tile_m: cutlass.Constexpr, rows=None,
                  rows_per_query=None, lengths=None) -> Int32:
    blocks = Int32(0)
    if entry < mCuSeqlens.shape[0] - 1:
        _, length = seqlen.packed_span(mCuSeqlens, entry, rows)
        if cutlass.const_expr(lengths is not None):  # another kernel's entry: no tiles here
            if length < lengths[0] or length >= lengths[1]:
                length = 0
        if cutlass.const_expr(rows_per_query is not None):  # packed GQA: a tile row per (query, head)
            length = length * rows_per_query
        blocks = (length + tile_m - 1) // tile_m
    return blocks


@cute.jit
def varlen_blocks(mCuSeqlens: cute.Tensor, tile_m: cutlass.Constexpr, rows=None, lengths=None) -> Int32:
    """Q tiles of the whole packed batch (every lane of the calling warp gets the total)."""
    lane = cute.arch.lane_idx()
    total = Int32(0)
    for chunk in cutlass.range(0, mCuSeqlens.shape[0] - 1, 32, unroll=1):
        total += cute.arch.warp_reduction_sum(_entry_blocks(mCuSeqlens, chunk + lane, tile_m, rows,
                                                            lengths=lengths))
    return total


@cute.jit
def warp_inclusive_sum(value: Int32, lane: Int32) -> Int32:
    """The sum of `value` over lanes 0..lane of the calling warp (Hillis-Steele: five shuffles)."""
    running = value
    for i in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync_up(running, 1 << i)
        if lane >= (1 << i):
            running += below
    return running


@cute.jit
def varlen_tile(block: Int32, mCuSeqlens: cute.Tensor, tile_m: cutlass.Constexpr, rows=None,
                rows_per_query=None, lengths=None, order=None):
    """(entry, its Q tile index, its Q tile count) of packed Q tile `block` < varlen_blocks; a
    whole warp calls it. A `block` past the last tile gives a tile count of 0. `rows_per_query`:
    tile rows per query (the query heads a packed-GQA tile holds per query position). `order` (a
    tensor of one index per entry, or a 1-element stand-in): the tiles are numbered over the
    entries in that order (the longest first: kernels/entry_order.py)."""
    lane = cute.arch.lane_idx()
    entries = mCuSeqlens.shape[0] - 1
    ordered = False
    if cutlass.const_expr(order is not None):
        ordered = order.shape[0] == entries
    before = Int32(0)  # tiles of the entries before this chunk
    chunk = Int32(0)
    entry, m_block, blocks = Int32(0), Int32(0), Int32(0)
    searching = chunk < entries
    while searching:
        lane_entry = chunk + lane
        if cutlass.const_expr(order is not None):
            if ordered and lane_entry < entries:
                lane_entry = Int32(order[lane_entry])
        count = _entry_blocks(mCuSeqlens, lane_entry, tile_m, rows, rows_per_query, lengths)
        running = warp_inclusive_sum(count, lane)
        holds = cute.arch.vote_ballot_sync(before + running > block)
        if holds != 0:
            first = cute.arch.popc((holds & -holds) - 1)  # the lowest lane whose range holds it
            entry = chunk + first
            if cutlass.const_expr(order is not None):
                entry = cute.arch.shuffle_sync(lane_entry, first)
            blocks = cute.arch.shuffle_sync(count, first)
            m_block = block - before - cute.arch.shuffle_sync(running, first) + blocks
            searching = False
        else:
            before += cute.arch.shuffle_sync(running, 31)
            chunk += 32
            searching = chunk < entries
    return entry, m_block, blocks


# ---------------------------------------------------------------- attention tiles
@cute.jit
def head_group_tile(tile: Int32, tiles_per_head: Int32, heads_batches: Int32, group: Int32):
    """(tile index within its head, head-batch index) of linear tile `tile` when heads (and batch
    entries) go in groups of `group` and each group's heads are interleaved tile by tile: tile 0 of
    every head in the group, then tile 1, ... Each head's tiles keep their order; CTAs launched
    together span a group's heads, whose shared operands stay in L2, and start on the same tile
    index of each (the longest first, where the caller puts it). Where `group` does not divide
    the heads, the first group holds the remainder: a small group last would hand out its longest
    tiles when every other SM is finishing (d128 causal 4k: 64 heads in groups of 9 left one head
    of 32 tiles for the end: the busiest SM ran 9% longer than the average, and the kernel 7%
    longer than with the remainder first)."""
    rem = heads_batches % group
    first_tiles = rem * tiles_per_head
    in_group, first_hb, within = group, Int32(0), tile
    if tile < first_tiles:
        in_group = rem
    else:
        rest = tile - first_tiles
        first_hb = rem + rest // (group * tiles_per_head) * group
        in_group = cutlass.min(group, heads_batches - first_hb)
        within = rest % (group * tiles_per_head)
    return within // in_group, first_hb + within % in_group


class AttentionTileSchedule:
    """Mixin for a persistent attention kernel (K5): a linear tile -> the work it names. The kernel
    sets tile_m, tile_n, causal and varlen (static); `params` holds what varies per call: varlen,
    q_blocks (varlen_blocks), cu_q/cu_k and rows_q/rows_k (the packed tensors' rows, which bound
    every entry's span); window (None, or the sliding window's edges)."""

    causal_group_waves = 2  # causal head groups: tiles for this many waves of CTAs
    query_lengths = None  # varlen: the entries this kernel takes by query count (_entry_blocks)

    @cute.jit
    def tile_coords(self, tile: Int32, seqlen_q: Int32, heads_q: Int32, batch: Int32):
        """The linear tile order (a static CTA b takes tiles b, b + grid, ...; K5.5 hands them out
        in this order from a counter): heads (and batches) in groups; within a group, Q tiles from
        the last (longest under causal) to the first, the group's heads interleaved. Non-causal
        groups are one head: the CTAs running together work on one head and share its K/V in L2.
        Causal tiles differ in length, so a group holds enough heads for two waves of CTAs to start
        on long tiles (longest-processing-time first), yet few enough that their K/V still fits in
        L2 (all heads at once measured slower: worklog/k5.md)."""
        m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
        heads_batches = heads_q * batch
        group = 1
        if cutlass.const_expr(self.causal):
            group = cutlass.min((self.causal_group_waves * cute.arch.grid_dim()[0] + m_blocks - 1) // m_blocks,
                                heads_batches)
        from_last, head_batch = head_group_tile(tile, m_blocks, heads_batches, group)
        return m_blocks - 1 - from_last, head_batch % heads_q, head_batch // heads_q

    def tile_range(self, mQ, params):
        """(this CTA's first tile, the tile count, the static step); mQ is a (seqlen_q, d, heads,
        batch) view of Q or O."""
        seqlen_q, heads_q, batch = mQ.shape[0], mQ.shape[2], mQ.shape[3]
        if cutlass.const_expr(self.varlen):
            tiles = params.q_blocks * heads_q
        else:
            tiles = (seqlen_q + self.tile_m - 1) // self.tile_m * heads_q * batch
        return cute.arch.block_idx()[0], tiles, cute.arch.grid_dim()[0]

    @cute.jit
    def tile_work(self, tile: Int32, mQ: cute.Tensor, seqlen_k: Int32, params):
        """(m_block, head, batch, seq) of linear tile `tile`: `seq` (common/seqlen.py) holds the
        entry's lengths and, varlen, its row offsets; mQ is (seqlen_q, d, heads, batch)."""
        if cutlass.const_expr(self.varlen):
            # every query head of one Q tile in a row, the entry's Q tiles longest first if causal,
            # entry after entry: the CTAs running together share one entry's K/V in L2, GQA
            # groups included (one head's tiles of every entry in a row, the order before, ran
            # slower: worklog/k5.md)
            head, block = tile % mQ.shape[2], tile // mQ.shape[2]
            batch, m_block, blocks = varlen_tile(block, params.cu_q, self.tile_m, params.rows_q,
                                                 lengths=self.query_lengths)
            if cutlass.const_expr(self.causal):
                m_block = blocks - 1 - m_block
            return m_block, head, batch, self.entry_lengths(batch, params)
        m_block, head, batch = self.tile_coords(tile, mQ.shape[0], mQ.shape[2], mQ.shape[3])
        return m_block, head, batch, seqlen.fixed(mQ.shape[0], seqlen_k)

    def entry_lengths(self, batch: Int32, params):
        """Entry `batch` of a packed batch (common/seqlen.py): keys packed as the queries are (a
        KV cache's kernel, kernels/k5_cache.py, reads them from the cache)."""
        return seqlen.from_cu_seqlens(params.cu_q, params.cu_k, batch, params.rows_q, params.rows_k)

    @cute.jit
    def kv_range(self, m_block: Int32, seq, params):
        """(n_block_max, n_blocks): the K/V tiles visited, n_block_max - 1 down to n_block_max -
        n_blocks."""
        n_max = mask.n_block_max(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                 self.causal, window=params.window)
        if cutlass.const_expr(params.window is None):
            return n_max, n_max
        n_min = mask.n_block_min(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                 window=params.window)
        return n_max, cutlass.max(n_max - n_min, 0)


# ---------------------------------------------------------------- split-KV (the KV-cache kernels)
@cute.jit
def split_kv_range(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, seq, causal: cutlass.Constexpr,
                   rows_per_query, window, split: Int32, num_splits: Int32):
    """(n_blocks, last): split `split` of `num_splits` of the key blocks a packed-GQA Q tile sees
    (`rows_per_query` tile rows per query; `window` None or runtime edges, as mask.py's), an equal
    share each, visited from `last` down to last - n_blocks + 1. A split with nothing to do (a tile
    holding no query, more splits than blocks) gets n_blocks = 0."""
    blocks_end = mask.n_block_max(m_block, tile_m, tile_n, seq.seqlen_q, seq.seqlen_k, causal,
                                  rows_per_query=rows_per_query, window=window)
    blocks_start = mask.n_block_min(m_block, tile_m, tile_n, seq.seqlen_q, seq.seqlen_k,
                                    rows_per_query=rows_per_query, window=window)
    blocks = cutlass.max(blocks_end - blocks_start, 0)
    per_split = (blocks + num_splits - 1) // num_splits
    first = blocks_start + split * per_split
    n_blocks = cutlass.max(cutlass.min(blocks_end, first + per_split) - first, 0)
    return n_blocks, first + n_blocks - 1
