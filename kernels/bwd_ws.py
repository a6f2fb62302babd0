"""The production backward: one warp-specialized kernel whose techniques are flags. The registry's
rows b2 to b9 are its configurations (fa3/registry.py; their tables: kernels/config.py); B1
(bwd.py) is the lesson it starts from, with B1's math and the pieces B1 shares (bwd_setup.py,
bwd_mma.py, bwd_pointwise.py, common/statistics.py, bwd_order.py, bwd_dkv_store.py), but it does
not build on B1's class.

Roles (block = 384 threads):
    warpgroup 0 gives its registers away (setmaxnreg.dec to 24 in all four warps):
        warp 0, the loader: K_j and V_j once, then Q_i and dO_i into the ring, one stage ahead of
            the consumers and never waiting on them except for a free stage;
        warp 1, the dQ writer: per Q tile, waits until the consumers have put this K/V tile's dQ_i
            share (FP32) in SMEM, in fragment order, adds it to global memory with a 1-D bulk
            reduce-add, and hands the buffer back once the bulk copy has read it
            (bwd_dq_handoff.py).
    warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240): the five GEMMs, as in B1, but
        S and dP are issued together and P = exp2(...) runs while dP is in flight; dQ, dV and dK
        are issued together and dQ is handed to the writer while dV and dK run. The thousands of
        scalar FP32 atomics of B1 per Q tile become bulk reductions the consumers do not wait for.
Deterministic: the writer waits for this Q tile's counter to reach this K/V tile's turn
(`dq_turn`, bwd_order.py) before its reduce-add, waits for the reduction to complete, then bumps
the counter (common/accum.py). Unordered (neither deterministic nor `ordered_dq`), each CTA starts
its walk over the Q tiles at a different tile (`walk_start`).

The flags (its BackwardConfig's; all off is b2, B1's GEMMs warp-specialized). Each selects pieces at
trace time, so each configuration's code is only its own:

    scores_transposed   S^T = K Q^T and dP^T = V dO^T: P^T and dS^T stay in registers as the A
                        operands of dV and dK, dS^T is written once (for dQ) into one of two
                        buffers, one consumer barrier per Q tile, the statistics per column
                        (bwd_transposed_scores.py). With it: `dv_under_dp` (dV issued under dP^T,
                        else after dS^T), `ds_from_rounded_p` (dS^T from the rounded P^T; with
                        `ds_in_pairs` in 16-bit pairs, bwd_pointwise.py).
    dq_transposed       dQ^T = K^T dS^T on the transposed scores (bwd_transposed_dq.py).
    dkv_transposed      dK^T += Q^T dS and dV^T += dO^T P, the head dim on the WGMMA's M, for the
                        wide head dims (bwd_transposed_dkv.py).
    dq_per_warpgroup    each warpgroup's dQ share handed to the writer on its own, through
                        `dq_buffers` buffers returned a tile late; with `dq_mbarriers` through
                        mbarriers, one share buffer the warpgroups take in turns
                        (`shared_dq_buffer`) or one each (bwd_dq_handoff.py).
    stats_in_smem       LSE * log2 e and D through SMEM with the Q/dO TMA (common/statistics.py);
                        with the transposed scores read where used, or ahead (`prefetch_stats`,
                        `stat_group`).
    head_groups, head_group_ctas   the causal (and ordered) launch order in head groups, capped
                        at about one wave of CTAs (bwd_order.py).
    rotated_walk        ordered walks without a mask start at their own Q tiles (bwd_order.py).
    ordered_dq, do_stages   as B1's (bwd_setup.py): dQ in the deterministic order for speed; dO
                        in a ring of its own with fewer stages.

Entry points: WarpSpecializedBackward (the rungs), FlexBackward (the same kernel with flex
attention's score and mask mods compiled in and the tensors they capture one more argument; the
mods' steps are bwd_pointwise.py's) and BlockSparseFlexBackward (and a BlockMask's transposed
lists another: per K/V tile only the listed Q blocks' tiles are visited), all launching
BackwardRoles, which holds the roles, the hooks and the consume steps. The three roles follow one
walk over the Q tiles (common/q_walk.py): the loader loads, the dQ writer adds and the consumers
compute visit i's Q tile, so that the Q ring and the dQ buffers stay in step.

The rungs, as kernels/config.py configures them:

    b2  no flag: S, dP, P and dS row-major (P and dS through SMEM), dQ handed off whole.
    b3  scores_transposed, dV under dP^T.
    b4  b3 with dq_per_warpgroup (two buffers), stats_in_smem, dV after dS^T, no head groups.
    b6  b3 with dq_transposed, dV after dS^T.
    b7  b6 with b4's hand-off and stats_in_smem (head groups kept).
    b8  b4 on 128 x 128 S^T tiles at d64: ds_from_rounded_p and ds_in_pairs (S^T's FP32
        registers die before dP^T lands), one dQ buffer a warpgroup (two do not fit beside
        128-row Q/dO stages), dV under dP^T, each column's LSE read where used.
    b9  dkv_transposed, one dO stage, dQ through mbarriers (d256: one share buffer in turns).

Constraints: head_dim 64/96/128/192/256 as the registry's rows serve them (their tiles:
kernels/config.py); tile_m a multiple of 64 (16 with dq_transposed: the Q tile is then no WGMMA's
M), tile_n of 64 (16 with dkv_transposed: the keys are N of dK^T/dV^T and of S, dP, 8 a
warpgroup); the transposed scores take 128-key tiles, two Q stages and dO on the Q ring (their
module docstring); the per-warpgroup
hand-off on named barriers takes the transposed scores' consume step (its buffers follow the Q
stage), the one through mbarriers the row-major one (it counts Q tiles). Packed batches: as B1,
each entry's dQ in whole-tile slots of the fragment-order accumulator. SMEM (bf16, b2): d=128 Q/dO
2 x 32 KB, K/V 64 KB, P/dS 32 KB, dQ 32 KB = 192 KB; d=256 one Q/dO stage (64 KB), K/V 64 KB,
P/dS 16 KB, dQ 64 KB = 208 KB.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .bwd_dkv_store import DkvEpilogue
from .bwd_dq_handoff import DqHandoff
from .bwd_mma import BackwardMmas
from .bwd_order import DqOrder
from .bwd_pointwise import PointwiseGradients
from .bwd_setup import BackwardSetup
from .bwd_transposed_dkv import TransposedDkv
from .bwd_transposed_dq import TransposedDq
from .bwd_transposed_scores import TransposedScores
from .common import mma, pipeline, q_walk, smem, tma
from .common.statistics import QueryStatistics
from .config import BLOCK_MASK_TILE, BackwardConfig

CONSUMER_BARRIER = 1  # the consumer warpgroups among themselves (0 is __syncthreads)


class BackwardRoles(BackwardSetup, QueryStatistics, DqOrder, DkvEpilogue, BackwardMmas, PointwiseGradients,
                    TransposedScores, TransposedDq, TransposedDkv, DqHandoff):
    """The kernel's roles and the hooks that pick among the pieces (mixins) by flag (the module
    docstring); its entry points, WarpSpecializedBackward and FlexBackward, add the launch
    signature."""
    # the host reads it: dQ accumulated in fragment order (bwd_dq_handoff.py), converted by
    # FragmentDqPostprocess (B1: row-major, by atomics)
    FRAGMENT_DQ = True
    # GQA dK/dV by bulk reduce-adds of SMEM rows (bwd_dkv_store.py), not scalar atomics
    dkv_bulk_add = True

    def __init__(self, dtype, head_dim: int, causal: bool, config: BackwardConfig,
                 deterministic: bool = False, local: bool = False, softcap: bool = False,
                 varlen: bool = False, head_dim_v: int | None = None, score_mod=None, mask_mod=None,
                 score_mod_grad=None):
        """config: kernels/config.backward_config's (tiles, stages and the flags above). `score_mod`,
        `mask_mod`: None or the forward's mod sources (fa3/mods.py), `score_mod_grad` the score
        mod's derivative (None where it is 1: a number, or a mod source); FlexBackward's."""
        if score_mod is not None and softcap:
            raise ValueError("a score mod and softcap are exclusive: write the cap as a score mod")
        if (score_mod is not None or mask_mod is not None) and varlen:
            raise ValueError("the mods take fixed-length batches (their b is a batch entry)")
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.score_mod_grad = None if score_mod_grad == 1 else score_mod_grad
        self.scores_transposed = config.scores_transposed
        self.dq_transposed = config.dq_transposed
        self.dkv_transposed = config.dkv_transposed
        # the dQ hand-off (bwd_dq_handoff.py): whole, or per warpgroup through `dq_buffers`
        # buffers (one where two do not fit), or per warpgroup through mbarriers, one share
        # buffer in turns (`shared_dq_buffer`) or, where SMEM allows, one each
        self.dq_per_warpgroup, self.dq_buffers = config.dq_per_warpgroup, config.dq_buffers
        self.dq_mbarriers, self.shared_dq_buffer = config.dq_mbarriers, config.shared_dq_buffer
        # dS^T = P^T (dP^T - D) from the bf16 P^T the dV GEMM reads, so S^T's FP32 accumulator
        # dies at the rounding, before dP^T lands (what makes b8's 128 x 128 tiles fit at d64);
        # `ds_in_pairs` (bwd_pointwise.py) multiplies in 16-bit pairs without widening P^T back
        self.ds_from_rounded_p, self.ds_in_pairs = config.ds_from_rounded_p, config.ds_in_pairs
        # dV issued from P^T's registers while dP^T is still in flight (its scores then wait for
        # the register operand), or after dS^T, when S^T's and dP^T's FP32 registers are free
        self.dv_under_dp = config.dv_under_dp
        # the statistics through SMEM (common/statistics.py); read into registers between issuing
        # S^T/dP^T and waiting for S^T (`prefetch_stats`: the exp2 then does not wait on SMEM),
        # or where used, `stat_group` columns together ahead of their exp2s (0: each column's just
        # before its own)
        self.stats_in_smem, self.prefetch_stats = config.stats_in_smem, config.prefetch_stats
        self.stat_group = config.stat_group
        # the causal launch order (bwd_order.py): head groups (the dQ hand-off per warpgroup on
        # named barriers runs faster without them at d64/d96), and a cap on a group's CTAs (the
        # transposed scores: about one wave of CTAs, 132 SMs, rather than 50 MB of L2)
        self.head_groups, self.head_group_ctas = config.head_groups, config.head_group_ctas
        # ordered walks without a mask ascend unless the configuration rotates them (`rotated_walk`:
        # b2 at d256): with the late counter bump on wide K/V tiles, ascending walks in head groups
        # ran faster than rotated ones at d64-d128 (worklog/backward.md)
        self.rotated_ordered_walk = config.rotated_walk
        super().__init__(dtype, head_dim, causal, config, deterministic, local, softcap, varlen, head_dim_v)
        assert not (self.split_do and self.smem_stats), "D rides with dO: statistics from registers"
        assert not (self.scores_transposed and self.dkv_transposed), "dK^T and dV^T read P and dS from SMEM"
        if self.scores_transposed:
            assert self.q_stages == 2, "the two dS^T buffers follow the Q stage index"
            assert not self.split_do, "dO rides on the Q ring (consume_step_t)"
            assert self.tile_n == 128, "each of the two consumer warpgroups owns 64 keys"
            assert self.ds_from_rounded_p or not self.ds_in_pairs, "dS^T in pairs needs P^T rounded first"
        else:
            assert not (self.dq_transposed or self.ds_from_rounded_p), "dQ^T and the rounded P^T need S^T"
        if self.dq_per_warpgroup and not self.dq_mbarriers:
            assert self.scores_transposed, "the dQ buffers follow the Q stage index (consume_step_t)"
        if self.dq_mbarriers:
            assert self.dq_per_warpgroup and not self.scores_transposed, \
                "the mbarrier turns count Q tiles (consume_step_rows)"
        self.consumer_threads = 128 * self.mma_warpgroups
        self.num_threads = 128 + self.consumer_threads

    # ---------------------------------------------------------------- settings of the flags
    @property
    def p_in_smem(self) -> bool:
        """P goes through SMEM for dV, except on the transposed scores (P^T stays in registers)."""
        return not self.scores_transposed

    @property
    def q_tile_multiple(self) -> int:
        """Q tiles are M of S and dQ (whole 64-row WGMMA atoms); dQ^T takes them as N."""
        return 16 if self.dq_transposed else 64

    @property
    def kv_tile_multiple(self) -> int:
        """K/V tiles are M of dK/dV; dK^T and dV^T take them as N (8 a warpgroup)."""
        return 16 if self.dkv_transposed else 64

    @property
    def block_split(self) -> int:
        """Q tiles a BlockMask block holds (its BLOCK_MASK_TILE rows over tile_m; the block-sparse
        walk, common/q_walk.py)."""
        return BLOCK_MASK_TILE[0] // self.tile_m

    @property
    def dq_turn_barriers(self) -> int:
        """The dQ hand-off's mbarriers (`dq_mbarriers`): full and empty a warpgroup."""
        return 2 * self.mma_warpgroups if self.dq_mbarriers else 0

    @property
    def defers_dq_bump(self) -> bool:
        """The late counter bump (bwd_order.py) holds a tile's buffer until the next tile's adds
        are issued: the per-warpgroup hand-off needs a second buffer to hand that tile off into."""
        if self.dq_per_warpgroup and not self.dq_mbarriers:
            return super().defers_dq_bump and self.dq_buffers >= 2
        return super().defers_dq_bump

    # ---------------------------------------------------------------- host side: the pieces' hooks
    def smem_layouts(self, head_dim: int | None = None, stages: int | None = None):
        """B1's layouts (bwd_setup.py); the transposed scores' dS^T buffers; the transposed
        dK/dV's own."""
        if self.dkv_transposed:
            return self.dkv_t_layouts(head_dim, stages)
        sQ_layout, sKV_layout, sPdS_layout = super().smem_layouts(head_dim, stages)
        if self.scores_transposed:
            sPdS_layout = self.scores_t_layout()
        return sQ_layout, sKV_layout, sPdS_layout

    def make_pipelines(self, storage, sQ_layout, sKV_layout, consumer_warps):
        pipes = super().make_pipelines(storage, sQ_layout, sKV_layout, consumer_warps)
        if self.dq_mbarriers:
            self.init_dq_turns(storage.dq_turns.data_ptr())  # made visible by pipeline.init_done
        if self.walk_slots:  # (likewise)
            q_walk.init_handoff(storage.dq_turns.data_ptr() + self.dq_turn_barriers, self.walk_slots,
                                self.consumer_threads)
        return pipes

    def smem_tensors(self, storage, sQ_layout, sKV_layout, sPdS_layout):
        s = super().smem_tensors(storage, sQ_layout, sKV_layout, sPdS_layout)
        if self.dq_mbarriers:
            s.dq_turns = storage.dq_turns.data_ptr()
        if self.walk_slots:
            s.walk_handoff = q_walk.make_handoff(storage.dq_turns.data_ptr() + self.dq_turn_barriers, self.walk_slots)
        return s

    # ---------------------------------------------------------------- the GEMMs' hooks (bwd_mma.py)
    def score_tile(self):
        if self.scores_transposed:
            return self.tile_n, self.tile_m  # S^T: (keys, queries)
        return super().score_tile()

    def tiled_mmas(self):
        """(S and dP, dV and dK, dQ) tiled MMAs, each in the form the flags pick."""
        if not self.scores_transposed:
            return super().tiled_mmas()
        sdp, dkv = self.scores_t_mma(), self.dkv_mma(self.head_dim)
        return sdp, dkv, self.dq_t_mma() if self.dq_transposed else self.dq_mma_from_ds_t()

    def dkv_mma(self, head_dim: int):
        if self.dkv_transposed:
            return self.dkv_t_mma(head_dim)
        if self.scores_transposed:
            return self.dkv_mma_a_in_regs(head_dim)
        return super().dkv_mma(head_dim)

    def dkv_tile(self, head_dim: int | None = None):
        return self.dkv_t_tile(head_dim) if self.dkv_transposed else super().dkv_tile(head_dim)

    def dkv_view(self, tile: cute.Tensor) -> cute.Tensor:
        return mma.transpose_view(tile) if self.dkv_transposed else tile

    def operand_fragments(self, s, wg_sdp, wg_dkv, wg_dq) -> dict:
        if self.scores_transposed:
            return self.scores_t_fragments(s, wg_sdp, wg_dkv, wg_dq)
        return super().operand_fragments(s, wg_sdp, wg_dkv, wg_dq)

    def dkv_operands(self, s, wg_dkv) -> dict:
        return self.dkv_t_operands(s, wg_dkv) if self.dkv_transposed else super().dkv_operands(s, wg_dkv)

    def dv_operands(self, s, wg_dv) -> dict:
        if self.dkv_transposed:
            return self.dv_t_operands(s, wg_dv)
        if self.scores_transposed:
            return self.dv_operands_p_in_regs(s, wg_dv)
        return super().dv_operands(s, wg_dv)

    def dq_fragments(self, s, wg_dq) -> dict:
        """dQ's operands on the transposed scores: dQ = dS K, or dQ^T = K^T dS^T."""
        return self.dq_t_fragments(s, wg_dq) if self.dq_transposed else self.dq_fragments_from_ds_t(s, wg_dq)

    def dq_view(self, tile: cute.Tensor) -> cute.Tensor:
        """A (tile_m, d) tensor seen in the shape of the dQ accumulator (dQ^T: transposed)."""
        return mma.transpose_view(tile) if self.dq_transposed else tile

    def issue_dkv(self, ctx, s, stage, do_stage=None):
        if self.dkv_transposed:
            return self.issue_dkv_t(ctx, s, stage, do_stage)
        return super().issue_dkv(ctx, s, stage, do_stage)

    def dkv_to_smem(self, ctx, frag: cute.Tensor, sX: cute.Tensor, tiled: cute.TiledMma):
        if self.dkv_transposed:
            return self.dkv_t_to_smem(ctx, frag, sX, tiled)
        return super().dkv_to_smem(ctx, frag, sX, tiled)

    def dq_gemm(self, ctx, stage):
        """Issue dQ_i (or dQ_i^T) from dS^T's SMEM buffer `stage` (transposed scores)."""
        return self.dq_t_gemm(ctx, stage) if self.dq_transposed else self.dq_gemm_from_ds_t(ctx, stage)

    # ---------------------------------------------------------------- the statistics' hooks
    def stat_count(self, ctx) -> int:
        return self.col_stat_count(ctx) if self.scores_transposed else super().stat_count(ctx)

    def stat_index(self, ctx, r: int):
        return self.col_stat_index(ctx, r) if self.scores_transposed else super().stat_index(ctx, r)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
               window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, extra: tuple, stream):
        """SMEM, TMA atoms and the launch; `extra` goes to `kernel` after mCuSeqlensK (the flex
        form's captured tensors)."""
        sQ_layout, sKV_layout, sPdS_layout = self.smem_layouts()
        loads = self.make_loads(mQ, mdO, mK, mV, sQ_layout, sKV_layout)
        storage_cls = self.shared_storage(sQ_layout, sKV_layout, sPdS_layout)
        self.kernel(*loads, mdQacc, *self.make_stat_loads(mLSE2, mD), mLSE2, mD, mdK, mdV, mLock,
                    scale_log2, softmax_scale, window_left, window_right, softcap_scale, mCuSeqlensQ,
                    mCuSeqlensK, *extra, sQ_layout, sKV_layout, sPdS_layout, self.sdq_layout(),
                    storage_cls).launch(
            grid=self.grid(mQ, mK, mCuSeqlensK),
            block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def roles(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
              tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
              mdQacc: cute.Tensor, tma_lse, mLSE2_tiles, tma_d, mD_tiles, mLSE2: cute.Tensor, mD: cute.Tensor,
              mdK: cute.Tensor, mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32,
              softmax_scale: Float32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
              mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, sQ_layout: cute.ComposedLayout,
              sKV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout, sdQ_layout,
              SharedStorage: cutlass.Constexpr, aux: tuple = (), block_lists=None):
        """The kernel's body (module docstring): the loader and dQ-writer warps, the consumers'
        walk; `aux`: the mods' captured tensors (FlexBackward); `block_lists`: a BlockMask's
        transposed lists, which every role walks instead of the Q tiles that see this K/V tile
        (BlockSparseFlexBackward, common/q_walk.py)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch, seq = self.kv_tile_work(mQ, mK, mCuSeqlensQ, mCuSeqlensK)
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_do, tma_k, tma_v)
            if cutlass.const_expr(self.smem_stats):
                tma.prefetch(tma_lse, tma_d)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        q_pipe, kv_pipe = self.make_pipelines(storage, sQ_layout, sKV_layout, self.consumer_threads // 32)
        do_pipe = self.make_do_pipeline(storage, sQ_layout, sKV_layout, self.consumer_threads // 32)
        pipeline.init_done()
        s = self.smem_tensors(storage, sQ_layout, sKV_layout, sPdS_layout)
        s.sdQ = smem.get_tensor(storage.sdQ, sdQ_layout)
        window = (window_left, window_right) if cutlass.const_expr(self.local) else None
        if cutlass.const_expr(block_lists is None):
            m_first, m_end = self.q_tile_range(n_block, seq.seqlen_q, seq.seqlen_k, window)
            start = self.walk_start(n_block, m_first, m_end, seq)
            walk = q_walk.DenseQWalk(start, m_first, m_end, not self.ordered_dq or self.rotates_unmasked)
        else:  # each role reads the same lists at this CTA's (batch, query head, K/V tile), after its
            # register split (a walk read before it was held across it: spilled at 24 registers)
            walk = None

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.config.producer_regs)
            if warp_idx == 0:
                q_copies, kv_copies = self.tma_copies(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV,
                                                      s, head, batch, seq, (tma_lse, mLSE2_tiles, tma_d, mD_tiles))
                self.load(q_pipe, kv_pipe, q_copies, kv_copies, n_block,
                          self.role_walk(walk, block_lists, batch, head, n_block, s), do_pipe)
            if warp_idx == 1:
                self.write_dq(mdQacc, s, mLock, n_block, head, batch,
                              self.role_walk(walk, block_lists, batch, head, n_block), seq, window, tidx % 32)
        else:
            cute.arch.setmaxregister_increase(self.config.consumer_regs)
            ctidx = tidx - 128
            ctx = self.consumer_setup(s, ctidx, seq, window, softcap_scale, mLSE2, mD, head, batch)
            if cutlass.const_expr(self.has_mods):  # what the mods read (apply_mods, mod_score_grads)
                ctx.aux, ctx.batch, ctx.head = aux, batch, head
            pipeline.consume_wait(kv_pipe, pipeline.consumer_state(1))
            visits = self.role_walk(walk, block_lists, batch, head, n_block, s)
            q_consumer = pipeline.consumer_state(self.q_stages)
            if cutlass.const_expr(visits.has_full and self.mask_mod is not None):
                # a block mask's partial blocks (the mask mod), then its full ones (none): two loops,
                # no branch in either
                for i in cutlass.range(visits.partial_tiles(), unroll=1):
                    q_consumer = self.consume_step(ctx, s, q_pipe, q_consumer, visits.consumer_tile(i), n_block,
                                                   scale_log2, do_pipe)
                for i in cutlass.range(visits.partial_tiles(), visits.count(), unroll=1):
                    q_consumer = self.consume_step(ctx, s, q_pipe, q_consumer, visits.consumer_tile(i), n_block,
                                                   scale_log2, do_pipe, partial=False)
            else:
                for i in cutlass.range(visits.count(), unroll=1):
                    q_consumer = self.consume_step(ctx, s, q_pipe, q_consumer, visits.consumer_tile(i), n_block,
                                                   scale_log2, do_pipe)
            self.store_dkv(ctx, s, mdK, mdV, n_block, head, batch, softmax_scale, mLSE2.shape[1])

    def role_walk(self, walk, block_lists, batch: Int32, head: Int32, n_block: Int32, s=None):
        """A role's walk: the dense one `roles` built, or (walk None) the block mask's, read here;
        the loader's and the consumers' with the SMEM hand-off through which the loader gives each
        visit's Q tile to the consumers (`s`: q_walk.py)."""
        if walk is not None:
            return walk
        return q_walk.block_mask_walk(block_lists, batch, head, n_block, self.block_split,
                                      None if s is None else s.walk_handoff)

    @cute.jit
    def sync_consumers(self):
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.consumer_threads)

    @cute.jit
    def walk_start(self, n_block: Int32, m_first: Int32, m_end: Int32, seq) -> Int32:
        """The first Q tile this CTA visits. Unordered without a mask: each K/V tile starts its
        walk at a different Q tile (rotated by n_block), so the CTAs of one head do not all reduce
        into the same dQ tile at once; under a mask each walk already starts at its own first Q
        tile (the diagonal's), and rotating it made two CTAs of a head walk the same tiles in step
        (slower, worklog/backward.md). Ordered without a mask: in order (the counters hand each
        tile from n to n + 1), or, where rotated (`rotated_walk`: b2 at d256) and the entry has no
        more K/V tiles than Q tiles, each walk `rotation_step` Q tiles after the last
        (`rotates_ordered`; `dq_turn` ranks the adds in the order the walks bring them)."""
        start = m_first
        if cutlass.const_expr(not self.ordered_dq and not (self.causal or self.local)):
            start = m_first + n_block % cutlass.max(m_end - m_first, 1)
        elif cutlass.const_expr(self.rotates_unmasked):
            if self.rotates_ordered(seq.seqlen_q, seq.seqlen_k):
                step = self.rotation_step(seq.seqlen_q, seq.seqlen_k)
                start = m_first + (n_block * step) % cutlass.max(m_end - m_first, 1)
        return start

    @cute.jit
    def load(self, q_pipe, kv_pipe, q_copies, kv_copies, n_block: Int32, walk, do_pipe=None):
        """Loader warp: K/V once, then Q_i and dO_i for every Q tile of the walk (common/q_walk.py),
        as stages free up (with `split_do`, dO_i into its own ring once the consumers have
        released dO_{i-1})."""
        pipeline.produce(kv_pipe, pipeline.producer_state(1), n_block, kv_copies)
        do_copies = []
        if cutlass.const_expr(self.split_do):  # (tma_copies' second entry is dO's)
            q_copies, do_copies = [q_copies[0]] + q_copies[2:], [q_copies[1]]
        q_state = pipeline.producer_state(self.q_stages)
        for i in cutlass.range(walk.count(), unroll=1):
            m_block = walk.m_block(i)
            if cutlass.const_expr(walk.sparse):  # the consumers take visit i's tile from SMEM
                walk.publish(q_state, m_block)
            q_state = pipeline.produce(q_pipe, q_state, m_block, q_copies)
            if cutlass.const_expr(self.split_do):
                pipeline.produce(do_pipe, pipeline.state_at(self.do_stages, i, producer=True), m_block, do_copies)
        pipeline.tail(q_pipe, q_state)
        if cutlass.const_expr(self.split_do):
            pipeline.tail(do_pipe, pipeline.state_at(self.do_stages, walk.count(), producer=True))

    def consume_step(self, ctx, s, q_pipe, q_state, m_block: Int32, n_block: Int32, scale_log2: Float32,
                     do_pipe=None, partial: bool = True):
        """One Q tile against this CTA's K/V tile: `consume_step_rows`, or on the transposed
        scores `consume_step_t` (bwd_transposed_scores.py). `partial`: the mask mod runs (every
        tile but a block mask's full blocks)."""
        step = self.consume_step_t if self.scores_transposed else self.consume_step_rows
        if partial:
            return step(ctx, s, q_pipe, q_state, m_block, n_block, scale_log2, do_pipe)
        return step(ctx, s, q_pipe, q_state, m_block, n_block, scale_log2, do_pipe, partial=False)

    @cute.jit
    def consume_step_rows(self, ctx, s, q_pipe, q_state, m_block: Int32, n_block: Int32, scale_log2: Float32,
                          do_pipe=None, partial: cutlass.Constexpr = True):
        """One Q tile: S and dP in flight together, P under dP; dQ handed off under dV and dK.
        `split_do`: dO_i waited for between S and dP, released once dV is done."""
        consumers = self.consumer_threads
        lse2, dsum = self.step_stats(ctx, q_pipe, q_state, m_block)
        m_block = q_walk.landed(m_block, q_state)  # (a block-sparse walk's tile, published by the loader)
        stage, do_state = q_state.index, None
        if cutlass.const_expr(self.split_do):
            do_state = pipeline.state_at(self.do_stages, q_state.count)
        acc_s, acc_dp = self.scores_and_dp(ctx, stage, 1, do_pipe, do_state)  # S has landed, dP may still run
        self.probabilities(ctx, acc_s, lse2, m_block, n_block, ctx.seq.seqlen_q, ctx.seq.seqlen_k, scale_log2,
                           partial)
        if cutlass.const_expr(self.pairs_make_ds()):
            p = mma.to_dtype_pairs(acc_s, self.dtype)  # S's FP32 registers die here, before dP lands
            warpgroup.wait_group(0)
            ds = self.paired_score_grads(ctx, p, acc_dp, dsum)
        else:
            p = mma.to_dtype(acc_s, self.dtype)
            warpgroup.wait_group(0)
            self.score_grads(acc_s, acc_dp, dsum, lse2, scale_log2)
            if cutlass.const_expr(self.score_mod_grad is not None):
                self.mod_score_grads(ctx, acc_s, acc_dp, lse2, m_block, n_block, False)
            ds = mma.to_dtype(acc_dp, self.dtype)
        # every GEMM of the previous Q tile (both warpgroups) is done with sP and sdS
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=consumers)
        mma.store_to_smem(p, ctx.sdp, ctx.tidx, s.sP[None, None, 0], self.score_matrices())
        mma.store_to_smem(ds, ctx.sdp, ctx.tidx, s.sdS[None, None, 0], self.score_matrices())
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=consumers)
        acc_dq = self.issue_dq(ctx, -1)
        self.issue_dkv(ctx, s, stage, do_state.index if cutlass.const_expr(self.split_do) else stage)
        if cutlass.const_expr(self.split_do):
            warpgroup.wait_group(1)  # dQ and dV are done (dK still runs): dO_i is free
            pipeline.release(do_pipe, do_state)
        else:
            warpgroup.wait_group(2)  # dQ is done; dV and dK still run
        self.hand_off_dq(ctx, s, acc_dq, step=q_state.count)
        warpgroup.wait_group(0)
        return pipeline.release(q_pipe, q_state)

    @cute.jit
    def step_stats(self, ctx, q_pipe, q_state, m_block: Int32):
        """This thread's (LSE * log2 e, D) of Q tile m_block, loaded from global memory before
        waiting for the tile's stage (their latency hides under the wait and the first GEMM); with
        `smem_stats`, the stage's SMEM statistics (`col_stat` reads each where it is used)."""
        if cutlass.const_expr(self.smem_stats):
            pipeline.consume_wait(q_pipe, q_state)
            return ctx.sLSE[None, 0, q_state.index], ctx.sD[None, 0, q_state.index]
        lse2, dsum = self.stats(ctx, m_block)
        pipeline.consume_wait(q_pipe, q_state)
        return lse2, dsum


