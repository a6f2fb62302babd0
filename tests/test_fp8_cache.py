"""An FP8 KV cache: attention_with_kvcache / attention_varlen over a float8_e4m3fn cache with
descales (vLLM's and SGLang's call), against the float reference of the dequantized values; and the
CPU checks (argument errors, fake shapes, the kernel's PTX).

Descales are per (batch, heads_kv), as engines pass them; the cache rows past each length hold
NaN (e4m3's 0x7F), pages are permuted, some sequences are empty.
"""

import pytest
import torch

import fa3

from conftest import HEAD_DIM_PARAM, cache_reference, make_kv_cache, raises_with, rel_err

FP8 = torch.float8_e4m3fn
TOL = 2e-2  # fp16 P and a bf16 output over exactly dequantized values
gpu = pytest.mark.gpu


def quantize_per_head(x, planes_of=None):
    """x (planes, rows, heads, d) float -> (x8, descale) with one descale per (entry, head):
    entry = the plane (dense), or planes_of[p] (pages: the entry whose table names page p). NaN
    rows stay NaN and do not set the scale."""
    entries = x.shape[0] if planes_of is None else int(planes_of.max()) + 1
    owner = torch.arange(x.shape[0], device=x.device) if planes_of is None else planes_of
    amax = torch.zeros(entries, x.shape[2], device=x.device)
    per_plane = x.float().nan_to_num(0.0).abs().amax(dim=(1, 3))
    amax.index_reduce_(0, owner, per_plane, "amax")
    descale = amax.clamp_min(1e-6) / 440.0  # (just below e4m3's 448: no value rounds past it)
    return (x.float() / descale[owner][:, None, :, None]).to(FP8), descale


def quantize_queries(q, heads_kv):
    """q (batch, seqlen_q, heads_q, d) -> (q8, descale (batch, heads_kv)): one scale per KV head's
    group of query heads (flash-attn's FA3 convention)."""
    batch, seqlen_q, heads_q, d = q.shape
    grouped = q.float().view(batch, seqlen_q, heads_kv, heads_q // heads_kv, d)
    descale = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(1e-6) / 440.0
    q8 = (grouped / descale[:, None, :, None, None]).to(FP8).view(q.shape)
    return q8, descale


def dequantize(x8, descale, heads_axis=2):
    """x8 * its (batch, heads_kv) descale, in float32 (q: each KV head's group of query heads)."""
    b, h = descale.shape
    group = x8.shape[heads_axis] // h
    return x8.float() * descale.repeat_interleave(group, dim=1)[:, None, :, None]


def fp8_cache_case(head_dim, page_size, lens, seqlen_q=1, batch=3, heads_q=8, heads_kv=2, capacity=768, seed=0):
    """(q8, cache8 (k, v), table, descales, the dequantized dense q/k/v for the reference)."""
    gen = torch.Generator(device="cuda").manual_seed(seed + head_dim)
    k_dense, v_dense, k_cache, v_cache, table = make_kv_cache(batch, capacity, heads_kv, head_dim, lens,
                                                           page_size, gen)
    planes_of = None
    if table is not None:  # the entry each page belongs to
        planes_of = torch.empty(k_cache.shape[0], dtype=torch.long, device="cuda")
        planes_of[table.long().flatten()] = torch.arange(batch, device="cuda").repeat_interleave(table.shape[1])
    k8, kd = quantize_per_head(k_cache, planes_of)
    v8, vd = quantize_per_head(v_cache, planes_of)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", generator=gen)
    q8, qd = quantize_queries(q, heads_kv)
    k_ref, v_ref = (x8 if table is None else x8[table.long()].flatten(1, 2) for x8 in (k8, v8))
    k_ref, v_ref = dequantize(k_ref, kd), dequantize(v_ref, vd)
    return q8, (k8, v8), table, (qd, kd, vd), (dequantize(q8, qd), k_ref, v_ref)


@gpu
@HEAD_DIM_PARAM
@pytest.mark.parametrize("page_size", [None, 64, 16], ids=["dense", "page64", "page16"])
def test_fp8_cache_matches_reference(head_dim, page_size):
    """Decode (one query) and a 3-token verify step, causal and not, 1 / 3 / planned splits."""
    lens = [0, 130, 700]
    for seqlen_q, causal in ((1, False), (3, True)):
        q8, (k8, v8), table, descales, (q_ref, k_ref, v_ref) = fp8_cache_case(head_dim, page_size, lens, seqlen_q)
        ref_o, ref_lse = cache_reference(q_ref, k_ref, v_ref, lens, causal)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for splits in (1, 3, 0):
            out, lse = fa3.attention_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, block_table=table,
                                                  causal=causal, num_splits=splits, return_lse=True,
                                                  q_descale=descales[0], k_descale=descales[1],
                                                  v_descale=descales[2])
            where = f"seqlen_q={seqlen_q}, num_splits={splits}"
            assert out.dtype == torch.bfloat16 and not out.isnan().any(), where
            assert rel_err(out, ref_o) < TOL, f"{where}: {rel_err(out, ref_o)}"
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(lse), finite), f"{where}: empty rows differ"
            assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-2, rtol=1e-3), where


