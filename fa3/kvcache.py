"""fa3.attention_with_kvcache: decode (and short appends) against a dense or paged KV cache, and
packed variable-length queries over such a cache (fa3.attention_varlen with block_table/seqused_k).

flash-attn's `flash_attn_with_kvcache` conventions: q (batch, seqlen_q, heads_q, d); a dense cache
(batch, capacity, heads_kv, d) or a paged one (num_pages, page_size, heads_kv, d), any page size,
with `block_table` (batch, max_pages) int32; new k/v are written into the cache at `cache_seqlens`
(in place) before attending. Packed queries (total_q, heads_q, d) with int32 `cu_seqlens_q` mix
any lengths (a decode is a one-token entry; causal aligns each entry to the bottom right of its
own keys). The kernel (kernels/decode.py) packs the query heads of each KV head into one tile and
splits the key range across CTAs; `num_splits=0` picks the split count from shapes alone
(`plan_splits`: no host sync, so CUDA graphs capture the call).

Eager calls check the values of cache_seqlens and block_table on the host (fa3.index_checks: one
small copy); captured and traced calls cannot, and rely on clamping: the kernel clamps lengths to
[0, capacity] and page indices to [0, num_pages), append_to_cache the append's positions.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _compile, _dispatch, _launch, index_checks, masking, registry

# Pages of a multiple of the kernel's key block (tile_n = 64 rows) are read by TMA, one box per
# block; any other page size by cp.async row gathers (kernels/common/paged.py).
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed costs outweigh the keys it reads


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, kernel, window_size, softcap,
                  cu_seqlens_q=None, max_seqlen_q=None, lengths_name="cache_seqlens", cache_leftpad=None):
    """The arguments of a call against a KV cache (attention_with_kvcache; attention_varlen over a
    cache, whose lengths are `seqused_k`: `lengths_name`); returns (spec, the lengths as an int32
    tensor, capacity, new tokens, max_seqlen_q). Packed queries (cu_seqlens_q given): q is
    (total_q, heads_q, d) and max_seqlen_q defaults to total_q (a bound that needs no sync)."""
    packed = cu_seqlens_q is not None
    _checks.check_tensor(q, "q", 3 if packed else 4)
    _checks.check_tensor(k_cache, "k_cache", 4, q.dtype)
    _checks.check_tensor(v_cache, "v_cache", 4, q.dtype)
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
    if k is not None:
        if packed:
            raise NotImplementedError("new k/v with cu_seqlens_q (packed queries) are not supported by "
                                      "fa3: write the new tokens into the cache first, then attend")
        _checks.check_tensor(k, "k", 4, q.dtype)
        _checks.check_tensor(v, "v", 4, q.dtype)
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != (heads_kv, head_dim):
            raise ValueError(f"k and v must both be (batch={batch}, new_tokens, heads_kv={heads_kv}, "
                             f"head_dim={head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.device != q.device or v.device != q.device:
            name, t = ("k", k) if k.device != q.device else ("v", v)
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; put them on one GPU")
        appended = k.shape[1]
        if appended > capacity:
            raise ValueError(f"{appended} new tokens do not fit a cache of {capacity} per sequence")
        if block_table is not None and appended and planes == 0:
            raise ValueError("k_cache has no pages (shape[0] = 0): the new tokens have nowhere to go")
    cache_seqlens = _seqlens_tensor(cache_seqlens, batch, q.device, capacity, appended, block_table, rows,
                                    lengths_name)
    if cache_leftpad is not None:
        if block_table is not None or packed:
            raise NotImplementedError("cache_leftpad is for a dense cache with (batch, seqlen_q) queries (as in "
                                      "flash-attn): not with block_table or cu_seqlens_q")
        if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32 \
                or cache_leftpad.shape != (batch,) or cache_leftpad.device != q.device:
            raise ValueError(f"cache_leftpad must be an int32 tensor of shape (batch={batch},) on {q.device}, got "
                             f"{getattr(cache_leftpad, 'dtype', type(cache_leftpad).__name__)} "
                             f"{tuple(getattr(cache_leftpad, 'shape', ()))}: use .to(torch.int32)")
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, kernel, head_dim,
                               "q and the cache")
    _checks.check_hopper(q.device, "q")
    return spec, cache_seqlens, capacity, appended, seqlen_q if not packed else max_seqlen_q


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


def num_splits_for(batch, heads_kv, q_tiles, capacity, sm_count, tile_n=64, ctas_per_sm=1) -> int:
    """Splits of the key range so that batch x heads_kv x q_tiles x splits CTAs fill the SMs'
    CTA slots (ctas_per_sm each: one for the TMA ring, which takes most of the SMEM), each split
    keeping at least MIN_BLOCKS_PER_SPLIT key blocks of the cache's capacity. From shapes only: no
    host sync."""
    ctas, slots = batch * heads_kv * q_tiles, sm_count * ctas_per_sm
    if ctas >= 0.8 * slots:
        return 1
    blocks = -(-capacity // tile_n)
    # round down: one CTA past the slots would run alone in a second wave
    return max(1, min(MAX_SPLITS, slots // ctas, blocks // MIN_BLOCKS_PER_SPLIT))


SM_SMEM_BYTES = 233472  # shared memory of one sm_90 SM (228 KB); each resident CTA also reserves 1 KB
CTA_SMEM_BYTES = 232448  # the most one CTA may use (227 KB; kernels/common/smem.py's SMEM_CAPACITY)


def reads_by_gather(spec, page_size: int) -> bool:
    """Pages that do not hold whole key blocks (tile_n rows) are read by cp.async row gathers, the
    others by TMA, one box per block."""
    return page_size % spec.config["tile_n"] != 0


def _smem_plan(spec, head_dim: int, gather: bool) -> tuple[int, int, int]:
    """(Q tile bytes, K+V bytes per stage, stages) of s1's SMEM (kernels/decode.py; a CPU test
    holds the stages equal to the kernel's): the ring as deep as SMEM allows beside the Q tile and
    1 KB of barriers, up to max_kv_stages; a gather keeps gather_kv_stages."""
    cfg = spec.config_for(head_dim)
    q_bytes, kv_bytes = cfg["tile_m"] * head_dim * 2, 2 * cfg["tile_n"] * head_dim * 2
    stages = min(cfg["max_kv_stages"], (CTA_SMEM_BYTES - q_bytes - 1024) // kv_bytes)
    return q_bytes, kv_bytes, min(stages, cfg["gather_kv_stages"]) if gather else stages


def kv_stages(spec, head_dim: int, gather: bool) -> int:
    """The K+V ring depth s1 compiles."""
    return _smem_plan(spec, head_dim, gather)[2]


def ctas_per_sm(spec, head_dim: int, gather: bool) -> int:
    """How many s1 CTAs share an SM: the TMA ring fills one SM's SMEM (1); a row gather's short
    ring leaves room for more (2 at d128), so that one CTA's copies, issued by its only
    warpgroup, overlap another's math."""
    if not gather:
        return 1
    q_bytes, kv_bytes, stages = _smem_plan(spec, head_dim, True)
    return max(1, SM_SMEM_BYTES // (q_bytes + 1024 + stages * kv_bytes + 1024))


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int):
    """Write the new tokens at positions cache_seqlens[b] + i (device-side indices: no sync).

    torch's index ops assert on the device for an index outside the tensor, which ends the
    process's CUDA context; so the first position is clamped to [0, capacity - new_tokens] and page
    indices to [0, num_pages) (in the ops that convert them anyway: no extra kernel). Checked
    values are unchanged; unchecked bad ones (CUDA-graph capture, torch.compile) write inside the
    cache."""
    batch, new = k.shape[:2]
    positions = cache_seqlens.clamp(0, capacity - new)[:, None] + torch.arange(new, device=k.device)
    if block_table is None:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
    else:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table, 1, positions // page_size).clamp_(0, k_cache.shape[0] - 1)
        k_cache[pages, positions % page_size] = k
        v_cache[pages, positions % page_size] = v


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
        }[kind]()
    return t


