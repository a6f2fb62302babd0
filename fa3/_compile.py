"""Compile once per static configuration; keep batch, seqlens and heads dynamic.

Kernels are compiled against *fake* tensors whose batch, seqlen, heads and strides are symbolic
(`cute.sym_int64`; each family's list: fa3._signatures), with the TVM-FFI calling convention: the
compiled object is then called with plain torch tensors, checks them in compiled code, and
launches on torch's current stream. A new shape never recompiles; a new dtype, head dim, causal
flag or rung does (it is in the key).

Without a GPU (CI), compiles target sm_90a: the DSL is imported through fa3._dsl, which pins the
architecture first (nothing in fa3 imports cutlass at module import time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import threading
from dataclasses import dataclass

import torch

from . import _disk_cache, _dsl, registry, split_plan
from . import _signatures as sig

_LOCK = threading.Lock()
_CACHE: dict[tuple, object] = {}


def _key_dims(head_dim, head_dim_v):
    """A compile key's head dims: head_dim, or (head_dim, head_dim_v) where v's differs (so keys
    of calls with equal head dims stay as they were)."""
    return head_dim if head_dim_v in (None, head_dim) else (head_dim, head_dim_v)


def attention_key(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                  sinks=False, head_dim_v=None, short=False) -> tuple:
    cfg = spec.config_for(head_dim, head_dim_v, short)
    variant = (bool(varlen), bool(local), bool(softcap), bool(sinks))
    return (spec.name, str(dtype), _key_dims(head_dim, head_dim_v), bool(causal), *((variant,) if any(variant) else ()),
            tuple(sorted(cfg.items())), _dsl.TARGET_ARCH, _dsl.version())


def _options(extra: str = "") -> str:
    return f"--enable-tvm-ffi --gpu-arch {_dsl.TARGET_ARCH} {extra}".strip()


def _compile_kernel(kernel, fake_args, extra_options):
    """Compile for torch's current stream (TVM-FFI: called with plain torch tensors)."""
    _, cute = _dsl.import_cute()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fake_args, stream, options=_options(extra_options))


def _build_attention(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                     sinks=False, head_dim_v=None, short=False, extra_options=""):
    variant = dict(varlen=varlen, local=local, softcap=softcap, sinks=sinks) if spec.variants else {}
    if head_dim_v not in (None, head_dim):
        variant["head_dim_v"] = head_dim_v
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal,
                               **variant, **spec.config_for(head_dim, head_dim_v, short))
    return _compile_kernel(kernel, sig.attention_args(spec, dtype, head_dim, head_dim_v), extra_options)


# ----------------------------------------------------------------------------- FP8 forward (F1)
def _build_attention_fp8(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                         extra_options=""):
    """`dtype`: the output's (q, k, v are e4m3)."""
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal, varlen=varlen,
                               local=local, softcap=softcap, **spec.config_for(head_dim))
    return _compile_kernel(kernel, sig.attention_fp8_args(spec, dtype, head_dim), extra_options)


def attention_fp8_key(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False) -> tuple:
    return attention_key(spec, dtype, head_dim, causal, varlen, local, softcap)


def get_attention_fp8(spec, out_dtype, head_dim, causal, varlen=False, local=False, softcap=False):
    """The compiled FP8 forward for this static configuration (`out_dtype`: O's)."""
    fast_key = ("fp8", spec.name, out_dtype, head_dim, causal, varlen, local, softcap)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(
            attention_fp8_key(spec, out_dtype, head_dim, causal, varlen, local, softcap),
            lambda: _build_attention_fp8(spec, out_dtype, head_dim, causal, varlen, local, softcap))
    return fn


