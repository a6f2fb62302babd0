"""B4: B3 with the dQ share handed to the writer per warpgroup, through two buffers.

In B3 the two consumer warpgroups fill one FP32 dQ buffer together and meet the writer warp at two
named barriers of 256 + 32 threads: each warpgroup waits for the slower one, and both wait until
the copy engine has read the previous tile's buffer (the bulk reduce-add must be accepted by L2
before the buffer is free). The dQ MMA already splits d between the warpgroups (each owns d / 2
columns), so each half can travel on its own:

    consumer warpgroup w, Q tile i (buffer b = i % 2):
        wait EMPTY[w, b]; store its share in fragment order (B2's); fence; arrive FULL[w, b]
    writer warp, Q tile i:
        for w: wait FULL[w, b]; one 1-D bulk reduce-add of half w; commit
        then hand back tile i - 1's buffers (EMPTY[w, b ^ 1]) once the copy engine has read them

A warpgroup meets only the writer (128 + 32 threads), never the other warpgroup, at the hand-off;
and the writer returns a buffer one tile late, so a slow reduce-add delays nobody unless it takes
a whole Q tile. Deterministic: the writer keeps B2's order (the counter of the Q tile, both halves
landed before it is bumped) and returns the buffers at once.

Fragment order came to the ladder here: measured on an H100 against each half as a swizzled
(tile_m, d / 2) FP32 tile added by a TMA tensor reduce-add (8-byte pair stores; B7's transposed dQ
took scattered 4-byte stores): B4 1.05-1.10x at d96, B7 0.98-1.04x at d128 (2k / 8k, causal and not).

SMEM (bf16, d = 128): B3's 192 KB with 32 KB of dQ, plus the second dQ buffer: 224 KB. The four
halves are stages of one flat FP32 layout, stage = 2 b + w. `dq_buffers = 1` (B8's 128-row tiles
at d64, where two do not fit): one buffer a warpgroup, which the writer hands back as soon as its
reduce-add has read it.
Constraints: B3's (head_dim 96 or 128, two Q stages: the buffer follows the Q stage index, as the
dS buffers do).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .bwd_swap import SwappedBackward
from .common import accum

FIRST_DQ_BARRIER = 2  # EMPTY[w, b] = 2 + 2 (2 b + w), FULL = the next id (1 is the consumers')


class SplitDqBackward(SwappedBackward):
    # LSE and D through SMEM with the Q/dO TMA (fixed lengths): +2-6% at d96, H100
    stats_in_smem = True
    # dV issued after dS^T, and each column's LSE read where used (not ahead of the wait on S^T):
    # H100, locked clocks, d96 2k / 8k, causal and not: 5.4-7.3% fewer cycles than under dP^T with
    # the LSE read ahead (worklog/coverage.md; the read ahead had measured 1.01-1.07x on an H200
    # with dV under dP^T). B7 and B8 set both themselves.
    dv_under_dp = False
    prefetch_stats = False
    # buffers a warpgroup's share rotates through (returned a tile late); with one, the writer
    # returns it once its reduce-add has read it
    dq_buffers = 2
    # causal CTAs launched head after head, not in head groups (bwd_order.py): under locked clocks
    # (H100) the groups cost b4 6-9% at d96 (causal 2k / 8k) and b8 3-5% at d64; b7 (d128) and b9
    # keep them (2-5% faster with them)
    head_groups = False

    @property
    def defers_dq_bump(self) -> bool:
        """The late counter bump (bwd_order.py) holds a tile's buffer until the next tile's adds
        are issued, so it needs a second buffer to hand that tile off into."""
        return super().defers_dq_bump and self.dq_buffers >= 2

    # ---------------------------------------------------------------- host side
    def sdq_layout(self):
        """(half_elems, halves x buffers) FP32, unswizzled: stage 2 b + w is warpgroup w's half of
        buffer b, in fragment order."""
        return cute.make_layout((self.half_elems(), self.mma_warpgroups * self.dq_buffers))

    # ---------------------------------------------------------------- device side
    @staticmethod
    def dq_barriers(slot: Int32):
        """(EMPTY, FULL) named-barrier ids of dQ slot 2 b + w."""
        return FIRST_DQ_BARRIER + 2 * slot, FIRST_DQ_BARRIER + 2 * slot + 1

    @cute.jit
    def write_dq(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                 start: Int32, m_first: Int32, m_end: Int32, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, one 1-D bulk reduce-add per warpgroup half (issued by lane
        0), as each half arrives."""
        wgs = self.mma_warpgroups
        handoff = 128 + 32
        for slot in cutlass.range_constexpr(wgs * self.dq_buffers):  # every buffer starts free
            cute.arch.barrier_arrive(barrier_id=self.dq_barriers(slot)[0], number_of_threads=handoff)
        prev_m = m_first  # (`defers_dq_bump`: the Q tile whose counter is still to be passed on)
        defer = self.defers_now(seq)
        for i in cutlass.range(m_end - m_first, unroll=1):
            m_block = self.m_block_at(i, start, m_first, m_end)
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
                if i > 0:  # the previous tile's halves have been read: its buffer is free
                    cute.arch.cp_async_bulk_wait_group(wgs, read=True)
                    self.free_dq_buffer((i - 1) % self.dq_buffers, handoff)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if defer and m_end > m_first:
            self.pass_on_late(mLock, seq, prev_m, head, batch, lane)

    @cute.jit
    def free_dq_buffer(self, buffer: Int32, handoff: cutlass.Constexpr):
        for w in cutlass.range_constexpr(self.mma_warpgroups):
            slot = self.mma_warpgroups * buffer + w
            cute.arch.barrier_arrive(barrier_id=self.dq_barriers(slot)[0], number_of_threads=handoff)

    @cute.jit
    def hand_off_dq(self, ctx, s, acc_dq: cute.Tensor, buffer: Int32 = 0):
        """This warpgroup's half of dQ_i into its slot of `buffer` (the Q stage's index), met by
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
