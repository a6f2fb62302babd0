"""B9: B2 with dK and dV computed transposed, for the wide head dims (192, 256).

B2 accumulates dK and dV as (tile_n, d): the K/V tile is the WGMMA's M, so it comes in whole
64-row atoms per warpgroup, and at d192/d256 the registers (two (tile_n, d) FP32 accumulators)
and SMEM (two Q/dO stages beside a 64 x d FP32 dQ buffer) leave B2 64-key tiles, one Q/dO stage
at d256. Here (FlashAttention-3's `dKV_swapAB`) the same GEMMs produce the transposes:

    dV^T += dO^T P     (d, tile_n)   A = dO^T (MN-major, SMEM), B = P^T viewed (N, K) (MN-major, SMEM)
    dK^T += Q^T dS     (d, tile_n)   A = Q^T  (MN-major, SMEM), B = dS^T viewed (N, K) (MN-major, SMEM)

The head dim is now M: d256's 256 rows split into 128 a warpgroup, d192's 192 (three atoms)
do not halve, so there the warpgroups split the keys instead (48 of 96 each; P and dS take the
32-byte swizzle so a warpgroup's 48 columns are whole atoms). The key count is N, any multiple
of 8 a warpgroup: 96 keys at d192 and 64 at d256. S, dP and dQ are B2's (S and dP split the keys
among the warpgroups).

One dO stage (`do_stages` = 1, bwd.py): dO_i comes in a ring of its own, waited for between S
and dP and released as soon as dV^T is done, while Q keeps two stages. The SMEM it frees buys
64-key tiles at d256 (cuDNN's width; with two Q/dO stages only 48 fit, flash-attn-4's) and a dQ
buffer per warpgroup at d192 (`shared_dq_buffer` False); under locked clocks on an H100 the
d256 main kernel took 18-20% fewer cycles than on 48-key tiles, d192's 12% fewer
(worklog/backward.md).

The FP32 dQ buffer at d256 holds one warpgroup's share (half a Q tile), and the warpgroups take
turns: warpgroup 0 fills it, the writer warp adds it to global memory, hands it
to warpgroup 1 once read, adds that one, hands it back. Warpgroup 1 waits for the writer while
its dV^T and dK^T GEMMs run. The turns are mbarriers (full and empty per warpgroup, waited on
by parity), not B2's named barriers: thread t of each warpgroup writes the same bytes, and
compute-sanitizer's racecheck orders such writes through mbarriers but reports looped
named-barrier hand-offs as hazards (a 96-thread model of these turns: 1024 reported with named
barriers, 0 with mbarriers; both ran correctly).
With `shared_dq_buffer` False each warpgroup has a buffer of its own, handed back to it once
read (no turns). bf16 d192: Q 2 x 24 KB, dO 24 KB, K/V 72 KB, P/dS 24 KB, dQ 2 x 24 KB = 216 KB;
d256: Q 2 x 32 KB, dO 32 KB, K/V 64 KB, P/dS 16 KB, dQ 32 KB = 208 KB.

After the walk dK and dV leave as B2's do (rows through the free sK/sV tiles, 16-byte stores),
written into the tiles through the transposed view element by element (once per CTA).
Everything else (loader, statistics, masks, packed batches, determinism, the postprocess) is B2's.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .bwd_ws import WarpSpecializedBackward
from .common import accum, mma, smem

# the dQ turns' mbarriers (`dq_turns`): full and empty of warpgroup w at 2 w and 2 w + 1
TURN_FULL, TURN_EMPTY = 0, 1


class TransposedDkvBackward(WarpSpecializedBackward):
    kv_tile_multiple = 16  # the keys are N of dK^T/dV^T (and of S, dP): 8 a warpgroup
    dq_turn_barriers = 4  # (full, empty) a warpgroup

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 64, tile_n: int = 128,
                 q_stages: int = 2, deterministic: bool = False, local: bool = False,
                 softcap: bool = False, varlen: bool = False, ordered_dq: bool = False,
                 head_dim_v: int | None = None, do_stages: int = 0, shared_dq_buffer: bool = True):
        super().__init__(dtype, head_dim, causal, tile_m, tile_n, q_stages, deterministic, local,
                         softcap, varlen, ordered_dq, head_dim_v, do_stages)
        # the FP32 dQ buffer: one warpgroup's share, the warpgroups in turns; False: a share for
        # each (flash-attn-4's; SMEM allows it at d192 beside one dO stage, `do_stages`)
        self.shared_dq_buffer = shared_dq_buffer

    # ---------------------------------------------------------------- host side
    def dkv_split_n(self, head_dim: int | None = None) -> bool:
        """Whether the warpgroups split dK^T's (or dV^T's: `head_dim` = head_dim_v) keys (d192:
        three 64-row atoms do not halve) rather than its head dim rows."""
        return ((head_dim or self.head_dim) // 64) % self.mma_warpgroups != 0

    def dkv_tile(self, head_dim: int | None = None):
        return head_dim or self.head_dim, self.tile_n

    def dkv_view(self, tile: cute.Tensor) -> cute.Tensor:
        return mma.transpose_view(tile)

    def dkv_mma(self, head_dim: int):
        """dK^T's (head_dim) or dV^T's (head_dim_v) tiled MMA: (head dim, tile_n)."""
        return mma.tiled_mma(self.dtype, *self.dkv_tile(head_dim), a_major="MN", b_major="MN",
                             warpgroups=self.mma_warpgroups, split_n=self.dkv_split_n(head_dim))

    def smem_layouts(self, head_dim: int | None = None, stages: int | None = None):
        """Q and dO: K-major A of S/dP and MN-major A of dK^T/dV^T (d256: 128 rows a warpgroup,
        whole 128-byte atoms); K: MN-major B of dQ as B2's; P and dS: MN-major B of dK^T/dV^T,
        whose keys the warpgroups split at d192 (the swizzle fits a warpgroup's share; with
        head_dim_v, whichever of dK^T and dV^T splits them). `head_dim`, `stages`: as B2's."""
        wgs, d = self.mma_warpgroups, head_dim or self.head_dim
        # the keys a warpgroup writes (S's split: 24 at d256) or reads (dK^T/dV^T's at d192)
        split = self.dkv_split_n() or self.dkv_split_n(self.head_dim_v)
        key_share = min(mma.n_share(self.tile_m, self.tile_n, wgs),
                        self.tile_n // wgs if split else self.tile_n)
        return (smem.tile_layout(self.dtype, self.tile_m, d, stages or self.q_stages),
                smem.tile_layout(self.dtype, self.tile_n, d, 1, share=mma.n_share(self.tile_m, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_m, self.tile_n, 1, share=key_share))

    def sdq_layout(self):
        """One warpgroup's FP32 dQ share in fragment order (the warpgroups take turns), or with
        `shared_dq_buffer` off one for each warpgroup."""
        return cute.make_layout((self.half_elems(), 1 if self.shared_dq_buffer else self.mma_warpgroups))

    def dkv_operands(self, s, wg_dkv) -> dict:
        """dV^T's and dK^T's (A, B) fragments: dO^T and P^T viewed (N, K), Q^T and dS^T."""
        t = mma.transpose_view
        dv = self.dv_operands(s, wg_dkv) if self.head_dim_v == self.head_dim else {}  # (else mma_setup's)
        return dict(**dv, tdKrQt=mma.fragment_A(wg_dkv, t(s.sQ)), tdKrdSt=mma.fragment_B(wg_dkv, t(s.sdS)))

    def dv_operands(self, s, wg_dv) -> dict:
        """dV^T's (A, B) fragments: dO^T and P^T viewed (N, K)."""
        t = mma.transpose_view
        return dict(tdVrdOt=mma.fragment_A(wg_dv, t(s.sdO)), tdVrPt=mma.fragment_B(wg_dv, t(s.sP)))

    # ---------------------------------------------------------------- device side
    @cute.jit
    def issue_dkv(self, ctx, s, stage, do_stage=None):
        """dV^T += dO^T P and dK^T += Q^T dS, every operand from SMEM (no wait); dO from
        `do_stage` (default: Q's `stage`)."""
        do_stage = stage if cutlass.const_expr(do_stage is None) else do_stage
        mma.gemm(ctx.dv, ctx.acc_dv, ctx.tdVrdOt[None, None, None, do_stage], ctx.tdVrPt[None, None, None, 0], wait=-1)
        mma.gemm(ctx.dkv, ctx.acc_dk, ctx.tdKrQt[None, None, None, stage], ctx.tdKrdSt[None, None, None, 0], wait=-1)

    @cute.jit
    def dkv_to_smem(self, ctx, frag: cute.Tensor, sX: cute.Tensor, tiled: cute.TiledMma):
        """dK^T or dV^T (rounded) into the (tile_n, d) tile sX through its transposed view."""
        mma.store_to_smem(frag, tiled, ctx.tidx, self.dkv_view(sX), transpose=True)

    def make_pipelines(self, storage, sQ_layout, sKV_layout, consumer_warps):
        pipes = super().make_pipelines(storage, sQ_layout, sKV_layout, consumer_warps)
        self.init_dq_turns(storage.dq_turns.data_ptr())  # made visible by pipeline.init_done
        return pipes

    @cute.jit
    def init_dq_turns(self, turns):
        """Full: the warpgroup's 128 threads arrive once their share is in; empty: the writer
        warp's 32 lanes once the bulk copy has read it."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            for w in cutlass.range_constexpr(self.mma_warpgroups):
                cute.arch.mbarrier_init(turns + 2 * w + TURN_FULL, 128)
                cute.arch.mbarrier_init(turns + 2 * w + TURN_EMPTY, 32)

    def smem_tensors(self, storage, sQ_layout, sKV_layout, sPdS_layout):
        s = super().smem_tensors(storage, sQ_layout, sKV_layout, sPdS_layout)
        s.dq_turns = storage.dq_turns.data_ptr()
        return s

    @cute.jit
    def hand_off_dq(self, ctx, s, acc_dq: cute.Tensor, buffer: Int32 = 0, step: Int32 = 0):
        """Wait for this warpgroup's turn at the one-share SMEM buffer (its `step`-th, by parity),
        or for its own buffer to be read (`shared_dq_buffer` off), fill it, tell the writer."""
        w = cute.arch.make_warp_uniform(ctx.tidx // 128)
        cute.arch.mbarrier_wait(s.dq_turns + 2 * w + TURN_EMPTY, step % 2)
        self.store_fragment(acc_dq, s.sdQ[None, 0 if cutlass.const_expr(self.shared_dq_buffer) else w],
                            ctx.tidx % 128)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copy
        cute.arch.mbarrier_arrive(s.dq_turns + 2 * w + TURN_FULL)

    @cute.jit
    def write_dq(self, mdQacc, s, mLock, n_block: Int32, head: Int32, batch: Int32,
                 start: Int32, m_first: Int32, m_end: Int32, seq, window, lane: Int32):
        """dQ writer warp: per Q tile, warpgroup 0's share then warpgroup 1's, each one bulk
        reduce-add from the one buffer, handed to the other warpgroup once read (or each from its
        own buffer, handed back to its warpgroup: `shared_dq_buffer` off). Ordered: the turn is
        awaited before the first share and passed on once both have landed."""
        half = self.half_elems()
        wgs = self.mma_warpgroups
        shared = self.shared_dq_buffer
        for w in cutlass.range_constexpr(1 if shared else wgs):
            cute.arch.mbarrier_arrive(s.dq_turns + 2 * w + TURN_EMPTY)  # the first turn(s)
        for i in cutlass.range(m_end - m_first, unroll=1):
            m_block = self.m_block_at(i, start, m_first, m_end)
            for w in cutlass.range_constexpr(wgs):
                cute.arch.mbarrier_wait(s.dq_turns + 2 * w + TURN_FULL, i % 2)
                if cutlass.const_expr(self.ordered_dq and w == 0):
                    counter = self.wait_dq_turn(mLock, seq, m_block, n_block, head, batch, window, lane,
                                                cute.arch.sync_warp)
                if lane == 0:
                    self.reduce_fragments(mdQacc, s.sdQ[None, 0 if shared else w].iterator, seq, m_block,
                                          head, batch, half, w * half)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the buffer has been read
                cute.arch.mbarrier_arrive(s.dq_turns + 2 * ((w + 1) % wgs if shared else w) + TURN_EMPTY)
            if cutlass.const_expr(self.ordered_dq):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # both shares' sums have landed
                accum.ordered_end(counter, lane, cute.arch.sync_warp)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