def _cached(key, build):
    """The kernel for `key` (a callable), loaded from the disk cache or built and stored there,
    once even across threads, on first use."""
    fn = _CACHE.get(key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(key)
            if fn is None:
                fn = _CACHE[key] = _load_or_build(key, build)
    return fn


def _load_or_build(key, build):
    fn = _disk_cache.load(key)  # a hit does not import cutlass
    if fn is None:
        compiled = build()
        _disk_cache.save(key, compiled)
        fn = _disk_cache.fast_callable(compiled)
    return fn


_FAST: dict[tuple, object] = {}  # (rung, dtype, head_dim, causal) -> compiled: the per-call lookup


def get_attention(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False, sinks=False,
                  head_dim_v=None, short=False):
    """The compiled kernel for this static configuration (compiled on first use). The per-call
    path is one dict lookup; the full key (config, arch, DSL version) is built only on a miss.
    varlen/local/softcap/sinks: the variants of rungs that list them (registry `variants`);
    head_dim_v: V's head dim where it differs (registry `value_head_dims`); short: the rung's
    tiles for short query sequences (registry `short_queries`)."""
    fast_key = (spec.name, dtype, head_dim, causal, varlen, local, softcap, sinks, head_dim_v, short)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(
            attention_key(spec, dtype, head_dim, causal, varlen, local, softcap, sinks, head_dim_v, short),
            lambda: _build_attention(spec, dtype, head_dim, causal, varlen, local, softcap, sinks,
                                     head_dim_v, short))
    return fn


# ----------------------------------------------------------------------------- backward
def backward_key(spec, dtype, head_dim, causal, deterministic=False, gqa=False, local=False,
                 softcap=False, varlen=False, head_dim_v=None) -> tuple:
    cfg = spec.config_for(head_dim, head_dim_v)
    return (spec.name, str(dtype), _key_dims(head_dim, head_dim_v), bool(causal), bool(deterministic), bool(gqa),
            bool(local), bool(softcap), bool(varlen), tuple(sorted(cfg.items())), _dsl.TARGET_ARCH,
            _dsl.version())


def _build_backward(spec, dtype, head_dim, causal, deterministic=False, gqa=False, local=False,
                    softcap=False, varlen=False, head_dim_v=None, extra_options=""):
    value = {"head_dim_v": head_dim_v} if head_dim_v not in (None, head_dim) else {}
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal,
                               deterministic=deterministic, local=local, softcap=softcap,
                               varlen=varlen, **value, **spec.config_for(head_dim, head_dim_v))
    return _compile_kernel(kernel, sig.backward_args(dtype, head_dim, gqa, deterministic, head_dim_v),
                           extra_options)


def get_backward(spec, dtype, head_dim, causal, deterministic, gqa, local=False, softcap=False,
                 varlen=False, head_dim_v=None):
    """The compiled backward main kernel for this static configuration (compiled on first use);
    head_dim_v: V's head dim where it differs (registry `value_head_dims`)."""
    fast_key = ("bwd", spec.name, dtype, head_dim, causal, deterministic, gqa, local, softcap, varlen,
                head_dim_v)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(
            backward_key(spec, dtype, head_dim, causal, deterministic, gqa, local, softcap, varlen,
                         head_dim_v),
            lambda: _build_backward(spec, dtype, head_dim, causal, deterministic, gqa, local, softcap,
                                    varlen, head_dim_v))
    return fn


def _build_preprocess(dtype, head_dim, head_dim_v=None, varlen=False, tile_m=64, dq_in_slots=False,
                      extra_options=""):
    cutlass, cute = _dsl.import_cute()
    from .kernels.bwd_pre import BackwardPreprocess

    dt = sig.cute_dtype(dtype)
    b, sq, h, rows = (cute.sym_int64() for _ in range(4))

    def tensor(elem, *shape):
        return sig.unit_last(cute, elem, *shape, align=4)

    dq_rows = cute.sym_int64()
    # O, dO and the dQ accumulator read and written in 16-byte vectors (_launch.tma_ready's rule)
    dv = head_dim_v or head_dim
    args = [sig.unit_last(cute, dt, b, sq, h, dv, tma=True),
            sig.unit_last(cute, dt, b, sq, h, dv, tma=True),
            tensor(cutlass.Float32, b, h, sq), tensor(cutlass.Float32, b, h, rows),
            tensor(cutlass.Float32, b, h, rows),
            sig.unit_last(cute, cutlass.Float32, b, dq_rows, h, head_dim, tma=True),
            # cu_seqlens_q: read only by the varlen variant (a 1-element stand-in otherwise)
            sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)]
    return _compile_kernel(BackwardPreprocess(dt, head_dim, head_dim_v, varlen, tile_m, dq_in_slots), args,
                           extra_options)


