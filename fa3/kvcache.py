"""fa3.attention_with_kvcache: decode (and short appends) against a dense or paged KV cache, and
packed variable-length queries over such a cache (fa3.attention_varlen with block_table/seqused_k).

flash-attn's `flash_attn_with_kvcache` conventions: q (batch, seqlen_q, heads_q, d); a dense cache
(batch, capacity, heads_kv, d) or a paged one (num_pages, page_size, heads_kv, d), any page size,
with `block_table` (batch, max_pages) int32; new k/v are written into the cache at `cache_seqlens`
(in place) before attending. Packed queries (total_q, heads_q, d) with int32 `cu_seqlens_q` mix
any lengths (a decode is a one-token entry; causal aligns each entry to the bottom right of its
own keys). The kernel (kernels/decode.py) packs the query heads of each KV head into one tile and
splits the key range across CTAs; `num_splits=0` picks the split count from shapes alone
(fa3.cache.split_plan: no host sync, so CUDA graphs capture the call).

An FP8 cache: k_cache and v_cache in float8_e4m3fn with k/v_descale (batch, heads_kv) float32
(one element for a whole tensor), q in float8_e4m3fn with q_descale (vLLM's and SGLang's call; out
bf16, or out='s dtype) or in bf16 / fp16 with none (out in q's dtype); the kernel dequantizes each
K/V tile in SMEM, so the cache is read at one byte an element. New 16-bit k/v are quantized into
it with k/v_descale.

The kernel clamps lengths to [0, capacity] and page indices to [0, num_pages), fa3.cache.append the
append's positions; eager calls also check the values of cache_seqlens and block_table on the host
without waiting for them (fa3.index_checks: a copy behind the kernels, raised by a later call).
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, index_checks, masking, mla, registry
from .compile import kvcache as _compile_kvcache
from .cache import prefill as cache_prefill
from ._memo import BoundedMemo, layout
from .cache.append import append_packed, append_to_cache
from .cache.checks import check_descales, check_kvcache
from .cache.split_plan import call_plan, split_request


NO_DESCALES = (None, None, None)


def launch_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, capacity: int, appended: int,
                   causal: bool, scale: float, num_splits: int, window=(-1, -1), softcap: float = 0.0,
                   cu_seqlens_q=None, max_seqlen_q: int = 0, max_seqlen_k: int = -1, out=None,
                   cache_leftpad=None, sinks=None, descales=None, out_dtype=None, full: bool = False):
    """(out, lse) of rung `spec`; arguments are validated (`capacity`: keys a sequence can hold, from
    `check_kvcache`) and the new tokens already appended. Packed queries (cu_seqlens_q): q and out
    are (total_q, heads_q, d), lse (heads_q, total_q), and the kernel sees them as a batch of one
    plane (grid sized by max_seqlen_q); otherwise q is (batch, seqlen_q, heads_q, d). max_seqlen_k
    (-1: unknown, the capacity) bounds the keys for the split plan; cache_leftpad (batch,): where
    each sequence's keys start in a dense cache. descales: an FP8 cache's (q, k, v) descales,
    float32 (batch, heads_kv) each (q's None for 16-bit q); out, unless given, in out_dtype (None:
    bf16 for FP8 q, q's dtype otherwise). full: every sequence holds all `capacity` keys (no order
    to sort)."""
    fp8 = descales is not None
    out_dtype = out.dtype if out is not None else out_dtype or (
        torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    launch = CacheLaunch(spec, q, k_cache, block_table is not None, capacity, appended, causal, scale, num_splits,
                         window, softcap, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cache_leftpad is not None,
                         sinks is not None, fp8, out_dtype, full)
    return launch(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, out, cache_leftpad, sinks,
                  descales)


class CacheLaunch:
    """A call against a KV cache, planned from what is static in it (shapes, dtypes, the variants
    present, the split plan, the compiled kernels); calling it with the call's tensors allocates
    the outputs and launches (launch_kvcache's arguments, validated). Repeated calls of one shape
    keep it (fa3.kvcache.cache_attention's memo) and pay only the allocations and launches."""

    def __init__(self, spec, q, k_cache, paged: bool, capacity: int, appended: int, causal: bool, scale: float,
                 num_splits: int, window, softcap: float, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int,
                 leftpad: bool, has_sinks: bool, fp8: bool, out_dtype, full: bool):
        device, head_dim = q.device, q.shape[-1]
        self.device, self.out_dtype, self.packed = device, out_dtype, cu_seqlens_q is not None
        self.paged, self.leftpad, self.has_sinks, self.appended = paged, leftpad, has_sinks, appended
        if self.packed:
            (total_q, heads_q, _), batch, seqlen_q = q.shape, cu_seqlens_q.shape[0] - 1, max(max_seqlen_q, 1)
            self.lse_shape, rows_q = (heads_q, total_q), total_q
        else:
            batch, seqlen_q, heads_q, _ = q.shape
            self.lse_shape, rows_q = (batch, heads_q, seqlen_q), seqlen_q
        self.batch = batch
        self.empty = q.numel() == 0  # (out has q's shape)
        if self.empty or batch == 0:
            return
        heads_kv = k_cache.shape[2]
        # a capped request plans for the capacity: a CUDA graph captured with short sequences (vLLM captures
        # with max_seqlen_k = 1) replays long ones
        self.keys = capacity if max_seqlen_k < 0 or num_splits < 0 else min(capacity, max_seqlen_k)
        sms = _checks.HOPPER_SMS[device]  # (check_kvcache, eager or in the op, checked the device)
        plan = call_plan(spec, head_dim, batch, seqlen_q, rows_q if self.packed else None, heads_q, heads_kv,
                         k_cache.shape[1] if paged else None, self.keys, causal, window, softcap, scale, fp8,
                         leftpad or appended != 0, num_splits, sms)
        self.mask, self.long, self.num_splits, self.s1_queries = plan.mask, plan.long, plan.num_splits, plan.s1_queries
        s1_max_queries = 0 if plan.long is None else plan.long.min_queries  # S1 (and its combine) skip K5's
        self.sort = plan.longest_first and not full  # the longest entries first (sorted on the device)
        # a warp-split rung (s2) writes one partial per warp of each CTA, always combined
        self.partials_shape = (self.num_splits * spec.config.base.partials_per_cta, 1 if self.packed else batch,
                               rows_q, heads_q, head_dim)
        # several partials a row: the combine merges them, launched by the same compiled call
        self.split = self.partials_shape[0] > 1
        self.fn = _compile_kvcache.get_kvcache(spec, k_cache.dtype, head_dim, self.mask.causal, paged,
                                               self.mask.local, self.mask.softcap,
                                               _compile_kvcache.gather_layout(spec, k_cache.dtype, plan.gather,
                                                                              k_cache.shape[1] if paged else None),
                                               self.packed,
                                               leftpad, has_sinks, out_dtype if fp8 else None, s1_max_queries,
                                               q.dtype if q.dtype != k_cache.dtype else None, self.split)
        self.order = _compile_kvcache.get_entry_order() if self.sort else None
        self.head_dim = head_dim
        # the stand-in for the entries' order (the kernels take None for the rest: signatures.kvcache_args)
        self.no_order = _launch.stand_in(device, torch.int64)
        # the stream's scratch a call takes: the split partials (O, LSE: the combine reads them)
        splits, planes, rows, heads, _ = self.partials_shape
        self.scratch_shapes = (self.partials_shape, (splits, planes, heads, rows)) if self.split else ()

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q=None, out=None,
                 cache_leftpad=None, sinks=None, descales=None, keep_lse: bool = True):
        """(out, lse): the launch, for tensors of the planned shapes (validated). keep_lse=False: the
        caller drops the LSE, which goes to the stream's scratch (no allocation)."""
        device = self.device
        if out is None:
            out = torch.empty(q.shape, dtype=self.out_dtype, device=device)
        if self.empty or self.batch == 0:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
            if self.empty:
                return out, lse
            return out.zero_(), lse.fill_(float("-inf"))  # packed rows that no entry holds
        lse, o_partial, lse_partial = _launch.lse_and_partials(self.lse_shape, self.scratch_shapes, keep_lse, device,
                                                               self.head_dim)
        if self.packed:
            q4, out4, lse3, cu = q.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), cu_seqlens_q
        else:
            q4, out4, lse3, cu = q, out, lse, None
        order = self.no_order
        if self.order is not None:
            order = torch.empty(self.batch, dtype=torch.int64, device=device)
            self.order(cache_seqlens, order, self.keys)
        sinks = _launch.sinks_ready(sinks) if self.has_sinks else None
        # what the compiled variant does not read is None (signatures.kvcache_args): nothing to convert
        q_descale, k_descale, v_descale = descales or NO_DESCALES
        mask = self.mask
        self.fn(q4, k_cache, v_cache, cache_seqlens, block_table if self.paged else None, out4,
                lse3, o_partial, lse_partial, mask.scale_log2, self.appended, mask.left, mask.right,
                mask.softcap_scale, cu, self.s1_queries, cache_leftpad if self.leftpad else None, order, sinks,
                q_descale, k_descale, v_descale)
        if self.long is not None:
            cache_prefill.launch(self.long, q, k_cache, v_cache, cache_seqlens, block_table, cu, out, lse, mask,
                                 sinks if self.has_sinks else None)
        return out, lse


