"""S1: attention against a KV cache, with the key range split across CTAs (flash-decoding).

Decode has one (or a few) new query rows per sequence against thousands of cached keys: the work
is reading K and V once, at memory speed. Two ideas make that possible on 132 SMs:

* **Pack GQA.** The query heads that share a KV head (`group = heads_q // heads_kv`) times the
  query positions fill the M dimension of one Q tile: packed row R holds query position R // group
  of query head kv_head * group + R % group. Each K/V byte is then read once per KV head, not once
  per query head. Q is gathered into SMEM by plain loads (its rows are not one TMA box).
* **Split-KV.** When batch x heads_kv x Q tiles cannot fill the SMs, CTA `split` of `num_splits`
  takes an equal share of the key blocks and writes an FP32 partial O and its LSE; a combine kernel
  (`SplitKVCombine`) merges the partials: LSE = log sum_i exp(lse_i), O = sum_i exp(lse_i - LSE) O_i.
  With one split the kernel writes O and LSE directly.
* **Sinks** (a compile-time variant): each query head's sink logit joins the row's denominator
  once: in the epilogue's softmax.finalize with one split, else in the combine, as one more
  partial with LSE = sink and O = 0.

Grid (num_splits, heads_kv * q_tiles, batch), one warpgroup per CTA (tile_m = 64). K/V tiles come
through K3's TMA ring (`kv_stages` deep, warp 0 refills a stage as soon as it is released); the
math is K4.2's (both GEMMs on WGMMA, softmax on the accumulator, P from registers). Key blocks are
visited from the last to the first, so the ragged and causal-diagonal blocks, the only ones masked,
come first.

The cache is dense, (batch, capacity, heads_kv, d), or paged, (num_pages, page_size, heads_kv, d)
with `block_table[b, i]` the page holding keys [i * page_size, (i + 1) * page_size) of entry b.
Both are the same to the producer: a key block lives in a (rows, d) plane at (row tile, kv head,
plane), the plane being the batch entry (dense) or the page (paged); tile_n divides page_size, so
a block never straddles pages. Sequence lengths come from `cache_seqlens` (common/seqlen.py);
causal masks align to the bottom right as everywhere in fa3.

Values no host check has seen (a CUDA graph replayed with new lengths or pages) cannot send a load
outside the cache: lengths are clamped to [0, capacity] (capacity: the dense cache's rows, or
pages_per_seq * page_size), so no block-table entry past a row's pages_per_seq is read, and each
page index read is clamped to [0, num_pages). Both bounds come from the tensors' (dynamic) shapes.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .common import mask, mma, pipeline, seqlen, smem, softmax, tma


class SplitKVAttention:
    def __init__(self, dtype, head_dim: int, causal: bool, paged: bool = False, tile_m: int = 64,
                 tile_n: int = 64, max_kv_stages: int = 8, local: bool = False, softcap: bool = False,
                 sinks: bool = False):
        self.dtype, self.head_dim, self.causal, self.paged = dtype, head_dim, causal, paged
        # a sliding window (mask.py), capped scores, attention sinks (softmax.finalize)
        self.local, self.softcap, self.sinks = local, softcap, sinks
        self.tile_m, self.tile_n = tile_m, tile_n
        self.num_threads = 128  # one warpgroup: tile_m = 64 rows
        q_bytes = tile_m * head_dim * 2
        kv_bytes = 2 * tile_n * head_dim * 2  # a K and a V tile per stage
        self.kv_stages = min(max_kv_stages, smem.stages_that_fit(kv_bytes, q_bytes + 1024))

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCacheSeqlens: cute.Tensor,
                 mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor,
                 mLSEacc: cute.Tensor, scale_log2: Float32, appended: Int32, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mSinks: cute.Tensor, stream):
        """mQ (batch, seqlen_q, heads_q, d); mK/mV the cache; mO/mLSE the result when there is one
        split, else mOacc (splits, batch, seqlen_q, heads_q, d) and mLSEacc (splits, batch,
        heads_q, seqlen_q) in FP32: the number of splits is mOacc.shape[0]. The window edges,
        softcap_scale and mSinks (heads_q,) are read only by the variants that use them."""
        batch, seqlen_q, heads_q, _ = mQ.shape
        heads_kv = mK.shape[2]
        sQ_layout = smem.tile_layout(self.dtype, self.tile_m, self.head_dim)
        sKV_layout = smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages)
        tile_kv = (self.tile_n, self.head_dim)
        tma_k, tK = tma.make_load(tma.seq_major(mK), sKV_layout, tile_kv)
        tma_v, tV = tma.make_load(tma.seq_major(mV), sKV_layout, tile_kv)

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"S1 with kv_stages={self.kv_stages}, tile_n={self.tile_n}, d={self.head_dim}")
        q_tiles = cute.ceil_div(seqlen_q * (heads_q // heads_kv), self.tile_m)
        self.kernel(mQ, tma_k, tK, tma_v, tV, mCacheSeqlens, mBlockTable, mO, mLSE, mOacc, mLSEacc,
                    scale_log2, appended, window_left, window_right, softcap_scale, mSinks, sQ_layout,
                    sKV_layout, SharedStorage).launch(
            grid=[mOacc.shape[0], heads_kv * q_tiles, batch], block=[self.num_threads, 1, 1],
            stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom,
               mV: cute.Tensor, mCacheSeqlens: cute.Tensor, mBlockTable: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor, scale_log2: Float32,
               appended: Int32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mSinks: cute.Tensor, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, head_tile, batch = cute.arch.block_idx()
        num_splits = mOacc.shape[0]
        seqlen_q, heads_q, heads_kv = mQ.shape[1], mQ.shape[2], mK.shape[2]  # mK: (rows, d, heads, planes)
        group = heads_q // heads_kv
        q_tiles = (seqlen_q * group + self.tile_m - 1) // self.tile_m
        head_kv, m_block = head_tile // q_tiles, head_tile % q_tiles
        capacity = mK.shape[0]
        if cutlass.const_expr(self.paged):
            capacity = mBlockTable.shape[1] * mK.shape[0]
        seq = seqlen.from_cache(mCacheSeqlens, batch, seqlen_q, appended, capacity)
        if warp_idx == 0:
            tma.prefetch(tma_k, tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), self.kv_stages, 4,
                                  2 * smem.stage_bytes(self.dtype, sKV_layout))
        pipeline.init_done()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)[None, None, 0]
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

        window = (window_left, window_right) if cutlass.const_expr(self.local) else None
        # this split's share of the key blocks the tile sees
        blocks_end = mask.n_block_max(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                      self.causal, rows_per_query=group, window=window)
        blocks_start = mask.n_block_min(m_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                        rows_per_query=group, window=window)
        blocks = cutlass.max(blocks_end - blocks_start, 0)
        per_split = (blocks + num_splits - 1) // num_splits
        first = blocks_start + split * per_split
        n_blocks = cutlass.max(cutlass.min(blocks_end, first + per_split) - first, 0)
        last = first + n_blocks - 1  # visited first

        kv_producer = pipeline.producer_state(self.kv_stages)
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.kv_stages, n_blocks), unroll=1):
                kv_producer = self.load_kv(kv_pipe, kv_producer, last - kv_producer.count, tma_k, mK,
                                           tma_v, mV, sK, sV, mBlockTable, head_kv, batch)
        self.load_q(mQ, sQ, tidx, m_block, head_kv, group, batch, seqlen_q)

        ctx = self.compute_setup(sQ, sK, sV, tidx)
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        row0 = m_block * self.tile_m
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            pipeline.consume_wait(kv_pipe, kv_consumer)
            self.zero_rows_past_end(sV[None, None, kv_consumer.index], seq.seqlen_k - n_block * self.tile_n, tidx)
            self.compute_tile(ctx, kv_consumer.index, m_block, n_block, group, seq, scale_log2, window,
                              softcap_scale)
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)
            if warp_idx == 0 and kv_producer.count < n_blocks:  # refill the stage just freed
                kv_producer = self.load_kv(kv_pipe, kv_producer, last - kv_producer.count, tma_k, mK,
                                           tma_v, mV, sK, sV, mBlockTable, head_kv, batch)
        if warp_idx == 0:
            pipeline.tail(kv_pipe, kv_producer)
        self.store(ctx, mO, mLSE, mOacc, mLSEacc, mSinks, split, num_splits, row0, head_kv, group,
                   batch, seqlen_q, scale_log2)

    # ---------------------------------------------------------------- loads
    @cute.jit
    def load_kv(self, kv_pipe, state, n_block: Int32, tma_k, mK, tma_v, mV, sK, sV, mBlockTable,
                head_kv: Int32, batch: Int32):
        """Key block n_block of this entry into the next stage: (row tile, head, plane) coordinates
        in the dense cache (plane = batch entry) or the paged one (plane = its page)."""
        plane, row_tile = batch, n_block
        if cutlass.const_expr(self.paged):
            tiles_per_page = mK.shape[0] // self.tile_n
            # a bad entry reads some page of the pool (results are meaningless, memory is safe)
            page = mBlockTable[batch, n_block // tiles_per_page]
            plane = cutlass.max(cutlass.min(page, mK.shape[3] - 1), 0)
            row_tile = n_block % tiles_per_page
        tile_kv = (self.tile_n, self.head_dim)
        tKsK, tKgK = tma.partition(tma_k, cute.local_tile(mK[None, None, head_kv, plane], tile_kv, (None, 0)), sK)
        tVsV, tVgV = tma.partition(tma_v, cute.local_tile(mV[None, None, head_kv, plane], tile_kv, (None, 0)), sV)
        return pipeline.produce(kv_pipe, state, row_tile, [(tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)])

    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, tidx: Int32, m_block: Int32, head_kv: Int32,
               group: Int32, batch: Int32, seqlen_q: Int32):
        """Gather the packed Q tile into SMEM: 8-element chunks, rows past the queries zeroed."""
        chunks_per_row = self.head_dim // 8
        for i in cutlass.range_constexpr(self.tile_m * chunks_per_row // self.num_threads):
            chunk = tidx + i * self.num_threads
            r, c = chunk // chunks_per_row, chunk % chunks_per_row * 8
            packed = m_block * self.tile_m + r
            query, head = packed // group, head_kv * group + packed % group
            valid = query < seqlen_q
            query = cutlass.min(query, seqlen_q - 1)  # a row that exists: loaded, then zeroed
            for e in cutlass.range_constexpr(8):
                x = mQ[batch, query, head, c + e]
                sQ[r, c + e] = x if valid else x.dtype(0.0)
        # generic-proxy writes, read by WGMMA through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

    @cute.jit
    def zero_rows_past_end(self, sV_stage: cute.Tensor, valid_rows: Int32, tidx: Int32):
        """Zero the V rows of a ragged last block that lie past the sequence. A cache's unused rows
        are whatever memory held (NaN bit patterns included) and P = 0 there does not help:
        0 * NaN = NaN. K needs nothing: masking selects -inf over any score."""
        if valid_rows < self.tile_n:
            for r in cutlass.range(valid_rows, self.tile_n, unroll=1):
                for c in cutlass.range_constexpr((self.head_dim + self.num_threads - 1) // self.num_threads):
                    col = tidx + c * self.num_threads
                    if col < self.head_dim:
                        sV_stage[r, col] = sV_stage.element_type(0.0)
            cute.arch.fence_proxy("async.shared", space="cta")  # read next by WGMMA (async proxy)
            cute.arch.sync_threads()

    # ---------------------------------------------------------------- compute (K4.2's)
    def compute_setup(self, sQ, sK, sV, tidx):
        qk = mma.tiled_mma(self.dtype, self.tile_m, self.tile_n)
        thr_qk = qk.get_slice(tidx)
        pv = mma.tiled_mma(self.dtype, self.tile_m, self.head_dim, b_major="MN", a_in_regs=True)
        thr_pv = pv.get_slice(tidx)
        ctx = SimpleNamespace(
            qk=qk, thr_qk=thr_qk, pv=pv, tidx=tidx,
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
            s_coords=mma.rows_cols(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))),
            tOrVt=thr_pv.make_fragment_B(thr_pv.partition_B(mma.transpose_view(sV))),
            acc_o=cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32),
            o_coords=mma.rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))))
        ctx.acc_o.fill(0.0)
        ctx.row_max, ctx.row_sum = softmax.row_state(cute.size(ctx.s_coords, mode=[0]))
        return ctx

    @cute.jit
    def compute_tile(self, ctx, stage, m_block: Int32, n_block: Int32, group: Int32, seq,
                     scale_log2: Float32, window, softcap_scale: Float32):
        acc_s = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(ctx.qk, acc_s, ctx.tSrQ, ctx.tSrK[None, None, None, stage], zero_init=True, wait=0)
        s_mn = mma.rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, softcap_scale)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                self.causal, rows_per_query=group, window=window):
            mask.apply(s_mn, ctx.s_coords, m_block * self.tile_m, n_block * self.tile_n, seq.seqlen_q,
                       seq.seqlen_k, self.causal, rows_per_query=group, window=window)
        softmax.rescale(mma.rows_cols(ctx.acc_o),
                        softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4))
        p = mma.to_dtype(acc_s, self.dtype)
        mma.gemm(ctx.pv, ctx.acc_o, mma.as_a_operand(p), ctx.tOrVt[None, None, None, stage], wait=0)

    # ---------------------------------------------------------------- epilogue
    @cute.jit
    def store(self, ctx, mO, mLSE, mOacc, mLSEacc, mSinks, split: Int32, num_splits: Int32, row0: Int32,
              head_kv: Int32, group: Int32, batch: Int32, seqlen_q: Int32, scale_log2: Float32):
        """O and LSE of each real row (direct stores: a decode tile has few), unpacked to (query,
        head); with several splits the FP32 partials instead (the combine adds the sinks)."""
        o_mn = mma.rows_cols(ctx.acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            packed = row0 + ctx.o_coords[r, 0][0]
            query, head = packed // group, head_kv * group + packed % group
            sink_log2 = None
            if cutlass.const_expr(self.sinks):
                sink_log2 = -Float32.inf  # (no sink in a partial)
                if num_splits == 1:
                    sink_log2 = mSinks[head] * Float32(softmax.LOG2E)
            inv_sum, lse = softmax.finalize(ctx.row_max[r], ctx.row_sum[r], scale_log2, 4, sink_log2)
            if query < seqlen_q:
                if num_splits == 1:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mO[batch, query, head, ctx.o_coords[r, c][1]] = (o_mn[r, c] * inv_sum).to(self.dtype)
                    if ctx.tidx % 4 == 0:
                        mLSE[batch, head, query] = lse
                else:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mOacc[split, batch, query, head, ctx.o_coords[r, c][1]] = o_mn[r, c] * inv_sum
                    if ctx.tidx % 4 == 0:
                        mLSEacc[split, batch, head, query] = lse


class SplitKVCombine:
    """O and LSE from the splits' FP32 partials: one warp per (batch, query, head) row.

    LSE = m + log(sum_i exp(lse_i - m)) with m = max_i lse_i; O = sum_i exp(lse_i - LSE) O_i. Splits
    that saw no key carry lse = -inf and weigh 0; a row no split saw keeps O = 0, LSE = -inf.
    `sinks`: the head's sink is one more term of the sum, with no O (mSinks (heads_q,) FP32)."""

    warps = 4

    def __init__(self, dtype, head_dim: int, sinks: bool = False):
        self.dtype, self.head_dim, self.sinks = dtype, head_dim, sinks

    @cute.jit
    def __call__(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSinks: cute.Tensor, stream):
        _, batch, seqlen_q, heads_q, _ = mOacc.shape
        rows = batch * seqlen_q * heads_q
        self.kernel(mOacc, mLSEacc, mO, mLSE, mSinks).launch(
            grid=[cute.ceil_div(rows, self.warps), 1, 1], block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSinks: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        splits, batch_size, seqlen_q, heads_q, _ = mOacc.shape
        row = block * self.warps + tidx // 32
        if row < batch_size * seqlen_q * heads_q:
            head = row % heads_q
            query = row // heads_q % seqlen_q
            batch = row // (heads_q * seqlen_q)
            top = -Float32.inf
            for s in cutlass.range(lane, splits, 32, unroll=1):
                top = cute.arch.fmax(top, mLSEacc[s, batch, head, query])
            top = cute.arch.warp_reduction_max(top, threads_in_group=32)
            sink = -Float32.inf
            if cutlass.const_expr(self.sinks):
                sink = mSinks[head]
                top = cute.arch.fmax(top, sink)
            offset = top
            if top == -Float32.inf:
                offset = Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, splits, 32, unroll=1):
                total += cute.math.exp(mLSEacc[s, batch, head, query] - offset, fastmath=True)
            total = cute.arch.warp_reduction_sum(total, threads_in_group=32)
            if cutlass.const_expr(self.sinks):
                total += cute.math.exp(sink - offset, fastmath=True)
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = offset + cute.math.log(total, fastmath=True)
            acc = cute.make_rmem_tensor((self.head_dim // 32,), Float32)
            acc.fill(0.0)
            if total > Float32(0.0):
                for s in cutlass.range(splits, unroll=1):
                    weight = cute.math.exp(mLSEacc[s, batch, head, query] - lse, fastmath=True)
                    for i in cutlass.range_constexpr(self.head_dim // 32):
                        acc[i] += weight * mOacc[s, batch, query, head, lane + 32 * i]
            for i in cutlass.range_constexpr(self.head_dim // 32):
                mO[batch, query, head, lane + 32 * i] = acc[i].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, query] = lse
