"""fa3.attention_with_kvcache: GPU correctness against the float reference, and CPU validation.

The cache rows past each sequence's length are poisoned (K with NaN, V with NaN) so that a kernel
reading or weighting them fails; cache_seqlens are ragged (0 and 1 included); pages are permuted.
"""

import pytest
import torch

import fa3
from fa3.cache import split_plan
from fa3.reference import attention_reference

from conftest import HEAD_DIM_PARAM, HAS_HOPPER, cache_reference, make_kv_cache, raises_with, rel_err

TOL = 1.5e-2
gpu = pytest.mark.gpu


CASES = [  # (batch, seqlen_q, heads_q, heads_kv, capacity, lens, new_tokens)
    (4, 1, 8, 2, 512, [0, 1, 200, 511], 0),
    (3, 1, 6, 1, 1024, [1000, 64, 129], 1),
    (2, 4, 4, 4, 256, [3, 250], 2),
    (2, 7, 8, 2, 768, [700, 7], 0),
]


@gpu
@HEAD_DIM_PARAM
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 64, 256])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kvcache_matches_reference(head_dim, causal, page_size, case):
    batch, sq, hq, hkv, capacity, lens, new = CASES[case]
    if page_size is not None and capacity % page_size:
        capacity += page_size - capacity % page_size
    gen = torch.Generator(device="cuda").manual_seed(case * 7 + head_dim)
    final = [n + new for n in lens]
    k_dense, v_dense, k_cache, v_cache, table = make_kv_cache(batch, capacity, hkv, head_dim,
                                                           [n for n in lens], page_size, gen)
    q = torch.randn(batch, sq, hq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_new = v_new = None
    if new:
        k_new = torch.randn(batch, new, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_new = torch.randn_like(k_new)
        for b, n in enumerate(lens):  # what the cache must hold after the append
            k_dense[b, n:n + new] = k_new[b]
            v_dense[b, n:n + new] = v_new[b]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_o, ref_lse = cache_reference(q.float(), k_dense.float(), v_dense.float(), final, causal)
    for splits in (1, 3, 0):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = fa3.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                              block_table=table, causal=causal, num_splits=splits,
                                              return_lse=True)
        assert out.shape == q.shape and not out.isnan().any(), f"NaN with num_splits={splits}"
        assert rel_err(out, ref_o) < TOL, f"num_splits={splits}: {rel_err(out, ref_o)}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), f"num_splits={splits}: empty rows differ"
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-2, rtol=1e-3)
        if new:  # appended in place
            got_k = kc if table is None else kc[table.long()].flatten(1, 2)
            for b, n in enumerate(lens):
                assert torch.equal(got_k[b, n:n + new], k_new[b])


@gpu
@pytest.mark.parametrize("window_size, softcap", [((100, 0), 0.0), ((-1, -1), 20.0), ((300, 0), 5.0)])
@pytest.mark.parametrize("page_size", [None, 64])
def test_kvcache_window_and_softcap(window_size, softcap, page_size):
    """Sliding window (causal, so right = 0 as flash-attn) and softcap, ragged lengths, 1 to n
    splits: the window moves the first visited key block, so splits start past block 0."""
    batch, sq, hq, hkv, capacity, lens = 3, 2, 8, 2, 1024, [1000, 37, 513]
    gen = torch.Generator(device="cuda").manual_seed(11)
    k_dense, v_dense, k_cache, v_cache, table = make_kv_cache(batch, capacity, hkv, 128, lens, page_size, gen)
    q = torch.randn(batch, sq, hq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_o, ref_lse = cache_reference(q.float(), k_dense.float(), v_dense.float(), lens, True, window_size, softcap)
    for splits in (1, 4, 0):
        out, lse = fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                              causal=True, window_size=window_size, softcap=softcap,
                                              num_splits=splits, return_lse=True)
        assert rel_err(out, ref_o) < TOL, f"num_splits={splits}: {rel_err(out, ref_o)}"
        assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3), f"num_splits={splits}"


@gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q, variant", [(1, "plain"), (3, "plain"), (2, "window-softcap-sinks"),
                                               (1, "fp16-non-causal-window")])
