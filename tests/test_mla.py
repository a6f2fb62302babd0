"""MLA decode (flash-attn 3's qv): the float reference, the arguments refused on the CPU, and on the
GPU the kernel (M1) against the reference: dense and paged caches (pages of whole 64-key blocks, and
pages of 1, 16, 32, 48 and 80 rows read by row gathers), 1 to n splits, ragged and empty sequences,
causal speculative queries, packed entries of different lengths, 16 and 128 heads, vLLM's call on
views of one 576-wide cache, appends, CUDA graphs replayed with new lengths (and new offsets).

The cache rows past each sequence hold NaN (K and V), so that a kernel reading or weighting them
fails; pages are permuted.
"""

import math

import pytest
import torch

import fa3
from conftest import make_kv_cache, raises_with, rel_err

gpu = pytest.mark.gpu
D, DV = 64, 512  # the rotary part (q, k) and the latent (qv, v): DeepSeek-V2/V3
TOL = 1.5e-2


def mla_reference(q, qv, k, v, lens, causal, scale=None):
    """(out, lse) in float64 of MLA decode over dense caches: q (batch, seqlen_q, heads_q, d), qv
    (..., d_v), k (batch, capacity, heads_kv, d), v (..., d_v); entry b sees its first lens[b] keys,
    scores (q k^T + qv v^T) * scale (default 1 / sqrt(d + d_v)), causal aligned to the bottom right,
    out = softmax(S) v. Rows that see no key: out 0, lse -inf. lse (batch, heads_q, seqlen_q)."""
    batch, seqlen_q, heads_q, d = q.shape
    d_v = qv.shape[-1]
    group = heads_q // k.shape[2]
    scale = 1.0 / math.sqrt(d + d_v) if scale is None else scale
    out = torch.zeros(batch, seqlen_q, heads_q, d_v, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), float("-inf"), dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        kb = k[b, :n].double().repeat_interleave(group, dim=1)  # (n, heads_q, d)
        vb = v[b, :n].double().repeat_interleave(group, dim=1)
        s = (torch.einsum("qhd,khd->hqk", q[b].double(), kb) + torch.einsum("qhd,khd->hqk", qv[b].double(), vb)) * scale
        if causal:
            visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(seqlen_q, device=q.device)[:, None] + n - seqlen_q
            s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # (heads_q, seqlen_q)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)  # (rows with no key: 0)
        out[b] = torch.einsum("hqk,khd->qhd", p, vb)
        lse[b] = row_lse
    return out, lse


def test_reference_is_attention_over_concatenated_heads():
    """The reference is attention with q and qv concatenated against [k, v] as keys and v as values
    (what absorbed MLA computes), over each sequence's first lens[b] keys, causal."""
    g = torch.Generator().manual_seed(0)
    q, qv = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 10, 1, 8, generator=g), torch.randn(2, 10, 1, 16, generator=g)
    out, lse = mla_reference(q, qv, k, v, [10, 5], True, scale=0.3)
    for b, n in enumerate([10, 5]):
        keys = torch.cat([k[b:b + 1, :n], v[b:b + 1, :n]], -1).double().expand(1, n, 4, 24)
        ref, ref_lse = fa3.reference.attention_reference(torch.cat([q, qv], -1)[b:b + 1].double(), keys,
                                                         v[b:b + 1, :n].double().expand(1, n, 4, 16), True,
                                                         softmax_scale=0.3, dtype=torch.float64)
        assert torch.allclose(out[b:b + 1], ref.double()) and torch.allclose(lse[b:b + 1], ref_lse.double())


# ----------------------------------------------------------------------------- arguments (CPU)
def _mla_args(batch=2, seqlen_q=1, heads=16, page_size=64, pages=4, dtype=torch.bfloat16, heads_kv=1):
    q = torch.randn(batch, seqlen_q, heads, D, dtype=dtype)
    qv = torch.randn(batch, seqlen_q, heads, DV, dtype=dtype)
    k_cache = torch.randn(pages, page_size, heads_kv, D, dtype=dtype)
    v_cache = torch.randn(pages, page_size, heads_kv, DV, dtype=dtype)
    table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2) % pages
    lens = torch.tensor([5, 70][:batch], dtype=torch.int32)
    return dict(q=q, qv=qv, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens, block_table=table)


