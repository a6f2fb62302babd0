"""K5's tiles per variant: where a variant cannot keep the rung's tiles (plain Python, no DSL, so
that the host asks the same rules without importing the DSL: fa3/split_plan.py chooses a packed
call's page layout for the tiles the kernel will have)."""


def adjust(tile_m: int, tile_n: int, head_dim: int, causal: bool, varlen: bool, local: bool,
           head_dim_v: int | None = None) -> tuple[int, int]:
    """(tile_m, tile_n) that K5 compiles for the rung's tiles and this variant (and the FP8 forward and
    K5 over a KV cache: common/warp_specialized_forward.py applies it)."""
    if local and tile_m == 192:
        # three 160-register warpgroups have no room for the window's state (680 bytes of
        # spills at d64): a windowed kernel takes two warpgroups on 128-row tiles
        tile_m = 128
    if causal and head_dim == 96 and tile_m == 192:
        # causal d96: 96-wide K/V tiles, 5% faster than 112 at 2k (fewer masked columns on the
        # diagonal), within 1% from 8k
        tile_n = min(tile_n, 96)
    if varlen and head_dim == 192 and head_dim_v in (None, 192) and tile_n > 80:
        # likewise a packed batch's offsets and bounds beside 96-wide S tiles at d192 (36
        # bytes of spills): 80-wide K/V tiles
        tile_n = 80
    return tile_m, tile_n