DECODE_MIN_KV_BYTES = 32 << 20  # K and V at least this large: reading them outweighs S1's extra launch


def decodes_over_keys(q, k, v) -> bool:
    """Whether fa3.attention's forward-only call (validated) is a decode step over a long context,
    which S1 runs faster than K5 (worklog/serving.md): S1 reads each KV head's keys once for all its query heads
    (one tile of tile_m rows) and splits the keys across CTAs where the batch does not fill the
    SMs, where K5 runs one CTA per query head and reads every key there. Also: more keys than
    queries, v's head dim as q's, S1's head dims, K and V of DECODE_MIN_KV_BYTES or more (below
    it the GPU work is small beside either launch), aligned for TMA."""
    seqlen_q, head_dim, seqlen_k = q.shape[1], q.shape[3], k.shape[1]
    if seqlen_q >= seqlen_k or 2 * k.numel() * k.element_size() < DECODE_MIN_KV_BYTES or v.shape[3] != head_dim \
            or not registry.available_kernels(registry.KVCACHE, head_dim):
        return False
    return decode_rows_fit(q, k) and _launch.tma_aligned(k) and _launch.tma_aligned(v)


def decode_rows_fit(q, k) -> bool:
    """Whether a KV head's query rows (seqlen_q x the query heads sharing it) fit one S1 tile, the
    shape S1 is built for: more rows take several Q tiles, where K5 (a prompt) is the better kernel.
    q and k (batch, seqlen, heads, d) with a head dim that has a KV-cache rung."""
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, None, q.shape[3], "q and the cache")
    return q.shape[1] * (q.shape[2] // k.shape[2]) <= spec.config.base.tile_m


def decode_attention(q, k, v, causal: bool, scale: float, out=None, window=(-1, -1), softcap: float = 0.0,
                     sinks=None):
    """(out, lse) of fa3.attention's call on S1 (decodes_over_keys said so; arguments validated):
    k and v as a dense cache in which every sequence holds all its keys."""
    masking.check_scale(scale)  # (fa3.attention checks it where it computes a Masking)
    if q.requires_grad or k.requires_grad or v.requires_grad:  # (under no_grad) as launch_attention
        q, k, v = _launch.detached(q, k, v)
    seqlen_k = k.shape[1]
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, None, q.shape[3], "q and the cache")
    return launch_kvcache(spec, _launch.tma_ready(q), k, v, full_lengths(q.shape[0], q.device), None, seqlen_k, 0,
                          causal, scale, 0, window, softcap, out=out, sinks=sinks, full=True)


