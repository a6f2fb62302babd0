"""S1: attention against a KV cache, with the key range split across CTAs (flash-decoding).

Decode has one (or a few) new query rows per sequence against thousands of cached keys: the work
is reading K and V once, at memory speed. Two ideas make that possible on 132 SMs:

* **Pack GQA.** The query heads that share a KV head (`group = heads_q // heads_kv`) times the
  query positions fill the M dimension of one Q tile: packed row R holds query position R // group
  of query head kv_head * group + R % group. Each K/V byte is then read once per KV head, not once
  per query head. Q is gathered into SMEM by plain loads (its rows are not one TMA box).
* **Split-KV.** When batch x heads_kv x Q tiles cannot fill the SMs, CTA `split` of `num_splits`
  takes an equal share of the key blocks and writes an FP32 partial O and its LSE; a combine kernel
  (`SplitKVCombine`, kernels/combine.py) merges the partials: LSE = log sum_i exp(lse_i),
  O = sum_i exp(lse_i - LSE) O_i.
  With one split the kernel writes O and LSE directly.
* **Sinks** (a compile-time variant): each query head's sink logit joins the row's denominator
  once: in the epilogue's softmax.finalize with one split, else in the combine, as one more
  partial with LSE = sink and O = 0.

Grid (num_splits, heads_kv * q_tiles, batch), one warpgroup per CTA (tile_m = 64; packed queries:
below). K/V tiles come
through K3's TMA ring (`kv_stages` deep, warp 0 refills a stage as soon as it is released); the
math is K4.2's (both GEMMs on WGMMA, softmax on the accumulator, P from registers). Key blocks are
visited from the last to the first, so the ragged and causal-diagonal blocks, the only ones masked,
come first.

The cache is dense, (batch, capacity, heads_kv, d), or paged, (num_pages, page_size, heads_kv, d)
with `block_table[b, i]` the page holding keys [i * page_size, (i + 1) * page_size) of entry b
(common/paged.py). Dense caches and pages of a multiple of tile_n are the same to the producer: a
key block lives in a (rows, d) plane at (row tile, kv head, plane), the plane being the batch entry
(dense) or the page (paged), one TMA box. Any other page size (1, 16, ...) compiles the `gather`
layout: every thread copies its share of the block's rows from their pages with cp.async into the
same swizzled stage, on a cp.async ring (the full barrier counts one arrival per thread); the
consumers fence the async proxy before WGMMA reads it. Sequence lengths come from `cache_seqlens`
(common/seqlen.py); causal masks align to the bottom right as everywhere in fa3.

Packed queries (`varlen`): q is one (total_q, heads_q, d) plane, entry b's queries at rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) (seqlen.from_cache_packed). The grid is (splits, heads_kv,
Q tiles): the Q tiles of every entry numbered in a row (entry b has ceil(len_b * group / tile_m)),
each CTA finding its entry from cu_seqlens_q with a warp scan (scheduler.varlen_tile, as k5's packed
batches), so a step of 100 decodes beside one 2k-token chunk launches about 230 tiles per KV head,
not 101 x the chunk's 128; the grid's bound (min(batch x tiles of max_seqlen_q, ceil(total_q x
group / tile_m) + batch)) leaves a few tiles with no rows, which return at once.

**Longest first.** When the CTAs take more than one wave of the SMs, the host passes `mOrder`, the
entries sorted by key count on the GPU (kernels/entry_order.py): entry tiles are numbered in that
order (packed) or the grid's batch index goes through it, so the longest entries start first and
the short ones fill the last wave (worklog/serving.md). O, LSE and
the partials are stored at the entry's rows, so one combine serves both layouts. A decode is an entry
of one query; a chunk of a prompt, a longer one: one launch serves a serving engine's whole step.
Where the host sends the long entries (long_queries or more queries) to K5 in the same call
(kernels/k5_cache.py, fa3/cache/prefill.py), `max_queries` gives them no tiles here.

**An FP8 cache** (`fp8`: k_cache and v_cache in float8_e4m3fn, with descales (batch, heads_kv)
FP32; q in e4m3 with its own descale, or in bf16 / fp16 with none: `query_dtype`) is S1 plus one
idea, dequantizing in SMEM. An FP8 cache halves the bytes a decode reads.
WGMMA's FP8 form wants V K-major (V^T), which a paged cache does not hold, so the warpgroup
dequantizes instead: each landed stage is converted into one 16-bit K and one 16-bit V tile (fp16:
every e4m3 value is exact there; cvt.rn.f16x2.e4m3x2 converts two at a time), the GEMMs read those,
and the stage is released as soon as it is converted. The conversions are laid beside the GEMMs,
per key block (`mainloop_fp8`):

    issue S = Q K^T -> convert V (under S) -> release the stage -> wait for S -> softmax ->
    issue P V -> wait for the next stage, convert its K (under P V) -> wait for P V

(no GEMM is in flight across the loop's back edge: ptxas serializes WGMMAs whose accumulators
are carried there, C7514), and the ring is short (`fp8_kv_stages`) so that two CTAs share an SM
up to d128, one's conversions running beside the other's GEMMs. Q is converted as it is
gathered: e4m3 exactly; bf16 or fp16 after a power of two per warp's 16 rows that brings their
largest |q| into [2^14, 2^15) (fp16 ends at 65504; exact for every element within 2^28 of that
largest: load_q_scaled), whose inverse joins the warp's score scale. q_descale (e4m3 q) x
k_descale of the CTA's KV head folds into the score scale (with softcap: into the tanh's),
v_descale into O's normalisation; the output is bf16 or fp16 (`out_dtype`).
Everything else is the 16-bit cache's: the split, packed GQA, pages and gathers, masks, sinks, the
combine. SMEM at d128: Q 16 KB, four 16 KB FP8 stages, the two 16 KB fp16 tiles.

Values no host check has seen (a CUDA graph replayed with new lengths or pages) cannot send a load
outside the cache: lengths are clamped to [0, capacity] (capacity: the dense cache's rows, or
pages_per_seq * page_size), so no block-table entry past a row's pages_per_seq is read, and each
page index read is clamped to [0, num_pages). Both bounds come from the tensors' (dynamic) shapes.
"""

from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp as warp_mma, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from .common import fp8_mma_sync, mask, mma, paged, pipeline, scheduler, seqlen, smem, softmax, tma
from .config import DecodeConfig

CONVERT_ELEMS = 8  # elements one thread dequantizes at a time (FP8 cache): 8 bytes of e4m3 in, 16 bytes out
WARPS = DecodeConfig.WARPS  # the CTA's warps; S2 (warp_split): each takes tile_n / WARPS keys of every block