def test_qv_reaches_the_device_check():
    """A valid MLA call on CPU tensors gets as far as the device check."""
    raises_with(fa3.attention_with_kvcache, ValueError, "cpu", **_mla_args(), causal=True)


@pytest.mark.parametrize("change, exc, words", [
    (lambda a: a.update(qv=a["qv"][..., :256]), ValueError, ("qv has head_dim 256", "v_cache has 512")),
    (lambda a: a.update(qv=a["qv"][:, :, :8]), ValueError, ("qv", "must match q")),
    (lambda a: a.update(qv=a["qv"].half()), TypeError, ("qv", "dtype")),
    (lambda a: a.update(k_cache=a["k_cache"][..., :32].contiguous(), q=a["q"][..., :32].contiguous()),
     NotImplementedError, ("head dims 32 and 512", "64", "512")),
    (lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn), v_cache=a["v_cache"].to(torch.float8_e4m3fn)),
     NotImplementedError, ("FP8",)),
    (lambda a: a.update(q=a["q"][:, :, :15], qv=a["qv"][:, :, :15],
                        k_cache=torch.randn(4, 64, 2, D, dtype=torch.bfloat16),
                        v_cache=torch.randn(4, 64, 2, DV, dtype=torch.bfloat16)), ValueError, ("heads_q=15", "heads_kv=2")),
    (lambda a: a.update(v_cache=a["v_cache"][:, :, :, :DV - 8]), ValueError, ("v_cache has 504",)),
    (lambda a: a.update(kernel="s1"), ValueError, ("kernel='s1'", "MLA rung", "m1")),
    (lambda a: a.update(window_size=(128, 0)), NotImplementedError, ("window_size=(128, 0)", "qv")),
    (lambda a: a.update(softcap=30.0), NotImplementedError, ("softcap=30.0",)),
    (lambda a: a.update(sinks=torch.zeros(16)), NotImplementedError, ("sinks",)),
    (lambda a: a.update(k_descale=torch.ones(1)), NotImplementedError, ("k_descale", "FP8")),
    (lambda a: a.update(k=torch.randn(2, 1, 1, D, dtype=torch.bfloat16)), ValueError, ("both k and v",)),
    (lambda a: a.update(k=torch.randn(2, 1, 1, D, dtype=torch.bfloat16), v=torch.randn(2, 1, 1, D, dtype=torch.bfloat16)),
     ValueError, ("k and v must be", "512")),
])
def test_mla_refuses_bad_arguments(change, exc, words):
    """Each bad MLA argument is refused with a message naming it (and the fix), before the device."""
    args = _mla_args()
    change(args)
    raises_with(fa3.attention_with_kvcache, exc, *words, **args)


@pytest.mark.parametrize("page_size", [1, 16, 32, 48, 80])
def test_pages_of_any_size_reach_the_device_check(page_size):
    """Pages that do not hold whole 64-key blocks (vLLM's 16, SGLang's 1, any other size) are read
    by row gathers: no longer refused, the call gets as far as the device check."""
    args = _mla_args(page_size=page_size, pages=8)
    args["block_table"] = torch.arange(2 * 4, dtype=torch.int32).view(2, 4) % 8
    args["cache_seqlens"] = torch.tensor([1, 4 * page_size], dtype=torch.int32)
    raises_with(fa3.attention_with_kvcache, ValueError, "cpu", **args, causal=True)


