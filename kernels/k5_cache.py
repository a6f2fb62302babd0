"""K5 over a KV cache: the prompt chunks of a serving step, on K5.5's warp-specialized kernel.

A serving engine packs a step's decodes (one query each) and chunks of prompts (hundreds or
thousands of queries) into one call over its paged cache (vLLM's varlen call with seqused_k and
block_table). S1 (kernels/decode.py) packs a KV head's query heads into 64-row tiles on one
warpgroup: right for decodes, which only read the cache, and slow for a chunk, which is
compute-bound. This kernel is K5.5 (producer warp, ping-pong consumer warpgroups, the intra-
warpgroup overlap, the dynamic causal schedule) plus one idea: the keys come from the cache. It
composes what K5 is made of (the roles of common/warp_specialized_forward.py, the mainloop of
k5_mainloop.py) with its own launch and the loads' hooks below.

* Entries: queries packed as K5's varlen batches (cu_seqlens_q); entry b's keys are the first
  seqused_k[b] rows of its cache (seqlen.from_cache_packed). Only entries of at least
  `min_queries` queries get tiles (scheduler's `lengths`); S1, launched in the same call with the
  complementary bound, takes the others, so each row is written by exactly one kernel.
* Loads: a key block of tile_n rows is one TMA box of one page where pages hold whole blocks
  (page_size a multiple of tile_n; a dense cache is one page per entry: `block_page`). Smaller
  pages (`page_rows`: 8 to tile_n / 2 rows, dividing tile_n; vLLM's 16) are one box each, into
  their row slab of the stage: the producer warp's lanes read the block's page-table entries at
  once, one each, and the boxes all complete on the stage's one full barrier. Page indices are
  clamped into the pool and table entries past the sequence's last page are never read.
* The block holding the sequence's last key is visited first. Its rows past that key hold
  whatever the cache holds there (unused page rows, or the last page again): K there is masked to
  -inf scores, V is zeroed in SMEM by the consumers before P V reads it (0 * NaN is NaN).

Pages of other sizes (1, 24, ...) have no box here: the caller keeps such calls on S1's gathers.
"""

from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass import pipeline as dsl_pipeline

from .common import paged, pipeline, seqlen, tma
from .common.warp_specialized_forward import EPILOGUE_BARRIER, WarpSpecializedForward
from .config import ForwardConfig
from .k5_mainloop import ForwardMainloop

NO_LIMIT = 1 << 30  # queries: an entry bound that no packed batch reaches


