"""v's head dim different from q's and k's (DeepSeek-style MLA prefill (192, 128), and (128, 64)):
fa3.attention and fa3.attention_varlen, forward (k5 rungs) and backward (b9 at (192, 128), b7 at
(128, 64), b2 at both).
CPU: what is refused and how (other pairs, backward rungs that do not take a pair, the backward
op, the KV cache), fake shapes, compile keys. GPU: against the float64 reference, outputs and
gradients poisoned with NaN.
"""

import pytest
import torch

import fa3
from fa3.compile import builders as _compile
from fa3 import registry
from fa3.kernels import config
from fa3.reference import attention_reference

from conftest import assert_close_to_reference, autograd_grads, raises_with, reference_grads, rel_err

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
PAIRS = registry.VALUE_HEAD_DIMS


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=BF16)


def test_pairs_are_the_issue_s():
    assert set(PAIRS) >= {(192, 128), (128, 64)}
    assert all(p in registry.fastest(registry.ATTENTION, p[0]).value_head_dims for p in PAIRS)
    # the backward: the fastest rung that takes the pair (b7, d128's default, takes (128, 64))
    assert registry.fastest(registry.BACKWARD, 192, head_dim_v=128).name == "b9"
    assert registry.fastest(registry.BACKWARD, 128, head_dim_v=64).name == "b7"
    assert registry.fastest(registry.BACKWARD, 128).name == "b7"
    assert all(p in registry.fastest(registry.BACKWARD, p[0], deterministic=True, head_dim_v=p[1]).value_head_dims
               for p in PAIRS)


@pytest.mark.parametrize("d, dv", PAIRS)
def test_output_takes_v_head_dim_on_meta(no_device_check, d, dv):
    q, k, v = _meta(2, 33, 8, d), _meta(2, 17, 2, d), _meta(2, 17, 2, dv)
    with torch.no_grad():  # meta tensors go through the op's fake
        out, lse = torch.ops.fa3.attention(q, k, v, True, 0.1, "k5.5")
    assert out.shape == (2, 33, 8, dv) and lse.shape == (2, 8, 33)
    cu = torch.tensor([0, 20, 33], dtype=torch.int32, device="meta")
    out, _ = torch.ops.fa3.attention_varlen(q[0], k[0], v[0], cu, cu, True, 0.1, -1, -1, 0.0, "k5.5")
    assert out.shape == (33, 8, dv)