def test_qv_needs_a_cache():
    """qv without a KV cache is refused by attention_varlen and by flash_attn_func, naming where it
    applies."""
    q, qv = torch.randn(16, 2, D, dtype=torch.bfloat16), torch.randn(16, 2, DV, dtype=torch.bfloat16)
    k, v = torch.randn(16, 1, D, dtype=torch.bfloat16), torch.randn(16, 1, DV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    raises_with(fa3.attention_varlen, ValueError, "qv", "KV cache", "seqused_k", q=q, k=k, v=v, cu_seqlens_q=cu,
                cu_seqlens_k=cu, qv=qv)
    raises_with(fa3.flash_attn_func, NotImplementedError, "qv", "KV cache", q=q[None], k=k[None], v=v[None],
                qv=qv[None])


def test_packed_qv_takes_ragged_entries():
    """Packed queries under qv: uniform entries (vLLM's decode call, max_seqlen_q = 1) and entries
    of different lengths (total_q < batch x max_seqlen_q: MTP / speculative verifies of several
    lengths) both get as far as the device check; only the latter take the kernel's varlen
    layout (fa3.mla.is_ragged, from host integers)."""
    from fa3 import mla

    a = _mla_args()
    q, qv = a["q"].flatten(0, 1), a["qv"].flatten(0, 1)  # (2, 16, d): one query per entry
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    call = dict(q=q, k=a["k_cache"], v=a["v_cache"], cu_seqlens_q=cu, seqused_k=a["cache_seqlens"],
                block_table=a["block_table"], qv=qv, causal=True)
    raises_with(fa3.attention_varlen, ValueError, "cpu", **call, max_seqlen_q=1)
    raises_with(fa3.attention_varlen, ValueError, "cpu", **call, max_seqlen_q=3)
    raises_with(fa3.attention_varlen, ValueError, "cpu", **call, max_seqlen_q=None)
    assert not mla.is_ragged(cu, 2, 2, 1) and not mla.is_ragged(None, 2, 5, 1)
    assert mla.is_ragged(cu, 2, 2, 3) and mla.is_ragged(cu, 2, 5, 4)
    # flash-attn 3's name and vLLM's (q_v), not both
    fc = dict(q=q, k=a["k_cache"], v=a["v_cache"], cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=a["cache_seqlens"],
              block_table=a["block_table"], causal=True)
    raises_with(fa3.flash_attn_varlen_func, ValueError, "cpu", **fc, q_v=qv)
    raises_with(fa3.flash_attn_varlen_func, ValueError, "cpu", **fc, qv=qv)
    raises_with(fa3.flash_attn_varlen_func, ValueError, "qv given twice", **fc, qv=qv, q_v=qv)
    raises_with(fa3.flash_attn_with_kvcache, ValueError, "cpu", q=a["q"], k_cache=a["k_cache"], v_cache=a["v_cache"],
                cache_seqlens=a["cache_seqlens"], block_table=a["block_table"], qv=a["qv"], causal=True)


def test_mla_out_is_checked(no_device_check):
    """out= under qv has v's head dim."""
    args = _mla_args()
    raises_with(fa3.attention_with_kvcache, ValueError, "out", "(2, 1, 16, 512)", **args,
                out=torch.empty(2, 1, 16, D, dtype=torch.bfloat16))


def test_scheduler_metadata_takes_mla_dims():
    """get_scheduler_metadata with headdim_v != headdim: MLA's 64 / 512 only (planned on the GPU)."""
    lens = torch.zeros(2, dtype=torch.int32)
    raises_with(fa3.get_scheduler_metadata, ValueError, "headdim_v=512", "MLA", batch_size=2, max_seqlen_q=1,
                max_seqlen_k=128, num_heads_q=16, num_heads_kv=1, headdim=128, cache_seqlens=lens, headdim_v=512)
    meta = fa3.get_scheduler_metadata(2, 1, 128, 16, 1, D, lens, headdim_v=DV, num_splits=4)
    assert meta.tolist() == [4]


def test_mla_split_plan():
    """The split count from host integers (132 SMs): a batch that fills the SMs is not split; a
    short batch splits to fill them, each split keeping 8 key blocks of a 64-row tile (4 of a
    16-row one), at most 128; max_splits caps the plan (vLLM's num_splits=16), num_splits is taken as given."""
    from fa3 import registry
    from fa3.cache.split_plan import plan_mla_splits

    m1 = registry.get("m1")
    plan = lambda batch, heads, keys, n=0, seqlen_q=1: plan_mla_splits(m1, batch, seqlen_q, heads, 1, keys, 132, n)
    assert plan(128, 128, 1024) == plan(128, 16, 1024) == 1
    # one CTA: 128 splits (MLA_MAX_SPLITS) of 4 blocks; two Q tiles: 64 of 8 (the SMs' 132 / 2 CTAs)
    assert plan(1, 16, 32768) == 128 and plan(1, 128, 32768) == 64 and plan(1, 128, 32768, -16) == 16
    assert plan(4, 128, 1024) == 2 and plan(4, 16, 1024) == 4  # 16 blocks: 8 (64 rows), 4 (16 rows) a split
    assert plan(16, 16, 8192) == 8 and plan(16, 16, 8192, 3) == 3 and plan(2, 16, 512, seqlen_q=4) == 1


# ----------------------------------------------------------------------------- GPU
def make_mla_cache(batch, capacity, heads_kv, lens, page_size, gen, fused=False):
    """conftest.make_kv_cache with k d wide and v d_v wide; fused: the pages as vLLM holds them,
    one (pages, page_size, d_v + d) tensor, v = [..., :d_v] and k = [..., d_v:] (heads_kv 1).
    Returns (k_dense, v_dense, k_cache, v_cache, table)."""
    k, v, k_cache, v_cache, table = make_kv_cache(batch, capacity, heads_kv, D, lens, page_size, gen, d_v=DV)
    if not fused or table is None:
        return k, v, k_cache, v_cache, table
    assert heads_kv == 1
    pages = table.numel()
    cache = torch.empty(pages, page_size, DV + D, device="cuda", dtype=torch.bfloat16)
    cache[table.flatten().long()] = torch.cat([v, k], -1).view(pages, page_size, DV + D)
    return k, v, cache[..., DV:].unsqueeze(-2), cache[..., :DV].unsqueeze(-2), table


def check(out, lse, ref_o, ref_lse, what):
    assert not out.isnan().any(), f"{what}: NaN"
    assert rel_err(out, ref_o) < TOL, f"{what}: {rel_err(out, ref_o)}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: empty rows differ"
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-2, rtol=1e-3), what


