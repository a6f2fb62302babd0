"""M1: MLA decode against a latent KV cache (flash-attn 3's `qv`, DeepSeek's absorbed attention).

Multi-head latent attention caches one 512-wide latent vector v per token (and a 64-wide rotary
key k), shared by every query head (heads_kv = 1). After absorbing the key up-projection into the
query, each head's score is a 576-wide dot product and the value is the latent itself:

    S = (q k^T + qv v^T) * softmax_scale,   O = softmax(S) v        (O: 512 wide)

q (batch, seqlen_q, heads_q, 64) is the rotary part of the query, qv (..., 512) the absorbed one.
A decode step reads every cached byte once for all query heads, so the kernel is S1's design
(kernels/decode.py) on these dimensions: the query heads of a KV head, times the queries, packed
into one 64-row Q tile (128 heads: two tiles, whose CTAs run side by side and share the cache
through L2); the key range split across CTAs when the tiles cannot fill the SMs, the FP32 partials
merged by kernels/combine.py (512 columns a row); key blocks visited from the last, where the
ragged end and the causal diagonal are.

**Two warpgroups, O split by columns.** O is 64 x 512 FP32: 256 registers a thread on one
warpgroup, more than a thread has. Warpgroup w holds O[:, 256 w : 256 (w + 1)] (128 registers).
The scores are computed once, by warpgroup 0 (the "scores" warpgroup), and P is shared through
SMEM (FlashMLA's Hopper split):

    warpgroup 0: wait for the stage -> S = q K^T + qv V^T (WGMMA, 36 k-steps, A and B from SMEM)
                 -> mask, online softmax -> [wait P empty] write P (16-bit, stmatrix) and each
                 row's rescale factor to SMEM -> [arrive P full, wait P full] -> O0 *= factor,
                 O0 += P V[:, :256] -> release the stage
    warpgroup 1: [wait P full] -> O1 *= factor (read from SMEM), O1 += P V[:, 256:] -> [arrive P
                 empty] -> release the stage -> refill it (warp 4 issues the TMA loads; a gather:
                 all of warpgroup 1's threads issue cp.async copies)

so warpgroup 1's P V of block j runs beside warpgroup 0's S of block j + 1. Both P V halves read
P from SMEM with one two-warpgroup tiled MMA. The hand-off of P and the factors is a one-stage
mbarrier pipeline (pipeline.create_handoff): *P full* takes one arrival from each of warpgroup 0's
128 threads, each after its own writes of P (and its fence.proxy.async: WGMMA reads P through the
async proxy) and of the factors; *P empty* one from each of warpgroup 1's threads once its P V of
the block is done, which warpgroup 0 waits for before it overwrites P. Warpgroup 0 waits on P
full too: its own P V reads the rows its other warps wrote. The epilogue's 1/l takes the same
path, one hand-off after the last block's (so the factors' SMEM is only ever ordered by this
mbarrier pair, no CTA barrier). (Named barriers ordered all this as well, but compute-sanitizer's
racecheck does not follow bar.arrive, nor, in CTAs whose warpgroup 0 had passed its own 128-thread
barrier, the epilogue's two CTA barriers, and reported hazards on the factors; it follows mbarrier
arrive/wait pairs.) Each thread's O rows are the rows of the same thread's S (a 64-row WGMMA
atom: rows r and r + 8 of each warp's 16), which is how the factors in SMEM find their rows.

Why not split the S GEMM too (each warpgroup half of the 576-wide reduction, partial S exchanged
in FP32): the exchange buffer (16 KB, 32 KB double-buffered) does not fit beside Q (72 KB) and two
72 KB stages, and one stage would leave no load in flight while a block is computed. Computing S
twice (once per warpgroup, no exchange) would add 4.7 MFLOP a 64-key block to 4.2 of P V: compute
bound on H200 at 64 heads.

**SMEM** (config.mla_config's plan, which the kernel checks): q 8 KB + qv 64 KB, two stages of
(K 8 KB + V 64 KB), P 8 KB, the factors 256 B and the ring's and P's mbarriers (within the 1 KB the
plan keeps below Q): 225 KB, one CTA an SM, the same for every layout (a gather needs no TMA
descriptor and no more barriers; a third stage would not fit). V's stage is read by both GEMMs
(K-major as S's B operand, MN-major as P V's): the latent is read from memory once.

**Layouts.** The cache is dense (batch, capacity, heads_kv, d) or paged (num_pages, page_size,
heads_kv, d). Pages of a multiple of 64 rows hold whole key blocks: a block is one TMA box of one
page (paged.block_page). Pages of any other size (vLLM's 16, SGLang's 1, 48, 80, ...) compile the
`gather` layout: warpgroup 1's 128 threads copy the block's rows from their pages with 16-byte
cp.async copies into the same swizzled stage (paged.RowGather: 16 rows a pass, 4 a thread; a
thread copies one chunk of a row's k and the same chunk of each of v's eight 64-wide groups, 36
copies, each warp copy reading whole 128-byte lines), completing on the stage's full barrier
(cp.async.mbarrier.arrive.noinc, one arrival a copying thread: pipeline.create_gather, whose empty
barrier takes one arrival from each of the 256 reading threads); each warpgroup fences the async
proxy after its wait, before WGMMA reads the stage. Warpgroup 1 is the one with time to spare
(warpgroup 0's S and softmax are the critical path); the table reads and the copies add no live
registers to warpgroup 0. k and v are two tensors with their own strides, so vLLM's views of one
(pages, page_size, 576) cache (v = [..., :512], k = [..., 512:]) are read as they are. q and qv are
gathered into swizzled SMEM with 16-byte cp.async copies (rows past the queries copy the last
query's row: never stored), committed as their own cp.async group before a gather's first copies
so that waiting for Q does not wait for the ring. Rows of the cache past a sequence hold anything
(NaN included; a gather does not copy them, and they keep what the stage held): their scores are
masked, and the V rows of the ragged block are zeroed in SMEM before either GEMM reads them
(0 * NaN = NaN in P V).

**Packed queries of different lengths** (`varlen`, cu_seqlens_q: vLLM's MTP and speculative
verifies): q is one (total_q, heads_q, d) plane, entry b's queries at rows [cu[b], cu[b + 1]). The
grid is (Q tiles of every entry in a row, splits, heads_kv): entry b has ceil(len_b x group / 64)
tiles, side by side (with 128 heads, the two tiles of a query read the same blocks together), and
each CTA finds its entry with a warp scan over cu_seqlens_q (scheduler.varlen_tile, as S1); the grid
is sized from max_seqlen_q and total_q (min(batch x tiles of the longest, ceil(total_q x group /
64) + batch)), so a captured graph replays new offsets of the same total; tiles past the last own
no rows and read no keys. Uniform entries (total_q = batch x max_seqlen_q) keep the (batch,
seqlen_q) layout.

Values no host check saw cannot send a load outside a tensor: lengths are clamped to [0,
capacity] (seqlen.from_cache), page indices to the pool (paged.page_of; a gather's rows past the
sequence read its last key's entry and copy nothing), packed offsets into [0, total_q]
(seqlen.packed_span).
"""

