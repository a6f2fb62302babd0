"""What every backward CTA sets up around its walk, B1's and the warp-specialized kernel's alike: its
work (a K/V tile, a query head, a batch entry), the SMEM layouts and storage, the TMA loads of Q,
dO, K and V with their pipelines, the consumers' context, and the range of Q tiles it walks.

Q and dO share one staged layout (dO may take fewer stages, `do_stages`, in a ring of its own); K
and V one stage each; P and dS one tile each (the kernel's `smem_layouts` may change them: the
transposed scores' dS^T buffers, the transposed dK/dV's key shares). Every transposed operand is a
view of the same swizzled tile. After the walk the Q, dO, K and V tiles (consecutive fields) are
free: FP32 scratch for the dK/dV epilogue (bwd_dkv_store.py).

Variable-length batches (`varlen`): the grid's CTAs take every entry's (head, K/V tile) pairs entry
after entry (`kv_tile_work`, common/scheduler.py) and each reads its entry's lengths and row
offsets (common/seqlen.py); each entry's Q tiles have whole-tile slots (`packed_q_tile`) for the
statistics, the dQ counters and the fragment-order dQ accumulator.

A mixin of the backward kernels (kernels/bwd.py, kernels/bwd_ws.py), which set `mma_warpgroups`
and provide `dq_smem_elems`, `mma_setup` (bwd_mma.py) and the statistics (common/statistics.py).
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .common import mask, mma, pipeline, q_walk, scheduler, seqlen, smem, tma
from .config import BackwardConfig


class BackwardSetup:
    """Mixin of the backward kernels: the static configuration every one takes (the constructor),
    then the CTA's setup. The kernel may replace the settings below (properties of its flags)."""
    mma_warpgroups = 2
    p_in_smem = True  # P goes through SMEM for dV (the transposed scores keep it in registers)
    dq_turn_barriers = 0  # mbarriers of the dQ hand-off (in the barriers' first 1 KB: no tile moves)
    walk_slots = 0  # a block-sparse walk's hand-off of Q tiles, loader to consumers: its stages (after the dQ turns: q_walk.py)
    q_tile_multiple = 64  # Q tiles are M of S and dQ: whole 64-row WGMMA atoms (dQ^T: N of both)
    kv_tile_multiple = 64  # K/V tiles are M of dK/dV; P and dS rows fill a 128-byte swizzle atom

    def __init__(self, dtype, head_dim: int, causal: bool, config: BackwardConfig,
                 deterministic: bool = False, local: bool = False, softcap: bool = False,
                 varlen: bool = False, head_dim_v: int | None = None):
        """config: kernels/config.backward_config's (this mixin reads the tiles and stages, the
        kernel its flags)."""
        self.config = config
        tile_m, tile_n, q_stages = config.tile_m, config.tile_n, config.q_stages
        assert tile_m % self.q_tile_multiple == 0 and tile_n % self.kv_tile_multiple == 0, \
            f"Q tiles of a multiple of {self.q_tile_multiple} rows, K/V tiles of {self.kv_tile_multiple} (WGMMA atoms, swizzle atoms)"
        self.dtype, self.head_dim, self.causal = dtype, head_dim, causal
        # V's head dim (dO, O and dV take it; Q, K, dQ and dK keep head_dim): `value_head_dims`
        self.head_dim_v = head_dim_v or head_dim
        # static variants, as the forward's: the window's predicates (mask.py) and capped scores
        self.local, self.softcap, self.varlen = local, softcap, varlen
        self.tile_m, self.tile_n, self.q_stages = tile_m, tile_n, q_stages
        # dO's stages (0: Q's, on Q's barriers); fewer (`split_do`: one) free SMEM, and dO then has
        # a ring of its own
        self.do_stages = config.do_stages or q_stages
        assert self.do_stages in (1, q_stages), "dO takes Q's stages or one"
        self.deterministic = deterministic
        # dQ added in a fixed K/V order (counters): deterministic, or chosen for speed (`ordered_dq`
        # in kernels/config.py: b2 at d256)
        self.ordered_dq = deterministic or config.ordered_dq
        self.num_threads = 128 * self.mma_warpgroups

    # ---------------------------------------------------------------- host side
    @property
    def split_do(self) -> bool:
        """Whether dO has fewer stages than Q, in a ring of its own (`do_stages`)."""
        return self.do_stages != self.q_stages

    def smem_layouts(self, head_dim: int | None = None, stages: int | None = None):
        """Q and dO share one staged layout; K and V one stage each; P and dS one tile each. Q and
        dO are the MN-major B of dK and dV, K that of dQ: where those MMAs split head_dim among
        the warpgroups, the swizzle fits a warpgroup's share (smem.py). `head_dim`: the tiles'
        columns (default head_dim; `value_layouts` asks for head_dim_v); `stages`: the Q-shaped
        tile's (default q_stages; `value_layouts` asks for do_stages)."""
        wgs, d = self.mma_warpgroups, head_dim or self.head_dim
        return (smem.tile_layout(self.dtype, self.tile_m, d, stages or self.q_stages,
                                 share=mma.n_share(self.tile_n, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_n, d, 1, share=mma.n_share(self.tile_m, d, wgs)),
                smem.tile_layout(self.dtype, self.tile_m, self.tile_n, 1))

    def value_layouts(self, sQ_layout, sKV_layout):
        """(dO's staged layout, V's): Q's and K's, or with head_dim_v columns where V's head dim
        differs, and do_stages stages where dO has fewer than Q (dO and V then have tiles of their
        own)."""
        if self.head_dim_v == self.head_dim and not self.split_do:
            return sQ_layout, sKV_layout
        sdO_layout, sV_layout = self.smem_layouts(self.head_dim_v, self.do_stages)[:2]
        return sdO_layout, sV_layout if self.head_dim_v != self.head_dim else sKV_layout

    def make_loads(self, mQ, mdO, mK, mV, sQ_layout, sKV_layout):
        """(atom, TMA tensor) for Q, dO (Q tiles) and K, V (K/V tiles), flattened."""
        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        dv = self.head_dim_v
        return (*tma.make_load(tma.seq_major(mQ), sQ_layout, tile_q),
                *tma.make_load(tma.seq_major(mdO), sdO_layout, (self.tile_m, dv)),
                *tma.make_load(tma.seq_major(mK), sKV_layout, tile_kv),
                *tma.make_load(tma.seq_major(mV), sV_layout, (self.tile_n, dv)))

    def shared_storage(self, sQ_layout, sKV_layout, sPdS_layout):
        p_elems = cute.cosize(sPdS_layout) if self.p_in_smem else 8  # 8 keeps the field valid
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[Int64, 2 * self.q_stages]
            kv_barriers: cute.struct.MemRange[Int64, 2]
            # (1 keeps the field valid; a block-sparse walk's hand-off, mbarriers and slots, follows the turns)
            dq_turns: cute.struct.MemRange[Int64, max(1, self.dq_turn_barriers + q_walk.handoff_words(self.walk_slots))]
            do_barriers: cute.struct.MemRange[Int64, 2 * self.do_stages if self.split_do else 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.dq_smem_elems()], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.stat_smem_elems()], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.stat_smem_elems()], 128]

        if self.dkv_bulk_add:  # add_dkv_rows' FP32 rows fit in the free Q, dO, K and V tiles
            free = sum(cute.cosize(x) for x in (sQ_layout, sdO_layout, sKV_layout, sV_layout)) * self.dtype.width // 8
            widest = max(self.head_dim, self.head_dim_v)
            assert self.tile_n * (widest + 4) * 4 <= free, "dK/dV rows exceed the free SMEM"
        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"{type(self).__name__} with q_stages={self.q_stages}, tile_m={self.tile_m}, "
                          f"tile_n={self.tile_n}, d={self.head_dim}")
        return SharedStorage

    def grid(self, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensK: cute.Tensor):
        """One CTA per (K/V tile, query head, batch entry). Varlen: the entries' K/V tiles in a
        row, at most ceil(total_k / tile_n) + entries of them (CTAs past the last one exit)."""
        batch, seqlen_k, heads_q = mQ.shape[0], mK.shape[1], mQ.shape[2]
        kv_tiles = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.varlen):
            return [kv_tiles + mCuSeqlensK.shape[0] - 1, heads_q, 1]
        return [kv_tiles, heads_q, batch]

    # ---------------------------------------------------------------- setup pieces
    @cute.jit
    def kv_tile_work(self, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                     mCuSeqlensK: cute.Tensor):
        """(n_block, head, batch, seq) of this CTA; seq (common/seqlen.py) holds the entry's lengths
        and row offsets. Varlen: the grid's CTAs, numbered x fastest, take the entries' (head, K/V
        tile) pairs entry after entry, as fixed lengths order them (bwd_order.py); the entry of
        the CTA's packed K/V tile index (its number over the heads) found by a warp-wide search of
        cu_seqlens_k. A CTA past the last one gets empty lengths (no work)."""
        block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):
            heads = mQ.shape[2]
            linear = block + cute.arch.grid_dim()[0] * head
            # offsets clamped into the packed rows: unchecked ones (a replayed graph) stay inside
            batch, in_entry, blocks = scheduler.varlen_tile(linear // heads, mCuSeqlensK, self.tile_n, mK.shape[0])
            seq = seqlen.from_cu_seqlens(mCuSeqlensQ, mCuSeqlensK, batch, mQ.shape[0], mK.shape[0])
            local = linear - (linear // heads - in_entry) * heads  # among the entry's blocks x heads
            n_block, head = scheduler.head_group_tile(local, cutlass.max(blocks, 1), heads,
                                                      self.head_group(seq.seqlen_q, seq.seqlen_k, heads))
            head = cutlass.min(head, heads - 1)  # a CTA past the last tile: any head, no work
            seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
            if blocks == 0:
                seqlen_q, seqlen_k = Int32(0), Int32(0)
            seq.seqlen_q, seq.seqlen_k = seqlen_q, seqlen_k
            return self.kv_order(n_block, blocks), head, batch, seq
        kv_tiles = (mK.shape[0] + self.tile_n - 1) // self.tile_n  # (seqlen, d, heads, batch)
        block, head, batch = self.launch_tile(block, head, batch, kv_tiles, mQ.shape[0], mK.shape[0],
                                              mQ.shape[2], mQ.shape[3])
        return self.kv_order(block, kv_tiles), head, batch, seqlen.fixed(mQ.shape[0], mK.shape[0])

    def make_pipelines(self, storage, sQ_layout, sKV_layout, consumer_warps):
        """(Q/dO ring, K/V single stage): each stage's Q and dO (K and V) land on one barrier (with
        the stage's statistics, `stats_in_smem`); with `split_do`, the Q ring holds Q alone
        (`make_do_pipeline`)."""
        stat_bytes = 2 * self.tile_m * 4 if self.smem_stats else 0
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        q_bytes = smem.stage_bytes(self.dtype, sQ_layout)
        if not self.split_do:
            q_bytes += smem.stage_bytes(self.dtype, sdO_layout)
        kv_bytes = smem.stage_bytes(self.dtype, sKV_layout) + smem.stage_bytes(self.dtype, sV_layout)
        q_pipe = pipeline.create(storage.q_barriers.data_ptr(), self.q_stages, consumer_warps,
                                 q_bytes + stat_bytes)
        kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), 1, consumer_warps, kv_bytes)
        return q_pipe, kv_pipe

    def make_do_pipeline(self, storage, sQ_layout, sKV_layout, consumer_warps):
        """`split_do`: dO's own ring of do_stages, its stage for Q tile i at count i (`do_state`);
        None otherwise (dO rides on the Q ring)."""
        if not self.split_do:
            return None
        sdO_layout, _ = self.value_layouts(sQ_layout, sKV_layout)
        return pipeline.create(storage.do_barriers.data_ptr(), self.do_stages, consumer_warps,
                               smem.stage_bytes(self.dtype, sdO_layout))

    def smem_tensors(self, storage, sQ_layout, sKV_layout, sPdS_layout):
        def get(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        stats = dict(sLSE=storage.sLSE.get_tensor(self.stat_layout()),
                     sD=storage.sD.get_tensor(self.stat_layout())) if self.smem_stats else {}
        # after the walk Q, dO, K and V (consecutive fields) are free: FP32 scratch for dK/dV
        scratch = cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32)
        sdO_layout, sV_layout = self.value_layouts(sQ_layout, sKV_layout)
        return SimpleNamespace(scratch=scratch, sQ=get(storage.sQ, sQ_layout), sdO=get(storage.sdO, sdO_layout),
                               sK=get(storage.sK, sKV_layout), sV=get(storage.sV, sV_layout),
                               sP=get(storage.sP, sPdS_layout) if self.p_in_smem else None,
                               sdS=get(storage.sdS, sPdS_layout), **stats)

    def tma_copies(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, s, head, batch, seq, stat_loads=None):
        """([(atom, gmem tiles, smem stages)] for Q and dO (and the statistics, `stat_loads`: the
        atoms and TMA tensors of make_stat_loads), the same for K and V)."""
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)

        def copy(atom, mX, h, offset, tile, sX):
            gX = seqlen.rows(mX, h, batch, offset, self.varlen)
            tXsX, tXgX = tma.partition(atom, cute.local_tile(gX, tile, (None, 0)), sX)
            return atom, tXgX, tXsX

        stat_copies = []
        if cutlass.const_expr(self.smem_stats):
            tma_lse, mLSE2, tma_d, mD = stat_loads
            offset = self.stat_offset(seq, batch)
            stat_copies = [copy(tma_lse, mLSE2, head, offset, (self.tile_m, 1), s.sLSE),
                           copy(tma_d, mD, head, offset, (self.tile_m, 1), s.sD)]

        dv = self.head_dim_v
        return ([copy(tma_q, mQ, head, seq.offset_q, tile_q, s.sQ),
                 copy(tma_do, mdO, head, seq.offset_q, (self.tile_m, dv), s.sdO)] + stat_copies,
                [copy(tma_k, mK, head_kv, seq.offset_k, tile_kv, s.sK),
                 copy(tma_v, mV, head_kv, seq.offset_k, (self.tile_n, dv), s.sV)])

    def consumer_setup(self, s, tidx, seq, window, softcap_scale, mLSE2, mD, head, batch):
        """`mma_setup`'s context plus what the walk reads: the entry's lengths and offsets (seq),
        the window edges, the softcap scale, and this head's LSE * log2 e and D rows."""
        ctx = self.mma_setup(s, tidx)
        ctx.window, ctx.softcap_scale, ctx.seq = window, softcap_scale, seq
        if self.smem_stats:  # (common/statistics.py: registers or SMEM)
            ctx.sLSE, ctx.sD = s.sLSE, s.sD
        else:
            ctx.lse_rows, ctx.d_rows = self.stat_rows(mLSE2, head, batch, seq), self.stat_rows(mD, head, batch, seq)
        return ctx

    # ---------------------------------------------------------------- the walk
    @cute.jit
    def q_tile_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window):
        """(first, end) of the Q tiles that see K/V tile n_block (mask.py; end >= first)."""
        first = mask.m_block_min(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal, window)
        end = mask.m_block_max(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, window)  # 0 without rows
        if cutlass.const_expr(window is not None):  # a window may leave this K/V tile no Q tile
            end = cutlass.max(first, end)
        return first, end

    def packed_q_tile(self, seq, m_block: Int32, batch: Int32) -> Int32:
        """Varlen: Q tile m_block of entry `batch` among whole-tile slots per head (the dQ counters,
        the fragment-order dQ accumulator): entry b's tiles count from cu_seqlens_q[b] // tile_m + b,
        which leaves every entry room for all of its tiles; total_q // tile_m + entries + 1 slots
        hold them all (seq's offsets clamped into the packed rows, seqlen.py)."""
        return seq.offset_q // self.tile_m + batch + m_block