CASES = [  # (batch, seqlen_q, heads_q, heads_kv, capacity, lens)
    (4, 1, 16, 1, 1024, [0, 1, 300, 1024]),  # an empty sequence, one key, ragged, full
    (3, 1, 128, 1, 2048, [2000, 64, 129]),  # two Q tiles
    (2, 4, 16, 1, 512, [4, 500]),  # causal speculative verify: 4 queries x 16 heads in one tile
    (2, 2, 64, 2, 512, [100, 512]),  # heads_kv 2
]


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("page_size", [None, 64, 128, 1, 16, 32],
                         ids=["dense", "page64", "page128", "gather1", "gather16", "gather32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_mla_matches_reference(case, page_size, causal):
    batch, sq, hq, hkv, capacity, lens = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(case * 10 + (page_size or 0))
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, hkv, lens, page_size, gen)
    q = torch.randn(batch, sq, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, sq, hq, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_o, ref_lse = mla_reference(q, qv, k_dense, v_dense, lens, causal)
    for splits in (1, 3, 0):
        out, lse = fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, qv=qv,
                                              causal=causal, num_splits=splits, return_lse=True)
        assert out.shape == (batch, sq, hq, DV)
        check(out, lse, ref_o, ref_lse, f"num_splits={splits}")


@gpu
@pytest.mark.parametrize("page_size", [64, 16], ids=["page64", "gather16"])
@pytest.mark.parametrize("heads", [16, 128])
def test_vllm_call_on_one_cache(heads, page_size):
    """vLLM's FlashAttention MLA decode: flash_attn_varlen_func(q=q_pe, k=k_pe view, v=latent view of
    one (pages, page_size, 576) cache, q_v=q_nope, cu_seqlens_q, max_seqlen_q=1, seqused_k,
    block_table, causal, num_splits=16 as a cap, scheduler_metadata), with its softmax_scale; out=
    preallocated. Pages of 16: row gathers from rows 1152 bytes apart."""
    batch, capacity, lens = 5, 4096, [4096, 1, 777, 3000, 64]
    gen = torch.Generator(device="cuda").manual_seed(heads)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, page_size, gen, fused=True)
    assert k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
    q = torch.randn(batch, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    scale = 192 ** -0.5
    meta = fa3.get_scheduler_metadata(batch, 1, capacity, heads, 1, D, seqlens, headdim_v=DV, page_size=page_size,
                                      causal=True)
    out = torch.empty(batch, heads, DV, device="cuda", dtype=torch.bfloat16)
    got, lse = fa3.flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, q_v=qv, cu_seqlens_q=cu, max_seqlen_q=1,
                                          max_seqlen_k=capacity, seqused_k=seqlens, block_table=table,
                                          softmax_scale=scale, causal=True, return_softmax_lse=True,
                                          scheduler_metadata=meta, num_splits=16, out=out, fa_version=3)
    ref_o, ref_lse = mla_reference(q[:, None], qv[:, None], k_dense, v_dense, lens, True, scale)
    assert got is out and lse.shape == (heads, batch)
    check(out[:, None], lse.T[:, :, None], ref_o, ref_lse, "vLLM's call")


