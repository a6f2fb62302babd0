"""K5: K4.2's math, warp-specialized, with FlashAttention-3's two overlaps.

Roles (common/warp_specialized_forward.py; block = 128 * (1 + consumer warpgroups) threads): a
producer warpgroup whose warp 0 issues every TMA copy (Q once, then K_j and V_j on separate
pipelines, so that a K stage is released as soon as S = Q K^T has read it), and two or three
consumer warpgroups that take its registers (setmaxnreg), each owning 64 rows of the Q tile and
running both GEMMs and the softmax, K/V tiles from the last to the first (the masked tiles first).
Substages (flags and tiles; all five are one class):
    K5.1  warp specialization only. Per tile: S = QK^T, wait, softmax, O += PV, wait.
    K5.2  + ping-pong: named barriers make the consumer warpgroups take turns issuing GEMMs, so
          one warpgroup's softmax runs under another's GEMMs (warpgroup 1 starts with a credit;
          common/pingpong.py).
    K5.3  + intra-warpgroup overlap: issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; softmax S_j
          while P V is in flight; the first tile's S and the last tile's P V form the prologue and
          epilogue. P_{j-1} lives in its own registers while S_j is computed.
    K5.4  (tiles, not code) three consumer warpgroups on 192-row Q tiles at d64, the turn passing
          1 -> 2 -> 3 -> 1.
    K5.5  + dynamic schedule (causal): after tile blockIdx, a CTA takes whichever tile a GMEM
          counter hands out next, so CTAs that drew short tiles take more (common/scheduler.py).
The class composes two pieces: the roles, the loads' pipelines and the epilogue
(WarpSpecializedForward, which the FP8 forward and K5 over a KV cache compose too) and the
consumers' per-tile math (both mainloops, the softmax step, P's conversion: ForwardMainloop,
k5_mainloop.py); the tile state (the two WGMMAs' fragments, O's accumulator, the row softmax state,
O's finalization) and the Q/K/V stage loads beneath them are common/attention_tiles.py's, which K4
(the rung this one's math comes from) uses too. This module holds the launch on 16-bit operands,
with the attention sinks, and its flex-attention forms (WarpSpecializedFlexAttention: the same
kernel with score and mask mods compiled in, their captured tensors one more argument;
BlockSparseFlexAttention: and a BlockMask's block lists another, only the listed K/V tiles loaded
and visited, common/kv_walk.py). No rung's class is a base class.
Epilogue: O (scaled by 1/l) and LSE are written once from registers; with attention sinks (a
compile-time variant) each query head's sink logit joins l and the LSE there (softmax.finalize),
and nowhere else: the mainloop is unchanged.

Constraints: head_dim 64/96/128/192/256 (tiles per head dim: kernels/config.forward_config); the
register split is 24 / 240 (producer / two consumer warpgroups) or 32 / 160 (three), sum <= 64K
registers per SM.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common.warp_specialized_forward import WarpSpecializedForward
from .k5_mainloop import ForwardMainloop


class WarpSpecializedAttention(WarpSpecializedForward, ForwardMainloop):
    """K5.1-K5.5 on 16-bit q, k, v (WarpSpecializedForward's constructor: the configuration, the
    variants)."""

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mSinks: cute.Tensor, stream):
        """mQ/mK/mV/mO (batch, seqlen, heads, d), mLSE (batch, heads_q, seqlen_q). Varlen: batch 1,
        the sequences packed along seqlen at the int32 offsets mCuSeqlensQ/K (batch + 1,); otherwise
        those are unread stand-ins, as are the window edges (mask.py), softcap_scale
        (softmax.softcap) and mSinks (heads_q,) FP32 (softmax.finalize) when their variant is off
        (the kernel then takes None in mSinks' place: no parameter)."""
        self.launch(mQ, mK, mV, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCuSeqlensK, window_left, window_right, softcap_scale,
                    (mSinks if cutlass.const_expr(self.sinks) else None,), stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, mSinks: Optional[cute.Tensor],
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               epi_tile: cutlass.Constexpr, SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2, mTileCounter,
                   mCuSeqlensQ, mCuSeqlensK, window_left, window_right, softcap_scale, mSinks, None,
                   sQ_layout, sKV_layout, sV_layout, sO_layout, epi_tile, SharedStorage)


class WarpSpecializedFlexAttention(WarpSpecializedForward, ForwardMainloop):
    """K5 with flex attention's mods compiled in (constructor: WarpSpecializedForward's, with
    `score_mod` and/or `mask_mod`): the mods run on S in registers after Q K^T and before the row
    max, on every tile (common/mask.apply_mods); the tensors they captured arrive as `aux`, one
    tuple of tensors in the mods' order (fa3/flex.py). A score mod sees softmax_scale * q k^T: the
    host passes softmax_scale in softcap_scale's place and log2(e) as scale_log2. Rows the mods
    hide entirely give O = 0 and LSE = -inf (softmax.py). Kept apart from WarpSpecializedAttention
    so that its launch signature (and every configuration without mods) is unchanged."""

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mSinks: cute.Tensor, aux: tuple, stream):
        """WarpSpecializedAttention's arguments, and `aux`: the mods' captured tensors."""
        self.launch(mQ, mK, mV, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCuSeqlensK, window_left, window_right, softcap_scale,
                    (mSinks if cutlass.const_expr(self.sinks) else None, aux), stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, mSinks: Optional[cute.Tensor], aux: tuple,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               epi_tile: cutlass.Constexpr, SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2, mTileCounter,
                   mCuSeqlensQ, mCuSeqlensK, window_left, window_right, softcap_scale, mSinks, None,
                   sQ_layout, sKV_layout, sV_layout, sO_layout, epi_tile, SharedStorage, aux=aux)


