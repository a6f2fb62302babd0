"""New tokens written into a KV cache before attending (flash-attn's k/v of a cache call): equal-length
appends at cache_seqlens[b] onwards, or packed ones by cu_seqlens_k_new; dense or paged caches, FP8
ones as bytes. Indices are computed on the device (no sync) and clamped into the cache, so that
values no host check saw (a CUDA graph, torch.compile) never index outside it: torch's index ops
would assert on the device and end the process's CUDA context.
"""

from __future__ import annotations

import torch

from . import _checks


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int):
    """Write the new tokens at positions cache_seqlens[b] + i (device-side indices: no sync).

    torch's index ops assert on the device for an index outside the tensor, which ends the
    process's CUDA context; so the first position is clamped to [0, capacity - new_tokens] and page
    indices to [0, num_pages) (in the ops that convert them anyway: no extra kernel). Checked
    values are unchanged; unchecked bad ones (CUDA-graph capture, torch.compile) write inside the
    cache."""
    batch, new = k.shape[:2]
    positions = cache_seqlens.clamp(0, capacity - new)[:, None] + torch.arange(new, device=k.device)
    entries = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
    _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table)


def append_packed(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new, block_table, capacity: int):
    """Packed appends: sequence b's new tokens, rows [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1])
    of k and v, written at positions cache_seqlens[b] + i; returns the lengths after the append
    (int32 (batch,)), which the kernel attends over. Device-side indices (no sync); as in
    append_to_cache, unchecked bad values are clamped into the cache: each row's sequence to
    [0, batch), its position to [0, capacity)."""
    batch, total = cache_seqlens.shape[0], k.shape[0]
    if total and batch:
        rows = torch.arange(total, dtype=torch.int32, device=k.device)
        entries = torch.searchsorted(cu_seqlens_k_new[1:], rows, right=True).clamp_(max=batch - 1)
        positions = (cache_seqlens[entries] + rows - cu_seqlens_k_new[entries]).clamp_(0, capacity - 1)
        _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table)
    return cache_seqlens + (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1])


def _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table):
    """k_cache/v_cache at (sequence entries[i], position positions[i]) = k[i]/v[i] (any matching
    index shapes; positions within the capacity, page indices clamped to the pool)."""
    if block_table is None:
        index = (entries, positions)
    else:
        page_size = k_cache.shape[1]
        pages = block_table[entries, positions // page_size].clamp_(0, k_cache.shape[0] - 1)
        index = (pages, positions % page_size)
    if k_cache.dtype in _checks.FP8_DTYPES:  # (torch's index_put has no FP8 kernel: copy the bytes)
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache[index] = k
    v_cache[index] = v