def test_plain_mla_calls_remembered(monkeypatch, cpu_as_hopper):
    """A plain MLA call that passed every check is remembered by its layouts and options
    (fa3.mla._MLA_CALLS): the same call again skips check_mla; an append, another out= layout, a
    profiler, or lengths that check_mla had to convert take the full path. Kernels no-op (CPU)."""
    from fa3 import mla
    from fa3.compile import mla as compile_mla

    launched = []
    monkeypatch.setattr(compile_mla, "get_mla", lambda *a, **k: (lambda *args: launched.append(args)))
    checked = []
    real_check = mla.check_mla
    monkeypatch.setattr(mla, "check_mla", lambda *a: checked.append(1) or real_check(*a))
    mla._MLA_CALLS.clear()
    args = _mla_args()

    def call(**kwargs):
        checked.clear()
        launched.clear()
        got = fa3.attention_with_kvcache(**dict(dict(args, causal=True), **kwargs), return_lse=True)
        assert len(launched) == 1
        return len(checked), got

    assert call()[0] == 1 and call()[0] == 0, "the second call takes the remembered launch"
    (n, (out, lse)), (_, (out2, _)) = call(), call()
    assert n == 0 and out.shape == (2, 1, 16, DV) and lse.shape == (2, 16, 1) and out2 is not out
    given = torch.empty(2, 1, 16, DV, dtype=torch.bfloat16)
    assert call(out=given)[0] == 1 and call(out=given)[0] == 0 and call(out=given)[1][0] is given
    with pytest.raises(ValueError, match="shares memory"):  # a remembered out= is still checked
        fa3.attention_with_kvcache(**dict(args, qv=given.view(2, 1, 16, DV)), out=given, causal=True)
    assert call(causal=False)[0] == 1 and call(num_splits=2)[0] == 1  # other keys
    strided = torch.tensor([5, 0, 70, 0], dtype=torch.int32)[::2]  # made contiguous by check_mla
    assert call(cache_seqlens=strided)[0] == 1 and call(cache_seqlens=strided)[0] == 1
    new = dict(k=torch.randn(2, 1, 1, D, dtype=torch.bfloat16), v=torch.randn(2, 1, 1, DV, dtype=torch.bfloat16))
    monkeypatch.setattr(mla, "append_to_cache", lambda *a: None)
    assert call(**new)[0] == 1 and call(**new)[0] == 1  # appends are never remembered
    monkeypatch.setattr(fa3._dispatch, "profiling", lambda: True)
    assert call()[0] == 1


