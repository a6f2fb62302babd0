"""A forward kernel fed by TMA through a `kv_stages`-deep producer/consumer ring, its math behind
three hooks: K3's kernel (scalar math per stage), which K4 runs with its math on WGMMA.

One CTA per (Q tile, head, batch):
  * Q is loaded once per CTA by one TMA copy into its own single-stage buffer.
  * K and V get *separate* staged SMEM regions (both can be in flight at once); the K and V copies
    of a stage complete on *one* full barrier whose tx_count is sK_bytes + sV_bytes.
  * Warp 0 prefetches min(kv_stages, n_tiles) stages, then refills the stage the CTA just released.
  * Per stage every thread runs the rung's hooks: compute_setup (once, before the first tile; the
    state the others share), compute_tile (one K/V stage) and compute_epilogue (O and LSE); SMEM
    holds a P buffer of p_smem_elems() FP32 (the scalar P V reads P from there).

Ragged tiles: TMA zero-fills rows past seqlen; masking handles the scores; the barrier still counts
the full box. A rung sets what it reads: dtype, head_dim, causal, tile_m, tile_n, kv_stages,
num_threads (all its warps consume).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from . import mask, pipeline, smem, tma
from .attention_tiles import StagedQkvLoads


class TmaRingKernel(StagedQkvLoads):
    kv_pipelines = 1  # K and V share one full barrier per stage (K5 splits them)
    q_stages = 1  # one Q tile per CTA (make_loads: common/attention_tiles.py)

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, stream):
        batch, seqlen_q, heads_q, _ = mQ.shape
        sQ_layout, sKV_layout, (tma_q, tQ, tma_k, tK, tma_v, tV) = self.make_loads(mQ, mK, mV)

        @cute.struct
        class SharedStorage:
            q_full: cute.struct.MemRange[Int64, 2]
            kv_barriers: cute.struct.MemRange[Int64, 2 * self.kv_stages * self.kv_pipelines]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, self.p_smem_elems()], 128]

        smem.check_budget(SharedStorage.size_in_bytes(),
                          f"K3 with kv_stages={self.kv_stages}, tile_n={self.tile_n}, d={self.head_dim}")
        self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, mO, mLSE, scale_log2, sQ_layout, sKV_layout,
                    SharedStorage).launch(
            grid=[cute.ceil_div(seqlen_q, self.tile_m), heads_q, batch],
            block=[self.num_threads, 1, 1], stream=stream)

    def p_smem_elems(self) -> int:
        """P goes through SMEM (fp32, rows padded by one word) for the scalar P V."""
        return self.tile_m * (self.tile_n + 1)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]  # (seqlen, d, heads, batch) views
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        if warp_idx == 0:
            tma.prefetch(tma_q, tma_k, tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        consumer_warps = self.num_threads // 32
        q_pipe = pipeline.create(storage.q_full.data_ptr(), 1, consumer_warps,
                                 smem.stage_bytes(self.dtype, sQ_layout))
        kv_pipe = pipeline.create(storage.kv_barriers.data_ptr(), self.kv_stages, consumer_warps,
                                  2 * smem.stage_bytes(self.dtype, sKV_layout))
        pipeline.init_done()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sP = storage.sP.get_tensor(cute.make_layout((self.tile_m, self.tile_n), stride=(self.tile_n + 1, 1)))

        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)
        tQsQ, tQgQ = tma.partition(tma_q, cute.local_tile(mQ[None, None, head, batch], tile_q, (None, 0)), sQ)
        tKsK, tKgK = tma.partition(tma_k, cute.local_tile(mK[None, None, head_kv, batch], tile_kv, (None, 0)), sK)
        tVsV, tVgV = tma.partition(tma_v, cute.local_tile(mV[None, None, head_kv, batch], tile_kv, (None, 0)), sV)
        kv_copies = [(tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV)]

        n_blocks = mask.n_block_max(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal)
        kv_producer = pipeline.producer_state(self.kv_stages)
        if warp_idx == 0:  # load: Q once, then fill the ring
            pipeline.produce(q_pipe, pipeline.producer_state(1), m_block, [(tma_q, tQgQ, tQsQ)])
            for _ in cutlass.range(cutlass.min(self.kv_stages, n_blocks), unroll=1):
                kv_producer = pipeline.produce(kv_pipe, kv_producer, kv_producer.count, kv_copies)

        ctx = self.compute_setup(sQ[None, None, 0], sK, sV, sP, tidx, m_block, seqlen_q, seqlen_k)
        pipeline.consume_wait(q_pipe, pipeline.consumer_state(1))
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        for n_block in cutlass.range(n_blocks, unroll=1):
            pipeline.consume_wait(kv_pipe, kv_consumer)
            self.compute_tile(ctx, kv_consumer.index, n_block, scale_log2)
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)
            if warp_idx == 0 and kv_producer.count < n_blocks:  # refill the stage just freed
                kv_producer = pipeline.produce(kv_pipe, kv_producer, kv_producer.count, kv_copies)
        if warp_idx == 0:
            pipeline.tail(kv_pipe, kv_producer)
        self.compute_epilogue(ctx, mO, mLSE, batch, head, scale_log2)