def get_backward_preprocess(dtype, head_dim, head_dim_v=None, varlen=False, tile_m=64, dq_in_slots=False):
    """D = rowsum(dO * O) and LSE * log2(e), padded, and the dQ accumulator zeroed (kernels/bwd_pre.py);
    O and dO have head_dim_v columns where given. varlen: a packed batch, the statistics (and,
    dq_in_slots, the dQ accumulator) in slots of the main kernel's tile_m rows."""
    fast_key = ("bwd_pre", dtype, head_dim, head_dim_v, varlen, tile_m, dq_in_slots)
    fn = _FAST.get(fast_key)
    if fn is None:
        layout = (bool(varlen), tile_m if varlen else 0, bool(dq_in_slots and varlen))
        key = ("bwd_pre", str(dtype), _key_dims(head_dim, head_dim_v), layout, _dsl.TARGET_ARCH, _dsl.version())
        fn = _FAST[fast_key] = _cached(key, lambda: _build_preprocess(dtype, head_dim, head_dim_v, *layout))
    return fn


def _build_postprocess(spec, dtype, head_dim, varlen=False, extra_options=""):
    cutlass, cute = _dsl.import_cute()
    from .kernels.bwd_post import FragmentDqPostprocess

    dt = sig.cute_dtype(dtype)
    rung = spec.load_class()(dtype=dt, head_dim=head_dim, causal=False, varlen=varlen,
                             **spec.config_for(head_dim))
    b, rows, sq, h = (cute.sym_int64() for _ in range(4))
    args = [sig.unit_last(cute, cutlass.Float32, b, rows, h, head_dim, tma=True),
            sig.unit_last(cute, dt, b, sq, h, head_dim, tma=True), cutlass.Float32(1.0),
            # cu_seqlens_q: read only when packed (a 1-element stand-in otherwise)
            sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)]
    return _compile_kernel(FragmentDqPostprocess(rung), args, extra_options)


def get_backward_postprocess(spec, dtype, head_dim, varlen=False):
    """dQ = scale * dQacc in the output dtype, from `spec`'s fragment-order accumulator
    (kernels/bwd_post.py); `varlen`: a packed batch's."""
    fast_key = ("bwd_post", spec.name, dtype, head_dim, varlen)
    fn = _FAST.get(fast_key)
    if fn is None:
        key = ("bwd_post", spec.name, str(dtype), head_dim, varlen,
               tuple(sorted(spec.config_for(head_dim).items())), _dsl.TARGET_ARCH, _dsl.version())
        fn = _FAST[fast_key] = _cached(key, lambda: _build_postprocess(spec, dtype, head_dim, varlen))
    return fn


def _build_value_transpose(head_dim, packed=False, extra_options=""):
    cutlass, cute = _dsl.import_cute()
    from .kernels.fp8_transpose import ValueTranspose

    b, s, h = (cute.sym_int64() for _ in range(3))
    k4 = cute.sym_int64(divisibility=4)  # keys / 4: keys are a multiple of 16
    v = sig.unit_last(cute, cutlass.Int32, b, s, h, head_dim // 4, tma=True)  # tma_ready's strides
    vt = sig.fake_tensor(cute, cutlass.Int32, (b, h, head_dim, k4),
                      (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), k4, 1))
    cu = sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)
    return _compile_kernel(ValueTranspose(head_dim, packed), [v, vt, cu], extra_options)


