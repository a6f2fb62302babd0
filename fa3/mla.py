"""MLA decode against a latent KV cache: flash-attn 3's `qv`, as vLLM's FlashAttention MLA backend
and SGLang call it (fa3.attention_with_kvcache(..., qv=), fa3.attention_varlen over a cache with
qv=, and flash-attn's names).

DeepSeek's multi-head latent attention caches, per token, one latent vector (kv_lora_rank = 512
wide: v_cache) and one rotary key (64 wide: k_cache), shared by every query head (heads_kv = 1).
With the key up-projection absorbed into the query, each head's scores are

    S = (q k^T + qv v^T) * softmax_scale,  O = softmax(S) v   (out: v's 512 columns)

q being the rotary part of the query (64 wide) and qv the absorbed one (512 wide). softmax_scale
defaults to 1 / sqrt(64 + 512), as flash-attn 3's (DeepSeek passes its own, 1 / sqrt(192) times
its YaRN factor). The kernel is kernels/mla_decode.py (M1): each KV head's query heads times the
queries packed into 64-row tiles, the key range split across CTAs from shapes alone (no host sync,
so a step captures in a CUDA graph), the partials merged by the combine at 512 columns.

What it takes now: bf16 / fp16, d 64 + 512, any heads_kv dividing heads_q, 1 or more queries a
sequence (packed queries: entries of any lengths up to max_seqlen_q), causal or not, a dense cache
or pages of any size (a multiple of 64 rows: one TMA box a key block; any other, vLLM's 16 or
SGLang's 1: cp.async row gathers), new k / v appended into the cache first. Refused with a message:
FP8 caches and queries, window, softcap, sinks, left padding, packed appends, torch.compile tracing.

Bad index values are handled as every cache call's: the kernel clamps lengths to the capacity and
page indices to the pool, and eager calls check the values on the host behind the kernels
(fa3.index_checks).
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, index_checks, masking
from .cache.append import append_to_cache
from .cache.checks import check_mla
from .cache.split_plan import plan_mla_splits
from .compile import mla as _compile_mla


def default_scale(q, qv) -> float:
    """flash-attn 3's softmax_scale under qv: 1 / sqrt(q's head dim + qv's)."""
    return 1.0 / math.sqrt(q.shape[-1] + qv.shape[-1])


def refuse_options(window_size, softcap, sinks, cache_leftpad, cu_seqlens_k_new, descales) -> None:
    """What an MLA call does not take yet, each refused by name."""
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} with qv: sliding windows are not implemented "
                                  "for MLA decode; leave it at (-1, -1)")
    if softcap:
        raise NotImplementedError(f"softcap={softcap} with qv is not implemented; leave it at 0.0")
    if sinks is not None:
        raise NotImplementedError("sinks with qv are not implemented; leave them at None")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad with qv is not implemented; leave it at None")
    if cu_seqlens_k_new is not None:
        raise NotImplementedError("packed new k/v (cu_seqlens_k_new) with qv are not implemented: pass k and v "
                                  "as (batch, new_tokens, heads_kv, d), or write them into the cache first")
    names = ("q_descale", "k_descale", "v_descale")
    given = [n for n, d in zip(names, descales) if d is not None]
    if given:
        raise NotImplementedError(f"{', '.join(given)} with qv: MLA over an FP8 cache is not implemented yet; "
                                  "pass bf16 / fp16 q, qv and caches without descales")


def is_ragged(cu_seqlens_q, batch: int, total_q: int, max_seqlen_q: int) -> bool:
    """Whether packed queries need the kernel's varlen layout (entries found from cu_seqlens_q on the
    GPU): any but batch entries of max_seqlen_q each (total_q = batch x max_seqlen_q, with no entry
    longer than max_seqlen_q: the deferred index check holds the offsets to that), which it reads
    as (batch, max_seqlen_q) like unpacked queries. Host integers only: a captured graph replays it."""
    return cu_seqlens_q is not None and total_q != batch * max_seqlen_q


