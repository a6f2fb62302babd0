"""K5's consumer mainloop: what a consumer warpgroup does with each K/V tile of its Q tile.

    issue S = Q K_j^T; softmax (mask only on the tiles that need one, online max and sum); rescale
    O when a row's max moved; P rounded into the A operand's registers; issue O += P V_j

Two orders of the same steps (a mixin beside WarpSpecializedForward, which owns the roles, the
pipelines and the epilogue: common/warp_specialized_forward.py; K5, the FP8 forward and K5 over a
KV cache compose both):
    `mainloop` (K5.1/K5.2): one tile at a time; with ping-pong (common/pingpong.py) the other
        warpgroup's GEMMs run under this one's softmax.
    `mainloop_overlapped` (K5.3 on): S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together,
        softmax(S_j) under P V; the first tile's S and the last tile's P V are its prologue and
        epilogue.
K/V tiles are visited in the order of the tile's walk (ctx.walk, common/kv_walk.py): K5's own runs
from the last tile to the first, and `masked_tiles` splits it into the masked ones (ragged end,
diagonal, a window's edges) and a steady-state loop with no mask code; score and mask mods (flex
attention: `score_mod`, `mask_mod`, None unless compiled in) run on every tile. A block mask's walk
visits its partial blocks (the mask mod and the sequence-end mask) and then its full blocks (the
score mod only; the sequence-end mask too where the last K/V tile is ragged, `full_blocks`). FP8
(common/fp8_forward.py) replaces the three P hooks (`new_p`, `convert_p`, `p_operand`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .common import mask, mma, pipeline, softmax


class ForwardMainloop:
    @cute.jit
    def issue_qk(self, ctx, k_pipe, k_state):
        """Wait for K_j and issue S = Q K_j^T without waiting for it."""
        pipeline.consume_wait(k_pipe, k_state)
        acc_s = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        mma.gemm(ctx.qk, acc_s, ctx.tSrQ, ctx.tSrK[None, None, None, k_state.index], zero_init=True, wait=-1)
        return acc_s

    @cute.jit
    def issue_pv(self, ctx, p, v_pipe, v_state):
        """Wait for V_j and issue O += P V_j without waiting for it."""
        pipeline.consume_wait(v_pipe, v_state)
        mma.gemm(ctx.pv, ctx.acc_o, self.p_operand(p), ctx.tOrVt[None, None, None, v_state.index], wait=-1)

    @cute.jit
    def softmax_tile(self, ctx, acc_s, n_block: Int32, scale_log2: Float32, masked: cutlass.Constexpr,
                     partial: cutlass.Constexpr = True):
        """Mask (`masked` tiles only) and online softmax on S in registers; returns the O rescale.
        `partial`: the mask mod runs here (every tile but a block mask's full blocks)."""
        s_mn = mma.rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softmax.softcap(s_mn, ctx.softcap_scale)
        mask_mod = self.mask_mod if cutlass.const_expr(partial) else None
        if cutlass.const_expr(self.score_mod is not None or mask_mod is not None):
            # before the positional masks; the score's scale rides in softcap_scale (the host folds
            # it out of scale_log2 when a score mod sees scaled scores)
            mask.apply_mods(s_mn, ctx.s_coords, ctx.m_block * self.tile_m, n_block * self.tile_n,
                            ctx.batch, ctx.head, ctx.softcap_scale, mask.bind_mod(self.score_mod, ctx.aux),
                            mask.bind_mod(mask_mod, ctx.aux))
        if cutlass.const_expr(masked):
            mask.apply(s_mn, ctx.s_coords, ctx.m_block * self.tile_m, n_block * self.tile_n,
                       ctx.seqlen_q, ctx.seqlen_k, self.causal, window=ctx.window)
        return softmax.online_update(s_mn, ctx.row_max, ctx.row_sum, scale_log2, 4, self.p_offset_log2)

    # P = exp(S - max) in registers, rounded to the operand type of P V and used as its A operand
    # (16-bit: the accumulator's own layout, regrouped); FP8 replaces these three.

    def new_p(self, ctx, acc_s: cute.Tensor) -> cute.Tensor:
        return cute.make_rmem_tensor_like(acc_s, self.dtype)

    def convert_p(self, p: cute.Tensor, acc_s: cute.Tensor):
        # as 32-bit pairs (cvt.rn.bf16x2 into an Int32 view): 16-bit halves converted one by one
        # were repacked right before each P V WGMMA, and at d192 ptxas fenced those repacks with
        # warpgroup.arrive (C7519; what the pairs gained: worklog/k5.md)
        mma.to_dtype_packed(acc_s, p)

    def p_operand(self, p: cute.Tensor) -> cute.Tensor:
        return mma.as_a_operand(p)

    @cute.jit
    def masked_tiles(self, ctx, n_blocks: Int32):
        """(high, low): visits j < high (the highest tiles: ragged end, diagonal, window's right
        edge) and j >= low (a window's left edge) need a mask; those between run a loop with no
        mask code at all: a branch inside the steady-state loop lets ptxas hoist the wait for the
        in-flight P V above the softmax, which undoes the overlap. A block mask's walk: its partial
        blocks, then its full ones (common/kv_walk.py)."""
        high, low = n_blocks, n_blocks
        if cutlass.const_expr(ctx.walk.sparse):
            high = ctx.walk.partial_count
        else:
            first_row_limit = mask.col_limit(ctx.m_block * self.tile_m, ctx.seqlen_q, ctx.seqlen_k,
                                             self.causal, ctx.window)
            unmasked = cutlass.max(first_row_limit, 0) // self.tile_n
            high = n_blocks - cutlass.min(n_blocks, unmasked)
            if cutlass.const_expr(ctx.window is not None):
                high = cutlass.min(n_blocks, ctx.n_max - cutlass.min(ctx.n_max, unmasked))
                left = mask.n_block_unmasked_min(ctx.m_block, self.tile_m, self.tile_n, ctx.seqlen_q,
                                                 ctx.seqlen_k, window=ctx.window)
                low = cutlass.min(n_blocks, cutlass.max(high, ctx.n_max - left))
        return high, low

    @cute.jit
    def rescale_o(self, ctx, correction: cute.Tensor):
        """O *= the per-row correction. With `rescale_vote`, skipped (warp-uniformly) when no row
        of the warp raised its running max, which is most tiles once a long row has seen its
        largest scores. Without it every tile pays the multiplies, but the branch is gone: at d128
        the vote's branch let ptxas hoist the overlapped step's wait for P V above the exp2s (the
        warps then waited for P V with the softmax still to do), and the unconditional rescale
        keeps the wait after them: 3.5% fewer cycles at d128. The vote wins at d64/96/256, where
        the multiplies (d256: 128 a thread beside 40 exponentials) cost more than the placement
        gains, and d192 measured either way (worklog/k5.md)."""
        if cutlass.const_expr(self.rescale_vote):
            moved = correction[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(correction)):
                moved = moved | (correction[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                softmax.rescale(mma.rows_cols(ctx.acc_o), correction)
        else:
            softmax.rescale(mma.rows_cols(ctx.acc_o), correction)

    @cute.jit
    def mainloop(self, ctx, k_pipe, v_pipe, k_state, v_state, n_blocks: Int32, wg: Int32,
                 scale_log2: Float32):
        """K5.1/K5.2: one tile at a time; with ping-pong the other warpgroup's GEMMs cover this
        warpgroup's softmax."""
        n_masked, low = self.masked_tiles(ctx, n_blocks)
        walk = ctx.walk
        # A turn runs from wait_turn to pass_turn and covers P_j V_j plus the next Q K^T; every
        # pass follows the same warpgroup's wait, so the two barriers strictly alternate.
        self.wait_turn(wg)
        for j in cutlass.range(n_masked, unroll=1):
            k_state, v_state = self.step(ctx, k_pipe, v_pipe, k_state, v_state, walk.partial_block(j), wg,
                                         scale_log2, True)
        if cutlass.const_expr(walk.sparse):
            if cutlass.const_expr(walk.has_full):
                k_state, v_state = self.full_blocks(ctx, k_pipe, v_pipe, k_state, v_state, None, n_masked, low, wg,
                                                    scale_log2)
        else:
            for j in cutlass.range(n_masked, low, unroll=1):
                k_state, v_state = self.step(ctx, k_pipe, v_pipe, k_state, v_state, walk.block(j), wg,
                                             scale_log2, False)
        if cutlass.const_expr(ctx.window is not None):
            for j in cutlass.range(low, n_blocks, unroll=1):
                k_state, v_state = self.step(ctx, k_pipe, v_pipe, k_state, v_state, walk.block(j), wg,
                                             scale_log2, True)
        self.pass_turn(wg)
        return k_state, v_state

    @cute.jit
    def full_blocks(self, ctx, k_pipe, v_pipe, k_state, v_state, p, start: Int32, stop: Int32, wg: Int32,
                    scale_log2: Float32):
        """Visits start .. stop - 1 of a block mask's walk, its full blocks: no mask mod. Where the
        sequence's last K/V tile is ragged, one of them may be it, so they all take the
        sequence-end mask; the choice is one branch outside the loops (a branch inside would undo
        the overlap, as `masked_tiles` says). `p`: None (`step`) or P's registers
        (`overlapped_step`)."""
        walk = ctx.walk
        if walk.ragged:
            for j in cutlass.range(start, stop, unroll=1):
                k_state, v_state = self.visit(ctx, k_pipe, v_pipe, k_state, v_state, p, walk.full_block(j), wg,
                                              scale_log2, True, False)
        else:
            for j in cutlass.range(start, stop, unroll=1):
                k_state, v_state = self.visit(ctx, k_pipe, v_pipe, k_state, v_state, p, walk.full_block(j), wg,
                                              scale_log2, False, False)
        return k_state, v_state

    def visit(self, ctx, k_pipe, v_pipe, k_state, v_state, p, n_block: Int32, wg: Int32, scale_log2: Float32,
              masked: cutlass.Constexpr, partial: cutlass.Constexpr):
        """`step` (p None) or `overlapped_step` on tile n_block."""
        if cutlass.const_expr(p is None):
            return self.step(ctx, k_pipe, v_pipe, k_state, v_state, n_block, wg, scale_log2, masked, partial)
        return self.overlapped_step(ctx, k_pipe, v_pipe, k_state, v_state, p, n_block, wg, scale_log2, masked,
                                    partial)

    @cute.jit
    def step(self, ctx, k_pipe, v_pipe, k_state, v_state, n_block: Int32, wg: Int32,
             scale_log2: Float32, masked: cutlass.Constexpr, partial: cutlass.Constexpr = True):
        acc_s = self.issue_qk(ctx, k_pipe, k_state)
        self.pass_turn(wg)
        warpgroup.wait_group(0)
        k_state = pipeline.release(k_pipe, k_state)
        correction = self.softmax_tile(ctx, acc_s, n_block, scale_log2, masked, partial)
        self.rescale_o(ctx, correction)
        p = self.new_p(ctx, acc_s)
        self.convert_p(p, acc_s)
        self.wait_turn(wg)
        self.issue_pv(ctx, p, v_pipe, v_state)
        warpgroup.wait_group(0)
        v_state = pipeline.release(v_pipe, v_state)
        return k_state, v_state

    @cute.jit
    def mainloop_overlapped(self, ctx, k_pipe, v_pipe, k_state, v_state, n_blocks: Int32, wg: Int32,
                            scale_log2: Float32):
        """K5.3: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together; softmax(S_j) under P V."""
        n_masked, low = self.masked_tiles(ctx, n_blocks)
        walk = ctx.walk
        # prologue: the first visit's S and P; O is still zero, nothing to rescale
        acc_s = self.issue_qk(ctx, k_pipe, k_state)
        warpgroup.wait_group(0)
        k_state = pipeline.release(k_pipe, k_state)
        if cutlass.const_expr(walk.sparse and walk.has_full):
            if walk.partial_count > 0:
                self.softmax_tile(ctx, acc_s, walk.partial_block(0), scale_log2, True)
            else:  # a full block first: no mask mod (torch's semantics), the sequence-end mask kept
                self.softmax_tile(ctx, acc_s, walk.full_block(0), scale_log2, True, False)
        else:
            self.softmax_tile(ctx, acc_s, walk.first(), scale_log2, True)
        p = self.new_p(ctx, acc_s)
        self.convert_p(p, acc_s)
        unmasked_from = cutlass.max(n_masked, 1)
        for j in cutlass.range(1, unmasked_from, unroll=1):
            k_state, v_state = self.overlapped_step(ctx, k_pipe, v_pipe, k_state, v_state, p,
                                                    walk.partial_block(j), wg, scale_log2, True)
        if cutlass.const_expr(ctx.window is not None):
            low = cutlass.max(low, unmasked_from)
        if cutlass.const_expr(walk.sparse):
            if cutlass.const_expr(walk.has_full):  # (without full lists, every visit is partial)
                k_state, v_state = self.full_blocks(ctx, k_pipe, v_pipe, k_state, v_state, p, unmasked_from, low,
                                                    wg, scale_log2)
        else:
            for j in cutlass.range(unmasked_from, low, unroll=1):
                k_state, v_state = self.overlapped_step(ctx, k_pipe, v_pipe, k_state, v_state, p,
                                                        walk.block(j), wg, scale_log2, False)
        if cutlass.const_expr(ctx.window is not None):  # the window's left edge
            for j in cutlass.range(low, n_blocks, unroll=1):
                k_state, v_state = self.overlapped_step(ctx, k_pipe, v_pipe, k_state, v_state, p,
                                                        walk.block(j), wg, scale_log2, True)
        # epilogue: the last P V
        self.issue_pv(ctx, p, v_pipe, v_state)
        warpgroup.wait_group(0)
        v_state = pipeline.release(v_pipe, v_state)
        return k_state, v_state

    @cute.jit
    def overlapped_step(self, ctx, k_pipe, v_pipe, k_state, v_state, p, n_block: Int32, wg: Int32,
                        scale_log2: Float32, masked: cutlass.Constexpr, partial: cutlass.Constexpr = True):
        self.wait_turn(wg)
        acc_s = self.issue_qk(ctx, k_pipe, k_state)
        self.issue_pv(ctx, p, v_pipe, v_state)
        self.pass_turn(wg)
        warpgroup.wait_group(1)  # S_j has landed; P V may still run
        correction = self.softmax_tile(ctx, acc_s, n_block, scale_log2, masked, partial)
        # Releasing K only now puts a basic-block boundary (the release is predicated on one lane
        # per warp) between the softmax and the wait below. ptxas still sinks most of the exp2
        # below the wait; forcing them above it measured slower (worklog/k5.md, "pinned softmax").
        k_state = pipeline.release(k_pipe, k_state)
        warpgroup.wait_group(0)  # P_{j-1} V_{j-1} is done: P's registers and V's stage are free
        v_state = pipeline.release(v_pipe, v_state)
        self.convert_p(p, acc_s)
        self.rescale_o(ctx, correction)
        return k_state, v_state
