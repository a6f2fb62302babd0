"""A packed call over a KV cache, split by its entries' query counts: decodes on S1, prompt chunks
on K5 (kernels/k5_cache.py).

A serving step (vLLM's varlen call with seqused_k and block_table) mixes one-query decodes with
chunks of prompts hundreds or thousands of queries long. S1 serves the decodes at memory speed;
the chunks are compute-bound and run about twice as fast on K5.5's warp-specialized kernel. When
the call's longest entry (max_seqlen_q, known on the host) has at least the S1 rung's
`long_queries` queries, one call launches both: S1 for the entries below that count (its
combine, if split, after it), then K5 for the others. Each kernel finds its own entries from
cu_seqlens_q on the GPU: no host sync, and the same launches replay in a CUDA graph.

K5 reads the cache by TMA boxes: whole key blocks of a page (a page size that is a multiple of the
K/V tile) or whole pages (a multiple of 16 rows dividing the tile, vLLM's 16 among them; pages of
8 would need 16 boxes a tile and spill the producer's registers at d128). Other page sizes, FP8
caches and left-padded caches stay on S1 for the whole call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks, _compile_kvcache, _launch, registry
from .kernels import k5_tiles

RUNG = "k5.5"  # the attention rung whose tiles and schedule the chunks run on


@dataclass(frozen=True)
class Plan:
    """K5's static configuration for one call's long entries."""
    min_queries: int  # entries of this many queries or more
    paged: bool
    page_rows: int  # 0: a page holds whole key blocks (or a dense cache); else one box per page


def tiles(head_dim: int, causal: bool, local: bool) -> dict:
    """RUNG's configuration at head_dim with the tiles K5 compiles for a packed batch
    (kernels/k5_tiles.py, which K5 itself applies), so that the page layout is chosen for them."""
    cfg = registry.get(RUNG).config_for(head_dim)
    cfg["tile_m"], cfg["tile_n"] = k5_tiles.adjust(cfg["tile_m"], cfg["tile_n"], head_dim, causal, True, local)
    return cfg


def plan(spec, head_dim: int, page_size: int | None, max_seqlen_q: int, causal: bool, local: bool,
         packed: bool, fp8: bool, offsets: bool) -> Plan | None:
    """How the call's long entries run on K5, or None: the whole call on S1 (no packed queries, no
    entry that long, an FP8 cache, keys at offsets (a left-padded cache, tokens appended in the
    kernel's call), or pages no TMA box fits). page_size: None for a dense cache."""
    min_queries = spec.config.get("long_queries", 0)
    if not (packed and min_queries) or fp8 or offsets or max_seqlen_q < min_queries:
        return None
    tile_n = tiles(head_dim, causal, local)["tile_n"]
    page_rows = 0
    if page_size is not None:
        if page_size % tile_n:
            if tile_n % page_size or page_size % 16:
                return None
            page_rows = page_size
    return Plan(min_queries, page_size is not None, page_rows)


def split_queries(p: Plan | None, max_seqlen_q: int) -> int:
    """The query run S1's split plan counts per entry: the longest, or 1 when the long entries go to
    K5. Then the entries S1 keeps are planned as decodes: a prompt chunk beside three decodes of 30k
    keys took 1.1 ms with the chunk's length counted (one CTA per decode and KV head, each reading
    30k keys); entries of up to long_queries - 1 queries over-split at worst (more, shorter CTAs)."""
    return max_seqlen_q if p is None else 1


def launch(p: Plan, q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, out, lse, mask,
           sinks=None) -> None:
    """K5 over the cache for the entries of p.min_queries queries or more: writes their rows of out
    (total_q, heads_q, d) and lse (heads_q, total_q); arguments validated (cache_seqlens: the keys
    each entry attends to, clamped into the cache by the kernel)."""
    rung = registry.get(RUNG)
    device, head_dim = q.device, q.shape[-1]
    fn = _compile_kvcache.get_cache_prefill(rung, q.dtype, head_dim, mask.causal, p.paged, p.page_rows,
                                            p.min_queries, mask.local, mask.softcap, sinks is not None)
    table = block_table if p.paged else _launch.stand_in(device).view(1, 1)
    fn(_launch.tma_ready(q.unsqueeze(0)), k_cache, v_cache, out.unsqueeze(0), lse.unsqueeze(0), mask.scale_log2,
       _checks.HOPPER_SMS[device], _launch.tile_counter(rung, mask.causal, device), cu_seqlens_q, cache_seqlens,
       table, mask.left, mask.right, mask.softcap_scale,
       _launch.stand_in(device, torch.float32) if sinks is None else sinks)
