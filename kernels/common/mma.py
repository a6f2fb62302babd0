"""WGMMA (Hopper's warpgroup MMA): tiled MMAs, the issue protocol, accumulator views.

A warpgroup (4 consecutive warps, 128 threads) issues `wgmma.mma_async` for a 64 x N x 16 tile;
A comes from SMEM (a descriptor) or registers, B from SMEM, the FP32 accumulator lives in registers.
Per 64-row atom a thread owns rows r and r + 8 of each 16-row slab and N/4 columns, a row spread
over the 4 lanes of a quad. The issue protocol:

    fence()                                   order earlier register writes before the MMA reads
    for k: gemm(atom, acc, A[:, :, k], B[:, :, k])   ACCUMULATE off for the first k if zero_init
    commit_group()                            close this batch of async MMAs
    wait_group(n)                             until at most n batches are still in flight

The accumulator must not be read (softmax) or written until a wait covers it, and an SMEM stage
must not be released while an MMA that reads it is in flight.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup
from cutlass.utils import hopper_helpers as sm90

_MAJOR = {"K": OperandMajorMode.K, "MN": OperandMajorMode.MN}


def tiled_mma(dtype, tile_m: int, tile_n: int, a_major="K", b_major="K", a_in_regs=False,
              warpgroups: int | None = None, split_n: bool = False):
    """MMA producing a (tile_m, tile_n) accumulator with `warpgroups` (default tile_m/64) warpgroups
    stacked along M; with fewer, each warpgroup repeats the 64-row atom (tile_m/64/warpgroups times);
    with more than tile_m/64, the rest split N (each warpgroup then owns tile_n/split columns).
    `split_n`: the warpgroups split N whatever tile_m (M = 192 does not halve into 64-row atoms)."""
    wg_m = 1 if split_n else min(warpgroups or tile_m // 64, tile_m // 64)
    wg_n = (warpgroups or wg_m) // wg_m
    return sm90.make_trivial_tiled_mma(
        dtype, dtype, _MAJOR[a_major], _MAJOR[b_major], Float32,
        atom_layout_mnk=(wg_m, wg_n, 1), tiler_mn=(64, tile_n // wg_n),
        a_source=warpgroup.OperandSource.RMEM if a_in_regs else warpgroup.OperandSource.SMEM)


def n_share(tile_m: int, tile_n: int, warpgroups: int) -> int:
    """The columns of a (tile_m, tile_n) accumulator each warpgroup computes (tiled_mma's split)."""
    wg_m = min(warpgroups, tile_m // 64)
    return tile_n // (warpgroups // wg_m)


def warpgroup_slice(tiled: cute.TiledMma, thread_idx):
    """The slice of `tiled` for thread_idx's warpgroup, from a warp-uniform index: SMEM operands
    are per warpgroup (every thread of it passes the same descriptors), and a provably uniform
    slice lets the compiler build the descriptors in uniform registers (no per-thread address
    math and register-to-uniform moves before each WGMMA)."""
    warpgroup_idx = cute.arch.make_warp_uniform(thread_idx // 128)
    return tiled.get_slice(warpgroup_idx * 128)


def fragment_A(slice_, sA: cute.Tensor) -> cute.Tensor:
    """The A operand fragment (SMEM descriptors) of sA for one MMA slice."""
    return slice_.make_fragment_A(slice_.partition_A(sA))


def fragment_B(slice_, sB: cute.Tensor) -> cute.Tensor:
    """The B operand fragment (SMEM descriptors) of sB for one MMA slice."""
    return slice_.make_fragment_B(slice_.partition_B(sB))


@cute.jit
def gemm(tiled: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool] = False, wait: cutlass.Constexpr[int] = 0):
    """acc (+)= A B over every k block of the fragments; commit; wait until `wait` batches remain
    in flight (-1: do not wait)."""
    warpgroup.fence()
    # A fresh atom per call: toggling ACCUMULATE on a shared one breaks SSA dominance under
    # dynamic control flow.
    atom = cute.make_mma_atom(tiled.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread:
    ((2, MMA_M), (2, N/8, MMA_N)): 2 rows per 64-row atom, N/4 columns each."""
    shape, stride = acc.layout.shape, cute.make_layout(acc.layout.shape).stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[0][2], stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def as_a_operand(p: cute.Tensor) -> cute.Tensor:
    """The same registers as an A operand of a following MMA (16-bit types): the m64nNk16
    accumulator and the m64k16 A fragment coincide, only the grouping changes:
    ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N))."""
    layout = cute.logical_divide(p.layout, ((None, None, 2), None, None))
    shape, stride = layout.shape, layout.stride
    frg = cute.make_layout(
        ((shape[0][0], shape[0][1], shape[0][2][0]), shape[1], (shape[0][2][1], shape[2])),
        stride=((stride[0][0], stride[0][1], stride[0][2][0]), stride[1], (stride[0][2][1], stride[2])))
    return cute.make_tensor(p.iterator, frg)


# FP8 (e4m3) P as the A operand of P V. Per k32 block a thread's FP32 accumulator holds, for each of
# its 2 rows, columns 8g + 2t + {0, 1} (g < 4 groups of 8, t = lane % 4); the m64k32 e4m3 A fragment
# holds 4 bytes a register, k = 16h + 4t + {0..3} (h < 2) per row: 8 values a row either way, not
# the same columns. fp8_a_order reads a thread's own accumulator in A's order, A byte 16h + 4t + j
# taking column 8(2h + j // 2) + 2t + j % 2: a fixed permutation of the columns (keys) inside each
# 16, which the B operand's keys must follow (the FP8 rung's V^T is permuted so on the host).


def fp8_a_shape(acc: cute.Tensor):
    """The A fragment of P V for accumulator `acc` ((2, 2, N/8), MMA_M, MMA_N) of S: (4 bytes,
    2 rows, 2 halves of k32), MMA_M, (N/32 k blocks, MMA_N)."""
    (_, _, groups), mma_m, mma_n = acc.shape
    return ((4, 2, 2), mma_m, (groups // 4, mma_n))


def fp8_a_view(p: cute.Tensor) -> cute.Tensor:
    """A compact fp8_a_shape tensor with its 4 bytes split as (2 columns of a pair, 2 groups of 8),
    the shape fp8_a_order gives."""
    (_, rows, halves), mma_m, k_blocks = p.shape
    return cute.make_tensor(p.iterator, cute.make_layout((((2, 2), rows, halves), mma_m, k_blocks)))


def fp8_a_order(acc: cute.Tensor) -> cute.Tensor:
    """The FP32 accumulator of S seen in the FP8 A operand's element order (no data movement):
    (((pair, group), row, half), MMA_M, (k block, MMA_N)), group/half/k block being groups of 8
    columns 1/2/4 apart."""
    (_, _, groups), mma_m, mma_n = acc.shape
    compact = cute.make_layout(acc.shape).stride  # ((1, 2, 4), ...): column pair, row, group
    (s_col, s_row, s_grp), s_m, s_n = compact
    order = cute.make_layout((((2, 2), 2, 2), mma_m, (groups // 4, mma_n)),
                             stride=(((s_col, s_grp), s_row, 2 * s_grp), s_m, (4 * s_grp, s_n)))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, order))


def transpose_view(s: cute.Tensor) -> cute.Tensor:
    """(rows, cols, ...) SMEM tensor seen as (cols, rows, ...): V (tile_n, d) as the MN-major
    B operand (d, tile_n) of P V, with no data movement."""
    shape = (s.shape[1], s.shape[0], *s.shape[2:])
    return cute.composition(s, cute.make_ordered_layout(shape, order=(1, 0, *range(2, cute.rank(s)))))


def smem_writer(tiled: cute.TiledMma, dtype, thread_idx, whole_tile: bool = False, matrices: int = 4,
                transpose: bool = False):
    """(copy, thread slice) writing this thread's share of a `tiled` accumulator, converted to the
    16-bit `dtype`, into a row-major swizzled SMEM tile with `stmatrix` (8x8 blocks per instruction
    instead of scattered 2-byte stores): the whole (M, N) tile of the tiled MMA, or (default) one
    atom-sized subtile at a time, as the epilogue stores it. `matrices` 8x8 blocks an instruction:
    4 (16 columns of a warpgroup's N), or 2 where its N is an odd multiple of 8 (24: B9 at d256).
    `transpose`: each 8x8 block lands transposed, for a tile whose rows (M) are the contiguous
    dimension (a transposed view, e.g. B9's dK^T into the (keys, d) K tile)."""
    stmatrix = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose, matrices), dtype)
    if whole_tile:
        r2s = cute.make_tiled_copy_C(stmatrix, tiled)
    else:
        r2s = cute.make_tiled_copy_S(stmatrix, cute.make_tiled_copy_C_atom(stmatrix, tiled))
    return r2s, r2s.get_slice(thread_idx)


@cute.jit
def store_to_smem(frag: cute.Tensor, tiled: cute.TiledMma, thread_idx, sX: cute.Tensor,
                  matrices: cutlass.Constexpr[int] = 4, transpose: cutlass.Constexpr[bool] = False):
    """Write a 16-bit accumulator `frag` (already converted) into the (M, N) SMEM tile sX."""
    r2s, thr = smem_writer(tiled, frag.element_type, thread_idx, whole_tile=True, matrices=matrices,
                           transpose=transpose)
    cute.copy(r2s, r2s.retile(frag), thr.partition_D(sX))


def to_dtype(acc: cute.Tensor, dtype) -> cute.Tensor:
    """A register copy of the FP32 accumulator rounded to `dtype` (same layout)."""
    out = cute.make_rmem_tensor_like(acc, dtype)
    out.store(acc.load().to(dtype))
    return out


@dsl_user_op
def pack_16bit_pair(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Two FP32 values rounded to bf16/fp16 and packed into one 32-bit register (lo in the low
    half): one cvt.rn.{bf16x2,f16x2}.f32."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def mul_16bit_pairs(a: Int32, b: Int32, dtype, *, loc=None, ip=None) -> Int32:
    """Two packed bf16/fp16 pairs multiplied half by half, rounded to nearest: one
    mul.rn.{bf16x2,f16x2}."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"mul.rn.{kind} $0, $1, $2;", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def to_dtype_pairs(acc: cute.Tensor, dtype) -> cute.Tensor:
    """`to_dtype`'s copy written as 32-bit pairs (`to_dtype_packed`): for an A operand, or for
    arithmetic on the pairs (`mul_16bit_pairs`)."""
    out = cute.make_rmem_tensor_like(acc, dtype)
    to_dtype_packed(acc, out)
    return out


@cute.jit
def to_dtype_packed(acc: cute.Tensor, out: cute.Tensor):
    """out = acc rounded to out's 16-bit type, written as 32-bit pairs: the WGMMA A operand reads
    32-bit registers, so 16-bit halves converted one at a time get repacked before each WGMMA."""
    out32 = cute.recast_tensor(out, Int32)
    for i in cutlass.range_constexpr(cute.size(out32)):
        out32[i] = pack_16bit_pair(acc[2 * i], acc[2 * i + 1], out.element_type)