from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .common import mask, mma, paged, pipeline, scheduler, seqlen, smem, softmax, tma
from .config import MlaConfig

# named barrier (0 is the CTA's): warpgroup 0 alone (P's hand-off is on mbarriers: p_barriers)
SCORES_WARPGROUP = 3
PRODUCER_WARP = 4  # warpgroup 1's first warp issues the TMA loads (warpgroup 0 is the critical path)
GATHER_THREADS = 128  # row gathers (pages of other sizes): warpgroup 1's threads issue the cp.async copies


class MlaDecode:
    # a combine launched behind this kernel as its programmatic dependent (kernels/combine.py,
    # _WithCombine): every CTA lets it launch as it starts
    launches_dependents = False

    def __init__(self, dtype, causal: bool, config: MlaConfig, paged: bool = False, gather: bool = False,
                 varlen: bool = False):
        """config: kernels/config.mla_config's (tiles, head dims, the ring's depth and the SMEM plan
        it counts on). paged: the cache as pages of a multiple of tile_n rows (one TMA box a key
        block), or (gather) of any size, read by cp.async row gathers; else dense. varlen: packed
        queries of different lengths (cu_seqlens_q), every entry's Q tiles in one grid."""
        self.dtype, self.causal, self.paged = dtype, causal, paged
        self.gather = paged and gather
        self.varlen = varlen
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.head_dim, self.head_dim_v = config.head_dim, config.head_dim_v
        self.kv_stages, self.planned_smem_bytes = config.kv_stages, config.planned_smem_bytes
        self.num_threads = 256  # two warpgroups: O's column halves
        self.half_v = self.head_dim_v // 2

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQv: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mOacc: cute.Tensor, mLSEacc: cute.Tensor, scale_log2: Float32, appended: Int32,
                 mCuSeqlensQ: cute.Tensor, max_seqlen_q: Int32, stream):
        """mQ (batch, seqlen_q, heads_q, d), mQv (..., d_v); mK (planes, rows, heads_kv, d), mV (...,
        d_v): planes are the batch entries (dense) or the pages (paged, with mBlockTable (batch,
        pages_per_seq)); mCacheSeqlens (batch,) the keys each sequence holds before the `appended`
        ones; mO (batch, seqlen_q, heads_q, d_v) and mLSE (batch, heads_q, seqlen_q) with one split,
        else the FP32 partials mOacc (splits, batch, seqlen_q, heads_q, d_v) and mLSEacc (splits,
        batch, heads_q, seqlen_q): the number of splits is mOacc.shape[0]. Varlen: one plane (batch
        1) of total_q queries, entry b's at rows [cu[b], cu[b + 1]) of mCuSeqlensQ (batch + 1,),
        max_seqlen_q the longest (it sizes the grid); otherwise both are unread (a stand-in)."""
        batch, seqlen_q, heads_q, _ = mQ.shape
        heads_kv = mK.shape[2]
        group = heads_q // heads_kv
        q_tiles = cute.ceil_div(seqlen_q * group, self.tile_m)
        # a KV head's Q tiles side by side in the grid: their CTAs read the same keys together
        grid = [heads_kv * q_tiles, mOacc.shape[0], batch]
        if cutlass.const_expr(self.varlen):
            # every entry's Q tiles in a row (an entry's side by side), per KV head: at most
            # ceil(total_q x group / tile_m) + batch, and at most batch tiles of the longest entry
            batch = mCuSeqlensQ.shape[0] - 1
            tiles = cutlass.min(batch * cute.ceil_div(max_seqlen_q * group, self.tile_m),
                                cute.ceil_div(seqlen_q * group, self.tile_m) + batch)
            grid = [cutlass.max(tiles, 1), mOacc.shape[0], heads_kv]
        layouts = (smem.tile_layout(self.dtype, self.tile_m, self.head_dim),  # q, qv, k, v, P
                   smem.tile_layout(self.dtype, self.tile_m, self.head_dim_v),
                   smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages),
                   smem.tile_layout(self.dtype, self.tile_n, self.head_dim_v, self.kv_stages),
                   smem.tile_layout(self.dtype, self.tile_m, self.tile_n))
        sQ_layout, sQv_layout, sK_layout, sV_layout, sP_layout = layouts
        if cutlass.const_expr(self.gather):  # cp.async reads the cache itself: (rows, d, heads, pages)
            tma_k, tK, tma_v, tV = None, tma.seq_major(mK), None, tma.seq_major(mV)
        else:
            tma_k, tK = tma.make_load(tma.seq_major(mK), sK_layout, (self.tile_n, self.head_dim))
            tma_v, tV = tma.make_load(tma.seq_major(mV), sV_layout, (self.tile_n, self.head_dim_v))
        self.stage_bytes = smem.stage_bytes(self.dtype, sK_layout) + smem.stage_bytes(self.dtype, sV_layout)

        @cute.struct
        class SharedStorage:
            kv_barriers: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            p_barriers: cute.struct.MemRange[Int64, pipeline.HANDOFF_BARRIERS]  # P full, P empty
            row_factor: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sQv: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQv_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        smem.check_budget(SharedStorage.size_in_bytes(), f"M1 with kv_stages={self.kv_stages}")
        smem.check_plan(SharedStorage.size_in_bytes(), self.planned_smem_bytes, "M1")
        self.kernel(mQ, mQv, tma_k, tK, tma_v, tV, mCacheSeqlens, mBlockTable, mO, mLSE, mOacc, mLSEacc,
                    scale_log2, appended, mCuSeqlensQ, *layouts, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQv: cute.Tensor, tma_k: Optional[cute.CopyAtom], mK: cute.Tensor,
               tma_v: Optional[cute.CopyAtom], mV: cute.Tensor, mCacheSeqlens: cute.Tensor, mBlockTable: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor,
               scale_log2: Float32, appended: Int32, mCuSeqlensQ: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sQv_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        if cutlass.const_expr(self.launches_dependents):
            cute.arch.griddepcontrol_launch_dependents()  # (the combine waits for this grid's end)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_splits = mOacc.shape[0]
        heads_kv = mK.shape[2]  # mK: the TMA tensor, (rows, d, heads, planes)
        group = mQ.shape[2] // heads_kv
        capacity = mK.shape[0]
        if cutlass.const_expr(self.paged):
            capacity = mBlockTable.shape[1] * mK.shape[0]
        if cutlass.const_expr(self.varlen):
            # grid (Q tiles of every entry in a row, splits, heads_kv): each warp finds its tile's
            # entry from cu_seqlens_q (scheduler.varlen_tile); its queries are rows offset_q.. of
            # the one packed plane
            tile, split, head_kv = cute.arch.block_idx()
            batch, m_block, entry_tiles = scheduler.varlen_tile(tile, mCuSeqlensQ, self.tile_m, mQ.shape[1], group)
            seq = seqlen.from_cache_packed(mCuSeqlensQ, mCacheSeqlens, batch, appended, capacity, mQ.shape[1])
            # a tile past the last entry's (the grid is sized for graph replay) names entry 0 with
            # no tiles: it owns no rows (its stores would race the real tile's) and reads no keys
            seq.seqlen_q = cutlass.min(seq.seqlen_q, entry_tiles * self.tile_m)
            seq.seqlen_k = seq.seqlen_k * cutlass.min(entry_tiles, 1)
        else:
            head_tile, split, batch = cute.arch.block_idx()
            q_tiles = cute.arch.grid_dim()[0] // heads_kv
            head_kv, m_block = head_tile // q_tiles, head_tile % q_tiles
            seq = seqlen.from_cache(mCacheSeqlens, batch, mQ.shape[1], appended, capacity)
        n_blocks, last = scheduler.split_kv_range(m_block, self.tile_m, self.tile_n, seq, self.causal, group,
                                                  None, split, num_splits)
        if cutlass.const_expr(not self.gather):
            if warp_idx == PRODUCER_WARP:
                tma.prefetch(tma_k, tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        if cutlass.const_expr(self.gather):  # warpgroup 1 copies (one arrival a thread), both warpgroups read
            kv_pipe = pipeline.create_gather(storage.kv_barriers.data_ptr(), self.kv_stages, GATHER_THREADS,
                                             self.num_threads)
        else:
            kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), self.kv_stages, self.num_threads // 32,
                                      self.stage_bytes)
        p_pipe = pipeline.create_handoff(storage.p_barriers.data_ptr(), 128, 128)  # warpgroup 0 -> 1
        pipeline.init_done()
        sQ = smem.get_tensor(storage.sQ, sQ_layout)[None, None, 0]
        sQv = smem.get_tensor(storage.sQv, sQv_layout)[None, None, 0]
        sK, sV = smem.get_tensor(storage.sK, sK_layout), smem.get_tensor(storage.sV, sV_layout)
        sP = smem.get_tensor(storage.sP, sP_layout)[None, None, 0]
        row_factor = storage.row_factor.get_tensor(cute.make_layout(self.tile_m))

        kv_producer = pipeline.producer_state(self.kv_stages)
        loads = (kv_pipe, tma_k, mK, tma_v, mV, sK, sV, mBlockTable, head_kv, batch, seq, tidx)
        q_args = (mQ, mQv, sQ, sQv, tidx, m_block, head_kv, group, batch, seq)
        if cutlass.const_expr(self.gather):
            # Q's copies first, in a cp.async group of their own: the gathers after them complete on
            # the ring's barriers, and waiting for Q does not wait for them
            if n_blocks > 0:
                self.issue_q(*q_args)
            if self.is_kv_producer(warp_idx):
                for _ in cutlass.range(cutlass.min(self.kv_stages, n_blocks), unroll=1):
                    kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
            if n_blocks > 0:  # (CTA-uniform: ends with a CTA barrier)
                self.wait_q()
        else:
            if warp_idx == PRODUCER_WARP:
                for _ in cutlass.range(cutlass.min(self.kv_stages, n_blocks), unroll=1):
                    kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
            if n_blocks > 0:  # (CTA-uniform: the load ends with a CTA barrier)
                self.issue_q(*q_args)
                self.wait_q()

        ctx = self.compute_setup(sQ, sQv, sK, sV, sP, tidx)
        blocks = (n_blocks, last, m_block, group, seq, scale_log2)
        if warp_idx < 4:
            self.scores_mainloop(ctx, kv_pipe, p_pipe, sV, sP, row_factor, *blocks)
        else:
            kv_producer = self.values_mainloop(ctx, kv_pipe, p_pipe, kv_producer, loads, row_factor, warp_idx,
                                               *blocks)
        if self.is_kv_producer(warp_idx):
            pipeline.tail(kv_pipe, kv_producer)
        self.store(ctx, p_pipe, row_factor, n_blocks, mO, mLSE, mOacc, mLSEacc, split, num_splits, m_block,
                   head_kv, group, batch, seq, scale_log2, warp_idx)

    # ---------------------------------------------------------------- loads
    def is_kv_producer(self, warp_idx):
        """Warp PRODUCER_WARP issues the TMA loads; every thread of warpgroup 1 its share of a
        gather (warp-uniform)."""
        return warp_idx >= 4 if cutlass.const_expr(self.gather) else warp_idx == PRODUCER_WARP

    @cute.jit
    def load_kv(self, state, n_block: Int32, kv_pipe, tma_k, mK, tma_v, mV, sK, sV, mBlockTable,
                head_kv: Int32, batch: Int32, seq, tidx: Int32):
        """Key block n_block into the next stage: one box of k and one of v at (row tile, head,
        plane), the plane being the batch entry (dense) or the block's page (paged); or (gather)
        cp.async copies of the block's rows from their pages by warpgroup 1's threads, 16 rows a
        pass, each thread one 16-byte chunk of k and the same chunk of each 64-wide group of v
        (paged.RowGather: 4 rows, 36 copies a thread)."""
        if cutlass.const_expr(self.gather):
            wg_tidx = tidx - GATHER_THREADS
            gather = paged.RowGather(self.dtype, self.tile_n, self.head_dim, GATHER_THREADS)
            rows = gather.locate(wg_tidx, mBlockTable, batch, n_block, seq.seqlen_k, mK.shape[0], mK.shape[3])
            copies = lambda stage: gather.copy(wg_tidx, rows, [
                (mK[None, None, head_kv, None], sK[None, None, stage]),
                (mV[None, None, head_kv, None], sV[None, None, stage])])
            return pipeline.produce_copies(kv_pipe, state, copies)
        plane, row_tile = batch, n_block
        if cutlass.const_expr(self.paged):
            plane, row_tile = paged.block_page(mBlockTable, batch, n_block, self.tile_n, mK.shape[0], mK.shape[3])
        gK = cute.local_tile(mK[None, None, head_kv, plane], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, plane], (self.tile_n, self.head_dim_v), (None, 0))
        tKsK, tKgK = tma.partition(tma_k, gK, sK)
        tVsV, tVgV = tma.partition(tma_v, gV, sV)
        return pipeline.produce(kv_pipe, state, row_tile, [(tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)])

    @cute.jit
    def issue_q(self, mQ: cute.Tensor, mQv: cute.Tensor, sQ: cute.Tensor, sQv: cute.Tensor, tidx: Int32,
                m_block: Int32, head_kv: Int32, group: Int32, batch: Int32, seq):
        """Gather the packed Q tile (q and qv) into SMEM with 16-byte cp.async copies from all
        threads, committed as one cp.async group (wait_q waits for it): packed row R is query
        R // group of head head_kv * group + R % group (rows past the queries copy the last
        query's row, whose scores are never stored); varlen: the entry's rows of the one plane."""
        q_plane = 0 if cutlass.const_expr(self.varlen) else batch
        for mX, sX, cols in ((mQ, sQ, self.head_dim), (mQv, sQv, self.head_dim_v)):
            rows = paged.RowGather(self.dtype, self.tile_m, cols, self.num_threads)
            tiled, thr = rows.thread_copy(tidx)
            chunk = tidx % rows.chunks
            for i in cutlass.range_constexpr(self.tile_m // rows.rows_per_pass):
                packed = m_block * self.tile_m + tidx // rows.chunks + i * rows.rows_per_pass
                query = cutlass.min(packed // group, seq.seqlen_q - 1)
                if cutlass.const_expr(self.varlen):
                    query = seq.offset_q + query
                src = cute.local_tile(mX[q_plane, query, head_kv * group + packed % group, None], (rows.elems,),
                                      (chunk,))
                dst = thr.partition_D(sX)[None, i, 0]
                cute.copy(tiled, cute.make_tensor(src.iterator, dst.layout), dst)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def wait_q(self):
        """Wait for issue_q's group (not for cp.async copies issued after it), then make the tile
        visible to every warpgroup's WGMMA."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")  # (cp.async writes: generic proxy; WGMMA reads)
        cute.arch.sync_threads()

    # ---------------------------------------------------------------- the two warpgroups
    def compute_setup(self, sQ, sQv, sK, sV, sP, tidx):
        """The GEMMs' fragments: S on warpgroup 0 (one 64 x tile_n tile, two A/B pairs: q with K,
        qv with V), P V on both (tile_m x d_v split by columns, P read from SMEM)."""
        qk = mma.tiled_mma(self.dtype, self.tile_m, self.tile_n)
        thr_qk = qk.get_slice(tidx % 128)
        pv = mma.tiled_mma(self.dtype, self.tile_m, self.head_dim_v, b_major="MN", warpgroups=2)
        thr_pv, wg_pv = pv.get_slice(tidx), mma.warpgroup_slice(pv, tidx)
        ctx = SimpleNamespace(
            qk=qk, pv=pv, tidx=tidx,
            tSrQ=mma.fragment_A(thr_qk, sQ), tSrK=mma.fragment_B(thr_qk, sK),
            tSrQv=mma.fragment_A(thr_qk, sQv), tSrV=mma.fragment_B(thr_qk, sV),
            s_shape=thr_qk.partition_shape_C((self.tile_m, self.tile_n)),
            s_coords=mma.rows_cols(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))),
            tOrP=mma.fragment_A(wg_pv, sP), tOrVt=mma.fragment_B(wg_pv, mma.transpose_view(sV)),
            acc_o=cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32),
            o_coords=mma.rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))))
        ctx.acc_o.fill(0.0)
        ctx.row_max, ctx.row_sum = softmax.row_state(cute.size(ctx.s_coords, mode=[0]))
        return ctx

    @cute.jit
    def scores_mainloop(self, ctx, kv_pipe, p_pipe, sV: cute.Tensor, sP: cute.Tensor, row_factor: cute.Tensor,
                        n_blocks: Int32, last: Int32, m_block: Int32, group: Int32, seq, scale_log2: Float32):
        """Warpgroup 0: per key block (last, last - 1, ...), S, the softmax, P and the rescale
        factors handed over through SMEM (p_pipe's producer), then its half of P V. The hand-off's
        states follow from the block count (one stage), none carried through the loop."""
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            stage = kv_consumer.index
            pipeline.consume_wait(kv_pipe, kv_consumer)
            if cutlass.const_expr(self.gather):  # cp.async wrote the stage (generic proxy): WGMMA reads it
                cute.arch.fence_proxy("async.shared", space="cta")
            if j == 0:  # the sequence's ragged end, if this split has it, is its first block
                self.zero_rows_past_end(sV[None, None, stage], seq.seqlen_k - n_block * self.tile_n, ctx.tidx)
            acc_s = cute.make_rmem_tensor(ctx.s_shape, Float32)
            mma.gemm(ctx.qk, acc_s, ctx.tSrQ, ctx.tSrK[None, None, None, stage], zero_init=True, wait=-1)
            mma.gemm(ctx.qk, acc_s, ctx.tSrQv, ctx.tSrV[None, None, None, stage], wait=0)
            s_mn = mma.rows_cols(acc_s)
            if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                    self.causal, rows_per_query=group):
                mask.apply(s_mn, ctx.s_coords, m_block * self.tile_m, n_block * self.tile_n, seq.seqlen_q,
                           seq.seqlen_k, self.causal, rows_per_query=group)
            factor = softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4)
            p = mma.to_dtype(acc_s, self.dtype)
            p_state = pipeline.state_at(1, j, producer=True)
            p_pipe.producer_acquire(p_state)  # warpgroup 1's P V of block j - 1 is done
            mma.store_to_smem(p, ctx.qk, ctx.tidx, sP)
            self.share_rows(ctx, row_factor, factor)
            cute.arch.fence_proxy("async.shared", space="cta")  # P: generic writes, read by WGMMA
            p_pipe.producer_commit(p_state)  # this thread's writes are done
            pipeline.consume_wait(p_pipe, pipeline.state_at(1, j))  # every thread's: P is whole
            softmax.rescale(mma.rows_cols(ctx.acc_o), factor)
            self.accumulate(ctx, stage)
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)

    @cute.jit
    def values_mainloop(self, ctx, kv_pipe, p_pipe, kv_producer, loads, row_factor: cute.Tensor,
                        warp_idx: Int32, n_blocks: Int32, last: Int32, m_block: Int32, group: Int32, seq,
                        scale_log2: Float32):
        """Warpgroup 1: per key block, its half of P V once warpgroup 0 has written P (p_pipe's
        consumer); then the freed stage refilled (warp PRODUCER_WARP's TMA, or every thread's share
        of a gather). Returns the producer state
        (for pipeline.tail)."""
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        for j in cutlass.range(n_blocks, unroll=1):
            pipeline.consume_wait(p_pipe, pipeline.state_at(1, j))  # P and the factors of block j
            stage = kv_consumer.index
            pipeline.consume_wait(kv_pipe, kv_consumer)  # (landed: warpgroup 0 waited; this orders the reads)
            if cutlass.const_expr(self.gather):  # (the copies' writes, seen by this warpgroup's WGMMA)
                cute.arch.fence_proxy("async.shared", space="cta")
            softmax.rescale(mma.rows_cols(ctx.acc_o), self.shared_rows(ctx, row_factor))
            self.accumulate(ctx, stage)
            p_pipe.consumer_release(pipeline.state_at(1, j))  # this thread's P V has read sP and the factors
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)
            if self.is_kv_producer(warp_idx) and kv_producer.count < n_blocks:  # refill the stage just freed
                kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
        return kv_producer

    @cute.jit
    def accumulate(self, ctx, stage: Int32):
        """O[:, this warpgroup's half] += P V[:, that half] of the stage, waited for."""
        mma.gemm(ctx.pv, ctx.acc_o, ctx.tOrP, ctx.tOrVt[None, None, None, stage], wait=0)

    @cute.jit
    def share_rows(self, ctx, row_values: cute.Tensor, values: cute.Tensor):
        """Warpgroup 0: one value per row of its S fragment (a quad holds a row) into SMEM."""
        if ctx.tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(values)):
                row_values[ctx.s_coords[r, 0][0]] = values[r]

    @cute.jit
    def shared_rows(self, ctx, row_values: cute.Tensor) -> cute.Tensor:
        """The values share_rows wrote, for this thread's rows of O."""
        rows = cute.size(ctx.o_coords, mode=[0])
        values = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            values[r] = row_values[ctx.o_coords[r, 0][0]]
        return values

    @cute.jit
    def zero_rows_past_end(self, sV_stage: cute.Tensor, valid_rows: Int32, tidx: Int32):
        """Zero the V rows of a ragged block past the sequence (warpgroup 0, before S reads them;
        warpgroup 1 reads them after P full): a cache's unused rows hold anything, and 0 * NaN =
        NaN in P V. Their scores are masked."""
        if valid_rows < self.tile_n:
            for r in cutlass.range(cutlass.max(valid_rows, 0), self.tile_n, unroll=1):
                for c in cutlass.range_constexpr(self.head_dim_v // 128):
                    sV_stage[r, tidx + c * 128] = sV_stage.element_type(0.0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=SCORES_WARPGROUP, number_of_threads=128)

    # ---------------------------------------------------------------- epilogue
    @cute.jit
    def store(self, ctx, p_pipe, row_factor: cute.Tensor, n_blocks: Int32, mO, mLSE, mOacc, mLSEacc, split: Int32,
              num_splits: Int32, m_block: Int32, head_kv: Int32, group: Int32, batch: Int32, seq, scale_log2: Float32,
              warp_idx: Int32):
        """Each warpgroup's half of O normalised by 1/l, and warpgroup 0's LSE, unpacked to (query,
        head) rows; with several splits the FP32 partials instead. Direct stores: a decode tile has
        few rows. 1/l is warpgroup 0's (its registers); warpgroup 1 gets it through the factors'
        SMEM as one more hand-off on p_pipe, the (n_blocks)-th: P empty (warpgroup 1 has read the
        last block's factors) before warpgroup 0 writes, P full before warpgroup 1 reads. (Two CTA
        barriers did this before; racecheck did not see them order these accesses in the CTAs whose
        warpgroup 0 had passed zero_rows_past_end's 128-thread barrier.) Varlen: at the entry's rows
        of the one plane."""
        q_plane = 0 if cutlass.const_expr(self.varlen) else batch
        inv_sums = cute.make_rmem_tensor((cute.size(ctx.o_coords, mode=[0]),), Float32)
        if warp_idx < 4:
            for r in cutlass.range_constexpr(cute.size(ctx.row_max)):
                inv_sum, lse = softmax.finalize(ctx.row_max[r], ctx.row_sum[r], scale_log2, 4)
                inv_sums[r] = inv_sum
                packed = m_block * self.tile_m + ctx.s_coords[r, 0][0]
                query, head = packed // group, head_kv * group + packed % group
                if ctx.tidx % 4 == 0 and query < seq.seqlen_q:
                    row = seq.offset_q + query if cutlass.const_expr(self.varlen) else query
                    if num_splits == 1:
                        mLSE[q_plane, head, row] = lse
                    else:
                        mLSEacc[split, q_plane, head, row] = lse
            p_state = pipeline.state_at(1, n_blocks, producer=True)
            p_pipe.producer_acquire(p_state)  # warpgroup 1 has read the last block's factors
            self.share_rows(ctx, row_factor, inv_sums)
            p_pipe.producer_commit(p_state)
        else:
            pipeline.consume_wait(p_pipe, pipeline.state_at(1, n_blocks))  # 1/l is written
            shared = self.shared_rows(ctx, row_factor)
            for r in cutlass.range_constexpr(cute.size(inv_sums)):
                inv_sums[r] = shared[r]
        o_mn = mma.rows_cols(ctx.acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            packed = m_block * self.tile_m + ctx.o_coords[r, 0][0]
            query, head = packed // group, head_kv * group + packed % group
            if query < seq.seqlen_q:
                row = seq.offset_q + query if cutlass.const_expr(self.varlen) else query
                if num_splits == 1:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mO[q_plane, row, head, ctx.o_coords[r, c][1]] = (o_mn[r, c] * inv_sums[r]).to(mO.element_type)
                else:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mOacc[split, q_plane, row, head, ctx.o_coords[r, c][1]] = o_mn[r, c] * inv_sums[r]
