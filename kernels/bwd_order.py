"""The backward's dQ order: which K/V tile's CTA adds its share of a Q tile's dQ when.

Unordered (the default where it is faster), every CTA adds with reduce-adds as it goes. Ordered
(`ordered_dq`: deterministic, or b2 at d256 for speed), each Q tile has an int32 counter and the
K/V tiles add their shares to it one at a time in a fixed order (common/accum.py: wait for the
counter to reach the CTA's turn, add, make the add visible, bump it), so the FP32 sums are the
same bits every run. The order:

    causal or windowed (`kv_reversed`): descending K/V tiles, the CTAs numbered from the last tile,
        so the diagonal's CTA, whose walk reaches the Q tile first, adds first and is launched first;
    no mask: ascending K/V tiles, or rotated (`rotates_ordered`: K/V tile n starts its walk at Q
        tile n * step, `rotation_step`: tile_n / tile_m where the Q tiles leave room, else 1, and
        Q tile m takes its adds in the order the walks bring them).

Where the K/V tile a CTA waits on for Q tile m walked m two or more steps earlier (descending
walks, and rotated ones of step 2 or more), or is the one below it in an ascending walk, and a K/V
tile spans two or more Q tiles, a Q tile's counter is passed on one step late
(`defers_dq_bump`, `defers_now`): the writer issues the next tile's adds before it waits for this
tile's to land, so the consumers no longer wait a whole reduce round trip per tile.

Packed batches launch as fixed lengths do: entry after entry, each entry's heads in turn, a
head's K/V tiles in a row (`kv_tile_work`; one head's tiles of every entry in a row, the order
before, read each Q/dO row 128 bytes at a time at d64 and ran slower than fixed lengths:
worklog/backward.md).

The launch order (`head_groups`, causal): the grid's CTAs numbered head after head give each
head's long walks (K/V tile 0 walks every Q tile) first but the last heads' long walks at the end,
behind whatever is left of the others. Instead heads (and batch entries) go in groups, the group's
heads interleaved tile by tile (common/scheduler.py, head_group_tile): the CTAs of one tile index of
the whole group start together, longest first, and the group's Q, dO and dQ accumulator (the rows
every K/V tile of a head walks) fit in L2 together (`l2_bytes`); the S^T rungs also cap a group at
about one wave of CTAs (`head_group_ctas`: at d64 2k, 33 heads of 16 K/V tiles made four waves
share L2). Each head's CTAs keep their order. Ordered walks without
a mask group heads too (`ordered_head_groups`): a head's CTAs pass each Q tile's counter along in
K/V order, and with one head in flight that chain is the critical path; a group gives the SMs
other heads' chains to run while one waits. Not a rotated walk (below): it would need the whole
group's K/V tiles resident at once. Which rungs group is a flag of the kernel (`head_groups`, set
by the rungs' configurations, kernels/config.py): b4 and b8 launch head after head, b2, b3, b6, b7
and b9 in groups, as each measured faster (worklog/backward.md).

A CTA may only wait for CTAs launched before it, or for CTAs that are resident with it: the GPU
launches CTAs in order as earlier ones finish, so a wait on one that cannot launch until the waiter
finishes never ends. The rotated order waits on higher-numbered K/V tiles of the same head, so it
is used only where a head's K/V tiles fit on the GPU at once (`rotated_walk_max_kv_tiles`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .common import accum, mask, scheduler


class DqOrder:
    # ordered (deterministic) walks without a mask start at different Q tiles (`rotates_ordered`):
    # B2 at d256 (its configuration's `rotated_walk`); elsewhere every K/V tile walks its Q tiles from
    # the first (bwd_ws.py says why)
    rotated_ordered_walk = False
    # The rotated order makes a CTA wait for adds of higher-numbered K/V tiles of its head, so all
    # of a head's K/V tiles must be resident at once (one CTA an SM): with more tiles than SMs it
    # deadlocked (d256 at 12k: 192 tiles, 132 SMs). A bound well under any Hopper part's SM
    # count (78 on the smallest), which keeps the gains at the lengths that have them (backward.md)
    rotated_walk_max_kv_tiles = 32
    # causal grids launched in groups of interleaved heads (`launch_tile`), each group's Q, dO and
    # FP32 dQ rows within `l2_bytes` (Hopper's L2: 50 MB)
    head_groups = True
    # ordered walks without a mask launched in head groups too (not rotated ones: a rotated walk
    # waits on later K/V tiles of its head, which must all be resident at once)
    ordered_head_groups = True
    l2_bytes = 50 * 1024 * 1024
    # (> 0) a group also no larger than this many CTAs' worth of heads (`head_group`)
    head_group_ctas = 0

    @property
    def groups_heads(self) -> bool:
        """Whether the launch order may group heads (`head_groups`): causal, or ordered walks."""
        return self.head_groups and (self.causal or (self.ordered_head_groups and self.ordered_dq))

    @cute.jit
    def head_group(self, seqlen_q: Int32, seqlen_k: Int32, heads_batches: Int32):
        """Heads (and batch entries) launched together (`launch_tile`): 1, or (`groups_heads`) as
        many as fit their Q, dO and FP32 dQ rows in `l2_bytes`, and (`head_group_ctas`) whose K/V
        tiles number no more than head_group_ctas."""
        group = Int32(1)
        if cutlass.const_expr(self.groups_heads):
            row_bytes = 2 * (self.head_dim + self.head_dim_v) * self.dtype.width // 8 + 4 * self.head_dim
            group = cutlass.min(cutlass.max(self.l2_bytes // row_bytes // cutlass.max(seqlen_q, 1), 1),
                                heads_batches)
            if cutlass.const_expr(self.head_group_ctas > 0):
                kv_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
                group = cutlass.max(cutlass.min(group, self.head_group_ctas // cutlass.max(kv_tiles, 1)), 1)
            if cutlass.const_expr(self.rotates_unmasked):
                if self.rotates_ordered(seqlen_q, seqlen_k):
                    group = Int32(1)
        return group

    @cute.jit
    def launch_tile(self, block: Int32, head: Int32, batch: Int32, kv_tiles: Int32, seqlen_q: Int32,
                    seqlen_k: Int32, heads: Int32, batches: Int32):
        """(block, head, batch) of the CTA at grid position (block, head, batch): itself, or
        (`groups_heads`) the CTA at that place in the grouped launch order (module doc)."""
        if cutlass.const_expr(self.groups_heads):
            tile = block + kv_tiles * (head + heads * batch)
            block, head_batch = scheduler.head_group_tile(
                tile, kv_tiles, heads * batches, self.head_group(seqlen_q, seqlen_k, heads * batches))
            head, batch = head_batch % heads, head_batch // heads
        return block, head, batch

    # ordered causal walks: a Q tile's counter passed on once the writer has issued the next
    # tile's adds (the sums of this one then land under them), not right after its own adds;
    # fewer cycles for the same bits (worklog/backward.md)
    defer_dq_bump = True
    # ascending walks (no mask, too many K/V tiles to rotate) too: a CTA waits only on the one
    # below it (no cycle: K/V tile 0 waits on nobody). Where a K/V tile spans two or more Q tiles,
    # B2's deterministic d128 main kernel, locked clocks, 8k and 16k: 6.6% fewer cycles, the same
    # bits; with one Q tile a K/V tile (d256's 64 x 64) 10.5% more: each CTA of the wavefront then
    # starts a whole step behind the one below it, so only wide tiles defer (`defers_dq_bump`)
    defer_ascending = True

    @property
    def defers_dq_bump(self) -> bool:
        """Whether this variant may pass counters on late (`defer_dq_bump`; `defers_now` decides
        per entry): descending walks of K/V tiles that span two or more Q tiles, rotated ones that
        can start two or more Q tiles apart, and (`defer_ascending`) ascending ones of such
        tiles."""
        if not (self.defer_dq_bump and self.ordered_dq):
            return False
        wide = self.tile_n >= 2 * self.tile_m
        return wide and (self.kv_reversed or self.rotates_unmasked or self.defer_ascending)

    @cute.jit
    def defers_now(self, seq):
        """Whether the dQ writer passes this entry's counters on late: `defers_dq_bump` where it is
        safe to wait a step. Descending walks and rotated ones of step >= 2: the K/V tile a CTA
        waits on for Q tile m walked m at least two steps earlier. A rotated walk of step 1 must
        not: the CTA it waits on would be waiting, at the same step, for the next one's next add,
        and so on around the head, back to itself (a deadlock); nor descending walks of K/V tiles
        of one Q tile (d64's 128 x 128: every step's adds would wait for walks that end later).
        Ascending walks (`defer_ascending`): a CTA waits only on lower ones."""
        defer = cutlass.Boolean(False)
        if cutlass.const_expr(self.defers_dq_bump):
            defer = cutlass.Boolean(True)
            if cutlass.const_expr(not self.kv_reversed):
                rotates = cutlass.Boolean(False)
                if cutlass.const_expr(self.rotates_unmasked):
                    rotates = self.rotates_ordered(seq.seqlen_q, seq.seqlen_k)
                if rotates:
                    defer = self.rotation_step(seq.seqlen_q, seq.seqlen_k) >= 2
                else:
                    defer = cutlass.Boolean(self.defer_ascending)
        return defer

    @cute.jit
    def pass_on_late(self, mLock: cute.Tensor, seq, m_block: Int32, head: Int32, batch: Int32, lane: Int32):
        """The writer warp's late bump (`defers_now`): Q tile m_block's adds have landed, its
        counter goes to the next K/V tile."""
        accum.ordered_end(self.dq_counter(mLock, seq, m_block, head, batch), lane, cute.arch.sync_warp)

    @property
    def kv_reversed(self) -> bool:
        """Deterministic causal or windowed: each Q tile's K/V tiles add in descending order."""
        return self.ordered_dq and (self.causal or self.local)

    @cute.jit
    def kv_order(self, block: Int32, kv_tiles: Int32) -> Int32:
        """The K/V tile of the entry's block-th CTA: block itself, or, reversed (`kv_reversed`), the
        last tile first. Deterministic adds to Q tile m go in the order of its K/V tiles' CTAs.
        Under a causal mask the highest of them (the diagonal's) starts its walk at m, and a lower
        one reaches m later in its walk (it starts further up): adding from the top down, no CTA
        waits on another in steady state, and the ones waited on are launched first. Ascending,
        K/V tile n could add to its first Q tile only after n - 1 had walked down to it, a
        wavefront across the head."""
        n_block = block
        if cutlass.const_expr(self.kv_reversed):
            n_block = cutlass.max(kv_tiles - 1 - block, 0)  # 0 for a varlen CTA past the last tile
        return n_block

    def dq_counter(self, mLock: cute.Tensor, seq, m_block: Int32, head: Int32, batch: Int32):
        """Pointer to Q tile m_block's counter. Varlen: entry b's tiles count from
        cu_seqlens_q[b] // tile_m + b, which leaves every entry room for all of its tiles."""
        if cutlass.const_expr(self.varlen):
            return accum.elem_ptr(mLock, (0, head, self.packed_q_tile(seq, m_block, batch)))
        return accum.elem_ptr(mLock, (batch, head, m_block))


    @cute.jit
    def wait_dq_turn(self, mLock: cute.Tensor, seq, m_block: Int32, n_block: Int32, head: Int32,
                     batch: Int32, window, thread: Int32, barrier_fn):
        """Deterministic dQ: wait until Q tile m_block's counter reaches this K/V tile's turn;
        returns the counter, for accum.ordered_end once the adds are visible."""
        counter = self.dq_counter(mLock, seq, m_block, head, batch)
        turn = self.dq_turn(m_block, n_block, seq.seqlen_q, seq.seqlen_k, window)
        accum.ordered_begin(counter, turn, thread, barrier_fn)
        return counter

    @cute.jit
    def dq_turn(self, m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window) -> Int32:
        """Deterministic dQ: this K/V tile's place among Q tile m_block's contributors, which are
        n_block_min(m) .. n_block_max(m) - 1 (a window's first is not 0), counted from the last
        when `kv_reversed`."""
        turn = n_block
        if cutlass.const_expr(self.kv_reversed):
            last = mask.n_block_max(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal,
                                    window=window) - 1
            turn = last - n_block
        elif cutlass.const_expr(window is not None):
            turn = n_block - mask.n_block_min(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                              window=window)
        elif cutlass.const_expr(self.rotates_unmasked):
            # K/V tile n walks the Q tiles from tile n * step (`rotates_ordered`): Q tile m is
            # reached first by K/V tile min(m / step, kv_tiles - 1), then by the ones below it,
            # cyclically, each `step` steps after the last. Ranking the adds in that order, each CTA
            # finds its turn come as it arrives (ascending turns made a wavefront: K/V tile n
            # waited n steps before its first add)
            kv_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
            if self.rotates_ordered(seqlen_q, seqlen_k):
                first = cutlass.min(m_block // self.rotation_step(seqlen_q, seqlen_k), kv_tiles - 1)
                turn = (first - n_block + kv_tiles) % kv_tiles
        return turn

    @property
    def rotates_unmasked(self) -> bool:
        """Whether this variant's ordered walks may rotate (`rotated_ordered_walk`, no mask)."""
        return self.rotated_ordered_walk and not (self.causal or self.local)

    @cute.jit
    def rotation_step(self, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """How many Q tiles apart the rotated walks start (`rotates_ordered`): tile_n / tile_m (a K/V
        tile's span, so that a Q tile's visitors come that many steps apart), where the Q tiles
        hold kv_tiles starts that far apart, else 1."""
        step = Int32(1)
        if cutlass.const_expr(self.tile_n >= 2 * self.tile_m):
            kv_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
            q_tiles = (seqlen_q + self.tile_m - 1) // self.tile_m
            step = cutlass.max(cutlass.min(Int32(self.tile_n // self.tile_m), q_tiles // cutlass.max(kv_tiles, 1)), 1)
        return step

    @cute.jit
    def rotates_ordered(self, seqlen_q: Int32, seqlen_k: Int32):
        """Whether an ordered walk without a mask starts at Q tile n_block (`rotated_ordered_walk`):
        when the entry has no more K/V tiles than Q tiles, so that the starts are distinct, and
        few enough to be resident together (`rotated_walk_max_kv_tiles`); else in order, where
        each CTA waits only for lower-numbered ones (launched first)."""
        kv_tiles = (seqlen_k + self.tile_n - 1) // self.tile_n
        q_tiles = (seqlen_q + self.tile_m - 1) // self.tile_m
        return kv_tiles <= q_tiles and kv_tiles <= self.rotated_walk_max_kv_tiles
