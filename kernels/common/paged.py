"""Paged KV caches: which row of which page holds a key (one home), and the row gather for pages
smaller than a key block.

A paged cache is (num_pages, page_size, heads_kv, d) with block_table[b, i] the page holding keys
[i * page_size, (i + 1) * page_size) of sequence b: key `key` of sequence b is row key % page_size
of page block_table[b, key // page_size]. Every page index read from the table is clamped to
[0, num_pages), so a bad entry (a CUDA graph replayed with a table no host check saw) reads some
page of the pool: meaningless results, never memory outside the cache.

Two ways to fill a (tile_n, d) key block of the SMEM ring:
* page_size a multiple of tile_n: the block is one TMA box of one page (`block_page`).
* any other page size (1, 16, 48, ...): the block's rows come from several pages. `RowGather`
  copies them row by row with cp.async, 16 bytes per copy, into the same swizzled SMEM stage a
  TMA box would fill (the swizzle permutes 16-byte chunks, so a chunk lands whole). Each producer
  thread's copies complete on the stage's full mbarrier (cp.async.mbarrier.arrive.noinc: the
  barrier expects one arrival per producer thread, pipeline.create_gather). K and V may differ in
  width (MLA: 64-wide keys, a 512-wide latent): the rows are laid out for the narrower, and each
  thread copies the same chunk of every narrow-width group of the wider one's row. Rows past the
  sequence's keys are not copied: they keep what the stage held (the consumers mask K there and
  zero V), and the table entries past a sequence's pages are never read.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from . import smem

CHUNK_BYTES = 16  # one cp.async: 8 bf16/fp16 elements


@cute.jit
def page_of(mBlockTable: cute.Tensor, batch: Int32, entry: Int32, num_pages: Int32) -> Int32:
    """Page block_table[batch, entry], clamped to [0, num_pages)."""
    return cutlass.max(cutlass.min(mBlockTable[batch, entry], num_pages - 1), 0)


@cute.jit
def key_location(mBlockTable: cute.Tensor, batch: Int32, key: Int32, page_size: Int32,
                 num_pages: Int32):
    """(page, row within the page) of key `key` of sequence `batch`."""
    return page_of(mBlockTable, batch, key // page_size, num_pages), key % page_size


@cute.jit
def block_page(mBlockTable: cute.Tensor, batch: Int32, n_block: Int32, tile_n: cutlass.Constexpr,
               page_size: Int32, num_pages: Int32):
    """(page, block within the page) of key block n_block, for pages holding whole blocks."""
    blocks_per_page = page_size // tile_n
    return page_of(mBlockTable, batch, n_block // blocks_per_page, num_pages), n_block % blocks_per_page


class RowGather:
    """cp.async copies of a (tile_n, head_dim) key block from scattered cache rows, by the first
    `active` of `threads` threads (t: the index among them): thread t copies 16-byte chunk
    t % chunks of rows t // chunks + i * rows_per_pass. `active` is the most threads that cover
    whole rows and divide the block: all of them for d 64/128/256, 96 of 128 for d96 (12 chunks a
    row) and d192 (24). A tensor copied beside it may be a multiple of head_dim wide (MLA's
    latent, 512 beside the 64-wide keys): the same rows, thread t taking chunk t % chunks of each
    head_dim-wide group (a warp's copy still reads whole 128-byte lines at d64)."""

    def __init__(self, dtype, tile_n: int, head_dim: int, threads: int):
        self.dtype, self.tile_n, self.head_dim, self.threads = dtype, tile_n, head_dim, threads
        self.elems = CHUNK_BYTES * 8 // dtype.width
        self.chunks = head_dim // self.elems  # per row
        self.rows_per_pass, self.active = smem.row_passes(tile_n, self.chunks, threads)

    def thread_copy(self, tidx: Int32):
        """This thread's slice of the tiled cp.async copy (16 bytes per copy, L2 only: each row is
        read once)."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.dtype, num_bits_per_copy=CHUNK_BYTES * 8)
        threads = cute.make_ordered_layout((self.rows_per_pass, self.chunks), order=(1, 0))
        tiled = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, self.elems)))
        return tiled, tiled.get_slice(tidx % self.active)  # (threads past `active` copy nothing)

    @cute.jit
    def locate(self, tidx: Int32, mBlockTable: cute.Tensor, batch: Int32, n_block: Int32,
               seqlen_k: Int32, page_size: Int32, num_pages: Int32):
        """(valid, page, row) of each row this thread copies in key block n_block: the table reads,
        issued before the stage is free so that their latency hides behind the wait. Rows past the
        sequence read its last key's entry (always one of its pages) and are not copied."""
        rows = []
        limit = seqlen_k
        if cutlass.const_expr(self.active < self.threads):  # idle threads: no row is theirs
            limit = seqlen_k * (1 - cutlass.min(cutlass.max(tidx - (self.active - 1), 0), 1))
        for i in cutlass.range_constexpr(self.tile_n // self.rows_per_pass):
            key = n_block * self.tile_n + tidx // self.chunks + i * self.rows_per_pass
            page, row = key_location(mBlockTable, batch, cutlass.min(key, seqlen_k - 1), page_size, num_pages)
            rows.append((key < limit, page, row))
        return rows

    @cute.jit
    def copy(self, tidx: Int32, rows, copies):
        """Issue this thread's copies of the located rows: `copies` is a list of (mX, sX) pairs
        sharing the rows (K and V), mX the cache as (page_size, d_x, pages) of one head, sX one
        (tile_n, d_x) stage, d_x a multiple of head_dim (its groups: the class's docstring)."""
        tiled, thr = self.thread_copy(tidx)
        chunk = tidx % self.chunks
        for i in cutlass.range_constexpr(self.tile_n // self.rows_per_pass):
            valid, page, row = rows[i]
            if valid:
                for mX, sX in copies:
                    for g in cutlass.range_constexpr(cute.size(sX, mode=[1]) // self.head_dim):
                        dst = thr.partition_D(sX)[None, i, g]
                        at = chunk if g == 0 else chunk + g * self.chunks  # (g = 0: as before the groups)
                        src = cute.local_tile(mX[row, None, page], (self.elems,), (at,))
                        cute.copy(tiled, cute.make_tensor(src.iterator, dst.layout), dst)