@gpu
def test_fp8_cache_append_out_and_one_scale():
    """New FP8 tokens written into the cache (in place) before attending; out= in fp16 (poisoned
    first); descales of one element (per tensor)."""
    lens, new = [5, 300], 2
    q8, (k8, v8), table, _, _ = fp8_cache_case(128, 64, lens, seqlen_q=new, batch=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    k_new, v_new = (torch.randn(2, new, 2, 128, device="cuda", generator=gen).to(FP8) for _ in range(2))
    scale = torch.tensor(0.5, device="cuda")
    out = torch.full(q8.shape, float("nan"), dtype=torch.float16, device="cuda")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    fa3.attention_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True,
                               q_descale=scale, k_descale=scale, v_descale=scale, out=out)
    dense_k, dense_v = (x[table.long()].flatten(1, 2) for x in (k8, v8))
    for b, n in enumerate(lens):
        assert torch.equal(dense_k[b, n:n + new].view(torch.uint8), k_new[b].view(torch.uint8))
        assert torch.equal(dense_v[b, n:n + new].view(torch.uint8), v_new[b].view(torch.uint8))
    final = [n + new for n in lens]
    ref_o, _ = cache_reference(q8.float() * 0.5, dense_k.float() * 0.5, dense_v.float() * 0.5, final, True)
    assert out.dtype == torch.float16 and rel_err(out, ref_o) < TOL


