"""fa3.attention_with_kvcache: decode (and short appends) against a dense or paged KV cache, and
packed variable-length queries over such a cache (fa3.attention_varlen with block_table/seqused_k).

flash-attn's `flash_attn_with_kvcache` conventions: q (batch, seqlen_q, heads_q, d); a dense cache
(batch, capacity, heads_kv, d) or a paged one (num_pages, page_size, heads_kv, d), any page size,
with `block_table` (batch, max_pages) int32; new k/v are written into the cache at `cache_seqlens`
(in place) before attending. Packed queries (total_q, heads_q, d) with int32 `cu_seqlens_q` mix
any lengths (a decode is a one-token entry; causal aligns each entry to the bottom right of its
own keys). The kernel (kernels/decode.py) packs the query heads of each KV head into one tile and
splits the key range across CTAs; `num_splits=0` picks the split count from shapes alone
(fa3.split_plan: no host sync, so CUDA graphs capture the call).

An FP8 cache: q, k_cache and v_cache in float8_e4m3fn with q/k/v_descale (batch, heads_kv) float32
(vLLM's and SGLang's call; one element for a whole tensor); the kernel dequantizes each K/V tile
in SMEM, so the cache is read at one byte an element; out is bf16 (or out='s dtype).

Eager calls check the values of cache_seqlens and block_table on the host (fa3.index_checks: one
small copy); captured and traced calls cannot, and rely on clamping: the kernel clamps lengths to
[0, capacity] and page indices to [0, num_pages), fa3.cache_append the append's positions.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _compile_kvcache, _dispatch, _launch, cache_prefill, index_checks, masking, registry
from .cache_append import append_packed, append_to_cache
from .split_plan import call_plan


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
    dtypes = _checks.SUPPORTED_DTYPES
    if getattr(q, "dtype", None) in _checks.FP8_LIKE or getattr(k_cache, "dtype", None) in _checks.FP8_LIKE:
        dtypes = _checks.FP8_DTYPES  # an FP8 cache: q, k_cache and v_cache all e4m3
        if isinstance(q, torch.Tensor) and q.dtype not in _checks.FP8_LIKE:
            raise TypeError(f"k_cache has dtype {k_cache.dtype} but q has {q.dtype}: an FP8 cache takes FP8 "
                            "queries (as FlashAttention-3): q8, q_descale = fa3.quantize_fp8(q)")
    _checks.check_tensor(q, "q", 3 if packed else 4, dtypes=dtypes)
    _checks.check_tensor(k_cache, "k_cache", 4, q.dtype, dtypes=dtypes)
    _checks.check_tensor(v_cache, "v_cache", 4, q.dtype, dtypes=dtypes)
    if packed:
        (total_q, heads_q, head_dim), seqlen_q = q.shape, None
        _checks.check_offsets(cu_seqlens_q, "cu_seqlens_q", q.device)
        batch = cu_seqlens_q.shape[0] - 1
        if max_seqlen_q is None:
            max_seqlen_q = total_q
        elif not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be an int >= 0 (the longest entry of cu_seqlens_q), got "
                             f"{max_seqlen_q!r}; pass None to use q.shape[0]")
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
        s = t.stride()
        if t.data_ptr() % 16 or any(x % 8 for x in s[:3]) or t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} with a 16-byte aligned base and strides "
                             "(the kernel reads it with TMA and the cache is updated in place, so fa3 "
                             f"cannot copy it): allocate it with torch.empty(...) contiguous")
    if block_table is None:
        if planes != batch:
            raise ValueError(f"a dense k_cache must have batch {batch} ({'cu_seqlens_q' if packed else 'q'}'s)"
                             f" in dimension 0, got {planes}; for a paged cache pass block_table")
        capacity = rows
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
                or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor of shape (batch={batch}, max_pages), "
                             f"got {getattr(block_table, 'dtype', type(block_table))} "
                             f"{tuple(getattr(block_table, 'shape', ()))}: use .to(torch.int32)")
        if block_table.device != q.device or block_table.stride(-1) != 1:
            raise ValueError(f"block_table must be on {q.device} and contiguous in its last dimension")
        if rows == 0:
            raise ValueError("page_size = k_cache.shape[1] = 0: a paged cache is (num_pages, page_size, "
                             "heads_kv, head_dim) with pages of at least one token")
        capacity = block_table.shape[1] * rows
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
        _checks.check_tensor(k, "k", 3 if packed_new else 4, q.dtype, dtypes=dtypes)
        _checks.check_tensor(v, "v", 3 if packed_new else 4, q.dtype, dtypes=dtypes)
        if packed_new:
            _checks.check_offsets(cu_seqlens_k_new, "cu_seqlens_k_new", q.device, batch=batch,
                                  batch_source="cu_seqlens_q" if packed else "q.shape[0]")
            if k.shape != v.shape or k.shape[1:] != (heads_kv, head_dim):
                raise ValueError(f"k and v with cu_seqlens_k_new must both be (total_new, heads_kv={heads_kv}, "
                                 f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        elif k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != (heads_kv, head_dim):
            raise ValueError(f"k and v must both be (batch={batch}, new_tokens, heads_kv={heads_kv}, "
                             f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.device != q.device or v.device != q.device:
            name, t = ("k", k) if k.device != q.device else ("v", v)
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; put them on one GPU")
        appended = 0 if packed_new else k.shape[1]
        _checks.check_no_overlap(v_cache, "v_cache", (("k_cache", k_cache),),
                                 "appending the new k and v would write one over the other")
        if appended > capacity:
            raise ValueError(f"{appended} new tokens do not fit a cache of {capacity} per sequence")
        if block_table is not None and k.shape[0] * k.shape[1] and planes == 0:
            raise ValueError("k_cache has no pages (shape[0] = 0): the new tokens have nowhere to go")
    cache_seqlens = _seqlens_tensor(cache_seqlens, batch, q.device, capacity, appended, block_table, rows,
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
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, kernel, head_dim,
                               "q and the cache")
    _checks.check_hopper(q.device, "q")
    return spec, cache_seqlens, capacity, appended, seqlen_q if not packed else max_seqlen_q


def check_descales(q, descales, batch: int, heads_kv: int):
    """An FP8 cache's (q_descale, k_descale, v_descale) as the kernel takes them (float32 (batch,
    heads_kv) each; None or one element broadcast); None for a 16-bit call, which takes none."""
    if q.dtype not in _checks.FP8_DTYPES:
        if any(t is not None for t in descales):
            raise ValueError(f"q_descale, k_descale and v_descale apply to an FP8 cache (float8_e4m3fn q, "
                             f"k_cache and v_cache); q has dtype {q.dtype}: drop the descales")
        return None
    return tuple(_checks.check_descale(t, name, batch, heads_kv, q.device)
                 for t, name in zip(descales, ("q_descale", "k_descale", "v_descale")))


def check_out_dtype(out_dtype, q, descales) -> None:
    """The op's out_dtype: bf16 or fp16 with an FP8 cache (None: bf16), q's dtype (or None) otherwise."""
    allowed = _checks.SUPPORTED_DTYPES if descales is not None else (q.dtype,)
    if out_dtype is not None and out_dtype not in allowed:
        cache = "an FP8 cache" if descales is not None else f"a {q.dtype} cache"
        raise TypeError(f"out_dtype={out_dtype}: {cache} writes {' or '.join(map(str, allowed))}; pass one "
                        "of those, or None")


def _seqlens_tensor(cache_seqlens, batch, device, capacity, appended, block_table, page_size,
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


_DUMMIES: dict = {}


def _dummy(kind, device, head_dim=None):
    """Stand-ins for arguments a static configuration never reads (one per device)."""
    key = (kind, device, head_dim)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = {
            "table": lambda: torch.zeros(1, 1, dtype=torch.int32, device=device),
            "o_partial": lambda: torch.empty(1, 1, 1, 1, head_dim, dtype=torch.float32, device=device),
            "lse_partial": lambda: torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device),
            "descale": lambda: torch.ones(1, 1, dtype=torch.float32, device=device),
        }[kind]()
    return t


def launch_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, capacity: int, appended: int,
                   causal: bool, scale: float, num_splits: int, window=(-1, -1), softcap: float = 0.0,
                   cu_seqlens_q=None, max_seqlen_q: int = 0, max_seqlen_k: int = -1, out=None,
                   cache_leftpad=None, sinks=None, descales=None, out_dtype=None):
    """(out, lse) of rung `spec`; arguments are validated (`capacity`: keys a sequence can hold, from
    `check_kvcache`) and the new tokens already appended. Packed queries (cu_seqlens_q): q and out
    are (total_q, heads_q, d), lse (heads_q, total_q), and the kernel sees them as a batch of one
    plane (grid sized by max_seqlen_q); otherwise q is (batch, seqlen_q, heads_q, d). max_seqlen_k
    (-1: unknown, the capacity) bounds the keys for the split plan; cache_leftpad (batch,): where
    each sequence's keys start in a dense cache. descales: an FP8 cache's (q, k, v) descales,
    float32 (batch, heads_kv) each; out, unless given, in out_dtype (None: bf16 for an FP8 cache,
    q's dtype otherwise)."""
    device, head_dim = q.device, q.shape[-1]
    packed, fp8 = cu_seqlens_q is not None, descales is not None
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype or (torch.bfloat16 if fp8 else q.dtype), device=device)
    if packed:
        (total_q, heads_q, _), batch, seqlen_q = q.shape, cu_seqlens_q.shape[0] - 1, max(max_seqlen_q, 1)
        lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=device)
        q4, out4, lse3, cu = q.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), cu_seqlens_q
        rows_q = total_q
    else:
        batch, seqlen_q, heads_q, _ = q.shape
        lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
        q4, out4, lse3, cu = q, out, lse, _launch.stand_in(device)
        rows_q = seqlen_q
    if out.numel() == 0:
        return out, lse
    if batch == 0:  # packed rows that no entry holds
        return out.zero_(), lse.fill_(float("-inf"))
    heads_kv = k_cache.shape[2]
    paged = block_table is not None
    keys = capacity if max_seqlen_k < 0 else min(capacity, max_seqlen_k)
    sms = _checks.HOPPER_SMS[device]  # (check_kvcache, eager or in the op, checked the device)
    plan = call_plan(spec, head_dim, batch, seqlen_q, rows_q if packed else None, heads_q, heads_kv,
                     k_cache.shape[1] if paged else None, keys, causal, window, softcap, scale, fp8,
                     cache_leftpad is not None or appended != 0, num_splits, sms)
    mask, long, num_splits = plan.mask, plan.long, plan.num_splits
    s1_max_queries = 0 if long is None else long.min_queries  # S1 (and its combine) skip K5's entries
    planes = 1 if packed else batch
    if num_splits > 1:
        o_partial = torch.empty(num_splits, planes, rows_q, heads_q, head_dim, dtype=torch.float32,
                                device=device)
        lse_partial = torch.empty(num_splits, planes, heads_q, rows_q, dtype=torch.float32, device=device)
    else:
        o_partial, lse_partial = _dummy("o_partial", device, head_dim), _dummy("lse_partial", device)
    # the longest entries first when the CTAs take several waves (sorted on the device: no sync)
    order = _launch.stand_in(device, torch.int64)
    if plan.longest_first:
        order = torch.empty(batch, dtype=torch.int64, device=device)
        _compile_kvcache.get_entry_order()(cache_seqlens, order, keys)
    leftpad, has_sinks = cache_leftpad is not None, sinks is not None
    sinks = _launch.sinks_ready(sinks) if has_sinks else _launch.stand_in(device, torch.float32)
    fn = _compile_kvcache.get_kvcache(spec, q.dtype, head_dim, mask.causal, paged, mask.local, mask.softcap,
                                      plan.gather, packed, leftpad, has_sinks, out.dtype if fp8 else None,
                                      s1_max_queries)
    descales = descales or (_dummy("descale", device),) * 3
    table = block_table if paged else _dummy("table", device)
    fn(q4, k_cache, v_cache, cache_seqlens, table, out4, lse3, o_partial, lse_partial, mask.scale_log2,
       appended, mask.left, mask.right, mask.softcap_scale, cu, plan.s1_queries,
       cache_leftpad if leftpad else _launch.stand_in(device), order, sinks, *descales)
    if num_splits > 1:
        combine = _compile_kvcache.get_combine(out.dtype, head_dim, has_sinks, s1_max_queries)
        combine(o_partial, lse_partial, out4, lse3, sinks, cu)
    if long is not None:
        cache_prefill.launch(long, q, k_cache, v_cache, cache_seqlens, block_table, cu, out, lse, mask,
                             sinks if has_sinks else None)
    return out, lse