def get_value_transpose(head_dim, packed=False):
    """The FP8 forward's V^T in the P operand's key order (kernels/fp8_transpose.py); `packed`: a
    packed batch's, each sequence in its own 16-aligned run of columns."""
    fast_key = ("fp8_vt", head_dim, packed)
    fn = _FAST.get(fast_key)
    if fn is None:
        key = ("fp8_vt", head_dim, *(("packed",) if packed else ()), _dsl.TARGET_ARCH, _dsl.version())
        fn = _FAST[fast_key] = _cached(key, lambda: _build_value_transpose(head_dim, packed))
    return fn


# GEMM operand layouts, as torch strides show them: "row" = unit stride along the last dimension
# (a contiguous tensor), "col" = unit stride along the first (a .t() view). Static in the kernel.
GEMM_LAYOUTS = ("row", "col")


def gemm_key(spec, dtype, a_layout, b_layout, out_dtype=None, row_scales=False) -> tuple:
    dtypes = str(dtype) if out_dtype in (None, dtype) else (str(dtype), str(out_dtype))
    return (spec.name, dtypes, a_layout, b_layout, *(("row_scales",) if row_scales else ()),
            tuple(sorted(spec.config.items())), _dsl.TARGET_ARCH, _dsl.version())


def _build_gemm(spec, dtype, a_layout="row", b_layout="row", out_dtype=None, row_scales=False,
                extra_options=""):
    """`dtype`: A's and B's (e4m3: the scaled FP8 GEMM, C in `out_dtype`, per-tensor scales or
    `row_scales`)."""
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), out_dtype=sig.cute_dtype(out_dtype or dtype),
                               row_scales=row_scales, **spec.config)
    return _compile_kernel(kernel, sig.gemm_args(dtype, a_layout, b_layout, out_dtype), extra_options)


def get_gemm(spec, dtype, a_layout, b_layout, tiles: tuple = (), out_dtype=None, row_scales=False):
    """The compiled GEMM for this rung, dtypes and operand layouts (compiled on first use); call it
    as fn(a, b, c, sm_count, workspace, counters, splits, scale_a, scale_b). `tiles`: ((key,
    value), ...) overrides of the rung's config (the tile shape the GEMM heuristic picks per
    problem). Like get_attention, a hit is one dict lookup."""
    fast_key = ("gemm", spec.name, dtype, a_layout, b_layout, tiles, out_dtype, row_scales)
    fn = _FAST.get(fast_key)
    if fn is None:
        if tiles:
            spec = dataclasses.replace(spec, config={**spec.config, **dict(tiles)})
        fn = _FAST[fast_key] = _cached(gemm_key(spec, dtype, a_layout, b_layout, out_dtype, row_scales),
                                       lambda: _build_gemm(spec, dtype, a_layout, b_layout, out_dtype,
                                                           row_scales))
    return fn


# ----------------------------------------------------------------------------- KV cache (S1)
def kvcache_key(spec, dtype, head_dim, causal, paged=False, local=False, softcap=False, gather=False,
                varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0) -> tuple:
    variant = (bool(local), bool(softcap), bool(sinks))
    layout = (bool(gather), bool(varlen), bool(leftpad))  # row gathers, packed queries, left padding
    out = (("out", str(out_dtype)),) if out_dtype not in (None, dtype) else ()
    out += (("max_queries", int(max_queries)),) if max_queries else ()
    return (spec.name, str(dtype), head_dim, bool(causal), bool(paged), *((variant,) if any(variant) else ()),
            *((("gather_varlen_leftpad",) + layout,) if any(layout) else ()), *out,
            tuple(sorted(spec.config_for(head_dim).items())), _dsl.TARGET_ARCH, _dsl.version())


