"""fa3.attention_with_kvcache: decode (and short appends) against a dense or paged KV cache.

flash-attn's `flash_attn_with_kvcache` conventions: q (batch, seqlen_q, heads_q, d); a dense cache
(batch, capacity, heads_kv, d) or a paged one (num_pages, page_size, heads_kv, d) with
`block_table` (batch, max_pages) int32; new k/v are written into the cache at `cache_seqlens`
(in place) before attending. The kernel (kernels/decode.py) packs the query heads of each KV head
into one tile and splits the key range across CTAs; `num_splits=0` picks the split count from
shapes alone (no host sync: CUDA graphs capture the call).

Eager calls check the values of cache_seqlens and block_table on the host (fa3.index_checks: one
small copy); captured and traced calls cannot, and rely on clamping: the kernel clamps lengths to
[0, capacity] and page indices to [0, num_pages), append_to_cache the append's positions.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _compile, _dispatch, _launch, index_checks, masking, registry

PAGE_MULTIPLE = 64  # the kernel's key block: a page holds whole blocks
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed costs outweigh the keys it reads


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, kernel, window_size, softcap):
    """attention_with_kvcache's arguments; returns (spec, cache_seqlens as an int32 tensor, capacity,
    new tokens)."""
    _checks.check_tensor(q, "q", 4)
    _checks.check_tensor(k_cache, "k_cache", 4, q.dtype)
    _checks.check_tensor(v_cache, "v_cache", 4, q.dtype)
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
            raise ValueError(f"a dense k_cache must have batch {batch} (q's) in dimension 0, got "
                             f"{planes}; for a paged cache pass block_table")
        capacity = rows
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
                or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 tensor of shape (batch={batch}, max_pages), "
                             f"got {getattr(block_table, 'dtype', type(block_table))} "
                             f"{tuple(getattr(block_table, 'shape', ()))}: use .to(torch.int32)")
        if block_table.device != q.device or block_table.stride(-1) != 1:
            raise ValueError(f"block_table must be on {q.device} and contiguous in its last dimension")
        if rows % PAGE_MULTIPLE:
            raise ValueError(f"page_size={rows} (k_cache.shape[1]) is not supported: fa3 needs pages of "
                             f"a multiple of {PAGE_MULTIPLE} tokens")
        capacity = block_table.shape[1] * rows
    appended = 0
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new tokens to append), or neither")
    if k is not None:
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
    cache_seqlens = _seqlens_tensor(cache_seqlens, batch, q.device, capacity, appended, block_table, rows)
    spec = _dispatch.memo_rung(_dispatch.family_rung, registry.KVCACHE, kernel, head_dim,
                               "q and the cache")
    _checks.check_hopper(q.device, "q")
    return spec, cache_seqlens, capacity, appended


def _seqlens_tensor(cache_seqlens, batch, device, capacity, appended, block_table, page_size):
    if isinstance(cache_seqlens, int):  # a host value: checked in every call
        index_checks.check_cache_lengths([cache_seqlens], capacity, appended, block_table, page_size,
                                         indexed=False)
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must be an int or an int32 tensor of shape (batch={batch},), "
                         f"got {getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                         f"{tuple(getattr(cache_seqlens, 'shape', ()))}: use .to(torch.int32)")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
    return cache_seqlens.contiguous()


def num_splits_for(batch, heads_kv, q_tiles, capacity, sm_count, tile_n=64) -> int:
    """Splits of the key range so that batch x heads_kv x q_tiles x splits CTAs fill the SMs (one
    CTA per SM: the TMA ring takes most of the SMEM), each split keeping at least
    MIN_BLOCKS_PER_SPLIT key blocks of the cache's capacity. From shapes only: no host sync."""
    ctas = batch * heads_kv * q_tiles
    if ctas >= 0.8 * sm_count:
        return 1
    blocks = -(-capacity // tile_n)
    # round down: one CTA past the SM count would run alone in a second wave
    return max(1, min(MAX_SPLITS, sm_count // ctas, blocks // MIN_BLOCKS_PER_SPLIT))


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


def launch_kvcache(spec, q, k_cache, v_cache, cache_seqlens, block_table, capacity: int, appended: int,
                   causal: bool, scale: float, num_splits: int, window=(-1, -1), softcap: float = 0.0,
                   sinks=None):
    """(out, lse) of rung `spec`; arguments are validated (`capacity`: keys a sequence can hold, from
    `check_kvcache`) and the new tokens already appended."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    device = q.device
    out = torch.empty(batch, seqlen_q, heads_q, head_dim, dtype=q.dtype, device=device)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out, lse
    heads_kv = k_cache.shape[2]
    paged = block_table is not None
    mask = masking.masking(causal, window, softcap, scale)
    if num_splits <= 0:
        q_tiles = -(-seqlen_q * (heads_q // heads_kv) // spec.config["tile_m"])
        keys = capacity
        if mask.local:  # a window bounds the keys a query sees, whatever the cache holds
            keys = min(capacity, mask.left + mask.right + seqlen_q)
        num_splits = num_splits_for(batch, heads_kv, q_tiles, keys,
                                    _checks.sm_count(device.index), spec.config["tile_n"])
    if num_splits > 1:
        o_partial = torch.empty(num_splits, batch, seqlen_q, heads_q, head_dim, dtype=torch.float32,
                                device=device)
        lse_partial = torch.empty(num_splits, batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
    else:
        o_partial, lse_partial = _dummy("o_partial", device, head_dim), _dummy("lse_partial", device)
    has_sinks = sinks is not None
    sinks = _launch.sinks_ready(sinks) if has_sinks else _launch.stand_in(device, torch.float32)
    fn = _compile.get_kvcache(spec, q.dtype, head_dim, mask.causal, paged, mask.local, mask.softcap,
                              has_sinks)
    table = block_table if paged else _dummy("table", device)
    fn(q, k_cache, v_cache, cache_seqlens, table, out, lse, o_partial, lse_partial, mask.scale_log2,
       appended, mask.left, mask.right, mask.softcap_scale, sinks)
    if num_splits > 1:
        _compile.get_combine(q.dtype, head_dim, has_sinks)(o_partial, lse_partial, out, lse, sinks)
    return out, lse


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                           causal: bool = False, softmax_scale: float | None = None,
                           window_size=(-1, -1), softcap: float = 0.0, num_splits: int = 0,
                           return_lse: bool = False, kernel: str | None = None, sinks=None):
    """softmax(q K^T * softmax_scale) V over each sequence's cached keys, as flash-attn's
    flash_attn_with_kvcache.

    q: (batch, seqlen_q, heads_q, d), bf16/fp16, d in 64/96/128/192/256, heads_q a multiple of heads_kv.
    k_cache, v_cache: dense (batch, capacity, heads_kv, d), or paged (num_pages, page_size,
        heads_kv, d) with page_size a multiple of 64 and `block_table` (batch, max_pages) int32
        naming each sequence's pages in order.
    k, v: optional new tokens (batch, new_tokens, heads_kv, d), written into the cache at positions
        cache_seqlens[b] .. cache_seqlens[b] + new_tokens - 1 (in place) before attending.
    cache_seqlens: int or int32 (batch,) tensor: valid tokens per sequence before the append, in
        [0, capacity] with cache_seqlens + new_tokens <= capacity (capacity: k_cache.shape[1]
        dense, block_table.shape[1] * page_size paged).
    causal: query i of seqlen_q sees keys up to cache_seqlens + new_tokens - seqlen_q + i (bottom
        right aligned, as flash-attn).
    window_size, softcap: sliding window and capped scores, as fa3.attention (the window is
        aligned the same way, to each sequence's own length).
    num_splits: how many CTAs share each sequence's keys; 0 picks from the shapes and SM count.
    sinks: optional attention sinks, a float32 (heads_q,) tensor, as fa3.attention (not
        differentiated here).
    Returns out (batch, seqlen_q, heads_q, d) (and the fp32 lse (batch, heads_q, seqlen_q)).
    Not differentiable (inference). Runs on torch's current stream, so a decode step can be
    captured in a CUDA graph.

    Bad values: an eager call copies cache_seqlens (and, paged, the smallest and largest page index
    the sequences use) to the host, one small copy and one sync, and raises ValueError naming the
    argument, the batch entry, the value and the bound: a length outside [0, capacity], an append
    past the capacity, or a block_table entry outside [0, num_pages) among the first
    ceil((cache_seqlens[b] + new_tokens) / page_size) of row b (entries past those are never read,
    and may hold anything). An append is refused before it writes. While a CUDA graph is captured
    or torch.compile traces, values cannot be read on the host (nor in direct calls of
    torch.ops.fa3.attention_kvcache): lengths are clamped to [0, capacity] and page indices to
    [0, num_pages), and an append past the capacity writes its tokens at the last new_tokens
    positions (clamped page indices included). The results of bad values are then meaningless,
    but no kernel reads or writes outside its tensors and the CUDA context survives.
    """
    spec, seqlens, capacity, appended = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                      block_table, kernel, window_size, softcap)
    window = tuple(window_size)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if sinks is not None:
        _checks.check_sinks(sinks, q.shape[2], q.device)
        _dispatch.check_sinks(spec, "kernel")
        sinks = sinks.detach()  # inference: no gradient flows through the cache call
    wait = None
    if index_checks.values_checkable(q.device):
        wait = index_checks.start_cache_check(seqlens, block_table, capacity, appended, k_cache.shape[1],
                                              k_cache.shape[0])
    if k is not None:
        if wait is not None:  # refuse before anything is written into the cache
            wait()
            wait = None
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity)
    if _dispatch.direct_call_ok(q, k_cache, v_cache) and (sinks is None or _dispatch.direct_call_ok(sinks)):
        out, lse = launch_kvcache(spec, q, k_cache, v_cache, seqlens, block_table, capacity, appended,
                                  bool(causal), scale, int(num_splits), window, softcap, sinks)
    else:
        out, lse = torch.ops.fa3.attention_kvcache(q, k_cache, v_cache, seqlens, block_table, appended,
                                                   bool(causal), scale, int(num_splits), spec.name,
                                                   window[0], window[1], float(softcap), sinks)
    if wait is not None:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return (out, lse) if return_lse else out
