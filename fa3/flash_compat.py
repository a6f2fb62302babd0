"""flash-attn's function names and signatures on fa3, so that moving is changing an import:

    from fa3 import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Arguments mean what they mean in flash-attn 2 (positional order included) and the results come
back as flash-attn returns them. What fa3 does not implement is refused with a message naming the
argument, never ignored: dropout_p > 0, alibi_slopes, return_attn_probs (the probability matrix is
never formed), and the KV-cache options rotary_cos/sin, cache_batch_idx and cache_leftpad.
Everything else is validated by the fa3 function each one calls.
"""

from __future__ import annotations

import torch

from .interface import attention
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen


def _refuse(name: str, given, unset, why: str) -> None:
    if given is not unset and given != unset:
        raise NotImplementedError(f"{name}={given!r} is not supported by fa3 ({why}); leave it at {unset!r}")


def _check_common(dropout_p, alibi_slopes, return_attn_probs):
    _refuse("dropout_p", dropout_p, 0.0, "attention dropout is not implemented; apply dropout elsewhere")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by fa3 (no ALiBi bias); leave it at None")
    _refuse("return_attn_probs", return_attn_probs, False,
            "the attention probabilities are never materialized; use fa3.attention(..., return_lse=True) "
            "for the log-sum-exp")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    learnable_sink=None):
    """flash_attn.flash_attn_func: q (batch, seqlen_q, heads_q, d), k and v (batch, seqlen_k,
    heads_kv, d) -> out shaped like q. Differentiable (window and softcap included).
    learnable_sink: flash-attn-4's name for attention sinks (fa3.attention's `sinks`: float32
    (heads_q,); a 16-bit one is cast)."""
    _check_common(dropout_p, alibi_slopes, return_attn_probs)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, deterministic=deterministic, sinks=_sinks(learnable_sink))


def _sinks(learnable_sink):
    """flash-attn-4 keeps its sinks in the model's dtype: cast (differentiably) to fa3's float32."""
    if learnable_sink is not None and getattr(learnable_sink, "dtype", None) in (torch.bfloat16, torch.float16):
        return learnable_sink.float()
    return learnable_sink


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, *, learnable_sink=None):
    """flash_attn.flash_attn_varlen_func: q (total_q, heads_q, d), k and v (total_k, heads_kv, d),
    int32 cumulative offsets -> out shaped like q; differentiable (as fa3.attention_varlen)."""
    _check_common(dropout_p, alibi_slopes, return_attn_probs)
    if block_table is not None:
        raise NotImplementedError("block_table in flash_attn_varlen_func is not supported by fa3; for a "
                                  "paged cache use flash_attn_with_kvcache")
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, sinks=_sinks(learnable_sink))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None):
    """flash_attn.flash_attn_with_kvcache: new k/v (if given) are written into the cache in place at
    cache_seqlens, then q attends to each sequence's cache -> out, or (out, softmax_lse)."""
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by fa3's flash_attn_with_kvcache; leave it "
                                      f"at None (apply rotary embeddings to q and k before the call)")
    del rotary_interleaved  # only meaningful with rotary_cos/sin
    if cache_seqlens is None:
        raise ValueError("cache_seqlens is required by fa3 (int32 (batch,) or an int: the tokens each "
                         "sequence already holds in the cache)")
    return attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                  window_size=window_size, softcap=softcap, num_splits=num_splits,
                                  return_lse=return_softmax_lse, sinks=_sinks(learnable_sink))
