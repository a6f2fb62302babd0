"""The backward's pointwise steps, S -> P and dP -> dS, on a consumer thread's accumulator
registers (the (rows, cols) view of common/mma.py), with each row's statistics (S = Q K^T; the
transposed scores read them per column: bwd_transposed_scores.py):

    P  = exp2(S * scale_log2 - LSE * log2 e)   after the softcap and the mask
    dS = P * (dP - D)                          times 1 - t^2 for capped scores

and, where P is rounded to 16 bits for the next GEMM anyway (`ds_in_pairs`), dS from those rounded
pairs: each pair of adjacent columns' dP - D rounded into one 32-bit pair and multiplied by P's
pair in 16-bit arithmetic (one mul.rn.bf16x2), which is also dS's rounding for the GEMMs. P's
FP32 registers then die at P's rounding, before dP lands, and P is never widened back. It costs
accuracy (one more rounding of dP - D: dQ and dK errors about 1.4x; worklog/backward.md, b8).

Flex attention's mods (the warp-specialized backward's flex form, kernels/bwd_ws.FlexBackward):
S is recomputed as the forward saw it, the score and mask mods applied before the positional masks
(common/mask.apply_mods), and dS is multiplied by the score mod's derivative where it is not 1
(`mod_score_grads`: dS = P (dP - D) * d score_mod / d score, the scale applied later as ever).
A mixin of both backward kernels (kernels/bwd.py, kernels/bwd_ws.py).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import mask, mma, softmax


class PointwiseGradients:
    # dS multiplied in 16-bit pairs from the rounded P (`paired_score_grads`; capped scores keep
    # the FP32 product: their 1 - t^2 needs P's logarithm). b8's, on the transposed scores;
    # prepared for the row-major ones (b2, b9)
    ds_in_pairs = False
    # flex attention's mods (fa3/mods.py's ModSource, set by the flex form's constructor): the score
    # and mask mods, and the score mod's derivative where it is not 1 (a number or a ModSource)
    score_mod = mask_mod = score_mod_grad = None

    def pairs_make_ds(self) -> bool:
        """Whether this variant's dS comes from P's rounded pairs (`ds_in_pairs`; not capped, no
        score mod derivative to multiply by)."""
        return self.ds_in_pairs and not self.softcap and self.score_mod_grad is None

    @property
    def has_mods(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @cute.jit
    def probabilities(self, ctx, acc_s, lse2: cute.Tensor, m_block: Int32, n_block: Int32,
                      seqlen_q: Int32, seqlen_k: Int32, scale_log2: Float32, partial: cutlass.Constexpr = True):
        """S -> P in place: softcap (the capped variant) or the mods (`partial`: with the mask mod),
        mask (tiles that need it), then exp2(S * scale_log2 - LSE * log2 e)."""
        s_mn = mma.rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, ctx.softcap_scale)
        if cutlass.const_expr(self.has_mods):
            self.apply_mods(ctx, s_mn, m_block, n_block, False, partial)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                self.causal, window=ctx.window):
            mask.apply(s_mn, ctx.s_coords, m_block * self.tile_m, n_block * self.tile_n, seqlen_q,
                       seqlen_k, self.causal, window=ctx.window)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * scale_log2 - lse2[r], fastmath=True)

    @cute.jit
    def apply_mods(self, ctx, s_mn: cute.Tensor, m_block: Int32, n_block: Int32, transposed: cutlass.Constexpr,
                   partial: cutlass.Constexpr = True):
        """The forward's mods on this tile's S (or S^T, `transposed`), on every tile: the score mod
        sees softmax_scale * S (the host passes softmax_scale in softcap_scale's slot and log2 e as
        scale_log2, as to the forward), the mask mod hides with -inf (common/mask.apply_mods) where
        `partial` (every tile but a block mask's full blocks, which take the score mod alone)."""
        row0, col0 = m_block * self.tile_m, n_block * self.tile_n
        if cutlass.const_expr(transposed):
            row0, col0 = col0, row0
        mask_mod = self.mask_mod if cutlass.const_expr(partial) else None
        if cutlass.const_expr(self.score_mod is not None or mask_mod is not None):
            mask.apply_mods(s_mn, ctx.s_coords, row0, col0, ctx.batch, ctx.head, ctx.softcap_scale,
                            mask.bind_mod(self.score_mod, ctx.aux), mask.bind_mod(mask_mod, ctx.aux), transposed)

    @cute.jit
    def mod_score_grads(self, ctx, acc_p, acc_ds, lse2, m_block: Int32, n_block: Int32,
                        transposed: cutlass.Constexpr):
        """dS *= d score_mod / d score in place (`score_mod_grad`: a number, or a function of the
        mod's output, which common/mask.score_mod_grad recovers from P and the LSE), after
        `score_grads` (P still in `acc_p`: FP32, or rounded with `ds_from_rounded_p`). `transposed`:
        S^T's views, the LSE per column (`col_stat`)."""
        p_mn, ds_mn = mma.rows_cols(acc_p), mma.rows_cols(acc_ds)
        grad = mask.bind_mod(self.score_mod_grad, ctx.aux)
        constant = isinstance(grad, (int, float))
        row0, col0 = m_block * self.tile_m, n_block * self.tile_n
        if cutlass.const_expr(transposed):
            row0, col0 = col0, row0
        for c in cutlass.range_constexpr(cute.size(ds_mn, mode=[1])):
            lse = Float32(0.0)
            if cutlass.const_expr(transposed and not constant):
                lse = self.col_stat(ctx, lse2, c)
            for r in cutlass.range_constexpr(cute.size(ds_mn, mode=[0])):
                if cutlass.const_expr(not transposed and not constant):
                    lse = lse2[r]
                q_idx, kv_idx = mask.mod_index(ctx.s_coords, r, c, row0, col0, transposed)
                p = p_mn[r, c]
                if cutlass.const_expr(p_mn.element_type != Float32):
                    p = Float32(p)
                ds_mn[r, c] = ds_mn[r, c] * mask.score_mod_grad(grad, p, lse, ctx.batch, ctx.head, q_idx, kv_idx)

    @cute.jit
    def score_grads(self, acc_p, acc_dp, dsum: cute.Tensor, lse2: cute.Tensor, scale_log2: Float32):
        """dP -> dS = P * (dP - D) in place. Capped scores (z = cap * t, t = tanh(s * scale / cap))
        also take dz/ds's 1 - t^2 (the scale is applied later, as without a cap); t is recovered
        from P itself, t = (log2 P + LSE * log2 e) / scale_log2, so no register holds it meanwhile,
        and where P = 0 (masked, or no contribution) the factor is 0, not 0 * inf."""
        p_mn, dp_mn = mma.rows_cols(acc_p), mma.rows_cols(acc_dp)
        inv_scale = self.score_grad_scale(scale_log2)
        for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                dp_mn[r, c] = self.score_grad(p_mn[r, c], dp_mn[r, c], dsum[r], lse2[r], inv_scale)

    @cute.jit
    def score_grad_scale(self, scale_log2: Float32) -> Float32:
        """What `score_grad` multiplies by to recover t: 1 / scale_log2 (capped scores only)."""
        return cute.arch.rcp_approx(scale_log2) if cutlass.const_expr(self.softcap) else scale_log2

    @cute.jit
    def score_grad(self, p: Float32, dp: Float32, dsum: Float32, lse2: Float32, inv_scale: Float32) -> Float32:
        """One element of dS = P * (dP - D), times 1 - t^2 for capped scores (see score_grads)."""
        ds = p * (dp - dsum)
        if cutlass.const_expr(self.softcap):
            t = (cute.math.log2(p, fastmath=True) + lse2) * inv_scale
            ds = ds * (1.0 - t * t) if p > 0.0 else Float32(0.0)
        return ds

    @cute.jit
    def paired_score_grads(self, ctx, p: cute.Tensor, acc_dp: cute.Tensor, dsum,
                           by_column: cutlass.Constexpr = False) -> cute.Tensor:
        """dS = P (dP - D), rounded, from the rounded P's 32-bit pairs (see the module docstring);
        D per row, or per column (`by_column`: S^T, each column pair's read once). Returns dS in
        the input type, in the accumulator's layout."""
        ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
        p32, ds32 = cute.recast_tensor(p, Int32), cute.recast_tensor(ds, Int32)
        dp_mn = mma.rows_cols(acc_dp)
        for c in cutlass.range_constexpr(0, cute.size(dp_mn, mode=[1]), 2):  # columns c, c + 1
            if cutlass.const_expr(by_column):
                d0, d1 = self.col_stat(ctx, dsum, c), self.col_stat(ctx, dsum, c + 1)
            for r in cutlass.range_constexpr(cute.size(dp_mn, mode=[0])):
                if cutlass.const_expr(not by_column):
                    d0 = d1 = dsum[r]
                pair = cute.crd2idx((r, c), dp_mn.layout) // 2
                x = mma.pack_16bit_pair(dp_mn[r, c] - d0, dp_mn[r, c + 1] - d1, self.dtype)
                ds32[pair] = mma.mul_16bit_pairs(p32[pair], x, self.dtype)
        return ds