class CacheAttention(WarpSpecializedForward, ForwardMainloop):
    def __init__(self, dtype, head_dim: int, causal: bool, config: ForwardConfig, paged: bool = False,
                 page_rows: int = 0, min_queries: int = 1, local: bool = False, softcap: bool = False,
                 sinks: bool = False):
        """config: kernels/config.cache_prefill_config's (K5's tiles for a packed batch; with a box
        per page, the producer's registers for its copies). paged: the cache is (num_pages,
        page_size, heads_kv, d) with a block table, else (batch, capacity, heads_kv, d); page_rows:
        0 where a page holds whole key blocks, else the page size (one TMA box per page). The
        variants as K5's (varlen is implied)."""
        super().__init__(dtype, head_dim, causal, config, varlen=True, local=local, softcap=softcap,
                         sinks=sinks)
        assert page_rows == 0 or (paged and self.tile_n % page_rows == 0 and page_rows % 8 == 0), \
            f"pages of {page_rows} rows do not tile {self.tile_n}-key blocks"
        self.paged, self.page_rows = paged, page_rows
        self.query_lengths = (min_queries, NO_LIMIT)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, mBlockTable: cute.Tensor,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32, mSinks: cute.Tensor,
                 stream):
        """mQ/mO (1, total_q, heads, d) with the queries packed by mCuSeqlensQ (batch + 1,), mLSE
        (1, heads_q, total_q); mK/mV the cache (paged or dense, as the class says), mCacheSeqlens
        (batch,) the keys each entry holds, mBlockTable (batch, pages_per_seq) (a stand-in when
        dense). The rest as K5's."""
        self.launch(mQ, mK, mV, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCacheSeqlens, window_left, window_right, softcap_scale,
                    (mSinks if cutlass.const_expr(self.sinks) else None, mBlockTable), stream)

    def make_stage_loads(self, mQ, mK, mV):
        """K5's layouts; with small pages, K's and V's boxes are one page's rows of a stage."""
        sQ_layout, sKV_layout, sV_layout, loads = super().make_stage_loads(mQ, mK, mV)
        if cutlass.const_expr(self.page_rows > 0):
            rows = self.page_rows
            loads = (*loads[:2],
                     *tma.make_load_box(tma.seq_major(mK), self.page_slab(sKV_layout, self.head_dim),
                                        (rows, self.head_dim)),
                     *tma.make_load_box(tma.seq_major(mV), self.page_slab(sV_layout, self.head_dim_v),
                                        (rows, self.head_dim_v)))
        return sQ_layout, sKV_layout, sV_layout, loads

    def page_slab(self, staged, cols: int):
        """Stage 0's first page_rows rows of a (tile_n, cols, stages) layout: one page's box."""
        return cute.composition(staged, cute.make_layout((self.page_rows, cols), stride=(1, self.tile_n)))

    def page_slabs(self, sX: cute.Tensor, cols: int) -> cute.Tensor:
        """A (tile_n, cols, stages) ring seen as (page_rows, cols, (slab, stage)): slab i of a
        stage holds its rows [i * page_rows, (i + 1) * page_rows)."""
        slabs = self.tile_n // self.page_rows
        return cute.composition(sX, cute.make_layout(
            (self.page_rows, cols, (slabs, self.kv_stages)),
            stride=(1, self.tile_n, (self.page_rows, self.tile_n * cols))))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, mSinks: Optional[cute.Tensor],
               mBlockTable: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               epi_tile: cutlass.Constexpr, SharedStorage: cutlass.Constexpr):
        # mK: the TMA view (page_size, d, heads_kv, pages), or (capacity, d, heads_kv, batch) dense
        capacity = mK.shape[0]
        if cutlass.const_expr(self.paged):
            capacity = mBlockTable.shape[1] * mK.shape[0]
        cache = SimpleNamespace(seqlens=mCacheSeqlens, table=mBlockTable, capacity=capacity,
                                page_size=mK.shape[0], pages=mK.shape[3])
        self.roles(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2, mTileCounter,
                   mCuSeqlensQ, mCacheSeqlens, window_left, window_right, softcap_scale, mSinks, None,
                   sQ_layout, sKV_layout, sV_layout, sO_layout, epi_tile, SharedStorage, cache=cache)

    def entry_lengths(self, batch: Int32, params):
        """Entry `batch`: its packed queries, and its cache's first seqused_k[batch] keys."""
        return seqlen.from_cache_packed(params.cu_q, params.cache.seqlens, batch, Int32(0),
                                        params.cache.capacity, params.rows_q)

    def kv_source(self, tma_k, mK, tma_v, mV, sK, sV, head_kv: Int32, batch: Int32, seq, params):
        """One KV head's cache for produce_kv: its pages (or the entry's plane), the ring, the
        entry's keys and table row."""
        return SimpleNamespace(tma_k=tma_k, gK=mK[None, None, head_kv, None], tma_v=tma_v,
                               gV=mV[None, None, head_kv, None], sK=sK, sV=sV, batch=batch,
                               seqlen_k=seq.seqlen_k, cache=params.cache)

    @cute.jit
    def produce_kv(self, kv, k_pipe, k_state, v_pipe, v_state, n_block: Int32):
        """Key block n_block into the next K and V stages: one box of its page (or, dense, of the
        entry's plane), or a box per page."""
        cache = kv.cache
        if cutlass.const_expr(self.page_rows > 0):
            slabs = self.tile_n // self.page_rows
            # lane i reads slab i's table entry (past the sequence: its last page, whose rows are
            # masked or zeroed), lane 0 issues every box
            last_entry = (kv.seqlen_k - 1) // self.page_rows
            entry = cutlass.min(n_block * slabs + cutlass.min(cute.arch.lane_idx(), slabs - 1), last_entry)
            page = paged.page_of(cache.table, kv.batch, entry, cache.pages)
            k_state = self.produce_pages(k_pipe, k_state, kv.tma_k, kv.gK, kv.sK, self.head_dim, page)
            v_state = self.produce_pages(v_pipe, v_state, kv.tma_v, kv.gV, kv.sV, self.head_dim_v, page)
            return k_state, v_state
        plane, row_tile = kv.batch, n_block
        if cutlass.const_expr(self.paged):
            plane, row_tile = paged.block_page(cache.table, kv.batch, n_block, self.tile_n, cache.page_size,
                                               cache.pages)
        tKsK, tKgK = tma.partition(kv.tma_k, cute.local_tile(kv.gK[None, None, plane], (self.tile_n, self.head_dim),
                                                             (None, 0)), kv.sK)
        tVsV, tVgV = tma.partition(kv.tma_v, self.v_tiles(kv.gV[None, None, plane]), kv.sV)
        k_state = pipeline.produce(k_pipe, k_state, row_tile, [(kv.tma_k, tKgK, tKsK)])
        v_state = pipeline.produce(v_pipe, v_state, row_tile, [(kv.tma_v, tVgV, tVsV)])
        return k_state, v_state

    @cute.jit
    def produce_pages(self, pipe, state, atom, gX: cute.Tensor, sX: cute.Tensor, cols: cutlass.Constexpr,
                      page: Int32):
        """Stage state.index of one ring from tile_n / page_rows pages, lane i's `page` into slab
        i, every box on the stage's full barrier (the whole warp calls: the copy elects its lane).
        gX: one KV head's cache, (page_rows, cols, pages)."""
        pages = cute.local_tile(gX, (self.page_rows, cols), (0, 0, None))  # (page_rows, cols, pages)
        tXsX, tXgX = tma.partition(atom, pages, self.page_slabs(sX, cols))
        pipe.producer_acquire(state)
        for i in cutlass.range_constexpr(self.tile_n // self.page_rows):
            cute.copy(atom, tXgX[(None, cute.arch.shuffle_sync(page, i))], tXsX[(None, (i, state.index))],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
        pipe.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def before_mainloop(self, v_pipe, v_state, sV, ctidx: Int32, seq, n_max: Int32, n_blocks: Int32):
        """Zero the V rows of the first visited block that lie past the last key (tile-uniform:
        every consumer thread takes the branch or none), in 16-byte chunks shared by the consumer
        threads, then fence them for WGMMA and meet."""
        valid = seq.seqlen_k - (n_max - 1) * self.tile_n
        if n_blocks > 0 and valid < self.tile_n:
            pipeline.consume_wait(v_pipe, v_state)  # (the mainloop's own wait on it passes at once)
            stage = sV[None, None, v_state.index]
            chunks = self.head_dim_v // 8
            threads = 128 * self.consumer_wgs
            zeros = cute.make_rmem_tensor((8,), self.dtype)
            zeros.fill(0.0)
            for idx in cutlass.range(ctidx, (self.tile_n - valid) * chunks, threads, unroll=1):
                row, chunk = valid + idx // chunks, idx % chunks
                dst = cute.local_tile(stage[row, None], (8,), (chunk,))
                cute.autovec_copy(zeros, cute.make_tensor(dst.iterator.align(16), cute.make_layout(8)))
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, read by WGMMA
            dsl_pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER, num_threads=threads).arrive_and_wait()
