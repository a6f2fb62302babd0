"""F1: the default forward (K5.5) on FP8 e4m3 inputs, FlashAttention-3's low-precision forward,
with V^T from a transpose kernel.

The FP8 forward's math (e4m3 WGMMAs, P rounded to e4m3 in the A operand's order, the descales) is
common/fp8_forward.py's, which F2 (kernels/k5_fp8_vt.py) composes too; roles, pipelines, ping-pong,
intra-warpgroup overlap, dynamic schedule and epilogue are the warp-specialized forward's
(common/warp_specialized_forward.py), the mainloop K5's (k5_mainloop.py). What is F1's own:
  * FP8 WGMMA reads B K-major only: P V needs V^T, (d, tile_n) with the keys contiguous. A separate
    kernel (kernels/fp8_transpose.py, launched by fa3.fp8.transpose_v) hands V over transposed,
    (batch, heads_kv, d, keys padded to 16), with the keys of each 16 in the order in which each
    thread packs P (common/fp8_forward.py), so the producer's TMA loads V^T tiles like any other;
    FA3's C++ kernel instead transposes V in SMEM in its producer warpgroup (LDSM.T / STSM; F2
    here), which saves that pass over V.
  * Packed (varlen) batches: the 16-key permutation is counted from each entry's first key, so V^T
    gives every entry its own 16-aligned run of columns, starting at 16 * ceil(cu_k[b] / 16) + 16 b
    (fa3.fp8.transpose_v_packed; the runs cannot overlap: entry b's ends at most 16 columns past
    where entry b + 1's starts without the + 16 b).

Constraints: head_dim 64/128/256, tile_n a multiple of 32 (the WGMMA's k); forward only. Tiles as
K5.5's (kernels/config.fp8_forward_config).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .common import smem, tma
from .common.fp8_forward import Fp8Forward
from .fp8_transpose import KEY_BLOCK
from .k5_mainloop import ForwardMainloop


class Fp8Attention(Fp8Forward, ForwardMainloop):
    value_transposed_by_host = True  # the call passes fa3.fp8.transpose_v(v) (F2: v itself)

    # ---------------------------------------------------------------- host side
    def make_stage_loads(self, mQ, mK, mVt):
        """Q and K as K5 stages them; V^T in (d, tile_n) stages, keys contiguous (K-major for P V)."""
        sQ_layout = smem.tile_layout(self.dtype, self.tile_m, self.head_dim, self.q_stages)
        sK_layout = smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages)
        sV_layout = self.vt_layout()
        loads = (*tma.make_load(tma.seq_major(mQ), sQ_layout, (self.tile_m, self.head_dim)),
                 *tma.make_load(tma.seq_major(mK), sK_layout, (self.tile_n, self.head_dim)),
                 *tma.make_load(tma.seq_major(mVt), sV_layout, (self.head_dim, self.tile_n)))
        return sQ_layout, sK_layout, sV_layout, loads

    # ---------------------------------------------------------------- device side
    def v_rows(self, mVt: cute.Tensor, head_kv: Int32, batch: Int32, seq) -> cute.Tensor:
        """The entry's V^T for one KV head, (d, keys); packed: from its own 16-aligned column."""
        if cutlass.const_expr(self.varlen):
            first = (seq.offset_k + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK + KEY_BLOCK * batch
            return cute.domain_offset((0, first), mVt[None, None, head_kv, 0])
        return mVt[None, None, head_kv, batch]

    def v_tiles(self, gVt: cute.Tensor) -> cute.Tensor:
        """One head's V^T, (d, keys), as (d, tile_n) tiles indexed by the last mode."""
        return cute.local_tile(gVt, (self.head_dim, self.tile_n), (0, None))