@gpu
@pytest.mark.parametrize("page_size", [16, 1])
def test_fp8_varlen_over_paged_cache(page_size):
    """vLLM's call with an FP8 cache: flash_attn_varlen_func over pages with seqused_k, a step of
    decodes beside a chunk, descales (sequences, heads_kv)."""
    lens, q_lens = [700, 1, 0, 64], [1, 1, 0, 37]
    gen = torch.Generator(device="cuda").manual_seed(11)
    _, (k8, v8), table, (_, kd, vd), (_, k_ref, v_ref) = fp8_cache_case(128, page_size, lens, batch=4, capacity=768)
    q = torch.randn(sum(q_lens), 8, 128, device="cuda", generator=gen)
    q8 = q.to(FP8)
    qd = torch.ones(4, 2, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seqused = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = fa3.flash_attn_varlen_func(q8, k8, v8, cu_seqlens_q=cu, max_seqlen_q=max(q_lens), seqused_k=seqused,
                                     max_seqlen_k=max(lens), causal=True, block_table=table, q_descale=qd,
                                     k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    for b in range(4):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if q_lens[b] == 0:
            continue
        ref_o, _ = cache_reference(q8[rows].float()[None], k_ref[b:b + 1], v_ref[b:b + 1], [lens[b]], True)
        assert rel_err(out[rows][None], ref_o) < TOL, (b, rel_err(out[rows][None], ref_o))


# ----------------------------------------------------------------------------- CPU checks
def cpu_cache(dtype=FP8):
    q = torch.randn(2, 1, 4, 64).to(dtype)
    k, v = (torch.randn(2, 128, 2, 64).to(dtype) for _ in range(2))
    return q, k, v


def test_fp8_cache_checks(no_device_check):
    """Each mistake names the argument and the fix."""
    q, k, v = cpu_cache()
    call = dict(cache_seqlens=3)
    raises_with(fa3.attention_with_kvcache, TypeError, "k_cache", "fa3.quantize_fp8(q)",
                q=q.to(torch.bfloat16), k_cache=k, v_cache=v, **call)
    raises_with(fa3.attention_with_kvcache, ValueError, "k_descale", "(2, 2)", q=q, k_cache=k, v_cache=v,
                k_descale=torch.ones(3, 2), **call)
    raises_with(fa3.attention_with_kvcache, TypeError, "v_descale", "float32", q=q, k_cache=k, v_cache=v,
                v_descale=torch.ones(2, 2, dtype=torch.float16), **call)
    raises_with(fa3.attention_with_kvcache, TypeError, "e5m2", q=q.to(torch.float8_e5m2),
                k_cache=k.to(torch.float8_e5m2), v_cache=v.to(torch.float8_e5m2), **call)
    raises_with(fa3.attention_with_kvcache, TypeError, "out", "bfloat16", q=q, k_cache=k, v_cache=v,
                out=torch.empty(q.shape, dtype=FP8), **call)
    b16 = [t.to(torch.bfloat16) for t in (q, k, v)]
    raises_with(fa3.attention_with_kvcache, ValueError, "FP8 cache", "drop the descales", q=b16[0],
                k_cache=b16[1], v_cache=b16[2], q_descale=torch.ones(2, 2), **call)
    raises_with(fa3.attention_with_kvcache, TypeError, "k", "float8_e4m3fn", q=q, k_cache=k, v_cache=v,
                k=torch.randn(2, 1, 2, 64, dtype=torch.bfloat16), v=torch.randn(2, 1, 2, 64).to(FP8), **call)
    # heads 72 one-byte elements apart: a multiple of 8 elements, not of 16 bytes (TMA's rule)
    narrow = torch.zeros(*k.shape[:3], 72).to(FP8)[..., :64]
    raises_with(fa3.attention_with_kvcache, ValueError, "k_cache", "16-byte aligned", q=q, k_cache=narrow,
                v_cache=v, **call)


def test_fp8_cache_op_out_dtype():
    """The op's out_dtype: bf16 or fp16 on an FP8 cache, q's dtype on a 16-bit one (None: the default)."""
    q = cpu_cache()[0]
    ones = (torch.ones(2, 2),) * 3
    for ok in (None, torch.bfloat16, torch.float16):
        fa3.kvcache_checks.check_out_dtype(ok, q, ones)
    raises_with(fa3.kvcache_checks.check_out_dtype, TypeError, "out_dtype=torch.float32", "FP8 cache",
                out_dtype=torch.float32, q=q, descales=ones)
    q16 = q.to(torch.bfloat16)
    fa3.kvcache_checks.check_out_dtype(torch.bfloat16, q16, None)
    raises_with(fa3.kvcache_checks.check_out_dtype, TypeError, "out_dtype=torch.float16", "torch.bfloat16",
                out_dtype=torch.float16, q=q16, descales=None)


def test_fp8_cache_op_fake_shapes():
    """torch.ops.fa3.attention_kvcache with an FP8 cache on meta tensors: out in out_dtype (bf16
    by default), lse (batch, heads_q, seqlen_q)."""
    q, k, v = (t.to("meta") for t in cpu_cache())
    lens = torch.ones(2, dtype=torch.int32, device="meta")
    d = torch.ones(2, 2, device="meta")
    for out_dtype, want in ((None, torch.bfloat16), (torch.float16, torch.float16)):
        out, lse = torch.ops.fa3.attention_kvcache(q, k, v, lens, None, 0, False, 0.125, 0, "s1", -1, -1, 0.0,
                                                   None, 0, -1, None, None, d, d, d, out_dtype)
        assert out.shape == q.shape and out.dtype == want and lse.shape == (2, 4, 1)


@pytest.mark.parametrize("head_dim,layout", [(64, "dense"), (128, "dense"), (128, "gather"), (256, "paged"),
                                             (96, "gather"), (192, "dense")])
def test_fp8_cache_kernel_compiles(head_dim, layout):
    """s1 on an FP8 cache for sm_90a: 8-byte e4m3 loads, cvt.rn.f16x2.e4m3x2, 16-byte fp16 stores,
    fp16 WGMMA, no spills, no serialized WGMMA."""
    pytest.importorskip("cutlass")
    from fa3 import _compile

    report = _compile.compile_report(fa3.registry.get("s1"), FP8, head_dim=head_dim, causal=True,
                                     paged=layout != "dense", gather=layout == "gather")
    for instruction in ("cvt.rn.f16x2.e4m3x2", "ld.shared.v2", "st.shared.v4", "wgmma.mma_async.sync.aligned",
                        ".f32.f16.f16"):
        assert instruction in report.ptx, instruction
    assert report.spill_bytes == 0 and not report.serialized_wgmma, report.summary()
