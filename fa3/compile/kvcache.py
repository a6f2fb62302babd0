"""The KV-cache family's kernels: keys, builders and getters of S1 (kernels/decode.py), K5 over the
cache for a packed call's prompt chunks (kernels/k5_cache.py), the split-KV combine (alone for MLA;
compiled into S1's call otherwise: kernels/combine.SplitKVWithCombine) and the
entries' sort (kernels/entry_order.py), and what --warm-cache fills beside S1. The shared compile
machinery is compile/core.py; the other families are compile/builders.py.
"""

from __future__ import annotations

import torch

from . import core
from . import dsl
from .. import registry
from ..cache import split_plan
from . import signatures as sig
from ..kernels import config


WARP_PAGE_ROWS = 16  # S2's keys a warp of a block: a page of this many rows is one warp's (warp_pages)


def gather_layout(spec, dtype, gather: bool, page_size) -> bool | int:
    """The `gather` argument of get_kvcache for a call: False (TMA boxes), True (row gathers of any
    page size), or WARP_PAGE_ROWS where S2 reads an FP8 cache in pages of that many rows, each
    warp gathering its own page (kernels/decode.py's warp_pages)."""
    if gather and page_size == WARP_PAGE_ROWS and spec.config.base.warp_split and dtype == torch.float8_e4m3fn:
        return WARP_PAGE_ROWS
    return bool(gather)


def _warp_pages(spec, dtype, paged, gather) -> bool:
    """gather_layout's page-a-warp variant (True == 1 is not it)."""
    return bool(paged) and gather is not True and gather == WARP_PAGE_ROWS and spec.config.base.warp_split \
        and dtype == torch.float8_e4m3fn


def _decode_config(spec, dtype, head_dim, paged, gather):
    warp_pages = {"warp_pages": True} if _warp_pages(spec, dtype, paged, gather) else {}
    return config.decode_config(spec.config, head_dim, gather=bool(paged and gather),
                                fp8=dtype == torch.float8_e4m3fn, **warp_pages)


def kvcache_key(spec, dtype, head_dim, causal, paged=False, local=False, softcap=False, gather=False,
                varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0, query_dtype=None,
                with_combine=False) -> tuple:
    variant = (bool(local), bool(softcap), bool(sinks))
    layout = (bool(gather), bool(varlen), bool(leftpad))  # row gathers, packed queries, left padding
    out = (("out", str(out_dtype)),) if out_dtype not in (None, dtype) else ()
    out += (("max_queries", int(max_queries)),) if max_queries else ()
    out += (("query", str(query_dtype)),) if query_dtype not in (None, dtype) else ()
    out += (("with_combine",),) if with_combine else ()
    out += (("warp_pages", WARP_PAGE_ROWS),) if _warp_pages(spec, dtype, paged, gather) else ()
    return (spec.name, str(dtype), head_dim, bool(causal), bool(paged), *((variant,) if any(variant) else ()),
            *((("gather_varlen_leftpad",) + layout,) if any(layout) else ()), *out,
            config.key(spec.config, _decode_config(spec, dtype, head_dim, paged, gather)), dsl.TARGET_ARCH,
            dsl.version())


