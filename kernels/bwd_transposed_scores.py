"""The backward with the scores computed transposed, S^T = K Q^T, so that P^T and dS^T stay in
registers (FlashAttention-3's `SdP_swapAB`; the kernel's `scores_transposed`, b3 on).

Computing S = Q K^T puts the queries on the accumulator's rows, and P and dS must go through SMEM,
because dV = P^T dO and dK = dS^T Q need them transposed. Here the operands of the first two GEMMs
are swapped:

    S^T  = K Q^T          (tile_n, tile_m)   A = K (K-major),  B = Q  (K-major)
    dP^T = V dO^T         (tile_n, tile_m)   A = V (K-major),  B = dO (K-major)
    P^T  = exp2(S^T * scale_log2 - LSE * log2 e)    LSE per *column* now
    dS^T = P^T * (dP^T - D)                         D per column
    dV  += P^T dO         (tile_n, d)        A = P^T  from registers (RS), B = dO^T (MN-major)
    dK  += dS^T Q         (tile_n, d)        A = dS^T from registers (RS), B = Q^T  (MN-major)
    dQ_i = dS K           (tile_m, d)        A = dS (MN-major view of the SMEM dS^T), B = K^T
                                             (or dQ^T, bwd_transposed_dq.py)

Each consumer warpgroup owns 64 keys (rows of S^T) for the whole walk, the same rows of dV and dK
it accumulates, so the accumulator of S^T is already the A operand of dV (the m64nNk16
accumulator and the m64k16 A fragment coincide, as P in the forward's P V). P never touches SMEM;
dS^T is written once, for dQ, whose K dimension runs over both warpgroups' keys. The freed SMEM
holds a second dS buffer, so one barrier per Q tile (dS complete before dQ reads it) replaces the
row-major step's two: the buffer written at tile i was last read by tile i - 2's dQ, which both
warpgroups waited for before the barrier of tile i - 1.

Per-query statistics. LSE * log2 e and D now belong to columns: a thread holds columns
8j + 2 (lane % 4) + {0, 1} of each 64-column block, tile_m / 4 of them, too many registers to
hold them all beside five accumulators. Each lane loads the 2 tile_m / 64 values of columns
8 (lane / 4) + 2 (lane % 4) + {0, 1} (+ 64k) and the others are fetched with one shuffle per
column when used (the lane holding column 8j + ... is 4 (j % 8) + lane % 4). With the statistics
in SMEM (`stats_in_smem`, common/statistics.py) each column's value is read where it is used
(its two adjacent columns in one `ld.shared.v2`), or ahead of the wait for S^T
(`prefetch_stats`), or a group of columns ahead of their exp2s (`stat_group`).

The order of dV. Issued from P^T's registers while dP^T is still in flight (`dv_under_dp`: its
scores then wait for the register operand), or after dS^T, when S^T's and dP^T's FP32 registers
are free.

dS^T from the rounded P^T (`ds_from_rounded_p`, with `ds_in_pairs`: b8's 128 x 128 tiles at
d64). Five 64 x 128 FP32 accumulators a thread at the worst point (S^T, dP^T, P^T rounded for
dV, dV and dK) spill at 128 query rows, and ptxas serializes the WGMMAs. Computing dS^T from the
rounded P^T makes them fit:

    P^T_bf16  = round(exp2(S^T * scale_log2 - LSE * log2 e))  into the A operand's 32-bit pairs
    dS^T_bf16 = P^T_bf16 * round(dP^T - D)                     one mul.rn.bf16x2 a pair

S^T's FP32 registers die at the rounding, before dP^T lands, so S^T and dP^T never live together
with the P^T fragment. Each column pair's dP^T - D is rounded into one 32-bit pair and multiplied
by P^T's pair in 16-bit arithmetic (bwd_pointwise.py), which is also dS^T's rounding for the dK
and dQ GEMMs. The price is accuracy: one more rounding of dP - D (dQ and dK errors against
float64 grow, worklog/backward.md; dV unchanged). Capped scores (softcap) compute dS^T in FP32
(their 1 - t^2 needs P's logarithm). SMEM (bf16, d64, 128 x 128 tiles, one dQ buffer a
warpgroup): Q/dO 2 x 2 x 16 KB, K/V 32 KB, dS^T 2 x 32 KB, dQ 2 x 16 KB, beside the statistics.

Constraints: head dims 96 and 128 on 64-row Q tiles (at d64 such tiles lose to 128-row ones,
which fit only with the rounded P^T; at d192/d256 the dK and dV accumulators leave no room);
128-key tiles (each of the two consumer warpgroups owns 64 keys); two Q stages (the dS^T
buffers, and a per-warpgroup dQ hand-off's buffers, follow the Q stage index); dO rides on the Q
ring. The loader, the dQ writer warp, the deterministic order and the packed batches are the
warp-specialized kernel's (bwd_ws.py). SMEM (bf16, d = 128, 64 x 128 tiles): Q/dO 2 x 32 KB,
K/V 64 KB, dS^T 2 x 16 KB, dQ 32 KB = 192 KB.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .common import mask, mma, pipeline, q_walk, smem, softmax


class ColumnStats(NamedTuple):
    """A statistic already gathered per column of this thread's accumulator (`prefetch_columns`)."""
    regs: cute.Tensor


