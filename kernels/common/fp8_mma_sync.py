"""FP8 (e4m3) K and V rows in SMEM as the fp16 operands of one warp's mma.sync m16n8k16,
converted in registers (S2 over an FP8 cache, kernels/decode.py).

Every e4m3 value is exact in fp16, and cvt.rn.f16x2.e4m3x2 turns a byte pair into an f16x2
register; so a warp can load its FP8 bytes from the ring's stage straight into registers and
convert them there, in the order its B fragments want, with no 16-bit copy of the tile in SMEM.
Both reductions leave room to choose that order, and it is chosen so that the loads are wide.

Lane = 4 g + t (g = lane / 4, t = lane % 4). m16n8k16's fp16 fragments, per lane (two 16-bit
values a 32-bit register; CuTe's value order, the PTX a0.., b0.., c0..):
    A (16 x 16, m x k): a0 a1 (m g, k 2t and 2t + 1), a2 a3 (g + 8; 2t..), a4 a5 (g; 2t + 8..),
                        a6 a7 (g + 8; 2t + 8..)
    B (16 x 8, k x n):  b0 b1 (k 2t, 2t + 1; n g), b2 b3 (k 2t + 8, 2t + 9; n g)
    C (16 x 8, m x n):  c0 c1 (m g; n 2t, 2t + 1), c2 c3 (g + 8; 2t, 2t + 1)

S = Q K^T, k = d (`quarter_d`): the reduction may visit d in any order that Q and K share. Lane
    (g, t) loads bytes [t d/4, (t + 1) d/4) of keys g and g + 8 (16-byte loads: the swizzle keeps
    16-byte chunks whole), and k step s takes 4 of them: k index 2t + j + 8h (j, h < 2) of step s
    is d column t d/4 + 4s + 2h + j, i.e. b0 b1 = bytes 4s, 4s + 1 and b2 b3 = bytes 4s + 2, 4s + 3
    of the lane's run: one 32-bit word a step, one cvt a half. Q's A fragment is read from its
    16-bit SMEM tile in the same order (`q_operand`, once per CTA).
O = P V, k = keys, n = d (`paired_d`): the keys stay in order (P is S's accumulator, whose
    columns are the keys in order); d may be permuted if O's columns are. ldmatrix .x4 .trans of
    FP8 rows read as b16 pairs gives lane (g, t), of an 8-key x 16-byte block, the byte pairs at
    columns 2g, 2g + 1 of keys 2t and 2t + 1; one prmt of the blocks of keys 0-7 and 8-15 puts
    keys 2t, 2t + 1, 2t + 8, 2t + 9 of one column in one word: b0 b1 and b2 b3 of one n tile, one
    cvt each. So n tile 2c + e, n index g, is d column 16c + 2g + e, and O's accumulator holds,
    of n tile 2c + e, columns 16c + 2(2t + {0, 1}) + e (`paired_d_columns`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

CHUNK_BYTES = 16  # the swizzle's unit: a 16-byte chunk of a row stays contiguous
KEYS = 16  # the keys one warp multiplies (m16n8k16's k for P V, two n tiles of S)
# prmt selectors over (matrix of keys 0-7, matrix of keys 8-15) of ldmatrix.trans: the even / odd
# byte of each pair -> keys 2t, 2t + 1, 2t + 8, 2t + 9 of one d column
EVEN_COLUMN, ODD_COLUMN = 0x6420, 0x7531


@dsl_user_op
def ldmatrix_x4_trans(addr: Int32, *, loc=None, ip=None):
    """Four 8x8 b16 matrices from SMEM, transposed (lanes 8m .. 8m + 7 address matrix m's rows)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def byte_perm(lo: Int32, hi: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of (hi:lo) (no side effects:
    free to be scheduled)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(lo).ir_value(loc=loc, ip=ip), Int32(hi).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def e4m3_pair_to_f16x2(word: Int32, half: int, *, loc=None, ip=None) -> Int32:
    """The e4m3 byte pair in `half` (0: bytes 0-1, 1: bytes 2-3) of a word as an f16x2 register
    (the lower byte in the lower half): one cvt.rn.f16x2.e4m3x2, exact."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, " + ("hi" if half else "lo") + "; }",
        "=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def load_row_quarters(sX: cute.Tensor, lane: Int32, words: cute.Tensor):
    """Lane (g, t)'s quarter of rows g and g + 8 of a (16, cols) SMEM tile (plain or swizzled in
    16-byte chunks), in 16-byte loads: words[w, i] = bytes 4w .. 4w + 3 of row g + 8i's columns
    [t cols/4, (t + 1) cols/4). words: an Int32 register tensor (quarter bytes / 4, 2)."""
    cols = cute.size(sX, mode=[1])
    elems = CHUNK_BYTES * 8 // sX.element_type.width  # a chunk's elements
    chunks = cols // 4 // elems  # per lane and row
    g, t = lane // 4, lane % 4
    for i in cutlass.range_constexpr(2):
        for c in cutlass.range_constexpr(chunks):
            src = cute.local_tile(sX[g + 8 * i, None], (elems,), (t * chunks + c,))
            vec = cute.make_rmem_tensor((elems,), sX.element_type)
            cute.autovec_copy(cute.make_tensor(src.iterator.align(CHUNK_BYTES), cute.make_layout(elems)), vec)
            vec32 = cute.recast_tensor(vec, Int32)
            for w in cutlass.range_constexpr(CHUNK_BYTES // 4):
                words[c * (CHUNK_BYTES // 4) + w, i] = vec32[w]


@cute.jit
def q_operand(sQ: cute.Tensor, lane: Int32, frag: cute.Tensor):
    """Q's A fragment of S = Q K^T in `quarter_d` order from its (16, d) 16-bit SMEM tile: frag
    (the tiled MMA's A fragment, ((2, 2, 2), 1, d / 16)) gets, at step s, a0 a1 = row g's columns
    t d/4 + 4s, + 1; a4 a5 = + 2, + 3; a2 a3, a6 a7 the same of row g + 8."""
    steps = cute.size(frag, mode=[2])
    words = cute.make_rmem_tensor((2 * steps, 2), Int32)  # a row's quarter: 4 elements a step
    load_row_quarters(sQ, lane, words)
    frag32 = cute.recast_tensor(frag, Int32)  # ((a0 a1, a2 a3, a4 a5, a6 a7), 1, steps)
    for s in cutlass.range_constexpr(steps):
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(2):
                frag32[i + 2 * h, 0, s] = words[2 * s + h, i]


@cute.jit
def k_operand(sK: cute.Tensor, lane: Int32, frag: cute.Tensor):
    """K's B fragment of S = Q K^T (fp16) in `quarter_d` order from the warp's (16 keys, d) FP8
    rows: frag (((2, 2), 2, d / 16): n tile i holds key g + 8i) gets, at step s, b0 b1 and b2 b3 =
    key g + 8i's bytes t d/4 + 4s .. + 3, converted. Two 16-byte loads a key at d128, one at d64."""
    steps = cute.size(frag, mode=[2])
    words = cute.make_rmem_tensor((steps, 2), Int32)  # a key's quarter: 4 bytes a step
    load_row_quarters(sK, lane, words)
    frag32 = cute.recast_tensor(frag, Int32)  # ((b0 b1, b2 b3), 2, steps)
    for s in cutlass.range_constexpr(steps):
        for i in cutlass.range_constexpr(2):
            for h in cutlass.range_constexpr(2):
                frag32[h, i, s] = e4m3_pair_to_f16x2(words[s, i], h)


@cute.jit
def value_words(v_base: Int32, sV_layout: cute.ComposedLayout, row0: Int32, stage: Int32, lane: Int32,
                words: cute.Tensor):
    """The warp's 16 V rows (rows row0 .. row0 + 15 of `stage` of the swizzled FP8 ring at byte
    address v_base, sV_layout its (rows, d, stages) layout) in `paired_d` order: words[2c + e] =
    the bytes of keys 2t, 2t + 1, 2t + 8, 2t + 9 at d column 16c + 2g + e (one ldmatrix .x4
    .trans and four prmt a 32 columns: matrix m holds keys 8 (m % 2) .., columns 16 (m / 2) ..)."""
    head_dim = cute.size(sV_layout.outer, mode=[1])
    m = lane // 8  # the matrix this lane addresses a row of
    row = row0 + 8 * (m % 2) + lane % 8
    for b in cutlass.range_constexpr(head_dim // (2 * CHUNK_BYTES)):
        r0, r1, r2, r3 = ldmatrix_x4_trans(v_base + cute.crd2idx((row, 2 * CHUNK_BYTES * b + CHUNK_BYTES * (m // 2),
                                                                  stage), sV_layout))
        words[4 * b] = byte_perm(r0, r1, EVEN_COLUMN)
        words[4 * b + 1] = byte_perm(r0, r1, ODD_COLUMN)
        words[4 * b + 2] = byte_perm(r2, r3, EVEN_COLUMN)
        words[4 * b + 3] = byte_perm(r2, r3, ODD_COLUMN)


@cute.jit
def zero_keys_past(words: cute.Tensor, valid_keys: Int32, lane: Int32):
    """Zero the bytes of keys valid_keys .. 15 in value_words' words (keys 2t, 2t + 1, 2t + 8,
    2t + 9 a word): a cache's unused rows hold anything, NaN included, and P = 0 there does not
    help (0 * NaN = NaN). e4m3 0x00 is +0."""
    t = lane % 4
    keep = Int32(0)
    for j in cutlass.range_constexpr(4):  # byte j: key 2t + j % 2 + 8 (j / 2)
        if 2 * t + j % 2 + 8 * (j // 2) < valid_keys:
            keep = keep | (Int32(0xFF) << (8 * j))
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = words[i] & keep


@cute.jit
def v_operand(words: cute.Tensor, frag: cute.Tensor):
    """V's B fragment of O = P V (fp16) from value_words' words: frag (((2, 2), d / 8, 1)) gets,
    of n tile j, b0 b1 = keys 2t, 2t + 1 and b2 b3 = keys 2t + 8, 2t + 9 of words[j]."""
    frag32 = cute.recast_tensor(frag, Int32)  # ((b0 b1, b2 b3), d / 8, 1)
    for j in cutlass.range_constexpr(cute.size(frag, mode=[1])):
        for h in cutlass.range_constexpr(2):
            frag32[h, j, 0] = e4m3_pair_to_f16x2(words[j], h)


def paired_d_columns(rows: int, head_dim: int) -> cute.Tensor:
    """A (rows, head_dim) coordinate tensor whose column n is d column `paired_d`(n) = 16 (n / 16)
    + 2 (n % 8) + (n / 8) % 2: partitioned like O's accumulator, the d column each value holds."""
    coords = cute.make_identity_tensor((rows, head_dim))
    paired = cute.make_layout((rows, (8, 2, head_dim // 16)), stride=(1, (2 * rows, rows, 16 * rows)))
    return cute.make_tensor(coords.iterator, cute.composition(coords.layout, paired))