def test_attention_decode_steps_run_on_s1(head_dim, seqlen_q, variant):
    """fa3.attention's forward-only decode steps over a long context go to S1
    (kvcache.decodes_over_keys) and match the float reference; lse too; and they equal
    attention_with_kvcache on the same keys bit for bit (the same kernel), poisoned out= included."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, seqlen_k, heads_q, heads_kv = 2, 9000, 32, 8  # 9000 keys: not a multiple of any tile; K, V >= 32 MiB
    dtype = torch.float16 if variant.startswith("fp16") else torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    assert fa3.kvcache.decodes_over_keys(q, k, v)
    kw = dict(causal=True)
    if variant == "window-softcap-sinks":
        kw.update(window_size=(700, 0), softcap=15.0,
                  sinks=torch.randn(heads_q, device="cuda", generator=gen))
    elif variant != "plain":  # a window on both sides of the query's place (bottom-right aligned)
        kw.update(causal=False, window_size=(500, 20))
    out = torch.full_like(q, float("nan"))
    got, lse = fa3.attention(q, k, v, return_lse=True, out=out, **kw)
    assert got is out
    ref, ref_lse = attention_reference(q, k, v, window_size=kw.get("window_size", (-1, -1)),
                                       softcap=kw.get("softcap", 0.0), sinks=kw.get("sinks"), causal=kw["causal"])

    assert rel_err(got, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)
    same = fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlen_k, **kw)
    assert torch.equal(got, same)


@gpu
def test_attention_decode_steps_in_a_graph_first():
    """fa3.attention's decode steps read a lengths tensor kept per device and batch: a CUDA graph that
    captures its first use makes its own (filled on replay), and one made eagerly serves later
    graphs; a batch of several waves (no entry sort: every sequence holds all keys) is right too."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    for batch, seqlen_k in [(3, 8192), (160, 1100)]:  # 160 x 8 KV heads: several waves of S1's CTAs
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(batch, seqlen_k, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        fa3.attention(q[:1], k[:1], v[:1], causal=True)  # compiled outside the capture
        assert fa3.kvcache.decodes_over_keys(q, k, v) or batch == 160
        fa3.kvcache._FULL_LENGTHS.clear()
        out = torch.full_like(q, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fa3.kvcache.decode_attention(q, k, v, True, 128 ** -0.5, out=out)
        assert not fa3.kvcache._FULL_LENGTHS  # a capture does not keep what it made
        graph.replay()
        ref = attention_reference(q, k, v, causal=True)[0]
        assert rel_err(out, ref) < TOL
        eager = fa3.kvcache.decode_attention(q, k, v, True, 128 ** -0.5)[0]
        assert fa3.kvcache._FULL_LENGTHS and torch.equal(eager, out)
        out.fill_(float("nan"))
        graph2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph2):
            fa3.kvcache.decode_attention(q, k, v, True, 128 ** -0.5, out=out)
        graph2.replay()
        assert torch.equal(eager, out)

def test_decode_routing_decision():
    """Which forward-only calls fa3.attention sends to S1: few queries (a KV head's query rows in one
    tile), more keys than queries, K and V of 32 MiB or more, v's head dim as q's, TMA-aligned."""
    def call(batch=1, seqlen_q=1, seqlen_k=8192, heads_q=32, heads_kv=8, d=128, dv=None):
        q = torch.empty(batch, seqlen_q, heads_q, d, dtype=torch.bfloat16, device="meta")
        k = torch.empty(batch, seqlen_k, heads_kv, d, dtype=torch.bfloat16, device="meta")
        v = torch.empty(batch, seqlen_k, heads_kv, dv or d, dtype=torch.bfloat16, device="meta")
        return fa3.kvcache.decodes_over_keys(q, k, v)

    assert call() and call(seqlen_q=16) and call(batch=64, seqlen_k=4096) and call(d=256, seqlen_k=4096)
    assert not call(seqlen_q=17)  # 17 x 4 query rows: past one 64-row tile
    assert not call(seqlen_k=4096)  # 16 MiB of K and V: K5
    assert not call(seqlen_q=8192)  # a prompt, not a decode step
    assert not call(dv=64)  # v's head dim differs: K5
    assert not call(d=32, seqlen_k=1 << 15)  # no KV-cache rung for the head dim
    q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    wide = torch.empty(1, 8192, 8, 132, dtype=torch.bfloat16, device="meta")[..., :128]  # heads 132 apart
    assert not fa3.kvcache.decodes_over_keys(q, wide, wide)  # K5's path copies it; S1 reads it by TMA


def test_attention_routes_decode_steps(no_device_check, monkeypatch):
    """fa3.attention's dispatch: a forward-only decode step with kernel=None goes to
    kvcache.decode_attention; a named rung, a call that needs gradients, or a prompt does not."""
    from fa3 import interface, kvcache

    taken = []
    monkeypatch.setattr(kvcache, "decode_attention", lambda q, *a, **kw: taken.append("s1") or (q, None))
    monkeypatch.setattr(interface, "launch_attention", lambda spec, q, *a, **kw: taken.append(spec.name) or (q, None))
    q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8192, 8, 128, dtype=torch.bfloat16, device="meta")
    fa3.attention(q, k, k, causal=True)
    fa3.attention(q, k, k, causal=True, kernel="k5.5")
    fa3.attention(torch.empty(1, 8192, 32, 128, dtype=torch.bfloat16, device="meta"), k, k, causal=True)
    assert taken == ["s1", "k5.5", fa3.registry.fastest(fa3.registry.ATTENTION, 128).name]


