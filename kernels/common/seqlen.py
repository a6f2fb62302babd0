"""Per batch entry: how many queries and keys there are (one home for sequence lengths).

Fixed-shape calls read them from the tensors' shapes; a KV cache holds `cache_seqlens[b]` valid
keys (plus the tokens appended this call) out of its capacity; packed batches (`cu_seqlens`) place
each entry's rows at an offset of one packed tensor, and a packed batch over a KV cache takes its
queries from `cu_seqlens_q` and its keys from the cache. The producer, the split-KV range,
masking and the epilogue all ask this one object instead of each computing their own.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def from_cache(mCacheSeqlens: cute.Tensor, batch: Int32, seqlen_q: Int32, appended: Int32,
               capacity: Int32, mLeftpad=None):
    """Entry `batch` of a KV cache: keys are the cache's first cache_seqlens[batch] rows plus the
    `appended` rows written this call, clamped to [0, capacity] so that no load leaves the cache.
    A left-padded cache (`mLeftpad`, flash-attn's cache_leftpad) starts at row cache_leftpad[batch]
    (clamped into those rows): the keys are the rows from there (offset_k) to the end."""
    seqlen_k = _cached_keys(mCacheSeqlens, batch, appended, capacity)
    offset_k = Int32(0)
    if cutlass.const_expr(mLeftpad is not None):
        offset_k = cutlass.max(cutlass.min(mLeftpad[batch], seqlen_k), 0)
        seqlen_k = seqlen_k - offset_k
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, offset_q=Int32(0), offset_k=offset_k)


@cute.jit
def _cached_keys(mCacheSeqlens: cute.Tensor, batch: Int32, appended: Int32, capacity: Int32) -> Int32:
    return cutlass.max(cutlass.min(mCacheSeqlens[batch] + appended, capacity), 0)


@cute.jit
def from_cache_packed(mCuSeqlensQ: cute.Tensor, mCacheSeqlens: cute.Tensor, batch: Int32,
                      appended: Int32, capacity: Int32, total_q: Int32):
    """Entry `batch` of packed queries over a KV cache (a varlen call with seqused_k): its queries
    are rows [cu[batch], cu[batch + 1]) of the packed (total_q, heads, d) q, clamped into its
    total_q rows (packed_span); its keys the cache's first cache_seqlens[batch] (+ appended) rows,
    clamped as from_cache."""
    offset_q, seqlen_q = packed_span(mCuSeqlensQ, batch, total_q)
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=_cached_keys(mCacheSeqlens, batch, appended, capacity),
                           offset_q=offset_q, offset_k=Int32(0))


def fixed(seqlen_q: Int32, seqlen_k: Int32):
    """A fixed-shape batch: every entry has the tensors' lengths, at row 0 of its own plane."""
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, offset_q=Int32(0), offset_k=Int32(0))


@cute.jit
def packed_span(mCuSeqlens: cute.Tensor, entry: Int32, total):
    """(offset, length) of entry `entry` of a packed batch: rows [cu[entry], cu[entry + 1]).
    `total` (the packed tensor's rows; None: trust the offsets) clamps the span into [0, total]
    with a length >= 0, so that offsets no host check saw (a CUDA graph replayed with new ones)
    never place a row outside the tensor: an entry past the end is empty, one that runs over it
    is cut at it, a decreasing pair gives an empty entry."""
    start, end = mCuSeqlens[entry], mCuSeqlens[entry + 1]
    if cutlass.const_expr(total is not None):
        start = cutlass.max(cutlass.min(start, total), 0)
        end = cutlass.max(cutlass.min(end, total), start)
    return start, end - start


@cute.jit
def packed_entry_length(mCuSeqlens: cute.Tensor, row: Int32, total) -> Int32:
    """The length of the packed entry holding `row` (spans clamped as packed_span), 0 if none; a
    whole warp calls it: each lane takes one entry of a chunk of 32, a ballot names the holder."""
    lane = cute.arch.lane_idx()
    entries = mCuSeqlens.shape[0] - 1
    length = Int32(0)
    chunk = Int32(0)
    searching = chunk < entries
    while searching:
        entry = cutlass.min(chunk + lane, entries - 1)
        start, count = packed_span(mCuSeqlens, entry, total)
        holds = cute.arch.vote_ballot_sync(chunk + lane < entries and start <= row and row < start + count)
        if holds != 0:
            length = cute.arch.shuffle_sync(count, cute.arch.popc((holds & -holds) - 1))
            searching = False
        else:
            chunk += 32
            searching = chunk < entries
    return length


@cute.jit
def from_cu_seqlens(mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, batch: Int32, total_q=None,
                    total_k=None):
    """Entry `batch` of a packed variable-length batch: its rows are [cu[batch], cu[batch + 1]) of
    the one (total, heads, d) tensor (flash-attn's cu_seqlens, int32, batch + 1 offsets), clamped
    into the tensors' total_q / total_k rows when given (packed_span)."""
    offset_q, seqlen_q = packed_span(mCuSeqlensQ, batch, total_q)
    offset_k, seqlen_k = packed_span(mCuSeqlensK, batch, total_k)
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k, offset_q=offset_q, offset_k=offset_k)


def rows(mX: cute.Tensor, head: Int32, batch: Int32, offset: Int32, varlen: bool) -> cute.Tensor:
    """The (seqlen, d) rows of one head of one entry, in an (seqlen, d, heads, batch) tensor (a TMA
    tensor included): the entry's own plane, or (varlen) the packed plane from the entry's offset.
    Tiles read past a packed sequence's end reach the next one's rows: loads mask them, stores
    must not write them."""
    if varlen:
        return cute.domain_offset((offset, 0), mX[None, None, head, 0])
    return mX[None, None, head, batch]
