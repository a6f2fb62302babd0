"""The backward's dK/dV epilogue: once a CTA has walked every Q tile, its dK (times softmax_scale)
and dV accumulators leave, rows past the entry's seqlen_k skipped:

    no GQA, in the inputs' 16-bit dtype: rounded into the free SMEM K and V tiles with stmatrix,
        then out in 16-byte row vectors (`store_dkv_rows`);
    GQA, FP32 summed over each group: as FP32 rows through the free Q/dO/K/V SMEM, one 1-D bulk
        reduce-add a row (`add_dkv_rows`, `dkv_bulk_add`), or scalar atomics (`store_dkv_fp32`);
    GQA deterministic: FP32 slices per query head, stored, summed on the host (`store_dkv_fp32`).

dV's accumulator has head_dim_v columns where V's head dim differs (its own tiled MMA, `ctx.dv`).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import accum, mma, seqlen, smem, tma


class DkvEpilogue:
    # GQA (FP32 dK/dV summed over each group, not deterministic): rows out of SMEM by 1-D bulk
    # reduce-adds instead of one scalar atomic per element (`add_dkv_rows`; the warp-specialized
    # kernel's: measured faster)
    dkv_bulk_add = False

    @cute.jit
    def store_dkv(self, ctx, s, mdK: cute.Tensor, mdV: cute.Tensor, n_block: Int32, head: Int32,
                  batch: Int32, softmax_scale: Float32, heads_q: Int32):
        """dK * softmax_scale and dV, rows past seqlen_k skipped: rounded to the output's dtype
        into this head's slice through SMEM (`store_dkv_rows`), or in FP32 (GQA) from registers:
        without determinism added with atomics into the slice of the group's KV head
        (heads_kv heads), deterministic into this query head's slice."""
        group_sum = cutlass.const_expr(mdK.element_type == Float32 and not self.deterministic)
        slice_head = head // (heads_q // mdK.shape[2]) if group_sum else head
        if cutlass.const_expr(mdK.element_type == self.dtype):
            self.store_dkv_rows(ctx, s, mdK, mdV, n_block, head, batch, softmax_scale)
        elif cutlass.const_expr(group_sum and self.dkv_bulk_add):
            self.add_dkv_rows(ctx, s, mdK, mdV, n_block, slice_head, batch, softmax_scale)
        else:
            self.store_dkv_fp32(ctx, mdK, mdV, n_block, slice_head, batch, softmax_scale, group_sum)

    @cute.jit
    def store_dkv_rows(self, ctx, s, mdK: cute.Tensor, mdV: cute.Tensor, n_block: Int32, head: Int32,
                       batch: Int32, softmax_scale: Float32):
        """dK and dV rounded into the SMEM K and V tiles (free once every GEMM of the walk is done;
        stmatrix, 8x8 blocks), then out row by row in 16-byte vectors, rows past the entry's
        seqlen_k skipped. Direct stores from the accumulator would be 2-byte scalars (a thread
        holds pairs of columns 8 rows apart): 128 a thread at d128."""
        self.sync_consumers()  # both warpgroups are done reading sK and sV
        dk = cute.make_rmem_tensor_like(ctx.acc_dk, self.dtype)
        dk.store((ctx.acc_dk.load() * softmax_scale).to(self.dtype))
        self.dkv_to_smem(ctx, dk, s.sK[None, None, 0], ctx.dkv)
        self.dkv_to_smem(ctx, mma.to_dtype(ctx.acc_dv, self.dtype), s.sV[None, None, 0], ctx.dv)
        self.sync_consumers()
        first = (n_block * self.tile_n, 0)  # the tile's rows in the entry's (seqlen_k, d) rows
        gdK = cute.domain_offset(first, seqlen.rows(tma.seq_major(mdK), head, batch, ctx.seq.offset_k, self.varlen))
        gdV = cute.domain_offset(first, seqlen.rows(tma.seq_major(mdV), head, batch, ctx.seq.offset_k, self.varlen))
        rows, threads = ctx.seq.seqlen_k - n_block * self.tile_n, 128 * self.mma_warpgroups
        tiles = ((s.sK[None, None, 0], gdK), (s.sV[None, None, 0], gdV))
        if cutlass.const_expr(self.head_dim_v == self.head_dim):
            smem.store_rows(tiles, rows, ctx.tidx, threads)  # a row of each in the same pass
        else:
            for tile in tiles:
                smem.store_rows((tile,), rows, ctx.tidx, threads)

    @cute.jit
    def dkv_to_smem(self, ctx, frag: cute.Tensor, sX: cute.Tensor, tiled: cute.TiledMma):
        """A rounded dK or dV accumulator of `tiled` into the (tile_n, d) SMEM tile sX, with
        stmatrix."""
        mma.store_to_smem(frag, tiled, ctx.tidx, sX)

    @cute.jit
    def add_dkv_rows(self, ctx, s, mdK: cute.Tensor, mdV: cute.Tensor, n_block: Int32, head_kv: Int32,
                     batch: Int32, softmax_scale: Float32):
        """GQA: dK * softmax_scale, then dV, each as FP32 rows into the free Q/dO/K/V SMEM
        (`scratch`, rows padded by 4 floats: a warp's 8-byte stores of 8 rows meet 2-way bank
        conflicts, not 8-way), and added into the KV head's FP32 rows by one 1-D bulk reduce-add
        a row (thread r issues row r; rows past the entry's seqlen_k skipped). The scratch is
        rewritten for dV once every row's bulk read of dK is done."""
        rows_left = ctx.seq.seqlen_k - n_block * self.tile_n
        first = ctx.seq.offset_k + n_block * self.tile_n  # the entry's plane, or the packed rows
        entry = 0 if cutlass.const_expr(self.varlen) else batch
        ctx.acc_dk.store(ctx.acc_dk.load() * softmax_scale)
        for acc, thr, mX, d in ((ctx.acc_dk, ctx.thr_dkv, mdK, self.head_dim),
                                (ctx.acc_dv, ctx.thr_dv, mdV, self.head_dim_v)):
            stride = d + 4  # 16-byte aligned rows (d a multiple of 8)
            sX = cute.make_tensor(s.scratch, cute.make_layout((self.tile_n, d), stride=(stride, 1)))
            self.sync_consumers()  # the walk's GEMMs (dK) or the previous rows' bulk reads (dV) are done
            cute.autovec_copy(acc, thr.partition_C(self.dkv_view(sX)))
            cute.arch.fence_view_async_shared()  # generic-proxy writes, read by the bulk copies
            self.sync_consumers()
            r = ctx.tidx
            if r < cutlass.min(rows_left, self.tile_n):
                tma.bulk_reduce_add_f32(accum.elem_ptr(sX, (r, 0)),
                                        accum.elem_ptr(mX, (entry, first + r, head_kv, 0)), d * 4)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_dkv_fp32(self, ctx, mdK: cute.Tensor, mdV: cute.Tensor, n_block: Int32, slice_head: Int32,
                       batch: Int32, softmax_scale: Float32, group_sum: cutlass.Constexpr):
        """FP32 dK/dV (GQA) from the accumulators, element by element, into head `slice_head`:
        added with atomics (`group_sum`) or stored (see store_dkv)."""
        offset = ctx.seq.offset_k
        rows_left = ctx.seq.seqlen_k - n_block * self.tile_n
        for acc, thr, mX, d, scale in ((ctx.acc_dk, ctx.thr_dkv, mdK, self.head_dim, softmax_scale),
                                       (ctx.acc_dv, ctx.thr_dv, mdV, self.head_dim_v, None)):
            coords = thr.partition_C(self.dkv_view(cute.make_identity_tensor((self.tile_n, d))))
            gX = thr.partition_C(self.dkv_view(cute.local_tile(
                seqlen.rows(tma.seq_major(mX), slice_head, batch, offset, self.varlen), (self.tile_n, d),
                (n_block, 0))))
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                if coords[i][0] < rows_left:
                    value = acc[i] * scale if cutlass.const_expr(scale is not None) else acc[i]
                    if cutlass.const_expr(group_sum):
                        accum.add_element(gX, i, value)
                    else:
                        gX[i] = value.to(mX.element_type)