def prepare_decode(q, k, v, causal: bool, scale: float):
    """decode_attention's launch for a plain fa3.attention call (no window, softcap or sinks)
    that ran with these q, k, v, planned once: a function of (q, k, v) for later calls with the
    same shapes, strides, dtypes and devices and 16-byte aligned data (fa3.interface's memo); None
    where decode_attention would copy q."""
    if q.device not in _checks.HOPPER_SMS or not _launch.tma_aligned(q):
        return None
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, None, q.shape[3], "q and the cache")
    launch = CacheLaunch(spec, q, k, False, k.shape[1], 0, causal, scale, 0, (-1, -1), 0.0, None, 0, -1, False,
                         False, False, q.dtype, True)
    lengths = full_lengths(q.shape[0], q.device)

    def run(q, k, v, keep_lse: bool = True, out=None):
        if q.requires_grad or k.requires_grad or v.requires_grad:  # (under no_grad) as decode_attention
            q, k, v = _launch.detached(q, k, v)
        return launch(q, k, v, lengths, None, out=out, keep_lse=keep_lse)
    return run


FULL_LENGTH = 1 << 30  # past any cache's rows: S1 clamps a length to its cache's capacity
_FULL_LENGTHS = BoundedMemo(64)


def full_lengths(batch: int, device) -> torch.Tensor:
    """int32 (batch,) lengths of FULL_LENGTH, which S1 reads as "all of the cache's rows": the
    lengths of fa3.attention's decode steps, with no fill kernel per call. Kept per device and
    batch, made once outside any graph capture and waited for (so that any stream, or a graph
    captured later, reads it filled); a capture that comes first makes its own, on its stream."""
    key = (device, batch)
    lengths = _FULL_LENGTHS.get(key)
    if lengths is None:
        lengths = torch.full((batch,), FULL_LENGTH, dtype=torch.int32, device=device)
        if torch.cuda.is_current_stream_capturing():
            return lengths
        torch.cuda.current_stream(device).synchronize()
        _FULL_LENGTHS.remember(key, lengths)
    return lengths