@gpu
@pytest.mark.parametrize("packed", [False, True], ids=["batch-seqlen", "packed"])
def test_remembered_mla_call_computes_the_same(packed):
    """A repeated plain MLA call runs the launch remembered from its first call: the first call's
    output for the same values, and the reference's for lengths rewritten in place and new
    queries (a later decode step); vLLM's packed call with out= too."""
    batch, heads, capacity, page_size = 3, 16, 2048, 64
    lens = [2048, 300, 1]
    gen = torch.Generator(device="cuda").manual_seed(11)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, page_size, gen, fused=True)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, heads, DV, device="cuda", dtype=torch.bfloat16)

    def call(q, qv):
        if packed:
            return fa3.flash_attn_varlen_func(q=q[:, 0], k=k_cache, v=v_cache, q_v=qv[:, 0], cu_seqlens_q=cu,
                                              max_seqlen_q=1, max_seqlen_k=capacity, seqused_k=seqlens,
                                              block_table=table, causal=True, out=out).clone()[:, None]
        return fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, qv=qv,
                                          causal=True)

    q = torch.randn(batch, 1, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, 1, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    first = call(q, qv)
    assert torch.equal(call(q, qv), first)
    assert rel_err(first, mla_reference(q, qv, k_dense, v_dense, lens, True)[0]) < TOL
    # in place: the same tensor, new values (within the rows written: those past lens hold NaN)
    seqlens.copy_(torch.tensor([1000, 17, 0], dtype=torch.int32))
    q2, qv2 = torch.randn_like(q), torch.randn_like(qv)
    got = call(q2, qv2)
    assert rel_err(got, mla_reference(q2, qv2, k_dense, v_dense, [1000, 17, 0], True)[0]) < TOL
    fa3.check_index_values()


@gpu
def test_packed_speculative_queries():
    """Packed queries, 3 a sequence (a speculative verify): attention_varlen over the cache equals
    the (batch, seqlen_q) call."""
    batch, sq, hq, lens = 3, 3, 16, [50, 3, 1000]
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, 1024, 1, lens, 64, gen)
    q = torch.randn(batch, sq, hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, sq, hq, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, batch * sq + 1, sq, dtype=torch.int32, device="cuda")
    out, lse = fa3.attention_varlen(q.flatten(0, 1), k_cache, v_cache, cu, None, sq, None, block_table=table,
                                    seqused_k=seqlens, qv=qv.flatten(0, 1), causal=True, return_lse=True)
    ref_o, ref_lse = mla_reference(q, qv, k_dense, v_dense, lens, True)
    check(out.view(batch, sq, hq, DV), lse.view(hq, batch, sq).permute(1, 0, 2), ref_o, ref_lse, "packed")


@gpu
@pytest.mark.parametrize("page_size", [64, 16], ids=["page64", "gather16"])
def test_append_then_attend(page_size):
    """New k (64 wide) and v (512 wide) are written into the paged cache at cache_seqlens before the
    kernel reads them (an empty sequence included)."""
    batch, lens, new = 3, [0, 64, 300], 2
    gen = torch.Generator(device="cuda").manual_seed(7)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, 512, 1, lens, page_size, gen)
    k_new = torch.randn(batch, new, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn(batch, new, 1, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    for b, n in enumerate(lens):
        k_dense[b, n:n + new], v_dense[b, n:n + new] = k_new[b], v_new[b]
    q = torch.randn(batch, new, 128, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, new, 128, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = fa3.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                          qv=qv, causal=True, return_lse=True)
    ref_o, ref_lse = mla_reference(q, qv, k_dense, v_dense, [n + new for n in lens], True)
    check(out, lse, ref_o, ref_lse, "append")


@gpu
def test_cuda_graph_replays_new_lengths():
    """A decode step captured once replays with new lengths and pages (planned from shapes: no host
    read of the lengths)."""
    batch, capacity = 8, 2048
    gen = torch.Generator(device="cuda").manual_seed(9)
    lens = [2048, 1, 100, 0, 1500, 64, 65, 700]
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, 64, gen)
    q = torch.randn(batch, 1, 128, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, 1, 128, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.ones(batch, dtype=torch.int32, device="cuda")
    call = lambda: fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, qv=qv,
                                               causal=True, num_splits=16)
    call()  # compiled and planned outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
    graph.replay()
    ref_o, _ = mla_reference(q, qv, k_dense, v_dense, lens, True)
    assert rel_err(out, ref_o) < TOL


@gpu
@pytest.mark.parametrize("page_size", [48, 80])
def test_gathered_pages_of_odd_sizes(page_size):
    """Pages of 48 and 80 rows (a key block spans two pages, across a page's middle): row gathers,
    split and not, against the reference; 128 heads (two Q tiles reading the same blocks)."""
    batch, capacity, lens = 3, 960, [960, 47, 500]
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, page_size, gen)
    q = torch.randn(batch, 2, 128, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, 2, 128, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_o, ref_lse = mla_reference(q, qv, k_dense, v_dense, lens, True)
    for splits in (1, 4):
        out, lse = fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, qv=qv,
                                              causal=True, num_splits=splits, return_lse=True)
        check(out, lse, ref_o, ref_lse, f"pages of {page_size}, num_splits={splits}")


