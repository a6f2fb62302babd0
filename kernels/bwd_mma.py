"""The backward's five GEMMs (the table in bwd.py's docstring): their tiled MMAs, every operand
fragment (SMEM descriptors, transposed views where a GEMM reads a tile the other way round), the
dK/dV accumulators, and the calls that issue them. A mixin of both backward kernels; the
warp-specialized one (bwd_ws.py) changes the tiles and views through the hooks (`score_tile`,
`dkv_tile`, `dkv_view`, `tiled_mmas`, `dkv_mma`, `operand_fragments`, `dkv_operands`,
`dv_operands`, `issue_dkv`) by flag: `scores_transposed` computes S^T and dP^T
(bwd_transposed_scores.py), `dq_transposed` dQ^T (bwd_transposed_dq.py), `dkv_transposed` dK^T
and dV^T (bwd_transposed_dkv.py).
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .common import mma, pipeline


class BackwardMmas:
    # ---------------------------------------------------------------- setup
    def mma_setup(self, s, tidx):
        """The three tiled MMAs, every operand fragment (SMEM descriptors, transposed views where
        the GEMM reads a tile the other way round) and the dK/dV accumulators."""
        sdp, dkv, dq = self.tiled_mmas()
        thr_sdp, thr_dkv, thr_dq = sdp.get_slice(tidx), dkv.get_slice(tidx), dq.get_slice(tidx)
        wg_sdp, wg_dkv, wg_dq = (mma.warpgroup_slice(m, tidx) for m in (sdp, dkv, dq))
        ctx = SimpleNamespace(
            sdp=sdp, dkv=dkv, dq=dq, thr_sdp=thr_sdp, thr_dkv=thr_dkv, thr_dq=thr_dq, tidx=tidx,
            lane=tidx % 32, **self.operand_fragments(s, wg_sdp, wg_dkv, wg_dq),
            s_coords=mma.rows_cols(thr_sdp.partition_C(cute.make_identity_tensor(self.score_tile()))),
        )
        # dV's MMA: dK's, or one with head_dim_v columns (its own fragments) where V's differs
        ctx.dv, ctx.thr_dv = dkv, thr_dkv
        if self.head_dim_v != self.head_dim:
            ctx.dv = self.dkv_mma(self.head_dim_v)
            ctx.thr_dv = ctx.dv.get_slice(tidx)
            vars(ctx).update(self.dv_operands(s, mma.warpgroup_slice(ctx.dv, tidx)))
        ctx.acc_dv = cute.make_rmem_tensor(ctx.thr_dv.partition_shape_C(self.dkv_tile(self.head_dim_v)), Float32)
        ctx.acc_dk = cute.make_rmem_tensor(thr_dkv.partition_shape_C(self.dkv_tile()), Float32)
        ctx.acc_dv.fill(0.0)
        ctx.acc_dk.fill(0.0)
        return ctx

    def score_tile(self):
        """The (rows, cols) of the S and dP accumulators: (queries, keys)."""
        return self.tile_m, self.tile_n

    def score_matrices(self) -> int:
        """8x8 blocks a `stmatrix` of P or dS writes: 4, or 2 where a warpgroup's share of the
        keys is an odd multiple of 8 (mma.smem_writer)."""
        return 4 if mma.n_share(*self.score_tile(), self.mma_warpgroups) % 16 == 0 else 2

    def dkv_tile(self, head_dim: int | None = None):
        """The (rows, cols) of the dK and dV accumulators: (keys, d) (`dkv_transposed`: (d, keys)); dV's with
        `head_dim` = head_dim_v."""
        return self.tile_n, head_dim or self.head_dim

    def dkv_view(self, tile: cute.Tensor) -> cute.Tensor:
        """A (tile_n, d) tensor seen in the shape of the dK/dV accumulators (`dkv_tile`)."""
        return tile

    def tiled_mmas(self):
        """(S and dP, dV and dK, dQ) tiled MMAs."""
        wgs = self.mma_warpgroups
        return (mma.tiled_mma(self.dtype, self.tile_m, self.tile_n, warpgroups=wgs),
                self.dkv_mma(self.head_dim),
                mma.tiled_mma(self.dtype, self.tile_m, self.head_dim, b_major="MN", warpgroups=wgs))

    def dkv_mma(self, head_dim: int):
        """The tiled MMA of dK (head_dim) or dV (head_dim_v): a `dkv_tile` accumulator from SMEM
        operands."""
        return mma.tiled_mma(self.dtype, *self.dkv_tile(head_dim), a_major="MN", b_major="MN",
                             warpgroups=self.mma_warpgroups)

    def operand_fragments(self, s, wg_sdp, wg_dkv, wg_dq) -> dict:
        """Every GEMM's A and B descriptors, from the warpgroup slices (see mma.warpgroup_slice)."""
        t = mma.transpose_view
        return dict(
            tSrQ=mma.fragment_A(wg_sdp, s.sQ), tSrK=mma.fragment_B(wg_sdp, s.sK),
            tdPrdO=mma.fragment_A(wg_sdp, s.sdO), tdPrV=mma.fragment_B(wg_sdp, s.sV),
            **self.dkv_operands(s, wg_dkv),
            tdQrdS=mma.fragment_A(wg_dq, s.sdS), tdQrKt=mma.fragment_B(wg_dq, t(s.sK)))

    def dkv_operands(self, s, wg_dkv) -> dict:
        """dV's and dK's (A, B) fragments: P^T and dO^T, dS^T and Q^T (`dkv_transposed`: their transposes)."""
        t = mma.transpose_view
        # (dV's own where V's head dim differs: mma_setup)
        dv = self.dv_operands(s, wg_dkv) if self.head_dim_v == self.head_dim else {}
        return dict(**dv, tdKrdSt=mma.fragment_A(wg_dkv, t(s.sdS)), tdKrQt=mma.fragment_B(wg_dkv, t(s.sQ)))

    def dv_operands(self, s, wg_dv) -> dict:
        """dV's (A, B) fragments: P^T and dO^T."""
        t = mma.transpose_view
        return dict(tdVrPt=mma.fragment_A(wg_dv, t(s.sP)), tdVrdOt=mma.fragment_B(wg_dv, t(s.sdO)))

    # ---------------------------------------------------------------- issue
    @cute.jit
    def scores_and_dp(self, ctx, stage, wait_s: cutlass.Constexpr, do_pipe=None, do_state=None):
        """Issue S = Q K^T and dP = dO V^T back to back; wait until `wait_s` groups remain (1: S
        has landed, dP may still run; 0: both). do_pipe/do_state (`split_do`): dO's own ring,
        waited for between the two."""
        acc_s = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_dp = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(ctx.sdp, acc_s, ctx.tSrQ[None, None, None, stage], ctx.tSrK[None, None, None, 0],
                 zero_init=True, wait=-1)
        do_stage = stage
        if cutlass.const_expr(do_pipe is not None):
            pipeline.consume_wait(do_pipe, do_state)
            do_stage = do_state.index
        mma.gemm(ctx.sdp, acc_dp, ctx.tdPrdO[None, None, None, do_stage], ctx.tdPrV[None, None, None, 0],
                 zero_init=True, wait=wait_s)
        return acc_s, acc_dp

    @cute.jit
    def issue_dkv(self, ctx, s, stage, do_stage=None):
        """dV += P^T dO and dK += dS^T Q, from the SMEM copies of P and dS (no wait); dO from
        `do_stage` (default: Q's `stage`)."""
        do_stage = stage if cutlass.const_expr(do_stage is None) else do_stage
        mma.gemm(ctx.dv, ctx.acc_dv, ctx.tdVrPt[None, None, None, 0], ctx.tdVrdOt[None, None, None, do_stage], wait=-1)
        mma.gemm(ctx.dkv, ctx.acc_dk, ctx.tdKrdSt[None, None, None, 0], ctx.tdKrQt[None, None, None, stage], wait=-1)

    @cute.jit
    def issue_dq(self, ctx, wait: cutlass.Constexpr):
        """dQ_i = dS K (this K/V tile's share), fresh accumulator."""
        acc_dq = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        mma.gemm(ctx.dq, acc_dq, ctx.tdQrdS[None, None, None, 0], ctx.tdQrKt[None, None, None, 0],
                 zero_init=True, wait=wait)
        return acc_dq
