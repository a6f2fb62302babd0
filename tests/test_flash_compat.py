"""flash-attn's names: the signatures match flash-attn 2's (names, order, defaults), unsupported
options are refused by name, valid calls reach fa3's own validation (CPU), and on the GPU the
results equal fa3's own entry points. The transformers integration imports without
transformers."""

import inspect
import subprocess
import sys

import pytest
import torch

import fa3
from conftest import raises_with

# flash-attn 2.x signatures (parameter names in order, with defaults); fa3 may make a required one
# optional (flash-attn 3 did: cu_seqlens_k and the max lengths, for calls over a KV cache)
FLASH_ATTN = {
    "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                       "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, "
                              "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                              "softcap=0.0, alibi_slopes=None, deterministic=False, "
                              "return_attn_probs=False, block_table=None",
    "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
                               "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, "
                               "block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), "
                               "softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                               "return_softmax_lse=False",
}
# flash-attn 3's serving keywords (keyword-only after flash-attn 2's parameters), as vLLM and SGLang pass them
FA3_OPTIONS = {"qv", "attention_chunk", "pack_gqa", "sm_margin"}  # flash-attn 3's, at the values fa3 implements
FLASH_ATTN_3_KEYWORDS = {
    "flash_attn_func": {"q_descale", "k_descale", "v_descale", "num_splits"} | FA3_OPTIONS,
    "flash_attn_varlen_func": {"seqused_k", "return_softmax_lse", "out", "scheduler_metadata", "num_splits",
                               "q_descale", "k_descale", "v_descale", "fa_version", "s_aux", "seqused_q",
                               "q_v"} | FA3_OPTIONS,
    "flash_attn_with_kvcache": {"page_table", "cu_seqlens_q", "max_seqlen_q", "cu_seqlens_k_new",
                                "scheduler_metadata", "q_descale", "k_descale", "v_descale", "sinks", "out",
                                "pack_gqa", "sm_margin", "attention_chunk", "ver", "qv"},
}


@pytest.mark.parametrize("name", FLASH_ATTN)
def test_signatures_match_flash_attn(name):
    """flash-attn 2's positional parameters in order, then keyword-only: flash-attn 3's serving
    keywords and the attention sinks under flash-attn-4's name (learnable_sink)."""
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    positional = [p for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
    got = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                    for p in positional)
    assert got == FLASH_ATTN[name] and name in fa3.__all__
    keywords = {p.name: p.default for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}
    assert set(keywords) == FLASH_ATTN_3_KEYWORDS[name] | {"learnable_sink"}
    assert all(default is None for k, default in keywords.items() if k in ("learnable_sink", "s_aux", "sinks"))