def plan_splits(spec, batch: int, max_seqlen_q: int, heads_q: int, heads_kv: int, keys: int, mask,
                sm_count: int, head_dim: int, gather: bool) -> int:
    """How many CTAs share each sequence's keys (num_splits=0), from host integers only: the
    batch, the longest query run, the heads, the most keys a sequence holds (`keys`: the capacity,
    or max_seqlen_k where the caller knows it), the SM count and how many CTAs an SM holds (head_dim;
    gather: pages that are not a multiple of the key block). A window bounds the keys a query
    sees, whatever the cache holds. This is the whole split plan: a captured graph replays it."""
    q_tiles = -(-max(max_seqlen_q, 1) * (heads_q // heads_kv) // spec.config["tile_m"])
    if mask.local:
        keys = min(keys, mask.left + mask.right + max(max_seqlen_q, 1))
    return num_splits_for(batch, heads_kv, q_tiles, keys, sm_count, spec.config["tile_n"],
                          ctas_per_sm(spec, head_dim, gather))


def launch_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, capacity: int, appended: int,
                   causal: bool, scale: float, num_splits: int, window=(-1, -1), softcap: float = 0.0,
                   cu_seqlens_q=None, max_seqlen_q: int = 0, max_seqlen_k: int = -1, out=None,
                   cache_leftpad=None, sinks=None):
    """(out, lse) of rung `spec`; arguments are validated (`capacity`: keys a sequence can hold, from
    `check_kvcache`) and the new tokens already appended. Packed queries (cu_seqlens_q): q and out
    are (total_q, heads_q, d), lse (heads_q, total_q), and the kernel sees them as a batch of one
    plane (grid sized by max_seqlen_q); otherwise q is (batch, seqlen_q, heads_q, d). max_seqlen_k
    (-1: unknown, the capacity) bounds the keys for the split plan; cache_leftpad (batch,): where
    each sequence's keys start in a dense cache."""
    device, head_dim = q.device, q.shape[-1]
    packed = cu_seqlens_q is not None
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
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
    gather = paged and reads_by_gather(spec, k_cache.shape[1])
    mask = masking.masking(causal, window, softcap, scale)
    if num_splits <= 0:
        keys = capacity if max_seqlen_k < 0 else min(capacity, max_seqlen_k)
        num_splits = plan_splits(spec, batch, seqlen_q, heads_q, heads_kv, keys, mask,
                                 _checks.sm_count(device.index), head_dim, gather)
    planes = 1 if packed else batch
    if num_splits > 1:
        o_partial = torch.empty(num_splits, planes, rows_q, heads_q, head_dim, dtype=torch.float32,
                                device=device)
        lse_partial = torch.empty(num_splits, planes, heads_q, rows_q, dtype=torch.float32, device=device)
    else:
        o_partial, lse_partial = _dummy("o_partial", device, head_dim), _dummy("lse_partial", device)
    leftpad, has_sinks = cache_leftpad is not None, sinks is not None
    sinks = _launch.sinks_ready(sinks) if has_sinks else _launch.stand_in(device, torch.float32)
    fn = _compile.get_kvcache(spec, q.dtype, head_dim, mask.causal, paged, mask.local, mask.softcap,
                              gather, packed, leftpad, has_sinks)
    table = block_table if paged else _dummy("table", device)
    fn(q4, k_cache, v_cache, cache_seqlens, table, out4, lse3, o_partial, lse_partial, mask.scale_log2,
       appended, mask.left, mask.right, mask.softcap_scale, cu, seqlen_q,
       cache_leftpad if leftpad else _launch.stand_in(device), sinks)
    if num_splits > 1:
        _compile.get_combine(q.dtype, head_dim, has_sinks)(o_partial, lse_partial, out4, lse3, sinks)
    return out, lse


def cache_attention(q, k_cache, v_cache, k, v, seqlens, block_table, causal, softmax_scale, window_size,
                    softcap, num_splits, kernel, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
                    out=None, lengths_name="cache_seqlens", cache_leftpad=None, sinks=None):
    """The body of every call against a KV cache: check, check the index values (eager), append,
    launch (directly, or through torch.ops.fa3.attention_kvcache), return (out, lse)."""
    spec, seqlens, capacity, appended, max_q = check_kvcache(
        q, k_cache, v_cache, k, v, seqlens, block_table, kernel, window_size, softcap, cu_seqlens_q,
        max_seqlen_q, lengths_name, cache_leftpad)
    if out is not None:
        _checks.check_output(out, "out", q)
    _checks.check_rung_sinks(spec, sinks, q.shape[-2], q.device)
    if sinks is not None:
        sinks = sinks.detach()  # inference: no gradient flows through a cache call
    window = tuple(window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    max_seqlen_k = -1 if max_seqlen_k is None else int(max_seqlen_k)
    # eager: the index values are checked on the host (where values_checkable(q.device)), unless
    # this thread checked these very tensors, unmodified, last
    if cu_seqlens_q is not None:
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
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity)
    if _dispatch.direct_call_ok(q, k_cache, v_cache) and (sinks is None or _dispatch.direct_call_ok(sinks)):
        out, lse = launch_kvcache(spec, q, k_cache, v_cache, seqlens, block_table, capacity, appended,
                                  bool(causal), scale, int(num_splits), window, softcap, cu_seqlens_q, max_q,
                                  max_seqlen_k, out, cache_leftpad, sinks)
    else:
        result, lse = torch.ops.fa3.attention_kvcache(q, k_cache, v_cache, seqlens, block_table, appended,
                                                      bool(causal), scale, int(num_splits), spec.name,
                                                      window[0], window[1], float(softcap), cu_seqlens_q,
                                                      max_q, max_seqlen_k, cache_leftpad, sinks)
        out = result if out is None else out.copy_(result)  # the op is functional
    if not refuse_first:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return out, lse


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                           cu_seqlens_q=None, max_seqlen_q=None, cache_leftpad=None,
                           causal: bool = False, softmax_scale: float | None = None,
                           window_size=(-1, -1), softcap: float = 0.0, num_splits: int = 0,
                           return_lse: bool = False, kernel: str | None = None, sinks=None):
    """softmax(q K^T * softmax_scale) V over each sequence's cached keys, as flash-attn's
    flash_attn_with_kvcache.

    q: (batch, seqlen_q, heads_q, d), bf16/fp16, d in 64/96/128/192/256, heads_q a multiple of heads_kv;
        or, with cu_seqlens_q, (total_q, heads_q, d): entry b's queries are rows
        [cu_seqlens_q[b], cu_seqlens_q[b + 1]) (several tokens per sequence: speculative verify,
        chunked prefill), max_seqlen_q their longest (None: total_q; it sizes the grid).
    k_cache, v_cache: dense (batch, capacity, heads_kv, d), or paged (num_pages, page_size,
        heads_kv, d) with `block_table` (batch, max_pages) int32 naming each sequence's pages in
        order; any page size (multiples of 64 are read by TMA, others by cp.async row gathers).
    k, v: optional new tokens (batch, new_tokens, heads_kv, d), written into the cache at positions
        cache_seqlens[b] .. cache_seqlens[b] + new_tokens - 1 (in place) before attending (not with
        cu_seqlens_q).
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
                               cache_leftpad=cache_leftpad, sinks=sinks)
    return (out, lse) if return_lse else out


def get_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
                           num_heads_kv: int, headdim: int, cache_seqlens: torch.Tensor,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal: bool = False, window_size=(-1, -1), has_softcap: bool = False,
                           num_splits: int = 0, pack_gqa=None, sm_margin: int = 0) -> torch.Tensor:
    """The split plan of a call against a KV cache, ahead of the call (flash-attn 3's name and
    arguments, as vLLM calls it when it builds a step's metadata).

    fa3's plan is a function of host integers only (plan_splits: batch, longest query run, heads,
    most keys, window, SM count), so there is nothing to precompute on the device: a call with
    these shapes and num_splits=0 derives the same count on the host, in microseconds, with no
    device read, and a captured graph replays it. The plan is returned as an int32 tensor (1,) on
    cache_seqlens' device holding the split count (num_splits if > 0), for code that keeps the
    metadata in a buffer and passes it back as attention_varlen(..., scheduler_metadata=...),
    which accepts and checks it. Arguments that do not change fa3's plan (qkv_dtype, headdim_v,
    cu_seqlens_q, cu_seqlens_k_new, cache_leftpad, page_size, max_seqlen_k_new, pack_gqa) are
    accepted for the signature."""
    if headdim_v not in (None, headdim):
        raise ValueError(f"headdim_v={headdim_v} != headdim={headdim}: fa3 needs the same head_dim for q, k, v")
    if num_heads_kv <= 0 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q={num_heads_q} must be a multiple of num_heads_kv={num_heads_kv}")
    masking.check_window(window_size, 1.0 if has_softcap else 0.0)
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, None, headdim, "q and the cache")
    device = cache_seqlens.device
    if num_splits <= 0:
        mask = masking.masking(bool(causal), tuple(window_size), 1.0 if has_softcap else 0.0, 1.0)
        sms = max(1, _checks.sm_count(device.index if device.index is not None else 0) - sm_margin)
        gather = page_size is not None and reads_by_gather(spec, page_size)
        num_splits = plan_splits(spec, batch_size, max_seqlen_q, num_heads_q, num_heads_kv, max_seqlen_k,
                                 mask, sms, headdim, gather)
    return torch.full((1,), num_splits, dtype=torch.int32, device=device)


def check_scheduler_metadata(metadata, q) -> None:
    """What get_scheduler_metadata returns (or None): an int32 tensor on q's device."""
    if metadata is None:
        return
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32 or metadata.numel() < 1 \
            or metadata.device != getattr(q, "device", None):
        raise ValueError(f"scheduler_metadata must be the int32 tensor fa3.get_scheduler_metadata returns, on "
                         f"{q.device}, got {getattr(metadata, 'dtype', type(metadata).__name__)} "
                         f"{tuple(getattr(metadata, 'shape', ()))} (or pass None: fa3 plans from shapes)")
