"""V^T for the FP8 forward: (batch, seqlen_k, heads_kv, d) e4m3 -> (batch, heads_kv, d, keys).

FP8 WGMMA reads B K-major only, so P V needs V with the keys contiguous; and the FP8 P operand
packs each 16 keys in its own order (mma.fp8_a_order): key 16 b + 8 a + 2 t + c goes to position
16 b + 4 t + 2 a + c. `keys` is seqlen_k rounded up to 16, zeros past seqlen_k.

Bytes are moved as 32-bit words (the tensors are Int32 views of the FP8 data):

    thread (j, kb): the word j (d bytes 4 j .. 4 j + 3) of the 16 keys of block kb, 16 loads;
    then, for each of its 4 d rows, the 16 keys in the P operand's order as 4 words (byte shifts
    and masks), one 16-byte store. Lanes 2 i and 2 i + 1 take the same word of two adjacent key
    blocks (`key_lanes`): a warp's store then fills whole 32-byte sectors (16 rows, 32 bytes
    each), and its loads whole 64-byte row segments: about a copy of V's time, where each lane on
    its own key block (a store fills half a sector) or two key blocks a thread took twice that or
    more (worklog/fp8.md).

Packed batches (`packed`, attention_varlen): V is (1, total_k, heads, d / 4) and V^T one entry
whose columns give sequence b its own run of 16-aligned blocks from block ceil(cu_k[b] / 16) + b
(kernels/k5_fp8.py reads it there); each thread finds the sequence of its block by a binary
search over cu_k, and blocks between runs are zeros. Offsets are clamped into [0, total_k], so
values no host check saw never send a load outside V.

Memory-bound: one read and one write of V. A CTA of 128 threads covers 512 / d key blocks.
Constraints: d / 2 divides 128 (d 64, 128, 256).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

KEY_BLOCK = 16
KEY_LANES = 2  # adjacent lanes on adjacent key blocks: two 16-byte stores fill a sector
THREADS = 128


class ValueTranspose:
    def __init__(self, head_dim: int, packed: bool = False, key_lanes: int = KEY_LANES):
        assert head_dim % 4 == 0 and THREADS % (head_dim // 4 * key_lanes) == 0, head_dim
        self.head_dim, self.packed, self.key_lanes = head_dim, packed, key_lanes
        self.words = head_dim // 4  # 32-bit words a V row
        self.blocks_per_cta = THREADS // self.words  # key blocks a CTA

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: cute.Tensor, stream):
        """mV: (batch, seqlen_k, heads, d / 4) Int32; mVt: (batch, heads, d, keys / 4) Int32;
        mCuSeqlensK: a packed batch's int32 offsets (a stand-in otherwise)."""
        batch, heads = mVt.shape[0], mVt.shape[1]
        key_blocks = mVt.shape[3] // 4
        self.kernel(mV, mVt, mCuSeqlensK).launch(
            grid=[cute.ceil_div(key_blocks, self.blocks_per_cta), heads, batch],
            block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def source_keys(self, mCuSeqlensK: cute.Tensor, kb: Int32, total: Int32):
        """(first key, end) in V of packed V^T's block kb: its sequence's keys from the block's
        place in the sequence's run; end = the sequence's end (keys from there are zeros)."""
        lo, hi = Int32(0), Int32(mCuSeqlensK.shape[0] - 2)
        while lo < hi:  # the last sequence whose run starts at or before block kb
            mid = (lo + hi + 1) // 2
            if (mCuSeqlensK[mid] + KEY_BLOCK - 1) // KEY_BLOCK + mid <= kb:
                lo = mid
            else:
                hi = mid - 1
        start = cutlass.max(cutlass.min(mCuSeqlensK[lo], total), 0)
        end = cutlass.max(cutlass.min(mCuSeqlensK[lo + 1], total), start)
        first = start + (kb - (start + KEY_BLOCK - 1) // KEY_BLOCK - lo) * KEY_BLOCK
        return first, end

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        seqlen = mV.shape[1]
        # tidx = (key lane, word, the rest): lanes 2 i, 2 i + 1 on the same word, adjacent blocks
        j = tidx // self.key_lanes % self.words
        kb = block * self.blocks_per_cta + tidx % self.key_lanes \
            + tidx // (self.key_lanes * self.words) * self.key_lanes
        if kb < mVt.shape[3] // 4:
            first, end = kb * KEY_BLOCK, seqlen
            if cutlass.const_expr(self.packed):
                first, end = self.source_keys(mCuSeqlensK, kb, seqlen)
            words = cute.make_rmem_tensor((KEY_BLOCK,), Int32)
            for i in cutlass.range_constexpr(KEY_BLOCK):
                key = first + i
                words[i] = Int32(0)
                if key < end and key >= 0:
                    words[i] = mV[batch, key, head, j]
            out = cute.make_rmem_tensor((4,), Int32)
            gVt = cute.local_tile(mVt[batch, head, None, None], (1, 4), (None, kb))
            for r in cutlass.range_constexpr(4):
                shift = 8 * r
                for t in cutlass.range_constexpr(4):
                    # position 4 t + 2 a + c holds key 8 a + 2 t + c: bytes (c, a) of word t
                    out[t] = (((words[2 * t] >> shift) & 0xFF)
                              | (((words[2 * t + 1] >> shift) & 0xFF) << 8)
                              | (((words[8 + 2 * t] >> shift) & 0xFF) << 16)
                              | (((words[9 + 2 * t] >> shift) & 0xFF) << 24))
                cute.autovec_copy(out, gVt[0, None, 4 * j + r])
