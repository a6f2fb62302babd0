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
caches and left-padded caches stay on S1 for the whole call. Which entries K5 takes, and on which
tiles, is the call's plan (fa3.cache.split_plan: prefill_plan); this module launches it.
"""

from __future__ import annotations

import torch

from .. import _checks, _launch, registry
from ..compile import kvcache as _compile_kvcache
from . import split_plan

def launch(p: split_plan.PrefillPlan, q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, out, lse, mask,
           sinks=None) -> None:
    """K5 over the cache for the entries of p.min_queries queries or more: writes their rows of out
    (total_q, heads_q, d) and lse (heads_q, total_q); arguments validated (cache_seqlens: the keys
    each entry attends to, clamped into the cache by the kernel)."""
    rung = registry.get(split_plan.PREFILL_RUNG)
    device, head_dim = q.device, q.shape[-1]
    fn = _compile_kvcache.get_cache_prefill(rung, q.dtype, head_dim, mask.causal, p.paged, p.page_rows,
                                            p.min_queries, mask.local, mask.softcap, sinks is not None)
    table = block_table if p.paged else _launch.stand_in(device).view(1, 1)
    fn(_launch.tma_ready(q.unsqueeze(0)), k_cache, v_cache, out.unsqueeze(0), lse.unsqueeze(0), mask.scale_log2,
       _checks.HOPPER_SMS[device], _launch.tile_counter(rung, mask.causal, device), cu_seqlens_q, cache_seqlens,
       table, mask.left, mask.right, mask.softcap_scale,
       _launch.stand_in(device, torch.float32) if sinks is None else sinks)