def _build_kvcache(spec, dtype, head_dim, causal, paged=False, local=False, softcap=False, gather=False,
                   varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0, extra_options=""):
    # an FP8 cache (and q): dequantized in SMEM to fp16 for the GEMMs, O in out_dtype (bf16 default)
    fp8 = dtype == torch.float8_e4m3fn
    out_dtype = out_dtype or (torch.bfloat16 if fp8 else dtype)
    cls = spec.load_class()
    if fp8:  # s1 plus dequantization in SMEM
        from .kernels.decode_fp8 import Fp8SplitKVAttention as cls
    kernel = cls(dtype=sig.cute_dtype(torch.float16 if fp8 else dtype), head_dim=head_dim, causal=causal,
                 paged=paged, local=local, softcap=softcap, gather=gather, varlen=varlen, leftpad=leftpad,
                 sinks=sinks, out_dtype=sig.cute_dtype(out_dtype), max_queries=max_queries,
                 **split_plan.kernel_plan(spec, head_dim, paged and gather, fp8))
    return _compile_kernel(kernel, sig.kvcache_args(dtype, head_dim, out_dtype), extra_options)


def get_kvcache(spec, dtype, head_dim, causal, paged, local=False, softcap=False, gather=False,
                varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0):
    """The compiled KV-cache kernel: paged (gather: pages that do not hold whole key blocks) or
    dense (leftpad: keys from cache_leftpad on), packed queries (varlen; max_queries: only entries
    of fewer queries, the rest being K5's) or (batch, seqlen_q) ones, with or without attention
    sinks; `dtype` q's and the cache's (float8_e4m3fn: an FP8 cache, O in out_dtype)."""
    fast_key = ("kvcache", spec.name, dtype, head_dim, causal, paged, local, softcap, gather, varlen, leftpad,
                sinks, out_dtype, max_queries)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(
            kvcache_key(spec, dtype, head_dim, causal, paged, local, softcap, gather, varlen, leftpad, sinks,
                        out_dtype, max_queries),
            lambda: _build_kvcache(spec, dtype, head_dim, causal, paged, local, softcap, gather, varlen,
                                   leftpad, sinks, out_dtype, max_queries))
    return fn


def cache_prefill_key(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False, softcap=False,
                      sinks=False) -> tuple:
    """K5 over a KV cache (kernels/k5_cache.py) on `spec`'s tiles (fa3.cache_prefill's rung)."""
    from .cache_prefill import tiles

    return ("cache_prefill", spec.name, str(dtype), head_dim, bool(causal), bool(paged), int(page_rows),
            int(min_queries), (bool(local), bool(softcap), bool(sinks)),
            tuple(sorted(tiles(head_dim, causal, local).items())), _dsl.TARGET_ARCH, _dsl.version())


def _build_cache_prefill(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False,
                         softcap=False, sinks=False, extra_options=""):
    from .cache_prefill import tiles
    from .kernels.k5_cache import CacheAttention

    kernel = CacheAttention(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal, paged=paged,
                            page_rows=page_rows, min_queries=min_queries, local=local, softcap=softcap,
                            sinks=sinks, **tiles(head_dim, causal, local))
    return _compile_kernel(kernel, sig.cache_prefill_args(dtype, head_dim), extra_options)


def get_cache_prefill(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False, softcap=False,
                      sinks=False):
    """The compiled K5 over a KV cache for a packed call's entries of min_queries or more queries:
    paged (page_rows: pages smaller than a key block, one TMA box each; 0: whole blocks) or dense."""
    static = (head_dim, causal, paged, page_rows, min_queries, local, softcap, sinks)
    fast_key = ("cache_prefill", spec.name, dtype, *static)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(cache_prefill_key(spec, dtype, *static),
                                       lambda: _build_cache_prefill(spec, dtype, *static))
    return fn


