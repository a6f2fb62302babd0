"""Static persistent tile schedule with grouped rasterisation (for L2 reuse).

A persistent grid launches one CTA per SM; CTA b takes linear tiles b, b + grid, b + 2 grid, ...
The linear order visits output tiles in bands of `group_m` tile rows, going down each band's
column before moving right:

    tile ids, group_m = 2, 3 x 4 tiles:     0  2  4  6
                                            1  3  5  7
                                            8  9 10 11     (a last, shorter band)

The CTAs running at one moment then cover a compact block of about group_m rows x grid/group_m
columns, so the A rows and B columns they read are fetched from DRAM once and shared through L2,
instead of a full row of B tiles per A row (row-major order).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def persistent_grid(num_tiles, sm_count):
    """CTAs to launch: one per SM, never more than there are tiles."""
    return cutlass.min(num_tiles, sm_count)


@cute.jit
def grouped_tile(tile_id: Int32, tiles_m: Int32, tiles_n: Int32, group_m: cutlass.Constexpr):
    """(m, n) tile coordinates of linear tile `tile_id`."""
    band_tiles = group_m * tiles_n
    band = tile_id // band_tiles
    first_m = band * group_m
    band_rows = cutlass.min(tiles_m - first_m, group_m)  # the last band may be shorter
    within = tile_id - band * band_tiles
    return first_m + within % band_rows, within // band_rows