class WarpSpecializedBackward(BackwardRoles):
    """Rungs b2-b9 (BackwardRoles' constructor: the configuration, the variants)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, stream):
        """Arguments as B1's."""
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mLock, scale_log2, softmax_scale, window_left,
                    window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK, (), stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               mdQacc: cute.Tensor, tma_lse: Optional[cute.CopyAtom],
               mLSE2_tiles: Optional[cute.Tensor], tma_d: Optional[cute.CopyAtom],
               mD_tiles: Optional[cute.Tensor], mLSE2: cute.Tensor, mD: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout, sdQ_layout,
               SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, mdQacc, tma_lse, mLSE2_tiles, tma_d, mD_tiles,
                   mLSE2, mD, mdK, mdV, mLock, scale_log2, softmax_scale, window_left, window_right,
                   softcap_scale, mCuSeqlensQ, mCuSeqlensK, sQ_layout, sKV_layout, sPdS_layout, sdQ_layout,
                   SharedStorage)


class FlexBackward(BackwardRoles):
    """The backward of flex attention's mods (BackwardRoles' constructor with `score_mod`,
    `mask_mod`, `score_mod_grad`): the mods recompute S as the forward saw it and dS takes the
    score mod's derivative (bwd_pointwise.py); one more argument, `aux`, the tensors the mods
    captured (one tuple, in fa3/mods.py's order, before the stream). A score mod sees
    softmax_scale * S: the host passes softmax_scale in softcap_scale's place and log2 e as
    scale_log2, as to the forward. Kept apart from WarpSpecializedBackward so that its launch
    signature (and every configuration without mods) is unchanged."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, aux: tuple, stream):
        """WarpSpecializedBackward's arguments, and `aux`."""
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mLock, scale_log2, softmax_scale, window_left,
                    window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK, (aux,), stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               mdQacc: cute.Tensor, tma_lse: Optional[cute.CopyAtom],
               mLSE2_tiles: Optional[cute.Tensor], tma_d: Optional[cute.CopyAtom],
               mD_tiles: Optional[cute.Tensor], mLSE2: cute.Tensor, mD: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, aux: tuple, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout, sdQ_layout,
               SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, mdQacc, tma_lse, mLSE2_tiles, tma_d, mD_tiles,
                   mLSE2, mD, mdK, mdV, mLock, scale_log2, softmax_scale, window_left, window_right,
                   softcap_scale, mCuSeqlensQ, mCuSeqlensK, sQ_layout, sKV_layout, sPdS_layout, sdQ_layout,
                   SharedStorage, aux=aux)