def _build_combine(dtype, head_dim, sinks=False, max_queries=0, extra_options=""):
    cutlass, cute = _dsl.import_cute()
    from .kernels.combine import SplitKVCombine

    dt, f32 = sig.cute_dtype(dtype), cutlass.Float32
    b, sq, hq, splits = (cute.sym_int64() for _ in range(4))
    args = [sig.unit_last(cute, f32, splits, b, sq, hq, head_dim), sig.unit_last(cute, f32, splits, b, hq, sq),
            sig.unit_last(cute, dt, b, sq, hq, head_dim, align=2), sig.unit_last(cute, f32, b, hq, sq),
            sig.fake_tensor(cute, f32, (cute.sym_int64(),), (1,), align=4)]
    args.append(sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4))  # cu_seqlens_q
    return _compile_kernel(SplitKVCombine(dt, head_dim, sinks, max_queries), args, extra_options)


def get_combine(dtype, head_dim, sinks=False, max_queries=0):
    """The split-KV combine kernel: FP32 partial O and LSE (and the sinks) -> O, LSE; max_queries:
    a packed call's rows of entries that long or longer are skipped (K5 writes them)."""
    fast_key = ("combine", dtype, head_dim, sinks, max_queries)
    fn = _FAST.get(fast_key)
    if fn is None:
        fn = _FAST[fast_key] = _cached(combine_key(dtype, head_dim, sinks, max_queries),
                                       lambda: _build_combine(dtype, head_dim, sinks, max_queries))
    return fn


def combine_key(dtype, head_dim, sinks=False, max_queries=0) -> tuple:
    # (the key names the cu_seqlens_q argument: entries cached before it took one are not loaded)
    return ("combine", str(dtype), head_dim, bool(sinks), ("cu_seqlens_q", int(max_queries)), _dsl.TARGET_ARCH,
            _dsl.version())


def _build_entry_order(extra_options=""):
    cutlass, cute = _dsl.import_cute()
    from .kernels.entry_order import EntryOrder

    args = [sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4),
            sig.fake_tensor(cute, cutlass.Int64, (cute.sym_int64(),), (1,), align=8), cutlass.Int32(1)]
    return _compile_kernel(EntryOrder(), args, extra_options)


def get_entry_order():
    """The KV-cache entries longest first (kernels/entry_order.py): (lengths int32, order int64,
    max_length)."""
    fn = _FAST.get("entry_order")
    if fn is None:
        fn = _FAST["entry_order"] = _cached(entry_order_key(), _build_entry_order)
    return fn


def entry_order_key() -> tuple:
    return ("entry_order", _dsl.TARGET_ARCH, _dsl.version())


def kvcache_companions(spec, dtype, head_dim, causal) -> list[tuple[str, tuple, object]]:
    """(label, key, build) of the kernels a call against a KV cache launches beside `spec` (s1),
    for `python -m fa3 compile --warm-cache`: the split-KV combine, the entries' sort and, for a
    16-bit cache, K5 over the cache for a packed call's prompt chunks (dense or pages holding whole
    key blocks, and pages of 16 rows) with the combine that skips K5's rows. `dtype`: the cache's."""
    from . import cache_prefill

    out_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    items = [("combine", combine_key(out_dtype, head_dim), lambda: _build_combine(out_dtype, head_dim)),
             ("entry order", entry_order_key(), _build_entry_order)]
    min_queries = spec.config.get("long_queries", 0)
    if dtype == torch.float8_e4m3fn or not min_queries:
        return items
    items.append(("combine skipping K5's rows", combine_key(dtype, head_dim, max_queries=min_queries),
                  lambda: _build_combine(dtype, head_dim, max_queries=min_queries)))
    tile_n = cache_prefill.tiles(head_dim, causal, False)["tile_n"]
    layouts = []  # (paged, page_rows) for a dense cache, whole-block pages, and vLLM's 16 and 64
    for page_size in (None, tile_n, 16, 64):
        p = cache_prefill.plan(spec, head_dim, page_size, min_queries, causal, False, True, False, False)
        if p is not None and (p.paged, p.page_rows) not in layouts:
            layouts.append((p.paged, p.page_rows))
    rung = registry.get(cache_prefill.RUNG)
    for paged, page_rows in layouts:
        static = (head_dim, causal, paged, page_rows, min_queries)
        label = "K5 over the cache, " + ("dense" if not paged else f"pages of {page_rows} rows" if page_rows
                                         else f"pages of a multiple of {tile_n} rows")
        items.append((label, cache_prefill_key(rung, dtype, *static),
                      lambda static=static: _build_cache_prefill(rung, dtype, *static)))
    return items


