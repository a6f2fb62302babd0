"""F1: the default forward (K5.5) on FP8 e4m3 inputs, FlashAttention-3's low-precision forward.

What changes against K5 (roles, pipelines, ping-pong, intra-warpgroup overlap, dynamic schedule and
epilogue are K5's, unchanged):
  * Q, K and V are float8_e4m3fn; both GEMMs run `wgmma.mma_async ... k32 .e4m3.e4m3` (32 deep,
    twice the 16-bit rate); S and O accumulate in FP32; O is written in mO's type (bf16 or fp16).
  * FP8 WGMMA reads B K-major only: P V needs V^T, (d, tile_n) with the keys contiguous. A separate
    kernel (kernels/fp8_transpose.py, launched by fa3.fp8.transpose_v) hands V over transposed,
    (batch, heads_kv, d, keys padded to 16), so the producer's TMA loads V^T tiles like any other; FA3's C++ kernel instead transposes V in
    SMEM in its producer warpgroup (LDSM.T / STSM), which saves that pass over V.
  * P = exp(S - max), computed times 2^8 (softmax.online_update's p_offset_log2: small
    probabilities stay out of e4m3's subnormals; 256 < 448, e4m3's largest), is rounded to e4m3 in
    registers and fed as the register A operand of P V. The FP32 accumulator and the FP8 A fragment
    do not hold the same columns: per k32 block a thread holds S columns {2t, 2t+1} + 8g (g < 4, t
    its lane in the quad), and A bytes for k = 4t + {0..3} + 16h (h < 2). Instead of exchanging
    bytes across the quad (FA3's permute of the registers), each thread packs its own values
    (mma.fp8_a_order): A position 16h + 4t + j takes key 8(2h + j // 2) + 2t + j % 2. That is a
    fixed permutation of the keys inside each 16, and V^T's key order is permuted the same way when
    it is transposed (transpose_v), so P V sums the same products.
  * Descales (float32, (batch, heads_kv)): q_descale * k_descale of the tile's KV head is folded
    into the exp2 scale (or, with softcap, into the tanh's scale), v_descale into 1/l at the end.

  * Packed (varlen) batches: the 16-key permutation is counted from each entry's first key, so V^T
    gives every entry its own 16-aligned run of columns, starting at 16 * ceil(cu_k[b] / 16) + 16 b
    (fa3.fp8.transpose_v_packed; the runs cannot overlap: entry b's ends at most 16 columns past
    where entry b + 1's starts without the + 16 b).

Constraints: head_dim 64/128/256, tile_n a multiple of 32 (the WGMMA's k); forward only. Tiles as
K5.5's (registry).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import mma, smem, tma
from .fp8_transpose import KEY_BLOCK
from .k5 import WarpSpecializedAttention

# softmax.online_update's p_offset_log2: P in (0, 256]
P_OFFSET_LOG2 = 8


class Fp8Attention(WarpSpecializedAttention):
    v_major = "K"  # V arrives as V^T: (d, tile_n) tiles, keys contiguous
    value_transposed_by_host = True  # the call passes fa3.fp8.transpose_v(v) (F2: v itself)
    p_offset_log2 = P_OFFSET_LOG2

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 128, tile_n: int = 128,
                 kv_stages: int = 2, q_stages: int = 1, pingpong: bool = True,
                 intra_wg_overlap: bool = True, dynamic_schedule: bool = False,
                 varlen: bool = False, local: bool = False, softcap: bool = False):
        """`dtype` is the output's (bf16 or fp16); q, k and v are e4m3."""
        if local and head_dim == 256 and tile_n > 64:
            # the window's state beside 128-wide S tiles at d256 spills (408-484 bytes): K5.5's
            # 64-wide tiles
            tile_n = 64
        assert tile_n % 32 == 0, "FP8 WGMMA is 32 keys deep: tile_n must be a multiple of 32"
        super().__init__(cutlass.Float8E4M3FN, head_dim, causal, tile_m, tile_n, kv_stages, q_stages,
                         pingpong, intra_wg_overlap, dynamic_schedule, varlen, local, softcap)
        self.out_dtype = dtype

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mQDescale: cute.Tensor,
                 mKDescale: cute.Tensor, mVDescale: cute.Tensor, stream):
        """K5's arguments, with V as mVt (batch, d, heads_kv, keys padded to 16; keys permuted
        within each 16 by the host; F2, which transposes V itself: V's rows, as K) and the
        descales (batch, heads_kv) float32 after them."""
        self.launch(mQ, mK, mVt, mO, mLSE, scale_log2, sm_count, mTileCounter, mCuSeqlensQ,
                    mCuSeqlensK, window_left, window_right, softcap_scale,
                    (mQDescale, mKDescale, mVDescale), stream)

    def make_stage_loads(self, mQ, mK, mVt):
        """Q and K as K5 stages them; V^T in (d, tile_n) stages, keys contiguous (K-major for P V)."""
        sQ_layout = smem.tile_layout(self.dtype, self.tile_m, self.head_dim, self.q_stages)
        sK_layout = smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages)
        sV_layout = self.vt_layout()
        loads = (*tma.make_load(tma.seq_major(mQ), sQ_layout, (self.tile_m, self.head_dim)),
                 *tma.make_load(tma.seq_major(mK), sK_layout, (self.tile_n, self.head_dim)),
                 *tma.make_load(tma.seq_major(mVt), sV_layout, (self.head_dim, self.tile_n)))
        return sQ_layout, sK_layout, sV_layout, loads

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

    def v_rows(self, mVt: cute.Tensor, head_kv: Int32, batch: Int32, seq) -> cute.Tensor:
        """The entry's V^T for one KV head, (d, keys); packed: from its own 16-aligned column."""
        if cutlass.const_expr(self.varlen):
            first = (seq.offset_k + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK + KEY_BLOCK * batch
            return cute.domain_offset((0, first), mVt[None, None, head_kv, 0])
        return mVt[None, None, head_kv, batch]

    def v_tiles(self, gVt: cute.Tensor) -> cute.Tensor:
        """One head's V^T, (d, keys), as (d, tile_n) tiles indexed by the last mode."""
        return cute.local_tile(gVt, (self.head_dim, self.tile_n), (0, None))

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
