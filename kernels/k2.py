"""K2: one fused kernel, FlashAttention-2 style, scalar FP32 arithmetic.

Algorithm (one CTA per (Q tile, head, batch)):
    load the Q tile (tile_m x d) into SMEM once
    for each K/V tile j (up to the causal diagonal):
        load K_j into the shared K/V buffer;          S = Q K_j^T  (per thread, FP32 FMAs)
        mask; online softmax (running max m, sum l; O *= exp2((m_old - m_new) * scale_log2))
        P -> SMEM;  load V_j into the same buffer;    O += P V_j
    O /= l; write O and LSE once.

Threads: 4 per query row (256 for tile_m = 64), a "quad" as in the WGMMA accumulator of K4: each
thread holds tile_n/4 scores and d/4 output columns, interleaved (column = lane + 4 * i), and row
max/sum are reduced across the quad with two butterfly shuffles. SMEM rows are padded by one 4-byte
word so that the 8 rows a warp reads at once fall in different banks.

Constraints: head_dim 64/128/256; tile_m = 64 (4 threads a row); K and V share one buffer, so the
kernel loads, computes, syncs and loads again: no overlap of memory and math (K3 adds it).
The compute body (thread_row, scores, softmax_step, store_p, accumulate_pv, epilogue) is
common/scalar_tile.py's, which K3 runs on each stage of its ring; this rung's own is the kernel
around it: one buffer, plain loads.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import mask
from .common.scalar_tile import ScalarTileMath

PAD = 2  # elements (one 4-byte word of 16-bit data) added to each SMEM row


class FusedTiledAttention(ScalarTileMath):
    """One CTA per (Q tile, head, batch); the constructor is ScalarTileMath's (dtype, head_dim,
    causal, tile_m, tile_n)."""

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, stream):
        batch, seqlen_q, heads_q, _ = mQ.shape
        tile_layout = lambda rows: cute.make_layout((rows, self.head_dim), stride=(self.head_dim + PAD, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout(self.tile_m))], 128]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile_layout(self.tile_n))], 128]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * (self.tile_n + 1)], 128]

        self.kernel(mQ, mK, mV, mO, mLSE, scale_log2, SharedStorage).launch(
            grid=[cute.ceil_div(seqlen_q, self.tile_m), heads_q, batch],
            block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, scale_log2: Float32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, heads_q = mQ.shape[1], mQ.shape[2]
        seqlen_k, heads_kv = mK.shape[1], mK.shape[2]
        head_kv = head // (heads_q // heads_kv)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        padded = lambda rows, cols, pad: cute.make_layout((rows, cols), stride=(cols + pad, 1))
        sQ = storage.sQ.get_tensor(padded(self.tile_m, self.head_dim, PAD))
        sKV = storage.sKV.get_tensor(padded(self.tile_n, self.head_dim, PAD))
        sP = storage.sP.get_tensor(padded(self.tile_m, self.tile_n, 1))

        gQ = cute.local_tile(mQ[batch, None, head, None], (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(mK[batch, None, head_kv, None], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[batch, None, head_kv, None], (self.tile_n, self.head_dim), (None, 0))

        self.load_tile(gQ, sQ, seqlen_q - m_block * self.tile_m, tidx)
        row, lane, row_global, limit = self.thread_row(tidx, m_block, seqlen_q, seqlen_k)
        acc_o, row_max, row_sum = self.row_accumulators()

        for n_block in cutlass.range(mask.n_block_max(m_block, self.tile_m, self.tile_n, seqlen_q,
                                                      seqlen_k, self.causal)):
            cute.arch.sync_threads()  # the previous tile's P V is done with sKV and sP
            self.load_tile(gK[None, None, n_block], sKV, seqlen_k - n_block * self.tile_n, tidx)
            cute.arch.sync_threads()
            scores = self.scores(sQ, sKV, row, lane)
            self.softmax_step(scores, row_max, row_sum, acc_o, limit - n_block * self.tile_n,
                              lane, scale_log2)
            self.store_p(scores, sP, row, lane)
            cute.arch.sync_threads()  # every thread is done reading K
            self.load_tile(gV[None, None, n_block], sKV, seqlen_k - n_block * self.tile_n, tidx)
            cute.arch.sync_threads()
            self.accumulate_pv(sP, sKV, acc_o, row, lane)

        self.epilogue(acc_o, row_max, row_sum, mO, mLSE, batch, head, row_global, lane, scale_log2)

    @cute.jit
    def load_tile(self, gX: cute.Tensor, sX: cute.Tensor, valid_rows: Int32, tidx: Int32):
        """Plain loads of a (rows, d) tile, coalesced along d; rows past the end read as zero."""
        rows = cute.size(sX, mode=[0])
        for it in cutlass.range_constexpr(rows * self.head_dim // self.num_threads):
            idx = tidx + it * self.num_threads
            r, c = idx // self.head_dim, idx % self.head_dim
            val = self.dtype(0.0)
            if r < valid_rows:
                val = gX[r, c]
            sX[r, c] = val
