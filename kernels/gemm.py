"""GEMM on Hopper: C = A B with TMA loads, WGMMA from swizzled SMEM, FP32 accumulation, and a
stmatrix + TMA-store epilogue. The ladder G1 -> G2 -> G3 changes how loads and MMAs overlap.

Operands, as the interface passes them (torch shapes): A (M, K), B (K, N), C (M, N) row-major.
A may be row- or column-major and B too (a.t(), b.t() views, no copies): the MMA sees B as
(N, K), and whichever dimension has unit stride (static in the compiled kernel) picks the
K-major or MN-major SMEM layout and WGMMA operand mode. M, N, K are dynamic; TMA zero-fills
loads past the edges (so a ragged last K tile adds zeros) and clips stores.
FP8 (e4m3 A and B, the scaled GEMM of torch._scaled_mm): the same rungs with `dtype` e4m3 and
C in `out_dtype` (bf16/fp16); WGMMA k32 on 128-deep K tiles (128 bytes a row, as 16-bit's 64);
both operands K-major (FP8 WGMMA reads no MN-major operand); C = scale_a * scale_b * (A B), the
scales (FP32, read on the GPU) applied to the FP32 accumulator in the epilogue, after split-K's
sum: one each (per tensor), or (`row_scales`) scale_a per row of A and scale_b per column of B.
Constraints: 16-bit types or e4m3 (K-major); the non-unit stride of A and B, and N (C's row
stride), multiples of 16 bytes (TMA's rule); K > 0 (the interface handles K = 0 and empty outputs).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, pipeline as dsl_pipeline
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from .common import accum, epilogue, mma, pipeline, scheduler, smem, tma
from .config import GemmConfig

EPI_STAGES = 4  # SMEM buffers for the stored subtiles (fewer if a tile has fewer subtiles)
_BARRIER_BYTES = 1024  # pipeline barriers and alignment slack in the SMEM budget
K_TILE_BYTES = 128  # a K tile's row: the 128-byte swizzle's width


def _mn_major(t: cute.Tensor) -> bool:
    """(rows, K) operand whose rows (M or N) are the unit-stride dimension."""
    return LayoutEnum.from_tensor(t) == LayoutEnum.COL_MAJOR


class GemmBase:
    """What every rung shares: tiles, SMEM layouts, TMA atoms, the tiled MMA, the per-K-tile MMA
    step and the epilogue. Subclasses supply the grid and the kernel body."""

    producer_warpgroups = 0  # warpgroups that only load (G3)
    cluster_m = 1  # CTAs per cluster along M, sharing (multicasting) each B tile (G4: 2)

    def __init__(self, dtype, config: GemmConfig, out_dtype=None, row_scales: bool = False):
        """config: kernels/config.gemm_config's (tiles, stages, MMA warpgroups, ...)."""
        tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
        self.dtype = dtype  # A's and B's
        self.out_dtype = out_dtype or dtype  # C's
        self.scaled = dtype.width == 8  # FP8: C = scale_a * scale_b * (A B)
        # FP8 with scale_a per row of A (M,) and scale_b per column of B (N,), as torch._scaled_mm's
        # row-wise scaling; else one scale each
        self.row_scales = row_scales
        assert self.scaled or not row_scales
        # tile_k=0: 128 bytes of each row (the 128-byte swizzle): 64 16-bit or 128 FP8 elements
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k or K_TILE_BYTES * 8 // dtype.width
        # a_rows < tile_m (M <= a_rows, row-major A only): TMA loads just the top a_rows rows of
        # each A tile. Out-of-bounds rows of a TMA box cost time (worklog/gemm.md); the rows below
        # hold stale SMEM, which only reaches output rows >= M, and those the store clips.
        self.a_rows = config.a_rows or tile_m
        assert self.a_rows <= tile_m and self.a_rows % 8 == 0
        self.mma_warpgroups = config.mma_warpgroups
        self.mma_threads = 128 * self.mma_warpgroups
        self.num_threads = 128 * (self.mma_warpgroups + self.producer_warpgroups)
        self.mmas_in_flight = config.mmas_in_flight
        self.epi_tile = epilogue.subtile(tile_m, self.mma_warpgroups)
        subtiles = (tile_m // self.epi_tile[0]) * (tile_n // self.epi_tile[1])
        # buffers restart at 0 on each tile (persistent kernels): whole rounds per tile
        self.epi_stages = min(EPI_STAGES, subtiles)
        assert subtiles % self.epi_stages == 0, f"{subtiles} epilogue subtiles per tile"
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * self.epi_stages * self.out_dtype.width // 8
        stage_bytes = (tile_m + tile_n) * self.tile_k * dtype.width // 8
        # stages=0: as many as fit beside the epilogue buffers
        self.stages = config.stages or smem.stages_that_fit(stage_bytes, epi_bytes + _BARRIER_BYTES)

    def grid(self, tiles_m, tiles_n, sm_count, splits):
        raise NotImplementedError  # the rung's

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, sm_count: Int32,
                 mWorkspace: cute.Tensor, mCounters: cute.Tensor, splits: Int32,
                 mScaleA: cute.Tensor, mScaleB: cute.Tensor, stream):
        """mWorkspace (FP32), mCounters (int32, zero) and splits: split-K (PersistentGemm; the
        staged rungs take splits = 1 and ignore the buffers). mScaleA/B: FP8's scales (FP32:
        element 0, or per row of A / column of B with `row_scales`); 16-bit rungs ignore them."""
        mB = tma.transpose(mB)  # (K, N) -> (N, K)
        a_mn, b_mn = _mn_major(mA), _mn_major(mB)
        assert not (self.scaled and (a_mn or b_mn)), "FP8 WGMMA reads K-major operands only"
        tiled_mma = mma.tiled_mma(self.dtype, self.tile_m, self.tile_n, a_major="MN" if a_mn else "K",
                                  b_major="MN" if b_mn else "K", warpgroups=self.mma_warpgroups)
        sA_layout = smem.tile_layout(self.dtype, self.tile_m, self.tile_k, self.stages, rows_contiguous=a_mn)
        sB_layout = smem.tile_layout(self.dtype, self.tile_n, self.tile_k, self.stages, rows_contiguous=b_mn)
        sC_layout = epilogue.smem_layout(self.out_dtype, self.epi_tile, self.epi_stages)
        if cutlass.const_expr(self.a_rows < self.tile_m):
            assert not a_mn, "a_rows needs a row-major (K-major) A"
            sA_box = smem.tile_layout(self.dtype, self.a_rows, self.tile_k, self.stages)
            tma_a, tA = tma.make_load(mA, sA_box, (self.a_rows, self.tile_k))
        else:
            tma_a, tA = tma.make_load(mA, sA_layout, (self.tile_m, self.tile_k))
        if cutlass.const_expr(self.cluster_m > 1):
            tma_b, tB = tma.make_load_multicast(mB, sB_layout, (self.tile_n, self.tile_k), self.cluster_m)
        else:
            tma_b, tB = tma.make_load(mB, sB_layout, (self.tile_n, self.tile_k))
        tma_c, tC = tma.make_store(mC, sC_layout, self.epi_tile)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[Int64, 2 * self.stages]
            last_split: cute.struct.MemRange[Int32, 1]  # split-K: whether this CTA sums the tile
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(sC_layout)], 1024]

        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"GEMM {self.tile_m}x{self.tile_n}x{self.tile_k} with {self.stages} stages")
        tiles_m = Int32(cute.ceil_div(mC.shape[0], self.tile_m))
        tiles_n = Int32(cute.ceil_div(mC.shape[1], self.tile_n))
        self.kernel(tma_a, tA, tma_b, tB, tma_c, tC, mWorkspace, mCounters, splits, mScaleA, mScaleB,
                    tiled_mma, sA_layout, sB_layout, sC_layout,
                    SharedStorage).launch(grid=self.grid(tiles_m, tiles_n, sm_count, splits),
                                          block=[self.num_threads, 1, 1], stream=stream,
                                          **({"cluster": [self.cluster_m, 1, 1]} if self.cluster_m > 1 else {}),
                                          min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side, shared
    @cute.jit
    def prologue(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
                 mB: cute.Tensor, tma_c: cute.CopyAtom, sA_layout: cute.ComposedLayout,
                 sB_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout,
                 SharedStorage: cutlass.Constexpr):
        """Descriptor prefetch, SMEM, the A/B ring (every MMA warp releases) and the TMA
        partitions of every (tile, K tile) of A and B: tXgX[(None, tile, k)], tXsX[(None, stage)].
        Returns (tidx, warp_idx, ring, storage, sA, sB, sC, tAsA, tAgA, tBsB, tBgB)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            tma.prefetch(tma_a, tma_b, tma_c)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        a_box_bytes = self.a_rows * self.tile_k * (self.dtype.width // 8)
        ring = pipeline.create(storage.ab_barriers.data_ptr(), self.stages, self.mma_threads // 32,
                               a_box_bytes + smem.stage_bytes(self.dtype, sB_layout), self.cluster_m)
        pipeline.init_done(self.cluster_m)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        sA_box = sA
        if cutlass.const_expr(self.a_rows < self.tile_m):  # the top rows of every stage
            sA_box = cute.local_tile(sA, (self.a_rows, self.tile_k, self.stages), (0, 0, 0))
        tAsA, tAgA = tma.partition(tma_a, cute.local_tile(mA, (self.a_rows, self.tile_k), (None, None)), sA_box)
        gB_tiles = cute.local_tile(mB, (self.tile_n, self.tile_k), (None, None))
        if cutlass.const_expr(self.cluster_m > 1):  # this CTA issues its slice of each B box
            tBsB, tBgB = tma.partition_multicast(tma_b, gB_tiles, sB, cute.arch.block_idx_in_cluster(),
                                                 self.cluster_m)
        else:
            tBsB, tBgB = tma.partition(tma_b, gB_tiles, sB)
        return tidx, warp_idx, ring, storage, sA, sB, sC, tAsA, tAgA, tBsB, tBgB

    def mma_operands(self, tiled_mma, mma_tidx, sA, sB):
        """(tCrA, tCrB, acc): SMEM descriptors indexed [.., k_block, stage] and the FP32 accumulator."""
        thr, wg = tiled_mma.get_slice(mma_tidx), mma.warpgroup_slice(tiled_mma, mma_tidx)
        tCrA, tCrB = mma.fragment_A(wg, sA), mma.fragment_B(wg, sB)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        return tCrA, tCrB, acc

    @cute.jit
    def mma_k_tile(self, ring, read, released, k: Int32, tiled_mma: cute.TiledMma, acc: cute.Tensor,
                   tCrA: cute.Tensor, tCrB: cute.Tensor):
        """Wait for K tile k's stage, issue its MMAs, keep `mmas_in_flight` batches in flight, and
        release the stage whose MMAs have just retired (`mmas_in_flight` behind). Returns the
        advanced (read, released) states."""
        pipeline.consume_wait(ring, read)
        stage = read.index
        mma.gemm(tiled_mma, acc, tCrA[None, None, None, stage], tCrB[None, None, None, stage],
                 wait=self.mmas_in_flight)
        read.advance()
        if k >= self.mmas_in_flight:
            released = pipeline.release(ring, released)
        return read, released

    @cute.jit
    def mma_drain(self, ring, released):
        """After a tile's last K tile: retire every MMA and release the stages still held."""
        warpgroup.wait_group(0)
        for _ in cutlass.range_constexpr(self.mmas_in_flight):
            released = pipeline.release(ring, released)
        return released

    def store_acc(self, acc, tiled_mma, mma_tidx, sC, tma_c, gC, is_store_warp, store_pipe, scales,
                  tile_mn):
        """Output tile `tile_mn` = (m_tile, n_tile) of the accumulator to C (FP8: times scale_a *
        scale_b, per tensor or per row and column; `scales` = (mScaleA, mScaleB))."""
        barrier = dsl_pipeline.NamedBarrier(barrier_id=1, num_threads=self.mma_threads)
        scale = None
        if cutlass.const_expr(self.row_scales):
            self.scale_rows_cols(acc, tiled_mma, mma_tidx, scales, tile_mn)
        elif cutlass.const_expr(self.scaled):
            scale = scales[0][0] * scales[1][0]
        epilogue.store_tile(acc, tiled_mma, mma_tidx, sC, tma_c, gC, self.epi_tile, barrier,
                            is_store_warp, store_pipe, scale)

    @cute.jit
    def scale_rows_cols(self, acc, tiled_mma, mma_tidx, scales, tile_mn):
        """acc[r, c] *= scale_a[row] * scale_b[col] in the accumulator's own layout: this thread's
        2 rows per 64-row atom read scale_a once, each of its columns scale_b once (L1-cached).
        Rows and columns past M and N (clipped by the store) read the last scale."""
        mScaleA, mScaleB = scales
        coords = mma.rows_cols(tiled_mma.get_slice(mma_tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        acc_mn = mma.rows_cols(acc)
        rows, cols = cute.size(acc_mn, mode=[0]), cute.size(acc_mn, mode=[1])
        row_scale = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            row = tile_mn[0] * self.tile_m + coords[r, 0][0]
            row_scale[r] = mScaleA[cutlass.min(row, mScaleA.shape[0] - 1)]
        for c in cutlass.range_constexpr(cols):
            col = tile_mn[1] * self.tile_n + coords[0, c][1]
            col_scale = mScaleB[cutlass.min(col, mScaleB.shape[0] - 1)]
            for r in cutlass.range_constexpr(rows):
                acc_mn[r, c] = acc_mn[r, c] * row_scale[r] * col_scale


class StagedGemm(GemmBase):
    """G1 and G2: one CTA per output tile; every warp computes, warp 0 also issues the TMA loads.

    Warp 0 prefetches min(stages, K tiles) stages of the A/B ring; each iteration waits for a
    stage, issues its WGMMAs (tile_k / 16 per 64-row atom), releases the stage whose WGMMAs have
    retired, and warp 0 refills exactly that stage with the next K tile.

    G1 (stages=1, mmas_in_flight=0, one warpgroup, 128x128): load, wait, MMA, wait for the MMA,
        release, load the next tile: TMA latency and MMA time add up, nothing overlaps.
    G2 (stages from the SMEM budget, mmas_in_flight=1, two warpgroups, 128x256): the ring keeps
        up to `stages` loads in flight, and wait_group(1) leaves one K tile's WGMMAs running while
        the next is issued; a stage is released one K tile behind, when its MMAs have retired.
    Both: the epilogue (common/epilogue.py) starts after the last MMA; warp 0's refills sit in the
    MMA warps' instruction stream (its acquire waits for the slowest warp's release).
    """

    def grid(self, tiles_m, tiles_n, sm_count, splits):
        return [tiles_m, tiles_n, 1]

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, mWorkspace: cute.Tensor, mCounters: cute.Tensor,
               splits: Int32, mScaleA: cute.Tensor, mScaleB: cute.Tensor, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               sC_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        m_tile, n_tile, _ = cute.arch.block_idx()
        tidx, warp_idx, ring, storage, sA, sB, sC, tAsA, tAgA, tBsB, tBgB = self.prologue(
            tma_a, mA, tma_b, mB, tma_c, sA_layout, sB_layout, sC_layout, SharedStorage)
        copies = [(tma_a, tAgA[None, m_tile, None], tAsA), (tma_b, tBgB[None, n_tile, None], tBsB)]
        k_tiles = cute.size(tAgA, mode=[2])
        tCrA, tCrB, acc = self.mma_operands(tiled_mma, tidx, sA, sB)

        producer = pipeline.producer_state(self.stages)
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                producer = pipeline.produce(ring, producer, producer.count, copies)
        read = pipeline.consumer_state(self.stages)
        released = pipeline.consumer_state(self.stages)
        acc.fill(0.0)
        for k in cutlass.range(k_tiles, unroll=1):
            read, released = self.mma_k_tile(ring, read, released, k, tiled_mma, acc, tCrA, tCrB)
            # refill only the stage this iteration released: waiting on one that a later iteration
            # releases would stall warp 0, and with it the other warps (deadlock)
            if warp_idx == 0 and k >= self.mmas_in_flight and producer.count < k_tiles:
                producer = pipeline.produce(ring, producer, producer.count, copies)
        released = self.mma_drain(ring, released)
        if warp_idx == 0:
            pipeline.tail(ring, producer)

        store_pipe = epilogue.store_pipeline(self.epi_stages, self.mma_threads)
        gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (m_tile, n_tile))
        self.store_acc(acc, tiled_mma, tidx, sC, tma_c, gC, warp_idx == 0, store_pipe, (mScaleA, mScaleB),
                       (m_tile, n_tile))
        if warp_idx == 0:
            store_pipe.producer_tail()


class WarpSpecializedGemm(GemmBase):
    """The kernel of G3 and G4: warp-specialized and persistent (CUTLASS's "cooperative" schedule).
    A rung adds its schedule: `grid`, `unit_range` (this CTA's work units), `work_unit` (a unit's
    output tile and K range) and `b_multicast`.

    Warpgroup 0 is the producer: all four warps drop to `producer_regs` registers (setmaxnreg is
    warpgroup-wide), and warp 0 alone streams A/B K tiles through the ring, tile after tile, never
    waiting for an MMA except through the ring's empty barriers. Warpgroups 1..n consume: they
    raise their registers to `mma_regs`, and together compute one (tile_m, tile_n) output tile
    (64 rows each), with G2's in-flight MMA step, then store it through SMEM with TMA while the
    producer already fills the ring with the next tile's K tiles. With splits > 1 (split-K) every
    split writes its FP32 partial to the workspace and the last to arrive sums them in order and
    stores the tile (common/accum.sum_partials): deterministic, and no CTA waits for another.
    Register budget at 384 threads: 128 x producer_regs + 256 x mma_regs <= 65536.
    """

    producer_warpgroups = 1

    def __init__(self, dtype, config: GemmConfig, out_dtype=None, row_scales: bool = False):
        super().__init__(dtype, config, out_dtype, row_scales)
        self.group_m = config.group_m
        self.producer_regs, self.mma_regs = config.producer_regs, config.mma_regs
        assert 128 * self.producer_regs + self.mma_threads * self.mma_regs <= 65536, \
            "register file overcommitted"

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, mWorkspace: cute.Tensor, mCounters: cute.Tensor,
               splits: Int32, mScaleA: cute.Tensor, mScaleB: cute.Tensor, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               sC_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        tidx, warp_idx, ring, storage, sA, sB, sC, tAsA, tAgA, tBsB, tBgB = self.prologue(
            tma_a, mA, tma_b, mB, tma_c, sA_layout, sB_layout, sC_layout, SharedStorage)
        tiles_m = Int32(cute.size(tAgA, mode=[1]))
        tiles_n = Int32(cute.size(tBgB, mode=[1]))
        k_tiles = Int32(cute.size(tAgA, mode=[2]))
        first_unit, num_units, unit_step = self.unit_range(tiles_m, tiles_n, splits)

        if warp_idx < 4:  # the producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                producer = pipeline.producer_state(self.stages)
                for unit in cutlass.range(first_unit, num_units, unit_step, unroll=1):
                    _, m_tile, n_tile, _, k_first, k_count = self.work_unit(unit, splits, tiles_m, tiles_n, k_tiles)
                    copies = [(tma_a, tAgA[None, m_tile, None], tAsA),
                              (tma_b, tBgB[None, n_tile, None], tBsB, *self.b_multicast())]
                    for k in cutlass.range(k_first, k_first + k_count, unroll=1):
                        producer = pipeline.produce(ring, producer, k, copies)
                pipeline.tail(ring, producer)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            mma_tidx = tidx - 128
            tCrA, tCrB, acc = self.mma_operands(tiled_mma, mma_tidx, sA, sB)
            gC_tiles = cute.local_tile(mC, (self.tile_m, self.tile_n), (None, None))
            store_pipe = epilogue.store_pipeline(self.epi_stages, self.mma_threads)
            is_store_warp = warp_idx == 4
            consumers = dsl_pipeline.NamedBarrier(barrier_id=2, num_threads=self.mma_threads)
            # ring states carry over from tile to tile: the ring does not restart
            read = pipeline.consumer_state(self.stages)
            released = pipeline.consumer_state(self.stages)
            for unit in cutlass.range(first_unit, num_units, unit_step, unroll=1):
                tile, m_tile, n_tile, split, _, k_count = self.work_unit(unit, splits, tiles_m, tiles_n, k_tiles)
                acc.fill(0.0)
                for k in cutlass.range(k_count, unroll=1):
                    read, released = self.mma_k_tile(ring, read, released, k, tiled_mma, acc, tCrA, tCrB)
                released = self.mma_drain(ring, released)
                store = cutlass.Boolean(True)
                if splits > 1:
                    store = accum.sum_partials(acc, mWorkspace, accum.elem_ptr(mCounters, tile), tile, split,
                                               splits, mma_tidx, self.mma_threads,
                                               storage.last_split.get_tensor(cute.make_layout(1)),
                                               consumers.arrive_and_wait)
                if store:
                    self.store_acc(acc, tiled_mma, mma_tidx, sC, tma_c, gC_tiles[None, None, m_tile, n_tile],
                                   is_store_warp, store_pipe, (mScaleA, mScaleB), (m_tile, n_tile))
            if is_store_warp:
                store_pipe.producer_tail()


class PersistentGemm(WarpSpecializedGemm):
    """G3: WarpSpecializedGemm on L2-grouped tiles, with split-K for problems whose output tiles
    cannot fill the SMs.

    One CTA per SM (grid = min(work units, sm_count); the SM count is a runtime argument, so
    compiling needs no GPU); CTA b takes work units b, b + grid, ... A work unit is one split of
    one output tile (tiles in the grouped order of common/scheduler.py, a tile's splits adjacent
    so that they run at once): split s covers K tiles [s * per_split, (s + 1) * per_split), the
    host picks `splits` so that none is empty.
    """

    def grid(self, tiles_m, tiles_n, sm_count, splits):
        return [scheduler.persistent_grid(tiles_m * tiles_n * splits, sm_count), 1, 1]

    def unit_range(self, tiles_m: Int32, tiles_n: Int32, splits: Int32):
        """(first, count, step) of this CTA's work units."""
        return cute.arch.block_idx()[0], tiles_m * tiles_n * splits, cute.arch.grid_dim()[0]

    def b_multicast(self) -> tuple:
        """() or (the multicast mask of a B copy,)."""
        return ()

    @cute.jit
    def work_unit(self, unit: Int32, splits: Int32, tiles_m: Int32, tiles_n: Int32, k_tiles: Int32):
        """(tile, m_tile, n_tile, split, first K tile, K tiles) of work unit `unit`."""
        tile = unit // splits
        split = unit - tile * splits
        m_tile, n_tile = scheduler.grouped_tile(tile, tiles_m, tiles_n, self.group_m)
        per_split = (k_tiles + splits - 1) // splits
        k_first = split * per_split
        return tile, m_tile, n_tile, split, k_first, cutlass.min(per_split, k_tiles - k_first)


class ClusterGemm(WarpSpecializedGemm):
    """G4: G3's kernel (WarpSpecializedGemm) on 2-CTA clusters along M with TMA multicast of B.

    The two CTAs of a cluster compute vertically adjacent output tiles (2p, n) and (2p + 1, n),
    which need the same B tile. Each CTA's producer loads its own A tile and half of the B tile,
    and the copy engine writes that half into both CTAs' SMEM (`multicast::cluster`), so each B
    byte leaves L2 once per cluster instead of once per CTA. Each CTA's full barrier expects its
    A bytes plus the whole B tile; a stage may be refilled only when the consumers of *both* CTAs
    have released it (their releases arrive on both CTAs' empty barriers), and the barriers are
    initialised cluster-wide before the first copy. The pair walks the same work units in step
    (units are tile pairs in the grouped order), so neither waits on a stage the other never
    frees; with an odd number of M tiles the last pair's second tile lies past M: its loads are
    zero-filled and its store is clipped away, and it still multicasts B for its partner.
    No split-K (the rung is for problems with plenty of tiles).
    """

    cluster_m = 2

    def grid(self, tiles_m, tiles_n, sm_count, splits):
        pairs = (tiles_m + 1) // 2 * tiles_n
        return [self.cluster_m * scheduler.persistent_grid(pairs, sm_count // self.cluster_m), 1, 1]

    def unit_range(self, tiles_m: Int32, tiles_n: Int32, splits: Int32):
        return (cute.arch.block_idx()[0] // self.cluster_m, (tiles_m + 1) // 2 * tiles_n,
                cute.arch.grid_dim()[0] // self.cluster_m)

    def b_multicast(self) -> tuple:
        return (cutlass.Int16((1 << self.cluster_m) - 1),)  # every CTA of the cluster

    @cute.jit
    def work_unit(self, unit: Int32, splits: Int32, tiles_m: Int32, tiles_n: Int32, k_tiles: Int32):
        pair_m, n_tile = scheduler.grouped_tile(unit, (tiles_m + 1) // 2, tiles_n, self.group_m // 2)
        m_tile = pair_m * 2 + cute.arch.block_idx_in_cluster()
        return unit, m_tile, n_tile, Int32(0), Int32(0), k_tiles
