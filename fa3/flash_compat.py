"""flash-attn's function names and signatures on fa3, so that moving is changing an import:

    from fa3 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Arguments mean what they mean in flash-attn 2 (positional order included) and the results come
back as flash-attn returns them. What fa3 does not implement is refused with a message naming the
argument, never ignored: dropout_p > 0, alibi_slopes, return_attn_probs (the probability matrix is
never formed), and the KV-cache options rotary_cos/sin and cache_batch_idx. cu_seqlens_k_new
gives the offsets of packed new k/v; without new k/v it describes nothing and is ignored, as
flash-attn 3 does (SGLang passes it on every call).
flash-attn 3's serving keywords (seqused_k, block_table or page_table, out, num_splits,
scheduler_metadata, cu_seqlens_q on the cache call) are taken, attention sinks under the
names callers use (learnable_sink, s_aux, sinks), and MLA decode's qv over a cache (q_v: vLLM's name).
Everything else is validated by the fa3 function each one calls.
"""

from __future__ import annotations

import torch

from . import _checks
from .interface import attention
from .kvcache import attention_with_kvcache
from .cache.split_plan import check_scheduler_metadata, split_count
from .varlen import attention_varlen


def _refuse(name: str, given, unset, why: str) -> None:
    if given is not unset and given != unset:
        raise NotImplementedError(f"{name}={given!r} is not supported by fa3 ({why}); leave it at {unset!r}")


def _check_fa3_options(qv=None, attention_chunk=0, sm_margin=0, seqused_q=None) -> None:
    """flash-attn 3's options beyond flash-attn 2's, at the values fa3 implements (pack_gqa, a hint,
    is accepted by the callers: fa3 packs the query heads of a KV head where that pays). `qv`: given
    only where it cannot apply (no KV cache)."""
    if qv is not None:
        raise NotImplementedError("qv (DeepSeek's absorbed MLA query) is supported over a KV cache: "
                                  "flash_attn_with_kvcache(..., qv=), or flash_attn_varlen_func with "
                                  "seqused_k (and block_table) and qv=; leave it at None here")
    if seqused_q is not None:
        raise NotImplementedError("seqused_q is not supported by fa3: the queries of entry b are all of "
                                  "cu_seqlens_q's rows [b, b + 1); leave it at None")
    _refuse("attention_chunk", attention_chunk, 0, "chunked local attention is not implemented; a sliding "
            "window is (window_size)")
    _refuse("sm_margin", sm_margin, 0, "fa3's kernels and split plan use every SM")


def _check_common(dropout_p, alibi_slopes, return_attn_probs):
    _refuse("dropout_p", dropout_p, 0.0, "attention dropout is not implemented; apply dropout elsewhere")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by fa3 (no ALiBi bias); leave it at None")
    _refuse("return_attn_probs", return_attn_probs, False,
            "the attention probabilities are never materialized; use fa3.attention(..., return_lse=True) "
            "for the log-sum-exp")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    learnable_sink=None, q_descale=None, k_descale=None, v_descale=None, qv=None,
                    attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0):
    """flash_attn.flash_attn_func: q (batch, seqlen_q, heads_q, d), k and v (batch, seqlen_k,
    heads_kv, d) -> out shaped like q. Differentiable (window and softcap included).
    learnable_sink: flash-attn-4's name for attention sinks (fa3.attention's `sinks`: float32
    (heads_q,); a 16-bit one is cast). q/k/v_descale (flash-attn 3's): with float8_e4m3fn q, k, v,
    fa3's FP8 forward; with 16-bit inputs they are not read, as in flash-attn. flash-attn 3's other
    keywords are taken at the values fa3 implements: num_splits and pack_gqa (speed hints; the
    result is the same), qv None, attention_chunk and sm_margin 0."""
    _check_common(dropout_p, alibi_slopes, return_attn_probs)
    _check_fa3_options(qv, attention_chunk, sm_margin)
    del num_splits, pack_gqa  # (keys are split only over a KV cache; GQA packing is fa3's choice)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, deterministic=deterministic, sinks=_sinks(learnable_sink=learnable_sink),
                     **_descales(q, k, q_descale, k_descale, v_descale))


