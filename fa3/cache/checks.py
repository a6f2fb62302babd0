"""The arguments of a call against a KV cache, checked before anything launches or is written
(fa3.attention_with_kvcache, fa3.attention_varlen over a cache, and their custom ops): tensors,
shapes, strides, dtypes (an FP8 cache, FP8 or 16-bit q over it, its descales), the cache's layout
(dense or paged), new tokens to append, packed queries and appends, left padding, and host
lengths. The index values on the device (lengths, page indices, offsets) are fa3/index_checks.py's.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch, _launch, index_checks, masking, registry


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, kernel, window_size, softcap,
                  cu_seqlens_q=None, max_seqlen_q=None, lengths_name="cache_seqlens", cache_leftpad=None,
                  cu_seqlens_k_new=None):
    """The arguments of a call against a KV cache (attention_with_kvcache; attention_varlen over a
    cache, whose lengths are `seqused_k`: `lengths_name`); returns (spec, the lengths as an int32
    tensor, capacity, new tokens of every sequence (0 for packed appends), max_seqlen_q). Packed
    queries (cu_seqlens_q given): q is (total_q, heads_q, d) and max_seqlen_q defaults to total_q
    (a bound that needs no sync). Packed appends (cu_seqlens_k_new given): k and v are (total_new,
    heads_kv, d), sequence b's rows [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1])."""
    packed = cu_seqlens_q is not None
    packed_new = cu_seqlens_k_new is not None
    dtypes = cache_dtypes = _checks.SUPPORTED_DTYPES
    if getattr(q, "dtype", None) in _checks.FP8_LIKE:
        dtypes = cache_dtypes = _checks.FP8_DTYPES  # FP8 q: q, k_cache and v_cache all e4m3
    elif getattr(k_cache, "dtype", None) in _checks.FP8_LIKE:
        cache_dtypes = _checks.FP8_DTYPES  # bf16 / fp16 q over an FP8 cache (dequantized in the kernel)
    _checks.check_tensor(q, "q", 3 if packed else 4, dtypes=dtypes)
    _checks.check_tensor(k_cache, "k_cache", 4, q.dtype if cache_dtypes is dtypes else None, dtypes=cache_dtypes)
    _checks.check_tensor(v_cache, "v_cache", 4, k_cache.dtype, dtypes=cache_dtypes)
    if packed:
        (total_q, heads_q, head_dim), seqlen_q = q.shape, None
        _checks.check_offsets(cu_seqlens_q, "cu_seqlens_q", q.device)
        batch = cu_seqlens_q.shape[0] - 1
        max_seqlen_q = packed_max_seqlen_q(max_seqlen_q, total_q)
    else:
        batch, seqlen_q, heads_q, head_dim = q.shape
    masking.check_window(window_size, softcap)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have "
                         "the same shape")
    planes, rows, heads_kv, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has {cache_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} must be a multiple of the cache's heads_kv={heads_kv}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device or not _launch.tma_aligned(t):  # (in 16 bytes, not 8 elements: FP8 too)
            raise ValueError(f"{name} must be on {q.device} with a 16-byte aligned base and strides "
                             "(the kernel reads it with TMA and the cache is updated in place, so fa3 "
                             f"cannot copy it): allocate it with torch.empty(...) contiguous")
    capacity = cache_capacity(block_table, planes, rows, batch, packed, q.device)
    appended = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new tokens to append), or neither")
    if packed_new and k is None:
        raise ValueError("cu_seqlens_k_new holds the offsets of packed new k and v: pass k and v "
                         "(total_new, heads_kv, head_dim), or leave cu_seqlens_k_new at None")
    if k is not None:
        if packed and not packed_new:
            raise NotImplementedError("new k/v beside cu_seqlens_q (packed queries) are packed too: pass "
                                      "k and v as (total_new, heads_kv, head_dim) with their offsets "
                                      "cu_seqlens_k_new, or write the new tokens into the cache first")
        if cache_dtypes is dtypes:
            _checks.check_tensor(k, "k", 3 if packed_new else 4, q.dtype, dtypes=dtypes)
            _checks.check_tensor(v, "v", 3 if packed_new else 4, q.dtype, dtypes=dtypes)
        else:
            check_new_for_fp8_cache(q, k, v, 3 if packed_new else 4)
        if packed_new:
            _checks.check_offsets(cu_seqlens_k_new, "cu_seqlens_k_new", q.device, batch=batch,
                                  batch_source="cu_seqlens_q" if packed else "q.shape[0]")
            if k.shape != v.shape or k.shape[1:] != (heads_kv, head_dim):
                raise ValueError(f"k and v with cu_seqlens_k_new must both be (total_new, heads_kv={heads_kv}, "
                                 f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        elif k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != (heads_kv, head_dim):
            raise ValueError(f"k and v must both be (batch={batch}, new_tokens, heads_kv={heads_kv}, "
                             f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        appended = 0 if packed_new else k.shape[1]
        check_new_tokens(q, k, v, appended, capacity, block_table, planes)
        _checks.check_no_overlap(v_cache, "v_cache", (("k_cache", k_cache),),
                                 "appending the new k and v would write one over the other")
    cache_seqlens = seqlens_tensor(cache_seqlens, batch, q.device, capacity, appended, block_table, rows,
                                    lengths_name)
    if cache_leftpad is not None:
        if block_table is not None or packed or packed_new:
            raise NotImplementedError("cache_leftpad is for a dense cache with (batch, seqlen_q) queries (as in "
                                      "flash-attn): not with block_table, cu_seqlens_q or cu_seqlens_k_new")
        if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32 \
                or cache_leftpad.shape != (batch,) or cache_leftpad.device != q.device:
            raise ValueError(f"cache_leftpad must be an int32 tensor of shape (batch={batch},) on {q.device}, got "
                             f"{getattr(cache_leftpad, 'dtype', type(cache_leftpad).__name__)} "
                             f"{tuple(getattr(cache_leftpad, 'shape', ()))}: use .to(torch.int32)")
    rows = (seqlen_q if not packed else max_seqlen_q) * (heads_q // heads_kv)  # a KV head's query rows
    spec = _dispatch.memo_rung(_dispatch.cache_rung, kernel, head_dim, rows, block_table is not None,
                               cache_dtypes is not dtypes or q.dtype in _checks.FP8_DTYPES)
    _checks.check_hopper(q.device, "q")
    return spec, cache_seqlens, capacity, appended, seqlen_q if not packed else max_seqlen_q


def packed_max_seqlen_q(max_seqlen_q, total_q: int) -> int:
    """max_seqlen_q of packed queries: total_q where None (a bound that needs no sync), else an int
    >= 0 (refused by name otherwise)."""
    if max_seqlen_q is None:
        return total_q
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be an int >= 0 (the longest entry of cu_seqlens_q), got "
                         f"{max_seqlen_q!r}; pass None to use q.shape[0]")
    return max_seqlen_q


def cache_capacity(block_table, planes: int, rows: int, batch: int, packed: bool, device) -> int:
    """The keys a sequence can hold: a dense cache's rows (its planes one per batch entry), or the
    block table's pages x rows (check_block_table)."""
    if block_table is None:
        if planes != batch:
            raise ValueError(f"a dense k_cache must have batch {batch} ({'cu_seqlens_q' if packed else 'q'}'s)"
                             f" in dimension 0, got {planes}; for a paged cache pass block_table")
        return rows
    return check_block_table(block_table, batch, rows, device)


def check_block_table(block_table, batch: int, page_size: int, device) -> int:
    """A paged cache's block_table: int32 (batch, max_pages) on `device`, contiguous rows, beside
    pages of at least one row. Returns the capacity, max_pages x page_size."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
            or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be an int32 tensor of shape (batch={batch}, max_pages), "
                         f"got {getattr(block_table, 'dtype', type(block_table))} "
                         f"{tuple(getattr(block_table, 'shape', ()))}: use .to(torch.int32)")
    if block_table.device != device or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be on {device} and contiguous in its last dimension")
    if page_size == 0:
        raise ValueError("page_size = k_cache.shape[1] = 0: a paged cache is (num_pages, page_size, "
                         "heads_kv, head_dim) with pages of at least one token")
    return block_table.shape[1] * page_size


def check_new_for_fp8_cache(q, k, v, ndim: int) -> None:
    """New k and v for an FP8 cache beside bf16 / fp16 q: both in q's dtype (quantized into the
    cache with k_descale and v_descale) or both float8_e4m3fn (written as they are)."""
    allowed = (q.dtype,) + _checks.FP8_DTYPES
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype not in allowed:
            raise TypeError(f"{name} has dtype {t.dtype}; new k and v for an FP8 cache are q's dtype ({q.dtype}: "
                            "quantized into the cache with k_descale and v_descale) or torch.float8_e4m3fn "
                            f"(written as they are): pass {name}.to({q.dtype})")
    _checks.check_tensor(k, "k", ndim, dtypes=allowed)
    _checks.check_tensor(v, "v", ndim, dtypes=allowed)
    if v.dtype != k.dtype:
        raise TypeError(f"k has dtype {k.dtype} but v has {v.dtype}: pass the new k and v in one dtype")


def check_descales(q, k_cache, descales, batch: int, heads_kv: int):
    """An FP8 cache's (q_descale, k_descale, v_descale) as the kernel takes them (float32 (batch,
    heads_kv) each; None or one element broadcast), q_descale None for bf16 / fp16 q (which takes
    none); None for a 16-bit cache, which takes no descales."""
    if k_cache.dtype not in _checks.FP8_DTYPES:
        if any(t is not None for t in descales):
            raise ValueError(f"q_descale, k_descale and v_descale apply to an FP8 cache (float8_e4m3fn "
                             f"k_cache and v_cache); the cache has dtype {k_cache.dtype}: drop the descales")
        return None
    names = ("q_descale", "k_descale", "v_descale")
    if q.dtype not in _checks.FP8_DTYPES:
        if descales[0] is not None:
            raise ValueError(f"q_descale applies to FP8 queries, and q has dtype {q.dtype} (the kernel reads "
                             "it as it is over the FP8 cache): drop q_descale, or pass FP8 queries "
                             "(q8, q_descale = fa3.quantize_fp8(q))")
        return (None,) + tuple(_checks.check_descale(t, name, batch, heads_kv, q.device)
                               for t, name in zip(descales[1:], names[1:]))
    return tuple(_checks.check_descale(t, name, batch, heads_kv, q.device) for t, name in zip(descales, names))


def check_out_dtype(out_dtype, q, descales) -> None:
    """The op's out_dtype: bf16 or fp16 with an FP8 cache (None: bf16), q's dtype (or None) otherwise."""
    allowed = _checks.SUPPORTED_DTYPES if descales is not None else (q.dtype,)
    if out_dtype is not None and out_dtype not in allowed:
        cache = "an FP8 cache" if descales is not None else f"a {q.dtype} cache"
        raise TypeError(f"out_dtype={out_dtype}: {cache} writes {' or '.join(map(str, allowed))}; pass one "
                        "of those, or None")


def seqlens_tensor(cache_seqlens, batch, device, capacity, appended, block_table, page_size,
                    name="cache_seqlens"):
    if cache_seqlens is None:
        raise ValueError(f"{name} is required: int32 (batch={batch},), the keys each sequence holds in "
                         "the cache")
    if isinstance(cache_seqlens, int):  # a host value: checked in every call
        index_checks.check_cache_lengths([cache_seqlens], capacity, appended, block_table, page_size,
                                         indexed=False, lengths_name=name)
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or cache_seqlens.shape != (batch,):
        raise ValueError(f"{name} must be an int or an int32 tensor of shape (batch={batch},), "
                         f"got {getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                         f"{tuple(getattr(cache_seqlens, 'shape', ()))}: use .to(torch.int32)")
    if cache_seqlens.device != device:
        raise ValueError(f"{name} is on {cache_seqlens.device} but q is on {device}")
    return cache_seqlens.contiguous()


MLA_DIMS = "q and k_cache (the rotary part) 64 wide, qv and v_cache (the latent) 512 wide (DeepSeek-V2/V3)"


def check_mla(q, qv, k_cache, v_cache, k, v, cache_seqlens, block_table, kernel, cu_seqlens_q=None,
              max_seqlen_q=None, lengths_name="cache_seqlens"):
    """The arguments of an MLA call (`qv` given: scores q k^T + qv v^T over a latent cache, out
    P v): q (batch, seqlen_q, heads_q, d) or packed (total_q, heads_q, d) with cu_seqlens_q, qv
    the same with v's head dim; k_cache (planes, rows, heads_kv, d) and v_cache (..., d_v) with
    their own strides (views of one cache), dense or paged by block_table with pages of any size
    (a multiple of the kernel's key block: TMA boxes; any other: row gathers); optional new k, v
    (batch, new_tokens, heads_kv, d / d_v). Packed queries hold up to max_seqlen_q queries an
    entry (None: total_q); uniform ones (total_q = batch x max_seqlen_q: a decode step, a
    fixed-length speculative verify) the kernel reads as (batch, max_seqlen_q), others by
    cu_seqlens_q (fa3.mla.is_ragged). Returns (spec, the lengths as an int32 tensor, capacity, new
    tokens, batch, seqlen_q: max_seqlen_q when packed)."""
    packed = cu_seqlens_q is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("qv", qv)):
        if getattr(t, "dtype", None) in _checks.FP8_LIKE:
            raise NotImplementedError(f"{name} is {t.dtype}: MLA (qv=) over an FP8 cache or with FP8 queries "
                                      "is not implemented yet; pass bf16 / fp16 q, qv and caches")
    _checks.check_tensor(q, "q", 3 if packed else 4)
    _checks.check_tensor(qv, "qv", q.dim(), q.dtype)
    _checks.check_tensor(k_cache, "k_cache", 4, q.dtype)
    _checks.check_tensor(v_cache, "v_cache", 4, q.dtype)
    if qv.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"qv {tuple(qv.shape)} must match q {tuple(q.shape)} in every dimension but the last "
                         "(qv is the absorbed, latent-wide part of the same queries)")
    if qv.device != q.device:
        raise ValueError(f"qv is on {qv.device} but q is on {q.device}; put them on one GPU")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                         "(planes, rows, heads_kv); only their head dims differ under qv")
    if k_cache.shape[3] != q.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k_cache has {k_cache.shape[3]}: q multiplies the "
                         "cached keys (MLA's rotary part)")
    if v_cache.shape[3] != qv.shape[-1]:
        raise ValueError(f"qv has head_dim {qv.shape[-1]} but v_cache has {v_cache.shape[3]}: qv multiplies the "
                         "cached latent v, so their head dims must be equal")
    spec = _dispatch.memo_rung(mla_rung, kernel)
    cfg = spec.config.base
    if (q.shape[-1], qv.shape[-1]) != (cfg.head_dim, cfg.head_dim_v):
        raise NotImplementedError(f"q and qv have head dims {q.shape[-1]} and {qv.shape[-1]}: MLA decode is "
                                  f"compiled for {MLA_DIMS}")
    planes, rows, heads_kv, _ = k_cache.shape
    heads_q = q.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} must be a multiple of the cache's heads_kv={heads_kv}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device or not _launch.tma_aligned(t):
            raise ValueError(f"{name} must be on {q.device} with a 16-byte aligned base and strides (the "
                             "kernel reads it with TMA and fa3 cannot copy a cache): allocate it with "
                             "torch.empty(...), or slice it from one such tensor")
    if packed:
        _checks.check_offsets(cu_seqlens_q, "cu_seqlens_q", q.device)
        batch, total_q = cu_seqlens_q.shape[0] - 1, q.shape[0]
        max_seqlen_q = packed_max_seqlen_q(max_seqlen_q, total_q)
        seqlen_q = max_seqlen_q
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
    capacity = cache_capacity(block_table, planes, rows, batch, packed, q.device)
    appended = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new tokens to append), or neither")
    if k is not None:
        if packed:
            raise NotImplementedError("new k/v beside cu_seqlens_q under qv are not implemented: write the new "
                                      "tokens into the cache first, or pass (batch, seqlen_q) queries")
        _checks.check_tensor(k, "k", 4, q.dtype)
        _checks.check_tensor(v, "v", 4, q.dtype)
        if k.shape != (batch, k.shape[1], heads_kv, k_cache.shape[3]) or \
                v.shape != (batch, k.shape[1], heads_kv, v_cache.shape[3]):
            raise ValueError(f"k and v must be (batch={batch}, new_tokens, heads_kv={heads_kv}, {k_cache.shape[3]}) "
                             f"and (..., {v_cache.shape[3]}) (k_cache's and v_cache's head dims), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        appended = k.shape[1]
        check_new_tokens(q, k, v, appended, capacity, block_table, planes)
    cache_seqlens = seqlens_tensor(cache_seqlens, batch, q.device, capacity, appended, block_table, rows,
                                   lengths_name)
    _checks.check_hopper(q.device, "q")
    return spec, cache_seqlens, capacity, appended, batch, seqlen_q


def check_new_tokens(q, k, v, appended: int, capacity: int, block_table, planes: int):
    """New tokens to append (k and v, shapes checked): on q's device, `appended` of them a sequence
    fitting its `capacity`, and a paged cache with pages to write them into (`planes`: its pages)."""
    if k.device != q.device or v.device != q.device:
        name, t = ("k", k) if k.device != q.device else ("v", v)
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; put them on one GPU")
    if appended > capacity:
        raise ValueError(f"{appended} new tokens do not fit a cache of {capacity} per sequence")
    if block_table is not None and k.shape[0] * k.shape[1] and planes == 0:
        raise ValueError("k_cache has no pages (shape[0] = 0): the new tokens have nowhere to go")


def mla_rung(kernel):
    """The MLA rung `kernel` (None: the fastest), checked to be one."""
    if kernel is None:
        return registry.fastest(registry.MLA)
    spec = registry.get(kernel)
    if spec.family != registry.MLA:
        raise ValueError(f"kernel={kernel!r} is a {spec.family} rung; with qv the kernel is an MLA rung: "
                         f"{registry.available_kernels(registry.MLA)} (or None)")
    return spec
