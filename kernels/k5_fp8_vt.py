"""F2: F1 with V transposed in SMEM by the producer warpgroup, FlashAttention-3's FP8 design.

FP8 WGMMA reads its B operand K-major only, so P V needs V^T (d, keys), keys contiguous. F1 gets
it from a transpose kernel over all of V before each call (kernels/fp8_transpose.py: one more
read and write of V: worklog/fp8.md has its cost). F2 loads V's rows by TMA, as
K's, into a ring the consumers never read; the producer warpgroup's idle warps 1-3 transpose each
landed stage into a second ring, V^T, which P V reads (`kv_pipelines = 3`: K, V and V^T barriers;
the V^T ring after V's in SMEM, V's `value_load_stages` deep: one at d256, where two of each do
not fit beside the 128-key K tiles). Warp 0 issues the copies as in K5; the consumers are F1's:
the FP8 forward's math is common/fp8_forward.py's, which both compose (neither builds on the other).

The transpose, per 16 keys x 32 bytes of d (one warp instruction each way; of each 32 bytes of d,
the three warps take every third group of 16 keys):
    ldmatrix .x4 .trans (b16): matrix m holds keys 8 (m % 2) .. + 7, d bytes 16 (m / 2) .. + 15;
        lane i receives, of matrix m, the byte pairs (key 2t and 2t + 1, t = i % 4) of d pair i / 4
    prmt: the even and the odd d byte of matrices 0 and 1 (and of 2 and 3) -> for one d row, keys
        2t, 2t + 1, 2t + 8, 2t + 9: exactly the order in which each thread packs P into the FP8 A
        operand (mma.fp8_a_order; F1's transpose kernel permutes keys the same way)
    stmatrix .x4: those 4-byte words, row i / 4 and bytes 4t of 16-byte rows of V^T (d rows
        2j, 2j + 1, 2j + 16, 2j + 17 of the 32)
Both sides address 16-byte rows through the rings' swizzled layouts (the swizzle permutes whole
16-byte chunks). The stages are handed on by mbarriers: V's TMA ring (consumed by the three
warps, one release each), and V^T's ring (96 producer threads, each after a fence.proxy.async:
stmatrix writes through the generic proxy, WGMMA reads through the async one; every consumer
thread releases it, as K5's consumers release V). The transposing warps do not follow the tile
schedule: they take V stages in ring order until warp 0, after its last copy has been read,
raises a flag in SMEM and completes the next stage's full barrier without a copy.

Registers: setmaxnreg.inc only takes what .dec frees, so producer + 2 x consumer stays within the
launch's 3 x 168 (32 + 2 x 240 hung the consumers). F2 runs 32 / 232 at d64-d128 with two consumer
warpgroups (24 spilled beside a window's state) and K5's 24 / 240 at d256 (its consumers spill at
232): kernels/config.fp8_forward_config. The transposing loops stay dynamic (unrolled over the d
blocks, their addresses spilled).

Constraints: F1's (head_dim 64/128/256: multiples of 32; tile_n 64 or 128).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass import pipeline as dsl_pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .common import pipeline, smem
from .common.fp8_forward import Fp8Forward
from .common.fp8_mma_sync import ldmatrix_x4_trans
from .config import ForwardConfig
from .k5_mainloop import ForwardMainloop

KEY_GROUP, D_BLOCK = 16, 32  # keys and d bytes one ldmatrix/stmatrix pair moves
TRANSPOSE_WARPS = 3  # the producer warpgroup's warps 1-3 (warp 0 issues the copies)


@dsl_user_op
def stmatrix_x4(addr: Int32, r0: Int32, r1: Int32, r2: Int32, r3: Int32, *, loc=None, ip=None):
    """Four 8x8 b16 matrices to SMEM (lanes 8m .. 8m + 7 address matrix m's rows)."""
    llvm.inline_asm(
        None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class Fp8TransposingAttention(Fp8Forward, ForwardMainloop):
    kv_pipelines = 3  # K, V (TMA -> producer warp), V^T (producer warp -> consumers)
    value_transposed_by_host = False  # the call passes V's rows (F1: V^T from fa3.fp8.transpose_v)

    def __init__(self, dtype, head_dim: int, causal: bool, config: ForwardConfig, varlen: bool = False,
                 local: bool = False, softcap: bool = False):
        """Fp8Forward's arguments; the configuration's `value_load_stages` (V's TMA ring depth),
        `transpose_unroll` (key groups a transposing warp has in flight) and register split (the
        transposing warps' addresses: 32 producer registers where two consumer warpgroups leave
        room) are F2's: kernels/config.fp8_forward_config."""
        super().__init__(dtype, head_dim, causal, config, varlen, local, softcap)
        assert config.transposes_v, "F2 loads V into a ring of its own (value_load_stages)"
        self.transpose_unroll = config.transpose_unroll
        # transpose_stage: a V^T row (tile_n bytes) is one swizzle atom wide
        assert self.tile_n in (64, 128), f"F2 transposes 64- or 128-key tiles, not {self.tile_n}"
        self.value_load_stages = config.value_load_stages

    # ---------------------------------------------------------------- host side (Fp8Forward's __call__)
    def v_layout(self):
        """V's rows as TMA lands them: K's tiles, value_load_stages deep."""
        return smem.tile_layout(self.dtype, self.tile_n, self.head_dim, self.value_load_stages)

    def value_smem_elems(self, sV_layout) -> int:
        return cute.cosize(sV_layout) + cute.cosize(self.vt_layout())

    # ---------------------------------------------------------------- device side
    @cute.jit
    def value_rings(self, storage, barriers, sV_layout, consumer_warps: cutlass.Constexpr):
        """V's TMA ring (read by the producer warp alone) and V^T's (filled by it, read by P V)."""
        v_pipe = pipeline.create(barriers, self.value_load_stages, TRANSPOSE_WARPS,
                                 smem.stage_bytes(self.dtype, sV_layout))
        vt_pipe = dsl_pipeline.PipelineAsync.create(
            barrier_storage=barriers + 2 * self.value_load_stages, num_stages=self.kv_stages,
            producer_group=dsl_pipeline.CooperativeGroup(dsl_pipeline.Agent.Thread, 32 * TRANSPOSE_WARPS),
            consumer_group=dsl_pipeline.CooperativeGroup(dsl_pipeline.Agent.Thread, 32 * consumer_warps),
            defer_sync=True)
        vt_layout = self.vt_layout()
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        vt_ptr = storage.sV.data_ptr() + cute.cosize(sV_layout)
        sVt = cute.make_tensor(cute.recast_ptr(vt_ptr, vt_layout.inner, dtype=self.dtype), vt_layout.outer)
        v_base = storage.sV.data_ptr().toint()  # SMEM byte addresses (1-byte elements)
        # the producer warp's "no more stages" flag, cleared before the kernel's barrier sync
        done = storage.value_done.get_tensor(cute.make_layout(1))
        if cute.arch.thread_idx()[0] == 0:
            done[0] = Int32(0)
        transpose = (v_pipe, vt_pipe, sV_layout, vt_layout, v_base, v_base + cute.cosize(sV_layout), done)
        return (v_pipe, sV), (vt_pipe, sVt), transpose

    def producer_states(self):
        """K5's, with V's ring value_load_stages deep."""
        return (pipeline.producer_state(self.q_stages), pipeline.producer_state(self.kv_stages),
                pipeline.producer_state(self.value_load_stages))

    @cute.jit
    def producer_helpers(self, warp_idx: Int32, params):
        """Warps 1-3: every landed V stage into the next free V^T stage, until the producer warp's
        sentinel (`after_loads`) lands instead of a stage."""
        v_pipe, vt_pipe, sV_layout, vt_layout, v_base, vt_base, done = params.value_transpose
        v_state = pipeline.consumer_state(self.value_load_stages)
        vt_state = pipeline.producer_state(self.kv_stages)
        pipeline.consume_wait(v_pipe, v_state)
        finished = done[0]
        while finished == 0:
            vt_pipe.producer_acquire(vt_state)
            self.transpose_stage(warp_idx - 1, v_base, vt_base, sV_layout, vt_layout, v_state.index,
                                 vt_state.index)
            cute.arch.fence_proxy("async.shared", space="cta")  # stmatrix (generic) -> WGMMA (async)
            vt_pipe.producer_commit(vt_state)  # each thread, after its own writes
            vt_state.advance()
            v_state = pipeline.release(v_pipe, v_state)
            pipeline.consume_wait(v_pipe, v_state)
            finished = done[0]

    @cute.jit
    def after_loads(self, v_pipe, v_state, params):
        """Every V stage has been transposed and released (the tail waited): flag the end and
        complete the next stage's full barrier with no copy, so the transposing warps wake up
        and stop."""
        done = params.value_transpose[-1]
        if cute.arch.lane_idx() == 0:
            done[0] = Int32(1)
            cute.arch.mbarrier_arrive(v_pipe.producer_get_barrier(v_state))  # release: after the flag

    @cute.jit
    def transpose_stage(self, warp: Int32, v_base: Int32, vt_base: Int32, sV_layout: cute.ComposedLayout,
                        vt_layout: cute.ComposedLayout, v_stage: Int32, vt_stage: Int32):
        """This warp's share (key groups warp, warp + 3, ... of every d block) of V stage (tile_n,
        d) -> V^T stage (d, tile_n), each 16 keys in P's order (docstring)."""
        lane = cute.arch.lane_idx()
        m = lane // 8  # the matrix this lane addresses a row of
        key_in_group = 8 * (m % 2) + lane % 8  # ldmatrix: keys 0-7 / 8-15, d bytes 0-15 / 16-31
        d_in_block = 2 * (lane % 8) + m % 2 + 16 * (m // 2)  # stmatrix: d rows 2j (+1) (+16)
        # 16 keys further down V's tile are whole swizzle atoms further (the swizzle mixes a row's
        # chunks by row % 8): the ldmatrix address of key group g is group 0's + g * key_group
        key_group = cute.crd2idx((KEY_GROUP, 0, 0), sV_layout)
        even, odd = Int32(0x6420), Int32(0x7531)
        for b in cutlass.range(self.head_dim // D_BLOCK, unroll=1):
            src0 = v_base + cute.crd2idx((key_in_group, D_BLOCK * b + 16 * (m // 2), v_stage), sV_layout)
            # V^T's rows are tile_n bytes (64 or 128: one swizzle atom wide), so the 16-byte chunk
            # of key group g sits at the row's chunk bits XOR g: group 0's address XOR 16 g
            dst0 = vt_base + cute.crd2idx((D_BLOCK * b + d_in_block, 0, vt_stage), vt_layout)
            for g in cutlass.range(warp, self.tile_n // KEY_GROUP, TRANSPOSE_WARPS, unroll=self.transpose_unroll):
                r0, r1, r2, r3 = ldmatrix_x4_trans(src0 + g * key_group)
                dst = dst0 ^ (KEY_GROUP * g)
                # d row 2j: keys 2t, 2t + 1 (matrix 0's even bytes), 2t + 8, 2t + 9 (matrix 1's);
                # row 2j + 1: the odd bytes; matrices 2 and 3: rows 16 on
                stmatrix_x4(dst, Int32(cute.arch.prmt(r0, r1, even)), Int32(cute.arch.prmt(r0, r1, odd)),
                            Int32(cute.arch.prmt(r2, r3, even)), Int32(cute.arch.prmt(r2, r3, odd)))
