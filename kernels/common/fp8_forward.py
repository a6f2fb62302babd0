"""The warp-specialized forward on FP8 e4m3 q, k, v, FlashAttention-3's low-precision forward:
what F1 (kernels/k5_fp8.py, V^T from a transpose kernel) and F2 (kernels/k5_fp8_vt.py, V^T
transposed in SMEM by the producer warpgroup) share. Roles, pipelines, ping-pong, intra-warpgroup
overlap, dynamic schedule and epilogue are WarpSpecializedForward's, unchanged; the mainloop is
K5's (kernels/k5_mainloop.py) with the three P hooks below.

  * Q, K and V are float8_e4m3fn; both GEMMs run `wgmma.mma_async ... k32 .e4m3.e4m3` (32 deep,
    twice the 16-bit rate); S and O accumulate in FP32; O is written in mO's type (bf16 or fp16).
  * FP8 WGMMA reads B K-major only: P V reads V^T, (d, tile_n) tiles with the keys contiguous
    (`vt_layout`); the rung says where they come from.
  * P = exp(S - max), computed times 2^8 (softmax.online_update's p_offset_log2: small
    probabilities stay out of e4m3's subnormals; 256 < 448, e4m3's largest), is rounded to e4m3 in
    registers and fed as the register A operand of P V. The FP32 accumulator and the FP8 A fragment
    do not hold the same columns: per k32 block a thread holds S columns {2t, 2t+1} + 8g (g < 4, t
    its lane in the quad), and A bytes for k = 4t + {0..3} + 16h (h < 2). Instead of exchanging
    bytes across the quad (FA3's permute of the registers), each thread packs its own values
    (mma.fp8_a_order): A position 16h + 4t + j takes key 8(2h + j // 2) + 2t + j % 2. That is a
    fixed permutation of the keys inside each 16, and V^T's key order is permuted the same way
    where it is transposed (F1: fa3.fp8.transpose_v; F2: its producer warpgroup), so P V sums the
    same products.
  * Descales (float32, (batch, heads_kv)): q_descale * k_descale of the tile's KV head is folded
    into the exp2 scale (or, with softcap, into the tanh's scale), v_descale into 1/l at the end.

Constraints: head_dim 64/128/256, tile_n a multiple of 32 (the WGMMA's k); forward only. Tiles as
K5.5's (kernels/config.fp8_forward_config).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..config import ForwardConfig
from . import mma, smem
from .warp_specialized_forward import WarpSpecializedForward

# softmax.online_update's p_offset_log2: P in (0, 256]
P_OFFSET_LOG2 = 8


class Fp8Forward(WarpSpecializedForward):
    v_major = "K"  # P V reads V^T: (d, tile_n) tiles, keys contiguous
    p_offset_log2 = P_OFFSET_LOG2

    def __init__(self, dtype, head_dim: int, causal: bool, config: ForwardConfig, varlen: bool = False,
                 local: bool = False, softcap: bool = False):
        """`dtype` is the output's (bf16 or fp16); q, k and v are e4m3. `config`:
        kernels/config.fp8_forward_config's."""
        assert config.tile_n % 32 == 0, "FP8 WGMMA is 32 keys deep: tile_n must be a multiple of 32"
        super().__init__(cutlass.Float8E4M3FN, head_dim, causal, config, varlen, local, softcap)
        self.out_dtype = dtype

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mQDescale: cute.Tensor,
                 mKDescale: cute.Tensor, mVDescale: cute.Tensor, stream):
        """K5's arguments, with V as mVt (F1: V^T, (batch, d, heads_kv, keys padded to 16), keys
        permuted within each 16 by the host; F2, which transposes V itself: V's rows, as K) and
        the descales (batch, heads_kv) float32 after them."""
        self.launch(mQ, mK, mVt, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCuSeqlensK, window_left, window_right, softcap_scale,
                    (mQDescale, mKDescale, mVDescale), stream)

    def vt_layout(self):
        """The V^T ring P V reads: (d, tile_n) tiles, keys contiguous."""
        return smem.tile_layout(self.dtype, self.head_dim, self.tile_n, self.kv_stages)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mO_rows: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, mQDescale: cute.Tensor,
               mKDescale: cute.Tensor, mVDescale: cute.Tensor, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, epi_tile: cutlass.Constexpr,
               SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2, mTileCounter,
                   mCuSeqlensQ, mCuSeqlensK, window_left, window_right, softcap_scale, None,
                   (mQDescale, mKDescale, mVDescale), sQ_layout, sKV_layout, sV_layout, sO_layout,
                   epi_tile, SharedStorage)

    def tile_scales(self, ctx, scale_log2: Float32, batch: Int32, head: Int32, params):
        """The descales of the tile's KV head: q * k into the score scale, v into O's."""
        q_descale, k_descale, v_descale = params.descales
        head_kv = head // params.group
        qk_descale = q_descale[batch, head_kv] * k_descale[batch, head_kv]
        ctx.o_scale = v_descale[batch, head_kv]
        if cutlass.const_expr(self.softcap):  # scores are capped first: tanh(s * scale / cap)
            ctx.softcap_scale = ctx.softcap_scale * qk_descale
            return scale_log2
        return scale_log2 * qk_descale

    def new_p(self, ctx, acc_s: cute.Tensor) -> cute.Tensor:
        """P's e4m3 registers in the A fragment's byte order (4 bytes a register)."""
        return cute.make_rmem_tensor(mma.fp8_a_shape(acc_s), self.dtype)

    def convert_p(self, p: cute.Tensor, acc_s: cute.Tensor):
        """Round P (FP32, the accumulator) to e4m3, each thread's values packed in A order."""
        mma.fp8_a_view(p).store(mma.fp8_a_order(acc_s).load().to(self.dtype))

    def p_operand(self, p: cute.Tensor) -> cute.Tensor:
        return p