def build_kvcache(spec, dtype, head_dim, causal, paged=False, local=False, softcap=False, gather=False,
                   varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0, query_dtype=None,
                   with_combine=False, extra_options=""):
    # an FP8 cache: dequantized in SMEM to fp16 for the GEMMs; q e4m3 (query_dtype None) with O in
    # out_dtype (bf16 default), or bf16 / fp16 with O in out_dtype (q's default)
    fp8 = dtype == torch.float8_e4m3fn
    query_dtype = query_dtype or dtype
    out_dtype = out_dtype or (torch.bfloat16 if query_dtype == torch.float8_e4m3fn else query_dtype)
    # (16-bit q only over an FP8 cache: a 16-bit cache takes q of its own dtype)
    sixteen_bit_q = {"query_dtype": sig.cute_dtype(query_dtype)} if query_dtype != dtype else {}
    kernel = spec.load_class()(dtype=sig.cute_dtype(torch.float16 if fp8 else dtype), head_dim=head_dim,
                               causal=causal, config=_decode_config(spec, dtype, head_dim, paged, gather),
                               paged=paged, local=local, softcap=softcap, gather=bool(gather),
                               varlen=varlen, leftpad=leftpad, sinks=sinks, out_dtype=sig.cute_dtype(out_dtype),
                               max_queries=max_queries, fp8=fp8, **sixteen_bit_q,
                               **({"page_rows": WARP_PAGE_ROWS} if _warp_pages(spec, dtype, paged, gather) else {}))
    if with_combine:  # one host function launching the kernel and then the combine of its partials
        from ..kernels.combine import SplitKVCombine, SplitKVWithCombine

        kernel = SplitKVWithCombine(kernel, SplitKVCombine(sig.cute_dtype(out_dtype), head_dim, sinks, max_queries))
    args = sig.kvcache_args(dtype, head_dim, out_dtype, query_dtype, paged=paged, varlen=varlen, leftpad=leftpad,
                            sinks=sinks)
    return core.compile_kernel(kernel, args, extra_options)


def get_kvcache(spec, dtype, head_dim, causal, paged, local=False, softcap=False, gather=False,
                varlen=False, leftpad=False, sinks=False, out_dtype=None, max_queries=0, query_dtype=None,
                with_combine=False):
    """The compiled KV-cache kernel: paged (gather: pages that do not hold whole key blocks) or
    dense (leftpad: keys from cache_leftpad on), packed queries (varlen; max_queries: only entries
    of fewer queries, the rest being K5's) or (batch, seqlen_q) ones, with or without attention
    sinks; `dtype` the cache's and q's (float8_e4m3fn: an FP8 cache, O in out_dtype), or q's
    query_dtype where it differs (bf16 / fp16 q over an FP8 cache). with_combine: the kernel and
    the split-KV combine of its partials in one call (kernels/combine.SplitKVWithCombine), for
    calls of more than one partial a row."""
    static = (head_dim, causal, paged, local, softcap, gather, varlen, leftpad, sinks, out_dtype, max_queries,
              query_dtype, with_combine)
    return core.compiled(("kvcache", spec.name, dtype, *static), kvcache_key, build_kvcache, spec, dtype, *static)


def cache_prefill_key(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False, softcap=False,
                      sinks=False) -> tuple:
    """K5 over a KV cache (kernels/k5_cache.py) on `spec`'s tiles (fa3.cache.prefill's rung)."""
    cfg = config.cache_prefill_config(spec.config, head_dim, causal=bool(causal), local=bool(local),
                                      page_rows=int(page_rows))
    return ("cache_prefill", spec.name, str(dtype), head_dim, bool(causal), bool(paged), int(page_rows),
            int(min_queries), (bool(local), bool(softcap), bool(sinks)), config.key(spec.config, cfg),
            dsl.TARGET_ARCH, dsl.version())


def build_cache_prefill(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False,
                         softcap=False, sinks=False, extra_options=""):
    from ..kernels.k5_cache import CacheAttention

    cfg = config.cache_prefill_config(spec.config, head_dim, causal=bool(causal), local=bool(local),
                                      page_rows=int(page_rows))
    kernel = CacheAttention(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal, config=cfg,
                            paged=paged, page_rows=page_rows, min_queries=min_queries, local=local,
                            softcap=softcap, sinks=sinks)
    return core.compile_kernel(kernel, sig.cache_prefill_args(dtype, head_dim), extra_options)


def get_cache_prefill(spec, dtype, head_dim, causal, paged, page_rows, min_queries, local=False, softcap=False,
                      sinks=False):
    """The compiled K5 over a KV cache for a packed call's entries of min_queries or more queries:
    paged (page_rows: pages smaller than a key block, one TMA box each; 0: whole blocks) or dense."""
    static = (head_dim, causal, paged, page_rows, min_queries, local, softcap, sinks)
    return core.compiled(("cache_prefill", spec.name, dtype, *static), cache_prefill_key, build_cache_prefill,
                         spec, dtype, *static)