def test_unsupported_pairs_name_the_supported_ones(no_device_check):
    q, k = _meta(2, 16, 4, 128), _meta(2, 16, 4, 128)
    msg = raises_with(fa3.attention, ValueError, "v has head_dim 96", "q and k have 128", "(192, 128)",
                      "(128, 64)", "pad v to 128", q=q, k=k, v=_meta(2, 16, 4, 96))
    assert "forward and backward" in msg
    raises_with(fa3.attention, ValueError, "v has head_dim 64", "kernel='k4.2'", q=q, k=k,
                v=_meta(2, 16, 4, 64), kernel="k4.2")
    raises_with(fa3.attention, ValueError, "must have the same shape", "v's head_dim aside", q=q, k=k,
                v=_meta(2, 15, 4, 64))
    raises_with(fa3.attention, ValueError, "q has head_dim 128 but k has head_dim 64", q=q,
                k=_meta(2, 16, 4, 64), v=_meta(2, 16, 4, 64))
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    raises_with(fa3.attention_varlen, ValueError, "v has head_dim 96", "(192, 128)", q=q[0], k=k[0],
                v=_meta(16, 4, 96), cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_backward_rungs_that_do_not_take_a_pair_are_refused_by_name(no_device_check):
    q, k, v = _meta(2, 16, 4, 128).requires_grad_(), _meta(2, 16, 4, 128), _meta(2, 16, 4, 64)
    msg = raises_with(fa3.attention, ValueError, "v has head_dim 64", "backward_kernel='b6'", "['b2', 'b7']",
                      q=q, k=k, v=v, backward_kernel="b6")
    assert "pad v to 128" in msg
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    raises_with(fa3.attention_varlen, ValueError, "backward_kernel='b4'", q=q[0], k=k[0], v=v[0],
                cu_seqlens_q=cu, cu_seqlens_k=cu, backward_kernel="b4")
    # the backward op, called directly (CPU tensors run its real body, which checks)
    q, k, v = torch.randn(2, 16, 4, 192, dtype=BF16), torch.randn(2, 16, 4, 192, dtype=BF16), \
        torch.randn(2, 16, 4, 128, dtype=BF16)
    out = torch.randn(2, 16, 4, 128, dtype=BF16)
    call = dict(q=q, k=k, v=v, lse=torch.empty(2, 4, 16), causal=False, softmax_scale=0.1, deterministic=False)
    raises_with(torch.ops.fa3.attention_backward, ValueError, "v has head_dim 128", "backward_kernel='b1'",
                "['b2', 'b9']", dout=out, out=out, kernel="b1", **call)
    raises_with(torch.ops.fa3.attention_backward, ValueError, "dout must be shaped like the output (2, 16, 4, 128)",
                dout=torch.randn(2, 16, 4, 192, dtype=BF16), out=out, kernel="b9", **call)


@pytest.mark.parametrize("d, dv", PAIRS)
def test_gradients_take_their_tensors_shapes_on_meta(no_device_check, d, dv):
    q, k, v = _meta(2, 33, 8, d), _meta(2, 17, 2, d), _meta(2, 17, 2, dv)
    out = _meta(2, 33, 8, dv)
    grads = torch.ops.fa3.attention_backward(out, q, k, v, out, torch.empty(2, 8, 33, device="meta"), True, 0.1,
                                             "b2", False)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


def test_kvcache_refuses_a_v_cache_of_another_head_dim():
    q = torch.randn(2, 1, 8, 128, dtype=BF16)
    raises_with(fa3.attention_with_kvcache, ValueError, "k_cache", "v_cache", "same shape", q=q,
                k_cache=torch.randn(2, 256, 2, 128, dtype=BF16), v_cache=torch.randn(2, 256, 2, 64, dtype=BF16),
                cache_seqlens=3)


def test_compile_keys_and_tiles():
    spec = registry.get("k5.5")
    assert _compile.attention_key(spec, BF16, 192, True) != _compile.attention_key(spec, BF16, 192, True,
                                                                                  head_dim_v=128)
    assert _compile.attention_key(spec, BF16, 128, True) == _compile.attention_key(spec, BF16, 128, True,
                                                                                  head_dim_v=128)
    # V's narrower rows leave room for 128-wide K/V tiles at (192, 128)
    tiles = lambda *dims: config.forward_config(spec.config, *dims)
    assert tiles(192).tile_n < tiles(192, 128).tile_n == 128
    b9 = registry.get("b9")
    assert _compile.backward_key(b9, BF16, 192, True) != _compile.backward_key(b9, BF16, 192, True, head_dim_v=128)
    assert _compile.backward_key(b9, BF16, 192, True) == _compile.backward_key(b9, BF16, 192, True, head_dim_v=192)


# ----------------------------------------------------------------------------- GPU
def _inputs(batch, sq, sk, hq, hkv, d, dv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=BF16, generator=g)
    return mk(batch, sq, hq, d), mk(batch, sk, hkv, d), mk(batch, sk, hkv, dv)


@gpu
@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 257, 131, 4, 2), (1, 100, 1000, 6, 1), (2, 333, 100, 2, 2)])
def test_forward_matches_reference(d, dv, causal, shape):
    batch, sq, sk, hq, hkv = shape
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dv, seed=sq + d)
    out = torch.full((batch, sq, hq, dv), float("nan"), device="cuda", dtype=BF16)
    out, lse = fa3.attention(q, k, v, causal=causal, out=out, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, dtype=torch.float64)
    assert out.shape == (batch, sq, hq, dv) and not out.isnan().any()
    assert rel_err(out, ref) < 1.5e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-2, rtol=1e-3)