class BlockSparseFlexBackward(BackwardRoles):
    """FlexBackward with flex attention's block sparsity (constructor: BackwardRoles', with the
    mods): one more argument, `block_lists`, a BlockMask's transposed lists (q_num_blocks,
    q_indices[, full_q_num_blocks, full_q_indices]), int32, (batch or 1, heads_q or 1,
    kv_blocks[, q_blocks]), after `aux`. Per K/V tile the loader loads, the consumers compute and the
    dQ writer adds only the Q tiles of the listed blocks (common/q_walk.py, one walk for the three):
    the partial blocks with the mask mod, then the full blocks without it (the score mod runs on
    both, the sequence ends are masked on both). A K/V tile with no block stores dK = dV = 0.

    The blocks are BLOCK_MASK_TILE (torch's default BLOCK_SIZE, the forward's tiles): a K/V block is
    the K/V tile (tile_n = 128), a Q block `block_split` whole Q tiles (b4 and b7: two of 64 rows).
    Non-causal, no window, not varlen (the mask says what is visible). dQ is added unordered: the
    deterministic order ranks each Q tile's adds by K/V tile (bwd_order.dq_turn), a turn a sparse
    walk may never take, so an ordered kernel (deterministic, or `ordered_dq`) is refused."""

    def __init__(self, *args, **kwargs):
        BackwardRoles.__init__(self, *args, **kwargs)
        if self.causal or self.local or self.varlen:
            raise ValueError("the block-sparse backward takes no causal, window or varlen variant: the block mask "
                             "says what is visible")
        if self.ordered_dq:
            raise ValueError("the block-sparse backward adds dQ unordered: the deterministic order waits for every "
                             "K/V tile of a Q tile in turn, and a block mask's walk skips some (deterministic=True "
                             "is not supported with a block mask)")
        if not self.smem_stats:
            raise ValueError("the block-sparse backward takes the statistics through SMEM (stats_in_smem): its "
                             "consumers read a visit's Q tile once the tile's stage has landed")
        self.walk_slots = self.q_stages  # (q_walk.py: the hand-off of the tiles steps with the Q ring)
        if self.tile_n != BLOCK_MASK_TILE[1] or BLOCK_MASK_TILE[0] % self.tile_m:
            raise ValueError(f"the block-sparse backward walks {BLOCK_MASK_TILE[0]} x {BLOCK_MASK_TILE[1]} blocks: "
                             f"its K/V tiles must be {BLOCK_MASK_TILE[1]} keys and its Q tiles divide "
                             f"{BLOCK_MASK_TILE[0]} rows, not {self.tile_m} x {self.tile_n}")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
                 window_left: Int32, window_right: Int32, softcap_scale: Float32,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, aux: tuple, block_lists: tuple, stream):
        """FlexBackward's arguments, and `block_lists`."""
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mLock, scale_log2, softmax_scale, window_left,
                    window_right, softcap_scale, mCuSeqlensQ, mCuSeqlensK, (aux, block_lists), stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               mdQacc: cute.Tensor, tma_lse: Optional[cute.CopyAtom],
               mLSE2_tiles: Optional[cute.Tensor], tma_d: Optional[cute.CopyAtom],
               mD_tiles: Optional[cute.Tensor], mLSE2: cute.Tensor, mD: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLock: cute.Tensor, scale_log2: Float32,
               softmax_scale: Float32, window_left: Int32, window_right: Int32, softcap_scale: Float32,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, aux: tuple, block_lists: tuple,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               sdQ_layout, SharedStorage: cutlass.Constexpr):
        self.roles(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, mdQacc, tma_lse, mLSE2_tiles, tma_d, mD_tiles,
                   mLSE2, mD, mdK, mdV, mLock, scale_log2, softmax_scale, window_left, window_right,
                   softcap_scale, mCuSeqlensQ, mCuSeqlensK, sQ_layout, sKV_layout, sPdS_layout, sdQ_layout,
                   SharedStorage, aux=aux, block_lists=block_lists)
