"""K4: K3's TMA ring, with the math moved onto WGMMA from swizzled SMEM.

The ring, the barriers, the SMEM layouts and the TMA atoms are K3's, unchanged (common/tma_ring.py,
common/attention_tiles.py): the 128-byte swizzled tiles TMA writes are exactly what
`wgmma.mma_async` reads, which is why K3 already used them. Only the three compute hooks change;
K4.2's tile state is common/attention_tiles.py's (K5 runs on it), K4.1 keeps K3's scalar row state
and softmax (common/scalar_tile.py).

K4.1 (`pv_on_wgmma=False`): S = Q K^T is one warpgroup's WGMMA (tile_m = 64). The FP32 accumulator
    is spilled to the P buffer in SMEM and the rest is K3's: every thread reads back its quad share
    of a row, masks, runs the scalar online softmax, and does P V on CUDA cores.
K4.2 (`pv_on_wgmma=True`): both GEMMs on WGMMA, two warpgroups of 64 rows each (tile_m = 128).
    Softmax runs on the S accumulator in registers: a thread owns 2 rows (r, r + 8) x tile_n/4
    columns, row max/sum are reduced across the quad with two shuffles, exp2 has the scale folded
    in. P is rounded to 16 bits in registers and fed as the register-sourced A operand of P V (the
    accumulator and A fragments coincide for 16-bit types); V is read through a transposed view of
    its SMEM tile (an MN-major B operand). O accumulates in registers and is written once.
    Masking runs only on tiles that need it (ragged last tile, causal diagonal); tiles above the
    diagonal are never visited.

Both wait for each WGMMA before using its result (wait_group(0)): GEMMs, softmax and loads of the
next stage still serialise within a CTA. K5 overlaps them.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .common import mask, mma, softmax
from .common.attention_tiles import WgmmaTileState
from .common.scalar_tile import ScalarTileMath
from .common.tma_ring import TmaRingKernel


class WgmmaAttention(WgmmaTileState, TmaRingKernel, ScalarTileMath):
    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 128, tile_n: int = 128,
                 kv_stages: int = 2, pv_on_wgmma: bool = True):
        super().__init__(dtype, head_dim, causal, tile_m, tile_n)
        self.kv_stages = kv_stages
        self.pv_on_wgmma = pv_on_wgmma
        if pv_on_wgmma:
            self.num_threads = 128 * (tile_m // 64)  # one warpgroup per 64 rows
        else:
            assert tile_m == 64, "K4.1 keeps K3's 4-threads-per-row softmax: tile_m = 64"

    def p_smem_elems(self) -> int:
        return 8 if self.pv_on_wgmma else super().p_smem_elems()  # K4.2: P stays in registers

    # ---------------------------------------------------------------- compute hooks
    def compute_setup(self, sQ, sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k):
        """Fragments and accumulators for the tile: the QK^T MMA, then either K3's per-row state
        (K4.1, as `ctx.k3`) or the P V MMA and register softmax state (K4.2: WgmmaTileState's)."""
        if cutlass.const_expr(not self.pv_on_wgmma):
            ctx = self.scores_setup(sQ, sK, tidx, m_block, seqlen_q, seqlen_k)
            ctx.k3 = ScalarTileMath.compute_setup(self, sQ, sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k)
            return ctx
        return WgmmaTileState.compute_setup(self, sQ, sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k)

    @cute.jit
    def scores_wgmma(self, qk, thr_qk, tSrQ, tSrK, stage):
        """S = Q K_stage^T on WGMMA; returns the FP32 accumulator and its (rows, cols) view."""
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(qk, acc_s, tSrQ, tSrK[None, None, None, stage], zero_init=True, wait=0)
        return acc_s, mma.rows_cols(acc_s)

    @cute.jit
    def compute_tile(self, ctx, stage, n_block, scale_log2: Float32):
        if cutlass.const_expr(not self.pv_on_wgmma):
            self.compute_tile_smem_p(ctx, stage, n_block, scale_log2)
        else:
            self.compute_tile_regs(ctx, stage, n_block, scale_log2)

    @cute.jit
    def compute_tile_smem_p(self, ctx, stage, n_block, scale_log2: Float32):
        """K4.1: WGMMA S -> SMEM, then K3's scalar softmax and P V on the same buffer."""
        # Plain locals: values used inside the dynamic branch below must not come from the namespace
        # (the DSL does not thread attribute reads through staged control flow).
        k3, s_coords, sP = ctx.k3, ctx.s_coords, ctx.k3.sP
        qk, thr_qk, tSrQ, tSrK = ctx.qk, ctx.thr_qk, ctx.tSrQ, ctx.tSrK
        cute.arch.sync_threads()  # the previous tile's P V is done with sP
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) < 4:  # warpgroup 0 owns the 64 rows
            _, s_mn = self.scores_wgmma(qk, thr_qk, tSrQ, tSrK, stage)
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    sP[s_coords[r, c][0], s_coords[r, c][1]] = s_mn[r, c]
        cute.arch.sync_threads()
        scores = cute.make_rmem_tensor((1, self.tile_n // 4), Float32)
        for i in cutlass.range_constexpr(self.tile_n // 4):
            scores[0, i] = k3.sP[k3.row, k3.lane + 4 * i]
        self.softmax_step(scores, k3.row_max, k3.row_sum, k3.acc_o, k3.limit - n_block * self.tile_n,
                          k3.lane, scale_log2)
        self.store_p(scores, k3.sP, k3.row, k3.lane)  # each thread rewrites only the entries it read
        cute.arch.sync_threads()
        self.accumulate_pv(k3.sP, k3.sV[None, None, stage], k3.acc_o, k3.row, k3.lane)

    @cute.jit
    def compute_tile_regs(self, ctx, stage, n_block, scale_log2: Float32):
        """K4.2: S and O on WGMMA, softmax on the S accumulator, P in registers."""
        acc_s, s_mn = self.scores_wgmma(ctx.qk, ctx.thr_qk, ctx.tSrQ, ctx.tSrK, stage)
        if mask.tile_needs_mask(ctx.m_block, n_block, self.tile_m, self.tile_n, ctx.seqlen_q,
                                ctx.seqlen_k, self.causal):
            mask.apply(s_mn, ctx.s_coords, ctx.m_block * self.tile_m, n_block * self.tile_n,
                       ctx.seqlen_q, ctx.seqlen_k, self.causal)
        softmax.rescale(mma.rows_cols(ctx.acc_o),
                        softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4))
        p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        p.store(acc_s.load().to(self.dtype))
        mma.gemm(ctx.pv, ctx.acc_o, mma.as_a_operand(p), ctx.tOrVt[None, None, None, stage], wait=0)

    @cute.jit
    def compute_epilogue(self, ctx, mO, mLSE, batch, head, scale_log2: Float32):
        if cutlass.const_expr(not self.pv_on_wgmma):
            ScalarTileMath.compute_epilogue(self, ctx.k3, mO, mLSE, batch, head, scale_log2)
        else:
            self.store_o_registers(ctx, mO, mLSE, batch, head, scale_log2, 0)
