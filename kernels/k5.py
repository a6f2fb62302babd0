"""K5: K4.2's math, warp-specialized, with FlashAttention-3's two overlaps.

Roles (block = 128 * (1 + consumer warpgroups) threads):
    warpgroup 0, the producer: gives registers away (setmaxnreg.dec in all four warps); its warp 0
        issues every TMA copy: Q once, then K_j and V_j on *separate* pipelines, so that a K stage
        can be released as soon as S = Q K^T has read it, before P V has read V.
    warpgroups 1..n, the consumers: take the registers (setmaxnreg.inc), each owns 64 rows of the
        Q tile, runs both GEMMs and the softmax. K/V tiles are visited from the last to the first,
        so the only tiles that need a mask (the causal diagonal, the ragged end) come first.
Substages (flags; all three are one class):
    K5.1  warp specialization only. Per tile: S = QK^T, wait, softmax, O += PV, wait.
    K5.2  + ping-pong: two named barriers make the consumer warpgroups take turns issuing GEMMs, so
          one warpgroup's softmax runs under the other's GEMMs (warpgroup 1 starts with a credit).
    K5.3  + intra-warpgroup overlap: issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; softmax S_j
          while P V is in flight; the first tile's S and the last tile's P V form the prologue and
          epilogue. P_{j-1} lives in its own registers while S_j is computed.
Epilogue: O (scaled by 1/l) and LSE are written once from registers.

Constraints: head_dim 64/128/256 (tile_n per head dim in the registry); the register split is
24 (producer) / 240 (two consumer warpgroups), sum <= 64K registers per SM.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .common import mask, mma, pipeline, smem, softmax, tma
from .k4 import WgmmaAttention

PRODUCER_REGS, CONSUMER_REGS = 24, 240
SCHEDULER_BARRIER = 2  # named barriers 2 and 3: one per consumer warpgroup (0 is __syncthreads)


class WarpSpecializedAttention(WgmmaAttention):
    kv_pipelines = 2  # separate K and V barriers

    def __init__(self, dtype, head_dim: int, causal: bool, tile_m: int = 128, tile_n: int = 128,
                 kv_stages: int = 2, pingpong: bool = True, intra_wg_overlap: bool = True):
        super().__init__(dtype, head_dim, causal, tile_m, tile_n, kv_stages, pv_on_wgmma=True)
        self.consumer_wgs = tile_m // 64
        self.num_threads = 128 * (1 + self.consumer_wgs)
        self.pingpong = pingpong and self.consumer_wgs == 2
        self.intra_wg_overlap = intra_wg_overlap

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_blocks = cute.arch.grid_dim()[0]
        m_block_rev, head, batch = cute.arch.block_idx()
        m_block = m_blocks - 1 - m_block_rev  # longest (causal) tiles launch first
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_k, tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        consumer_warps = 4 * self.consumer_wgs
        kv_bytes = smem.stage_bytes(self.dtype, sKV_layout)
        barriers = storage.kv_barriers.data_ptr()
        q_pipe = pipeline.create(storage.q_full.data_ptr(), 1, consumer_warps,
                                 smem.stage_bytes(self.dtype, sQ_layout))
        k_pipe = pipeline.create(barriers, self.kv_stages, consumer_warps, kv_bytes)
        v_pipe = pipeline.create(barriers + 2 * self.kv_stages, self.kv_stages, consumer_warps, kv_bytes)
        pipeline.init_done()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        n_blocks = mask.n_block_max(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)
                tQsQ, tQgQ = tma.partition(tma_q, cute.local_tile(mQ[None, None, head, batch], tile_q, (None, 0)), sQ)
                tKsK, tKgK = tma.partition(tma_k, cute.local_tile(mK[None, None, head_kv, batch], tile_kv, (None, 0)), sK)
                tVsV, tVgV = tma.partition(tma_v, cute.local_tile(mV[None, None, head_kv, batch], tile_kv, (None, 0)), sV)
                self.load(q_pipe, k_pipe, v_pipe, m_block, n_blocks, (tma_q, tQgQ, tQsQ),
                          (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV))
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctx = self.compute_setup(sQ[None, None, 0], sK, sV, None, tidx - 128, m_block, seqlen_q, seqlen_k)
            self.mma_init(warp_idx // 4)
            pipeline.consume_wait(q_pipe, pipeline.consumer_state(1))
            if n_blocks > 0:
                if cutlass.const_expr(self.intra_wg_overlap):
                    self.mainloop_overlapped(ctx, k_pipe, v_pipe, n_blocks, warp_idx // 4, scale_log2)
                else:
                    self.mainloop(ctx, k_pipe, v_pipe, n_blocks, warp_idx // 4, scale_log2)
            self.compute_epilogue(ctx, mO, mLSE, batch, head, scale_log2)

    @cute.jit
    def load(self, q_pipe, k_pipe, v_pipe, m_block: Int32, n_blocks: Int32, q_copy, k_copy, v_copy):
        """Producer warp: Q once, then K_j and V_j from the last tile to the first."""
        pipeline.produce(q_pipe, pipeline.producer_state(1), m_block, [q_copy])
        k_state = pipeline.producer_state(self.kv_stages)
        v_state = pipeline.producer_state(self.kv_stages)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = n_blocks - 1 - j
            k_state = pipeline.produce(k_pipe, k_state, n_block, [k_copy])
            v_state = pipeline.produce(v_pipe, v_state, n_block, [v_copy])
        pipeline.tail(k_pipe, k_state)
        pipeline.tail(v_pipe, v_state)

    # ---------------------------------------------------------------- ping-pong scheduling
    @cute.jit
    def mma_init(self, wg: Int32):
        """Warpgroup 1 starts with the turn: a credit on its own barrier."""
        if cutlass.const_expr(self.pingpong):
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER, number_of_threads=256)

    @cute.jit
    def wait_turn(self, wg: Int32):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=SCHEDULER_BARRIER - 1 + wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, wg: Int32):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + 2 - wg, number_of_threads=256)

    # ---------------------------------------------------------------- consumer pieces
    @cute.jit
    def issue_qk(self, ctx, k_pipe, k_state):
        """Wait for K_j and issue S = Q K_j^T without waiting for it."""
        qk, thr_qk, tSrQ, tSrK, _, _, _, _ = ctx[0]
        pipeline.consume_wait(k_pipe, k_state)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index], zero_init=True, wait=-1)
        return acc_s

    @cute.jit
    def issue_pv(self, ctx, p, v_pipe, v_state):
        """Wait for V_j and issue O += P V_j without waiting for it."""
        pv, tOrVt, acc_o = ctx[1][0], ctx[1][1], ctx[1][2]
        pipeline.consume_wait(v_pipe, v_state)
        mma.gemm(pv, acc_o, mma.as_a_operand(p), tOrVt[None, None, None, v_state.index], wait=-1)

    @cute.jit
    def softmax_tile(self, ctx, acc_s, n_block: Int32, scale_log2: Float32):
        """Mask (only where needed) and online softmax on S in registers; returns the O rescale."""
        _, _, _, _, s_coords, m_block, seqlen_q, seqlen_k = ctx[0]
        row_max, row_sum = ctx[1][4], ctx[1][5]
        s_mn = mma.rows_cols(acc_s)
        if mask.tile_needs_mask(m_block, n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal):
            mask.apply(s_mn, s_coords, m_block * self.tile_m, n_block * self.tile_n, seqlen_q,
                       seqlen_k, self.causal)
        return softmax.online_update(s_mn, row_max, row_sum, scale_log2, 4)

    @cute.jit
    def rescale_o(self, ctx, correction: cute.Tensor):
        o_mn = mma.rows_cols(ctx[1][2])
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, c] = o_mn[r, c] * correction[r]

    @cute.jit
    def mainloop(self, ctx, k_pipe, v_pipe, n_blocks: Int32, wg: Int32, scale_log2: Float32):
        """K5.1/K5.2: one tile at a time; with ping-pong the other warpgroup's GEMMs cover this
        warpgroup's softmax."""
        k_state = pipeline.consumer_state(self.kv_stages)
        v_state = pipeline.consumer_state(self.kv_stages)
        # A turn runs from wait_turn to pass_turn and covers P_j V_j plus the next Q K^T; every
        # pass follows the same warpgroup's wait, so the two barriers strictly alternate.
        self.wait_turn(wg)
        for j in cutlass.range(n_blocks, unroll=1):
            acc_s = self.issue_qk(ctx, k_pipe, k_state)
            self.pass_turn(wg)
            warpgroup.wait_group(0)
            k_state = pipeline.release(k_pipe, k_state)
            correction = self.softmax_tile(ctx, acc_s, n_blocks - 1 - j, scale_log2)
            self.rescale_o(ctx, correction)
            p = cute.make_rmem_tensor_like(acc_s, self.dtype)
            p.store(acc_s.load().to(self.dtype))
            self.wait_turn(wg)
            self.issue_pv(ctx, p, v_pipe, v_state)
            warpgroup.wait_group(0)
            v_state = pipeline.release(v_pipe, v_state)
        self.pass_turn(wg)

    @cute.jit
    def mainloop_overlapped(self, ctx, k_pipe, v_pipe, n_blocks: Int32, wg: Int32, scale_log2: Float32):
        """K5.3: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together; softmax(S_j) under P V."""
        k_state = pipeline.consumer_state(self.kv_stages)
        v_state = pipeline.consumer_state(self.kv_stages)
        # prologue: the first (last-indexed) tile's S and P; O is still zero, nothing to rescale
        acc_s = self.issue_qk(ctx, k_pipe, k_state)
        warpgroup.wait_group(0)
        k_state = pipeline.release(k_pipe, k_state)
        self.softmax_tile(ctx, acc_s, n_blocks - 1, scale_log2)
        p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        p.store(acc_s.load().to(self.dtype))
        for j in cutlass.range(1, n_blocks, unroll=1):
            self.wait_turn(wg)
            acc_s = self.issue_qk(ctx, k_pipe, k_state)
            self.issue_pv(ctx, p, v_pipe, v_state)
            self.pass_turn(wg)
            warpgroup.wait_group(1)  # S_j has landed; P V may still run
            k_state = pipeline.release(k_pipe, k_state)
            correction = self.softmax_tile(ctx, acc_s, n_blocks - 1 - j, scale_log2)
            warpgroup.wait_group(0)  # P_{j-1} V_{j-1} is done: P's registers and V's stage are free
            v_state = pipeline.release(v_pipe, v_state)
            p.store(acc_s.load().to(self.dtype))
            self.rescale_o(ctx, correction)
        # epilogue: the last P V
        self.issue_pv(ctx, p, v_pipe, v_state)
        warpgroup.wait_group(0)
        v_state = pipeline.release(v_pipe, v_state)
