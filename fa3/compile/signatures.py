"""The symbolic signatures each kernel family is compiled against (fa3.compile.builders compiles them).

Fake tensors stand for the call's torch tensors: their dtypes and ranks are static, their extents
and strides symbolic (`cute.sym_int64`), so that one compile serves every batch, seqlen, head count
and stride; where TMA reads a tensor, its base and strides are declared 16-byte aligned (what the
call's tensors are made to satisfy: fa3._launch.tma_ready). The order of each list is the kernel's
`__call__` signature.
"""

from __future__ import annotations

import torch

from . import dsl


def cute_dtype(torch_dtype):
    cutlass, _ = dsl.import_cute()
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float8_e4m3fn: cutlass.Float8E4M3FN}[torch_dtype]


def fake_tensor(cute, dtype, shape, strides, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=strides, assumed_align=align)


def unit_last(cute, dtype, *shape, tma=False, align=4):
    """A fake tensor whose last stride is 1 and other strides dynamic; `tma`: base and strides
    16-byte aligned (what TMA needs), else the base aligned to `align` bytes."""
    if tma:
        per_16_bytes = 128 // dtype.width  # elements
        return fake_tensor(cute, dtype, shape,
                            (*(cute.sym_int64(divisibility=per_16_bytes) for _ in shape[:-1]), 1))
    return fake_tensor(cute, dtype, shape, (*(cute.sym_int64() for _ in shape[:-1]), 1), align=align)


def descale_tensor(cute, f32, entries, heads_kv):
    """An FP8 descale (entries, heads_kv) FP32 with both strides dynamic: a per-tensor descale is
    passed as its one element broadcast (strides 0), with no copy per call."""
    return fake_tensor(cute, f32, (entries, heads_kv), (cute.sym_int64(), cute.sym_int64()), align=4)


def attention_args(spec, dtype, head_dim, head_dim_v=None):
    """Fake (q, k, v, o, lse[, scores]) in flash-attn's (batch, seqlen, heads, head_dim) layout;
    v and o have head_dim_v (default head_dim)."""
    cutlass, cute = dsl.import_cute()
    dt = cute_dtype(dtype)
    b, sq, sk, hq, hkv = (cute.sym_int64() for _ in range(5))
    dv = head_dim_v or head_dim

    q, o = unit_last(cute, dt, b, sq, hq, head_dim, tma=True), unit_last(cute, dt, b, sq, hq, dv, tma=True)
    k, v = unit_last(cute, dt, b, sk, hkv, head_dim, tma=True), unit_last(cute, dt, b, sk, hkv, dv, tma=True)
    lse = unit_last(cute, cutlass.Float32, b, hq, sq)
    args = [q, k, v, o, lse]
    if spec.needs_scores_workspace:
        args.append(unit_last(cute, cutlass.Float32, b, hq, sq, sk))
    args.append(cutlass.Float32(1.0))  # scale_log2
    if spec.persistent:
        args.append(cutlass.Int32(132))  # SM count, a runtime argument
        args.append(fake_tensor(cute, cutlass.Int32, (1,), (1,), align=4))  # the tile counter
    if spec.variants:  # cu_seqlens_q/k (own extents: 1-element stand-ins when not varlen), window
        # edges, softcap scale, the sinks (heads_q,) FP32 (a 1-element stand-in without them)
        args += [fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4) for _ in range(2)]
        args += [cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(1.0)]
        args.append(fake_tensor(cute, cutlass.Float32, (cute.sym_int64(),), (1,), align=4))
    return args


def aux_args(spec) -> tuple:
    """Fake tensors for flex attention's captured tensors ((dtype, rank) each: fa3.mods): dynamic
    extents, contiguous (the launch makes them so), as one tuple argument."""
    cutlass, cute = dsl.import_cute()
    fakes = []
    for dtype, rank in spec:
        elem = AUX_DTYPES[dtype]
        shape = tuple(cute.sym_int64() for _ in range(rank))
        fakes.append(fake_tensor(cute, getattr(cutlass, elem), shape,
                                 (*(cute.sym_int64() for _ in range(rank - 1)), 1),
                                 align=torch.empty((), dtype=dtype).element_size()))
    return tuple(fakes)


