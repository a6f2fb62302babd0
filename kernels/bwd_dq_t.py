"""B6: B3 with dQ computed transposed, and dV issued after dS^T.

B3 computes S^T = K Q^T, so the Q tile is the N of S^T and dP^T and the K of dV += P^T dO and
dK += dS^T Q. Only dQ_i = dS K has the Q tile as its M. B6 computes it transposed,

    dQ_i^T = K^T dS^T             (d, tile_m)       A = K^T  (MN-major, sK),  B = dS (MN-major, sdS^T)

with each warpgroup owning 64 of the d rows. Its share travels to the writer in fragment order as
B2's does (the postprocess reads the fragments back through the transposed partition, `dq_view`).
And B6 issues dV += P^T dO after dS^T, when S^T's and dP^T's FP32 registers are free, where B3
issues it under dP^T.

Measured on an H100 (d128, 2k-16k, causal and not), when dQ still went through a swizzled FP32
tile (written transposed, 16-row TMA reduce-add boxes): 1.01-1.07x B4 in every cell of a
three-round run, 0.99-1.08x over three runs. Taken apart (one run): dV after dS^T alone, on B4,
0.97-1.06x; B6 with dV under dP^T, 0.95-1.02x of B6.

The Q tile only has to be a multiple of 16 here (dQ^T takes it as its N). 80-row tiles, as
FlashAttention-3's C++ backward and flash-attn-4 run d128 without a mask, compiled then (48 B of
spills) and ran 4-10% slower than 64: the registry row takes 64.

Constraints: head_dim 128, two Q stages. SMEM (bf16, 64 rows): B3's 192 KB. Registers a consumer
thread: S^T and dP^T 32 each, dV and dK 64 each, dQ^T 32.
"""
import cutlass.cute as cute
from cutlass import Float32

from .bwd_swap import SwappedBackward
from .common import mma


class TransposedDqBackward(SwappedBackward):
    q_tile_multiple = 16  # N of S^T and dP^T, K of dV and dK; dQ^T takes it as its N
    dv_under_dp = False  # under dP^T: 0.95-1.02x (and 148 B of spills at 80 rows)

    # ---------------------------------------------------------------- device side
    def tiled_mmas(self):
        """B3's S^T/dP^T and dV/dK MMAs; dQ^T = K^T dS^T with the warpgroups stacked along d."""
        sdp, dkv, _ = super().tiled_mmas()
        return sdp, dkv, mma.tiled_mma(self.dtype, self.head_dim, self.tile_m, a_major="MN", b_major="MN",
                                       warpgroups=self.mma_warpgroups)

    def dq_fragments(self, s, wg_dq) -> dict:
        """dQ^T = K^T dS^T: K^T is A, dS (the transposed view of sdS^T) is B."""
        t = mma.transpose_view
        return dict(tdQrKt=mma.fragment_A(wg_dq, t(s.sK)), tdQrdS=mma.fragment_B(wg_dq, t(s.sdS)))

    @cute.jit
    def dq_gemm(self, ctx, stage):
        """Issue dQ_i^T = K^T dS^T (no wait); returns the (d, tile_m) accumulator."""
        acc_dqt = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.head_dim, self.tile_m)), Float32)
        mma.gemm(ctx.dq, acc_dqt, ctx.tdQrKt[None, None, None, 0], ctx.tdQrdS[None, None, None, stage],
                 zero_init=True, wait=-1)
        return acc_dqt

    def dq_view(self, tile: cute.Tensor) -> cute.Tensor:
        return mma.transpose_view(tile)  # the accumulator is dQ^T