def _qkv(batch=1, seqlen=16, heads=2, d=64):
    return [torch.randn(batch, seqlen, heads, d, dtype=torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("option, words", [
    (dict(dropout_p=0.1), ("dropout_p=0.1",)),
    (dict(alibi_slopes=torch.zeros(2)), ("alibi_slopes",)),
    (dict(return_attn_probs=True), ("return_attn_probs=True", "return_lse")),
])
def test_flash_attn_func_refuses_what_fa3_lacks(option, words):
    q, k, v = _qkv()
    raises_with(fa3.flash_attn_func, NotImplementedError, *words, q=q, k=k, v=v, **option)


def test_valid_calls_reach_fa3_validation():
    q, k, v = _qkv()
    raises_with(fa3.flash_attn_func, ValueError, "cpu", q=q, k=k, v=v, causal=True)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    raises_with(fa3.flash_attn_varlen_func, ValueError, "cpu", q=q[0], k=k[0], v=v[0], cu_seqlens_q=cu,
                cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)


@pytest.mark.parametrize("option", ["rotary_cos", "cache_batch_idx", "alibi_slopes"])
def test_kvcache_refuses_what_fa3_lacks(option):
    q, k, v = _qkv()
    raises_with(fa3.flash_attn_with_kvcache, NotImplementedError, option, q=q, k_cache=k, v_cache=v,
                cache_seqlens=4, **{option: torch.zeros(1)})



def test_flash_attn_3_options():
    """Code written for flash-attn 3's interface passes num_splits and pack_gqa (speed hints: taken, the
    call reaches fa3's checks, here refused for its CPU tensors); qv, seqused_q, attention_chunk and
    sm_margin at other values than fa3 implements are refused by name."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    raises_with(fa3.flash_attn_func, ValueError, "cpu", q=q, k=k, v=v, causal=True, num_splits=4, pack_gqa=True)
    raises_with(fa3.flash_attn_varlen_func, ValueError, "cpu", q=q[0], k=k[0], v=v[0], cu_seqlens_q=cu,
                cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16, pack_gqa=False)
    refused = ((dict(qv=q), ("qv",)), (dict(attention_chunk=4096), ("attention_chunk=4096",)),
               (dict(sm_margin=4), ("sm_margin=4",)))
    for option, words in refused:
        raises_with(fa3.flash_attn_func, NotImplementedError, *words, q=q, k=k, v=v, **option)
        raises_with(fa3.flash_attn_varlen_func, NotImplementedError, *words, q=q[0], k=k[0], v=v[0],
                    cu_seqlens_q=cu, cu_seqlens_k=cu, **option)
    raises_with(fa3.flash_attn_varlen_func, NotImplementedError, "seqused_q", q=q[0], k=k[0], v=v[0],
                cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=torch.tensor([16], dtype=torch.int32))

def test_kvcache_takes_sglangs_keywords():
    """SGLang's cache calls pass ver=3 (its kernel selector), out=, and flash-attn 3's pack_gqa; they
    reach fa3's checks (CPU tensors: refused for their device). ver=4 (flash-attn-4), an SM margin and
    chunked local attention are refused by name."""
    q, k, v = _qkv()
    out = torch.empty_like(q)
    raises_with(fa3.flash_attn_with_kvcache, ValueError, "cpu", q=q, k_cache=k, v_cache=v, cache_seqlens=4,
                ver=3, out=out, pack_gqa=True)
    for option, words in ((dict(ver=4), ("ver=4", "flash-attn-4")), (dict(sm_margin=8), ("sm_margin=8",)),
                          (dict(attention_chunk=8192), ("attention_chunk=8192", "window_size"))):
        raises_with(fa3.flash_attn_with_kvcache, NotImplementedError, *words, q=q, k_cache=k, v_cache=v,
                    cache_seqlens=4, **option)

def test_kvcache_cu_seqlens_k_new_without_new_keys_is_ignored():
    """SGLang passes cu_seqlens_k_new on every cache call, with k=v=None (the new tokens are in the
    cache already); flash-attn 3 reads it only beside packed new k/v. So fa3 ignores it there (the
    call reaches attention_with_kvcache's own checks: CPU tensors, refused for their device)."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    raises_with(fa3.flash_attn_with_kvcache, ValueError, "cpu", q=q, k_cache=k, v_cache=v, cache_seqlens=4,
                cu_seqlens_k_new=cu)
    raises_with(fa3.flash_attn_with_kvcache, TypeError, "cu_seqlens_k_new", q=q, k_cache=k, v_cache=v,
                cache_seqlens=4, cu_seqlens_k_new=[0, 16])


def test_kvcache_packed_new_keys_argument_checks():
    """Packed new k/v (cu_seqlens_k_new beside k and v): (total_new, heads_kv, d) rows, offsets of
    batch + 1 int32 entries; well-formed arguments reach the device check (CPU tensors)."""
    q, k_cache, v_cache = _qkv(batch=2, seqlen=32)
    new = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    call = dict(q=q[:, :1], k_cache=k_cache, v_cache=v_cache, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    for fn in (fa3.flash_attn_with_kvcache, fa3.attention_with_kvcache):
        raises_with(fn, ValueError, "cpu", **call, k=new, v=new.clone(), cu_seqlens_k_new=cu)
        raises_with(fn, ValueError, "k must have 3 dimensions", **call, k=new[None], v=new[None], cu_seqlens_k_new=cu)
        raises_with(fn, ValueError, "(total_new, heads_kv=2, head_dim=64)", **call, k=new[:, :1], v=new[:, :1],
                    cu_seqlens_k_new=cu)
        raises_with(fn, ValueError, "cu_seqlens_k_new has 2 entries", "batch + 1 = 3", "q.shape[0]", **call,
                    k=new, v=new.clone(), cu_seqlens_k_new=cu[:2])
        raises_with(fn, ValueError, "cu_seqlens_k_new", "int32", **call, k=new, v=new.clone(),
                    cu_seqlens_k_new=cu.long())
    raises_with(fa3.attention_with_kvcache, ValueError, "cu_seqlens_k_new", "pass k and v", **call,
                cu_seqlens_k_new=cu)
    packed_q = dict(call, q=q[:, :2].flatten(0, 1), cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32))
    raises_with(fa3.attention_with_kvcache, ValueError, "cpu", **packed_q, k=new, v=new.clone(), cu_seqlens_k_new=cu)
    raises_with(fa3.attention_with_kvcache, NotImplementedError, "cu_seqlens_k_new", **packed_q,
                k=new.view(1, 5, 2, 64).expand(2, 5, 2, 64), v=new.view(1, 5, 2, 64).expand(2, 5, 2, 64))


def test_kvcache_needs_cache_seqlens():
    q, k, v = _qkv()
    raises_with(fa3.flash_attn_with_kvcache, ValueError, "cache_seqlens", q=q, k_cache=k, v_cache=v)


@pytest.mark.gpu
def test_results_equal_fa3():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    kw = dict(causal=True, window_size=(64, -1), softcap=10.0)
    assert torch.equal(fa3.flash_attn_func(q, k, v, 0.0, None, **kw), fa3.attention(q, k, v, **kw))
    cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
    packed = [t.reshape(600, 4, 128) for t in (q, k, v)]
    assert torch.equal(fa3.flash_attn_varlen_func(*packed, cu, cu, 300, 300, causal=True),
                       fa3.attention_varlen(*packed, cu, cu, 300, 300, causal=True))
    cache_k, cache_v = k.clone(), v.clone()
    out, lse = fa3.flash_attn_with_kvcache(q[:, :1], cache_k, cache_v, cache_seqlens=300, causal=True,
                                           return_softmax_lse=True)
    ref, ref_lse = fa3.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=300, causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import fa3.integrations.transformers as t; "
            "print(t.REGISTERED)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["False"], proc.stdout + proc.stderr