class TransposedScores:
    """Mixin of the warp-specialized backward (bwd_ws.py), which picks these pieces where its
    `scores_transposed` is set: the S^T layouts, MMAs and operands, the column statistics, and the
    consume step."""

    # ---------------------------------------------------------------- host side
    def scores_t_layout(self):
        """dS^T (tile_n, tile_m), one buffer per Q stage (P^T stays in registers)."""
        return smem.tile_layout(self.dtype, self.tile_n, self.tile_m, self.q_stages)

    # ---------------------------------------------------------------- MMAs and operands
    def scores_t_mma(self):
        """S^T's and dP^T's tiled MMA: (keys, queries)."""
        return mma.tiled_mma(self.dtype, self.tile_n, self.tile_m, warpgroups=self.mma_warpgroups)

    def dkv_mma_a_in_regs(self, head_dim: int):
        """dK's (head_dim) or dV's (head_dim_v) tiled MMA: A (P^T or dS^T) from registers."""
        return mma.tiled_mma(self.dtype, self.tile_n, head_dim, b_major="MN", a_in_regs=True,
                             warpgroups=self.mma_warpgroups)

    def dq_mma_from_ds_t(self):
        """dQ = dS K's tiled MMA, dS read as the MN-major view of the SMEM dS^T."""
        return mma.tiled_mma(self.dtype, self.tile_m, self.head_dim, a_major="MN", b_major="MN",
                             warpgroups=self.mma_warpgroups)

    def scores_t_fragments(self, s, wg_sdp, wg_dkv, wg_dq) -> dict:
        """K and V are the A operands of S^T and dP^T; dV and dK take A from registers."""
        t = mma.transpose_view
        frags = dict(tSrK=mma.fragment_A(wg_sdp, s.sK), tSrQ=mma.fragment_B(wg_sdp, s.sQ),
                     tdPrV=mma.fragment_A(wg_sdp, s.sV), tdPrdO=mma.fragment_B(wg_sdp, s.sdO))
        if self.head_dim_v == self.head_dim:  # (else mma_setup's)
            frags.update(self.dv_operands(s, wg_dkv))
        return dict(**frags, tdKrQt=mma.fragment_B(wg_dkv, t(s.sQ)), **self.dq_fragments(s, wg_dq))

    def dv_operands_p_in_regs(self, s, wg_dv) -> dict:
        """dV's B fragment, dO^T (its A, P^T, comes from registers)."""
        return dict(tdVrdOt=mma.fragment_B(wg_dv, mma.transpose_view(s.sdO)))

    def dq_fragments_from_ds_t(self, s, wg_dq) -> dict:
        """dQ = dS K: dS (the transposed view of sdS^T) is A, K^T is B."""
        t = mma.transpose_view
        return dict(tdQrdS=mma.fragment_A(wg_dq, t(s.sdS)), tdQrKt=mma.fragment_B(wg_dq, t(s.sK)))

    # ---------------------------------------------------------------- device side
    @cute.jit
    def scores_t_and_dp_t(self, ctx, stage, wait_s: cutlass.Constexpr):
        """Issue S^T = K Q^T and dP^T = V dO^T back to back; wait until `wait_s` groups remain."""
        shape = ctx.thr_sdp.partition_shape_C((self.tile_n, self.tile_m))
        acc_s = cute.make_rmem_tensor(shape, Float32)
        acc_dp = cute.make_rmem_tensor(shape, Float32)
        mma.gemm(ctx.sdp, acc_s, ctx.tSrK[None, None, None, 0], ctx.tSrQ[None, None, None, stage],
                 zero_init=True, wait=-1)
        mma.gemm(ctx.sdp, acc_dp, ctx.tdPrV[None, None, None, 0], ctx.tdPrdO[None, None, None, stage],
                 zero_init=True, wait=wait_s)
        return acc_s, acc_dp

    def col_stat_count(self, ctx) -> int:
        """A lane's share of a per-query statistic (`row_stats` loads it; `col_stat` fetches the
        other columns from the lanes that hold them)."""
        return 2 * (-(-self.tile_m // 64))  # a partial 64-column block still takes its 2

    def col_stat_index(self, ctx, r: int):
        """Value r = 2 k + i is column 64 k + 8 (lane / 4) + 2 (lane % 4) + i."""
        return 64 * (r // 2) + 8 * (ctx.lane // 4) + 2 * (ctx.lane % 4) + r % 2

    @cute.jit
    def col_stat(self, ctx, vals: cute.Tensor, c: cutlass.Constexpr) -> Float32:
        """The statistic of this thread's c-th column (of the (rows, cols) accumulator view):
        column 8 j + 2 (lane % 4) + i with c = 2 j + i, held by lane 4 (j % 8) + lane % 4."""
        j, i = c // 2, c % 2
        if cutlass.const_expr(isinstance(vals, ColumnStats)):  # prefetched into registers
            return vals.regs[c]
        if cutlass.const_expr(self.smem_stats):  # `vals` is the stage's SMEM statistic
            return vals[8 * j + 2 * (ctx.lane % 4) + i]
        return cute.arch.shuffle_sync(vals[i + 2 * (j // 8)], 4 * (j % 8) + ctx.lane % 4)

    @cute.jit
    def prefetch_columns(self, ctx, vals: cute.Tensor, columns: cutlass.Constexpr):
        """This thread's `columns` values of a statistic, read into registers (`prefetch_stats`)."""
        regs = cute.make_rmem_tensor((columns,), Float32)
        for c in cutlass.range_constexpr(columns):
            regs[c] = self.col_stat(ctx, vals, c)
        return ColumnStats(regs)

    @cute.jit
    def probabilities_t(self, ctx, acc_s, lse2: cute.Tensor, m_block: Int32, n_block: Int32,
                        seqlen_q: Int32, seqlen_k: Int32, scale_log2: Float32, partial: cutlass.Constexpr = True):
        """S^T -> P^T in place: softcap or the mods (`partial`: with the mask mod), mask (tiles that
        need it), exp2 with the column's LSE."""
        s_mn = mma.rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, ctx.softcap_scale)
        if cutlass.const_expr(self.has_mods):
            self.apply_mods(ctx, s_mn, m_block, n_block, True, partial)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                self.causal, window=ctx.window):
            mask.apply_transposed(s_mn, ctx.s_coords, n_block * self.tile_n, m_block * self.tile_m,
                                  seqlen_q, seqlen_k, self.causal, window=ctx.window)
        cols = cute.size(s_mn, mode=[1])
        group = self.stat_group if cutlass.const_expr(self.stat_group and self.smem_stats) else 1
        for c0 in cutlass.range_constexpr(0, cols, group):
            lses = [self.col_stat(ctx, lse2, c) for c in range(c0, min(c0 + group, cols))]
            for i, lse in enumerate(lses):
                for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                    s_mn[r, c0 + i] = cute.math.exp2(s_mn[r, c0 + i] * scale_log2 - lse, fastmath=True)

    @cute.jit
    def score_grads_t(self, ctx, acc_p, acc_dp, dsum: cute.Tensor, lse2: cute.Tensor, scale_log2: Float32):
        """dP^T -> dS^T in place, `score_grads` (bwd_pointwise.py) with the statistics per column."""
        p_mn, dp_mn = mma.rows_cols(acc_p), mma.rows_cols(acc_dp)
        inv_scale = self.score_grad_scale(scale_log2)
        for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
            d = self.col_stat(ctx, dsum, c)
            lse = self.col_stat(ctx, lse2, c) if cutlass.const_expr(self.softcap) else d  # read only with a cap
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                p = Float32(p_mn[r, c]) if cutlass.const_expr(self.ds_from_rounded_p) else p_mn[r, c]
                dp_mn[r, c] = self.score_grad(p, dp_mn[r, c], d, lse, inv_scale)

    @cute.jit
    def dv_gemm(self, ctx, p, stage, wait: cutlass.Constexpr):
        """dV += P^T dO with P^T from registers (`p`: the FP32 accumulator, rounded here, or
        already rounded); wait until `wait` remain."""
        if cutlass.const_expr(p.element_type != self.dtype):
            p = mma.to_dtype(p, self.dtype)
        mma.gemm(ctx.dv, ctx.acc_dv, mma.as_a_operand(p), ctx.tdVrdOt[None, None, None, stage], wait=wait)

    @cute.jit
    def dq_gemm_from_ds_t(self, ctx, stage):
        """Issue dQ_i = dS K from dS^T's SMEM buffer `stage` (no wait); returns the accumulator."""
        acc_dq = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        mma.gemm(ctx.dq, acc_dq, ctx.tdQrdS[None, None, None, stage], ctx.tdQrKt[None, None, None, 0],
                 zero_init=True, wait=-1)
        return acc_dq

    @cute.jit
    def consume_step_t(self, ctx, s, q_pipe, q_state, m_block: Int32, n_block: Int32, scale_log2: Float32,
                       do_pipe=None, partial: cutlass.Constexpr = True):
        """One Q tile: S^T and dP^T in flight together; dV issued from P^T's registers, under dP^T
        (`dv_under_dp`) or after dS^T; dK from dS^T's registers; dS^T to SMEM, one barrier, dQ; dQ
        handed off under dK. (dO rides on the Q ring: `do_pipe` is always None here.) `partial`:
        the mask mod runs (every tile but a block mask's full blocks)."""
        lse2, dsum = self.step_stats(ctx, q_pipe, q_state, m_block)
        m_block = q_walk.landed(m_block, q_state)  # (a block-sparse walk's tile, published by the loader)
        stage = q_state.index
        if cutlass.const_expr(self.prefetch_stats and self.smem_stats):
            acc_s, acc_dp = self.scores_t_and_dp_t(ctx, stage, -1)
            lse2 = self.prefetch_columns(ctx, lse2, cute.size(mma.rows_cols(acc_s), mode=[1]))
            warpgroup.wait_group(1)  # D's loads wait for dP^T anyway
        else:
            acc_s, acc_dp = self.scores_t_and_dp_t(ctx, stage, 1)  # S^T has landed, dP^T may still run
        self.probabilities_t(ctx, acc_s, lse2, m_block, n_block, ctx.seq.seqlen_q, ctx.seq.seqlen_k,
                             scale_log2, partial)
        p = acc_s
        if cutlass.const_expr(self.ds_from_rounded_p):  # into the A operand's 32-bit pairs
            p = mma.to_dtype_pairs(acc_s, self.dtype)
        if cutlass.const_expr(self.dv_under_dp):
            self.dv_gemm(ctx, p, stage, 1)
        else:
            warpgroup.wait_group(0)
        if cutlass.const_expr(self.pairs_make_ds()):
            ds = self.paired_score_grads(ctx, p, acc_dp, dsum, by_column=True)  # dP^T has landed
        else:
            self.score_grads_t(ctx, p, acc_dp, dsum, lse2, scale_log2)  # dP^T has landed
            if cutlass.const_expr(self.score_mod_grad is not None):
                self.mod_score_grads(ctx, p, acc_dp, lse2, m_block, n_block, True)
            if cutlass.const_expr(not self.dv_under_dp and not self.ds_from_rounded_p):
                self.dv_gemm(ctx, p, stage, -1)  # S^T's and dP^T's FP32 registers are free now
            ds = mma.to_dtype(acc_dp, self.dtype)
        if cutlass.const_expr(not self.dv_under_dp and self.ds_from_rounded_p):
            self.dv_gemm(ctx, p, stage, -1)  # after dS^T's rounding (spills before it at d64)
        mma.store_to_smem(ds, ctx.sdp, ctx.tidx, s.sdS[None, None, stage])
        cute.arch.fence_view_async_shared()
        # both warpgroups' keys of dS^T are in SMEM; the buffer's last reader (tile i - 2's dQ)
        # was waited for before the barrier of tile i - 1
        self.sync_consumers()
        acc_dq = self.dq_gemm(ctx, stage)
        mma.gemm(ctx.dkv, ctx.acc_dk, mma.as_a_operand(ds), ctx.tdKrQt[None, None, None, stage], wait=1)
        self.hand_off_dq(ctx, s, acc_dq, stage)  # dV and dQ are done, dK may run
        warpgroup.wait_group(0)
        return pipeline.release(q_pipe, q_state)
