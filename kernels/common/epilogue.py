"""Epilogue through SMEM: an FP32 WGMMA accumulator -> the output dtype -> SMEM (stmatrix) -> global
memory (TMA store), one (epi_m, epi_n) subtile at a time.

Why SMEM and not direct stores: a thread's accumulator holds pairs of adjacent columns spread over
rows 8 apart, so direct 4-byte stores are badly coalesced; `stmatrix` writes 8x8 blocks into a
swizzled SMEM buffer and one thread hands the whole subtile to the copy engine, which also clips
at the tensor's edges (ragged tiles need no predicates).

The subtiles cycle through `stages` SMEM buffers: a buffer is rewritten only after the bulk store
that read it has finished (the store pipeline keeps at most stages - 1 stores in flight). Every
writing thread meets on a named barrier twice per subtile: once so the buffer is complete before
the store is issued, once so no thread overwrites a buffer whose store is being waited for.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, pipeline
from cutlass.cute.nvgpu import cpasync

from . import mma, smem

SUBTILE_COLS = 32  # 64-byte rows: small buffers, and stmatrix/TMA stay efficient


def subtile(tile_m: int, warpgroups: int) -> tuple:
    """(rows, cols) of one stored subtile: the rows every writing warpgroup holds together."""
    return (min(tile_m, 64 * warpgroups), SUBTILE_COLS)


def smem_layout(dtype, epi_tile: tuple, stages: int):
    """Row-major swizzled (epi_m, epi_n, stages) buffers, the layout the TMA store reads."""
    return smem.tile_layout(dtype, epi_tile[0], epi_tile[1], stages)


def store_pipeline(stages: int, threads: int):
    """Bounds the bulk stores in flight to stages - 1 (no mbarriers: bulk-group waits)."""
    return pipeline.PipelineTmaStore.create(
        num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads))


@cute.jit
def store_tile(acc: cute.Tensor, tiled_mma: cute.TiledMma, thread_idx, sC: cute.Tensor,
               tma_atom: cute.CopyAtom, gC: cute.Tensor, epi_tile: cutlass.Constexpr,
               barrier: pipeline.NamedBarrier, is_store_warp, store_pipe, scale=None):
    """Write the (tile_m, tile_n) accumulator `acc` to the gmem tile gC (a TMA tensor tile), times
    `scale` (an FP32 value) unless it is None.

    thread_idx: index among the threads that hold `acc` (all meet on `barrier`);
    is_store_warp: true in exactly one warp, which issues the bulk stores."""
    dtype = sC.element_type
    r2s, thr_r2s = mma.smem_writer(tiled_mma, dtype, thread_idx)
    tRS_sC = thr_r2s.partition_D(sC)
    tRS_acc = r2s.retile(acc)
    frag_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
    frag_f32 = cute.make_rmem_tensor(frag_shape, Float32)
    frag_out = cute.make_rmem_tensor(frag_shape, dtype)
    per_subtile = cute.size(frag_f32)

    gC_sub = cute.zipped_divide(gC, epi_tile)  # ((epi_m, epi_n), (subtiles_m, subtiles_n))
    bSG_sC, bSG_gC = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                           cute.group_modes(sC, 0, 2), gC_sub)
    grid = gC_sub.shape[1]
    # the accumulator's registers run over subtiles row by row (n fastest)
    subtile_order = cute.make_layout(grid, stride=(grid[1], 1))
    stages = cute.size(tRS_sC, mode=[3])
    for sub in cutlass.range_constexpr(cute.size(grid)):
        for v in cutlass.range_constexpr(per_subtile):
            if cutlass.const_expr(scale is None):
                frag_f32[v] = tRS_acc[sub * per_subtile + v]
            else:
                frag_f32[v] = tRS_acc[sub * per_subtile + v] * scale
        frag_out.store(frag_f32.load().to(dtype))
        buf = sub % stages
        cute.copy(r2s, frag_out, tRS_sC[None, None, None, buf])
        # stmatrix writes go through the generic proxy; the bulk copy reads through the async one
        cute.arch.fence_proxy("async.shared", space="cta")
        barrier.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_atom, bSG_sC[None, buf], bSG_gC[None, subtile_order.get_hier_coord(sub)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        barrier.arrive_and_wait()
