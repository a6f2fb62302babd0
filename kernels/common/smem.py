"""SMEM layouts and the per-CTA budget.

Every staged tile (Q, K, V, GEMM A/B) uses the layout WGMMA reads: rows of `cols` 16-bit elements
in swizzle atoms (K-major), tiled to (rows, cols[, stages]). TMA atoms are built from the same
layout, so the copy engine writes exactly the swizzle the tensor cores (K4 on) expect; the scalar
rungs index it logically through the composed layout and never see the swizzle.

The swizzle is the widest whose atom row (128, 64 or 32 bytes) tiles a row: 128 bytes at head
dims 64/128/192/256, 64 bytes at d96 (192-byte rows). An MMA that splits the columns among
warpgroups (`share`: the columns one reads, e.g. the backward's dQ = dS K at d96, 48 per
warpgroup) must not cut an atom: the swizzle is then chosen for the share (32 bytes at d96, 64 at
d192), one choice per (head dim, split), here.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils import hopper_helpers as sm90

SMEM_CAPACITY = 232448  # bytes a CTA may use on sm_90 (227 KB)


def atom_elems(dtype, major: int) -> int:
    """Elements in one row of the swizzle atom chosen for a contiguous extent of `major`."""
    bits = major * dtype.width
    return next(b for b in (1024, 512, 256, 128) if bits % b == 0) // dtype.width


def tile_layout(dtype, rows: int, cols: int, stages: int = 1, rows_contiguous: bool = False,
                share: int | None = None):
    """(rows, cols, stages) swizzled layout. `cols` is the contiguous dimension (K-major), unless
    `rows_contiguous` (an MN-major operand, e.g. a column-major GEMM A or a row-major GEMM B seen
    as (N, K)): then the swizzle atom runs along the rows. `share`: the contiguous extent one
    warpgroup's MMA reads where an MMA splits it among warpgroups (the swizzle must not cut it)."""
    kind, major = (LayoutEnum.COL_MAJOR, rows) if rows_contiguous else (LayoutEnum.ROW_MAJOR, cols)
    if share is not None and share % atom_elems(dtype, major) and atom_elems(dtype, major) % share:
        major = share
    atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(kind, dtype, major), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(1, 0, 2) if rows_contiguous else (0, 1, 2))


def get_tensor(field, layout):
    """The SMEM tensor of a storage field in `layout`: swizzled (a ComposedLayout, tile_layout's)
    or plain."""
    if isinstance(layout, cute.ComposedLayout):
        return field.get_tensor(layout.outer, swizzle=layout.inner)
    return field.get_tensor(layout)


def row_passes(rows: int, chunks: int, threads: int) -> tuple[int, int]:
    """How `threads` threads sweep a (rows, chunks) tile of copy chunks in whole rows, pass after
    pass: (rows_per_pass, active). rows_per_pass is the most rows the threads cover that divides
    the tile; thread t < active = rows_per_pass x chunks takes chunk t % chunks of rows
    t // chunks + i x rows_per_pass (all 128 threads at d 64/128/256 in 16-byte chunks, 96 at d96
    and d192), the others none."""
    rows_per_pass = max(r for r in range(1, threads // chunks + 1) if rows % r == 0)
    return rows_per_pass, rows_per_pass * chunks


@cute.jit
def store_rows(tiles, rows, tidx, threads: cutlass.Constexpr):
    """Rows r < `rows` of 16-bit SMEM tiles out to global memory in 16-byte vectors. `tiles`: a
    tuple of (sX, gX), sX a (tile_rows, cols) SMEM tile, plain or swizzled at 16-byte granularity
    (tile_layout's: 8 elements of a row stay contiguous), gX the global rows it goes to, from the
    tile's first row, each row starting on 16 bytes (contiguous 16-bit tensors with cols a
    multiple of 8: `.align(16)` below rounds a pointer up, it does not check it). `threads`
    threads sweep whole rows (`row_passes`), each tile's row r in the same pass."""
    tile_rows, cols = cute.size(tiles[0][0], mode=[0]), cute.size(tiles[0][0], mode=[1])
    chunks = cols // 8
    rows_per_pass, active = row_passes(tile_rows, chunks, threads)
    if tidx < active:
        for p in cutlass.range_constexpr(tile_rows // rows_per_pass):
            r = tidx // chunks + p * rows_per_pass
            c = tidx % chunks
            if r < rows:
                for sX, gX in tiles:
                    vec = cute.make_rmem_tensor((8,), sX.element_type)
                    src = cute.local_tile(sX[r, None], (8,), (c,))
                    cute.autovec_copy(cute.make_tensor(src.iterator.align(16), cute.make_layout(8)), vec)
                    dst = cute.local_tile(gX[r, None], (8,), (c,))
                    cute.autovec_copy(vec, cute.make_tensor(dst.iterator.align(16), cute.make_layout(8)))


def stage_bytes(dtype, staged_layout) -> int:
    """Bytes of one stage: what one TMA copy of that tile delivers (and what tx_count counts)."""
    return cute.size_in_bytes(dtype, cute.slice_(staged_layout, (None, None, 0)))


def stages_that_fit(bytes_per_stage: int, reserved_bytes: int) -> int:
    """How many ring stages of `bytes_per_stage` fit beside `reserved_bytes` (epilogue buffers,
    barriers) in one CTA's SMEM."""
    return (SMEM_CAPACITY - reserved_bytes) // bytes_per_stage


def check_budget(num_bytes: int, what: str) -> None:
    """Refuse, at compile time, a configuration that does not fit in one CTA's SMEM."""
    if num_bytes > SMEM_CAPACITY:
        raise ValueError(f"{what} needs {num_bytes} bytes of shared memory but a Hopper CTA has "
                         f"{SMEM_CAPACITY} (227 KB): use fewer stages or smaller tiles")


def check_plan(num_bytes: int, planned_bytes: int, what: str) -> None:
    """Refuse, at compile time, a struct larger than the bytes the host's plan counts (a kernel
    whose CTAs share an SM by that count: one byte more and they would not)."""
    if num_bytes > planned_bytes:
        raise ValueError(f"{what}'s SMEM ({num_bytes} bytes) outgrew the host's plan ({planned_bytes}): "
                         "update the plan (fa3.cache.split_plan) with it")
