"""The split-KV combine: one warp per query row merges the FP32 partials of S1's splits.

S1 (kernels/decode.py) splits each sequence's keys across CTAs when batch x heads cannot fill the
SMs; each split writes its O_i (normalised by its own row sum) and lse_i. The exact result is the
softmax-weighted sum of the parts: LSE = log sum_i exp(lse_i), O = sum_i exp(lse_i - LSE) O_i.
Where a packed call's long entries are K5's (`max_queries`: kernels/k5_cache.py), their rows have
no partials and are skipped: each warp finds its row's entry from cu_seqlens_q.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from .common import seqlen


class SplitKVCombine:
    """O and LSE from the splits' FP32 partials: one warp per (batch, query, head) row, or per
    128-column slice of it where rows are wider than 256 (M1's 512-wide latent rows).

    The work is a few kilobytes a row; its time is round trips to L2. So each lane issues the loads
    of its elements of `chunk` splits' partial rows at once (the first chunk before the LSEs are
    even read: it does not depend on them), and the weights come from the LSEs already in L1:
    about two round trips for up to `chunk` splits where one split at a time took one per split
    (worklog/serving.md).

    LSE = m + log(sum_i exp(lse_i - m)) with m = max_i lse_i; O = sum_i exp(lse_i - LSE) O_i. Splits
    that saw no key carry lse = -inf and weigh 0; a row no split saw keeps O = 0, LSE = -inf.
    `sinks`: the head's sink is one more term of the sum, with no O (mSinks (heads_q,) FP32).

    A decode of one sequence has few rows (16 for one MLA query over 16 heads): one warp a 512-wide
    row left most SMs idle and walked its splits 4 at a time. In slices of 128 columns, four warps
    share a row (each reads the row's LSEs and weighs its own columns; the first writes the LSE),
    16 splits a round trip.

    Few rows with many partials (S2 at batch 1: 33 splits of 4 warps' partials, 132 a row; M1's
    64) walked them one chunk after another, a round trip each. Past two chunks (decided per
    call, from the partials' count), the CTA's four warps share one row (or slice) instead:
    warp p weighs chunks p, p + 4, ..., each warp reads all the LSEs for the row's total, and the
    four sums meet in SMEM, where the first warp adds them up and writes the row."""

    warps = 4
    # launched right behind the split kernel that writes its partials, programmatically dependent
    # on it (_WithCombine): its CTAs may start before that kernel ends, and wait for its memory
    # at griddepcontrol.wait before reading anything
    after_split_kernel = False

    def __init__(self, dtype, head_dim: int, sinks: bool = False, max_queries: int = 0):
        self.dtype, self.head_dim, self.sinks = dtype, head_dim, sinks
        self.max_queries = max_queries  # packed: rows of entries this long or longer are not S1's
        # the columns of a row one warp merges: the whole row up to 256, else slices of 128
        self.columns = head_dim if head_dim <= 256 else 128
        self.slices = head_dim // self.columns
        # splits whose partial rows are loaded together (one round trip to L2 for all of them):
        # 64 registers a lane
        self.chunk = 16 if self.columns <= 128 else 8

    @cute.jit
    def __call__(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor], stream):
        """mSinks: read with sinks only; mCuSeqlensQ: the packed queries' offsets (read with
        max_queries only); either may be None where it is not read."""
        splits, batch, seqlen_q, heads_q, _ = mOacc.shape
        works = batch * seqlen_q * heads_q * self.slices  # rows, or slices of rows
        row_warps = Int32(1)  # the warps that share one work's partials: 1, or the CTA's
        if splits > 2 * self.chunk:
            row_warps = Int32(self.warps)
        self.kernel(mOacc, mLSEacc, mO, mLSE, mSinks, mCuSeqlensQ, row_warps).launch(
            grid=[cute.ceil_div(works * row_warps, self.warps), 1, 1], block=[32 * self.warps, 1, 1],
            stream=stream, use_pdl=self.after_split_kernel)

    @cute.kernel
    def kernel(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSinks: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor], row_warps: Int32):
        if cutlass.const_expr(self.after_split_kernel):
            cute.arch.griddepcontrol_wait()  # the split kernel's partials are written and visible
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane, warp = cute.arch.lane_idx(), tidx // 32
        per_lane = self.columns // 32

        @cute.struct
        class Storage:
            sums: cute.struct.MemRange[Float32, self.warps * self.columns]  # each warp's weighted sum

        sums = SmemAllocator().allocate(Storage).sums.get_tensor(
            cute.make_layout((self.columns, self.warps)))
        splits, batch_size, seqlen_q, heads_q, _ = mOacc.shape
        work = (block * self.warps + warp) // row_warps
        part = warp % row_warps  # this warp's share of the work's splits: chunks part, part + row_warps, ...
        row = work
        column = lane  # this lane's first column (then every 32nd)
        if cutlass.const_expr(self.slices > 1):
            row = work // self.slices
            column = work % self.slices * self.columns + lane
        mine = row < batch_size * seqlen_q * heads_q
        if cutlass.const_expr(self.max_queries > 0):  # (warp-uniform: one row a warp)
            if mine:
                mine = seqlen.packed_entry_length(mCuSeqlensQ, row // heads_q % seqlen_q, seqlen_q) < self.max_queries
        acc = cute.make_rmem_tensor((per_lane,), Float32)
        acc.fill(0.0)
        head = row % heads_q
        query = row // heads_q % seqlen_q
        batch = row // (heads_q * seqlen_q)
        lse = -Float32.inf
        if mine:
            # the first chunk of partial O rows does not depend on the LSEs: its loads fly beside theirs
            parts = cute.make_rmem_tensor((self.chunk, per_lane), Float32)
            self.load_chunk(parts, mOacc, part * self.chunk, batch, query, head, column)
            top = -Float32.inf
            for s in cutlass.range(lane, splits, 32, unroll=1):
                top = cute.arch.fmax(top, mLSEacc[s, batch, head, query])
            top = cute.arch.warp_reduction_max(top, threads_in_group=32)
            sink = -Float32.inf
            if cutlass.const_expr(self.sinks):
                sink = mSinks[head]
                top = cute.arch.fmax(top, sink)
            offset = top
            if top == -Float32.inf:
                offset = Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, splits, 32, unroll=1):
                total += cute.math.exp(mLSEacc[s, batch, head, query] - offset, fastmath=True)
            total = cute.arch.warp_reduction_sum(total, threads_in_group=32)
            if cutlass.const_expr(self.sinks):
                total += cute.math.exp(sink - offset, fastmath=True)
            if total > Float32(0.0):
                lse = offset + cute.math.log(total, fastmath=True)
                for first in cutlass.range(part * self.chunk, splits, self.chunk * row_warps, unroll=1):
                    if first > part * self.chunk:
                        self.load_chunk(parts, mOacc, first, batch, query, head, column)
                    for j in cutlass.range_constexpr(self.chunk):
                        split = cutlass.min(first + j, splits - 1)
                        weight = cute.math.exp(mLSEacc[split, batch, head, query] - lse, fastmath=True)
                        if first + j >= splits:  # a clamped repeat of the last split
                            weight = Float32(0.0)
                        for i in cutlass.range_constexpr(per_lane):
                            acc[i] += weight * parts[j, i]
        if row_warps > 1:  # (the whole grid's choice: every thread reaches the barrier)
            for i in cutlass.range_constexpr(per_lane):
                sums[lane + 32 * i, warp] = acc[i]
            cute.arch.sync_threads()
            if part == 0:
                for w in cutlass.range_constexpr(1, self.warps):
                    for i in cutlass.range_constexpr(per_lane):
                        acc[i] += sums[lane + 32 * i, warp + w]
        if mine and part == 0:
            for i in cutlass.range_constexpr(per_lane):
                mO[batch, query, head, column + 32 * i] = acc[i].to(self.dtype)
            if column == 0:  # (the row's first lane: of its first slice)
                mLSE[batch, head, query] = lse

    @cute.jit
    def load_chunk(self, parts: cute.Tensor, mOacc: cute.Tensor, first: cutlass.Int32, batch, query, head, column):
        """This lane's elements (columns `column`, then every 32nd of its warp's) of the partial O
        rows of splits first .. first + chunk - 1, all issued before any is used; indices past the
        last split repeat it (in bounds; weighed 0)."""
        splits = mOacc.shape[0]
        for j in cutlass.range_constexpr(self.chunk):
            split = cutlass.min(first + j, splits - 1)
            for i in cutlass.range_constexpr(self.columns // 32):
                parts[j, i] = mOacc[split, batch, query, head, column + 32 * i]


class _WithCombine:
    """A split-KV kernel and the combine of its partials as one compiled host function: one call
    from Python launches both on the stream, where a second compiled call cost the host as much
    again as the combine's GPU time (worklog/host.md). Each subclass's __call__ takes its kernel's
    arguments (the DSL compiles a signature, not *args).

    The combine is launched as a programmatic dependent of the split kernel (PDL): each of the
    split kernel's CTAs lets it launch as it starts (`launches_dependents`), so the combine's CTAs
    are scheduled while the split kernel runs and wait at griddepcontrol.wait for its grid to end
    and its writes to land, instead of paying a launch after it."""

    def __init__(self, split_kernel, combine: SplitKVCombine):
        split_kernel.launches_dependents = True
        combine.after_split_kernel = True
        self.split_kernel, self.combine = split_kernel, combine


class SplitKVWithCombine(_WithCombine):
    """S1 or S2 (kernels/decode.py) with the combine: the arguments are the decode kernel's; the
    combine reads the partials, O, LSE, the sinks and cu_seqlens_q among them."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCacheSeqlens: cute.Tensor,
                 mBlockTable: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor,
                 mLSEacc: cute.Tensor, scale_log2: Float32, appended: Int32, window_left: Int32,
                 window_right: Int32, softcap_scale: Float32, mCuSeqlensQ: Optional[cute.Tensor],
                 max_seqlen_q: Int32, mLeftpad: Optional[cute.Tensor], mOrder: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mQDescale: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
                 mVDescale: Optional[cute.Tensor], stream):
        self.split_kernel(mQ, mK, mV, mCacheSeqlens, mBlockTable, mO, mLSE, mOacc, mLSEacc, scale_log2, appended,
                          window_left, window_right, softcap_scale, mCuSeqlensQ, max_seqlen_q, mLeftpad, mOrder,
                          mSinks, mQDescale, mKDescale, mVDescale, stream)
        self.combine(mOacc, mLSEacc, mO, mLSE, mSinks, mCuSeqlensQ, stream)


class MlaWithCombine(_WithCombine):
    """M1 (kernels/mla_decode.py) with the combine at the latent's width: the arguments are M1's."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQv: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mOacc: cute.Tensor, mLSEacc: cute.Tensor, scale_log2: Float32, appended: Int32,
                 mCuSeqlensQ: cute.Tensor, max_seqlen_q: Int32, stream):
        self.split_kernel(mQ, mQv, mK, mV, mCacheSeqlens, mBlockTable, mO, mLSE, mOacc, mLSEacc, scale_log2,
                          appended, mCuSeqlensQ, max_seqlen_q, stream)
        self.combine(mOacc, mLSEacc, mO, mLSE, None, None, stream)
