"""FP32 accumulation in global memory, from many CTAs into one buffer (the backward's dQ).

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
def add_fragment(acc: cute.Tensor, gX: cute.Tensor):
    """gX[i] += acc[i] for every element of this thread's fragment; gX is the global tile
    partitioned the same way as acc (tiled_mma thread slice .partition_C)."""
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        cute.arch.red(elem_ptr(gX, i), acc[i], op="add", dtype=Float32, sem="relaxed", scope="gpu")


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