@gpu
@pytest.mark.parametrize("kernel", ["s1", "s2"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_kvcache_splits_agree_and_rows_with_no_key_are_zero(kernel, sinks):
    """Every split count gives one split's result and the reference's: S2's four warp partials a
    CTA and 37 or 64 splits are past two of the combine's chunks, where its four warps share a row."""
    from fa3.reference import attention_reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 4096, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    sink = {"sinks": torch.randn(8, device="cuda", generator=gen)} if sinks else {}
    seqlens = torch.tensor([0, 4000], dtype=torch.int32, device="cuda")
    outs = [fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=s, kernel=kernel, **sink)
            for s in (1, 2, 7, 37, 64)]
    assert torch.equal(outs[0][0], torch.zeros_like(outs[0][0]))  # (a sink has no value)
    ref = attention_reference(q[1:], k[1:, :4000], v[1:, :4000], sinks=sink.get("sinks"))[0]
    for o in outs:
        assert rel_err(o, outs[0]) < 5e-3 and rel_err(o[1:], ref) < 1e-2


@gpu
def test_kvcache_decode_step_in_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(4, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    k_new, v_new = (torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
    seqlens = torch.tensor([5, 100, 1000, 2000], dtype=torch.int32, device="cuda")
    step = lambda: fa3.attention_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=seqlens)
    expected = step()  # compiles; appends at seqlens
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens += 1  # the next step: a new length, read on the device by the replay
    k_new.normal_(generator=gen)
    v_new.normal_(generator=gen)
    graph.replay()
    ref = fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens + 1)
    assert rel_err(out, ref) < 1e-6 and rel_err(out, expected) > 1e-4


# ----------------------------------------------------------------------------- CPU: validation
def _cpu_args(**over):
    args = dict(q=torch.randn(2, 1, 8, 128, dtype=torch.bfloat16),
                k_cache=torch.randn(2, 256, 2, 128, dtype=torch.bfloat16),
                v_cache=torch.randn(2, 256, 2, 128, dtype=torch.bfloat16),
                cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    args.update(over)
    return args


def raises(exc, *words, **over):
    return raises_with(fa3.attention_with_kvcache, exc, *words, **_cpu_args(**over))


def test_kvcache_validation_messages():
    raises(ValueError, "cache_seqlens", "int32", cache_seqlens=torch.tensor([3, 4]))
    raises(ValueError, "cache_seqlens", "(batch=2,)", cache_seqlens=torch.tensor([3], dtype=torch.int32))
    raises(ValueError, "cache_seqlens = -1", "negative", "[0, 256]", cache_seqlens=-1)
    raises(ValueError, "cache_seqlens = 257", "capacity of 256", "k_cache.shape[1] = 256", cache_seqlens=257)
    raises(ValueError, "cache_seqlens = 255", "2 new tokens", "257", "<= 256", cache_seqlens=255,
           k=torch.randn(2, 2, 2, 128, dtype=torch.bfloat16), v=torch.randn(2, 2, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "k_cache", "v_cache", v_cache=torch.randn(2, 128, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "heads_q=8", "heads_kv=3", k_cache=torch.randn(2, 256, 3, 128, dtype=torch.bfloat16),
           v_cache=torch.randn(2, 256, 3, 128, dtype=torch.bfloat16))
    raises(ValueError, "dense k_cache", "block_table", k_cache=torch.randn(3, 256, 2, 128, dtype=torch.bfloat16),
           v_cache=torch.randn(3, 256, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "block_table", "int32", block_table=torch.zeros(2, 4, dtype=torch.int64))
    raises(ValueError, "page_size = k_cache.shape[1] = 0", block_table=torch.zeros(2, 4, dtype=torch.int32),
           k_cache=torch.randn(8, 0, 2, 128, dtype=torch.bfloat16),
           v_cache=torch.randn(8, 0, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "both k and v", k=torch.randn(2, 1, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "new_tokens", k=torch.randn(2, 1, 4, 128, dtype=torch.bfloat16),
           v=torch.randn(2, 1, 4, 128, dtype=torch.bfloat16))
    raises(ValueError, "do not fit", k=torch.randn(2, 300, 2, 128, dtype=torch.bfloat16),
           v=torch.randn(2, 300, 2, 128, dtype=torch.bfloat16))
    raises(ValueError, "head_dim=80", q=torch.randn(2, 1, 8, 80, dtype=torch.bfloat16),
           k_cache=torch.randn(2, 256, 2, 80, dtype=torch.bfloat16),
           v_cache=torch.randn(2, 256, 2, 80, dtype=torch.bfloat16))
    raises(ValueError, "window_size", ">= 0", window_size=(-2, 0))
    raises(ValueError, "softcap", softcap=-1.0)
    raises(TypeError, "k_cache", "dtype", k_cache=torch.randn(2, 256, 2, 128))
    if not HAS_HOPPER:
        raises((ValueError, RuntimeError), "GPU")


def test_num_splits_heuristic():
    assert split_plan.num_splits_for(batch=64, heads_kv=8, q_tiles=1, capacity=4096, sm_count=132) == 1
    assert split_plan.num_splits_for(batch=1, heads_kv=8, q_tiles=1, capacity=32768, sm_count=132) == 16
    # a short cache keeps >= 4 key blocks per split
    assert split_plan.num_splits_for(batch=1, heads_kv=8, q_tiles=1, capacity=512, sm_count=132) == 2
    assert split_plan.num_splits_for(batch=1, heads_kv=1, q_tiles=1, capacity=64, sm_count=132) == 1
    # an FP8 cache read by TMA (two CTAs an SM): b64 x 8 KV heads fills 264 slots about twice, b32, b48
    # and b126 once, 1.5 and 3.8 times
    fp8 = dict(heads_kv=8, q_tiles=1, capacity=4096, sm_count=132, ctas_per_sm=2, fp8=True)
    assert [split_plan.num_splits_for(batch=b, **fp8) for b in (32, 48, 64, 126)] == [1, 1, 2, 1]
    assert split_plan.num_splits_for(batch=16, **fp8) == 2  # (fills the slots: 264 // 128)
    assert split_plan.num_splits_for(batch=64, **dict(fp8, fp8=False)) == 1


def test_kvcache_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 2, 8, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(3, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
        seqlens = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.fa3.attention_kvcache(q, kc, kc, seqlens, None, 0, True, 0.1, 0, "s1")
    assert out.shape == q.shape and lse.shape == (3, 8, 2) and lse.dtype == torch.float32