_INT_LENGTHS = BoundedMemo(16)


def int_lengths(batch: int, length: int, device) -> torch.Tensor:
    """int32 (batch,) tensor of one host length (flash-attn's int cache_seqlens), filled once per
    (device, stream, batch, length) and reused: a model's layers in one decode step pass the same
    int. Per stream, so that a reader on the stream that filled it is ordered after the fill; made
    fresh while a CUDA graph is captured (the graph fills its own)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index), batch, length)
    lengths = _INT_LENGTHS.get(key)
    if lengths is None:
        lengths = _INT_LENGTHS.remember(key, torch.full((batch,), length, dtype=torch.int32, device=device))
    return lengths


# the static part of a plain call against a cache (cache_attention's key) -> (its index check, its CacheLaunch)
_CACHE_CALLS = BoundedMemo()


def _index_check(q, k_cache, capacity: int, max_q: int, lengths_name: str):
    """start(lengths, block_table, cu_seqlens_q, cache_leftpad) -> wait: a plain call's index check
    (as cache_attention starts it) with its bounds made once."""
    device, total_q, page_size, num_pages = q.device, q.shape[0], k_cache.shape[1], k_cache.shape[0]

    def start(lengths, block_table, cu_seqlens_q, cache_leftpad=None):
        if cache_leftpad is not None:
            return index_checks.start_leftpad_check(cache_leftpad, lengths, capacity, 0, page_size, device)
        if cu_seqlens_q is not None:
            return index_checks.start_packed_cache_check(cu_seqlens_q, total_q, max_q, lengths, block_table,
                                                         capacity, page_size, num_pages, lengths_name, device)
        return index_checks.start_cache_check(lengths, block_table, capacity, 0, page_size, num_pages, device)
    return start


def cache_attention(q, k_cache, v_cache, k, v, seqlens, block_table, causal, softmax_scale, window_size,
                    softcap, num_splits, kernel, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
                    out=None, lengths_name="cache_seqlens", cache_leftpad=None, sinks=None,
                    descales=(None, None, None), cu_seqlens_k_new=None, keep_lse: bool = True):
    """The body of every call against a KV cache: check, check the index values (eager), append,
    launch (directly, or through torch.ops.fa3.attention_kvcache), return (out, lse). descales:
    (q_descale, k_descale, v_descale) as given (an FP8 cache). keep_lse=False: the caller drops the
    LSE (a remembered launch then writes it to scratch). Its callers (the public entry points)
    raise an earlier call's bad index values first (index_checks.raise_pending)."""
    # a plain call (no append, out=, sinks, window or softcap; lengths in a tensor or an int; left padding
    # allowed: transformers' padded generate) like one that ran before: its checks passed for these
    # shapes, and its launch is planned
    plain = k is None and cu_seqlens_k_new is None and sinks is None and out is None \
        and kernel is None and not softcap and window_size == (-1, -1) and type(causal) is bool \
        and (type(seqlens) is torch.Tensor or type(seqlens) is int) \
        and (softmax_scale is None or type(softmax_scale) is float) and not _dispatch.tracing()
    if plain:
        host_length = type(seqlens) is int  # one length for every sequence: checked here, not copied
        descaled = descales[0] is not None or descales[1] is not None or descales[2] is not None
        try:
            # (one flat tuple: cheaper to build and hash than a tuple of layout()s)
            key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
                   k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
                   int if host_length else layout(seqlens), None if block_table is None else layout(block_table),
                   None if cu_seqlens_q is None else layout(cu_seqlens_q), max_seqlen_q, max_seqlen_k, causal,
                   softmax_scale, num_splits, lengths_name,
                   tuple(None if d is None else (d.shape, d.dtype, d.device) for d in descales) if descaled else None,
                   None if cache_leftpad is None else layout(cache_leftpad))
            prepared = _CACHE_CALLS.get(key)
        except (AttributeError, TypeError):  # not tensors (check_kvcache names them), symbolic shapes
            key = prepared = plain = None
        if prepared is not None and (_dispatch.untraced_call_ok(q, k_cache, v_cache) if not descaled else
                                     _dispatch.untraced_call_ok(q, k_cache, v_cache,
                                                                *(d for d in descales if d is not None))) \
                and not _dispatch.profiling() and not (k_cache.data_ptr() | v_cache.data_ptr()) % 16:
            start_check, launch, capacity = prepared
            if not host_length or 0 <= seqlens <= capacity:  # (a bad int: check_kvcache's message below)
                if host_length:
                    seqlens = int_lengths(launch.batch, seqlens, q.device)
                wait = start_check(seqlens, block_table, cu_seqlens_q, cache_leftpad)
                out, lse = launch(q, k_cache, v_cache, seqlens, block_table, cu_seqlens_q, None, cache_leftpad, None,
                                  remembered_descales(q, k_cache, descales, launch.batch),
                                  keep_lse)
                wait()
                return out, lse
    host_lengths = isinstance(seqlens, int)  # checked on the host by check_kvcache: no copy needed
    spec, seqlens, capacity, appended, max_q = check_kvcache(
        q, k_cache, v_cache, k, v, seqlens, block_table, kernel, window_size, softcap, cu_seqlens_q,
        max_seqlen_q, lengths_name, cache_leftpad, cu_seqlens_k_new)
    descales = check_descales(q, k_cache, descales, seqlens.shape[0], k_cache.shape[2])
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
    masking.check_scale(scale)  # (launch_kvcache's plan reads the device's SM count first)
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
    elif host_lengths and block_table is None:
        wait = index_checks.nothing  # a host length, checked by check_kvcache; a dense cache has no table
    else:
        wait = index_checks.start_cache_check(seqlens, block_table, capacity, appended, k_cache.shape[1],
                                              k_cache.shape[0], q.device)
    refuse_first = k is not None or out is not None  # refuse before anything is written
    if refuse_first:
        wait()
    kv_descales = None if descales is None else descales[1:]  # (16-bit new k/v are quantized with them)
    if cu_seqlens_k_new is not None:  # the kernel attends over the lengths after the append
        seqlens = append_packed(k_cache, v_cache, k, v, seqlens, cu_seqlens_k_new, block_table, capacity,
                                kv_descales)
    elif k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity, kv_descales)
    if _dispatch.direct_call_ok(q, k_cache, v_cache, *(t for t in descales or () if t is not None)) and \
            (sinks is None or _dispatch.direct_call_ok(sinks)):
        with _dispatch.op_range("fa3::attention_kvcache"):
            # planned, launched and remembered (an FP8 cache's descales are the call's: its key holds their shapes)
            if plain and q.device in _checks.HOPPER_SMS:
                launch = CacheLaunch(spec, q, k_cache, block_table is not None, capacity, 0, causal, scale,
                                     int(num_splits), window, 0.0, cu_seqlens_q, max_q, max_seqlen_k,
                                     cache_leftpad is not None, False, descales is not None,
                                     torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype, False)
                out, lse = launch(q, k_cache, v_cache, seqlens, block_table, cu_seqlens_q, cache_leftpad=cache_leftpad,
                                  descales=descales)
                check = index_checks.nothing_to_start if host_length and block_table is None \
                    and cache_leftpad is None else _index_check(q, k_cache, capacity, max_q, lengths_name)
                _CACHE_CALLS.remember(key, (check, launch, capacity))
            else:
                out, lse = launch_kvcache(spec, q, k_cache, v_cache, seqlens, block_table, capacity, appended,
                                          bool(causal), scale, int(num_splits), window, softcap, cu_seqlens_q,
                                          max_q, max_seqlen_k, out, cache_leftpad, sinks, descales)
    else:
        out_dtype = None if descales is None or out is None else out.dtype  # (None: the op's default)
        result, lse = torch.ops.fa3.attention_kvcache(q, k_cache, v_cache, seqlens, block_table, appended,
                                                      bool(causal), scale, int(num_splits), spec.name,
                                                      window[0], window[1], float(softcap), cu_seqlens_q,
                                                      max_q, max_seqlen_k, cache_leftpad, sinks,
                                                      *(descales or (None,) * 3), out_dtype)
        out = result if out is None else out.copy_(result)  # the op is functional
    if not refuse_first:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return out, lse


