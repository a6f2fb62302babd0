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

Four concepts live in modules of their own and come in as mixins: the five GEMMs' tiled MMAs,
operand views and issue (bwd_mma.py), the pointwise steps from S and dP to P and dS
(bwd_pointwise.py), the order of the dQ adds (bwd_order.py: unordered, or ordered by counters,
reversed or rotated) and the dK/dV epilogue (bwd_dkv_store.py).

Constraints: head_dim 64/96/128/192/256; tile_m and tile_n multiples of 64 (WGMMA's 64-row atom; P and dS
rows fill a 128-byte swizzle atom). Where a GEMM's M is 64 the two warpgroups split its N.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .bwd_dkv_store import DkvEpilogue
from .bwd_mma import BackwardMmas
from .bwd_order import DqOrder
from .bwd_pointwise import PointwiseGradients
from .common import accum, mask, mma, pipeline, scheduler, seqlen, smem, tma
from .common.statistics import QueryStatistics


class AttentionBackward(QueryStatistics, DqOrder, DkvEpilogue, BackwardMmas, PointwiseGradients):
    mma_warpgroups = 2
    p_in_smem = True  # P goes through SMEM for dV (B3 keeps it in registers)
    dq_turn_barriers = 0  # mbarriers of B9's dQ turns (in the barriers' first 1 KB: no tile moves)
    q_tile_multiple = 64  # Q tiles are M of S and dQ: whole 64-row WGMMA atoms (B6: N of both)
    kv_tile_multiple = 64  # K/V tiles are M of dK/dV; P and dS rows fill a 128-byte swizzle atom

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 64, tile_n: int = 128,
                 q_stages: int = 2, deterministic: bool = False, local: bool = False,
                 softcap: bool = False, varlen: bool = False, ordered_dq: bool = False,
                 head_dim_v: int | None = None, do_stages: int = 0):
        assert tile_m % self.q_tile_multiple == 0 and tile_n % self.kv_tile_multiple == 0, \
            f"Q tiles of a multiple of {self.q_tile_multiple} rows, K/V tiles of {self.kv_tile_multiple} (WGMMA atoms, swizzle atoms)"
        self.dtype, self.head_dim, self.causal = dtype, head_dim, causal
        # V's head dim (dO, O and dV take it; Q, K, dQ and dK keep head_dim): `value_head_dims`
        self.head_dim_v = head_dim_v or head_dim
        # static variants, as the forward's: the window's predicates (mask.py) and capped scores
        self.local, self.softcap, self.varlen = local, softcap, varlen
        self.tile_m, self.tile_n, self.q_stages = tile_m, tile_n, q_stages
        # dO's stages (0: Q's, on Q's barriers); fewer (B2/B9's `split_do`: one) free SMEM, and dO
        # then has a ring of its own
        self.do_stages = do_stages or q_stages
        assert self.do_stages in (1, q_stages), "dO takes Q's stages or one"
        self.deterministic = deterministic
        # dQ added in a fixed K/V order (counters): deterministic, or chosen for speed (`ordered_dq`
        # in the registry: at d=256 the ordered walk ran 1.27x faster, see worklog/backward.md)
        self.ordered_dq = deterministic or ordered_dq
        self.num_threads = 128 * self.mma_warpgroups

    # ---------------------------------------------------------------- host side
    @property
    def split_do(self) -> bool:
        """Whether dO has fewer stages than Q, in a ring of its own (`do_stages`)."""
        return self.do_stages != self.q_stages

    def smem_layouts(self, head_dim: int | None = None, stages: int | None = None):
        """Q and dO share one staged layout; K and V one stage each; P and dS one tile each. Q and
        dO are the MN-major B of dK and dV, K that of dQ: where those MMAs split head_dim among
        the warpgroups, the swizzle fits a warpgroup's share (smem.py). `head_dim`: the tiles'
        columns (default head_dim; `value_layouts` asks for head_dim_v); `stages`: the Q-shaped
        tile's (default q_stages; `value_layouts` asks for do_stages)."""
        wgs, d = self.mma_warpgroups, head_dim or self.head_dim
        return (smem.tile_layout(self.dtype, self.tile_m, d, stages or self.q_stages,
                                 share=mma.n_share(self.tile_n, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_n, d, 1, share=mma.n_share(self.tile_m, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_m, self.tile_n, 1))

    def value_layouts(self, sQ_layout, sKV_layout):
        """(dO's staged layout, V's): Q's and K's, or with head_dim_v columns where V's head dim
        differs, and do_stages stages where dO has fewer than Q (dO and V then have tiles of their
        own)."""
        if self.head_dim_v == self.head_dim and not self.split_do:
            return sQ_layout, sKV_layout
        sdO_layout, sV_layout = self.smem_layouts(self.head_dim_v, self.do_stages)[:2]
        return sdO_layout, sV_layout if self.head_dim_v != self.head_dim else sKV_layout

    def make_loads(self, mQ, mdO, mK, mV, sQ_layout, sKV_layout):
        """(atom, TMA tensor) for Q, dO (Q tiles) and K, V (K/V tiles), flattened."""
        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        dv = self.head_dim_v
        return (*tma.make_load(tma.seq_major(mQ), sQ_layout, tile_q),
                *tma.make_load(tma.seq_major(mdO), sdO_layout, (self.tile_m, dv)),
                *tma.make_load(tma.seq_major(mK), sKV_layout, tile_kv),
                *tma.make_load(tma.seq_major(mV), sV_layout, (self.tile_n, dv)))

    def shared_storage(self, sQ_layout, sKV_layout, sPdS_layout):
        p_elems = cute.cosize(sPdS_layout) if self.p_in_smem else 8  # 8 keeps the field valid
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[Int64, 2 * self.q_stages]
            kv_barriers: cute.struct.MemRange[Int64, 2]
            dq_turns: cute.struct.MemRange[Int64, max(1, self.dq_turn_barriers)]  # (1 keeps the field valid)
            do_barriers: cute.struct.MemRange[Int64, 2 * self.do_stages if self.split_do else 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.dq_smem_elems()], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.stat_smem_elems()], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.stat_smem_elems()], 128]

        if self.dkv_bulk_add:  # add_dkv_rows' FP32 rows fit in the free Q, dO, K and V tiles
            free = sum(cute.cosize(x) for x in (sQ_layout, sdO_layout, sKV_layout, sV_layout)) * self.dtype.width // 8
            widest = max(self.head_dim, self.head_dim_v)
            assert self.tile_n * (widest + 4) * 4 <= free, "dK/dV rows exceed the free SMEM"
        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"{type(self).__name__} with q_stages={self.q_stages}, tile_m={self.tile_m}, "
                          f"tile_n={self.tile_n}, d={self.head_dim}")
        return SharedStorage

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

    def grid(self, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensK: cute.Tensor):
        """One CTA per (K/V tile, query head, batch entry). Varlen: the entries' K/V tiles in a
        row, at most ceil(total_k / tile_n) + entries of them (CTAs past the last one exit)."""
        batch, seqlen_k, heads_q = mQ.shape[0], mK.shape[1], mQ.shape[2]
        kv_tiles = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.varlen):
            return [kv_tiles + mCuSeqlensK.shape[0] - 1, heads_q, 1]
        return [kv_tiles, heads_q, batch]

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

    # ---------------------------------------------------------------- setup pieces
    @cute.jit
    def kv_tile_work(self, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                     mCuSeqlensK: cute.Tensor):
        """(n_block, head, batch, seq) of this CTA; seq (common/seqlen.py) holds the entry's lengths
        and row offsets. Varlen: the grid's CTAs, numbered x fastest, take the entries' (head, K/V
        tile) pairs entry after entry, as fixed lengths order them (bwd_order.py); the entry of
        the CTA's packed K/V tile index (its number over the heads) found by a warp-wide search of
        cu_seqlens_k. A CTA past the last one gets empty lengths (no work)."""
        block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            heads = mQ.shape[2]
            linear = block + cute.arch.grid_dim()[0] * head
            # offsets clamped into the packed rows: unchecked ones (a replayed graph) stay inside
            batch, in_entry, blocks = scheduler.varlen_tile(linear // heads, mCuSeqlensK, self.tile_n, mK.shape[0])
            seq = seqlen.from_cu_seqlens(mCuSeqlensQ, mCuSeqlensK, batch, mQ.shape[0], mK.shape[0])
            local = linear - (linear // heads - in_entry) * heads  # among the entry's blocks x heads
            n_block, head = scheduler.head_group_tile(local, cutlass.max(blocks, 1), heads,
                                                      self.head_group(seq.seqlen_q, seq.seqlen_k, heads))
            head = cutlass.min(head, heads - 1)  # a CTA past the last tile: any head, no work
            seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
            if blocks == 0:
                seqlen_q, seqlen_k = Int32(0), Int32(0)
            seq.seqlen_q, seq.seqlen_k = seqlen_q, seqlen_k
            return self.kv_order(n_block, blocks), head, batch, seq
        kv_tiles = (mK.shape[0] + self.tile_n - 1) // self.tile_n  # (seqlen, d, heads, batch)
        block, head, batch = self.launch_tile(block, head, batch, kv_tiles, mQ.shape[0], mK.shape[0],
                                              mQ.shape[2], mQ.shape[3])
        return self.kv_order(block, kv_tiles), head, batch, seqlen.fixed(mQ.shape[0], mK.shape[0])

    def make_pipelines(self, storage, sQ_layout, sKV_layout, consumer_warps):
        """(Q/dO ring, K/V single stage): each stage's Q and dO (K and V) land on one barrier (with
        the stage's statistics, `stats_in_smem`); with `split_do`, the Q ring holds Q alone
        (`make_do_pipeline`)."""
        stat_bytes = 2 * self.tile_m * 4 if self.smem_stats else 0
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        q_bytes = smem.stage_bytes(self.dtype, sQ_layout)
        if not self.split_do:
            q_bytes += smem.stage_bytes(self.dtype, sdO_layout)
        kv_bytes = smem.stage_bytes(self.dtype, sKV_layout) + smem.stage_bytes(self.dtype, sV_layout)
        q_pipe = pipeline.create(storage.q_barriers.data_ptr(), self.q_stages, consumer_warps,
                                 q_bytes + stat_bytes)
        kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), 1, consumer_warps, kv_bytes)
        return q_pipe, kv_pipe

    def make_do_pipeline(self, storage, sQ_layout, sKV_layout, consumer_warps):
        """`split_do`: dO's own ring of do_stages, its stage for Q tile i at count i (`do_state`);
        None otherwise (dO rides on the Q ring)."""
        if not self.split_do:
            return None
        sdO_layout, _ = self.value_layouts(sQ_layout, sKV_layout)
        return pipeline.create(storage.do_barriers.data_ptr(), self.do_stages, consumer_warps,
                               smem.stage_bytes(self.dtype, sdO_layout))

    def smem_tensors(self, storage, sQ_layout, sKV_layout, sPdS_layout):
        def get(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        stats = dict(sLSE=storage.sLSE.get_tensor(self.stat_layout()),
                     sD=storage.sD.get_tensor(self.stat_layout())) if self.smem_stats else {}
        # after the walk Q, dO, K and V (consecutive fields) are free: FP32 scratch for dK/dV
        scratch = cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32)
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        return SimpleNamespace(scratch=scratch, sQ=get(storage.sQ, sQ_layout), sdO=get(storage.sdO, sdO_layout),
                               sK=get(storage.sK, sKV_layout), sV=get(storage.sV, sV_layout),
                               sP=get(storage.sP, sPdS_layout) if self.p_in_smem else None,
                               sdS=get(storage.sdS, sPdS_layout), **stats)

    def tma_copies(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, s, head, batch, seq, stat_loads=None):
        """([(atom, gmem tiles, smem stages)] for Q and dO (and the statistics, `stat_loads`: the
        atoms and TMA tensors of make_stat_loads), the same for K and V)."""
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)

        def copy(atom, mX, h, offset, tile, sX):
            gX = seqlen.rows(mX, h, batch, offset, self.varlen)
            tXsX, tXgX = tma.partition(atom, cute.local_tile(gX, tile, (None, 0)), sX)
            return atom, tXgX, tXsX

        stat_copies = []
        if cutlass.const_expr(self.smem_stats):
            tma_lse, mLSE2, tma_d, mD = stat_loads
            offset = self.stat_offset(seq, batch)
            stat_copies = [copy(tma_lse, mLSE2, head, offset, (self.tile_m, 1), s.sLSE),
                           copy(tma_d, mD, head, offset, (self.tile_m, 1), s.sD)]

        dv = self.head_dim_v
        return ([copy(tma_q, mQ, head, seq.offset_q, tile_q, s.sQ),
                 copy(tma_do, mdO, head, seq.offset_q, (self.tile_m, dv), s.sdO)] + stat_copies,
                [copy(tma_k, mK, head_kv, seq.offset_k, tile_kv, s.sK),
                 copy(tma_v, mV, head_kv, seq.offset_k, (self.tile_n, dv), s.sV)])

    def consumer_setup(self, s, tidx, seq, window, softcap_scale, mLSE2, mD, head, batch):
        """`mma_setup`'s context plus what the walk reads: the entry's lengths and offsets (seq),
        the window edges, the softcap scale, and this head's LSE * log2 e and D rows."""
        ctx = self.mma_setup(s, tidx)
        ctx.window, ctx.softcap_scale, ctx.seq = window, softcap_scale, seq
        if self.smem_stats:  # (common/statistics.py: registers or SMEM)
            ctx.sLSE, ctx.sD = s.sLSE, s.sD
        else:
            ctx.lse_rows, ctx.d_rows = self.stat_rows(mLSE2, head, batch, seq), self.stat_rows(mD, head, batch, seq)
        return ctx

    # ---------------------------------------------------------------- compute pieces
    @cute.jit
    def q_tile_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window):
        """(first, end) of the Q tiles that see K/V tile n_block (mask.py; end >= first)."""
        first = mask.m_block_min(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal, window)
        end = mask.m_block_max(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, window)  # 0 without rows
        if cutlass.const_expr(window is not None):  # a window may leave this K/V tile no Q tile
            end = cutlass.max(first, end)
        return first, end

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

    def packed_q_tile(self, seq, m_block: Int32, batch: Int32) -> Int32:
        """Varlen: Q tile m_block of entry `batch` among whole-tile slots per head (the dQ counters,
        the fragment-order dQ accumulator): entry b's tiles count from cu_seqlens_q[b] // tile_m + b,
        which leaves every entry room for all of its tiles; total_q // tile_m + entries + 1 slots
        hold them all (seq's offsets clamped into the packed rows, seqlen.py)."""
        return seq.offset_q // self.tile_m + batch + m_block

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
