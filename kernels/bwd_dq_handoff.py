"""The warp-specialized backward's dQ: from the consumers' registers to the FP32 accumulator in
global memory, through SMEM and the dQ writer warp, which the consumers do not wait for.

Fragment order. Each consumer thread stores its FP32 dQ share in the order its registers hold it
(element i of thread t of a warpgroup at 512 (i / 4) + 4 t + i % 4 of the warpgroup's share: a
16-byte store per 4 registers, a warp's 32 stores contiguous, no bank conflicts), and the writer
adds a share with one 1-D bulk reduce-add into an accumulator of whole Q tiles laid out the same
way, head-major (batch, heads, Q tiles, tile_m x d; packed batches: each entry's tiles in
`packed_q_tile` slots), warpgroup w's share at w x tile_m x d / warpgroups of its tile. The
postprocess (bwd_post.py) reads the fragments back through the kernel's own dQ partition
(`dq_coords`; dQ^T's accumulator is the transposed tile, `dq_view`).

Three hand-offs between the consumers and the writer; the kernel's flags pick one:

    whole tile (the default): both warpgroups fill one buffer and meet the writer at two named
        barriers of consumers + writer: DQ_EMPTY (the writer gives the buffer back once the bulk
        copy has read it; it starts with one credit) and DQ_FULL (the consumers filled it). The
        writer adds both shares, back to back, with one bulk reduce-add.
    per warpgroup (`dq_per_warpgroup`): the dQ MMA already splits d (dQ^T: its rows) between the
        warpgroups, so each warpgroup's share travels on its own, through `dq_buffers` buffers:

            consumer warpgroup w, Q tile i (buffer b = i % 2):
                wait EMPTY[w, b]; store its share in fragment order; fence; arrive FULL[w, b]
            writer warp, Q tile i:
                for w: wait FULL[w, b]; one 1-D bulk reduce-add of share w; commit
                then hand back tile i - 1's buffers (EMPTY[w, b ^ 1]) once the copy engine has
                read them

        A warpgroup meets only the writer (128 + 32 threads), never the other warpgroup, and the
        writer returns a buffer one tile late, so a slow reduce-add delays nobody unless it takes
        a whole Q tile. The shares are stages of one flat FP32 layout, stage = 2 b + w. With one
        buffer (`dq_buffers` = 1, where two do not fit) the writer hands a share back as soon as
        its reduce-add has read it. The buffer follows the Q stage index, as the transposed
        scores' dS^T buffers do (their consume step passes it): two Q stages. SMEM (bf16, d128,
        transposed scores): the second buffer brings 192 KB to 224 KB.
    per warpgroup through mbarriers (`dq_mbarriers`, with `dq_per_warpgroup`): full and empty per
        warpgroup, waited on by parity, the consumers' count of Q tiles (`step`) passed by the
        row-major consume step. With `shared_dq_buffer` the SMEM holds one warpgroup's share
        (half a Q tile) and the warpgroups take turns: warpgroup 0 fills it, the writer adds it
        and hands it to warpgroup 1 once read, adds that one, hands it back; warpgroup 1 waits
        for the writer while its dV and dK GEMMs run. Without it each warpgroup has a buffer of
        its own, handed back to it once read (no turns). Mbarriers, not named barriers: thread t
        of each warpgroup writes the same bytes, and compute-sanitizer's racecheck orders such
        writes through mbarriers but reports looped named-barrier hand-offs as hazards (a model
        of these turns: hazards with named barriers, none with mbarriers; both ran correctly).

Ordered dQ (deterministic, or `ordered_dq`): the writer waits for the Q tile's counter to reach
this K/V tile's turn (`dq_turn`, bwd_order.py) before the tile's first reduce-add, waits for the
tile's sums to land, then bumps the counter (common/accum.py); the whole tile's and the
per-warpgroup writers, where they may (`defers_now`), pass it on a step late, once the next
tile's adds are issued (the per-warpgroup hand-off then frees a tile's buffers only once its
counter is passed on: it needs two).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .common import accum, tma

# named barriers: 0 is __syncthreads, 1 the consumer warpgroups among themselves (bwd_ws.py)
DQ_EMPTY, DQ_FULL = 2, 3  # the whole tile's: consumers + the dQ writer warp
FIRST_DQ_BARRIER = 2  # per warpgroup: EMPTY[w, b] = 2 + 2 (2 b + w), FULL the next id
# the hand-off through mbarriers (`dq_turns` in SMEM): full and empty of warpgroup w at 2 w and 2 w + 1
TURN_FULL, TURN_EMPTY = 0, 1


class DqHandoff:
    """Mixin of the warp-specialized backward (bwd_ws.py): the SMEM dQ buffer, the consumers'
    hand-off and the writer warp, in the form the kernel's flags pick (`dq_per_warpgroup`,
    `dq_mbarriers`, `dq_buffers`, `shared_dq_buffer`; the module docstring)."""

    # ---------------------------------------------------------------- host side
    def half_elems(self) -> int:
        """FP32 elements of one warpgroup's dQ share of a Q tile."""
        return self.tile_m * self.head_dim // self.mma_warpgroups

    def dq_smem_elems(self) -> int:
        return cute.cosize(self.sdq_layout())

    def sdq_layout(self):
        """The FP32 SMEM dQ buffers, unswizzled, a share in fragment order a column: (half_elems,
        warpgroups) for the whole tile; per warpgroup (half_elems, warpgroups x dq_buffers), stage
        2 b + w warpgroup w's share of buffer b; through mbarriers one warpgroup's share (the
        warpgroups take turns), or with `shared_dq_buffer` off one for each warpgroup."""
        if self.dq_mbarriers:
            return cute.make_layout((self.half_elems(), 1 if self.shared_dq_buffer else self.mma_warpgroups))
        if self.dq_per_warpgroup:
            return cute.make_layout((self.half_elems(), self.mma_warpgroups * self.dq_buffers))
        return cute.make_layout((self.half_elems(), self.mma_warpgroups))

    # ---------------------------------------------------------------- the hand-off, by flag
    def hand_off_dq(self, ctx, s, acc_dq: cute.Tensor, buffer: Int32 = 0, step: Int32 = 0):
        """This consumer's dQ share of the Q tile into SMEM, for the writer: `buffer` is the Q
        stage's index (per warpgroup), `step` the Q tile's count (through mbarriers)."""
        if self.dq_mbarriers:
            return self.hand_off_dq_by_mbarrier(ctx, s, acc_dq, step)
        if self.dq_per_warpgroup:
            return self.hand_off_dq_by_warpgroup(ctx, s, acc_dq, buffer)
        return self.hand_off_whole_dq(ctx, s, acc_dq)

    def write_dq(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                 walk, seq, window, lane: Int32):
        """The dQ writer warp's loop over this CTA's Q tiles."""
        if self.dq_mbarriers:
            write = self.write_dq_by_mbarrier
        elif self.dq_per_warpgroup:
            write = self.write_dq_by_warpgroup
        else:
            write = self.write_whole_dq
        return write(mdQacc, s, mLock, n_block, head, batch, walk, seq, window, lane)

    # ---------------------------------------------------------------- fragment order
    def dq_coords(self, tidx):
        """(row, column) in the (tile_m, d) dQ tile of each element of consumer thread tidx's dQ
        fragment, in the fragment's order (`dq_view`: dQ^T's accumulator is transposed)."""
        return self.tiled_mmas()[2].get_slice(tidx).partition_C(
            self.dq_view(cute.make_identity_tensor((self.tile_m, self.head_dim))))

    @staticmethod
    def fragment_view(flat: cute.Tensor, t) -> cute.Tensor:
        """Thread t's elements of a warpgroup's dQ share in fragment order: element i at
        512 (i / 4) + 4 t + i % 4, as (4, n / 4) (each column one 16-byte vector)."""
        n = cute.size(flat) // 128
        # (16-byte aligned: the share starts on 16 bytes and a thread's offset is 16 t bytes)
        return cute.make_tensor((flat.iterator + 4 * t).align(16), cute.make_layout((4, n // 4), stride=(1, 512)))

    @cute.jit
    def store_fragment(self, acc_dq: cute.Tensor, sdQ_half: cute.Tensor, t: Int32):
        """This thread's dQ fragment into its warpgroup's SMEM share in fragment order: one 16-byte
        store per 4 registers, a warp's 32 stores contiguous (no bank conflicts)."""
        dst = self.fragment_view(sdQ_half, t)
        src = cute.make_tensor(acc_dq.iterator, cute.make_layout(dst.shape))
        for j in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            cute.autovec_copy(src[None, j], dst[None, j])

    @cute.jit
    def reduce_fragments(self, mdQacc: cute.Tensor, src, seq, m_block: Int32, head: Int32, batch: Int32,
                         elems: cutlass.Constexpr, offset: cutlass.Constexpr = 0):
        """One 1-D bulk reduce-add of `elems` FP32 from SMEM `src` into Q tile m_block's elements
        `offset` on (a Q tile's tile_m x d elements are contiguous in the head-major accumulator)."""
        tile = accum.elem_ptr(mdQacc, self.dq_tile_origin(seq, m_block, head, batch))
        tma.bulk_reduce_add_f32(src, tile + offset, elems * 4)

    @cute.jit
    def dq_tile_origin(self, seq, m_block: Int32, head: Int32, batch: Int32):
        """(batch, row, head, 0) of Q tile m_block's first element in the fragment-order accumulator,
        seen as (batch, rows, heads, d): row m_block * tile_m of the entry's plane, or, packed, of
        the entry's `packed_q_tile` slot in the one plane."""
        origin = (batch, m_block * self.tile_m, head, 0)
        if cutlass.const_expr(self.varlen):
            origin = (0, self.packed_q_tile(seq, m_block, batch) * self.tile_m, head, 0)
        return origin

    # ---------------------------------------------------------------- the whole tile
    @cute.jit
    def hand_off_whole_dq(self, ctx, s, acc_dq: cute.Tensor):
        """Wait for the writer to free the SMEM dQ buffer, fill this warpgroup's share in fragment
        order, tell the writer."""
        handoff = self.consumer_threads + 32
        cute.arch.barrier(barrier_id=DQ_EMPTY, number_of_threads=handoff)
        warpgroup_idx = cute.arch.make_warp_uniform(ctx.tidx // 128)
        self.store_fragment(acc_dq, s.sdQ[None, warpgroup_idx], ctx.tidx % 128)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copy
        cute.arch.barrier_arrive(barrier_id=DQ_FULL, number_of_threads=handoff)

    @cute.jit
    def write_whole_dq(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                       walk, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, one bulk reduce-add of the consumers' FP32 shares."""
        handoff = self.consumer_threads + 32
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=handoff)  # the first credit
        prev_m = walk.first()  # (`defers_dq_bump`: the Q tile whose counter is still to be passed on)
        defer = self.defers_now(seq)
        for i in cutlass.range(walk.count(), unroll=1):
            m_block = walk.m_block(i)
            cute.arch.barrier(barrier_id=DQ_FULL, number_of_threads=handoff)
            if cutlass.const_expr(self.ordered_dq):
                counter = self.wait_dq_turn(mLock, seq, m_block, n_block, head, batch, window, lane,
                                            cute.arch.sync_warp)
            if lane == 0:  # both warpgroups' shares, back to back in SMEM and in the tile
                self.reduce_fragments(mdQacc, s.sdQ[None, 0].iterator, seq, m_block, head, batch,
                                      self.mma_warpgroups * self.half_elems())
            cute.arch.cp_async_bulk_commit_group()
            if defer:
                if i > 0:  # the previous tile's sums have landed: pass its counter on
                    cute.arch.cp_async_bulk_wait_group(1, read=False)
                    self.pass_on_late(mLock, seq, prev_m, head, batch, lane)
                prev_m = m_block
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffer has been read
            elif cutlass.const_expr(self.ordered_dq):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the sums have landed
                accum.ordered_end(counter, lane, cute.arch.sync_warp)
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffer has been read
            cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=handoff)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if defer and walk.nonempty():
            self.pass_on_late(mLock, seq, prev_m, head, batch, lane)

    # ---------------------------------------------------------------- per warpgroup
    @staticmethod
    def dq_barriers(slot: Int32):
        """(EMPTY, FULL) named-barrier ids of dQ slot 2 b + w."""
        return FIRST_DQ_BARRIER + 2 * slot, FIRST_DQ_BARRIER + 2 * slot + 1

    @cute.jit
    def write_dq_by_warpgroup(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                              walk, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, one 1-D bulk reduce-add per warpgroup share (issued by lane
        0), as each share arrives."""
        wgs = self.mma_warpgroups
        handoff = 128 + 32
        for slot in cutlass.range_constexpr(wgs * self.dq_buffers):  # every buffer starts free
            cute.arch.barrier_arrive(barrier_id=self.dq_barriers(slot)[0], number_of_threads=handoff)
        prev_m = walk.first()  # (`defers_dq_bump`: the Q tile whose counter is still to be passed on)
        defer = self.defers_now(seq)
        for i in cutlass.range(walk.count(), unroll=1):
            m_block = walk.m_block(i)
            buffer = i % self.dq_buffers
            if cutlass.const_expr(self.ordered_dq):
                counter = self.wait_dq_turn(mLock, seq, m_block, n_block, head, batch, window, lane,
                                            cute.arch.sync_warp)
            for w in cutlass.range_constexpr(wgs):
                slot = wgs * buffer + w
                cute.arch.barrier(barrier_id=self.dq_barriers(slot)[1], number_of_threads=handoff)
                if lane == 0:
                    self.reduce_fragments(mdQacc, s.sdQ[None, slot].iterator, seq, m_block, head, batch,
                                          self.half_elems(), w * self.half_elems())
                cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(self.dq_buffers == 1 and not self.ordered_dq):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # read: the slot is free again
                    cute.arch.barrier_arrive(barrier_id=self.dq_barriers(slot)[0], number_of_threads=handoff)
            if defer:
                if i > 0:  # the previous tile's sums have landed: pass its counter on, free its buffer
                    cute.arch.cp_async_bulk_wait_group(wgs, read=False)
                    self.pass_on_late(mLock, seq, prev_m, head, batch, lane)
                    self.free_dq_buffer((i - 1) % self.dq_buffers, handoff)
                prev_m = m_block
            elif cutlass.const_expr(self.ordered_dq):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the sums have landed
                accum.ordered_end(counter, lane, cute.arch.sync_warp)
                self.free_dq_buffer(buffer, handoff)
            elif cutlass.const_expr(self.dq_buffers > 1):
                if i > 0:  # the previous tile's shares have been read: its buffer is free
                    cute.arch.cp_async_bulk_wait_group(wgs, read=True)
                    self.free_dq_buffer((i - 1) % self.dq_buffers, handoff)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if defer and walk.nonempty():
            self.pass_on_late(mLock, seq, prev_m, head, batch, lane)

    @cute.jit
    def free_dq_buffer(self, buffer: Int32, handoff: cutlass.Constexpr):
        for w in cutlass.range_constexpr(self.mma_warpgroups):
            slot = self.mma_warpgroups * buffer + w
            cute.arch.barrier_arrive(barrier_id=self.dq_barriers(slot)[0], number_of_threads=handoff)

    @cute.jit
    def hand_off_dq_by_warpgroup(self, ctx, s, acc_dq: cute.Tensor, buffer: Int32 = 0):
        """This warpgroup's share of dQ_i into its slot of `buffer` (the Q stage's index), met by
        the writer alone."""
        warpgroup_idx = cute.arch.make_warp_uniform(ctx.tidx // 128)
        if cutlass.const_expr(self.dq_buffers == 1):
            buffer = 0
        slot = self.mma_warpgroups * buffer + warpgroup_idx
        empty, full = self.dq_barriers(slot)
        cute.arch.barrier(barrier_id=empty, number_of_threads=128 + 32)
        self.store_fragment(acc_dq, s.sdQ[None, slot], ctx.tidx % 128)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copy
        cute.arch.barrier_arrive(barrier_id=full, number_of_threads=128 + 32)

    # ---------------------------------------------------------------- per warpgroup, through mbarriers
    @cute.jit
    def init_dq_turns(self, turns):
        """Full: the warpgroup's 128 threads arrive once their share is in; empty: the writer
        warp's 32 lanes once the bulk copy has read it."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            for w in cutlass.range_constexpr(self.mma_warpgroups):
                cute.arch.mbarrier_init(turns + 2 * w + TURN_FULL, 128)
                cute.arch.mbarrier_init(turns + 2 * w + TURN_EMPTY, 32)

    @cute.jit
    def hand_off_dq_by_mbarrier(self, ctx, s, acc_dq: cute.Tensor, step: Int32 = 0):
        """Wait for this warpgroup's turn at the one-share SMEM buffer (its `step`-th, by parity),
        or for its own buffer to be read (`shared_dq_buffer` off), fill it, tell the writer."""
        w = cute.arch.make_warp_uniform(ctx.tidx // 128)
        cute.arch.mbarrier_wait(s.dq_turns + 2 * w + TURN_EMPTY, step % 2)
        self.store_fragment(acc_dq, s.sdQ[None, 0 if cutlass.const_expr(self.shared_dq_buffer) else w],
                            ctx.tidx % 128)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copy
        cute.arch.mbarrier_arrive(s.dq_turns + 2 * w + TURN_FULL)

    @cute.jit
    def write_dq_by_mbarrier(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                             walk, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, warpgroup 0's share then warpgroup 1's, each one bulk
        reduce-add from the one buffer, handed to the other warpgroup once read (or each from its
        own buffer, handed back to its warpgroup: `shared_dq_buffer` off). Ordered: the turn is
        awaited before the first share and passed on once both have landed."""
        half = self.half_elems()
        wgs = self.mma_warpgroups
        shared = self.shared_dq_buffer
        for w in cutlass.range_constexpr(1 if shared else wgs):
            cute.arch.mbarrier_arrive(s.dq_turns + 2 * w + TURN_EMPTY)  # the first turn(s)
        for i in cutlass.range(walk.count(), unroll=1):
            m_block = walk.m_block(i)
            for w in cutlass.range_constexpr(wgs):
                cute.arch.mbarrier_wait(s.dq_turns + 2 * w + TURN_FULL, i % 2)
                if cutlass.const_expr(self.ordered_dq and w == 0):
                    counter = self.wait_dq_turn(mLock, seq, m_block, n_block, head, batch, window, lane,
                                                cute.arch.sync_warp)
                if lane == 0:
                    self.reduce_fragments(mdQacc, s.sdQ[None, 0 if shared else w].iterator, seq, m_block,
                                          head, batch, half, w * half)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffer has been read
                cute.arch.mbarrier_arrive(s.dq_turns + 2 * ((w + 1) % wgs if shared else w) + TURN_EMPTY)
            if cutlass.const_expr(self.ordered_dq):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # both shares' sums have landed
                accum.ordered_end(counter, lane, cute.arch.sync_warp)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