@gpu
@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
def test_variants_and_varlen(d, dv):
    """Window, softcap and sinks at (d, dv); a packed batch against each sequence alone."""
    q, k, v = _inputs(2, 300, 555, 4, 2, d, dv, seed=d)
    sinks = torch.randn(4, device="cuda")
    kw = dict(causal=True, window_size=(100, 0), softcap=20.0)
    out = fa3.attention(q, k, v, sinks=sinks, **kw)
    ref, _ = attention_reference(q, k, v, dtype=torch.float64, sinks=sinks, **kw)
    assert rel_err(out, ref) < 1.5e-2
    lens_q, lens_k = [1, 77, 500, 0], [600, 77, 130, 5]
    g = torch.Generator(device="cuda").manual_seed(1)
    qp = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=BF16, generator=g)
    kp = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=BF16, generator=g)
    vp = torch.randn(sum(lens_k), 2, dv, device="cuda", dtype=BF16, generator=g)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = fa3.attention_varlen(qp, kp, vp, cu(lens_q), cu(lens_k), causal=True)
    assert out.shape == (sum(lens_q), 4, dv)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        o, _ = attention_reference(qp[None, cq[b]:cq[b + 1]], kp[None, ck[b]:ck[b + 1]],
                                   vp[None, ck[b]:ck[b + 1]], causal=True, dtype=torch.float64)
        got = out[cq[b]:cq[b + 1]]
        assert (rel_err(got, o[0]) < 1.5e-2) if o.abs().sum() else not got.any()


def _check_grads(fn, q, k, v, dout, causal, window=(-1, -1), softcap=0.0):
    """fa3's (out, dq, dk, dv) against float64, within 2x the error of the same math in bf16."""
    got = autograd_grads(fn, q, k, v, dout)
    exact = reference_grads(q, k, v, dout, causal, None, torch.float64, window, softcap)
    low = reference_grads(q, k, v, dout, causal, None, BF16, window, softcap)
    assert_close_to_reference(got, exact, low, BF16, floor=1e-3)


@gpu
@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True], ids=["", "det"])
@pytest.mark.parametrize("shape", [(2, 257, 131, 4, 2), (1, 100, 333, 6, 1), (2, 333, 333, 2, 2)])
def test_gradients_match_reference(d, dv, causal, deterministic, shape):
    """The backward with dv != d on its default rung (b9 at (192, 128), b7 at (128, 64); b2 where
    deterministic): ragged
    lengths, GQA and MQA, seqlen_q != seqlen_k both ways."""
    batch, sq, sk, hq, hkv = shape
    q, k, v = _inputs(batch, sq, sk, hq, hkv, d, dv, seed=sq + d + causal)
    dout = torch.randn(batch, sq, hq, dv, device="cuda", dtype=BF16)
    _check_grads(lambda q, k, v: fa3.attention(q, k, v, causal=causal, deterministic=deterministic),
                 q, k, v, dout, causal)


@gpu
@pytest.mark.parametrize("d, dv", PAIRS, ids=lambda p: str(p))
def test_gradients_on_b2_and_variants(d, dv):
    """b2 at each pair too; a window with softcap; a packed batch against the padded one."""
    q, k, v = _inputs(2, 300, 300, 4, 2, d, dv, seed=7)
    dout = torch.randn(2, 300, 4, dv, device="cuda", dtype=BF16)
    _check_grads(lambda q, k, v: fa3.attention(q, k, v, causal=True, backward_kernel="b2"), q, k, v, dout, True)
    _check_grads(lambda q, k, v: fa3.attention(q, k, v, causal=True, window_size=(100, 0), softcap=20.0),
                 q, k, v, dout, True, window=(100, 0), softcap=20.0)
    lens = [1, 177, 0, 122]  # 300 tokens
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qp, kp, vp, dp = q[0], k[0], v[0], dout[0]
    got = autograd_grads(lambda q, k, v: fa3.attention_varlen(q, k, v, cu, cu, causal=True), qp, kp, vp, dp)
    c = cu.tolist()
    for b in range(len(lens)):
        if lens[b] == 0:
            continue
        one = autograd_grads(lambda q, k, v: fa3.attention(q, k, v, causal=True),
                     *(t[None, c[b]:c[b + 1]] for t in (qp, kp, vp, dp)))
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, one):
            assert rel_err(g[c[b]:c[b + 1]], r[0]) < 1e-2, f"entry {b} {name}"
