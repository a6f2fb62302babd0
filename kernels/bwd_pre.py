"""The backward's preprocess: per query row, D = rowsum(dO * O) and LSE in the exp2 domain, and
the dQ accumulator zeroed.

    D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]       (FP32)
    LSE2[b, h, i] = LSE[b, h, i] * log2(e)                      (so P = exp2(S * scale_log2 - LSE2))
    dQacc[b, i, h, :] = 0                                       (the main kernel adds into it)

Both statistics are written for rows_out >= seqlen_q rows (the main kernel's Q tiles rounded up),
so the main kernel reads them without bounds checks: rows past seqlen_q, and rows that saw no key
(LSE = -inf), get LSE2 = +inf (P = 0: they add nothing and get zero gradient) and D = 0. The
zeroing rides along (one launch and one pass fewer than a separate fill): every row of dQacc.

Packed batches (`varlen`): the statistics go into whole-tile slots, as the fragment-order dQ
accumulator's rows do (kernels/bwd.py, packed_q_tile): entry b's Q tile m at slot
cu_seqlens_q[b] // tile_m + b + m, rows past the entry's end filled with LSE2 = +inf and D = 0. A
main kernel then reads a packed Q tile's statistics exactly as a fixed-length one's (by TMA, or
unchecked loads), never the next entry's rows. Each CTA takes rows_per_cta rows of one packed Q
tile (tiles numbered as the main kernel's grid numbers them, common/scheduler.py varlen_tile) and
zeroes its dQ rows: the tile's slot rows (`dq_in_slots`, fragment order), or its packed rows.

Memory-bound; it reads dO and O once, in 16-byte vectors: a row's d / 8 vectors go to a group of
`group` lanes (d / 8 rounded up to a power of two, at most 32: d = 96 and 192 leave lanes of each
group idle), the group sums its products with a butterfly. Each thread first loads every row it
owns in the CTA (`PASSES` of them), so their loads are in flight together.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import scheduler, seqlen
from .common.softmax import LOG2E

VEC = 8  # bf16/fp16 elements in 16 bytes
WARPS = 4
PASSES = 4  # rows a thread group handles per CTA


class BackwardPreprocess:
    def __init__(self, dtype, head_dim: int, head_dim_v: int | None = None, varlen: bool = False,
                 tile_m: int = 64, dq_in_slots: bool = False):
        """head_dim: dQ's columns; head_dim_v: O's and dO's (default head_dim). varlen: a packed
        batch, statistics in slots of the main kernel's tile_m rows (module doc); dq_in_slots: its
        dQ accumulator too (fragment order), else packed rows."""
        head_dim_v = head_dim_v or head_dim
        assert head_dim % VEC == 0 and head_dim_v % VEC == 0 and max(head_dim, head_dim_v) <= 32 * VEC
        self.dtype, self.head_dim, self.head_dim_v = dtype, head_dim, head_dim_v
        self.vectors = head_dim // VEC  # per row of dQ
        self.vectors_v = head_dim_v // VEC  # per row of O and dO
        self.group = min(32, 1 << (max(self.vectors, self.vectors_v) - 1).bit_length())
        self.rows_per_cta = WARPS * (32 // self.group) * PASSES
        self.varlen, self.tile_m, self.dq_in_slots = varlen, tile_m, dq_in_slots
        assert not varlen or tile_m % self.rows_per_cta == 0, "a packed Q tile in whole CTAs"

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mdQacc: cute.Tensor, mCuSeqlensQ: cute.Tensor, stream):
        """mO, mdO: (batch, seqlen_q, heads, head_dim_v); mLSE: (batch, heads, seqlen_q);
        mLSE2, mD: (batch, heads, rows_out) FP32 outputs; mdQacc: (batch, dq_rows, heads, d) FP32,
        zeroed. Varlen: batch 1, seqlen_q the packed rows, rows_out whole slots of tile_m rows
        (as many as packed Q tiles can reach: total_q // tile_m + entries + 1), mCuSeqlensQ the
        entries' offsets (unused otherwise)."""
        batch, heads, rows_out = mLSE2.shape
        blocks = cute.ceil_div(cutlass.max(rows_out, mdQacc.shape[1]), self.rows_per_cta)
        if cutlass.const_expr(self.varlen):  # every slot's worth of packed Q tiles (the rest exit)
            blocks = rows_out // self.rows_per_cta
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQacc, mCuSeqlensQ).launch(
            grid=[blocks, heads, batch], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.jit
    def cta_rows(self, block: Int32, mO: cute.Tensor, mLSE2: cute.Tensor, mdQacc: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor):
        """(packed row of the CTA's first row, its statistics' row, its dQ row, rows of O to read,
        statistic rows to write, dQ rows to zero), each count from the CTA's first row."""
        first = block * self.rows_per_cta
        src, dst, dq, reads, writes, zeroes = first, first, first, mO.shape[1] - first, \
            mLSE2.shape[2] - first, mdQacc.shape[1] - first
        if cutlass.const_expr(self.varlen):
            parts = self.tile_m // self.rows_per_cta
            entry, m_block, tiles = scheduler.varlen_tile(block // parts, mCuSeqlensQ, self.tile_m, mO.shape[1])
            start, length = seqlen.packed_span(mCuSeqlensQ, entry, mO.shape[1])
            part = (block % parts) * self.rows_per_cta
            src = start + m_block * self.tile_m + part
            dst = (start // self.tile_m + entry + m_block) * self.tile_m + part  # the tile's slot
            reads = length - m_block * self.tile_m - part
            writes = Int32(self.rows_per_cta)
            if tiles == 0:  # past the last packed Q tile
                reads, writes = Int32(0), Int32(0)
            dq, zeroes = src, reads
            if cutlass.const_expr(self.dq_in_slots):
                dq, zeroes = dst, writes
        return src, dst, dq, reads, writes, zeroes

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQacc: cute.Tensor, mCuSeqlensQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        vec, sub = lane % self.group, lane // self.group  # the vector in the row, the row in the warp
        src, dst, dq, reads, writes, zeroes = self.cta_rows(block, mO, mLSE2, mdQacc, mCuSeqlensQ)
        groups_per_pass = WARPS * (32 // self.group)
        first = warp * (32 // self.group) + sub  # this group's first row in the CTA's
        o = cute.make_rmem_tensor((VEC, PASSES), self.dtype)  # a row's vector contiguous
        do = cute.make_rmem_tensor((VEC, PASSES), self.dtype)
        o.fill(0.0)
        do.fill(0.0)
        for p in cutlass.range_constexpr(PASSES):
            row = first + p * groups_per_pass
            if row < reads and vec < self.vectors_v:
                cute.autovec_copy(cute.local_tile(mO[batch, src + row, head, None], (VEC,), (vec,)), o[None, p])
                cute.autovec_copy(cute.local_tile(mdO[batch, src + row, head, None], (VEC,), (vec,)), do[None, p])
        zeros = cute.make_rmem_tensor((VEC,), Float32)
        zeros.fill(0.0)
        for p in cutlass.range_constexpr(PASSES):
            row = first + p * groups_per_pass
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                dot += Float32(do[i, p]) * Float32(o[i, p])
            dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.group)
            if row < writes and vec == 0:
                lse2 = Float32.inf
                if row < reads:
                    lse = mLSE[batch, head, src + row]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2E)
                mD[batch, head, dst + row] = dot
                mLSE2[batch, head, dst + row] = lse2
            if row < zeroes and vec < self.vectors:
                cute.autovec_copy(zeros, cute.local_tile(mdQacc[batch, dq + row, head, None], (VEC,), (vec,)))