def build_combine(dtype, head_dim, sinks=False, max_queries=0, extra_options=""):
    cutlass, cute = dsl.import_cute()
    from ..kernels.combine import SplitKVCombine

    dt, f32 = sig.cute_dtype(dtype), cutlass.Float32
    b, sq, hq, splits = (cute.sym_int64() for _ in range(4))
    args = [sig.unit_last(cute, f32, splits, b, sq, hq, head_dim), sig.unit_last(cute, f32, splits, b, hq, sq),
            sig.unit_last(cute, dt, b, sq, hq, head_dim, align=2), sig.unit_last(cute, f32, b, hq, sq),
            sig.fake_tensor(cute, f32, (cute.sym_int64(),), (1,), align=4)]
    args.append(sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4))  # cu_seqlens_q
    return core.compile_kernel(SplitKVCombine(dt, head_dim, sinks, max_queries), args, extra_options)


def get_combine(dtype, head_dim, sinks=False, max_queries=0):
    """The split-KV combine kernel: FP32 partial O and LSE (and the sinks) -> O, LSE; max_queries:
    a packed call's rows of entries that long or longer are skipped (K5 writes them)."""
    return core.compiled(("combine", dtype, head_dim, sinks, max_queries), combine_key, build_combine, dtype,
                         head_dim, sinks, max_queries)


def combine_key(dtype, head_dim, sinks=False, max_queries=0) -> tuple:
    # (the key names the cu_seqlens_q argument: entries cached before it took one are not loaded)
    return ("combine", str(dtype), head_dim, bool(sinks), ("cu_seqlens_q", int(max_queries)), dsl.TARGET_ARCH,
            dsl.version())


def build_entry_order(extra_options=""):
    cutlass, cute = dsl.import_cute()
    from ..kernels.entry_order import EntryOrder

    args = [sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4),
            sig.fake_tensor(cute, cutlass.Int64, (cute.sym_int64(),), (1,), align=8), cutlass.Int32(1)]
    return core.compile_kernel(EntryOrder(), args, extra_options)


def get_entry_order():
    """The KV-cache entries longest first (kernels/entry_order.py): (lengths int32, order int64,
    max_length)."""
    return core.compiled("entry_order", entry_order_key, build_entry_order)


def entry_order_key() -> tuple:
    return ("entry_order", dsl.TARGET_ARCH, dsl.version())


def kvcache_companions(spec, dtype, head_dim, causal) -> list[tuple[str, tuple, object]]:
    """(label, key, build) of the kernels a call against a KV cache launches beside `spec` (s1),
    for `python -m fa3 compile --warm-cache`: the entries' sort and, for a 16-bit cache, K5 over
    the cache for a packed call's prompt chunks (dense, pages holding whole key blocks, pages of 16
    and 64 rows). (The split-KV combine is compiled with the rung: cache_configs' with_combine.)"""
    items = [("entry order", entry_order_key(), build_entry_order)]
    min_queries = spec.config.base.long_queries
    if dtype == torch.float8_e4m3fn or not min_queries:
        return items
    tile_n = split_plan.prefill_config(head_dim, causal, False).tile_n
    layouts = []  # (paged, page_rows) for a dense cache, whole-block pages, and vLLM's 16 and 64
    for page_size in (None, tile_n, 16, 64):
        p = split_plan.prefill_plan(spec, head_dim, page_size, min_queries, causal, False, True, False, False)
        if p is not None and (p.paged, p.page_rows) not in layouts:
            layouts.append((p.paged, p.page_rows))
    rung = registry.get(split_plan.PREFILL_RUNG)
    for paged, page_rows in layouts:
        static = (head_dim, causal, paged, page_rows, min_queries)
        label = "K5 over the cache, " + ("dense" if not paged else f"pages of {page_rows} rows" if page_rows
                                         else f"pages of a multiple of {tile_n} rows")
        items.append((label, cache_prefill_key(rung, dtype, *static),
                      lambda static=static: build_cache_prefill(rung, dtype, *static)))
    return items