@dsl_user_op
def float_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of an FP32 value, as an Int32."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_float(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The FP32 value of a bit pattern."""
    return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def rows_cols_sm80(acc: cute.Tensor) -> cute.Tensor:
    """An m16n8 accumulator (4, MMA_M, MMA_N) seen as (rows, cols) of this thread: value v is row
    v // 2 (of g and g + 8), column v % 2 (of 2t and 2t + 1): ((2, MMA_M), (2, MMA_N))."""
    shape = acc.layout.shape
    stride = cute.make_layout(shape).stride
    mn = cute.make_layout(((2, shape[1]), (2, shape[2])), stride=((2, stride[1]), (1, stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_a_sm80(p: cute.Tensor) -> cute.Tensor:
    """The same registers as the A operand of a following m16n8k16: two m16n8 accumulators side by
    side are one m16k16 A fragment: (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2)."""
    shape = p.layout.shape
    stride = cute.make_layout(shape).stride
    frg = cute.make_layout(((4, 2), shape[1], shape[2] // 2),
                           stride=((1, stride[2]), stride[1], 2 * stride[2]))
    return cute.make_tensor(p.iterator, cute.composition(p.layout, frg))


class SplitKVAttention:
    # a combine launched behind this kernel as its programmatic dependent (kernels/combine.py,
    # _WithCombine): every CTA lets it launch as it starts
    launches_dependents = False

    def __init__(self, dtype, head_dim: int, causal: bool, config: DecodeConfig, paged: bool = False,
                 local: bool = False, softcap: bool = False, gather: bool = False, varlen: bool = False,
                 leftpad: bool = False, sinks: bool = False, out_dtype=None, max_queries: int = 0,
                 fp8: bool = False, query_dtype=None, page_rows: int = 0):
        """config: kernels/config.decode_config's (tiles, and the SMEM plan: kv_stages and
        planned_smem_bytes, by which fa3.cache.split_plan counts CTAs an SM); SharedStorage may not outgrow
        planned_smem_bytes.
        max_queries (varlen; 0: none): only entries of fewer queries get tiles, the others being
        K5's in the same call (kernels/k5_cache.py). fp8: the cache in e4m3, `dtype` the 16-bit
        type it is dequantized to (fp16); q in query_dtype: e4m3 (None) with q_descale, or bf16 /
        fp16 with none (load_q_scaled). page_rows: the page size where a variant is compiled for
        it (16: S2's FP8 page-a-warp gather, `warp_pages`); 0 or any other: row gathers of any size."""
        self.dtype, self.head_dim, self.causal, self.paged = dtype, head_dim, causal, paged
        # fp8: the cache (and q, unless query_dtype is 16-bit) in e4m3, dequantized in SMEM to
        # `dtype` (fp16), the GEMMs' type
        self.fp8 = fp8
        self.cache_dtype = cutlass.Float8E4M3FN if fp8 else dtype
        # S1 converts each FP8 stage into 16-bit SMEM tiles for WGMMA; S2 converts in registers
        self.converts_in_smem = fp8 and not config.warp_split
        # 16-bit q over an FP8 cache: scaled by a power of two into fp16's range as it is gathered
        self.scales_q = fp8 and query_dtype is not None and query_dtype.width == 16
        self.out_dtype = out_dtype or dtype
        # a sliding window (mask.py), capped scores, attention sinks (softmax.finalize)
        self.local, self.softcap, self.sinks = local, softcap, sinks
        # pages that do not hold whole key blocks: cp.async row gathers (common/paged.py)
        self.gather = paged and gather
        # queries packed by cu_seqlens_q (total_q, heads_q, d), keys from the cache
        self.varlen = varlen
        self.query_lengths = (0, max_queries) if varlen and max_queries else None
        # a left-padded dense cache: entry b's keys start at row cache_leftpad[b] (flash-attn's)
        self.leftpad = leftpad and not paged
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_threads = 128  # one warpgroup: tile_m = 64 rows (S2: four warps on 16 rows)
        # S2: the keys of each block split across the warps, mma.sync on 16 query rows, a partial a warp
        self.warp_split = config.warp_split
        self.partials_per_cta = config.partials_per_cta
        self.warp_keys = self.tile_n // WARPS
        assert not self.warp_split or (self.tile_m == 16 and head_dim in (64, 128)), \
            "S2 runs 16-row Q tiles at head dims 64 and 128 (d256's fragments spill)"
        # S2 over an FP8 cache in pages of a warp's keys (16): each warp gathers its own page of each
        # block into its own rows of the stage and reads only those, so its ring needs no mbarrier
        # and no other warp: its own cp.async groups (mainloop_pages)
        self.warp_pages = self.gather and fp8 and self.warp_split and page_rows == self.warp_keys
        # the ring: as deep as SMEM allows, shorter for gathers and FP8 caches so that CTAs share an
        # SM (one's copies or conversions beside another's GEMMs): config.decode_config's plan
        self.kv_stages, self.planned_smem_bytes = config.kv_stages, config.planned_smem_bytes

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCacheSeqlens: cute.Tensor,
                 mBlockTable: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor,
                 mLSEacc: cute.Tensor, scale_log2: Float32, appended: Int32, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mCuSeqlensQ: Optional[cute.Tensor],
                 max_seqlen_q: Int32, mLeftpad: Optional[cute.Tensor], mOrder: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mQDescale: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
                 mVDescale: Optional[cute.Tensor], stream):
        """mQ (batch, seqlen_q, heads_q, d); mK/mV the cache; mO/mLSE the result when there is one
        split, else mOacc (splits, batch, seqlen_q, heads_q, d) and mLSEacc (splits, batch,
        heads_q, seqlen_q) in FP32: the number of splits is mOacc.shape[0]. The window edges,
        softcap_scale and mSinks (heads_q,) are read only by the variants that use them. Varlen:
        batch 1, the queries of entry b at rows [cu[b], cu[b + 1]) of mCuSeqlensQ (batch + 1,),
        max_seqlen_q their longest (it sizes the grid); otherwise both are unread. mLeftpad (batch,):
        where each entry's keys start in a dense cache (the leftpad variant; unread otherwise).
        mOrder (batch,) int64: the entries longest first (kernels/entry_order.py), or a 1-element
        stand-in for the entries in their own order. mQ/mK/mVDescale (batch, heads_kv) FP32: the
        FP8 descales. What the variant does not read is None (the block table of a dense cache,
        cu_seqlens_q of (batch, seqlen_q) queries, mLeftpad, mSinks, the descales it has not)."""
        batch, seqlen_q, heads_q, _ = mQ.shape
        heads_kv = mK.shape[2]
        group = heads_q // heads_kv
        q_tiles = cute.ceil_div(seqlen_q * group, self.tile_m)
        grid = [mOacc.shape[0] // self.partials_per_cta, heads_kv * q_tiles, batch]
        if cutlass.const_expr(self.varlen):
            # every entry's Q tiles in a row, per KV head: sum_b ceil(len_b * group / tile_m) is at most
            # ceil(total_q * group / tile_m) + batch, and at most batch tiles of the longest entry
            batch = mCuSeqlensQ.shape[0] - 1
            tiles = cutlass.min(batch * cute.ceil_div(max_seqlen_q * group, self.tile_m),
                                cute.ceil_div(seqlen_q * group, self.tile_m) + batch)
            # KV heads inside tiles: with mOrder, the CTAs launched first are the longest entry's
            grid = [mOacc.shape[0] // self.partials_per_cta, heads_kv, cutlass.max(tiles, 1)]
        sQ_layout = smem.tile_layout(self.dtype, self.tile_m, self.head_dim)
        sKV_layout = smem.tile_layout(self.cache_dtype, self.tile_n, self.head_dim, self.kv_stages)
        sKV16_layout = smem.tile_layout(self.dtype, self.tile_n, self.head_dim)  # fp8: the converted tiles
        tile_kv = (self.tile_n, self.head_dim)
        if cutlass.const_expr(self.gather):  # cp.async reads the cache itself: (rows, d, heads, pages)
            tma_k, tK, tma_v, tV = None, tma.seq_major(mK), None, tma.seq_major(mV)
        else:  # (a page smaller than the box could not even describe it)
            tma_k, tK = tma.make_load(tma.seq_major(mK), sKV_layout, tile_kv)
            tma_v, tV = tma.make_load(tma.seq_major(mV), sKV_layout, tile_kv)

        SharedStorage = self.shared_storage(sQ_layout, sKV_layout, sKV16_layout)
        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"S1 with kv_stages={self.kv_stages}, tile_n={self.tile_n}, d={self.head_dim}")
        # what fa3.cache.split_plan counts: two CTAs an SM must still fit
        smem.check_plan(SharedStorage.size_in_bytes(), self.planned_smem_bytes, "S1")
        self.kernel(mQ, tma_k, tK, tma_v, tV, mCacheSeqlens, mBlockTable, mO, mLSE, mOacc, mLSEacc,
                    scale_log2, appended, window_left, window_right, softcap_scale, mCuSeqlensQ,
                    mLeftpad, mOrder, mSinks, (mQDescale, mKDescale, mVDescale), sQ_layout, sKV_layout,
                    sKV16_layout, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    def shared_storage(self, sQ_layout, sKV_layout, sKV16_layout):
        """The SMEM struct: barriers, Q and the K/V ring; with an FP8 cache (S1), beside it the
        16-bit K and V tiles the GEMMs read (sKV16_layout; only there: every byte counts when two
        CTAs share an SM). S2 converts an FP8 cache in registers: the ring alone."""
        @cute.struct
        class RingStorage:
            kv_barriers: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.cache_dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.cache_dtype, cute.cosize(sKV_layout)], 1024]

        if not self.converts_in_smem:
            return RingStorage

        @cute.struct
        class Fp8Storage:
            ring: RingStorage
            sK16: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV16_layout)], 1024]
            sV16: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV16_layout)], 1024]
        return Fp8Storage

    def ring_storage(self, storage):
        """The struct's barriers, Q and ring."""
        return storage.ring if self.converts_in_smem else storage

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_k: Optional[cute.CopyAtom], mK: cute.Tensor,
               tma_v: Optional[cute.CopyAtom],
               mV: cute.Tensor, mCacheSeqlens: cute.Tensor, mBlockTable: Optional[cute.Tensor], mO: cute.Tensor,
               mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor, scale_log2: Float32,
               appended: Int32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: Optional[cute.Tensor], mLeftpad: Optional[cute.Tensor], mOrder: cute.Tensor,
               mSinks: Optional[cute.Tensor],
               descales,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sKV16_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        if cutlass.const_expr(self.launches_dependents):
            cute.arch.griddepcontrol_launch_dependents()  # (the combine waits for this grid's end)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_splits = mOacc.shape[0] // self.partials_per_cta  # (the key ranges; S2: WARPS partials each)
        heads_q, heads_kv = mQ.shape[2], mK.shape[2]  # mK: (rows, d, heads, planes)
        group = heads_q // heads_kv
        capacity = mK.shape[0]
        if cutlass.const_expr(self.paged):
            capacity = mBlockTable.shape[1] * mK.shape[0]
        if cutlass.const_expr(self.varlen):
            # grid (splits, heads_kv, Q tiles of every entry in a row): each warp finds its tile's
            # entry from cu_seqlens_q (common/scheduler.py); a tile past the last holds no rows
            split, head_kv, tile = cute.arch.block_idx()
            batch, m_block, entry_tiles = scheduler.varlen_tile(tile, mCuSeqlensQ, self.tile_m, mQ.shape[1],
                                                                group, self.query_lengths, mOrder)
            # queries at rows offset_q.. of the one packed plane
            seq = seqlen.from_cache_packed(mCuSeqlensQ, mCacheSeqlens, batch, appended, capacity,
                                           mQ.shape[1])
            # a tile past the last entry's (the grid is sized for graph replay) names entry 0 with no
            # tiles: it must own no rows, or its empty partials would race the real tile's stores
            seq.seqlen_q = cutlass.min(seq.seqlen_q, entry_tiles * self.tile_m)
        else:
            split, head_tile, batch = cute.arch.block_idx()
            if mOrder.shape[0] == cute.arch.grid_dim()[2]:  # the longest entries first
                batch = Int32(mOrder[batch])
            q_tiles = cute.arch.grid_dim()[1] // heads_kv
            head_kv, m_block = head_tile // q_tiles, head_tile % q_tiles
            seq = seqlen.from_cache(mCacheSeqlens, batch, mQ.shape[1], appended, capacity,
                                    mLeftpad if cutlass.const_expr(self.leftpad) else None)
        # a tile past the last entry's (the grid is sized for graph replay, and its last CTAs run
        # in the tail) returns at once: no barriers, no loads, no rows
        has_work = True
        if cutlass.const_expr(self.varlen):
            has_work = entry_tiles > 0
        if has_work:
            q_plane = 0 if cutlass.const_expr(self.varlen) else batch
            if cutlass.const_expr(not self.gather):
                if warp_idx == 0:
                    tma.prefetch(tma_k, tma_v)

            whole = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            storage = self.ring_storage(whole)
            if cutlass.const_expr(self.warp_pages):
                kv_pipe = None  # each warp's cp.async groups, no barriers
            elif cutlass.const_expr(self.gather):
                kv_pipe = pipeline.create_gather(storage.kv_barriers.data_ptr(), self.kv_stages,
                                                 self.num_threads)
            else:
                kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), self.kv_stages, 4,
                                          2 * smem.stage_bytes(self.cache_dtype, sKV_layout))
            pipeline.init_done()
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)[None, None, 0]
            sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
            sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

            window = (window_left, window_right) if cutlass.const_expr(self.local) else None
            scale_log2, softcap_scale, o_scale = self.fold_descales(descales, batch, head_kv, scale_log2, softcap_scale)
            # this split's share of the key blocks the tile sees (none when the tile holds no query)
            n_blocks, last = scheduler.split_kv_range(m_block, self.tile_m, self.tile_n, seq, self.causal, group,
                                                      window, split, num_splits)  # (last: visited first)

            kv_producer = pipeline.producer_state(self.kv_stages)
            loads = (kv_pipe, tma_k, mK, tma_v, mV, sK, sV, mBlockTable, head_kv, batch, seq, tidx)
            if cutlass.const_expr(self.warp_pages):  # this warp's page of the first blocks, a group a stage
                if n_blocks > 0:  # (a key, so a page of the table's to read: not past a 0-wide table)
                    for s in cutlass.range_constexpr(self.kv_stages):
                        has_page, page = self.warp_page(mBlockTable, batch, last - s, s < n_blocks, seq, warp_idx,
                                                        mK.shape[3])
                        self.copy_page(has_page, page, s, mK, mV, sK, sV, head_kv, warp_idx, tidx % 32)
                        cute.arch.cp_async_commit_group()
            elif self.is_kv_producer(warp_idx):
                for _ in cutlass.range(cutlass.min(self.kv_stages, n_blocks), unroll=1):
                    kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
            if cutlass.const_expr(self.scales_q):
                q_unscale = Float32(1.0)
                if n_blocks > 0:
                    q_unscale = self.load_q_scaled(mQ, sQ, tidx, m_block, head_kv, group, q_plane, seq)
                scale_log2, softcap_scale = self.fold_query_scale(q_unscale, scale_log2, softcap_scale)
            else:
                if n_blocks > 0:  # (CTA-uniform: the gather syncs the CTA)
                    self.load_q(mQ, sQ, tidx, m_block, head_kv, group, q_plane, seq)

            row0 = m_block * self.tile_m
            blocks = (n_blocks, last, m_block, group, seq, scale_log2, window, softcap_scale)
            ctx, kv_producer = self.attend(whole, sQ, sKV_layout, sKV16_layout, kv_pipe, kv_producer, loads, warp_idx,
                                           blocks)
            if cutlass.const_expr(not self.warp_pages):  # (warp_pages: every group issued was waited for)
                if self.is_kv_producer(warp_idx):
                    pipeline.tail(kv_pipe, kv_producer)
            part, parts = split, num_splits  # (S2: this warp's partial of this split, always combined)
            if cutlass.const_expr(self.warp_split):
                part, parts = split * WARPS + warp_idx, mOacc.shape[0]
            self.store(ctx, mO, mLSE, mOacc, mLSEacc, mSinks, part, parts, row0, head_kv, group,
                       q_plane, seq, scale_log2, o_scale)

    def fold_descales(self, descales, batch: Int32, head_kv: Int32, scale_log2: Float32,
                      softcap_scale: Float32):
        """(scale_log2, softcap_scale, O's scale): 16-bit caches have no descales; an FP8 cache's
        (one sequence, one KV head a CTA): q x k into the score scale (with softcap: the tanh's), v
        into O's. 16-bit q has no q_descale (its stand-in is not read)."""
        if not self.fp8:
            return scale_log2, softcap_scale, Float32(1.0)
        q_descale, k_descale, v_descale = descales
        if self.scales_q:
            qk_descale = k_descale[batch, head_kv]
        else:
            qk_descale = q_descale[batch, head_kv] * k_descale[batch, head_kv]
        if self.softcap:
            softcap_scale = softcap_scale * qk_descale
        else:
            scale_log2 = scale_log2 * qk_descale
        return scale_log2, softcap_scale, v_descale[batch, head_kv]

    def fold_query_scale(self, q_unscale: Float32, scale_log2: Float32, softcap_scale: Float32):
        """(scale_log2, softcap_scale) with load_q_scaled's 2^-k folded in where q's descale goes."""
        if self.softcap:
            return scale_log2, softcap_scale * q_unscale
        return scale_log2 * q_unscale, softcap_scale

    @cute.jit
    def attend(self, storage, sQ, sKV_layout, sKV16_layout, kv_pipe, kv_producer, loads, warp_idx: Int32, blocks):
        """The GEMMs' fragments over sQ and the ring (an FP8 cache: S1 over the converted tiles, S2
        from the ring's bytes, converted in registers), then the mainloop: (ctx, producer state)."""
        _, _, _, _, _, sK, sV, _, _, _, _, tidx = loads  # (load_kv's arguments)
        if cutlass.const_expr(self.warp_split):
            ctx = self.warp_setup(sQ, tidx)
            if cutlass.const_expr(self.fp8):  # ldmatrix reads V by byte address
                ctx.v_base, ctx.sKV_layout = self.ring_storage(storage).sV.data_ptr().toint(), sKV_layout
            if cutlass.const_expr(self.warp_pages):
                self.mainloop_pages(ctx, loads, warp_idx, *blocks)
            else:
                kv_producer = self.mainloop_warps(ctx, kv_pipe, kv_producer, loads, warp_idx, *blocks)
        elif cutlass.const_expr(self.fp8):
            sK16 = storage.sK16.get_tensor(sKV16_layout.outer, swizzle=sKV16_layout.inner)
            sV16 = storage.sV16.get_tensor(sKV16_layout.outer, swizzle=sKV16_layout.inner)
            ctx = self.compute_setup(sQ, sK16, sV16, tidx)
            kv_producer = self.mainloop_fp8(ctx, kv_pipe, kv_producer, loads, warp_idx, sK16, sV16, *blocks)
        else:
            ctx = self.compute_setup(sQ, sK, sV, tidx)
            kv_producer = self.mainloop(ctx, kv_pipe, kv_producer, loads, warp_idx, *blocks)
        return ctx, kv_producer

    @cute.jit
    def mainloop(self, ctx, kv_pipe, kv_producer, loads, warp_idx: Int32, n_blocks: Int32, last: Int32,
                 m_block: Int32, group: Int32, seq, scale_log2: Float32, window, softcap_scale: Float32):
        """Key blocks last, last - 1, ... (n_blocks of them) from the ring: each stage's GEMMs and
        softmax, then the stage refilled. Returns the producer state (for pipeline.tail)."""
        _, _, _, _, _, _, sV, _, _, _, _, tidx = loads  # (load_kv's arguments)
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            pipeline.consume_wait(kv_pipe, kv_consumer)
            if cutlass.const_expr(self.gather):  # cp.async wrote the stage (generic proxy): WGMMA reads it
                cute.arch.fence_proxy("async.shared", space="cta")
            self.zero_rows_past_end(sV[None, None, kv_consumer.index], seq.seqlen_k - n_block * self.tile_n, tidx)
            self.compute_tile(ctx, kv_consumer.index, m_block, n_block, group, seq, scale_log2, window,
                              softcap_scale)
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)
            if self.is_kv_producer(warp_idx) and kv_producer.count < n_blocks:  # refill the stage just freed
                kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
        return kv_producer

    # ---------------------------------------------------------------- an FP8 cache: dequantized in SMEM
    @cute.jit
    def mainloop_fp8(self, ctx, kv_pipe, kv_producer, loads, warp_idx: Int32, sK16: cute.Tensor,
                     sV16: cute.Tensor, n_blocks: Int32, last: Int32, m_block: Int32, group: Int32, seq,
                     scale_log2: Float32, window, softcap_scale: Float32):
        """mainloop on an FP8 cache: each stage converted into sK16/sV16, the conversions under the
        GEMMs (the module's docstring has the order)."""
        _, _, _, _, _, sK, sV, _, _, _, _, tidx = loads  # (load_kv's arguments)
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        if n_blocks > 0:  # the first block's K
            pipeline.consume_wait(kv_pipe, kv_consumer)
            self.convert_k(sK, sK16, kv_consumer.index, tidx)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            acc_s = self.scores(ctx, 0, wait=-1)  # S under V's conversion
            self.dequantize(sV[None, None, kv_consumer.index], sV16[None, None, 0], tidx,
                            seq.seqlen_k - n_block * self.tile_n, self.tile_n, self.num_threads)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, read by WGMMA
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)  # refilled while the GEMMs run
            if self.is_kv_producer(warp_idx) and kv_producer.count < n_blocks:
                kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
            warpgroup.wait_group(0)
            p = self.softmax_step(ctx, acc_s, m_block, n_block, group, seq, scale_log2, window, softcap_scale)
            cute.arch.sync_threads()  # every thread's share of sV16 written, every warp's S done
            self.accumulate(ctx, p, 0, wait=-1)  # P V under the next K's conversion
            if j + 1 < n_blocks:
                pipeline.consume_wait(kv_pipe, kv_consumer)
                self.convert_k(sK, sK16, kv_consumer.index, tidx)
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp's P V done: sV16 is free
        return kv_producer

    @cute.jit
    def convert_k(self, sK: cute.Tensor, sK16: cute.Tensor, stage: Int32, tidx: Int32):
        """The landed K tile of `stage` into sK16, visible to every warp's WGMMA when this returns
        (sK16 must be free: the last S done by every warp)."""
        self.dequantize(sK[None, None, stage], sK16[None, None, 0], tidx, self.tile_n, self.tile_n, self.num_threads)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

    @cute.jit
    def dequantize(self, src: cute.Tensor, dst: cute.Tensor, tidx: Int32, valid_rows: Int32,
                   rows: cutlass.Constexpr, threads: cutlass.Constexpr):
        """FP8 rows -> the 16-bit rows the GEMMs read (both (rows, d), swizzled; S1: rows = tile_n),
        by `threads` threads (S1: the CTA's; tidx: the thread's index among them; S2 converts in
        registers instead, common/fp8_mma_sync.py): each converts 8-element chunks (an 8-byte load,
        four cvt.rn.f16x2.e4m3x2, a 16-byte store), by rows; rows from valid_rows on are written as
        zeros (V: a cache's unused rows hold anything, NaN included, and 0 * NaN = NaN; K passes all)."""
        chunks = self.head_dim // CONVERT_ELEMS  # per row
        rows_per_pass, active = smem.row_passes(rows, chunks, threads)
        thread_layout = cute.make_ordered_layout((rows_per_pass, chunks), order=(1, 0))
        values = cute.make_layout((1, CONVERT_ELEMS))
        load, store = (cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=CONVERT_ELEMS * dtype.width),
            thread_layout, values) for dtype in (self.cache_dtype, self.dtype))
        tSsrc = load.get_slice(tidx % active).partition_S(src)
        tDdst = store.get_slice(tidx % active).partition_D(dst)
        if tidx < active:
            for i in cutlass.range_constexpr(rows // rows_per_pass):
                narrow = cute.make_rmem_tensor_like(tSsrc[None, i, 0])
                cute.copy(load, tSsrc[None, i, 0], narrow)
                wide = cute.make_rmem_tensor_like(tDdst[None, i, 0])
                wide.store(narrow.load().to(self.dtype))
                if tidx // chunks + i * rows_per_pass >= valid_rows:
                    wide.fill(0.0)
                cute.copy(store, wide, tDdst[None, i, 0])

    def is_kv_producer(self, warp_idx):
        """Warp 0 issues the TMA loads; every thread takes its share of a gather."""
        return True if cutlass.const_expr(self.gather) else warp_idx == 0

    # ---------------------------------------------------------------- loads
    @cute.jit
    def load_kv(self, state, n_block: Int32, kv_pipe, tma_k, mK, tma_v, mV, sK, sV, mBlockTable,
                head_kv: Int32, batch: Int32, seq, tidx: Int32):
        """Key block n_block of this entry into the next stage: one TMA box per tensor at (row
        tile, head, plane) of the dense cache (plane = batch entry; left-padded: rows from
        seq.offset_k) or the paged one (plane = its page), or (gather) cp.async copies of the
        block's rows from their pages."""
        if cutlass.const_expr(self.gather):
            gather = paged.RowGather(self.cache_dtype, self.tile_n, self.head_dim, self.num_threads)
            rows = gather.locate(tidx, mBlockTable, batch, n_block, seq.seqlen_k, mK.shape[0], mK.shape[3])
            copies = lambda stage: gather.copy(tidx, rows, [
                (mK[None, None, head_kv, None], sK[None, None, stage]),
                (mV[None, None, head_kv, None], sV[None, None, stage])])
            return pipeline.produce_copies(kv_pipe, state, copies)
        plane, row_tile = batch, n_block
        if cutlass.const_expr(self.paged):
            plane, row_tile = paged.block_page(mBlockTable, batch, n_block, self.tile_n, mK.shape[0],
                                               mK.shape[3])
        tile_kv = (self.tile_n, self.head_dim)
        gK, gV = mK[None, None, head_kv, plane], mV[None, None, head_kv, plane]
        if cutlass.const_expr(self.leftpad):  # TMA boxes start at any row
            gK, gV = cute.domain_offset((seq.offset_k, 0), gK), cute.domain_offset((seq.offset_k, 0), gV)
        tKsK, tKgK = tma.partition(tma_k, cute.local_tile(gK, tile_kv, (None, 0)), sK)
        tVsV, tVgV = tma.partition(tma_v, cute.local_tile(gV, tile_kv, (None, 0)), sV)
        return pipeline.produce(kv_pipe, state, row_tile, [(tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)])

    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, tidx: Int32, m_block: Int32, head_kv: Int32,
               group: Int32, q_plane: Int32, seq):
        """Gather the packed Q tile into SMEM: 8-element chunks, rows past the queries zeroed."""
        chunks_per_row = self.head_dim // 8
        for i in cutlass.range_constexpr(self.tile_m * chunks_per_row // self.num_threads):
            chunk = tidx + i * self.num_threads
            r, c = chunk // chunks_per_row, chunk % chunks_per_row * 8
            packed = m_block * self.tile_m + r
            query, head = packed // group, head_kv * group + packed % group
            valid = query < seq.seqlen_q
            query = cutlass.min(query, seq.seqlen_q - 1)  # a row that exists: loaded, then zeroed
            for e in cutlass.range_constexpr(8):
                x = mQ[q_plane, seq.offset_q + query, head, c + e].to(self.dtype)  # (fp8: exact in fp16)
                sQ[r, c + e] = x if valid else x.dtype(0.0)
        # generic-proxy writes, read by WGMMA through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

    @cute.jit
    def load_q_scaled(self, mQ: cute.Tensor, sQ: cute.Tensor, tidx: Int32, m_block: Int32, head_kv: Int32,
                      group: Int32, q_plane: Int32, seq) -> Float32:
        """load_q for bf16 / fp16 q over an FP8 cache, whose GEMMs are fp16: warp w gathers the 16
        rows its WGMMA accumulators hold (16w .. 16w + 15) and multiplies them by 2^k, k chosen from
        their largest |q| (a, in FP32) so that a 2^k lies in [2^14, 2^15), fp16 reaching 65504
        (k >= -113 for bf16's largest; k is at most 24, and 0 when a is inf). The products are
        exact, and so is their conversion to fp16 for every element of at least a 2^-28 (bf16 and
        fp16 carry at most 11 significant bits); smaller ones round to fp16's subnormals, an error
        of at most a 2^-39. Returns 2^-k, folded into this warp's score scale (fold_query_scale).
        Rows past the queries are zeros."""
        rows_per_warp = 16  # a warp's rows of the m64 WGMMA accumulator
        chunks_per_row = self.head_dim // 8
        warp, lane = tidx // 32, tidx % 32
        if cutlass.const_expr(self.warp_split):  # S2: every warp reads the tile's 16 rows (one scale), warp 0 stores
            warp = 0
        values = []  # this lane's chunks in FP32, kept until the warp's scale is known
        largest = Float32(0.0)
        for i in cutlass.range_constexpr(rows_per_warp * chunks_per_row // 32):
            chunk = lane + i * 32
            r = warp * rows_per_warp + chunk // chunks_per_row
            packed = m_block * self.tile_m + r
            query, head = packed // group, head_kv * group + packed % group
            valid = query < seq.seqlen_q
            query = cutlass.min(query, seq.seqlen_q - 1)  # a row that exists: loaded, then zeroed
            for e in cutlass.range_constexpr(8):
                x = mQ[q_plane, seq.offset_q + query, head, chunk % chunks_per_row * 8 + e].to(Float32)
                x = x if valid else Float32(0.0)
                largest = cute.arch.fmax(largest, cute.arch.fmax(x, -x))
                values.append(x)
        largest = cute.arch.warp_reduction_max(largest, threads_in_group=32)
        exponent = (float_bits(largest) >> 23) & 0xFF  # biased; 255: inf (fmax drops NaN)
        shift = cutlass.min(Int32(141) - exponent, Int32(24))  # 141 = 127 + 14
        if exponent == 255:
            shift = Int32(0)
        scale = bits_float((Int32(127) + shift) << 23)
        for i in cutlass.range_constexpr(rows_per_warp * chunks_per_row // 32):
            chunk = lane + i * 32
            r, c = warp * rows_per_warp + chunk // chunks_per_row, chunk % chunks_per_row * 8
            if cutlass.const_expr(self.warp_split):
                if tidx < 32:
                    for e in cutlass.range_constexpr(8):
                        sQ[r, c + e] = (values[i * 8 + e] * scale).to(self.dtype)
            else:
                for e in cutlass.range_constexpr(8):
                    sQ[r, c + e] = (values[i * 8 + e] * scale).to(self.dtype)
        # generic-proxy writes, read by WGMMA through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        return bits_float((Int32(127) - shift) << 23)

    @cute.jit
    def zero_rows_past_end(self, sV_stage: cute.Tensor, valid_rows: Int32, tidx: Int32):
        """Zero the V rows of a ragged last block that lie past the sequence. A cache's unused rows
        are whatever memory held (NaN bit patterns included; a gather leaves them as the stage
        held them) and P = 0 there does not help: 0 * NaN = NaN. K needs nothing: masking selects
        -inf over any score."""
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
        acc_s = self.scores(ctx, stage, wait=0)
        p = self.softmax_step(ctx, acc_s, m_block, n_block, group, seq, scale_log2, window, softcap_scale)
        self.accumulate(ctx, p, stage, wait=0)

    @cute.jit
    def scores(self, ctx, stage, wait: cutlass.Constexpr[int]):
        """S = Q K^T of the K tile at `stage` (issued; waited for as mma.gemm's `wait` says)."""
        acc_s = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(ctx.qk, acc_s, ctx.tSrQ, ctx.tSrK[None, None, None, stage], zero_init=True, wait=wait)
        return acc_s

    @cute.jit
    def softmax_step(self, ctx, acc_s, m_block: Int32, n_block: Int32, group: Int32, seq,
                     scale_log2: Float32, window, softcap_scale: Float32):
        """Cap and mask S, update the running max and sum, rescale O; returns P in the GEMM type."""
        s_mn = mma.rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, softcap_scale)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                self.causal, rows_per_query=group, window=window):
            mask.apply(s_mn, ctx.s_coords, m_block * self.tile_m, n_block * self.tile_n, seq.seqlen_q,
                       seq.seqlen_k, self.causal, rows_per_query=group, window=window)
        softmax.rescale(mma.rows_cols(ctx.acc_o),
                        softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4))
        return mma.to_dtype(acc_s, self.dtype)

    @cute.jit
    def accumulate(self, ctx, p, stage, wait: cutlass.Constexpr[int]):
        """O += P V of the V tile at `stage`."""
        mma.gemm(ctx.pv, ctx.acc_o, mma.as_a_operand(p), ctx.tOrVt[None, None, None, stage], wait=wait)

    # ---------------------------------------------------------------- S2: the keys split across the warps
    def warp_setup(self, sQ, tidx):
        """Each warp's mma.sync (m16n8k16) for S = Q K_w^T and O_w += P V_w on its own 16 keys of every
        block, Q's fragment loaded once from SMEM (ldmatrix; an FP8 cache: in the d order its K
        fragments are converted in, fp8_mma_sync's quarter_d), O_w and the row state in registers
        (an FP8 cache: O's columns in fp8_mma_sync's paired_d order)."""
        lane = tidx % 32
        atom = warp_mma.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16))
        qk = cute.make_tiled_mma(atom, (1, 1, 1), permutation_mnk=(16, 16, 16))
        pv = cute.make_tiled_mma(atom, (1, 1, 1), permutation_mnk=(16, 16, 16))
        thr_qk, thr_pv = qk.get_slice(lane), pv.get_slice(lane)
        load = cute.make_copy_atom(warp_mma.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        load_t = cute.make_copy_atom(warp_mma.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        copy_q = cute.make_tiled_copy_A(load, qk).get_slice(lane)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        o_columns = cute.make_identity_tensor((self.tile_m, self.head_dim))
        if cutlass.const_expr(self.fp8):
            fp8_mma_sync.q_operand(sQ, lane, tSrQ)
            o_columns = fp8_mma_sync.paired_d_columns(self.tile_m, self.head_dim)
        else:
            cute.copy(copy_q, copy_q.partition_S(sQ), copy_q.retile(tSrQ))
        ctx = SimpleNamespace(
            qk=qk, thr_qk=thr_qk, pv=pv, thr_pv=thr_pv, tidx=tidx, tSrQ=tSrQ,
            copy_k=cute.make_tiled_copy_B(load, qk).get_slice(lane),
            copy_v=cute.make_tiled_copy_B(load_t, pv).get_slice(lane),
            s_coords=rows_cols_sm80(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.warp_keys)))),
            acc_o=cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32),
            o_coords=rows_cols_sm80(thr_pv.partition_C(o_columns)))
        ctx.acc_o.fill(0.0)
        ctx.row_max, ctx.row_sum = softmax.row_state(cute.size(ctx.s_coords, mode=[0]))
        return ctx

    @cute.jit
    def mainloop_warps(self, ctx, kv_pipe, kv_producer, loads, warp_idx: Int32, n_blocks: Int32,
                       last: Int32, m_block: Int32, group: Int32, seq, scale_log2: Float32, window,
                       softcap_scale: Float32):
        """S2's mainloop: every warp waits for each block, takes its keys warp_keys x warp ..,
        multiplies them on mma.sync and updates its own row state; the stage is released by each
        warp after its P V (16-bit), or (an FP8 cache) as soon as its K and V bytes are in
        registers, converted there (common/fp8_mma_sync.py), and refilled. No barrier among the
        warps."""
        _, _, _, _, _, sK, sV, _, _, _, _, tidx = loads  # (load_kv's arguments)
        lane = tidx % 32
        keys = self.warp_keys
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            valid = seq.seqlen_k - n_block * self.tile_n - warp_idx * keys  # this warp's keys in the sequence
            pipeline.consume_wait(kv_pipe, kv_consumer)
            sK_w = cute.local_tile(sK[None, None, kv_consumer.index], (keys, self.head_dim), (warp_idx, 0))
            sV_w = cute.local_tile(sV[None, None, kv_consumer.index], (keys, self.head_dim), (warp_idx, 0))
            if cutlass.const_expr(self.fp8):
                tSrK, value_words = self.fp8_operands(ctx, sK_w, kv_consumer.index, warp_idx, lane)
                cute.arch.sync_warp()  # every lane's loads are done
                kv_consumer = pipeline.release(kv_pipe, kv_consumer)  # in registers: the stage is free
                if valid < keys:
                    fp8_mma_sync.zero_keys_past(value_words, valid, lane)
            else:
                self.warp_zero_rows(sV_w, valid, lane)
                tSrK = ctx.thr_qk.make_fragment_B(ctx.thr_qk.partition_B(sK_w))
                cute.copy(ctx.copy_k, ctx.copy_k.partition_S(sK_w), ctx.copy_k.retile(tSrK))
            acc_s = self.warp_scores(ctx, tSrK)
            if cutlass.const_expr(self.fp8):
                tOrVt = ctx.thr_pv.make_fragment_B(ctx.thr_pv.partition_shape_B((self.head_dim, keys)))
                fp8_mma_sync.v_operand(value_words, tOrVt)
            else:
                sVt_w = mma.transpose_view(sV_w)
                tOrVt = ctx.thr_pv.make_fragment_B(ctx.thr_pv.partition_B(sVt_w))
                cute.copy(ctx.copy_v, ctx.copy_v.partition_S(sVt_w), ctx.copy_v.retile(tOrVt))
            self.attend_block(ctx, acc_s, tOrVt, m_block, n_block, warp_idx, group, seq, scale_log2, window,
                              softcap_scale)
            if cutlass.const_expr(not self.fp8):
                kv_consumer = pipeline.release(kv_pipe, kv_consumer)
            if self.is_kv_producer(warp_idx) and kv_producer.count < n_blocks:  # refill a freed stage
                kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
        return kv_producer

    @cute.jit
    def warp_scores(self, ctx, tSrK: cute.Tensor) -> cute.Tensor:
        """S = Q K^T of this warp's keys (K's B fragment tSrK) on mma.sync, in FP32."""
        acc_s = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.warp_keys)), Float32)
        acc_s.fill(0.0)
        for k in cutlass.range_constexpr(cute.size(ctx.tSrQ.shape[2])):
            cute.gemm(ctx.qk, acc_s, ctx.tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        return acc_s

    @cute.jit
    def fp8_operands(self, ctx, sK_w: cute.Tensor, stage, warp_idx: Int32, lane: Int32):
        """(K's B fragment, V's words) of this warp's FP8 keys of `stage`, loaded into registers
        (common/fp8_mma_sync.py: K converted for mma.sync, V's bytes paired by key)."""
        tSrK = ctx.thr_qk.make_fragment_B(ctx.thr_qk.partition_shape_B((self.warp_keys, self.head_dim)))
        value_words = cute.make_rmem_tensor((self.head_dim // 8,), Int32)  # FP8 V, keys paired
        fp8_mma_sync.value_words(ctx.v_base, ctx.sKV_layout, warp_idx * self.warp_keys, stage, lane, value_words)
        fp8_mma_sync.k_operand(sK_w, lane, tSrK)
        return tSrK, value_words

    @cute.jit
    def attend_block(self, ctx, acc_s: cute.Tensor, tOrVt: cute.Tensor, m_block: Int32, n_block: Int32,
                     warp_idx: Int32, group: Int32, seq, scale_log2: Float32, window, softcap_scale: Float32):
        """A warp's block after S = Q K^T (acc_s) with V in registers (tOrVt): softcap, the masks
        where the block needs them, the online softmax's update of the warp's rows, O += P V."""
        keys = self.warp_keys
        s_mn = rows_cols_sm80(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, softcap_scale)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                self.causal, rows_per_query=group, window=window):
            mask.apply(s_mn, ctx.s_coords, m_block * self.tile_m, n_block * self.tile_n + warp_idx * keys,
                       seq.seqlen_q, seq.seqlen_k, self.causal, rows_per_query=group, window=window)
        softmax.rescale(rows_cols_sm80(ctx.acc_o),
                        softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4))
        p = acc_as_a_sm80(mma.to_dtype(acc_s, self.dtype))
        for k in cutlass.range_constexpr(cute.size(p.shape[2])):
            cute.gemm(ctx.pv, ctx.acc_o, p[None, None, k], tOrVt[None, None, k], ctx.acc_o)

    @cute.jit
    def mainloop_pages(self, ctx, loads, warp_idx: Int32, n_blocks: Int32, last: Int32, m_block: Int32,
                       group: Int32, seq, scale_log2: Float32, window, softcap_scale: Float32):
        """mainloop_warps over an FP8 cache in pages of 16 (`warp_pages`): warp w's keys of block n,
        16n/4 + 16w .., are page 4n + w of the sequence, and warp w alone copies them (copy_page)
        into rows 16w .. of the stage and reads them. Its ring is its own cp.async groups, one a
        stage, committed every iteration (empty past the last block) so that waiting for all but
        kv_stages - 1 of them means this block's have landed; a warp sync then makes every lane's
        copies visible to the warp, and another, after the warp's loads, frees its rows for the
        block kv_stages ahead, whose table entry was read before the wait."""
        _, _, mK, _, mV, sK, sV, mBlockTable, head_kv, batch, _, tidx = loads  # (load_kv's arguments)
        lane = tidx % 32
        keys = self.warp_keys
        stage = Int32(0)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            valid = seq.seqlen_k - n_block * self.tile_n - warp_idx * keys  # this warp's keys in the sequence
            has_page, page = self.warp_page(mBlockTable, batch, n_block - self.kv_stages,
                                            j + self.kv_stages < n_blocks, seq, warp_idx, mK.shape[3])
            cute.arch.cp_async_wait_group(self.kv_stages - 1)
            cute.arch.sync_warp()  # every lane's copies of this block have landed
            sK_w = cute.local_tile(sK[None, None, stage], (keys, self.head_dim), (warp_idx, 0))
            tSrK, value_words = self.fp8_operands(ctx, sK_w, stage, warp_idx, lane)
            cute.arch.sync_warp()  # every lane's loads are done: the warp's rows are free
            self.copy_page(has_page, page, stage, mK, mV, sK, sV, head_kv, warp_idx, lane)
            cute.arch.cp_async_commit_group()
            stage = stage + 1
            if stage == self.kv_stages:
                stage = Int32(0)
            if valid < keys:
                fp8_mma_sync.zero_keys_past(value_words, valid, lane)
            acc_s = self.warp_scores(ctx, tSrK)
            tOrVt = ctx.thr_pv.make_fragment_B(ctx.thr_pv.partition_shape_B((self.head_dim, keys)))
            fp8_mma_sync.v_operand(value_words, tOrVt)
            self.attend_block(ctx, acc_s, tOrVt, m_block, n_block, warp_idx, group, seq, scale_log2, window,
                              softcap_scale)

    @cute.jit
    def warp_page(self, mBlockTable: cute.Tensor, batch: Int32, n_block: Int32, wanted, seq, warp_idx: Int32,
                  num_pages: Int32):
        """(copy, page) of this warp's page of key block n_block (`warp_pages`: entry 4 n_block + w of
        the table): copy when the block is wanted and the page holds a key of the sequence. The
        table is read either way, at an entry of the sequence's (clamped to its last page), so that
        the load issues unconditionally; no entry past the sequence's pages is read (called only
        where the split has a block, so the sequence a key)."""
        entry = n_block * WARPS + warp_idx
        copy = wanted and entry * self.warp_keys < seq.seqlen_k
        last_entry = cutlass.max(seq.seqlen_k - 1, 0) // self.warp_keys
        page = paged.page_of(mBlockTable, batch, cutlass.max(cutlass.min(entry, last_entry), 0), num_pages)
        return copy, page

    @cute.jit
    def copy_page(self, copy, page: Int32, stage, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor,
                  sV: cute.Tensor, head_kv: Int32, warp_idx: Int32, lane: Int32):
        """cp.async copies of one page's 16 K and V rows (`warp_pages`) into rows 16 warp_idx .. of
        `stage`, by the warp's lanes: lane l copies 16-byte chunk l % chunks of rows l / chunks +
        i 32 / chunks (chunks: a row's, 8 at d128, 4 at d64), every row of the page, those past the
        sequence too (K masked, V zeroed in registers: zero_keys_past). `copy` false: nothing."""
        elems = paged.CHUNK_BYTES * 8 // self.cache_dtype.width
        chunks = self.head_dim // elems
        rows_per_pass = 32 // chunks
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.cache_dtype,
                                   num_bits_per_copy=paged.CHUNK_BYTES * 8)
        if copy:
            for mX, sX in ((mK[None, None, head_kv, None], sK), (mV[None, None, head_kv, None], sV)):
                for i in cutlass.range_constexpr(self.warp_keys // rows_per_pass):
                    row = lane // chunks + i * rows_per_pass
                    src = cute.local_tile(mX[row, None, page], (elems,), (lane % chunks,))
                    dst = cute.local_tile(sX[warp_idx * self.warp_keys + row, None, stage], (elems,), (lane % chunks,))
                    cute.copy(atom, cute.make_tensor(src.iterator.align(paged.CHUNK_BYTES), cute.make_layout(elems)),
                              cute.make_tensor(dst.iterator.align(paged.CHUNK_BYTES), cute.make_layout(elems)))

    @cute.jit
    def warp_zero_rows(self, sV_w: cute.Tensor, valid_rows: Int32, lane: Int32):
        """zero_rows_past_end for one warp's V rows (a 16-bit cache): the rows of its slice past the
        sequence, by its lanes, visible to its ldmatrix after the warp's sync."""
        if valid_rows < self.warp_keys:
            for r in cutlass.range(cutlass.max(valid_rows, 0), self.warp_keys, unroll=1):
                for c in cutlass.range_constexpr(self.head_dim // 32):
                    sV_w[r, lane + c * 32] = sV_w.element_type(0.0)
            cute.arch.fence_proxy("async.shared", space="cta")  # before the stage's next TMA write
            cute.arch.sync_warp()

    # ---------------------------------------------------------------- epilogue
    @cute.jit
    def store(self, ctx, mO, mLSE, mOacc, mLSEacc, mSinks, split: Int32, num_splits: Int32, row0: Int32,
              head_kv: Int32, group: Int32, q_plane: Int32, seq, scale_log2: Float32, o_scale: Float32):
        """O and LSE of each real row (direct stores: a decode tile has few), unpacked to (query,
        head) at the entry's rows of plane q_plane; with several splits the FP32 partials instead
        (the combine adds the sinks). o_scale: an FP8 cache's v_descale (1 otherwise)."""
        o_mn = rows_cols_sm80(ctx.acc_o) if cutlass.const_expr(self.warp_split) else mma.rows_cols(ctx.acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            packed = row0 + ctx.o_coords[r, 0][0]
            query, head = packed // group, head_kv * group + packed % group
            sink_log2 = None
            if cutlass.const_expr(self.sinks):
                sink_log2 = -Float32.inf  # (no sink in a partial)
                if num_splits == 1:
                    sink_log2 = mSinks[head] * Float32(softmax.LOG2E)
            inv_sum, lse = softmax.finalize(ctx.row_max[r], ctx.row_sum[r], scale_log2, 4, sink_log2)
            inv_sum = inv_sum * o_scale
            if query < seq.seqlen_q:
                row = seq.offset_q + query
                if num_splits == 1:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mO[q_plane, row, head, ctx.o_coords[r, c][1]] = (o_mn[r, c] * inv_sum).to(self.out_dtype)
                    if ctx.tidx % 4 == 0:
                        mLSE[q_plane, head, row] = lse
                else:
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                        mOacc[split, q_plane, row, head, ctx.o_coords[r, c][1]] = o_mn[r, c] * inv_sum
                    if ctx.tidx % 4 == 0:
                        mLSEacc[split, q_plane, head, row] = lse
