"""Serving engines' calls: any page size, packed queries over a (paged) KV cache, the split plan.

GPU tests compare against the float64 reference on the same batch unpaged and unpacked: pages are
shuffled within a pool holding unused pages, the pool's rows past each sequence hold NaN, table
entries past a sequence's pages hold -1 (as engines leave them: never read), outputs are poisoned
with NaN before the call, and sequences of 0 and 1 keys and queries are in every batch. CPU tests
check the refusals of bad arguments and values, by name.
"""

import re

import pytest
import torch

import fa3
from fa3 import index_checks
from fa3.cache import split_plan
from fa3.kernels import config
from fa3.reference import attention_reference

from conftest import raises_with, rel_err

gpu = pytest.mark.gpu
TOL = 1.5e-2
PAGE_SIZES = [1, 16, 48, 64, 256]


def _paged_cache(lens, heads_kv, d, page_size, gen, spare_pages=3):
    """Per-sequence dense K/V (NaN past each length) and the same in a shuffled page pool:
    returns (k_seqs, v_seqs, k_pool, v_pool, block_table); unused table entries are -1."""
    max_pages = max(1, max(-(-n // page_size) for n in lens))
    used = [-(-n // page_size) for n in lens]
    num_pages = sum(used) + spare_pages
    shape = (num_pages, page_size, heads_kv, d)
    k_pool = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    v_pool = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).tolist()
    table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    k_seqs, v_seqs, nxt = [], [], 0
    for b, n in enumerate(lens):
        k = torch.randn(n, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(n, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_seqs.append(k)
        v_seqs.append(v)
        for j in range(used[b]):
            page = perm[nxt]
            nxt += 1
            table[b, j] = page
            rows = slice(j * page_size, min(n, (j + 1) * page_size))
            k_pool[page, :rows.stop - rows.start] = k[rows]
            v_pool[page, :rows.stop - rows.start] = v[rows]
    return k_seqs, v_seqs, k_pool, v_pool, table.cuda()


def _dense_cache(lens, heads_kv, d, gen, spare_rows=5):
    """Per-sequence dense K/V and the same in a (batch, capacity, heads_kv, d) cache, NaN past each
    length: returns (k_seqs, v_seqs, k_cache, v_cache)."""
    capacity = max(lens) + spare_rows
    k_cache = torch.full((len(lens), capacity, heads_kv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    k_seqs = [torch.randn(n, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for n in lens]
    v_seqs = [torch.randn(n, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for n in lens]
    for b, n in enumerate(lens):
        k_cache[b, :n], v_cache[b, :n] = k_seqs[b], v_seqs[b]
    return k_seqs, v_seqs, k_cache, v_cache


def _reference(q_seqs, k_seqs, v_seqs, causal, window_size=(-1, -1), softcap=0.0):
    """Per sequence, float64: [(out (len_q, heads_q, d), lse (heads_q, len_q))]."""
    result = []
    for q, k, v in zip(q_seqs, k_seqs, v_seqs):
        o, lse = attention_reference(q[None], k[None], v[None], causal, dtype=torch.float64,
                                     window_size=window_size, softcap=softcap)
        result.append((o[0], lse[0]))
    return result


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _check(out, lse, ref, what):
    assert not out.isnan().any(), f"{what}: NaN (a row was not written, or garbage was read)"
    ref_o = torch.cat([o for o, _ in ref])
    ref_lse = torch.cat([lse for _, lse in ref], dim=-1)
    assert rel_err(out, ref_o) < TOL, f"{what}: relative error {rel_err(out, ref_o):.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: rows with no key differ"
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2, what


# ----------------------------------------------------------------------------- any page size
@gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_any_page_size(page_size, head_dim, causal):
    """attention_with_kvcache on pages of 1-256 tokens (gathered below 64, TMA at 64 and 256):
    ragged lengths with 0 and 1, one to several queries, 1 to n splits."""
    if head_dim != 128 and page_size not in (1, 16):
        pytest.skip("other head dims: the gather sizes only")
    gen = torch.Generator(device="cuda").manual_seed(page_size * 7 + head_dim)
    lens = [0, 1, 200, 63, 1000, 129]
    for seqlen_q in (1, 3):
        k_seqs, v_seqs, k_pool, v_pool, table = _paged_cache(lens, 2, head_dim, page_size, gen)
        q = torch.randn(len(lens), seqlen_q, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = _reference(list(q), k_seqs, v_seqs, causal)
        ref_o, ref_lse = torch.stack([o for o, _ in ref]), torch.stack([lse for _, lse in ref])
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for splits in (1, 3, 0):
            out, lse = fa3.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table,
                                                  causal=causal, num_splits=splits, return_lse=True)
            what = f"page {page_size}, d{head_dim}, seqlen_q {seqlen_q}, splits {splits}"
            assert not out.isnan().any() and rel_err(out, ref_o) < TOL, f"{what}: {rel_err(out, ref_o)}"
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite), what
            assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2, what


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_small_pages_append_window_softcap(page_size):
    """New tokens appended into small pages, then attended with a window and softcap."""
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    lens, new = [5, 300, 0], 2
    k_seqs, v_seqs, k_pool, v_pool, table = _paged_cache([n + new for n in lens], 2, 128, page_size, gen)
    q = torch.randn(3, new, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.stack([k[n:n + new] for k, n in zip(k_seqs, lens)])
    v_new = torch.stack([v[n:n + new] for v, n in zip(v_seqs, lens)])
    # the pool holds NaN where the new tokens go: the append must overwrite them
    for b, n in enumerate(lens):
        for i in range(n, n + new):
            k_pool[table[b, i // page_size], i % page_size] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref = _reference(list(q), k_seqs, v_seqs, True, (100, 0), 10.0)
    out = fa3.attention_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                     causal=True, window_size=(100, 0), softcap=10.0)
    assert rel_err(out, torch.stack([o for o, _ in ref])) < TOL


# ----------------------------------------------------------------------------- packed queries over a cache
MIXES = [  # (query lengths, key lengths): decodes (1), chunked prefills, empty entries
    ([1, 1, 37, 0, 200, 1], [500, 1, 37, 0, 900, 64]),
    ([64, 1, 3], [64, 4000, 3]),
    ([1] * 40, [17 * i + 1 for i in range(40)]),          # many entries: pure decode
]


@gpu
@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("case", range(len(MIXES)))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_over_paged_cache(page_size, case, causal):
    """fa3.attention_varlen(q, k_cache, v_cache, cu_seqlens_q, None, ..., block_table, seqused_k)
    against each sequence's float64 reference (keys: its first seqused_k cache positions; causal
    aligned to the end of its keys); out= poisoned with NaN; the split count forced and planned."""
    lens_q, lens_k = MIXES[case]
    gen = torch.Generator(device="cuda").manual_seed(case * 11 + (page_size or 0))
    heads_q, heads_kv, d = 8, 2, 128
    if page_size is None:  # a dense cache: (batch, capacity, heads_kv, d), seqused_k < capacity
        k_seqs, v_seqs, k_cache, v_cache = _dense_cache(lens_k, heads_kv, d, gen)
        table = None
    else:
        k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, heads_kv, d, page_size, gen)
    q = torch.randn(sum(lens_q), heads_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = _cu(lens_q)
    q_seqs = list(torch.split(q, lens_q))
    ref = _reference(q_seqs, k_seqs, v_seqs, causal)
    seqused_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    for splits in (1, 4, 0):
        out = torch.full_like(q, float("nan"))
        got, lse = fa3.attention_varlen(q, k_cache, v_cache, cu_q, None, max(lens_q), max(lens_k),
                                        block_table=table, seqused_k=seqused_k, causal=causal,
                                        return_lse=True, out=out, num_splits=splits)
        assert got is out and lse.shape == (heads_q, q.shape[0])
        _check(out, lse, ref, f"page {page_size}, case {case}, splits {splits}")
    # vLLM's keywords reach the same call
    out = torch.full_like(q, float("nan"))
    fa3.flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
                               seqused_k=seqused_k, max_seqlen_k=max(lens_k), softmax_scale=d ** -0.5,
                               causal=causal, alibi_slopes=None, window_size=(-1, -1), block_table=table,
                               softcap=0.0, scheduler_metadata=None, fa_version=3, num_splits=0)
    assert rel_err(out, torch.cat([o for o, _ in ref])) < TOL


@gpu
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_many_entries_longest_first(page_size, causal):
    """A step with more s1 CTAs than the SMs hold at once, so that they take the entries longest
    first (kernels/entry_order.py): 300 entries of shuffled key lengths (0 and 1 among them),
    decodes beside entries of 3 and 0 queries, packed; and the same batch as (batch, 2) queries."""
    gen = torch.Generator(device="cuda").manual_seed(300 + (page_size or 0) + causal)
    n, heads_q, heads_kv, d = 300, 8, 2, 128
    lens_k = [0, 1] + torch.randint(1, 1500, (n - 2,), generator=torch.Generator().manual_seed(7)).tolist()
    lens_k = [lens_k[i] for i in torch.randperm(n, generator=torch.Generator().manual_seed(8)).tolist()]
    lens_q = [3 if b % 50 == 7 else 0 if b % 50 == 9 else 1 for b in range(n)]
    if page_size is None:
        k_seqs, v_seqs, k_cache, v_cache = _dense_cache(lens_k, heads_kv, d, gen)
        table = None
    else:
        k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, heads_kv, d, page_size, gen)
    spec = fa3.registry.get("s1")
    gather = page_size is not None and split_plan.reads_by_gather(spec, page_size)
    slots = fa3._checks.sm_count(0) * split_plan.ctas_per_sm(spec, d, gather)
    assert split_plan.s1_ctas(spec, n, 3, heads_q, heads_kv, 1, total_q=sum(lens_q)) > slots  # ordered
    seqused_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), heads_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = _reference(list(torch.split(q, lens_q)), k_seqs, v_seqs, causal)
    out = torch.full_like(q, float("nan"))
    _, lse = fa3.attention_varlen(q, k_cache, v_cache, _cu(lens_q), None, 3, max(lens_k), block_table=table,
                                  seqused_k=seqused_k, causal=causal, return_lse=True, out=out)
    _check(out, lse, ref, f"packed, page {page_size}")
    q2 = torch.randn(n, 2, heads_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = _reference(list(q2), k_seqs, v_seqs, causal)
    out2 = torch.full_like(q2, float("nan"))
    _, lse2 = fa3.attention_with_kvcache(q2, k_cache, v_cache, cache_seqlens=seqused_k, block_table=table,
                                         causal=causal, return_lse=True, out=out2)
    _check(out2.flatten(0, 1), lse2.transpose(0, 1).flatten(1), ref, f"batched, page {page_size}")


@gpu
@pytest.mark.parametrize("entries", [1, 126, 3000])
def test_entry_order_sorts_any_lengths(entries):
    """The device sort s1's order comes from: a permutation of the entries, lengths non-increasing
    to within one bucket (max_length / 1023 keys), whatever the values (negative, past max_length)."""
    from fa3.compile import kvcache as _compile_kvcache

    gen = torch.Generator(device="cuda").manual_seed(entries)
    lens = torch.randint(-50, 5000, (entries,), dtype=torch.int32, device="cuda", generator=gen)
    order = torch.full((entries,), -1, dtype=torch.int64, device="cuda")
    _compile_kvcache.get_entry_order()(lens, order, 4000)
    assert sorted(order.tolist()) == list(range(entries))
    steps = lens.clamp(0, 4000)[order].diff()
    assert (steps <= 4000 / 1023 + 1).all(), steps.max()


@gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_varlen_over_paged_cache_with_sinks(splits):
    """gpt-oss served by vLLM: flash_attn_varlen_func(..., s_aux=sinks) over 16-token pages. A sink
    joins each row's denominator once: out = O * exp(lse) / (exp(lse) + exp(sink)), lse' =
    logaddexp(lse, sink); with several splits the combine adds it."""
    lens_q, lens_k = [1, 20, 0, 1], [300, 20, 0, 1]
    gen = torch.Generator(device="cuda").manual_seed(40 + splits)
    heads_q, heads_kv, d = 8, 2, 64
    k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, heads_kv, d, 16, gen)
    q = torch.randn(sum(lens_q), heads_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    sinks = (torch.randn(heads_q, device="cuda", generator=gen) * 2).bfloat16()  # the model's dtype
    ref = []
    for o, lse in _reference(list(torch.split(q, lens_q)), k_seqs, v_seqs, True):
        total = torch.logaddexp(lse, sinks.double()[:, None])  # (heads, len_q)
        ref.append((o * torch.exp(lse - total).t()[..., None], total))
    out = torch.full_like(q, float("nan"))
    _, lse = fa3.flash_attn_varlen_func(q, k_cache, v_cache, _cu(lens_q), None, max(lens_q), max(lens_k),
                                        causal=True, block_table=table, out=out, num_splits=splits,
                                        seqused_k=torch.tensor(lens_k, dtype=torch.int32, device="cuda"),
                                        return_softmax_lse=True, s_aux=sinks)
    _check(out, lse, ref, f"sinks, splits {splits}")


@gpu
@pytest.mark.parametrize("head_dim", [96, 192])
@pytest.mark.parametrize("splits", [1, 3])
def test_varlen_over_small_pages_head_dims_96_192(head_dim, splits):
    """d96/d192 rows are 12/24 16-byte chunks: the row gather runs on 96 of the 128 threads."""
    lens_q, lens_k = [1, 33, 1], [257, 40, 3]
    gen = torch.Generator(device="cuda").manual_seed(head_dim + splits)
    k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, 2, head_dim, 16, gen)
    q = torch.randn(sum(lens_q), 4, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = _reference(list(torch.split(q, lens_q)), k_seqs, v_seqs, True)
    out = torch.full_like(q, float("nan"))
    _, lse = fa3.attention_varlen(q, k_cache, v_cache, _cu(lens_q), None, max(lens_q), max(lens_k),
                                  block_table=table, seqused_k=torch.tensor(lens_k, dtype=torch.int32, device="cuda"),
                                  causal=True, out=out, num_splits=splits, return_lse=True)
    _check(out, lse, ref, f"d{head_dim}, splits {splits}")


@gpu
def test_varlen_over_cache_window_softcap_and_max_seqlen_q_default():
    lens_q, lens_k = [1, 50, 1], [700, 300, 1]
    gen = torch.Generator(device="cuda").manual_seed(3)
    k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, 4, 64, 16, gen)
    q = torch.randn(sum(lens_q), 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = _reference(list(torch.split(q, lens_q)), k_seqs, v_seqs, True, (128, 0), 20.0)
    out, lse = fa3.attention_varlen(q, k_cache, v_cache, _cu(lens_q), block_table=table,
                                    seqused_k=torch.tensor(lens_k, dtype=torch.int32, device="cuda"),
                                    causal=True, window_size=(128, 0), softcap=20.0, return_lse=True)
    _check(out, lse, ref, "window + softcap, max_seqlen_q=None")


# long entries (prompt chunks of long_queries or more) run on K5 beside S1's decodes in one call:
# ragged lengths, fewer keys than queries (causal rows that see nothing), an entry with no keys
LONG_MIX = ([1, 300, 1, 0, 129, 7, 1000, 150, 200, 1], [900, 300, 1, 0, 2000, 64, 1000, 60, 0, 77])


def _long_call(page_size, head_dim, causal, gen, lens=LONG_MIX, heads=(8, 2), **kw):
    lens_q, lens_k = lens
    heads_q, heads_kv = heads
    if page_size is None:  # dense: (batch, capacity, heads_kv, d), NaN past each length
        k_seqs, v_seqs, k_cache, v_cache = _dense_cache(lens_k, heads_kv, head_dim, gen, spare_rows=7)
        table = None
    else:
        k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, heads_kv, head_dim, page_size, gen)
    q = torch.randn(sum(lens_q), heads_q, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    call = lambda splits, out: fa3.attention_varlen(
        q, k_cache, v_cache, _cu(lens_q), None, max(lens_q), max(lens_k), block_table=table,
        seqused_k=torch.tensor(lens_k, dtype=torch.int32, device="cuda"), causal=causal, return_lse=True,
        out=out, num_splits=splits, **kw)
    return q, k_seqs, v_seqs, call


@gpu
@pytest.mark.parametrize("page_size", [None, 16, 32, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_long_entries_over_cache(page_size, causal):
    """A step of decodes and prompt chunks over a dense cache and pages of 16 to 256 (one TMA box a
    page, or a key block a box): the chunks run on K5, the decodes on S1 (split 1, 3 or planned),
    every row against the float64 reference; out poisoned, the cache NaN past each length."""
    gen = torch.Generator(device="cuda").manual_seed(70 + (page_size or 0) + causal)
    q, k_seqs, v_seqs, call = _long_call(page_size, 128, causal, gen)
    ref = _reference(list(torch.split(q, LONG_MIX[0])), k_seqs, v_seqs, causal)
    for splits in (1, 3, 0):
        out = torch.full_like(q, float("nan"))
        _, lse = call(splits, out)
        _check(out, lse, ref, f"page {page_size}, causal {causal}, splits {splits}")


@gpu
@pytest.mark.parametrize("head_dim, page_size", [(64, 16), (96, 16), (192, 16), (256, 16), (256, 64), (64, 128)])
def test_long_entries_head_dims(head_dim, page_size):
    """Each head dim's K5 tiles (d96 192 x 96 causal, d192 80-key packed tiles, d256 64-key tiles:
    pages of 64 hold whole blocks there) over small and whole-block pages."""
    gen = torch.Generator(device="cuda").manual_seed(head_dim + page_size)
    q, k_seqs, v_seqs, call = _long_call(page_size, head_dim, True, gen)
    ref = _reference(list(torch.split(q, LONG_MIX[0])), k_seqs, v_seqs, True)
    out = torch.full_like(q, float("nan"))
    _, lse = call(0, out)
    _check(out, lse, ref, f"d{head_dim}, page {page_size}")


@gpu
def test_long_entries_window_softcap_sinks():
    """gpt-oss-style serving: a sliding window, capped scores and sinks, on both kernels of the call."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    sinks = torch.randn(8, device="cuda", generator=gen) * 2
    q, k_seqs, v_seqs, call = _long_call(16, 64, True, gen, window_size=(200, 0), softcap=15.0, sinks=sinks)
    ref = []
    for o, lse in _reference(list(torch.split(q, LONG_MIX[0])), k_seqs, v_seqs, True, (200, 0), 15.0):
        total = torch.logaddexp(lse, sinks.double()[:, None])
        ref.append((o * torch.exp(lse - total).t()[..., None], total))
    out = torch.full_like(q, float("nan"))
    _, lse = call(0, out)
    _check(out, lse, ref, "window + softcap + sinks")


@gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_packed_queries_equal_unpacked(page_size):
    """attention_with_kvcache with cu_seqlens_q (several query tokens per sequence, as speculative
    verify) gives the rows of the same batch unpacked, and the reference for ragged lengths."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens_k = [300, 5, 1024]
    k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(lens_k, 2, 128, page_size or 64, gen)
    if page_size is None:  # dense: one row per sequence
        k_cache = torch.stack([torch.cat([k, k.new_full((1024 - k.shape[0], 2, 128), float("nan"))]) for k in k_seqs])
        v_cache = torch.stack([torch.cat([v, v.new_full((1024 - v.shape[0], 2, 128), float("nan"))]) for v in v_seqs])
        table = None
    seqlens = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 4, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    unpacked = fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True)
    packed = fa3.attention_with_kvcache(q.flatten(0, 1), k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                        cu_seqlens_q=_cu([4, 4, 4]), max_seqlen_q=4, causal=True)
    assert rel_err(packed, unpacked.flatten(0, 1)) < 1e-6
    lens_q = [4, 1, 2]
    qr = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    # SGLang's call: cu_seqlens_k_new (the cache lengths' offsets) beside no new k/v, ignored
    out = fa3.flash_attn_with_kvcache(qr, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                      cu_seqlens_q=_cu(lens_q), cu_seqlens_k_new=_cu(lens_k), max_seqlen_q=4,
                                      causal=True)
    ref = _reference(list(torch.split(qr, lens_q)), k_seqs, v_seqs, True)
    assert rel_err(out, torch.cat([o for o, _ in ref])) < TOL


@gpu
@pytest.mark.usefixtures("strict_index_checks")  # (it asserts a bad append is refused before writing)
@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
def test_kvcache_packed_appends(page_size):
    """cu_seqlens_k_new: each sequence appends its own number of new tokens (0 included, to an empty
    cache too) at its cache length and attends over all of them, with packed queries, then again
    with batched ones through flash-attn's name; the cache then holds exactly the appended rows."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    hkv, d = 2, 128
    lens, new1, new2 = [300, 0, 1000, 64], [3, 7, 0, 1], [1, 2, 5, 0]
    mid = [a + b for a, b in zip(lens, new1)]
    final = [a + b for a, b in zip(mid, new2)]
    k_seqs, v_seqs, k_cache, v_cache, table = _paged_cache(final, hkv, d, page_size or 64, gen)
    if page_size is None:  # dense: one row per sequence
        pad = lambda x: torch.cat([x, x.new_full((1040 - x.shape[0], hkv, d), float("nan"))])
        k_cache, v_cache, table = torch.stack([pad(k) for k in k_seqs]), torch.stack([pad(v) for v in v_seqs]), None
    host_table = None if table is None else table.cpu()

    def slots(b, positions):
        if host_table is None:
            return b, list(positions)
        return host_table[b, [p // page_size for p in positions]].tolist(), [p % page_size for p in positions]

    for b in range(4):  # the slots the appends fill start as NaN
        k_cache[slots(b, range(lens[b], final[b]))] = float("nan")
        v_cache[slots(b, range(lens[b], final[b]))] = float("nan")
    new_rows = lambda seqs, lo, hi: torch.cat([x[a:c] for x, a, c in zip(seqs, lo, hi)])
    lens_q = [3, 7, 1, 2]
    q = torch.randn(sum(lens_q), 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = fa3.attention_with_kvcache(q, k_cache, v_cache, new_rows(k_seqs, lens, mid), new_rows(v_seqs, lens, mid),
                                     cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     block_table=table, cu_seqlens_q=_cu(lens_q), max_seqlen_q=7,
                                     cu_seqlens_k_new=_cu(new1), causal=True)
    ref = _reference(list(torch.split(q, lens_q)), [k[:n] for k, n in zip(k_seqs, mid)],
                     [v[:n] for v, n in zip(v_seqs, mid)], True)
    assert rel_err(out, torch.cat([o for o, _ in ref])) < TOL, rel_err(out, torch.cat([o for o, _ in ref]))
    q2 = torch.randn(4, 2, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out2 = fa3.flash_attn_with_kvcache(q2, k_cache, v_cache, new_rows(k_seqs, mid, final),
                                       new_rows(v_seqs, mid, final),
                                       cache_seqlens=torch.tensor(mid, dtype=torch.int32, device="cuda"),
                                       page_table=table, cu_seqlens_k_new=_cu(new2), causal=True, num_splits=3)
    ref2 = _reference(list(q2), k_seqs, v_seqs, True)
    assert rel_err(out2, torch.stack([o for o, _ in ref2])) < TOL
    for b in range(4):
        assert torch.equal(k_cache[slots(b, range(final[b]))], k_seqs[b]), f"sequence {b}'s keys in the cache"
        assert torch.equal(v_cache[slots(b, range(final[b]))], v_seqs[b]), f"sequence {b}'s values in the cache"
    bad = torch.tensor([0, 1, 0, 1, 1], dtype=torch.int32, device="cuda")  # decreasing: refused, nothing written
    before = k_cache.clone()
    with pytest.raises(ValueError, match="cu_seqlens_k_new decreases at entry 2"):
        fa3.attention_with_kvcache(q2, k_cache, v_cache, k_seqs[0][:1], v_seqs[0][:1],
                                   cache_seqlens=torch.tensor(final, dtype=torch.int32, device="cuda"),
                                   block_table=table, cu_seqlens_k_new=bad)
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())


GRAPH_STEPS = [  # (page size, (query, key) lengths captured, then replayed, max_seqlen_q)
    (16, ([1, 1, 16, 1], [100, 1, 40, 2000]), ([2, 1, 13, 3], [1500, 7, 16, 1]), 16),
    (64, ([1, 1, 16, 1], [100, 1, 40, 2000]), ([2, 1, 13, 3], [1500, 7, 16, 1]), 16),
    # prompt chunks on K5 beside decodes on S1: both find their entries on the GPU
    (16, ([1, 700, 1, 300], [100, 1500, 40, 300]), ([200, 1, 600, 201], [1000, 7, 1300, 129]), 1000),
]


@gpu
@pytest.mark.parametrize("page_size, captured, replayed, max_q", GRAPH_STEPS)
def test_varlen_over_cache_in_cuda_graph(page_size, captured, replayed, max_q):
    """A mixed step captured once and replayed with new lengths, new pages and new queries (no host
    sync, no planning in the replay): it equals an eager call on the new values."""
    gen = torch.Generator(device="cuda").manual_seed(page_size + max_q)
    _, _, k_cache, v_cache, table = _paged_cache([2048] * 4, 8, 128, page_size, gen, spare_pages=0)
    q = torch.randn(sum(captured[0]), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = _cu(captured[0])
    seqused = torch.tensor(captured[1], dtype=torch.int32, device="cuda")
    meta = fa3.get_scheduler_metadata(4, max_q, 2048, 32, 8, 128, seqused, causal=True, page_size=page_size)
    step = lambda: fa3.attention_varlen(q, k_cache, v_cache, cu_q, None, max_q, 2048, block_table=table,
                                        seqused_k=seqused, causal=True, scheduler_metadata=meta)
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqused.copy_(torch.tensor(replayed[1], dtype=torch.int32))
    cu_q.copy_(_cu(replayed[0]))
    table.copy_(table.flip(1))
    q.normal_(generator=gen)
    graph.replay()
    assert rel_err(out, step()) < 1e-6


@gpu
@pytest.mark.usefixtures("strict_index_checks")  # (it asserts a bad left padding is refused in the call)
@pytest.mark.parametrize("new_tokens", [0, 1])
def test_kvcache_leftpad(new_tokens):
    """flash-attn's cache_leftpad: sequence b's keys are cache positions [leftpad[b],
    cache_seqlens[b] + new): the padding before them (NaN here) is never read; appends land at
    cache_seqlens as without it; causal aligns to the end of the keys; 1 to n splits."""
    gen = torch.Generator(device="cuda").manual_seed(13 + new_tokens)
    batch, capacity, hkv, d = 4, 1024, 2, 128
    pads, lens = [0, 100, 513, 7], [300, 164, 900, 8]
    k = torch.randn(batch, capacity, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    for b, (pad, n) in enumerate(zip(pads, lens)):
        k[b, :pad] = float("nan")
        v[b, :pad] = float("nan")
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    q = torch.randn(batch, 2, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = torch.randn(batch, new_tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_new = torch.randn_like(k_new)
    ref = [attention_reference(q[b:b + 1], torch.cat([k[b, pads[b]:lens[b]], k_new[b]])[None],
                               torch.cat([v[b, pads[b]:lens[b]], v_new[b]])[None], True, dtype=torch.float64)[0]
           for b in range(batch)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    for splits in (1, 5, 0):
        kc, vc = k.clone(), v.clone()
        args = (k_new, v_new) if new_tokens else ()
        out = fa3.flash_attn_with_kvcache(q, kc, vc, *args, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                          causal=True, num_splits=splits)
        assert rel_err(out, torch.cat(ref)) < TOL, f"splits {splits}: {rel_err(out, torch.cat(ref))}"
    bad = torch.tensor([0, 165, 0, 0], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=re.escape("cache_leftpad[1] = 165")):
        fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=bad)


# ----------------------------------------------------------------------------- bad values, on the GPU
@gpu
@pytest.mark.usefixtures("strict_index_checks")
def test_bad_values_over_cache_refused_before_writing():
    """Bad cu_seqlens_q / seqused_k / block_table values: a ValueError naming them, and out= is
    left as it was (nothing written)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    _, _, k_cache, v_cache, table = _paged_cache([100, 40], 2, 128, 16, gen, spare_pages=0)
    q = torch.randn(5, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqused = torch.tensor([100, 40], dtype=torch.int32, device="cuda")
    cases = [
        (dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32, device="cuda")), "start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32, device="cuda")), "decreases"),
        (dict(seqused_k=torch.tensor([100, 400], dtype=torch.int32, device="cuda")), "seqused_k[1] = 400"),
        (dict(block_table=torch.where(table == table[1, 0], 99, table)), "block_table[1, 0] = 99"),
    ]
    for over, words in cases:
        args = dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda"), seqused_k=seqused,
                    block_table=table)
        args.update(over)
        out = torch.full_like(q, float("nan"))
        with pytest.raises(ValueError, match=re.escape(words)):
            fa3.attention_varlen(q, k_cache, v_cache, args["cu_seqlens_q"], None, 3, 400, causal=True, out=out,
                                 block_table=args["block_table"], seqused_k=args["seqused_k"])
        assert out.isnan().all(), f"{words}: out was written"


# ----------------------------------------------------------------------------- CPU: refusals
def _cpu_call(**over):
    args = dict(q=torch.randn(5, 8, 128, dtype=torch.bfloat16),
                k=torch.randn(6, 16, 2, 128, dtype=torch.bfloat16),
                v=torch.randn(6, 16, 2, 128, dtype=torch.bfloat16),
                cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32), cu_seqlens_k=None,
                block_table=torch.zeros(2, 3, dtype=torch.int32),
                seqused_k=torch.tensor([3, 4], dtype=torch.int32))
    args.update(over)
    return args


@pytest.mark.usefixtures("strict_index_checks")  # (on a GPU its tensors' values are checked in the call)
def test_varlen_over_cache_argument_checks():
    call = fa3.attention_varlen
    raises_with(call, ValueError, "block_table", "int32", **_cpu_call(block_table=torch.zeros(2, 3)))
    raises_with(call, ValueError, "block_table", "(batch=2, max_pages)",
                **_cpu_call(block_table=torch.zeros(3, 3, dtype=torch.int32)))
    raises_with(call, ValueError, "block_table", **_cpu_call(block_table=torch.zeros(6, dtype=torch.int32)))
    raises_with(call, ValueError, "seqused_k", "(batch=2,)", **_cpu_call(seqused_k=torch.tensor([3], dtype=torch.int32)))
    raises_with(call, ValueError, "seqused_k", "int32", **_cpu_call(seqused_k=torch.tensor([3, 4])))
    raises_with(call, ValueError, "seqused_k is required", **_cpu_call(seqused_k=None))
    raises_with(call, ValueError, "cu_seqlens_k must be None",
                **_cpu_call(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32)))
    raises_with(call, ValueError, "cu_seqlens_q", "int32", **_cpu_call(cu_seqlens_q=torch.tensor([0, 2, 5])))
    raises_with(call, ValueError, "page_size = k_cache.shape[1] = 0",
                **_cpu_call(k=torch.randn(6, 0, 2, 128, dtype=torch.bfloat16),
                            v=torch.randn(6, 0, 2, 128, dtype=torch.bfloat16)))
    raises_with(call, ValueError, "max_seqlen_q", **_cpu_call(), max_seqlen_q=-1)
    raises_with(call, ValueError, "q has head_dim 64", **_cpu_call(q=torch.randn(5, 8, 64, dtype=torch.bfloat16)))
    raises_with(call, ValueError, "a dense k_cache must have batch 2",
                **_cpu_call(block_table=None, k=torch.randn(3, 16, 2, 128, dtype=torch.bfloat16),
                            v=torch.randn(3, 16, 2, 128, dtype=torch.bfloat16)))
    raises_with(call, ValueError, "cu_seqlens_k is required", **_cpu_call(block_table=None, seqused_k=None))
    raises_with(fa3.flash_attn_varlen_func, ValueError, "s_aux and learnable_sink", **_cpu_call(),
                s_aux=torch.zeros(8), learnable_sink=torch.zeros(8))
    raises_with(fa3.flash_attn_varlen_func, NotImplementedError, "fa_version=2", **_cpu_call(), fa_version=2)
    raises_with(fa3.attention_with_kvcache, NotImplementedError, "cu_seqlens_q",
                q=torch.randn(5, 8, 128, dtype=torch.bfloat16), k_cache=torch.randn(6, 16, 2, 128, dtype=torch.bfloat16),
                v_cache=torch.randn(6, 16, 2, 128, dtype=torch.bfloat16), k=torch.randn(2, 1, 2, 128, dtype=torch.bfloat16),
                v=torch.randn(2, 1, 2, 128, dtype=torch.bfloat16), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
                block_table=torch.zeros(2, 3, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32))
    raises_with(split_plan.check_scheduler_metadata, ValueError, "scheduler_metadata", metadata=torch.zeros(2),
                q=torch.zeros(1))
    dense = dict(q=torch.randn(2, 1, 8, 128, dtype=torch.bfloat16), k_cache=torch.randn(2, 64, 2, 128, dtype=torch.bfloat16),
                 v_cache=torch.randn(2, 64, 2, 128, dtype=torch.bfloat16), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    raises_with(fa3.attention_with_kvcache, ValueError, "cache_leftpad", "(batch=2,)", **dense,
                cache_leftpad=torch.zeros(3, dtype=torch.int32))
    raises_with(fa3.attention_with_kvcache, ValueError, "cache_leftpad", "int32", **dense,
                cache_leftpad=torch.zeros(2))
    raises_with(fa3.attention_with_kvcache, NotImplementedError, "cache_leftpad", "block_table",
                **{**dense, "k_cache": torch.randn(4, 16, 2, 128, dtype=torch.bfloat16),
                   "v_cache": torch.randn(4, 16, 2, 128, dtype=torch.bfloat16)},
                block_table=torch.zeros(2, 2, dtype=torch.int32), cache_leftpad=torch.zeros(2, dtype=torch.int32))


def test_leftpad_value_check_on_host_copies():
    seqlens = torch.tensor([10, 4], dtype=torch.int32)
    check = lambda pads, lengths=seqlens: index_checks.start_leftpad_check(
        torch.tensor(pads, dtype=torch.int32), lengths, 16, 0, 16)()
    check([10, 0])
    with pytest.raises(ValueError, match=re.escape("cache_leftpad[0] = -1")):
        check([-1, 0])
    with pytest.raises(ValueError, match=re.escape("cache_leftpad[1] = 5 is outside [0, cache_seqlens[1] = 4]")):
        check([0, 5])
    with pytest.raises(ValueError, match=re.escape("cache_seqlens[1] = 17")):
        check([0, 0], torch.tensor([10, 17], dtype=torch.int32))


def test_packed_cache_value_checks_on_host_copies():
    """The eager value checks of a packed call over a cache (CPU tensors stand in for the device
    copies): offsets, lengths (named seqused_k) and the pages the sequences use."""
    table = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([20, 16], dtype=torch.int32)

    def check(cu, lengths=lengths, table=table, max_q=3):
        index_checks.start_packed_cache_check(torch.tensor(cu, dtype=torch.int32), 5, max_q, lengths, table,
                                              3 * 16, 16, 3, "seqused_k")()

    check([0, 2, 5])  # fine: entries past a sequence's pages (-1) are not read
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] = 1"):
        check([1, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens_q decreases at entry 2"):
        check([0, 4, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 4"):
        check([0, 2, 4])
    with pytest.raises(ValueError, match="max_seqlen_q=2"):
        check([0, 2, 5], max_q=2)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 49"):
        check([0, 2, 5], lengths=torch.tensor([20, 49], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
        check([0, 2, 5], lengths=torch.tensor([20, 17], dtype=torch.int32))


def test_packed_append_value_checks_on_host_copies():
    """The eager value checks of packed appends (CPU tensors stand in for the device copies):
    cu_seqlens_k_new's offsets, each length with its own append within the capacity, the pages
    used after the append, and cu_seqlens_q beside them."""
    table = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([20, 10], dtype=torch.int32)

    def check(cu_new, lengths=lengths, total_new=5, cu_q=None):
        cu_q = None if cu_q is None else torch.tensor(cu_q, dtype=torch.int32)
        index_checks.start_append_check(torch.tensor(cu_new, dtype=torch.int32), total_new, lengths, table, 3 * 16,
                                        16, 3, cu_q, 4, 3)()

    check([0, 2, 5])
    check([0, 0, 5], cu_q=[0, 1, 4])
    with pytest.raises(ValueError, match=r"cu_seqlens_k_new\[0\] = 1"):
        check([1, 2, 5])
    with pytest.raises(ValueError, match="cu_seqlens_k_new decreases at entry 2"):
        check([0, 4, 3])
    with pytest.raises(ValueError, match=r"cu_seqlens_k_new\[-1\] = 4 but k.shape\[0\] = 5"):
        check([0, 2, 4])
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1"):
        check([0, 0, 7], total_new=7)  # 17 keys after the append need sequence 1's second page
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 46 plus the 3 new tokens"):
        check([0, 3, 5], lengths=torch.tensor([46, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -1"):
        check([0, 2, 5], lengths=torch.tensor([20, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 3"):
        check([0, 2, 5], cu_q=[0, 1, 3])


def test_entry_order_longest_first():
    """s1's CTAs take the entries longest first once they need more than one wave of the SMs
    (split_plan.longest_first; kernels/entry_order.py sorts them on the device)."""
    spec = fa3.registry.get("s1")
    assert not split_plan.longest_first(6, ctas=264, slots=264)  # one wave: nothing to order
    assert not split_plan.longest_first(1, ctas=1000, slots=264)
    assert split_plan.longest_first(6, ctas=265, slots=264)
    # the CTA count: splits x KV heads x Q tiles (packed: the grid's bound by total_q)
    assert split_plan.s1_ctas(spec, 126, 1, 32, 8, 1) == 126 * 8
    assert split_plan.s1_ctas(spec, 4, 100, 32, 8, 2) == 2 * 8 * 4 * 7
    assert split_plan.s1_ctas(spec, 100, 1000, 32, 8, 1, total_q=1100) == 8 * (69 + 100)


def test_split_plan_from_shapes():
    spec = fa3.registry.get("s1")
    mask = fa3.masking.masking(True, (-1, -1), 0.0, 1.0)
    # decode of one long sequence: split to fill the SMs; a wide batch: one split
    assert split_plan.plan_splits(spec, 1, 1, 32, 8, 32768, mask, 132, 128, False) == 16
    assert split_plan.plan_splits(spec, 64, 1, 32, 8, 4096, mask, 132, 128, False) == 1
    # query heads of a KV head share a tile (16 x 4 = one 64-row tile); more queries make more
    # Q tiles, so fewer splits
    assert split_plan.plan_splits(spec, 1, 16, 32, 8, 32768, mask, 132, 128, False) == 16
    assert split_plan.plan_splits(spec, 1, 64, 32, 8, 32768, mask, 132, 128, False) == 4
    # row gathers (pages of 16): two d128 CTAs share an SM, so twice the CTAs fill it
    assert split_plan.plan_splits(spec, 16, 1, 32, 8, 8192, mask, 132, 128, True) == 2
    assert split_plan.plan_splits(spec, 1, 1, 32, 8, 32768, mask, 132, 128, True) == 33
    assert split_plan.plan_splits(spec, 64, 1, 32, 8, 4096, mask, 132, 128, True) == 1


def test_call_plan_memo():
    """A call's plan (split_plan.call_plan) is computed once per set of host integers and equals
    its parts: a decode loop repeats the arguments and gets the stored plan back; any argument
    that changes gives a fresh one."""
    spec = fa3.registry.get("s1")
    args = dict(spec=spec, head_dim=128, batch=1, seqlen_q=1, total_q=None, heads_q=32, heads_kv=8, page_size=None,
                keys=32768, causal=True, window=(-1, -1), softcap=0.0, scale=0.125, fp8=False, offsets=False,
                num_splits=0, sm_count=132)
    plan = split_plan.call_plan(**args)
    assert split_plan.call_plan(**args) is plan
    assert plan.num_splits == 16 and not plan.gather and plan.long is None and not plan.longest_first
    assert plan.mask.causal and plan.mask.scale_log2 == pytest.approx(0.125 * 1.4426950408889634)
    assert split_plan.call_plan(**{**args, "page_size": 16}).num_splits == 33  # gathers: 2 CTAs an SM
    assert split_plan.call_plan(**{**args, "num_splits": 3}).num_splits == 3
    many = split_plan.call_plan(**{**args, "batch": 126, "keys": 4096})
    assert many.num_splits == 1 and many.longest_first  # 1008 CTAs: more than a wave
    packed = split_plan.call_plan(**{**args, "seqlen_q": 1024, "total_q": 1100, "page_size": 64})
    assert packed.long is not None and packed.s1_queries == spec.config.base.long_queries - 1
    with pytest.raises(ValueError, match="softmax_scale"):  # checked on the way in, never stored
        split_plan.call_plan(**{**args, "scale": float("nan")})
    # every argument is in the key: changing any one gives a plan of its own
    for name, value in dict(head_dim=64, batch=2, seqlen_q=2, total_q=1, heads_q=16, heads_kv=4, page_size=64,
                            keys=1000, causal=False, window=(8, 0), softcap=5.0, scale=0.5, fp8=True, offsets=True,
                            num_splits=2, sm_count=114).items():
        assert split_plan.call_plan(**{**args, name: value}) is not plan, name


def test_capped_splits():
    """max_splits (flash-attn 3's num_splits: a cap, which vLLM passes as 16 under full CUDA graphs for
    every batch size) plans from the shapes and caps; encoded as -n for the op (split_request), with
    clear errors for bad requests; the flash-attn names pass num_splits > 1 on as the cap."""
    spec = fa3.registry.get("s1")
    args = dict(spec=spec, head_dim=128, batch=1, seqlen_q=1, total_q=None, heads_q=32, heads_kv=8, page_size=16,
                keys=32768, causal=True, window=(-1, -1), softcap=0.0, scale=0.125, fp8=False, offsets=False,
                num_splits=split_plan.split_request(0, 16), sm_count=132)
    assert split_plan.call_plan(**args).num_splits == 16  # 33 planned (two CTAs an SM), capped
    assert split_plan.call_plan(**{**args, "num_splits": -64}).num_splits == 33
    assert split_plan.call_plan(**{**args, "batch": 64}).num_splits == 1  # 512 CTAs fill the SMs: no split
    assert split_plan.call_plan(**{**args, "batch": 4, "page_size": None}).num_splits == 4
    assert split_plan.split_request(5) == 5 and split_plan.split_request(0) == 0
    for bad in (dict(num_splits=-1), dict(num_splits=0, max_splits=-2), dict(num_splits=1.5), dict(num_splits=True),
                dict(num_splits=2, max_splits=4)):
        with pytest.raises(ValueError, match="splits"):
            split_plan.split_request(**bad)

    seen = []
    record = lambda *a, **kw: seen.append({k: kw.get(k) for k in ("num_splits", "max_splits")})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa3.flash_compat, "attention_varlen", record)
        mp.setattr(fa3.flash_compat, "attention_with_kvcache", record)
        q = torch.empty(4, 8, 128, dtype=torch.bfloat16)
        for n in (0, 1, 16):
            fa3.flash_attn_varlen_func(q, q, q, None, seqused_k=q, num_splits=n)
            fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=q, num_splits=n)
    assert seen == [{"num_splits": 0, "max_splits": None}] * 2 + [{"num_splits": 1, "max_splits": None}] * 2 + \
        [{"num_splits": None, "max_splits": 16}] * 2


@gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_vllm_query_layout(page_size):
    """vLLM's q is a view of the fused QKV projection's output: (tokens, heads_q, d) with a token stride
    of (heads_q + 2 heads_kv) d. A step of decodes and a prompt chunk on such a q equals the same step on
    a contiguous copy, bit for bit, and the float64 reference; so does the cache in vLLM's "HND"
    layout (heads outermost within a page)."""
    gen = torch.Generator(device="cuda").manual_seed(72 + page_size)
    lens_q, lens_k = [1, 1, 300, 1], [900, 1, 700, 4100]
    k_seqs, v_seqs, k_pool, v_pool, table = _paged_cache(lens_k, 8, 128, page_size, gen)
    qkv = torch.randn(sum(lens_q), (32 + 2 * 8) * 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = qkv[:, :32 * 128].view(-1, 32, 128)
    assert not q.is_contiguous()
    seqused = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    run = lambda query: fa3.flash_attn_varlen_func(query, k_pool, v_pool, _cu(lens_q), None, max(lens_q), max(lens_k),
                                                   causal=True, block_table=table, seqused_k=seqused,
                                                   return_softmax_lse=True)
    out, lse = run(q)
    want, want_lse = run(q.contiguous())
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    _check(out, lse, _reference(list(torch.split(q, lens_q)), k_seqs, v_seqs, True), f"page {page_size}")
    # vLLM's "HND" cache layout: each page's heads outermost in memory, the same (pages, page_size,
    # heads_kv, d) view with other strides
    k_hnd, v_hnd = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k_pool, v_pool))
    # the pool's unused rows hold NaN (poison), so values are compared with NaN equal to NaN
    assert not k_hnd.is_contiguous() and torch.allclose(k_hnd, k_pool, rtol=0, atol=0, equal_nan=True)
    out_hnd, lse_hnd = fa3.flash_attn_varlen_func(q, k_hnd, v_hnd, _cu(lens_q), None, max(lens_q), max(lens_k),
                                                  causal=True, block_table=table, seqused_k=seqused,
                                                  return_softmax_lse=True)
    assert torch.equal(out_hnd, want) and torch.equal(lse_hnd, want_lse)

@gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_vllm_full_graph_capture(page_size, monkeypatch):
    """vLLM's full CUDA graphs: a decode step captured from its dummy run (every sequence one key long,
    max_seqlen_k = 1, num_splits = 16) and replayed with the real lengths: right for them, out
    poisoned before the replay; the splits planned for the cache's capacity (several at batch 3), not
    for the dummy's one key."""
    plans = []

    def call_plan(*args, **kw):
        plan = split_plan.call_plan(*args, **kw)
        plans.append((args[8], plan.num_splits))  # (keys, splits)
        return plan

    monkeypatch.setattr(fa3.kvcache, "call_plan", call_plan)
    gen = torch.Generator(device="cuda").manual_seed(71 + page_size)
    lens = [3000, 700, 1]
    k_seqs, v_seqs, k_pool, v_pool, table = _paged_cache(lens, 8, 128, page_size, gen)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqused = torch.ones(len(lens), dtype=torch.int32, device="cuda")  # the dummy run's lengths
    out = torch.empty_like(q)
    cu_seqlens_q = _cu([1] * len(lens))  # made before the capture, as vLLM's persistent buffers are
    step = lambda: fa3.flash_attn_varlen_func(q, k_pool, v_pool, cu_seqlens_q, None, 1, 1, causal=True,
                                             block_table=table, seqused_k=seqused, out=out, num_splits=16,
                                             fa_version=3)
    step()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seqused.copy_(torch.tensor(lens, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref = _reference(list(torch.split(q, 1)), k_seqs, v_seqs, True)
    ref_o = torch.cat([o for o, _ in ref])
    assert not out.isnan().any() and rel_err(out, ref_o) < TOL
    capacity = table.shape[1] * page_size
    assert plans[-1][0] == capacity and 1 < plans[-1][1] <= 16, plans

def test_long_entries_plan():
    """Which calls run their long entries on K5, with which page layout (split_plan.prefill_plan)."""

    s1 = fa3.registry.get("s1")
    long_q = s1.config.base.long_queries
    plan = lambda page_size, max_q=long_q, packed=True, fp8=False, offsets=False, d=128, causal=True: \
        split_plan.prefill_plan(s1, d, page_size, max_q, causal, False, packed, fp8, offsets)
    assert plan(None) == split_plan.PrefillPlan(long_q, False, 0)  # dense: a key block a box
    assert plan(128) == split_plan.PrefillPlan(long_q, True, 0) and plan(256).page_rows == 0
    assert plan(16).page_rows == 16 and plan(32).page_rows == 32 and plan(64).page_rows == 64
    assert plan(64, d=256).page_rows == 0  # d256's 64-key tiles: a page holds a whole block
    assert plan(16, d=96).page_rows == 16 and plan(32, d=96).page_rows == 32  # causal d96: 96-key tiles
    assert plan(32, d=96, causal=False) is None  # 112-key tiles
    assert plan(32, d=192) is None and plan(16, d=192).page_rows == 16  # d192's 80-key packed tiles
    for refused in (plan(1), plan(8), plan(48), plan(16, max_q=long_q - 1), plan(16, packed=False),
                    plan(16, fp8=True), plan(16, offsets=True)):
        assert refused is None
    # the tiles the plan assumes are the kernel's (its constructor asserts them), at every head dim
    for d in (64, 96, 128, 192, 256):
        for causal, local in ((False, False), (True, False), (True, True)):
            assert split_plan.prefill_config(d, causal, local).tile_n % 16 == 0


def test_scheduler_metadata_plans_as_the_call(monkeypatch):
    """get_scheduler_metadata counts what the call will: with packed queries whose longest run goes
    to K5, S1's split plan covers the short entries only."""
    from fa3 import _checks

    monkeypatch.setattr(_checks, "sm_count", lambda index: 132)
    spec, mask = fa3.registry.get("s1"), fa3.masking.masking(True, (-1, -1), 0.0, 1.0)
    lens, cu = torch.tensor([30000], dtype=torch.int32), torch.tensor([0, 1000], dtype=torch.int32)
    assert split_plan.prefill_plan(spec, 128, 16, 1000, True, False, True, False, False) is not None  # K5 takes it
    short_runs = split_plan.plan_splits(spec, 1, 1, 32, 8, 32768, mask, 132, 128, True)
    whole_run = split_plan.plan_splits(spec, 1, 1000, 32, 8, 32768, mask, 132, 128, True)
    assert short_runs != whole_run
    meta = lambda **kw: int(fa3.get_scheduler_metadata(1, 1000, 32768, 32, 8, 128, lens, page_size=16, causal=True,
                                                        **kw)[0])
    assert meta(cu_seqlens_q=cu) == short_runs
    assert meta() == whole_run  # batched queries: S1 takes the whole call
    assert meta(cu_seqlens_q=cu, qkv_dtype=torch.float8_e4m3fn) == \
        split_plan.plan_splits(spec, 1, 1000, 32, 8, 32768, mask, 132, 128, True, True)  # FP8: S1 only
    # the call runs on every SM, so the plan counts them all (a decode's splits depend on the count)
    decode = lambda **kw: int(fa3.get_scheduler_metadata(1, 1, 32768, 32, 8, 128, lens, page_size=16, causal=True,
                                                          **kw)[0])
    assert decode(sm_margin=66) == decode() == split_plan.plan_splits(spec, 1, 1, 32, 8, 32768, mask, 132, 128, True)
    assert split_plan.plan_splits(spec, 1, 1, 32, 8, 32768, mask, 66, 128, True) != decode()


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_split_plan_knows_the_kernels_ring(head_dim):
    """The SMEM plan s1 compiles and the host counts CTAs by (config.decode_config; the kernel refuses a
    SharedStorage larger than it), gives the ring depths and CTAs an SM the kernels were tuned for."""
    spec = fa3.registry.get("s1")
    # (gather, FP8 cache) -> stages: a TMA ring as deep as SMEM allows (up to 8), gathers 3, FP8 4
    stages = {(False, False): {64: 8, 96: 8, 128: 6, 192: 4, 256: 3}[head_dim], (True, False): 3,
              (False, True): 4, (True, True): 3}
    for (gather, fp8), want in stages.items():
        plan = config.decode_config(spec.config, head_dim, gather=gather, fp8=fp8)
        assert plan.kv_stages == want, (head_dim, gather, fp8)
        assert plan.planned_smem_bytes <= config.CTA_SMEM_BYTES
    assert split_plan.ctas_per_sm(spec, head_dim, False) == 1
    assert split_plan.ctas_per_sm(spec, head_dim, True) == {64: 3, 96: 2, 128: 2, 192: 1, 256: 1}[head_dim]
    assert split_plan.ctas_per_sm(spec, head_dim, True, fp8=True) == {64: 4, 96: 3, 128: 2, 192: 1, 256: 1}[head_dim]


def test_packed_cache_op_fake_shapes():
    """torch.ops.fa3.attention_kvcache with packed queries, under FakeTensorMode (what torch.compile
    traces): out like q, lse (heads_q, total_q)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(7, 8, 128, dtype=torch.bfloat16, device="cuda")
        pages = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        seqused = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.fa3.attention_kvcache(q, pages, pages, seqused, table, 0, True, 0.1, 0, "s1",
                                                   -1, -1, 0.0, cu, 5, 64)
    assert out.shape == q.shape and lse.shape == (8, 7) and lse.dtype == torch.float32


def test_cache_rung_by_the_calls_shape(monkeypatch):
    """kernel=None runs s2 (the keys split across the warps, 16 query rows) on paged and FP8 caches
    whose KV heads serve 16 rows or fewer, s1 elsewhere (dense 16-bit caches, more rows, head dims
    s2 does not compile); get_scheduler_metadata plans for the rung the call runs; a named rung
    stays the named one."""
    from fa3 import _checks, _dispatch
    monkeypatch.setattr(_checks, "sm_count", lambda index: 132)  # (an H100's, without one)
    assert _dispatch.cache_rung(None, 128, 4, True, False).name == "s2"
    assert _dispatch.cache_rung(None, 64, 16, False, True).name == "s2"
    assert _dispatch.cache_rung(None, 128, 4, False, False).name == "s1"  # dense 16-bit
    assert _dispatch.cache_rung(None, 128, 17, True, True).name == "s1"  # more rows than s2's tile
    assert _dispatch.cache_rung(None, 256, 4, True, True).name == "s1"  # no s2 at d256
    assert _dispatch.cache_rung("s1", 128, 4, True, True).name == "s1"
    with pytest.raises(ValueError, match="head_dim=80"):
        _dispatch.cache_rung(None, 80, 4, True, False)
    cases = [(4, 16, 32, 8, 1), (64, 16, 32, 8, 1), (4, None, 32, 8, 1), (4, 16, 32, 2, 2)]
    for batch, page_size, heads_q, heads_kv, seqlen_q in cases:
        rows = seqlen_q * heads_q // heads_kv
        spec = _dispatch.cache_rung(None, 128, rows, page_size is not None, False)
        plan = split_plan.call_plan(spec, 128, batch, seqlen_q, None, heads_q, heads_kv, page_size, 8192, False,
                                    (-1, -1), 0.0, 1.0, False, False, 0, 132)
        lengths = torch.full((batch,), 8192, dtype=torch.int32)
        got = split_plan.get_scheduler_metadata(batch, seqlen_q, 8192, heads_q, heads_kv, 128, lengths,
                                                page_size=page_size)
        assert int(got) == plan.num_splits, (batch, page_size, heads_q, heads_kv, seqlen_q)
