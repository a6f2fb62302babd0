"""K3: K2's compute body fed by TMA through a `kv_stages`-deep producer/consumer ring.

What changes against K2 (and nothing else does):
  * Q is loaded once per CTA by one TMA copy into its own single-stage buffer.
  * K and V get *separate* staged SMEM regions (both can be in flight at once, so they cannot share
    bytes as in K2); the K and V copies of a stage complete on *one* full barrier whose tx_count is
    sK_bytes + sV_bytes.
  * Warp 0 prefetches min(kv_stages, n_tiles) stages, then refills the stage the CTA just released.
    With kv_stages = 1 (K3.1) the refill waits for the release: no overlap. With 2 (K3.2) tile j+1
    lands while tile j is computed. 5 (K3.3) rehearses the depth K4/K5 need once the math is fast.
  * SMEM tiles use the swizzled layouts WGMMA will read in K4 (see common/smem.py).

Ragged tiles: TMA zero-fills rows past seqlen; masking handles the scores; the barrier still counts
the full box. Threads: 4 per query row as in K2 (256 for tile_m = 64); all 8 warps consume.

The ring is common/tma_ring.py's (K4 runs on it too), the scalar math common/scalar_tile.py's (K2's
body); this rung's own is what runs on each stage (`compute_tile`).

SMEM (bf16, tile_m = tile_n = 64, d = 128): Q 16 KB + (K + V) 32 KB per stage + P 16.3 KB
-> 64 / 96 / 192 KB for 1 / 2 / 5 stages. At d = 256 five 64-row stages would need 336 KB: K3.3 uses
tile_n = 32 there (registry), 200 KB.
"""

import cutlass.cute as cute
from cutlass import Float32

from .common.scalar_tile import ScalarTileMath
from .common.tma_ring import TmaRingKernel


class TmaRingAttention(TmaRingKernel, ScalarTileMath):
    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 64, tile_n: int = 64,
                 kv_stages: int = 2):
        super().__init__(dtype, head_dim, causal, tile_m, tile_n)
        self.kv_stages = kv_stages

    # ---------------------------------------------------------------- compute: K2's body, per stage
    # compute_setup and compute_epilogue: this thread's row and its epilogue (ScalarTileMath's)
    @cute.jit
    def compute_tile(self, ctx, stage, n_block, scale_log2: Float32):
        scores = self.scores(ctx.sQ, ctx.sK[None, None, stage], ctx.row, ctx.lane)
        self.softmax_step(scores, ctx.row_max, ctx.row_sum, ctx.acc_o, ctx.limit - n_block * self.tile_n,
                          ctx.lane, scale_log2)
        cute.arch.sync_threads()  # the previous tile's P V is done with sP
        self.store_p(scores, ctx.sP, ctx.row, ctx.lane)
        cute.arch.sync_threads()
        self.accumulate_pv(ctx.sP, ctx.sV[None, None, stage], ctx.acc_o, ctx.row, ctx.lane)