@dataclass
class CompileReport:
    ptx: str
    cubin: bytes
    ptxas_log: str

    @property
    def registers(self) -> list[int]:
        return [int(r) for r in re.findall(r"Used (\d+) registers", self.ptxas_log)]

    @property
    def spill_bytes(self) -> int:
        return sum(int(a) + int(b) for a, b in
                   re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.ptxas_log))

    @property
    def serialized_wgmma(self) -> bool:
        """ptxas' C7512: it serialized the wgmma.mma_async instructions for lack of registers (each
        waits for the previous one: the asynchrony the kernel is built around is gone)."""
        return "C7512" in self.ptxas_log or "wgmma.mma_async instructions are serialized" in self.ptxas_log

    def summary(self) -> str:
        lines = [line.split("info    :")[-1].strip() for line in self.ptxas_log.splitlines()
                 if "registers" in line or "spill" in line]
        return "\n".join(lines)


def compile_report(spec, dtype=torch.bfloat16, **static) -> CompileReport:
    """Compile for sm_90a (no GPU needed) and return the PTX, the cubin and ptxas' resource report.

    `static` is what the family's builder takes (attention: head_dim, causal; GEMM: a_layout,
    b_layout, "row" by default)."""
    return build_report(BUILDERS[spec.family], spec, dtype, **static)


def build_report(build, *args, **kwargs) -> CompileReport:
    """Any builder of this module (a `_build_*`: main kernels and their helpers, the backward's
    pre/postprocess, the combine, ...) run for sm_90a with PTX and cubin kept, and ptxas' report."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        fn = build(*args, **kwargs, extra_options="--keep-ptx --keep-cubin remarks{ptx}")
    return CompileReport(ptx=fn.artifacts.PTX, cubin=fn.artifacts.CUBIN, ptxas_log=buf.getvalue())


# family -> builder(spec, dtype, **static, extra_options) -> compiled function
BUILDERS = {registry.ATTENTION: _build_attention, registry.ATTENTION_FP8: _build_attention_fp8,
            registry.GEMM: _build_gemm,
            registry.BACKWARD: _build_backward, registry.KVCACHE: _build_kvcache}
# family -> key(spec, dtype, **static): the compile-cache key, with the builder's static arguments
KEYS = {registry.ATTENTION: attention_key, registry.ATTENTION_FP8: attention_fp8_key,
        registry.GEMM: gemm_key, registry.BACKWARD: backward_key,
        registry.KVCACHE: kvcache_key}


def fill_disk_cache(spec, dtype=torch.bfloat16, **static):
    """Compile into the disk cache unless a valid entry is there (no GPU needed: for deployments).
    Returns (entry path or None if the cache is off or unwritable, whether it compiled)."""
    _dsl.pin_target_arch()  # before anything imports cutlass
    return fill_disk_cache_entry(KEYS[spec.family](spec, dtype, **static),
                                 lambda: BUILDERS[spec.family](spec, dtype, **static))


def fill_disk_cache_entry(key, build):
    """fill_disk_cache for any key and its builder (a rung's companion kernels: kvcache_companions)."""
    _dsl.pin_target_arch()  # before anything imports cutlass
    path = _disk_cache.has(key)
    if path is not None:
        return path, False
    return _disk_cache.save(key, build()), True
