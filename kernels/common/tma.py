"""TMA (the bulk tensor copy engine): atoms, partitions, descriptor prefetch.

A TMA atom is built on the host from a global tensor and the SMEM layout of one stage; the kernel
gets the atom plus a "TMA tensor" (coordinates, not pointers) to slice into tiles. One thread
issues a copy of a whole tile; completion is counted in bytes on an mbarrier (see pipeline.py).
Out-of-bounds parts of a box (ragged last tiles) are zero-filled and still counted.
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op


def seq_major(mX: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, d) -> a (seqlen, d, heads, batch) view of the same memory, so that a
    (tile, d) box tiles the first two modes and heads/batch index the rest."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))


def make_load(mX: cute.Tensor, staged_layout, tile_shape):
    """(atom, tma_tensor) loading `tile_shape` boxes of mX into one stage of `staged_layout`."""
    return _tiled_atom(cpasync.CopyBulkTensorTileG2SOp(), mX, staged_layout, tile_shape)


def make_load_box(mX: cute.Tensor, box_layout, tile_shape):
    """(atom, tma_tensor) loading `tile_shape` boxes of mX into SMEM of `box_layout` (one box's
    layout, e.g. a few rows of a stage: kernels/k5_cache.py's pages)."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX, box_layout, tile_shape)


def make_load_multicast(mX: cute.Tensor, staged_layout, tile_shape, ctas: int):
    """(atom, tma_tensor) for boxes that `ctas` CTAs of a cluster load together: each issues a
    1/ctas slice of the box (see partition_multicast) and the copy engine writes it into every
    CTA's SMEM at the same offset."""
    one_stage = cute.slice_(staged_layout, (None, None, 0))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mX, one_stage,
                                       tile_shape, num_multicast=ctas)


def make_store(mX: cute.Tensor, staged_layout, tile_shape):
    """(atom, tma_tensor) storing one stage of `staged_layout` into `tile_shape` boxes of mX; the
    parts of a box past mX's bounds are not written."""
    return _tiled_atom(cpasync.CopyBulkTensorTileS2GOp(), mX, staged_layout, tile_shape)


def make_reduce_add(mX: cute.Tensor, staged_layout, tile_shape):
    """(atom, tma_tensor) adding one stage of `staged_layout` into `tile_shape` boxes of mX
    (cp.reduce.async.bulk.tensor .add: the copy engine performs the read-modify-write in L2)."""
    return _tiled_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), mX, staged_layout, tile_shape)


def _tiled_atom(op, mX, staged_layout, tile_shape):
    one_stage = cute.slice_(staged_layout, (None, None, 0))
    return cpasync.make_tiled_tma_atom(op, mX, one_stage, tile_shape)


def transpose(mX: cute.Tensor) -> cute.Tensor:
    """(rows, cols) -> a (cols, rows) view of the same memory (GEMM's B, (K, N) in torch, is
    (N, K) to the MMA)."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 0]))


def partition(atom, gX: cute.Tensor, sX: cute.Tensor):
    """(tXsX, tXgX): SMEM indexed by stage, GMEM by tile, for a CTA that is its own cluster."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                 cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))


def partition_multicast(atom, gX: cute.Tensor, sX: cute.Tensor, rank, ctas: int):
    """(tXsX, tXgX) as `partition`, for CTA `rank` of `ctas` sharing each box (its slice)."""
    return cpasync.tma_partition(atom, rank, cute.make_layout(ctas),
                                 cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))


def prefetch(*atoms):
    """Pull the descriptors into cache before the first copy (call from one warp)."""
    for atom in atoms:
        cpasync.prefetch_descriptor(atom)


@dsl_user_op
def bulk_reduce_add_f32(src: cute.Pointer, dst: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """dst[0 : num_bytes / 4] += src[...] for FP32: one 1-D bulk reduce-add from SMEM into global
    memory (cp.reduce.async.bulk ... bulk_group.add.f32; the copy engine does the read-modify-write
    in L2). Both addresses 16-byte aligned, num_bytes a multiple of 16; completes like a TMA store
    (cp_async_bulk_commit_group / wait_group)."""
    llvm.inline_asm(
        None, [dst.llvm_ptr, src.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