def mla_attention(q, qv, k_cache, v_cache, k, v, seqlens, block_table, causal, softmax_scale, num_splits: int,
                  kernel=None, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None, out=None,
                  lengths_name="cache_seqlens", keep_lse: bool = True):
    """(out, lse) of an MLA call (module docstring), the unsupported options already refused
    (refuse_options). num_splits as split_request encodes it. out (..., d_v) like q but v's head
    dim; lse (batch, heads_q, seqlen_q), or (heads_q, total_q) with cu_seqlens_q."""
    spec, seqlens, capacity, appended, batch, seqlen_q = check_mla(
        q, qv, k_cache, v_cache, k, v, seqlens, block_table, kernel, cu_seqlens_q, max_seqlen_q, lengths_name)
    packed = cu_seqlens_q is not None
    ragged = is_ragged(cu_seqlens_q, batch, q.shape[0], seqlen_q)
    d_v = qv.shape[-1]
    out_shape = (*q.shape[:-1], d_v)
    if out is not None:
        inputs = (("q", q), ("qv", qv), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
        _checks.check_output(out, "out", _checks.OutputSpec(torch.Size(out_shape), q.dtype, q.device), inputs)
    scale = default_scale(q, qv) if softmax_scale is None else float(softmax_scale)
    mask = masking.masking(bool(causal), (-1, -1), 0.0, scale)
    if not _dispatch.direct_call_ok(q, qv, k_cache, v_cache, *(t for t in (k, v) if t is not None)):
        if _dispatch.tracing() or any(type(t) is not torch.Tensor for t in (q, qv, k_cache, v_cache)):
            raise NotImplementedError("qv under torch.compile, torch.export or a tensor subclass or mode is not "
                                      "implemented yet: call it eagerly (a CUDA graph captures it)")
        q, qv = q.detach(), qv.detach()  # inference: no gradient flows through a cache call
    # eager: the index values are checked on the host behind the kernels (deferred)
    page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    if packed:
        wait = index_checks.start_packed_cache_check(cu_seqlens_q, q.shape[0], seqlen_q, seqlens, block_table,
                                                     capacity, page_size, num_pages, lengths_name, q.device)
    else:
        wait = index_checks.start_cache_check(seqlens, block_table, capacity, appended, page_size, num_pages,
                                              q.device)
    refuse_first = k is not None or out is not None  # refuse before anything is written
    if refuse_first:
        wait()
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity)
    with _dispatch.op_range("fa3::attention_mla"):
        out, lse = launch_mla(spec, q, qv, k_cache, v_cache, seqlens, block_table, capacity, appended, mask,
                              num_splits, batch, seqlen_q, max_seqlen_k, out, keep_lse,
                              cu_seqlens_q if ragged else None)
    if not refuse_first:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return out, lse


def launch_mla(spec, q, qv, k_cache, v_cache, seqlens, block_table, capacity: int, appended: int, mask,
               num_splits: int, batch: int, seqlen_q: int, max_seqlen_k, out, keep_lse: bool, cu_seqlens_q=None):
    """Plan and launch M1 (and the combine); arguments validated, new tokens appended. Packed q
    of uniform entries (total_q = batch x seqlen_q rows) is viewed as (batch, seqlen_q): its out and
    lse too; cu_seqlens_q given (ragged entries, is_ragged): q is one plane of total_q rows, each
    entry's found by the kernel, seqlen_q their longest (it sizes the grid and the split plan)."""
    device, heads_q, heads_kv, d_v = q.device, q.shape[-2], k_cache.shape[2], qv.shape[-1]
    packed, varlen = q.dim() == 3, cu_seqlens_q is not None
    if out is None:
        out = torch.empty((*q.shape[:-1], d_v), dtype=q.dtype, device=device)
    lse_shape = (heads_q, q.shape[0]) if packed else (batch, heads_q, seqlen_q)
    if out.numel() == 0 or batch == 0:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        return out.zero_(), lse.fill_(float("-inf"))
    # (out is contiguous: allocated here or checked; q and qv are copied where not 16-byte aligned)
    planes, rows = (1, q.shape[0]) if varlen else (batch, seqlen_q)
    q4, qv4, out4 = (_launch.tma_ready(t.view(planes, rows, heads_q, t.shape[-1])) for t in (q, qv, out)) \
        if packed else (_launch.tma_ready(q), _launch.tma_ready(qv), out)
    keys = capacity if max_seqlen_k is None or num_splits < 0 else min(capacity, max(int(max_seqlen_k), 1))
    splits = plan_mla_splits(spec, batch, seqlen_q, heads_q, heads_kv, keys, _checks.HOPPER_SMS[device], num_splits)
    partials = ((splits, planes, rows, heads_q, d_v), (splits, planes, heads_q, rows)) if splits > 1 else ()
    lse, o_partial, lse_partial = _launch.lse_and_partials(lse_shape, partials, keep_lse, device, d_v)
    lse3 = lse.view(heads_q, planes, rows).permute(1, 0, 2) if packed else lse
    paged = block_table is not None
    gather = paged and k_cache.shape[1] % spec.config.base.tile_n != 0  # pages not holding whole key blocks
    fn = _compile_mla.get_mla(spec, q.dtype, mask.causal, paged, gather, varlen, splits > 1)  # (with the combine)
    table = block_table if paged else _launch.stand_in(device).view(1, 1)
    cu = cu_seqlens_q if varlen else _launch.stand_in(device)
    fn(q4, qv4, k_cache, v_cache, seqlens, table, out4, lse3, o_partial, lse_partial, mask.scale_log2, appended, cu,
       seqlen_q if varlen else 0)
    return out, lse
