"""S1 on an FP8 cache: q, k_cache and v_cache in float8_e4m3fn, with descales (batch, heads_kv)
FP32. An FP8 cache halves the bytes a decode reads. WGMMA's FP8 form wants V K-major (V^T), which a paged cache
does not hold, so the warpgroup dequantizes instead: each landed stage is converted into one 16-bit
K and one 16-bit V tile (fp16: every e4m3 value is exact there; cvt.rn.f16x2.e4m3x2 converts two
at a time), the GEMMs read those, and the stage is released as soon as it is converted. The
conversions are laid beside the GEMMs, per key block:

    issue S = Q K^T -> convert V (under S) -> release the stage -> wait for S -> softmax ->
    issue P V -> wait for the next stage, convert its K (under P V) -> wait for P V

(no GEMM is in flight across the loop's back edge: ptxas serializes WGMMAs whose accumulators
are carried there, C7514), and the ring is short (`fp8_kv_stages`) so that two CTAs share an SM
up to d128, one's conversions running beside the other's GEMMs. Q is converted as it is
gathered. q_descale x k_descale of the CTA's KV head folds into the score scale (with softcap:
into the tanh's), v_descale into O's normalisation; the output is bf16 or fp16 (`out_dtype`).

Everything else is S1's (kernels/decode.py): the split, packed GQA, pages and gathers, masks,
sinks, the combine. SMEM at d128: Q 16 KB, four 16 KB FP8 stages, the two 16 KB fp16 tiles.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .common import pipeline, smem
from .decode import SplitKVAttention

CONVERT_ELEMS = 8  # elements one thread dequantizes at a time: 8 bytes of e4m3 in, 16 bytes out


class Fp8SplitKVAttention(SplitKVAttention):
    fp8 = True  # (SplitKVAttention's SMEM plan counts the 1-byte stages and the fp16 tiles)

    def shared_storage(self, sQ_layout, sKV_layout, sKV16_layout):
        """S1's struct, and beside it the 16-bit K and V tiles the GEMMs read (only here: every
        byte counts when two CTAs share an SM)."""
        ring_storage = super().shared_storage(sQ_layout, sKV_layout, sKV16_layout)

        @cute.struct
        class Storage:
            ring: ring_storage
            sK16: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV16_layout)], 1024]
            sV16: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV16_layout)], 1024]
        return Storage

    def ring_storage(self, storage):
        return storage.ring

    @cute.jit
    def fold_descales(self, descales, batch: Int32, head_kv: Int32, scale_log2: Float32,
                      softcap_scale: Float32):
        """The KV head's descales (one sequence, one KV head a CTA): q x k into the score scale
        (with softcap: the tanh's), v into O's."""
        q_descale, k_descale, v_descale = descales
        qk_descale = q_descale[batch, head_kv] * k_descale[batch, head_kv]
        if cutlass.const_expr(self.softcap):
            softcap_scale = softcap_scale * qk_descale
        else:
            scale_log2 = scale_log2 * qk_descale
        return scale_log2, softcap_scale, v_descale[batch, head_kv]

    @cute.jit
    def attend(self, storage, sQ, sKV16_layout, kv_pipe, kv_producer, loads, warp_idx: Int32, blocks):
        """The GEMMs read the converted tiles."""
        sK16 = storage.sK16.get_tensor(sKV16_layout.outer, swizzle=sKV16_layout.inner)
        sV16 = storage.sV16.get_tensor(sKV16_layout.outer, swizzle=sKV16_layout.inner)
        tidx = loads[-1]  # (load_kv's last argument)
        ctx = self.compute_setup(sQ, sK16, sV16, tidx)
        return ctx, self.mainloop_fp8(ctx, kv_pipe, kv_producer, loads, warp_idx, sK16, sV16, *blocks)

    @cute.jit
    def mainloop_fp8(self, ctx, kv_pipe, kv_producer, loads, warp_idx: Int32, sK16: cute.Tensor,
                     sV16: cute.Tensor, n_blocks: Int32, last: Int32, m_block: Int32, group: Int32, seq,
                     scale_log2: Float32, window, softcap_scale: Float32):
        """mainloop on an FP8 cache: each stage converted into sK16/sV16, the conversions under the
        GEMMs (the module's docstring has the order)."""
        _, _, _, _, _, sK, sV, _, _, _, _, tidx = loads  # (load_kv's arguments)
        kv_consumer = pipeline.consumer_state(self.kv_stages)
        if n_blocks > 0:  # the first block's K
            pipeline.consume_wait(kv_pipe, kv_consumer)
            self.convert_k(sK, sK16, kv_consumer.index, tidx)
        for j in cutlass.range(n_blocks, unroll=1):
            n_block = last - j
            acc_s = self.scores(ctx, 0, wait=-1)  # S under V's conversion
            self.dequantize(sV[None, None, kv_consumer.index], sV16[None, None, 0], tidx,
                            seq.seqlen_k - n_block * self.tile_n)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, read by WGMMA
            kv_consumer = pipeline.release(kv_pipe, kv_consumer)  # refilled while the GEMMs run
            if self.is_kv_producer(warp_idx) and kv_producer.count < n_blocks:
                kv_producer = self.load_kv(kv_producer, last - kv_producer.count, *loads)
            warpgroup.wait_group(0)
            p = self.softmax_step(ctx, acc_s, m_block, n_block, group, seq, scale_log2, window, softcap_scale)
            cute.arch.sync_threads()  # every thread's share of sV16 written, every warp's S done
            self.accumulate(ctx, p, 0, wait=-1)  # P V under the next K's conversion
            if j + 1 < n_blocks:
                pipeline.consume_wait(kv_pipe, kv_consumer)
                self.convert_k(sK, sK16, kv_consumer.index, tidx)
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp's P V done: sV16 is free
        return kv_producer

    @cute.jit
    def convert_k(self, sK: cute.Tensor, sK16: cute.Tensor, stage: Int32, tidx: Int32):
        """The landed K tile of `stage` into sK16, visible to every warp's WGMMA when this returns
        (sK16 must be free: the last S done by every warp)."""
        self.dequantize(sK[None, None, stage], sK16[None, None, 0], tidx, self.tile_n)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

    @cute.jit
    def dequantize(self, src: cute.Tensor, dst: cute.Tensor, tidx: Int32, valid_rows: Int32):
        """FP8 stage tile -> the 16-bit tile the GEMMs read (both (tile_n, d), swizzled): each thread
        converts 8-element chunks (an 8-byte load, four cvt.rn.f16x2.e4m3x2, a 16-byte store), by
        rows; rows from valid_rows on are written as zeros (V: a cache's unused rows hold anything,
        NaN included, and 0 * NaN = NaN; K passes the tile's size)."""
        chunks = self.head_dim // CONVERT_ELEMS  # per row
        rows_per_pass, active = smem.row_passes(self.tile_n, chunks, self.num_threads)
        threads = cute.make_ordered_layout((rows_per_pass, chunks), order=(1, 0))
        values = cute.make_layout((1, CONVERT_ELEMS))
        load, store = (cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=CONVERT_ELEMS * dtype.width),
            threads, values) for dtype in (self.cache_dtype, self.dtype))
        tSsrc = load.get_slice(tidx % active).partition_S(src)
        tDdst = store.get_slice(tidx % active).partition_D(dst)
        if tidx < active:
            for i in cutlass.range_constexpr(self.tile_n // rows_per_pass):
                narrow = cute.make_rmem_tensor_like(tSsrc[None, i, 0])
                cute.copy(load, tSsrc[None, i, 0], narrow)
                wide = cute.make_rmem_tensor_like(tDdst[None, i, 0])
                wide.store(narrow.load().to(self.dtype))
                if tidx // chunks + i * rows_per_pass >= valid_rows:
                    wide.fill(0.0)
                cute.copy(store, wide, tDdst[None, i, 0])
