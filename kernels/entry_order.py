"""The entries of a KV-cache call, longest first: the order in which S1 (kernels/decode.py) hands
them to its CTAs when they take several waves of the SMs.

A CTA's time is about its entry's key count, and the GPU starts CTAs in grid order: with the
longest entries launched first, the short ones fill the gaps at the end (longest processing time
first), where a long entry launched last would run alone while the other SMs idle.

One CTA, a counting sort on the device (no host sync, so a captured graph replays it):
each entry's length, clamped to [0, max_length], falls in one of `buckets` equal ranges, the
longest range first; a histogram in SMEM (shared atomics), its exclusive scan, then every entry
takes the next slot of its bucket. Entries of one bucket keep no particular order (the slots go
by atomic arrival): the order decides only which CTA computes which tile, never a result.
Lengths of any value give a permutation of 0..B-1.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .common import scheduler


class EntryOrder:
    num_threads = 1024
    buckets = 1024  # one per thread for the scan; widths of max_length / 1024 keys

    @cute.jit
    def __call__(self, mLengths: cute.Tensor, mOrder: cute.Tensor, max_length: Int32, stream):
        """mLengths (B,) int32 keys per entry; mOrder (B,) int64: the entries, longest first."""
        self.kernel(mLengths, mOrder, max_length).launch(grid=[1, 1, 1], block=[self.num_threads, 1, 1],
                                                          stream=stream)

    @cute.jit
    def bucket(self, length: Int32, max_length: Int32) -> Int32:
        """0 for the longest range, buckets - 1 for the shortest (Int64: lengths up to 2^31)."""
        clamped = Int64(cutlass.max(cutlass.min(length, max_length), 0))
        return Int32(self.buckets - 1) - Int32(clamped * (self.buckets - 1) // Int64(cutlass.max(max_length, 1)))

    @cute.kernel
    def kernel(self, mLengths: cute.Tensor, mOrder: cute.Tensor, max_length: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = tidx % 32, tidx // 32

        @cute.struct
        class Storage:
            counts: cute.struct.MemRange[Int32, self.buckets]
            warp_totals: cute.struct.MemRange[Int32, self.num_threads // 32]

        storage = cutlass.utils.SmemAllocator().allocate(Storage)
        counts = storage.counts.get_tensor(cute.make_layout(self.buckets))
        warp_totals = storage.warp_totals.get_tensor(cute.make_layout(self.num_threads // 32))
        entries = mLengths.shape[0]

        counts[tidx] = Int32(0)
        cute.arch.sync_threads()
        for e in cutlass.range(tidx, entries, self.num_threads, unroll=1):
            cute.arch.atomic_add(counts.iterator + self.bucket(mLengths[e], max_length), Int32(1), scope="cta")
        cute.arch.sync_threads()

        # exclusive scan of the counts: within each warp, then over the warps' totals
        count = counts[tidx]
        running = scheduler.warp_inclusive_sum(count, lane)
        if lane == 31:
            warp_totals[warp] = running
        cute.arch.sync_threads()
        if warp == 0:
            total = warp_totals[lane]
            warp_totals[lane] = scheduler.warp_inclusive_sum(total, lane) - total
        cute.arch.sync_threads()
        counts[tidx] = warp_totals[warp] + running - count  # now each bucket's next free slot
        cute.arch.sync_threads()

        for e in cutlass.range(tidx, entries, self.num_threads, unroll=1):
            slot = cute.arch.atomic_add(counts.iterator + self.bucket(mLengths[e], max_length), Int32(1),
                                        scope="cta")
            mOrder[slot] = Int64(e)
