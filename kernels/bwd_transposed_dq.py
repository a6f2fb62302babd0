"""The backward with dQ computed transposed, on the transposed scores (the kernel's `dq_transposed`,
b6 and b7).

With S^T = K Q^T (bwd_transposed_scores.py) the Q tile is the N of S^T and dP^T and the K of
dV += P^T dO and dK += dS^T Q. Only dQ_i = dS K has the Q tile as its M. Computed transposed,

    dQ_i^T = K^T dS^T             (d, tile_m)       A = K^T  (MN-major, sK),  B = dS (MN-major, sdS^T)

each warpgroup owns 64 of the d rows, and the Q tile only has to be a multiple of 16 (dQ^T takes
it as its N; the configurations keep 64 (kernels/config.py): 80-row tiles, FlashAttention-3's and
flash-attn-4's d128 tile without a mask, spilled here and ran slower, worklog/backward.md). A
warpgroup's transposed share of dQ_i (its columns 64 w .. 64 w + 63) travels to the writer in
fragment order as any dQ share does (bwd_dq_handoff.py), whole or per warpgroup; the postprocess
reads the fragments back through the transposed partition (`dq_view`).

Constraints: head_dim 128 (d stacked over the two warpgroups in 64-row WGMMA atoms). Registers a
consumer thread at 64 x 128 tiles: S^T and dP^T 32 each, dV and dK 64 each, dQ^T 32.
"""

import cutlass.cute as cute
from cutlass import Float32

from .common import mma


class TransposedDq:
    """Mixin of the warp-specialized backward (bwd_ws.py), which picks these pieces where its
    `dq_transposed` is set: dQ^T's tiled MMA, operands, GEMM and view."""

    def dq_t_mma(self):
        """dQ^T = K^T dS^T's tiled MMA, the warpgroups stacked along d."""
        return mma.tiled_mma(self.dtype, self.head_dim, self.tile_m, a_major="MN", b_major="MN",
                             warpgroups=self.mma_warpgroups)

    def dq_t_fragments(self, s, wg_dq) -> dict:
        """dQ^T = K^T dS^T: K^T is A, dS (the transposed view of sdS^T) is B."""
        t = mma.transpose_view
        return dict(tdQrKt=mma.fragment_A(wg_dq, t(s.sK)), tdQrdS=mma.fragment_B(wg_dq, t(s.sdS)))

    @cute.jit
    def dq_t_gemm(self, ctx, stage):
        """Issue dQ_i^T = K^T dS^T (no wait); returns the (d, tile_m) accumulator."""
        acc_dqt = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.head_dim, self.tile_m)), Float32)
        mma.gemm(ctx.dq, acc_dqt, ctx.tdQrKt[None, None, None, 0], ctx.tdQrdS[None, None, None, stage],
                 zero_init=True, wait=-1)
        return acc_dqt