def _sinks(**named):
    """Attention sinks under whichever name the caller uses (flash-attn-4's learnable_sink, vLLM's
    s_aux, SGLang's sinks; at most one): fa3's float32 `sinks`, 16-bit ones cast differentiably
    (flash-attn-4 and the models keep them in the model's dtype)."""
    given = {name: t for name, t in named.items() if t is not None}
    if len(given) > 1:
        raise ValueError(f"attention sinks given twice ({' and '.join(given)}); pass one of them")
    sinks = next(iter(given.values()), None)
    if sinks is not None and getattr(sinks, "dtype", None) in (torch.bfloat16, torch.float16):
        return sinks.float()
    return sinks


def _qv(qv, q_v):
    """MLA's absorbed query under flash-attn 3's name (qv) or vLLM's fork's (q_v); at most one."""
    if qv is not None and q_v is not None:
        raise ValueError("qv given twice (qv and q_v, vLLM's name for it); pass one of them")
    return q_v if qv is None else qv


def _splits(num_splits) -> dict:
    """flash-attn 3's num_splits is a cap (its scheduler picks each sequence's count from the lengths,
    up to it; vLLM passes 16 under full CUDA graphs, for every batch): fa3's max_splits. 1 (no split)
    and 0 (planned) mean the same in both."""
    # (anything but an integer goes on as num_splits, which split_request refuses)
    return {"max_splits": num_splits} if split_count(num_splits) > 1 else {"num_splits": num_splits}


