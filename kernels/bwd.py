"""B1: FlashAttention-3's backward, all five GEMMs on WGMMA. One CTA per (K/V tile, query head, batch).

With P = softmax(Q K^T * scale) recomputed from the forward's LSE, and dO given:

    S  = Q K^T                    (tile_m, tile_n)   A = Q  (K-major), B = K  (K-major)
    dP = dO V^T                   (tile_m, tile_n)   A = dO (K-major), B = V  (K-major)
    P  = exp2(S * scale_log2 - LSE * log2 e)         (the preprocess stores LSE * log2 e)
    dS = P * (dP - D)             D = rowsum(dO * O), from the preprocess
    dV += P^T dO                  (tile_n, d)        A = P^T  (MN-major, from SMEM), B = dO^T (MN-major)
    dK += dS^T Q                  (tile_n, d)        A = dS^T (MN-major, from SMEM), B = Q^T  (MN-major)
    dQ_i += dS K                  (tile_m, d)        A = dS   (K-major,  from SMEM), B = K^T  (MN-major)

The CTA loads its K_j and V_j once (TMA), then walks the Q tiles that see them (all of them, or
from the causal diagonal down) through a `q_stages`-deep ring that brings Q_i and dO_i on one
barrier (B2 on may give dO fewer stages, `do_stages`, in a ring of its own). dK and dV stay in
registers for the whole walk and are written once, scaled by softmax_scale (the chain rule
through S * scale). dQ_i gets a contribution from every K/V tile, so
it is accumulated in FP32 global memory with atomic adds (common/accum.py; in a fixed order when
`deterministic`); the postprocess scales and rounds it.

Every transposed operand is a view of the same swizzled SMEM tile (no data moves): P and dS are
written once, row-major (tile_m, tile_n), and read both as dS (K-major A of dQ) and as P^T, dS^T
(MN-major A of dV, dK); Q, dO and K likewise serve as K-major A/B and as MN-major B.

Two consumer warpgroups, no producer: warp 0 also issues the TMA copies (refilling the stage all
warps just released), and every GEMM is waited for before its result is used. B2 specializes.
Rows past seqlen_q have LSE = +inf in the preprocessed buffer (P = 0) and zero dO (dS = 0); scores
past seqlen_k and above the causal diagonal are masked to -inf before the exponent. Rows with no
visible key likewise get LSE = +inf: P = 0, dQ = 0, and they add nothing to dK and dV.

Variable-length batches (`varlen`): Q, K, V, dO and the gradients are packed (total, heads, d) with
flash-attn's cu_seqlens; the grid's CTAs take every entry's (head, K/V tile) pairs entry after
entry (`kv_tile_work`, common/scheduler.py) and each reads its entry's lengths and row offsets
(common/seqlen.py). A Q tile that runs past its entry's last row reads the next entry's rows of
Q and dO, but its statistics from the entry's own whole-tile slot (the preprocess pads it with
LSE = +inf): P = 0 and dS = 0 there, so those rows add exact zeros to dQ and nothing to dK and dV
(B1's packed dQ accumulator needs only tile_m rows of slack at the end).

What is not this rung's own lesson comes in as mixins, shared with the warp-specialized kernel
(bwd_ws.py, which does not build on this one): the CTA's work, SMEM, loads and pipelines
(bwd_setup.py), the five GEMMs' tiled MMAs, operand views and issue (bwd_mma.py), the pointwise
steps from S and dP to P and dS (bwd_pointwise.py), the per-query statistics
(common/statistics.py), the order of the dQ adds (bwd_order.py: unordered, or ordered by counters,
reversed or rotated) and the dK/dV epilogue (bwd_dkv_store.py).

Constraints: head_dim 64/96/128/192/256; tile_m and tile_n multiples of 64 (WGMMA's 64-row atom; P and dS
rows fill a 128-byte swizzle atom). Where a GEMM's M is 64 the two warpgroups split its N.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .bwd_dkv_store import DkvEpilogue
from .bwd_mma import BackwardMmas
from .bwd_order import DqOrder
from .bwd_pointwise import PointwiseGradients
from .bwd_setup import BackwardSetup
from .common import accum, mma, pipeline, seqlen, tma
from .common.statistics import QueryStatistics


class AttentionBackward(BackwardSetup, QueryStatistics, DqOrder, DkvEpilogue, BackwardMmas,
                        PointwiseGradients):
    """B1: the constructor and the CTA's setup are BackwardSetup's; the walk, each GEMM waited for,
    and dQ by atomics are this class's."""

    def dq_smem_elems(self) -> int:
        """FP32 elements of an SMEM dQ tile: B1 adds dQ from registers (8 keeps the field valid)."""
        return 8

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, stream):
        """mLSE2, mD: (batch, heads_q, seqlen_q rounded up to tile_m) FP32 from the preprocess;
        mdQacc: (batch, same rows, heads_q, d) FP32, zeroed (B2 on: a view of a head-major
        accumulator in whole Q tiles, each tile's share in fragment order); mdK, mdV: (batch, seqlen_k, heads_q,
        d), one slice per query head, or under GQA FP32: zeroed (batch, seqlen_k, heads_kv, d) that
        the kernel adds into, or, deterministic, per-query-head slices summed afterwards; mLock: (batch, heads_q,
        Q tiles) int32 zeros, read only when dQ is ordered (`ordered_dq`). The window edges and softcap_scale
        are read only by the local and softcap variants (as the forward's), cu_seqlens_q/k only by
        the varlen one. Varlen: batch = 1 holding every entry; mLock total_q // tile_m + entries + 1
        counters per head, mLSE2 and mD as many whole-tile slots (`packed_q_tile`, bwd_pre.py),
        mdQacc total_q + tile_m rows (B1), or (B2 on) as many slots too."""
        sQ_layout, sKV_layout, sPdS_layout = self.smem_layouts()
        loads = self.make_loads(mQ, mdO, mK, mV, sQ_layout, sKV_layout)
        storage_cls = self.shared_storage(sQ_layout, sKV_layout, sPdS_layout)
        self.kernel(*loads, mLSE2, mD, mdQacc, mdK, mdV, mLock, scale_log2, softmax_scale,
                    window_left, window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK,
                    sQ_layout, sKV_layout, sPdS_layout, storage_cls).launch(
            grid=self.grid(mQ, mK, mCuSeqlensK), block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
               window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sPdS_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        assert not self.split_do, "B1 brings dO with Q (do_stages: B2 on)"
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch, seq = self.kv_tile_work(mQ, mK, mCuSeqlensQ, mCuSeqlensK)
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_do, tma_k, tma_v)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        consumer_warps = self.num_threads // 32
        q_pipe, kv_pipe = self.make_pipelines(storage, sQ_layout, sKV_layout, consumer_warps)
        pipeline.init_done()
        s = self.smem_tensors(storage, sQ_layout, sKV_layout, sPdS_layout)
        q_copies, kv_copies = self.tma_copies(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, s, head,
                                              batch, seq)
        window = (window_left, window_right) if cutlass.const_expr(self.local) else None
        m_first, m_end = self.q_tile_range(n_block, seq.seqlen_q, seq.seqlen_k, window)

        q_producer = pipeline.producer_state(self.q_stages)
        if warp_idx == 0:  # K_j, V_j once; then fill the Q/dO ring
            pipeline.produce(kv_pipe, pipeline.producer_state(1), n_block, kv_copies)
            for _ in cutlass.range(cutlass.min(self.q_stages, m_end - m_first), unroll=1):
                q_producer = pipeline.produce(q_pipe, q_producer, m_first + q_producer.count, q_copies)

        ctx = self.consumer_setup(s, tidx, seq, window, softcap_scale, mLSE2, mD, head, batch)
        pipeline.consume_wait(kv_pipe, pipeline.consumer_state(1))
        q_consumer = pipeline.consumer_state(self.q_stages)
        for m_block in cutlass.range(m_first, m_end, unroll=1):
            pipeline.consume_wait(q_pipe, q_consumer)
            self.compute_step(ctx, s, q_consumer.index, m_block, n_block, head, batch, mLSE2, mD,
                              mdQacc, mLock, scale_log2)
            q_consumer = pipeline.release(q_pipe, q_consumer)
            if warp_idx == 0 and m_first + q_producer.count < m_end:  # refill the stage just freed
                q_producer = pipeline.produce(q_pipe, q_producer, m_first + q_producer.count, q_copies)
        if warp_idx == 0:
            pipeline.tail(q_pipe, q_producer)
        self.store_dkv(ctx, s, mdK, mdV, n_block, head, batch, softmax_scale, mLSE2.shape[1])


    @cute.jit
    def add_dq(self, ctx, acc_dq, mdQacc: cute.Tensor, mLock: cute.Tensor, m_block: Int32,
               n_block: Int32, head: Int32, batch: Int32, barrier_fn):
        """dQacc[m_block] += acc_dq (FP32 atomics). Deterministic: K/V tiles add in the order of
        n_block (descending when `kv_reversed`); the counter of tile m reads a K/V tile's
        `dq_turn` when that tile's turn comes."""
        gdQ = cute.local_tile(seqlen.rows(tma.seq_major(mdQacc), head, batch, ctx.seq.offset_q, self.varlen),
                              (self.tile_m, self.head_dim), (m_block, 0))
        if cutlass.const_expr(self.ordered_dq):
            counter = self.wait_dq_turn(mLock, ctx.seq, m_block, n_block, head, batch, ctx.window,
                                        ctx.tidx, barrier_fn)
        accum.add_fragment(acc_dq, ctx.thr_dq.partition_C(gdQ))
        if cutlass.const_expr(self.ordered_dq):
            accum.ordered_end(counter, ctx.tidx, barrier_fn)


    @cute.jit
    def compute_step(self, ctx, s, stage, m_block: Int32, n_block: Int32, head: Int32, batch: Int32,
                     mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mLock: cute.Tensor,
                     scale_log2: Float32):
        """One Q tile against this CTA's K/V tile: the five GEMMs, each waited for."""
        lse2, dsum = self.stats(ctx, m_block)
        acc_s, acc_dp = self.scores_and_dp(ctx, stage, 0)
        self.probabilities(ctx, acc_s, lse2, m_block, n_block, ctx.seq.seqlen_q, ctx.seq.seqlen_k, scale_log2)
        self.score_grads(acc_s, acc_dp, dsum, lse2, scale_log2)
        p, ds = mma.to_dtype(acc_s, self.dtype), mma.to_dtype(acc_dp, self.dtype)
        cute.arch.sync_threads()  # every GEMM of the previous tile is done reading sP and sdS
        mma.store_to_smem(p, ctx.sdp, ctx.tidx, s.sP[None, None, 0])
        mma.store_to_smem(ds, ctx.sdp, ctx.tidx, s.sdS[None, None, 0])
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by WGMMA (async proxy)
        cute.arch.sync_threads()
        self.issue_dkv(ctx, s, stage)
        acc_dq = self.issue_dq(ctx, 0)
        self.add_dq(ctx, acc_dq, mdQacc, mLock, m_block, n_block, head, batch, cute.arch.sync_threads)

    @cute.jit
    def sync_consumers(self):
        """Every thread that holds dK/dV meets (B1: the whole CTA; B2 on: the consumers)."""
        cute.arch.sync_threads()
