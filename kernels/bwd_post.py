"""The backward's postprocess for dQ accumulated in fragment order (the warp-specialized kernel,
b2 on).

Those rungs hand each warpgroup's FP32 dQ share of a Q tile to the writer warp in the order the
warpgroup holds it in registers ("fragment order": thread t's element i at 512 (i / 4) + 4 t + i % 4
of the share, so each thread stores 16-byte vectors and a warp 512 contiguous bytes), and the writer
adds the share into the accumulator with one 1-D bulk reduce-add. The accumulator is head-major,
(batch, heads, Q tiles, tile_m x d): each Q tile's elements are contiguous, warpgroup w's share
at w x tile_m x d / warpgroups.

    dQ[b, m tile_m + r, h, c] = scale * dQacc[b, h, m, the fragment position of (r, c)]

One CTA per (Q tile, head, batch) with the rung's consumer threads: thread t of warpgroup w loads
exactly the 16-byte vectors it stored as consumer thread 128 w + t, so the fragment's coordinates
come from the rung's own dQ MMA (`dq_coords`, the partition the consumers used); the scaled values go to an
SMEM tile (tile_m, d) in the output dtype, row-major with 8 elements of padding a row (the
fragment's scattered 2-byte stores spread over the banks), and leave it row by row in 16-byte
vectors, rows past seqlen_q skipped.

Packed batches (the rung's `varlen`): one CTA per Q tile of the entries in a row (found by a warp's
search of cu_seqlens_q, as the forward's grid), its tile read from the entry's `packed_q_tile` slot
and its rows past the entry's end skipped.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import accum, scheduler, seqlen, smem

PAD = 8  # elements of padding an SMEM row


class FragmentDqPostprocess:
    def __init__(self, rung):
        """`rung`: the backward kernel object whose accumulator this converts (its dtype, tile_m,
        head_dim, mma_warpgroups, varlen, half_elems, dq_coords, fragment_view, packed_q_tile)."""
        self.rung = rung
        self.dtype, self.tile_m, self.head_dim = rung.dtype, rung.tile_m, rung.head_dim
        self.warpgroups, self.varlen = rung.mma_warpgroups, rung.varlen
        self.threads = 128 * self.warpgroups

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, mCuSeqlensQ: cute.Tensor,
                 stream):
        """mdQacc: (batch, rows, heads, d) FP32, a view of the head-major accumulator (rows whole
        Q tiles; packed: batch 1, the rung's `packed_q_tile` slots); mdQ: (batch, seqlen_q, heads,
        d) in the output dtype (packed: (1, total_q, heads, d)); mCuSeqlensQ: read when packed."""
        batch, rows, heads = mdQacc.shape[0], mdQacc.shape[1], mdQacc.shape[2]
        tiles = rows // self.tile_m
        if cutlass.const_expr(self.varlen):  # every entry's Q tiles in a row (as the forward's grid)
            tiles = cute.ceil_div(mdQ.shape[1], self.tile_m) + mCuSeqlensQ.shape[0] - 1

        @cute.struct
        class SharedStorage:
            tile: cute.struct.Align[cute.struct.MemRange[self.dtype, self.tile_m * (self.head_dim + PAD)], 128]

        self.kernel(mdQacc, mdQ, scale, mCuSeqlensQ, SharedStorage).launch(
            grid=[tiles, heads, batch], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def tile_work(self, block: Int32, batch: Int32, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor):
        """(batch, accumulator row, first dQ row, rows to write) of this CTA's Q tile;
        packed: the block-th Q tile of the entries in a row, in its entry's slot (0 rows past the
        last tile)."""
        seqlen_q = mdQ.shape[1]
        if cutlass.const_expr(self.varlen):
            entry, m_block, blocks = scheduler.varlen_tile(block, mCuSeqlensQ, self.tile_m, seqlen_q)
            seq = seqlen.from_cu_seqlens(mCuSeqlensQ, mCuSeqlensQ, entry, seqlen_q, seqlen_q)
            rows = seq.seqlen_q - m_block * self.tile_m
            if blocks == 0:
                rows = Int32(0)
            return (Int32(0), self.rung.packed_q_tile(seq, m_block, entry) * self.tile_m,
                    seq.offset_q + m_block * self.tile_m, rows)
        row0 = block * self.tile_m
        return batch, row0, row0, seqlen_q - row0

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, mCuSeqlensQ: cute.Tensor,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        warpgroup, t = tidx // 128, tidx % 128
        d = self.head_dim
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sdQ = storage.tile.get_tensor(cute.make_layout((self.tile_m, d), stride=(d + PAD, 1)))
        acc_batch, acc_row, row0, rows = self.tile_work(block, batch, mdQ, mCuSeqlensQ)

        if rows > 0:  # (the whole CTA alike)
            # this thread's vectors of its warpgroup's share, then their (row, column) in the tile
            share = cute.make_tensor(accum.elem_ptr(mdQacc, (acc_batch, acc_row, head, 0))
                                     + warpgroup * self.rung.half_elems(), cute.make_layout(self.rung.half_elems()))
            src = self.rung.fragment_view(share, t)
            vals = cute.make_rmem_tensor(src.shape, Float32)
            for j in cutlass.range_constexpr(cute.size(src, mode=[1])):
                cute.autovec_copy(src[None, j], vals[None, j])
            coords = self.rung.dq_coords(tidx)
            for i in cutlass.range_constexpr(cute.size(coords)):
                r, c = coords[i]
                sdQ[r, c] = self.dtype(vals[i % 4, i // 4] * scale)
            cute.arch.barrier()

            smem.store_rows(((sdQ, cute.domain_offset((row0, 0), mdQ[acc_batch, None, head, None])),),
                            rows, tidx, self.threads)