def _descales(q, k, q_descale, k_descale, v_descale) -> dict:
    """FP8 descale factors as fa3's keywords: flash-attn applies them to FP8 inputs only, and so
    does this: all three with FP8 q; k_descale and v_descale with 16-bit q over an FP8 cache (k);
    none otherwise (what is not passed on is checked to be a tensor or None, and not read)."""
    named = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if getattr(q, "dtype", None) in _checks.FP8_LIKE:
        return named
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    if getattr(k, "dtype", None) in _checks.FP8_LIKE:
        return {"k_descale": k_descale, "v_descale": v_descale}
    return {}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, *, seqused_k=None, return_softmax_lse=False, out=None,
                           scheduler_metadata=None, num_splits=0, q_descale=None, k_descale=None,
                           v_descale=None, fa_version=None, s_aux=None, learnable_sink=None, seqused_q=None,
                           qv=None, attention_chunk=0, pack_gqa=None, sm_margin=0, q_v=None):
    """flash_attn.flash_attn_varlen_func: q (total_q, heads_q, d), k and v (total_k, heads_kv, d),
    int32 cumulative offsets -> out shaped like q; differentiable (as fa3.attention_varlen).

    Over a KV cache, as vLLM calls it (keywords of flash-attn 3 / vllm_flash_attn): k and v the
    cache (paged with block_table, any page size, or dense), seqused_k int32 (batch,) each
    sequence's keys, cu_seqlens_k None, out= a preallocated output, num_splits (at most that many, as
    flash-attn 3 reads it: fa3's max_splits; 0: planned from
    shapes), scheduler_metadata (fa3.get_scheduler_metadata), return_softmax_lse -> (out, lse).
    FP8 descales: with float8_e4m3fn q, k, v (packed, no cache), fa3's FP8 forward; over an FP8
    cache, k_descale and v_descale its descales, and q_descale FP8 q's (with bf16 / fp16 q it is
    not read); with 16-bit inputs they are not read, as in flash-attn. s_aux (vLLM's name) or
    learnable_sink (flash-attn-4's): attention sinks, fa3's `sinks`. qv (or q_v, vLLM's name): MLA
    decode over the cache (k the rotary keys, v the latent; fa3.attention_with_kvcache's qv)."""
    _check_common(dropout_p, alibi_slopes, return_attn_probs)
    qv = _qv(qv, q_v)
    over_cache = block_table is not None or seqused_k is not None
    _check_fa3_options(None if over_cache else qv, attention_chunk, sm_margin, seqused_q)
    del pack_gqa  # a hint: fa3 packs the query heads of a KV head where that pays
    descales = _descales(q, k, q_descale, k_descale, v_descale)
    _refuse("fa_version", fa_version, None if fa_version is None else 3, "fa3 is FlashAttention-3")
    window_size = (-1, -1) if window_size is None else window_size  # (flash-attn 3's default)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, block_table=block_table, seqused_k=seqused_k,
                            out=out, **_splits(num_splits), scheduler_metadata=scheduler_metadata,
                            return_lse=return_softmax_lse,
                            sinks=_sinks(s_aux=s_aux, learnable_sink=learnable_sink),
                            **({"qv": qv} if qv is not None else {}), **descales)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, page_table=None, cu_seqlens_q=None,
                            max_seqlen_q=None, cu_seqlens_k_new=None, scheduler_metadata=None,
                            q_descale=None, k_descale=None, v_descale=None, sinks=None, learnable_sink=None,
                            out=None, pack_gqa=None, sm_margin=0, attention_chunk=0, ver=None, qv=None):
    """flash_attn.flash_attn_with_kvcache: new k/v (if given) are written into the cache in place at
    cache_seqlens, then q attends to each sequence's cache -> out, or (out, softmax_lse).
    cache_leftpad: where each sequence's keys start in a left-padded dense cache. flash-attn 3's
    keywords too (SGLang's call): page_table (= block_table), cu_seqlens_q and max_seqlen_q (packed
    queries, several per sequence), cu_seqlens_k_new (packed new k/v; ignored without them, as
    flash-attn 3 does), scheduler_metadata,
    FP8 descales (an FP8 cache: float8_e4m3fn k_cache, v_cache, with FP8 q or bf16 / fp16 q, whose
    q_descale is then not read; none is read with a 16-bit cache), sinks
    (SGLang's name) or learnable_sink (flash-attn-4's): attention sinks, fa3's `sinks`; out= a
    preallocated output; pack_gqa (a hint: fa3's cache kernel always packs the query heads of a KV
    head), sm_margin and attention_chunk at their defaults, and ver (SGLang's kernel selector) 3.
    qv (keyword): MLA decode (fa3.attention_with_kvcache's qv; k_cache the rotary keys, v_cache
    the latent)."""
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by fa3's flash_attn_with_kvcache; leave it "
                                      f"at None (apply rotary embeddings to q and k before the call)")
    if cu_seqlens_k_new is not None:
        # the offsets of packed new k/v; with none to append flash-attn 3 never reads them (SGLang
        # passes its cache lengths' offsets so): dropped there
        if not isinstance(cu_seqlens_k_new, torch.Tensor):
            raise TypeError(f"cu_seqlens_k_new must be a tensor or None, not {type(cu_seqlens_k_new).__name__}")
        if k is None and v is None:
            cu_seqlens_k_new = None
    del rotary_interleaved, pack_gqa  # only meaningful with rotary_cos/sin; a hint fa3 always follows
    _refuse("ver", ver, None if ver is None else 3, "fa3 is FlashAttention-3: ver=4 selects flash-attn-4 in SGLang")
    _check_fa3_options(attention_chunk=attention_chunk, sm_margin=sm_margin)
    if page_table is not None:
        if block_table is not None:
            raise ValueError("pass block_table or page_table (the same argument), not both")
        block_table = page_table
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required by fa3 (int32 (batch,) or an int: the tokens each "
                         "sequence already holds in the cache)")
    check_scheduler_metadata(scheduler_metadata, q)
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                                  max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new,
                                  cache_leftpad=cache_leftpad, causal=causal,
                                  softmax_scale=softmax_scale,
                                  window_size=window_size, softcap=softcap, **_splits(num_splits),
                                  return_lse=return_softmax_lse, sinks=_sinks(sinks=sinks, learnable_sink=learnable_sink),
                                  out=out, **({"qv": qv} if qv is not None else {}),
                                  **_descales(q, k_cache, q_descale, k_descale, v_descale))