# torch dtype -> the cutlass type name a captured tensor is read as
AUX_DTYPES = {torch.float32: "Float32", torch.float16: "Float16", torch.bfloat16: "BFloat16",
              torch.int32: "Int32", torch.int64: "Int64", torch.int16: "Int16", torch.int8: "Int8",
              torch.uint8: "Uint8"}


def attention_fp8_args(spec, out_dtype, head_dim):
    """Fake (q, k, vt, o, lse, scale_log2, SM count, tile counter, cu_seqlens stand-ins, window
    edges, softcap scale, q/k/v descales): q, k e4m3 (batch, seqlen, heads, d); vt e4m3 (batch, d,
    heads_kv, keys padded to 16), or v as k where the rung transposes it itself; o in out_dtype;
    descales float32 (batch, heads_kv), or (sequences, heads_kv) for a packed batch (whose tensors
    have batch 1)."""
    cutlass, cute = dsl.import_cute()
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    b, sq, sk, skt, hq, hkv = (cute.sym_int64() for _ in range(6))
    v = (unit_last(cute, f8, b, head_dim, hkv, skt, tma=True) if spec.load_class().value_transposed_by_host
         else unit_last(cute, f8, b, sk, hkv, head_dim, tma=True))
    args = [unit_last(cute, f8, b, sq, hq, head_dim, tma=True),
            unit_last(cute, f8, b, sk, hkv, head_dim, tma=True),
            v,
            unit_last(cute, cute_dtype(out_dtype), b, sq, hq, head_dim, tma=True),
            unit_last(cute, f32, b, hq, sq), f32(1.0), cutlass.Int32(132),
            fake_tensor(cute, cutlass.Int32, (1,), (1,), align=4)]
    args += [fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4) for _ in range(2)]
    args += [cutlass.Int32(0), cutlass.Int32(0), f32(1.0)]
    entries = cute.sym_int64()  # the descales' rows: batch, or a packed batch's sequences
    args += [descale_tensor(cute, f32, entries, hkv) for _ in range(3)]
    return args


def backward_args(dtype, head_dim, gqa, deterministic, head_dim_v=None):
    """Fake (q, k, v, dO, lse2, D, dQacc, dK, dV, lock, scale_log2, softmax_scale, window_left,
    window_right, softcap_scale, cu_seqlens_q, cu_seqlens_k): see
    kernels/bwd.py. `rows` is seqlen_q rounded up to the Q tile (varlen: total_q;
    dQacc then holds tile_m rows more (B1) or the whole-tile slots of `packed_q_tile` (B2 on));
    dK/dV: (batch, seqlen_k, heads_q, d) in the inputs' dtype without GQA; under GQA FP32,
    (batch, seqlen_k, heads_kv, d) that the kernel adds into with atomics, or, when
    deterministic, one slice per query head summed over each group afterwards. v, dO and dV have
    head_dim_v columns where given."""
    cutlass, cute = dsl.import_cute()
    dt = cute_dtype(dtype)
    b, sq, sk, hq, hkv, rows, dq_rows = (cute.sym_int64() for _ in range(7))

    f32, dkv_dt = cutlass.Float32, (cutlass.Float32 if gqa else dt)
    dkv_heads = hkv if gqa and not deterministic else hq

    def tma_operand(*shape):
        return unit_last(cute, dt, *shape, tma=True)

    dv = head_dim_v or head_dim
    return [tma_operand(b, sq, hq, head_dim), tma_operand(b, sk, hkv, head_dim),
            tma_operand(b, sk, hkv, dv), tma_operand(b, sq, hq, dv),
            unit_last(cute, f32, b, hq, rows), unit_last(cute, f32, b, hq, rows),
            unit_last(cute, f32, b, dq_rows, hq, head_dim),
            unit_last(cute, dkv_dt, b, sk, dkv_heads, head_dim),
            unit_last(cute, dkv_dt, b, sk, dkv_heads, dv),
            # the counters have shapes of their own: a 1-element stand-in when not deterministic
            unit_last(cute, cutlass.Int32, *(cute.sym_int64() for _ in range(3))),
            cutlass.Float32(1.0), cutlass.Float32(1.0),
            # window edges and softcap_scale: read only by the local / softcap variants
            cutlass.Int32(0), cutlass.Int32(0), cutlass.Float32(1.0),
            # cu_seqlens_q/k: read only by the varlen variant (1-element stand-ins otherwise)
            *(fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4) for _ in range(2))]


