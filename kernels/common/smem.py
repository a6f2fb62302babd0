"""SMEM layouts and the per-CTA budget.

Every staged tile (Q, K, V, GEMM A/B) uses the layout WGMMA reads: rows of `cols` 16-bit elements
in 128-byte swizzle atoms (K-major), tiled to (rows, cols[, stages]). TMA atoms are built from the
same layout, so the copy engine writes exactly the swizzle the tensor cores (K4 on) expect; the
scalar rungs index it logically through the composed layout and never see the swizzle.
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils import hopper_helpers as sm90

SMEM_CAPACITY = 232448  # bytes a CTA may use on sm_90 (227 KB)


def tile_layout(dtype, rows: int, cols: int, stages: int = 1, rows_contiguous: bool = False):
    """(rows, cols, stages) swizzled layout. `cols` is the contiguous dimension (K-major), unless
    `rows_contiguous` (an MN-major operand, e.g. a column-major GEMM A or a row-major GEMM B seen
    as (N, K)): then the swizzle atom runs along the rows."""
    kind, major = (LayoutEnum.COL_MAJOR, rows) if rows_contiguous else (LayoutEnum.ROW_MAJOR, cols)
    atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(kind, dtype, major), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(1, 0, 2) if rows_contiguous else (0, 1, 2))


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