_DESCALE_VIEWS = BoundedMemo(64)  # the descales' ids, batch, heads_kv -> (those tensors, check_descales' views)


def remembered_descales(q, k_cache, descales, batch: int):
    """check_descales' result for descales whose shapes, dtypes and devices passed it before (a
    remembered call's key holds them): the views made for these very tensors last time (they see
    in-place writes to them), made afresh for others."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return None
    key = (id(descales[0]), id(descales[1]), id(descales[2]), batch, k_cache.shape[2])
    hit = _DESCALE_VIEWS.get(key)  # (the memo holds the tensors: their ids stay theirs)
    if hit is not None and hit[0][0] is descales[0] and hit[0][1] is descales[1] and hit[0][2] is descales[2]:
        return hit[1]
    views = check_descales(q, k_cache, descales, batch, k_cache.shape[2])
    _DESCALE_VIEWS.remember(key, (descales, views))
    return views


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                           cu_seqlens_q=None, max_seqlen_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           causal: bool = False, softmax_scale: float | None = None,
                           window_size=(-1, -1), softcap: float = 0.0, num_splits: int = 0,
                           return_lse: bool = False, kernel: str | None = None, sinks=None,
                           q_descale=None, k_descale=None, v_descale=None, out=None, max_splits: int = 0,
                           qv=None):
    """softmax(q K^T * softmax_scale) V over each sequence's cached keys, as flash-attn's
    flash_attn_with_kvcache.

    q: (batch, seqlen_q, heads_q, d), bf16/fp16 (over an FP8 cache also float8_e4m3fn), d in
        64/96/128/192/256, heads_q a multiple of heads_kv;
        or, with cu_seqlens_q, (total_q, heads_q, d): entry b's queries are rows
        [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (several tokens per sequence: speculative verify,
        chunked prefill), max_seqlen_q their longest (None: total_q; it sizes the grid).
    k_cache, v_cache: dense (batch, capacity, heads_kv, d), or paged (num_pages, page_size,
        heads_kv, d) with `block_table` (batch, max_pages) int32 naming each sequence's pages in
        order; any page size (multiples of 64 are read by TMA, others by cp.async row gathers).
    k, v: optional new tokens (batch, new_tokens, heads_kv, d), written into the cache at positions
        cache_seqlens[b] .. cache_seqlens[b] + new_tokens - 1 (in place) before attending; or, with
        cu_seqlens_k_new, packed (total_new, heads_kv, d). In the cache's dtype, or, for an FP8
        cache beside 16-bit q, in q's dtype: quantized, e4m3(k / k_descale) rounded to nearest
        and saturating at +-448 (v likewise).
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
    max_splits: at most this many (flash-attn 3's num_splits: vLLM passes 16 under full CUDA
        graphs): the count planned from the shapes and the cache's capacity (not max_seqlen_k: a
        graph captured with short sequences replays long ones), capped; not with num_splits.
    sinks: optional attention sinks, a float32 (heads_q,) tensor, as fa3.attention (not
        differentiated here).
    q_descale, k_descale, v_descale: an FP8 cache (k_cache, v_cache torch.float8_e4m3fn): float32
        (batch, heads_kv) descales (or one element, or None for 1), as vLLM and SGLang pass them;
        attention is computed on k_cache * k_descale etc. (exactly: the kernel dequantizes each
        tile in SMEM). FP8 q (and k, v if given) with q_descale, out bf16 (or out='s dtype), or
        bf16 / fp16 q with no q_descale, out in q's dtype (or out='s): the kernel scales q by a
        power of two per 16 packed rows into fp16's range (its GEMMs' type; |q| beyond 65504
        included) and converts it exactly, but for elements 2^28 below their rows' largest.
    out: optional preallocated output shaped like q, contiguous, in q's dtype (an FP8 cache: bf16
        or fp16); it is returned.
    qv: MLA decode (flash-attn 3's qv, DeepSeek's absorbed latent attention): (batch, seqlen_q,
        heads_q, d_v) (or packed as q), scores (q k^T + qv v^T) * softmax_scale over a latent cache,
        out (..., d_v) = P v. k_cache (..., heads_kv, 64) holds the rotary keys and v_cache (...,
        heads_kv, 512) the latent (they may be views of one cache, as vLLM's); softmax_scale
        defaults to 1 / sqrt(64 + 512). bf16 / fp16, a dense cache or pages of any size, causal
        or not; packed queries of any lengths up to max_seqlen_q. fa3.mla says what is refused
        (FP8, window, softcap, sinks, ...).
    Returns out shaped like q (and the fp32 lse: (batch, heads_q, seqlen_q), or (heads_q, total_q)
    with cu_seqlens_q). Not differentiable (inference). Runs on torch's current stream, so a
    decode step can be captured in a CUDA graph.

    Bad values: lengths are clamped to [0, capacity], page indices to [0, num_pages) and query
    offsets into q's rows, and an append past the capacity writes its tokens at the last
    new_tokens positions (clamped page indices included): the results are then meaningless, but no
    kernel reads or writes outside its tensors and the CUDA context survives. An eager call also
    copies cache_seqlens (and block_table, cu_seqlens_q, ...) to pinned host memory behind its
    kernels without waiting (fa3.set_index_checks: "deferred"), and the next fa3 call that finds
    the copy done, or fa3.check_index_values(), raises ValueError naming the argument, the batch
    entry, the value and the bound: a length outside [0, capacity], an append past the capacity,
    a block_table entry outside [0, num_pages) among the first ceil((cache_seqlens[b] +
    new_tokens) / page_size) of row b (entries past those are never read, and may hold
    anything), or offsets that do not start at 0, decrease, end past total_q or exceed
    max_seqlen_q. fa3.set_index_checks("strict") raises in the call itself (one host sync), and
    refuses an append before it writes. While a CUDA graph is captured or torch.compile traces
    (and in direct calls of torch.ops.fa3.attention_kvcache) values are not read on the host.
    """
    index_checks.raise_pending()  # an earlier call's bad index values (deferred checks)
    if qv is not None:
        mla.refuse_options(window_size, softcap, sinks, cache_leftpad, cu_seqlens_k_new,
                           (q_descale, k_descale, v_descale))
        out, lse = mla.mla_attention(q, qv, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                                     split_request(num_splits, max_splits), kernel, cu_seqlens_q, max_seqlen_q,
                                     out=out, keep_lse=return_lse)
        return (out, lse) if return_lse else out
    out, lse = cache_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                               window_size, softcap, split_request(num_splits, max_splits), kernel, cu_seqlens_q,
                               max_seqlen_q, out=out, cache_leftpad=cache_leftpad, sinks=sinks,
                               descales=(q_descale, k_descale, v_descale), cu_seqlens_k_new=cu_seqlens_k_new,
                               keep_lse=return_lse)
    return (out, lse) if return_lse else out
