"""FP32 accumulation in global memory, from many CTAs into one buffer (the backward's dQ), and the
split-K reduction (`sum_partials`: the last of a tile's CTAs sums every partial, in order).

Several CTAs add partial sums into the same tile (each K/V tile contributes to every Q tile it sees).
Each thread adds its accumulator registers with `red.global.add.f32`: a fire-and-forget atomic the
L2 performs, so the CTA does not wait for it. The order in which CTAs' adds land is then up to the
hardware, and FP32 addition is not associative: results differ in the last bits run to run.

`ordered_begin` / `ordered_end` make it deterministic: a per-tile counter in global memory lets the
CTA with order index i add only once the counter reads i, and bumps it after its adds are visible.
The CTAs that share a tile must be launched in order of their index (lower block indices first,
which the hardware does for a grid), so that a waiting CTA never waits on one that cannot start.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def elem_ptr(t: cute.Tensor, i):
    """Pointer to element `i` (a flat index or a coordinate) of tensor t."""
    return t.iterator + cute.crd2idx(i, t.layout)


@cute.jit
def add_element(gX: cute.Tensor, i, value: Float32):
    """gX[i] += value, an FP32 atomic the L2 performs (fire and forget)."""
    cute.arch.red(elem_ptr(gX, i), value, op="add", dtype=Float32, sem="relaxed", scope="gpu")


@cute.jit
def add_fragment(acc: cute.Tensor, gX: cute.Tensor):
    """gX[i] += acc[i] for every element of this thread's fragment; gX is the global tile
    partitioned the same way as acc (tiled_mma thread slice .partition_C)."""
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        add_element(gX, i, acc[i])


@cute.jit
def ordered_begin(counter, index: Int32, thread_idx: Int32, barrier_fn):
    """Wait (one thread spins, then `barrier_fn` releases the rest) until *counter == index
    (`counter`: a pointer to an int32 in global memory)."""
    if thread_idx == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != index:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    barrier_fn()


@cute.jit
def ordered_end(counter, thread_idx: Int32, barrier_fn):
    """Make this CTA's adds visible GPU-wide, then hand the tile to the next index."""
    cute.arch.fence_acq_rel_gpu()
    barrier_fn()
    if thread_idx == 0:
        cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")


@cute.jit
def sum_partials(acc: cute.Tensor, workspace: cute.Tensor, counter, tile: Int32, split: Int32,
                 splits: Int32, tidx: Int32, threads: cutlass.Constexpr, last_flag: cute.Tensor,
                 barrier_fn) -> cutlass.Boolean:
    """Split-K: `splits` CTAs each hold a partial accumulator of one output tile. Each writes its
    fragment to its own workspace slot (tile, split), then bumps the tile's counter; the CTA that
    brings it to `splits` is the last: it resets the counter to 0 for the next launch, reads every
    slot and sums them in split order into `acc` (the same bits whichever CTA is last), and
    returns True. The others return False and leave the tile to it; nobody waits.

    workspace: FP32, (tiles x splits) slots of size(acc) x threads elements, thread-interleaved
    (element i of thread t at i * threads + t: coalesced). counter: a pointer to this tile's int32,
    0 at launch. last_flag: one Int32 of SMEM. barrier_fn: a barrier of the `threads` threads."""
    frag = cute.size(acc)
    slot = (tile * splits + split) * (frag * threads)
    for i in cutlass.range(frag, unroll_full=True):
        workspace[slot + i * threads + tidx] = acc[i]
    cute.arch.fence_acq_rel_gpu()  # this thread's partial is visible before the counter moves
    barrier_fn()
    if tidx == 0:
        arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        last_flag[0] = Int32(0)
        if arrived == splits - 1:
            cute.arch.store(counter, Int32(0))  # every other split has arrived: reuse next launch
            last_flag[0] = Int32(1)
    barrier_fn()
    is_last = last_flag[0] != 0
    if is_last:
        cute.arch.fence_acq_rel_gpu()
        first = (tile * splits) * (frag * threads) + tidx
        for i in cutlass.range(frag, unroll_full=True):
            acc[i] = workspace[first + i * threads]
        for s in cutlass.range(1, splits, unroll=1):
            base = first + s * (frag * threads)
            for i in cutlass.range(frag, unroll_full=True):
                acc[i] = acc[i] + workspace[base + i * threads]
    barrier_fn()  # last_flag is read before the next tile may write it
    return is_last