def gemm_args(dtype, a_layout, b_layout, out_dtype=None):
    """Fake a (M, K), b (K, N), c (M, N) row-major (in out_dtype, default dtype), the SM count,
    split-K's FP32 workspace, int32 counters and split count, and FP8's scale_a/scale_b (FP32).
    Shapes are dynamic and shared (the call checks that a, b and c agree); the non-unit stride is
    dynamic and 16-byte aligned."""
    cutlass, cute = dsl.import_cute()

    def matrix(dt, rows, cols, layout):
        lead = cute.sym_int64(divisibility=128 // dt.width)
        return fake_tensor(cute, dt, (rows, cols), (lead, 1) if layout == "row" else (1, lead))

    dt, out = cute_dtype(dtype), cute_dtype(out_dtype or dtype)
    m, n, k = (cute.sym_int64() for _ in range(3))
    workspace = fake_tensor(cute, cutlass.Float32, (cute.sym_int64(),), (1,))
    counters = fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,))
    scales = [fake_tensor(cute, cutlass.Float32, (cute.sym_int64(),), (1,), align=4) for _ in range(2)]
    return [matrix(dt, m, k, a_layout), matrix(dt, k, n, b_layout), matrix(out, m, n, "row"),
            cutlass.Int32(132), workspace, counters, cutlass.Int32(1), *scales]


def cache_prefill_args(dtype, head_dim):
    """Fake (q, k_cache, v_cache, out, lse, scale_log2, SM count, tile counter, cu_seqlens_q,
    cache_seqlens, block_table, window edges, softcap scale, sinks): see kernels/k5_cache.py. q and
    out (1, total_q, heads_q, d); the cache (planes, rows, heads_kv, d); every extent dynamic."""
    cutlass, cute = dsl.import_cute()
    dt, f32, i32 = cute_dtype(dtype), cutlass.Float32, cutlass.Int32
    one, tq, hq, hkv, rows, planes = (cute.sym_int64() for _ in range(6))
    cache = lambda: unit_last(cute, dt, planes, rows, hkv, head_dim, tma=True)
    vector = lambda t: fake_tensor(cute, t, (cute.sym_int64(),), (1,), align=4)
    return [unit_last(cute, dt, one, tq, hq, head_dim, tma=True), cache(), cache(),
            unit_last(cute, dt, one, tq, hq, head_dim, tma=True), unit_last(cute, f32, one, hq, tq),
            f32(1.0), i32(132), vector(i32),  # scale_log2, SM count, the tile counter
            vector(i32), vector(i32), unit_last(cute, i32, cute.sym_int64(), cute.sym_int64()),
            i32(0), i32(0), f32(1.0), vector(f32)]  # window edges, softcap scale, sinks


