"""The warp-specialized forward: the roles, pipelines and epilogue of FlashAttention-3's forward
kernel, which K5 (kernels/k5.py), the FP8 forward (kernels/k5_fp8.py, k5_fp8_vt.py) and K5 over a
KV cache (kernels/k5_cache.py) compose; each adds its launch signature and the hooks below.

Roles (block = 128 * (1 + consumer warpgroups) threads):
    warpgroup 0, the producer: gives registers away (setmaxnreg.dec in all four warps); its warp 0
        issues every TMA copy: Q once, then K_j and V_j on *separate* pipelines, so that a K stage
        can be released as soon as S = Q K^T has read it, before P V has read V.
    warpgroups 1..n, the consumers (two, or three on 192-row tiles): take the registers
        (setmaxnreg.inc), each owns 64 rows of the Q tile, runs both GEMMs and the softmax (the
        rung's mainloop: kernels/k5_mainloop.py), then stores O through SMEM with a TMA store.
        K/V tiles are visited from the last to the first, so the only tiles that need a mask (the
        causal diagonal, the ragged end) come first; with a block mask's lists (flex attention),
        only the listed tiles. Producer and consumers take the order from one walk
        (common/kv_walk.py).
Tiles come from a persistent schedule (common/scheduler.py: static, or handed out from a GMEM
counter); the consumer warpgroups may take turns issuing GEMMs (common/pingpong.py).

What a rung changes are hooks, each with the 16-bit forward's behaviour here: make_stage_loads,
v_rows / v_tiles (where V's tiles come from), value_rings / value_smem_elems / producer_states /
producer_helpers / after_loads (the V ring and what the producer warpgroup's other warps do: FP8's
V^T transpose), kv_source / produce_kv (a KV cache's pages), before_mainloop, tile_scales (FP8's
descales). The mixin expects the mainloop (mainloop, mainloop_overlapped) beside it.

The static configuration (tiles, stages, flags, the register split) is a ForwardConfig, chosen
per head dim and variant by kernels/config.py (forward_config, fp8_forward_config,
cache_prefill_config); the constructor takes it as it is.

Constraints: head_dim 64/96/128/192/256; tile_m 128 or 192 (one consumer warpgroup per 64 rows); the
register split within 64K registers per SM (128 x (producer + consumer warpgroups x consumer)).
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass import pipeline as dsl_pipeline

from ..config import ForwardConfig
from . import epilogue, kv_walk, mma, pipeline, scheduler, seqlen, smem, softmax, tma
from .attention_tiles import StagedQkvLoads, WgmmaTileState
from .pingpong import PingPong
from .scheduler import AttentionTileSchedule

EPILOGUE_BARRIER = 1  # named barrier among the consumer warpgroups (0 is __syncthreads)
TURN_BARRIER = 2  # named barriers 2, 3 (, 4): the ping-pong turns, one per consumer warpgroup
EPI_STAGES = 2  # SMEM buffers the O store cycles through


class WarpSpecializedForward(AttentionTileSchedule, PingPong, WgmmaTileState, StagedQkvLoads):
    kv_pipelines = 2  # separate K and V barriers
    turn_barrier = TURN_BARRIER  # PingPong's first barrier

    def __init__(self, dtype, head_dim: int, causal: bool, config: ForwardConfig, varlen: bool = False,
                 local: bool = False, softcap: bool = False, sinks: bool = False,
                 head_dim_v: int | None = None, score_mod=None, mask_mod=None):
        """`config`: kernels/config.py's choice for this head dim and variant. `score_mod`,
        `mask_mod`: None, or a mod source (`bind(aux) -> function`, fa3/flex.py) inlined into the
        softmax step (common/mask.apply_mods); a score mod and the softcap are exclusive."""
        if score_mod is not None and softcap:
            raise ValueError("a score mod and softcap are exclusive: write the cap as a score mod")
        self.config = config
        self.dtype, self.head_dim, self.causal = dtype, head_dim, causal
        self.tile_m, self.tile_n, self.kv_stages = config.tile_m, config.tile_n, config.kv_stages
        # V's (and O's) head dim, where it differs from Q's and K's (DeepSeek's (192, 128)): only
        # V's ring, P V and the epilogue see it
        self.head_dim_v = head_dim_v or head_dim
        # variants (static, each compiled on demand): packed variable-length batches, a sliding
        # window (mask.py), tanh-capped scores, attention sinks in the denominator (softmax.py)
        self.varlen, self.local, self.softcap, self.sinks = varlen, local, softcap, sinks
        # flex attention's mods, each compiled in (their captured tensors: the kernel's `aux` tuple)
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.consumer_wgs = config.consumer_warpgroups
        self.num_threads = 128 * (1 + self.consumer_wgs)
        self.producer_regs, self.consumer_regs = config.producer_regs, config.consumer_regs
        self.pingpong = config.pingpong and self.consumer_wgs >= 2
        self.intra_wg_overlap = config.intra_wg_overlap
        self.rescale_vote = config.rescale_vote  # skip O's rescale when no row's max moved (k5_mainloop)
        self.q_stages = config.q_stages
        # causal tiles differ in length: hand them out from a GMEM counter (non-causal: static)
        self.dynamic = config.dynamic_schedule and causal

    # ---------------------------------------------------------------- host side
    def make_stage_loads(self, mQ, mK, mV):
        """SMEM layouts of Q, K and V and their TMA atoms: K3's, V's ring on V's head dim."""
        sQ_layout, sKV_layout, loads = self.make_loads(mQ, mK, mV)
        return sQ_layout, sKV_layout, self.v_layout(), loads

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, scale_log2: Float32, sm_count: Int32, mTileCounter: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, window_left: Int32,
               window_right: Int32, softcap_scale: Float32, extra: tuple, stream):
        """SMEM, TMA atoms and the persistent launch; `extra` (tensors) go to `kernel` after
        softcap_scale (K5's: the sinks or None; each rung's kernel takes its own)."""
        batch, seqlen_q, heads_q, _ = mQ.shape
        sQ_layout, sKV_layout, sV_layout, loads = self.make_stage_loads(mQ, mK, mV)
        epi_tile = epilogue.subtile(self.tile_m, self.consumer_wgs)
        sO_layout = epilogue.smem_layout(mO.element_type, epi_tile, EPI_STAGES)
        tma_o, tO = tma.make_store(tma.seq_major(mO), sO_layout, epi_tile)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[Int64, 2 * self.q_stages]
            kv_barriers: cute.struct.MemRange[Int64, 2 * self.kv_pipelines * self.kv_stages]
            tile_barriers: cute.struct.MemRange[Int64, scheduler.TILE_HANDOFF_BARRIERS]  # K5.5
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, self.value_smem_elems(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[mO.element_type, cute.cosize(sO_layout)], 1024]
            next_tile: cute.struct.MemRange[Int32, 1]
            q_blocks: cute.struct.MemRange[Int32, 1]  # varlen: the packed batch's Q tiles
            value_done: cute.struct.MemRange[Int32, 1]  # F2: the producer warp's last V stage is in

        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"K5 with kv_stages={self.kv_stages}, tile_n={self.tile_n}, d={self.head_dim}")
        tiles = cute.ceil_div(seqlen_q, self.tile_m) * heads_q * batch
        self.kernel(*loads, tma_o, tO, mO, mLSE, scale_log2, mTileCounter, mCuSeqlensQ, mCuSeqlensK,
                    window_left, window_right, softcap_scale, *extra, sQ_layout, sKV_layout, sV_layout,
                    sO_layout, epi_tile, SharedStorage).launch(
            grid=[scheduler.persistent_grid(tiles, sm_count), 1, 1], block=[self.num_threads, 1, 1],
            stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.jit
    def roles(self, tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mO_rows, mLSE, scale_log2: Float32,
              mTileCounter, mCuSeqlensQ, mCuSeqlensK, window_left: Int32, window_right: Int32,
              softcap_scale: Float32, sinks, descales, sQ_layout, sKV_layout, sV_layout, sO_layout,
              epi_tile: cutlass.Constexpr, SharedStorage: cutlass.Constexpr, cache=None, aux=(),
              block_lists=None):
        """The body of a rung's kernel: barriers, SMEM, then the producer and consumer roles. `sinks`: None,
        or the (heads_q,) FP32 sink logits (the sinks variant); `descales`: None, or FP8's (q, k, v)
        descale tensors (batch, heads_kv); `cache`: None, or where a KV cache's keys are
        (kernels/k5_cache.py); `aux`: the tensors the score and mask mods captured; `block_lists`:
        None, or a BlockMask's lists, which both roles walk instead of every K/V tile
        (common/kv_walk.py)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_k, tma_v, tma_o)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        consumer_warps = 4 * self.consumer_wgs
        barriers = storage.kv_barriers.data_ptr()
        q_pipe = pipeline.create(storage.q_barriers.data_ptr(), self.q_stages, consumer_warps,
                                 smem.stage_bytes(self.dtype, sQ_layout))
        k_pipe = pipeline.create(barriers, self.kv_stages, consumer_warps,
                                 smem.stage_bytes(self.dtype, sKV_layout))
        (v_pipe, sV), (pv_pipe, sPV), value_transpose = self.value_rings(
            storage, barriers + 2 * self.kv_stages, sV_layout, consumer_warps)
        # K5.5: the next tile's index, producer warp -> every consumer thread (common/scheduler.py)
        handoff = None
        if cutlass.const_expr(self.dynamic):
            handoff = scheduler.tile_handoff(storage.tile_barriers.data_ptr(), 128 * self.consumer_wgs)
        # Varlen: every entry's rows are clamped into the packed tensors' rows (rows_q/rows_k), so
        # offsets that no host check saw (a replayed CUDA graph) never store O or LSE outside them.
        varlen = cutlass.const_expr(self.varlen)
        rows_q, rows_k = (mO_rows.shape[1], mK.shape[0]) if varlen else (None, None)
        q_blocks = storage.q_blocks.get_tensor(cute.make_layout(1))
        if cutlass.const_expr(varlen):
            # warp 0 counts the packed batch's Q tiles for everyone (SMEM, before the sync below):
            # counted by the consumers themselves, their loop over the entries made ptxas
            # serialize the d192 kernel's WGMMAs (C7520)
            if warp_idx == 0:
                count = scheduler.varlen_blocks(mCuSeqlensQ, self.tile_m, rows_q, self.query_lengths)
                if tidx == 0:
                    q_blocks[0] = count
        pipeline.init_done()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        next_tile = storage.next_tile.get_tensor(cute.make_layout(1))
        # what varies per call beyond the tensors: sequence offsets, window edges, the softcap
        params = SimpleNamespace(
            cu_q=mCuSeqlensQ, cu_k=mCuSeqlensK, o_rows=mO_rows, softcap_scale=softcap_scale,
            rows_q=rows_q, rows_k=rows_k, sinks=sinks, descales=descales, cache=cache,
            group=mQ.shape[2] // mK.shape[2],
            window=(window_left, window_right) if cutlass.const_expr(self.local) else None,
            q_blocks=q_blocks[0] if varlen else None, value_transpose=value_transpose, aux=aux,
            block_lists=block_lists)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(q_pipe, k_pipe, v_pipe, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
                          mTileCounter, next_tile, handoff, params)
            else:
                self.producer_helpers(warp_idx, params)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(q_pipe, k_pipe, pv_pipe, sQ, sK, sPV, sO, tma_o, mO, mLSE, mK.shape[0],
                         scale_log2, tidx - 128, warp_idx // 4, epi_tile, next_tile, handoff, params)

    def value_smem_elems(self, sV_layout) -> int:
        """SMEM elements of V's rings: the one TMA fills (F2 adds the V^T ring after it)."""
        return cute.cosize(sV_layout)

    def value_rings(self, storage, barriers, sV_layout, consumer_warps: int):
        """((pipeline, SMEM) V is loaded into, (pipeline, SMEM) P V reads, what the producer's
        hooks need): one TMA ring here (F2: V rows loaded, V^T transposed from them by the
        producer for the FP8 P V). Before pipeline.init_done(): the rings' barriers."""
        v_pipe = pipeline.create(barriers, self.kv_stages, consumer_warps, smem.stage_bytes(self.dtype, sV_layout))
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        return (v_pipe, sV), (v_pipe, sV), None

    def producer_helpers(self, warp_idx: Int32, params):
        """The producer warpgroup's warps 1-3 (idle in K5; F2's transpose V)."""

    def after_loads(self, v_pipe, v_state, params):
        """Hook after the producer warp's last copy has landed and been read (F2 ends its
        transposing warps there)."""

    def producer_states(self):
        """The producer warp's ring states (Q, K, V), carried across tiles (F2: V's ring has its
        own depth)."""
        return (pipeline.producer_state(self.q_stages), pipeline.producer_state(self.kv_stages),
                pipeline.producer_state(self.kv_stages))

    @cute.jit
    def load(self, q_pipe, k_pipe, v_pipe, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
             mTileCounter, next_tile, handoff, params):
        """Producer warp: per tile, Q once, then K_j and V_j in the tile's walk (the last tile to
        the first, or a block mask's listed tiles: common/kv_walk.py). The states run on across
        tiles, so the next tile's loads start as soon as stages free up."""
        states = self.producer_states()
        first, tiles, step = self.tile_range(mQ, params)
        loads = (q_pipe, k_pipe, v_pipe, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, params)
        if cutlass.const_expr(self.dynamic):
            # one hand-off after each tile: before the one after tile t, t hand-offs were done
            tile = first
            while tile < tiles:
                states = self.load_tile(tile, states, *loads)
                tile = scheduler.publish_next_tile(mTileCounter, next_tile, step, tiles, handoff,
                                                   self.tiles_done_parity(states[0], True) ^ 1)
            scheduler.handoff_tail(handoff, self.tiles_done_parity(states[0], True))
        else:
            for tile in cutlass.range(first, tiles, step, unroll=1):
                states = self.load_tile(tile, states, *loads)
        for pipe, state in zip((q_pipe, k_pipe, v_pipe), states):
            pipeline.tail(pipe, state)
        self.after_loads(v_pipe, states[2], params)

    def v_rows(self, mV: cute.Tensor, head_kv: Int32, batch: Int32, seq) -> cute.Tensor:
        """The entry's V for one KV head: its rows, (seqlen_k, d_v), as K's."""
        return seqlen.rows(mV, head_kv, batch, seq.offset_k, self.varlen)

    def v_tiles(self, gV: cute.Tensor) -> cute.Tensor:
        """One head's V rows, (seqlen_k, d_v), as (tile_n, d_v) tiles indexed by the last mode."""
        return cute.local_tile(gV, (self.tile_n, self.head_dim_v), (None, 0))

    def tiles_done_parity(self, q_state, producer: bool):
        """The number of tiles this role has finished, mod 2, read off its Q ring state (one Q
        stage per tile): its count, or with one Q stage its phase, which flips once a tile
        (producer states start at phase 1, consumer states at 0). The tile hand-off's pipeline
        state follows from it (common/scheduler.py), with no state of its own in the tile loop."""
        if cutlass.const_expr(self.q_stages == 1):
            return q_state.phase ^ 1 if producer else q_state.phase
        return q_state.count & 1

    @cute.jit
    def load_tile(self, tile: Int32, states, q_pipe, k_pipe, v_pipe, tma_q, mQ, tma_k, mK, tma_v, mV,
                  sQ, sK, sV, params):
        q_state, k_state, v_state = states
        tile_q = (self.tile_m, self.head_dim)
        m_block, head, batch, seq = self.tile_work(tile, mQ, mK.shape[0], params)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        gQ = seqlen.rows(mQ, head, batch, seq.offset_q, self.varlen)
        tQsQ, tQgQ = tma.partition(tma_q, cute.local_tile(gQ, tile_q, (None, 0)), sQ)
        kv = self.kv_source(tma_k, mK, tma_v, mV, sK, sV, head_kv, batch, seq, params)
        n_max, n_blocks = self.kv_range(m_block, seq, params)
        walk = kv_walk.tile_walk(params.block_lists, n_max, n_blocks, batch, head, m_block, seq.seqlen_k,
                                 self.tile_n)
        n_blocks = walk.count
        if n_blocks == 0:  # no key is visible: the consumers still take (and release) the Q tile
            q_state = pipeline.produce(q_pipe, q_state, m_block, [(tma_q, tQgQ, tQsQ)])
        for j in cutlass.range(n_blocks, unroll=1):
            k_state, v_state = self.produce_kv(kv, k_pipe, k_state, v_pipe, v_state, walk.block(j))
            if j == 0:
                # Q after the first K/V: with one Q buffer, waiting for the previous tile to
                # free it must not hold back the next tile's first K/V loads.
                q_state = pipeline.produce(q_pipe, q_state, m_block, [(tma_q, tQgQ, tQsQ)])
        return q_state, k_state, v_state

    def kv_source(self, tma_k, mK, tma_v, mV, sK, sV, head_kv: Int32, batch: Int32, seq, params):
        """What produce_kv copies K/V tiles from: the entry's rows of one KV head, tiled, as TMA
        partitions ((atom, tXgX, tXsX) for K and for V)."""
        tile_kv = (self.tile_n, self.head_dim)
        gK = seqlen.rows(mK, head_kv, batch, seq.offset_k, self.varlen)
        tKsK, tKgK = tma.partition(tma_k, cute.local_tile(gK, tile_kv, (None, 0)), sK)
        tVsV, tVgV = tma.partition(tma_v, self.v_tiles(self.v_rows(mV, head_kv, batch, seq)), sV)
        return (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)

    def produce_kv(self, kv, k_pipe, k_state, v_pipe, v_state, n_block: Int32):
        """K and V tile n_block into the next stage of each ring (kv_source's partitions)."""
        k_state = pipeline.produce(k_pipe, k_state, n_block, [kv[0]])
        v_state = pipeline.produce(v_pipe, v_state, n_block, [kv[1]])
        return k_state, v_state

    @cute.jit
    def consume(self, q_pipe, k_pipe, v_pipe, sQ, sK, sV, sO, tma_o, mO, mLSE, seqlen_k: Int32,
                scale_log2: Float32, ctidx: Int32, wg: Int32, epi_tile: cutlass.Constexpr, next_tile,
                handoff, params):
        """Consumer warpgroups: per tile, the mainloop, then O through SMEM and a TMA store."""
        states = (pipeline.consumer_state(self.q_stages), pipeline.consumer_state(self.kv_stages),
                  pipeline.consumer_state(self.kv_stages))
        store_pipe = epilogue.store_pipeline(EPI_STAGES, 128 * self.consumer_wgs)
        first, tiles, step = self.tile_range(mO, params)
        args = (q_pipe, k_pipe, v_pipe, sQ, sK, sV, sO, tma_o, mO, mLSE, seqlen_k, scale_log2, ctidx,
                wg, store_pipe, epi_tile, params)
        self.mma_init(wg)
        if cutlass.const_expr(self.dynamic):
            # every consumer thread takes every index the producer publishes, the sentinel included
            tile = first
            while tile < tiles:
                states = self.consume_tile(tile, states, *args)
                tile = scheduler.take_next_tile(next_tile, handoff,
                                                self.tiles_done_parity(states[0], False) ^ 1)
        else:
            for tile in cutlass.range(first, tiles, step, unroll=1):
                states = self.consume_tile(tile, states, *args)
        if ctidx < 32:
            store_pipe.producer_tail()

    @cute.jit
    def consume_tile(self, tile: Int32, states, q_pipe, k_pipe, v_pipe, sQ, sK, sV, sO, tma_o, mO, mLSE,
                     seqlen_k: Int32, scale_log2: Float32, ctidx: Int32, wg: Int32, store_pipe,
                     epi_tile: cutlass.Constexpr, params):
        q_state, k_state, v_state = states
        m_block, head, batch, seq = self.tile_work(tile, mO, seqlen_k, params)
        n_max, n_blocks = self.kv_range(m_block, seq, params)
        # the producer's walk, read from the same lists (common/kv_walk.py)
        walk = kv_walk.tile_walk(params.block_lists, n_max, n_blocks, batch, head, m_block, seq.seqlen_k,
                                 self.tile_n)
        n_blocks = walk.count
        ctx = self.compute_setup(sQ[None, None, q_state.index], sK, sV, None, ctidx, m_block,
                                 seq.seqlen_q, seq.seqlen_k)
        ctx.window, ctx.softcap_scale, ctx.n_max, ctx.walk = params.window, params.softcap_scale, n_max, walk
        ctx.batch, ctx.head, ctx.aux = batch, head, params.aux  # what the mods see (the query head)
        if cutlass.const_expr(self.sinks):  # read now, used by the epilogue: its latency is hidden
            ctx.sink_log2 = params.sinks[head] * Float32(softmax.LOG2E)
        scale_log2 = self.tile_scales(ctx, scale_log2, batch, head, params)
        pipeline.consume_wait(q_pipe, q_state)
        self.before_mainloop(v_pipe, v_state, sV, ctidx, seq, n_max, n_blocks)
        if n_blocks > 0:
            if cutlass.const_expr(self.intra_wg_overlap):
                k_state, v_state = self.mainloop_overlapped(ctx, k_pipe, v_pipe, k_state, v_state,
                                                            n_blocks, wg, scale_log2)
            else:
                k_state, v_state = self.mainloop(ctx, k_pipe, v_pipe, k_state, v_state,
                                                 n_blocks, wg, scale_log2)
        q_state = pipeline.release(q_pipe, q_state)  # every Q K^T of this tile has retired
        if cutlass.const_expr(self.varlen):
            # TMA clips at the tensor's edge, not the sequence's: a tile that runs past its
            # sequence's end would overwrite the next one's rows, so only that tile (the
            # sequence's last, when its length is not a multiple of tile_m) stores from registers
            if (m_block + 1) * self.tile_m <= seq.seqlen_q:
                self.store_o(ctx, tma_o, mO, sO, mLSE, 0, head, scale_log2, store_pipe, ctidx,
                             epi_tile, seq.offset_q)  # the packed plane (batch 0) from the offset
            else:
                self.store_o_registers(ctx, params.o_rows, mLSE, 0, head, scale_log2, seq.offset_q)
        else:
            self.store_o(ctx, tma_o, mO, sO, mLSE, batch, head, scale_log2, store_pipe, ctidx, epi_tile)
        return q_state, k_state, v_state

    def before_mainloop(self, v_pipe, v_state, sV, ctidx: Int32, seq, n_max: Int32, n_blocks: Int32):
        """Hook before a tile's mainloop, every consumer thread (a KV cache zeroes the V rows past
        its last key there: kernels/k5_cache.py)."""

    def tile_scales(self, ctx, scale_log2: Float32, batch: Int32, head: Int32, params):
        """The tile's exp2-domain score scale (and ctx.o_scale, None from compute_setup: O is
        only divided by the row sums). FP8 folds its descales in here."""
        return scale_log2

    @cute.jit
    def store_o(self, ctx, tma_o, mO, sO, mLSE, batch: Int32, head: Int32, scale_log2: Float32,
                store_pipe, ctidx: Int32, epi_tile: cutlass.Constexpr, row_offset=0):
        """O / l through SMEM (stmatrix) and a TMA store that clips the ragged edge; LSE direct.
        Varlen: the entry's rows start at row_offset of the packed plane (batch 0)."""
        o_mn = mma.rows_cols(ctx.acc_o)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            inv_sum, lse = self.row_output(ctx, r, scale_log2)
            for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, c] = o_mn[r, c] * inv_sum
            row = ctx.m_block * self.tile_m + ctx.o_coords[r, 0][0]
            if ctidx % 4 == 0 and row < ctx.seqlen_q:
                mLSE[batch, head, row_offset + row] = lse
        gO = cute.local_tile(seqlen.rows(mO, head, batch, row_offset, self.varlen),
                             (self.tile_m, self.head_dim_v), (ctx.m_block, 0))
        epilogue.store_tile(ctx.acc_o, ctx.pv, ctidx, sO, tma_o, gO, epi_tile,
                            dsl_pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER,
                                                      num_threads=128 * self.consumer_wgs),
                            ctidx < 32, store_pipe)
