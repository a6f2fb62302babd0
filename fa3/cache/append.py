"""New tokens written into a KV cache before attending (flash-attn's k/v of a cache call): equal-length
appends at cache_seqlens[b] onwards, or packed ones by cu_seqlens_k_new; dense or paged caches, FP8
ones as bytes (FP8 tokens) or quantized with the call's descales (bf16 / fp16 tokens). Indices are computed on the device (no sync) and clamped into the cache, so that
values no host check saw (a CUDA graph, torch.compile) never index outside it: torch's index ops
would assert on the device and end the process's CUDA context.
"""

from __future__ import annotations

import torch

from .. import _checks
from ..quantize import E4M3_MAX


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int, descales=None):
    """Write the new tokens at positions cache_seqlens[b] + i (device-side indices: no sync).
    descales: an FP8 cache's (k_descale, v_descale), float32 (batch, heads_kv), which 16-bit new
    tokens are quantized with (_write_tokens).

    torch's index ops assert on the device for an index outside the tensor, which ends the
    process's CUDA context; so the first position is clamped to [0, capacity - new_tokens] and page
    indices to [0, num_pages) (in the ops that convert them anyway: no extra kernel). Checked
    values are unchanged; unchecked bad ones (CUDA-graph capture, torch.compile) write inside the
    cache."""
    batch, new = k.shape[:2]
    positions = cache_seqlens.clamp(0, capacity - new)[:, None] + torch.arange(new, device=k.device)
    entries = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
    _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table, descales)


def append_packed(k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new, block_table, capacity: int,
                  descales=None):
    """Packed appends: sequence b's new tokens, rows [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1])
    of k and v, written at positions cache_seqlens[b] + i; returns the lengths after the append
    (int32 (batch,)), which the kernel attends over. Device-side indices (no sync); as in
    append_to_cache, unchecked bad values are clamped into the cache: each row's sequence to
    [0, batch), its position to [0, capacity). descales: as append_to_cache's."""
    batch, total = cache_seqlens.shape[0], k.shape[0]
    if total and batch:
        rows = torch.arange(total, dtype=torch.int32, device=k.device)
        entries = torch.searchsorted(cu_seqlens_k_new[1:], rows, right=True).clamp_(max=batch - 1)
        positions = (cache_seqlens[entries] + rows - cu_seqlens_k_new[entries]).clamp_(0, capacity - 1)
        _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table, descales)
    return cache_seqlens + (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1])


def quantize_tokens(x, descale):
    """16-bit new tokens x (..., heads_kv, d) for an FP8 cache: x / descale (descale (..., heads_kv),
    each token's sequence's), rounded to nearest e4m3, saturating at +-448 (NaN stays NaN)."""
    return (x.float() / descale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _write_tokens(k_cache, v_cache, k, v, entries, positions, block_table, descales=None):
    """k_cache/v_cache at (sequence entries[i], position positions[i]) = k[i]/v[i] (any matching
    index shapes; positions within the capacity, page indices clamped to the pool); 16-bit k/v
    into an FP8 cache quantized with descales (k_descale, v_descale) (batch, heads_kv) of each
    token's sequence."""
    if k.dtype != k_cache.dtype:  # (check_kvcache: 16-bit tokens for an FP8 cache)
        k, v = quantize_tokens(k, descales[0][entries]), quantize_tokens(v, descales[1][entries])
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