def cache_attention(q, k_cache, v_cache, k, v, seqlens, block_table, causal, softmax_scale, window_size,
                    softcap, num_splits, kernel, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
                    out=None, lengths_name="cache_seqlens", cache_leftpad=None, sinks=None,
                    descales=(None, None, None), cu_seqlens_k_new=None):
    """The body of every call against a KV cache: check, check the index values (eager), append,
    launch (directly, or through torch.ops.fa3.attention_kvcache), return (out, lse). descales:
    (q_descale, k_descale, v_descale) as given (an FP8 cache)."""
    spec, seqlens, capacity, appended, max_q = check_kvcache(
        q, k_cache, v_cache, k, v, seqlens, block_table, kernel, window_size, softcap, cu_seqlens_q,
        max_seqlen_q, lengths_name, cache_leftpad, cu_seqlens_k_new)
    descales = check_descales(q, descales, seqlens.shape[0], k_cache.shape[2])
    inputs = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
    if out is not None and descales is not None:
        _checks.check_fp8_output(out, q, inputs)
    elif out is not None:
        _checks.check_output(out, "out", q, inputs)
    _checks.check_rung_sinks(spec, sinks, q.shape[-2], q.device)
    if sinks is not None:
        sinks = sinks.detach()  # inference: no gradient flows through a cache call
    window = tuple(window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    max_seqlen_k = -1 if max_seqlen_k is None else int(max_seqlen_k)
    # eager: the index values are checked on the host (where values_checkable(q.device)), unless
    # this thread checked these very tensors, unmodified, last
    if cu_seqlens_k_new is not None:
        wait = index_checks.start_append_check(cu_seqlens_k_new, k.shape[0], seqlens, block_table, capacity,
                                               k_cache.shape[1], k_cache.shape[0], cu_seqlens_q, q.shape[0],
                                               max_q, q.device)
    elif cu_seqlens_q is not None:
        wait = index_checks.start_packed_cache_check(cu_seqlens_q, q.shape[0], max_q, seqlens, block_table,
                                                     capacity, k_cache.shape[1], k_cache.shape[0],
                                                     lengths_name, q.device)
    elif cache_leftpad is not None:
        wait = index_checks.start_leftpad_check(cache_leftpad, seqlens, capacity, appended, k_cache.shape[1],
                                                q.device)
    else:
        wait = index_checks.start_cache_check(seqlens, block_table, capacity, appended, k_cache.shape[1],
                                              k_cache.shape[0], q.device)
    refuse_first = k is not None or out is not None  # refuse before anything is written
    if refuse_first:
        wait()
    if cu_seqlens_k_new is not None:  # the kernel attends over the lengths after the append
        seqlens = append_packed(k_cache, v_cache, k, v, seqlens, cu_seqlens_k_new, block_table, capacity)
    elif k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity)
    if _dispatch.direct_call_ok(q, k_cache, v_cache, *(descales or ())) and \
            (sinks is None or _dispatch.direct_call_ok(sinks)):
        out, lse = launch_kvcache(spec, q, k_cache, v_cache, seqlens, block_table, capacity, appended,
                                  bool(causal), scale, int(num_splits), window, softcap, cu_seqlens_q, max_q,
                                  max_seqlen_k, out, cache_leftpad, sinks, descales)
    else:
        out_dtype = None if descales is None else (torch.bfloat16 if out is None else out.dtype)
        result, lse = torch.ops.fa3.attention_kvcache(q, k_cache, v_cache, seqlens, block_table, appended,
                                                      bool(causal), scale, int(num_splits), spec.name,
                                                      window[0], window[1], float(softcap), cu_seqlens_q,
                                                      max_q, max_seqlen_k, cache_leftpad, sinks,
                                                      *(descales or (None,) * 3), out_dtype)
        out = result if out is None else out.copy_(result)  # the op is functional
    if not refuse_first:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return out, lse


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                           cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           causal: bool = False, softmax_scale: float | None = None,
                           window_size=(-1, -1), softcap: float = 0.0, num_splits: int = 0,
                           return_lse: bool = False, kernel: str | None = None, sinks=None,
                           q_descale=None, k_descale=None, v_descale=None, out=None):
    """softmax(q K^T * softmax_scale) V over each sequence's cached keys, as flash-attn's
    flash_attn_with_kvcache.

    q: (batch, seqlen_q, heads_q, d), bf16/fp16 (float8_e4m3fn with an FP8 cache), d in
        64/96/128/192/256, heads_q a multiple of heads_kv;
        or, with cu_seqlens_q, (total_q, heads_q, d): entry b's queries are rows
        [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (several tokens per sequence: speculative verify,
        chunked prefill), max_seqlen_q their longest (None: total_q; it sizes the grid).
    k_cache, v_cache: dense (batch, capacity, heads_kv, d), or paged (num_pages, page_size,
        heads_kv, d) with `block_table` (batch, max_pages) int32 naming each sequence's pages in
        order; any page size (multiples of 64 are read by TMA, others by cp.async row gathers).
    k, v: optional new tokens (batch, new_tokens, heads_kv, d), written into the cache at positions
        cache_seqlens[b] .. cache_seqlens[b] + new_tokens - 1 (in place) before attending; or, with
        cu_seqlens_k_new, packed (total_new, heads_kv, d).
    cu_seqlens_k_new: optional int32 (batch + 1,) offsets of packed new k/v (required with them
        beside cu_seqlens_q): sequence b's new tokens are rows [cu_seqlens_k_new[b],
        cu_seqlens_k_new[b + 1]), any number per sequence, written at cache_seqlens[b] onwards;
        each sequence then holds cache_seqlens[b] + its new tokens (FlashAttention-3's packed
        appends).
    cache_seqlens: int or int32 (batch,) tensor: valid tokens per sequence before the append, in
        [0, capacity] with cache_seqlens + new_tokens <= capacity (capacity: k_cache.shape[1]
        dense, block_table.shape[1] * page_size paged).
    cache_leftpad: optional int32 (batch,), flash-attn's: sequence b's keys start at cache position
        cache_leftpad[b] (a left-padded dense cache, as batched generation fills it); its keys are
        positions [cache_leftpad[b], cache_seqlens[b] + new_tokens). Dense caches only.
    causal: query i of seqlen_q sees keys up to cache_seqlens + new_tokens - seqlen_q + i (bottom
        right aligned, as flash-attn; per entry with cu_seqlens_q).
    window_size, softcap: sliding window and capped scores, as fa3.attention (the window is
        aligned the same way, to each sequence's own length).
    num_splits: how many CTAs share each sequence's keys; 0 picks from the shapes and SM count.
    sinks: optional attention sinks, a float32 (heads_q,) tensor, as fa3.attention (not
        differentiated here).
    q_descale, k_descale, v_descale: an FP8 cache (q, k_cache, v_cache, and k, v if given, all
        torch.float8_e4m3fn): float32 (batch, heads_kv) descales (or one element, or None for 1),
        as vLLM and SGLang pass them; attention is computed on q * q_descale etc. (exactly: the
        kernel dequantizes each tile in SMEM) and out is bf16 (or out='s dtype).
    out: optional preallocated output shaped like q, contiguous, in q's dtype (an FP8 cache: bf16
        or fp16); it is returned.
    Returns out shaped like q (and the fp32 lse: (batch, heads_q, seqlen_q), or (heads_q, total_q)
    with cu_seqlens_q). Not differentiable (inference). Runs on torch's current stream, so a
    decode step can be captured in a CUDA graph.

    Bad values: an eager call copies cache_seqlens (and, paged, the smallest and largest page index
    the sequences use; packed, cu_seqlens_q) to the host, one small copy and one sync, and raises
    ValueError naming the argument, the batch entry, the value and the bound: a length outside
    [0, capacity], an append past the capacity, a block_table entry outside [0, num_pages) among
    the first ceil((cache_seqlens[b] + new_tokens) / page_size) of row b (entries past those are
    never read, and may hold anything), or offsets that do not start at 0, decrease, end past
    total_q or exceed max_seqlen_q. An append is refused before it writes. While a CUDA graph is
    captured or torch.compile traces, values cannot be read on the host (nor in direct calls of
    torch.ops.fa3.attention_kvcache): lengths are clamped to [0, capacity], page indices to
    [0, num_pages) and query offsets into q's rows, and an append past the capacity writes its
    tokens at the last new_tokens positions (clamped page indices included). The results of bad
    values are then meaningless, but no kernel reads or writes outside its tensors and the CUDA
    context survives.
    """
    out, lse = cache_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                               window_size, softcap, num_splits, kernel, cu_seqlens_q, max_seqlen_q,
                               out=out, cache_leftpad=cache_leftpad, sinks=sinks,
                               descales=(q_descale, k_descale, v_descale), cu_seqlens_k_new=cu_seqlens_k_new)
    return (out, lse) if return_lse else out
