"""fa3.attention_varlen: a packed batch of sequences of different lengths, as flash-attn's
flash_attn_varlen_func.

q (total_q, heads_q, d) and k, v (total_k, heads_kv, d) hold every sequence back to back; int32
cu_seqlens_q/k (batch + 1,) give where each starts (sequence b is rows [cu[b], cu[b + 1])). No
padding is computed: the kernel (k5 compiled with varlen=True) numbers the Q tiles sequence by
sequence from the offsets on the GPU and stores O only inside each sequence.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, backward, fp8, index_checks, kvcache, masking, mla
from .cache import split_plan
from .varlen_checks import check_varlen, check_varlen_rung


def packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_size, softcap, kernel, check_values=True, deterministic=False,
                     backward_kernel=None, out=None, sinks=None):
    """attention_varlen's body: (out, lse) of a packed batch. check_values=False: for callers that
    built the offsets themselves from a mask (correct by construction), skipping the host copy
    that checks them (fa3.integrations.transformers)."""
    spec = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel, check_values)
    if out is not None:
        _checks.check_output(out, "out", _checks.output_like(q, v), (("q", q), ("k", k), ("v", v)))
    scale = 1.0 / math.sqrt(q.shape[2]) if softmax_scale is None else float(softmax_scale)
    window = tuple(window_size)
    masking.check_window(window, softcap)
    _checks.check_rung_sinks(spec, sinks, q.shape[1], q.device)
    # the longest query sequence picks the tiles of short ones; a value that is not a Python int
    # (unchecked, e.g. a tensor) takes the long tiles, as an unknown one does
    rows = max_seqlen_q if isinstance(max_seqlen_q, int) else None
    if _dispatch.direct_call_ok(q, k, v) and (sinks is None or _dispatch.direct_call_ok(sinks)):
        with _dispatch.op_range("fa3::attention_varlen"):
            return launch_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, bool(causal), scale, window,
                                 softcap, out, sinks, rows)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or getattr(sinks, "requires_grad", False))
    # v's head dim matters to the backward only when there is one (a forward rung took it already)
    bwd = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[2], bool(deterministic),
                              v.shape[2] if needs_grad else None, masking.masked(causal, window))
    if needs_grad:
        check_varlen_rung(bwd, "backward_kernel")
        _dispatch.check_variants(bwd, masking.masking(bool(causal), window, softcap, scale), "backward_kernel")
        if out is None and sinks is None and _dispatch.eager_autograd_ok(q, k, v, cu_seqlens_q, cu_seqlens_k) \
                and q.device in _checks.HOPPER_SMS:  # fa3's own Function (not traced: no guard on the devices)
            causal = bool(causal)
            forward = lambda q, k, v: launch_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                                    window, softcap, max_seqlen_q=rows)
            gradients = backward.packed_gradients(bwd, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                                  bool(deterministic), window, float(softcap))
            with _dispatch.op_range("fa3::attention_varlen"):
                return backward.DifferentiableAttention.apply(forward, gradients,
                                                              "fa3::attention_varlen_backward", q, k, v)
    result, lse = torch.ops.fa3.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, bool(causal), scale,
                                                 window[0], window[1], float(softcap), spec.name,
                                                 bool(deterministic), bwd.name, sinks, rows or 0)
    return (result if out is None else out.copy_(result)), lse  # (the op is functional)


def launch_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float,
                  window=(-1, -1), softcap: float = 0.0, out=None, sinks=None, max_seqlen_q=None):
    """(out (total_q, heads_q, d_v), lse (heads_q, total_q) fp32); arguments validated (`out`: a
    checked preallocated output, or None; max_seqlen_q: the longest query sequence where known,
    which picks the rung's tiles for short ones)."""
    total_q, heads_q, head_dim = q.shape
    head_dim_v = v.shape[2]
    if out is None:
        out = _launch.empty_output(q, v)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[0] == 0:  # no keys anywhere: O = 0, LSE = -inf (or the sinks)
        return out.zero_(), _launch.no_keys(lse, sinks)
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = _launch.detached(q, k, v)
    if sinks is not None:
        sinks = _launch.sinks_ready(sinks)
    # the kernel takes flash-attn's 4-D layout with one batch entry holding every sequence
    q4, k4, v4 = (_launch.tma_ready(t.unsqueeze(0)) for t in (q, k, v))
    args = [q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0)]
    _launch.run_attention(spec, q.dtype, head_dim, masking.masking(causal, window, softcap, scale),
                          args, q.device, cu_seqlens=(cu_seqlens_q, cu_seqlens_k), sinks=sinks,
                          head_dim_v=None if head_dim_v == head_dim else head_dim_v, rows=max_seqlen_q)
    return out, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                     causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                     softcap: float = 0.0, return_lse: bool = False, kernel: str | None = None,
                     deterministic: bool = False, backward_kernel: str | None = None,
                     block_table=None, seqused_k=None, out=None, num_splits: int = 0,
                     scheduler_metadata=None, sinks=None, q_descale=None, k_descale=None,
                     v_descale=None, max_splits: int = 0, qv=None):
    """Attention over a packed batch of variable-length sequences, as flash_attn_varlen_func.

    q: (total_q, heads_q, d); k, v: (total_k, heads_kv, d); bf16/fp16 on a Hopper GPU, d in
    64/96/128/192/256 (v's may differ as fa3.attention's), heads_q a multiple of heads_kv. cu_seqlens_q/k: int32 (batch + 1,) offsets,
    starting at 0, non-decreasing, ending at total_q/total_k; sequences may be empty.
    max_seqlen_q/k: accepted for flash-attn's signature and checked; the kernel does not need them.
    causal, window_size, softcap, softmax_scale: as fa3.attention, per sequence (bottom-right
    aligned to each sequence's own lengths).
    deterministic, backward_kernel, sinks: as fa3.attention (the backward's dQ order; its rung;
        attention sinks, one float32 logit per query head).
    out: optional preallocated output (total_q, heads_q, d_v), contiguous; it is returned.
    Returns out (total_q, heads_q, d) (and lse (heads_q, total_q) fp32, flash-attn's varlen layout).

    Over a KV cache (what serving engines call once per layer and step, vLLM's call): k and v are
    the cache, paged (num_pages, page_size, heads_kv, d) with `block_table` (batch, max_pages)
    int32, any page size, or dense (batch, capacity, heads_kv, d) without it; `seqused_k` int32
    (batch,) is the keys each sequence holds (its first seqused_k[b] cache positions) and
    cu_seqlens_k is None. The queries mix any lengths (a decode is a one-token entry, a chunk of
    a prefill a longer one); causal aligns each entry's queries to the end of its keys.
    max_seqlen_q bounds the grid (None: total_q), max_seqlen_k the keys for the split plan (None:
    the capacity); num_splits: CTAs per sequence's keys (0: planned from these shapes; see
    fa3.get_scheduler_metadata), max_splits: at most that many (as attention_with_kvcache's; without
    a cache neither applies: keys are not split). No host
    sync (the eager value checks are deferred, as fa3.attention_with_kvcache's, and skipped under
    CUDA-graph capture and torch.compile; the kernel clamps), so the call captures in a CUDA graph at
    fixed shapes. Inference only.

    qv: over a KV cache only, MLA decode (vLLM's FlashAttention MLA call): qv (total_q, heads_q,
    d_v), k the cache's rotary keys (64 wide), v its latent (512 wide), out (total_q, heads_q, d_v)
    (fa3.attention_with_kvcache's qv; entries of any lengths up to max_seqlen_q).

    FP8: float8_e4m3fn q, k, v with q/k/v_descale float32 (sequences, heads_kv) (or one element),
    as fa3.attention's FP8 forward (forward only; output bf16 or out='s dtype); over a KV cache, an
    FP8 cache (fa3.attention_with_kvcache's: vLLM's call with an FP8 cache).

    Without a cache: differentiable in q, k and v, as fa3.attention (the backward rungs compile
    packed batches too). The offsets' values are checked on the host without a sync
    (fa3.set_index_checks: a copy behind the kernels, raised by a later call), except while a
    CUDA graph is captured or torch.compile traces; the kernels clamp them.
    """
    index_checks.raise_pending()  # an earlier call's bad index values (deferred checks)
    if block_table is not None or seqused_k is not None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k must be None with block_table/seqused_k: the keys of entry b "
                             "are the first seqused_k[b] positions of its cache (flash-attn's convention)")
        if seqused_k is None:
            raise ValueError("seqused_k is required with block_table: int32 (batch,), the keys each "
                             "sequence holds in the cache")
        split_plan.check_scheduler_metadata(scheduler_metadata, q)
        if qv is not None:
            mla.refuse_options(window_size, softcap, sinks, None, None, (q_descale, k_descale, v_descale))
            out, lse = mla.mla_attention(q, qv, k, v, None, None, seqused_k, block_table, causal, softmax_scale,
                                         split_plan.split_request(num_splits, max_splits), kernel, cu_seqlens_q,
                                         max_seqlen_q, max_seqlen_k, out, lengths_name="seqused_k",
                                         keep_lse=return_lse)
            return (out, lse) if return_lse else out
        out, lse = kvcache.cache_attention(q, k, v, None, None, seqused_k, block_table, causal, softmax_scale,
                                           window_size, softcap, split_plan.split_request(num_splits, max_splits),
                                           kernel, cu_seqlens_q, max_seqlen_q, max_seqlen_k, out,
                                           lengths_name="seqused_k", sinks=sinks,
                                           descales=(q_descale, k_descale, v_descale), keep_lse=return_lse)
        return (out, lse) if return_lse else out
    if qv is not None:
        raise ValueError("qv (MLA's absorbed query) applies to attention over a KV cache: pass the cache as k "
                         "(rotary keys) and v (latent) with seqused_k (and block_table), or use "
                         "fa3.attention_with_kvcache(..., qv=qv)")
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required (int32 (batch + 1,) offsets of k and v), unless k and v "
                         "are a KV cache read through seqused_k (and block_table)")
    split_plan.check_scheduler_metadata(scheduler_metadata, q)  # (no split plan without a cache)
    if fp8.is_fp8_call(q, q_descale, k_descale, v_descale):
        return fp8.attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                                 softmax_scale=softmax_scale, window=window_size, softcap=softcap,
                                 return_lse=return_lse, kernel=kernel, out=out, sinks=sinks,
                                 cu_seqlens=(cu_seqlens_q, cu_seqlens_k),
                                 max_seqlens=(max_seqlen_q, max_seqlen_k))
    out, lse = packed_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                softmax_scale, window_size, softcap, kernel, deterministic=deterministic,
                                backward_kernel=backward_kernel, out=out, sinks=sinks)
    return (out, lse) if return_lse else out
