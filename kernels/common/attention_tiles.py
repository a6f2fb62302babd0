"""What the attention rungs on TMA and WGMMA share, as mixins a rung's class composes:

StagedQkvLoads: the SMEM layouts of Q (q_stages tiles) and of the K/V ring (kv_stages tiles), and
    the TMA atoms that fill them (K3 introduced them; K4 and K5 load the same way).
WgmmaTileState: the per-tile state of attention with both GEMMs on WGMMA and P in registers
    (K4.2's idea, K5's math): the tiled MMAs of S = Q K^T and O += P V, their SMEM operand
    fragments, O's FP32 accumulator and the register softmax state (ctx, from compute_setup), and
    the finalization of O's rows (row_output: 1/l and the LSE) with the register store of O and
    the LSE (store_o_registers).

A rung sets what they read: dtype, head_dim, head_dim_v, causal, tile_m, tile_n, kv_stages,
q_stages, and (WgmmaTileState) v_major, p_offset_log2 where its V tiles or P differ.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import mma, smem, softmax, tma


class StagedQkvLoads:
    def make_loads(self, mQ, mK, mV):
        """SMEM layouts of Q (q_stages tiles) and K/V (a ring of kv_stages), and their TMA atoms."""
        sQ_layout = smem.tile_layout(self.dtype, self.tile_m, self.head_dim, self.q_stages)
        sKV_layout = smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages)
        loads = (*tma.make_load(tma.seq_major(mQ), sQ_layout, (self.tile_m, self.head_dim)),
                 *tma.make_load(tma.seq_major(mK), sKV_layout, (self.tile_n, self.head_dim)),
                 *tma.make_load(tma.seq_major(mV), self.v_layout(), (self.tile_n, self.head_dim_v)))
        return sQ_layout, sKV_layout, loads

    def v_layout(self):
        """V's ring: (tile_n, head_dim_v) tiles, K's layout unless V's head dim differs (K5)."""
        return smem.tile_layout(self.dtype, self.tile_n, self.head_dim_v, self.kv_stages)


class WgmmaTileState:
    # V's SMEM tile as P V's B operand: (tile_n, d) read through a transposed view (MN-major, 16-bit
    # types), or (FP8, "K") already stored transposed as (d, tile_n)
    v_major = "MN"
    # P is computed as 2^p_offset_log2 times the probabilities (finalize undoes it; FP8: 8)
    p_offset_log2 = 0

    def scores_setup(self, sQ, sK, tidx, m_block, seqlen_q, seqlen_k):
        """The QK^T MMA over this tile's Q and a K stage: its fragments and S's (row, col) coordinates."""
        qk = mma.tiled_mma(self.dtype, self.tile_m, self.tile_n)
        mma_tidx = tidx % (128 * (self.tile_m // 64))
        thr_qk, wg_qk = qk.get_slice(mma_tidx), mma.warpgroup_slice(qk, mma_tidx)
        return SimpleNamespace(
            qk=qk, thr_qk=thr_qk,
            tSrQ=mma.fragment_A(wg_qk, sQ), tSrK=mma.fragment_B(wg_qk, sK),
            s_coords=mma.rows_cols(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))),
            m_block=m_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, tidx=tidx, mma_tidx=mma_tidx)

    def compute_setup(self, sQ, sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k):
        """Fragments and accumulators for the tile: the QK^T MMA (scores_setup), the P V MMA with
        V's fragments, O's accumulator and the register softmax state. sP is unused (P stays in
        registers)."""
        ctx = self.scores_setup(sQ, sK, tidx, m_block, seqlen_q, seqlen_k)
        ctx.pv = mma.tiled_mma(self.dtype, self.tile_m, self.head_dim_v, b_major=self.v_major, a_in_regs=True)
        thr_pv = ctx.pv.get_slice(tidx)
        sVt = mma.transpose_view(sV) if self.v_major == "MN" else sV
        ctx.tOrVt = mma.fragment_B(mma.warpgroup_slice(ctx.pv, ctx.mma_tidx), sVt)
        ctx.acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        ctx.acc_o.fill(0.0)
        ctx.o_coords = mma.rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        ctx.row_max, ctx.row_sum = softmax.row_state(cute.size(ctx.s_coords, mode=[0]))
        ctx.sink_log2 = None  # an attention sink in the exp2 domain (K5's sinks variant sets it)
        ctx.o_scale = None  # O's scale beyond 1/l (FP8: v_descale)
        return ctx

    def row_output(self, ctx, r, scale_log2: Float32):
        """(O's scale, LSE) of accumulator row r: 1/l (times ctx.o_scale) and the natural-log LSE,
        the sink and P's offset accounted for: every epilogue's one formula."""
        inv_sum, lse = softmax.finalize(ctx.row_max[r], ctx.row_sum[r], scale_log2, 4, ctx.sink_log2,
                                        self.p_offset_log2)
        if cutlass.const_expr(ctx.o_scale is not None):
            inv_sum = inv_sum * ctx.o_scale
        return inv_sum, lse

    @cute.jit
    def store_o_registers(self, ctx, mO, mLSE, batch, head, scale_log2: Float32, row_offset):
        """O / l and LSE straight from the accumulator, rows past seqlen_q dropped; rows sit at
        row_offset + row of (batch, rows, heads, d) mO and (batch, heads, rows) mLSE (a packed
        varlen sequence's offset, else 0)."""
        o_mn = mma.rows_cols(ctx.acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            inv_sum, lse = self.row_output(ctx, r, scale_log2)
            row = ctx.m_block * self.tile_m + ctx.o_coords[r, 0][0]
            if row < ctx.seqlen_q:
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    mO[batch, row_offset + row, head, ctx.o_coords[r, c][1]] = \
                        (o_mn[r, c] * inv_sum).to(mO.element_type)
                if ctx.tidx % 4 == 0:
                    mLSE[batch, head, row_offset + row] = lse