def ragged_reference(q, qv, k_dense, v_dense, cu, lens, causal):
    """mla_reference entry by entry over packed q (total_q, heads_q, d): (out (total_q, heads_q,
    d_v), lse (heads_q, total_q)), each entry's causal diagonal at its own bottom right."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        o, lse = mla_reference(q[None, rows], qv[None, rows], k_dense[b:b + 1], v_dense[b:b + 1], [n], causal)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


RAGGED = [3, 1, 0, 4, 2]  # queries an entry (one with none): MTP / speculative verifies of several lengths


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [64, 16], ids=["page64", "gather16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_ragged_packed_entries(causal, page_size, heads):
    """Packed entries of different lengths (total_q < batch x max_seqlen_q): the kernel finds each Q
    tile's entry from cu_seqlens_q (varlen layout), split and not, against the reference entry by
    entry; an entry with no queries writes nothing, an empty sequence's rows are zeros."""
    batch, capacity, lens = len(RAGGED), 1024, [700, 1, 300, 0, 1024]
    gen = torch.Generator(device="cuda").manual_seed(heads + page_size)
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, page_size, gen)
    cu = [0]
    for n in RAGGED:
        cu.append(cu[-1] + n)
    total = cu[-1]
    q = torch.randn(total, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(total, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor(cu, dtype=torch.int32, device="cuda")
    ref_o, ref_lse = ragged_reference(q, qv, k_dense, v_dense, cu, lens, causal)
    for splits in (1, 3, 0):
        out, lse = fa3.attention_varlen(q, k_cache, v_cache, cu_q, None, max(RAGGED), None, block_table=table,
                                        seqused_k=seqlens, qv=qv, causal=causal, num_splits=splits, return_lse=True)
        assert out.shape == (total, heads, DV) and lse.shape == (heads, total)
        check(out, lse.T[None], ref_o[None], ref_lse.T[None], f"ragged, num_splits={splits}")


@gpu
def test_cuda_graph_replays_gathers_and_ragged_entries():
    """vLLM's MTP step on pages of 16: a packed call of ragged entries captured once replays with new
    lengths, new pages and new offsets of the same total (max_seqlen_q and total_q fixed)."""
    batch, capacity, page_size, heads = 4, 1024, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = [1000, 17, 0, 513]
    k_dense, v_dense, k_cache, v_cache, table = make_mla_cache(batch, capacity, 1, lens, page_size, gen)
    total, max_q = 8, 4
    q = torch.randn(total, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(total, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.ones(batch, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 1, 2, 4, 8], dtype=torch.int32, device="cuda")
    live_table = torch.zeros_like(table)
    call = lambda: fa3.flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, qv=qv, cu_seqlens_q=cu_q,
                                              max_seqlen_q=max_q, max_seqlen_k=capacity, seqused_k=seqlens,
                                              block_table=live_table, causal=True, num_splits=8)
    call()  # compiled and planned outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    cu = [0, 4, 5, 5, 8]
    seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
    cu_q.copy_(torch.tensor(cu, dtype=torch.int32))
    live_table.copy_(table)
    graph.replay()
    ref_o, _ = ragged_reference(q, qv, k_dense, v_dense, cu, lens, True)
    assert not out.isnan().any() and rel_err(out, ref_o) < TOL