def kvcache_args(dtype, head_dim, out_dtype=None, query_dtype=None, paged=True, varlen=True, leftpad=True,
                 sinks=True):
    """Fake (q, k_cache, v_cache, cache_seqlens, block_table, out, lse, out_partial, lse_partial,
    scale_log2, appended, window edges, softcap scale, cu_seqlens_q, max_seqlen_q, cache_leftpad,
    entry order, sinks, q/k/v descales): see kernels/decode.py. The cache is (planes, rows, heads_kv,
    d), planes being batch entries (dense) or pages (paged); every extent is dynamic (packed
    queries: q is (1, total_q, heads_q, d) and cache_seqlens has its own extent). `dtype`: the
    cache's, and q's unless query_dtype is given (16-bit q over an FP8 cache); out has out_dtype
    (default dtype); the descales are (batch, heads_kv) FP32 (1-element stand-ins where unread:
    all three over a 16-bit cache, q's for 16-bit q), any strides (a per-tensor one broadcast).
    What the variant does not read is None (the block table of a dense cache, cu_seqlens_q of
    (batch, seqlen_q) queries, cache_leftpad, the sinks, the descales it has not): the call passes
    None there too, which costs the launch nothing to convert."""
    cutlass, cute = dsl.import_cute()
    dt, f32, i32 = cute_dtype(dtype), cutlass.Float32, cutlass.Int32
    qt = cute_dtype(query_dtype or dtype)
    out = cute_dtype(out_dtype or dtype)
    b, sq, hq, hkv, rows, planes, pages, splits = (cute.sym_int64() for _ in range(8))
    # the block table, the partials, the lengths and the query offsets have extents of their own:
    # 1-element stand-ins when unused
    b_table, b_part, sq_part, hq_part, b_lens, b_cu, b_pad = (cute.sym_int64() for _ in range(7))
    cache = lambda: unit_last(cute, dt, planes, rows, hkv, head_dim, tma=True)
    descale = lambda: descale_tensor(cute, f32, cute.sym_int64(), cute.sym_int64())
    fp8, sixteen_bit_q = dtype == torch.float8_e4m3fn, query_dtype not in (None, dtype)
    return [unit_last(cute, qt, b, sq, hq, head_dim, align=qt.width // 8), cache(), cache(),
            fake_tensor(cute, i32, (b_lens,), (1,), align=4),
            unit_last(cute, i32, b_table, pages) if paged else None,
            unit_last(cute, out, b, sq, hq, head_dim, align=2), unit_last(cute, f32, b, hq, sq),
            unit_last(cute, f32, splits, b_part, sq_part, hq_part, head_dim),
            unit_last(cute, f32, splits, b_part, hq_part, sq_part), f32(1.0), i32(0),
            i32(0), i32(0), f32(1.0),  # (appended,) window edges, softcap scale
            fake_tensor(cute, i32, (b_cu,), (1,), align=4) if varlen else None, i32(1),  # cu_seqlens_q, max_seqlen_q
            fake_tensor(cute, i32, (b_pad,), (1,), align=4) if leftpad else None,  # cache_leftpad
            fake_tensor(cute, cutlass.Int64, (cute.sym_int64(),), (1,), align=8),  # the entries' order, or a stand-in
            fake_tensor(cute, f32, (cute.sym_int64(),), (1,), align=4) if sinks else None,
            descale() if fp8 and not sixteen_bit_q else None, descale() if fp8 else None,
            descale() if fp8 else None]


def mla_args(dtype, head_dim, head_dim_v):
    """Fake (q, qv, k_cache, v_cache, cache_seqlens, block_table, out, lse, out_partial,
    lse_partial, scale_log2, appended, cu_seqlens_q, max_seqlen_q): see kernels/mla_decode.py. q
    (batch, seqlen_q, heads_q, head_dim) and qv (..., head_dim_v) with 16-byte aligned rows
    (cp.async); the caches (planes, rows, heads_kv, d) with strides of their own (vLLM's k and v are
    views of one cache); every extent dynamic, the block table, the lengths, cu_seqlens_q and the
    partials with extents of their own (1-element stand-ins when unused)."""
    cutlass, cute = dsl.import_cute()
    dt, f32, i32 = cute_dtype(dtype), cutlass.Float32, cutlass.Int32
    b, sq, hq, hkv, rows, planes, pages, splits = (cute.sym_int64() for _ in range(8))
    b_table, b_part, sq_part, hq_part, b_lens, b_cu = (cute.sym_int64() for _ in range(6))
    return [unit_last(cute, dt, b, sq, hq, head_dim, tma=True), unit_last(cute, dt, b, sq, hq, head_dim_v, tma=True),
            unit_last(cute, dt, planes, rows, hkv, head_dim, tma=True),
            unit_last(cute, dt, planes, rows, hkv, head_dim_v, tma=True),
            fake_tensor(cute, i32, (b_lens,), (1,), align=4), unit_last(cute, i32, b_table, pages),
            unit_last(cute, dt, b, sq, hq, head_dim_v, align=2), unit_last(cute, f32, b, hq, sq),
            unit_last(cute, f32, splits, b_part, sq_part, hq_part, head_dim_v),
            unit_last(cute, f32, splits, b_part, hq_part, sq_part), f32(1.0), i32(0),
            fake_tensor(cute, i32, (b_cu,), (1,), align=4), i32(0)]
