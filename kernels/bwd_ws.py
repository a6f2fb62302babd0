"""B2: B1's math, warp-specialized, with FlashAttention-3's overlaps and a dQ writer warp.

Roles (block = 384 threads):
    warpgroup 0 gives its registers away (setmaxnreg.dec to 24 in all four warps):
        warp 0, the loader: K_j and V_j once, then Q_i and dO_i into the ring, one stage ahead of
            the consumers and never waiting on them except for a free stage;
        warp 1, the dQ writer: per Q tile, waits until the consumers have put this K/V tile's dQ_i
            share (FP32) in SMEM, in fragment order (below), adds it to global memory with one
            1-D bulk reduce-add, and hands the buffer back once the bulk copy has read it.
    warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240): the five GEMMs, as in B1, but
        S and dP are issued together and P = exp2(...) runs while dP is in flight; dQ, dV and dK
        are issued together and dQ is handed to the writer while dV and dK run. The thousands of
        scalar FP32 atomics of B1 per Q tile become one bulk reduction the consumers do not wait for.
Named barriers (consumer threads + the writer warp): DQ_EMPTY (the writer gives the SMEM buffer
back; it starts with one credit) and DQ_FULL (the consumers filled it). Deterministic: the writer
waits for this Q tile's counter to reach this K/V tile's turn (`dq_turn`) before its reduce-add,
waits for the reduction to complete, then bumps the counter (common/accum.py).

Unordered (neither deterministic nor `ordered_dq`), each CTA starts its walk over the Q tiles at a
different tile (`walk_start`).

dQ in fragment order: each consumer thread stores its FP32 dQ share in the order its registers hold
it (element i of thread t of a warpgroup at 512 (i / 4) + 4 t + i % 4 of the warpgroup's share: a
16-byte store per 4 registers, a warp's 32 stores contiguous), and the writer adds the shares with
one 1-D bulk reduce-add into an accumulator of whole Q tiles laid out the same way, head-major
(batch, heads, Q tiles, tile_m x d; packed batches: each entry's tiles in `packed_q_tile` slots). The
postprocess (bwd_post.py) reads the fragments back through this rung's own dQ partition. Measured
on an H200 against the earlier form, a swizzled (tile_m, d) SMEM tile and one TMA tensor
reduce-add per tile (8-byte pair stores, the box in the accumulator's row-major layout):
1.02-1.09x at d64/d192/d256 (2k / 8k, causal and not); B4 gained 1.05-1.10x at d96 and B7
0.98-1.04x at d128 on an H100 (worklog/backward.md).

Packed batches (varlen) and constraints: as B1. SMEM (bf16): d=128: Q/dO 2 x 32 KB, K/V 64 KB, P/dS 32 KB, dQ 32 KB = 192 KB;
d=256 takes one Q/dO stage (64 KB), K/V 64 KB, P/dS 16 KB, dQ 64 KB = 208 KB.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .bwd import AttentionBackward
from .common import accum, mma, pipeline, smem, tma

PRODUCER_REGS, CONSUMER_REGS = 24, 240
CONSUMER_BARRIER = 1  # the consumer warpgroups among themselves (0 is __syncthreads)
DQ_EMPTY, DQ_FULL = 2, 3  # consumers + the dQ writer warp


class WarpSpecializedBackward(AttentionBackward):
    # the host reads it: dQ accumulated in fragment order (the module docstring), converted by the
    # rung's FragmentDqPostprocess (B1: row-major, by atomics)
    FRAGMENT_DQ = True
    # GQA dK/dV by bulk reduce-adds of SMEM rows (bwd.py): H200, GQA 4, b7 d128 against the scalar
    # atomics +5/+2% non-causal 2k/8k, +8/-2% causal; b2 d64 +2/+2/+5/-2% (worklog/backward.md)
    dkv_bulk_add = True

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 64, tile_n: int = 128,
                 q_stages: int = 2, deterministic: bool = False, local: bool = False,
                 softcap: bool = False, varlen: bool = False, ordered_dq: bool = False,
                 head_dim_v: int | None = None, do_stages: int = 0, rotated_walk: bool = False):
        super().__init__(dtype, head_dim, causal, tile_m, tile_n, q_stages, deterministic, local,
                         softcap, varlen, ordered_dq, head_dim_v, do_stages)
        # ordered walks without a mask ascend unless the registry rotates them (`rotated_walk`: b2
        # at d256): with the late counter bump on wide K/V tiles, ascending walks in head groups ran
        # 8-10% faster than rotated ones at d96/d128 2k-4k, and 4% at d64 (H100, locked clocks;
        # worklog/backward.md)
        self.rotated_ordered_walk = rotated_walk
        assert not (self.split_do and self.smem_stats), "D rides with dO: statistics from registers"
        self.consumer_threads = 128 * self.mma_warpgroups
        self.num_threads = 128 + self.consumer_threads

    # ---------------------------------------------------------------- host side
    def half_elems(self) -> int:
        """FP32 elements of one warpgroup's dQ share of a Q tile."""
        return self.tile_m * self.head_dim // self.mma_warpgroups

    def dq_smem_elems(self) -> int:
        return cute.cosize(self.sdq_layout())

    def sdq_layout(self):
        """The FP32 dQ_i share in fragment order: (half_elems, warpgroups), unswizzled."""
        return cute.make_layout((self.half_elems(), self.mma_warpgroups))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, stream):
        """Arguments as B1's."""
        sQ_layout, sKV_layout, sPdS_layout = self.smem_layouts()
        loads = self.make_loads(mQ, mdO, mK, mV, sQ_layout, sKV_layout)
        storage_cls = self.shared_storage(sQ_layout, sKV_layout, sPdS_layout)
        self.kernel(*loads, mdQacc, *self.make_stat_loads(mLSE2, mD), mLSE2, mD, mdK, mdV, mLock,
                    scale_log2, softmax_scale, window_left, window_right, softcap_scale, mCuSeqlensQ,
                    mCuSeqlensK, sQ_layout, sKV_layout, sPdS_layout, self.sdq_layout(), storage_cls).launch(
            grid=self.grid(mQ, mK, mCuSeqlensK),
            block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               mdQacc: cute.Tensor, tma_lse: Optional[cute.CopyAtom],
               mLSE2_tiles: Optional[cute.Tensor], tma_d: Optional[cute.CopyAtom],
               mD_tiles: Optional[cute.Tensor], mLSE2: cute.Tensor, mD: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout, sdQ_layout,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch, seq = self.kv_tile_work(mQ, mK, mCuSeqlensQ, mCuSeqlensK)
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_do, tma_k, tma_v)
            if cutlass.const_expr(self.smem_stats):
                tma.prefetch(tma_lse, tma_d)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        q_pipe, kv_pipe = self.make_pipelines(storage, sQ_layout, sKV_layout, self.consumer_threads // 32)
        do_pipe = self.make_do_pipeline(storage, sQ_layout, sKV_layout, self.consumer_threads // 32)
        pipeline.init_done()
        s = self.smem_tensors(storage, sQ_layout, sKV_layout, sPdS_layout)
        s.sdQ = smem.get_tensor(storage.sdQ, sdQ_layout)
        window = (window_left, window_right) if cutlass.const_expr(self.local) else None
        m_first, m_end = self.q_tile_range(n_block, seq.seqlen_q, seq.seqlen_k, window)
        start = self.walk_start(n_block, m_first, m_end, seq)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                q_copies, kv_copies = self.tma_copies(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV,
                                                      s, head, batch, seq, (tma_lse, mLSE2_tiles, tma_d, mD_tiles))
                self.load(q_pipe, kv_pipe, q_copies, kv_copies, n_block, start, m_first, m_end, do_pipe)
            if warp_idx == 1:
                self.write_dq(mdQacc, s, mLock, n_block, head, batch, start, m_first, m_end,
                              seq, window, tidx % 32)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctidx = tidx - 128
            ctx = self.consumer_setup(s, ctidx, seq, window, softcap_scale, mLSE2, mD, head, batch)
            pipeline.consume_wait(kv_pipe, pipeline.consumer_state(1))
            q_consumer = pipeline.consumer_state(self.q_stages)
            for i in cutlass.range(m_end - m_first, unroll=1):
                q_consumer = self.consume_step(ctx, s, q_pipe, q_consumer,
                                               self.m_block_at(i, start, m_first, m_end), n_block,
                                               scale_log2, do_pipe)
            self.store_dkv(ctx, s, mdK, mdV, n_block, head, batch, softmax_scale, mLSE2.shape[1])

    @cute.jit
    def sync_consumers(self):
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumer_threads)

    @cute.jit
    def walk_start(self, n_block: Int32, m_first: Int32, m_end: Int32, seq) -> Int32:
        """The first Q tile this CTA visits. Unordered without a mask: each K/V tile starts its
        walk at a different Q tile (rotated by n_block), so the CTAs of one head do not all reduce
        into the same dQ tile at once; under a mask each walk already starts at its own first Q
        tile (the diagonal's), and rotating it made two CTAs of a head walk the same tiles in step
        (b7/b8 causal, H100: 0.3-4.4% slower, worklog/backward.md). Ordered without a mask: in
        order (the counters hand each tile from n to n + 1), or, where rotated (`rotated_walk`: b2
        at d256) and the entry has no more K/V tiles than Q tiles, each walk `rotation_step` Q tiles
        after the last (`rotates_ordered`; `dq_turn` ranks the adds in the order the walks bring
        them)."""
        start = m_first
        if cutlass.const_expr(not self.ordered_dq and not (self.causal or self.local)):
            start = m_first + n_block % cutlass.max(m_end - m_first, 1)
        elif cutlass.const_expr(self.rotates_unmasked):
            if self.rotates_ordered(seq.seqlen_q, seq.seqlen_k):
                step = self.rotation_step(seq.seqlen_q, seq.seqlen_k)
                start = m_first + (n_block * step) % cutlass.max(m_end - m_first, 1)
        return start

    @cute.jit
    def m_block_at(self, i: Int32, start: Int32, m_first: Int32, m_end: Int32) -> Int32:
        """The i-th Q tile of the walk from `start`, wrapping past the last to m_first (a compare
        per tile: the walk's division is done once, in walk_start)."""
        m_block = start + i
        if cutlass.const_expr(not self.ordered_dq or self.rotates_unmasked):
            if m_block >= m_end:
                m_block -= m_end - m_first
        return m_block

    @cute.jit
    def load(self, q_pipe, kv_pipe, q_copies, kv_copies, n_block: Int32, start: Int32, m_first: Int32,
             m_end: Int32, do_pipe=None):
        """Loader warp: K/V once, then Q_i and dO_i for every Q tile, as stages free up (with
        `split_do`, dO_i into its own ring once the consumers have released dO_{i-1})."""
        pipeline.produce(kv_pipe, pipeline.producer_state(1), n_block, kv_copies)
        do_copies = []
        if cutlass.const_expr(self.split_do):  # (tma_copies' second entry is dO's)
            q_copies, do_copies = [q_copies[0]] + q_copies[2:], [q_copies[1]]
        q_state = pipeline.producer_state(self.q_stages)
        for i in cutlass.range(m_end - m_first, unroll=1):
            m_block = self.m_block_at(i, start, m_first, m_end)
            q_state = pipeline.produce(q_pipe, q_state, m_block, q_copies)
            if cutlass.const_expr(self.split_do):
                pipeline.produce(do_pipe, pipeline.state_at(self.do_stages, i, producer=True), m_block, do_copies)
        pipeline.tail(q_pipe, q_state)
        if cutlass.const_expr(self.split_do):
            pipeline.tail(do_pipe, pipeline.state_at(self.do_stages, m_end - m_first, producer=True))

    @cute.jit
    def write_dq(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                 start: Int32, m_first: Int32, m_end: Int32, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, one bulk reduce-add of the consumers' FP32 shares."""
        handoff = self.consumer_threads + 32
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=handoff)  # the first credit
        prev_m = m_first  # (`defers_dq_bump`: the Q tile whose counter is still to be passed on)
        defer = self.defers_now(seq)
        for i in cutlass.range(m_end - m_first, unroll=1):
            m_block = self.m_block_at(i, start, m_first, m_end)
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
        if defer and m_end > m_first:
            self.pass_on_late(mLock, seq, prev_m, head, batch, lane)

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

    @cute.jit
    def consume_step(self, ctx, s, q_pipe, q_state, m_block: Int32, n_block: Int32, scale_log2: Float32,
                     do_pipe=None):
        """One Q tile: S and dP in flight together, P under dP; dQ handed off under dV and dK.
        `split_do`: dO_i waited for between S and dP, released once dV is done."""
        consumers = self.consumer_threads
        lse2, dsum = self.step_stats(ctx, q_pipe, q_state, m_block)
        stage, do_state = q_state.index, None
        if cutlass.const_expr(self.split_do):
            do_state = pipeline.state_at(self.do_stages, q_state.count)
        acc_s, acc_dp = self.scores_and_dp(ctx, stage, 1, do_pipe, do_state)  # S has landed, dP may still run
        self.probabilities(ctx, acc_s, lse2, m_block, n_block, ctx.seq.seqlen_q, ctx.seq.seqlen_k, scale_log2)
        if cutlass.const_expr(self.pairs_make_ds()):
            p = mma.to_dtype_pairs(acc_s, self.dtype)  # S's FP32 registers die here, before dP lands
            warpgroup.wait_group(0)
            ds = self.paired_score_grads(ctx, p, acc_dp, dsum)
        else:
            p = mma.to_dtype(acc_s, self.dtype)
            warpgroup.wait_group(0)
            self.score_grads(acc_s, acc_dp, dsum, lse2, scale_log2)
            ds = mma.to_dtype(acc_dp, self.dtype)
        # every GEMM of the previous Q tile (both warpgroups) is done with sP and sdS
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=consumers)
        mma.store_to_smem(p, ctx.sdp, ctx.tidx, s.sP[None, None, 0], self.score_matrices())
        mma.store_to_smem(ds, ctx.sdp, ctx.tidx, s.sdS[None, None, 0], self.score_matrices())
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=consumers)
        acc_dq = self.issue_dq(ctx, -1)
        self.issue_dkv(ctx, s, stage, do_state.index if cutlass.const_expr(self.split_do) else stage)
        if cutlass.const_expr(self.split_do):
            warpgroup.wait_group(1)  # dQ and dV are done (dK still runs): dO_i is free
            pipeline.release(do_pipe, do_state)
        else:
            warpgroup.wait_group(2)  # dQ is done; dV and dK still run
        self.hand_off_dq(ctx, s, acc_dq, step=q_state.count)
        warpgroup.wait_group(0)
        return pipeline.release(q_pipe, q_state)

    @cute.jit
    def step_stats(self, ctx, q_pipe, q_state, m_block: Int32):
        """This thread's (LSE * log2 e, D) of Q tile m_block, loaded from global memory before
        waiting for the tile's stage (their latency hides under the wait and the first GEMM); with
        `smem_stats`, the stage's SMEM statistics (`col_stat` reads each where it is used)."""
        if cutlass.const_expr(self.smem_stats):
            pipeline.consume_wait(q_pipe, q_state)
            return ctx.sLSE[None, 0, q_state.index], ctx.sD[None, 0, q_state.index]
        lse2, dsum = self.stats(ctx, m_block)
        pipeline.consume_wait(q_pipe, q_state)
        return lse2, dsum

    @cute.jit
    def hand_off_dq(self, ctx, s, acc_dq: cute.Tensor, buffer: Int32 = 0, step: Int32 = 0):
        """Wait for the writer to free the SMEM dQ buffer, fill this warpgroup's share in fragment
        order, tell the writer. (`buffer`: B2, B3 and B6 have one; `step`: the Q tile's count, for
        B9's turns.)"""
        handoff = self.consumer_threads + 32
        cute.arch.barrier(barrier_id=DQ_EMPTY, number_of_threads=handoff)
        warpgroup_idx = cute.arch.make_warp_uniform(ctx.tidx // 128)
        self.store_fragment(acc_dq, s.sdQ[None, warpgroup_idx], ctx.tidx % 128)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copy
        cute.arch.barrier_arrive(barrier_id=DQ_FULL, number_of_threads=handoff)

    def dq_coords(self, tidx):
        """(row, column) in the (tile_m, d) dQ tile of each element of consumer thread tidx's dQ
        fragment, in the fragment's order (`dq_view`: B7's accumulator is dQ^T)."""
        return self.tiled_mmas()[2].get_slice(tidx).partition_C(
            self.dq_view(cute.make_identity_tensor((self.tile_m, self.head_dim))))

    def dq_view(self, tile: cute.Tensor) -> cute.Tensor:
        """A (tile_m, d) tensor seen in the shape of the dQ accumulator."""
        return tile

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