class BlockSparseFlexAttention(WarpSpecializedForward, ForwardMainloop):
    """WarpSpecializedFlexAttention with flex attention's block sparsity (constructor:
    WarpSpecializedForward's, with the mods): one more argument, `block_lists`, a BlockMask's
    (kv_num_blocks, kv_indices[, full_kv_num_blocks, full_kv_indices]), int32, (batch or 1, heads_q
    or 1, q_blocks[, kv_blocks]). Per Q tile the producer warp loads, and the consumers visit, only
    the listed K/V tiles: the partial blocks with the mask mod, then the full blocks without it
    (common/kv_walk.py); the score mod runs on both. A tile with no block stores O = 0 and
    LSE = -inf. The blocks are the kernel's tiles (BLOCK_SIZE == (tile_m, tile_n)); non-causal, no
    window, not varlen. The tiles' lengths come from the lists and differ as causal ones do (a
    causal or document mask), so where the rung schedules dynamically (K5.5) they are handed out
    from the tile counter in the non-causal order (a head's Q tiles from the last), not b, b +
    grid, ... (the host passes a counter for block lists: fa3/_launch.run_attention)."""

    def __init__(self, *args, **kwargs):
        WarpSpecializedForward.__init__(self, *args, **kwargs)
        if self.causal or self.local or self.varlen:
            raise ValueError("block sparsity takes no causal, window or varlen variant: the block mask says "
                             "what is visible")
        self.dynamic = self.config.dynamic_schedule

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mSinks: cute.Tensor, aux: tuple,
                 block_lists: tuple, stream):
        """WarpSpecializedFlexAttention's arguments, and `block_lists`."""
        self.launch(mQ, mK, mV, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCuSeqlensK, window_left, window_right, softcap_scale,
                    (mSinks if cutlass.const_expr(self.sinks) else None, aux, block_lists), stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, mSinks: Optional[cute.Tensor], aux: tuple,
               block_lists: tuple, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               epi_tile: cutlass.Constexpr, SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2, mTileCounter,
                   mCuSeqlensQ, mCuSeqlensK, window_left, window_right, softcap_scale, mSinks, None,
                   sQ_layout, sKV_layout, sV_layout, sO_layout, epi_tile, SharedStorage, aux=aux,
                   block_lists=block_lists)
