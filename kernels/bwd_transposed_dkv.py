"""The backward with dK and dV computed transposed, for the wide head dims (the kernel's
`dkv_transposed`, b9 at d192 and d256; FlashAttention-3's `dKV_swapAB`).

Row-major dK and dV are (tile_n, d) accumulators: the K/V tile is the WGMMA's M, so it comes in
whole 64-row atoms per warpgroup, and at d192/d256 the registers (two (tile_n, d) FP32
accumulators) and SMEM (two Q/dO stages beside a 64 x d FP32 dQ buffer) leave 64-key tiles, one
Q/dO stage at d256. Here the same GEMMs produce the transposes:

    dV^T += dO^T P     (d, tile_n)   A = dO^T (MN-major, SMEM), B = P^T viewed (N, K) (MN-major, SMEM)
    dK^T += Q^T dS     (d, tile_n)   A = Q^T  (MN-major, SMEM), B = dS^T viewed (N, K) (MN-major, SMEM)

The head dim is now M: d256's 256 rows split into 128 a warpgroup, d192's 192 (three atoms) do
not halve, so there the warpgroups split the keys instead (48 of 96 each; P and dS take the
32-byte swizzle so a warpgroup's 48 columns are whole atoms). The key count is N, any multiple of
8 a warpgroup: 96 keys at d192 and 64 at d256. S, dP and dQ stay row-major (S and dP split the
keys among the warpgroups).

Its configurations pair it with one dO stage (`do_stages` = 1, bwd_setup.py): dO_i comes in a
ring of its own, waited for between S and dP and released as soon as dV^T is done, while Q keeps
two stages. The SMEM it frees buys 64-key tiles at d256 (cuDNN's width; with two Q/dO stages only
48 fit, flash-attn-4's) and a dQ buffer per warpgroup at d192; the dQ hand-off goes through
mbarriers, at d256 through one share buffer the warpgroups take in turns (`dq_mbarriers`,
`shared_dq_buffer`, bwd_dq_handoff.py). SMEM (bf16) d192: Q 2 x 24 KB, dO 24 KB, K/V 72 KB, P/dS
24 KB, dQ 2 x 24 KB = 216 KB; d256: Q 2 x 32 KB, dO 32 KB, K/V 64 KB, P/dS 16 KB, dQ 32 KB = 208 KB.

After the walk dK and dV leave as the row-major ones do (rows through the free sK/sV tiles,
16-byte stores, bwd_dkv_store.py), written into the tiles through the transposed view element by
element (once per CTA).
"""

import cutlass
import cutlass.cute as cute

from .common import mma, smem


class TransposedDkv:
    """Mixin of the warp-specialized backward (bwd_ws.py), which picks these pieces where its
    `dkv_transposed` is set: dK^T's and dV^T's tiles, MMAs, operands and SMEM layouts."""

    # ---------------------------------------------------------------- host side
    def dkv_split_n(self, head_dim: int | None = None) -> bool:
        """Whether the warpgroups split dK^T's (or dV^T's: `head_dim` = head_dim_v) keys (d192:
        three 64-row atoms do not halve) rather than its head dim rows."""
        return ((head_dim or self.head_dim) // 64) % self.mma_warpgroups != 0

    def dkv_t_tile(self, head_dim: int | None = None):
        """The (rows, cols) of the dK^T and dV^T accumulators: (d, keys)."""
        return head_dim or self.head_dim, self.tile_n

    def dkv_t_mma(self, head_dim: int):
        """dK^T's (head_dim) or dV^T's (head_dim_v) tiled MMA: (head dim, tile_n)."""
        return mma.tiled_mma(self.dtype, *self.dkv_t_tile(head_dim), a_major="MN", b_major="MN",
                             warpgroups=self.mma_warpgroups, split_n=self.dkv_split_n(head_dim))

    def dkv_t_layouts(self, head_dim: int | None = None, stages: int | None = None):
        """Q and dO: K-major A of S/dP and MN-major A of dK^T/dV^T (d256: 128 rows a warpgroup,
        whole 128-byte atoms); K: MN-major B of dQ as in the row-major layouts; P and dS: MN-major
        B of dK^T/dV^T, whose keys the warpgroups split at d192 (the swizzle fits a warpgroup's
        share; with head_dim_v, whichever of dK^T and dV^T splits them). `head_dim`, `stages`: as
        `smem_layouts`'."""
        wgs, d = self.mma_warpgroups, head_dim or self.head_dim
        # the keys a warpgroup writes (S's split: 24 at d256) or reads (dK^T/dV^T's at d192)
        split = self.dkv_split_n() or self.dkv_split_n(self.head_dim_v)
        key_share = min(mma.n_share(self.tile_m, self.tile_n, wgs),
                        self.tile_n // wgs if split else self.tile_n)
        return (smem.tile_layout(self.dtype, self.tile_m, d, stages or self.q_stages),
                smem.tile_layout(self.dtype, self.tile_n, d, 1, share=mma.n_share(self.tile_m, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_m, self.tile_n, 1, share=key_share))

    def dkv_t_operands(self, s, wg_dkv) -> dict:
        """dV^T's and dK^T's (A, B) fragments: dO^T and P^T viewed (N, K), Q^T and dS^T."""
        t = mma.transpose_view
        dv = self.dv_t_operands(s, wg_dkv) if self.head_dim_v == self.head_dim else {}  # (else mma_setup's)
        return dict(**dv, tdKrQt=mma.fragment_A(wg_dkv, t(s.sQ)), tdKrdSt=mma.fragment_B(wg_dkv, t(s.sdS)))

    def dv_t_operands(self, s, wg_dv) -> dict:
        """dV^T's (A, B) fragments: dO^T and P^T viewed (N, K)."""
        t = mma.transpose_view
        return dict(tdVrdOt=mma.fragment_A(wg_dv, t(s.sdO)), tdVrPt=mma.fragment_B(wg_dv, t(s.sP)))

    # ---------------------------------------------------------------- device side
    @cute.jit
    def issue_dkv_t(self, ctx, s, stage, do_stage=None):
        """dV^T += dO^T P and dK^T += Q^T dS, every operand from SMEM (no wait); dO from
        `do_stage` (default: Q's `stage`)."""
        do_stage = stage if cutlass.const_expr(do_stage is None) else do_stage
        mma.gemm(ctx.dv, ctx.acc_dv, ctx.tdVrdOt[None, None, None, do_stage], ctx.tdVrPt[None, None, None, 0], wait=-1)
        mma.gemm(ctx.dkv, ctx.acc_dk, ctx.tdKrQt[None, None, None, stage], ctx.tdKrdSt[None, None, None, 0], wait=-1)

    @cute.jit
    def dkv_t_to_smem(self, ctx, frag: cute.Tensor, sX: cute.Tensor, tiled: cute.TiledMma):
        """dK^T or dV^T (rounded) into the (tile_n, d) tile sX through its transposed view."""
        mma.store_to_smem(frag, tiled, ctx.tidx, mma.transpose_view(sX), transpose=True)
