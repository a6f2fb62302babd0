"""CPU tests: every bad argument to fa3.attention fails with a message that names it, and the
float reference (fa3.reference) computes what its docstring says.

Validation runs before any device check, so CPU tensors reach every shape and dtype error.
"""

import math

import pytest
import torch

import fa3
from fa3 import _checks, registry
from fa3.reference import attention_reference, causal_mask
from conftest import raises_with

ATTENTION_RUNGS = registry.available_kernels(registry.ATTENTION)
GEMM_RUNGS = registry.available_kernels(registry.GEMM)
ALL_HEAD_DIMS = sorted({d for n in ATTENTION_RUNGS for d in registry.get(n).head_dims})
UNSUPPORTED_HEAD_DIM = next(d for d in range(8, 1024, 8) if d not in ALL_HEAD_DIMS)
BF16 = torch.bfloat16


def qkv(batch=2, seqlen_q=16, seqlen_k=24, heads_q=4, heads_kv=2, head_dim=ALL_HEAD_DIMS[0], dtype=BF16):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    return q, k, v


def raises(exc, *words, **call):
    """fa3.attention(**call) raises `exc` whose message contains every word of `words`."""
    return raises_with(fa3.attention, exc, *words, **call)


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_tensor(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].tolist()
    raises(TypeError, f"{name} must be a torch.Tensor", "list", **args)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_rank(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name][0]
    raises(ValueError, name, "4 dimensions", str(tuple(args[name].shape)), **args)


def test_float32_unsupported():
    q, k, v = qkv(dtype=torch.float32)
    raises(TypeError, "q", "torch.float32", "bfloat16", "float16", q=q, k=k, v=v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].half()
    raises(TypeError, name, "torch.float16", "torch.bfloat16", **args)


def test_k_v_shape_mismatch():
    q, k, v = qkv()
    raises(ValueError, "k", "v", "same shape", q=q, k=k, v=v[:, :-1])


def test_batch_mismatch():
    q, k, v = qkv(batch=2)
    _, k3, v3 = qkv(batch=3)
    raises(ValueError, "batch", "2", "3", q=q, k=k3, v=v3)


def test_head_dim_mismatch():
    q, _, _ = qkv(head_dim=64)
    _, k, v = qkv(head_dim=128)
    raises(ValueError, "head_dim", "64", "128", q=q, k=k, v=v)


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 3), (2, 4)])
def test_heads_not_a_multiple(heads_q, heads_kv):
    q, k, v = qkv(heads_q=heads_q, heads_kv=heads_kv)
    raises(ValueError, f"heads_q={heads_q}", f"heads_kv={heads_kv}", "multiple", q=q, k=k, v=v)


def test_unsupported_head_dim_lists_supported():
    q, k, v = qkv(head_dim=UNSUPPORTED_HEAD_DIM)
    msg = raises(ValueError, f"head_dim={UNSUPPORTED_HEAD_DIM}", q=q, k=k, v=v)
    for d in ALL_HEAD_DIMS:
        assert str(d) in msg


@pytest.mark.parametrize("kernel", ATTENTION_RUNGS)
def test_unsupported_head_dim_for_rung(kernel):
    q, k, v = qkv(head_dim=UNSUPPORTED_HEAD_DIM)
    msg = raises(ValueError, f"head_dim={UNSUPPORTED_HEAD_DIM}", kernel, q=q, k=k, v=v, kernel=kernel)
    for d in registry.get(kernel).head_dims:
        assert str(d) in msg


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_not_contiguous(name):
    args = dict(zip("qkv", qkv()))
    t = args[name]
    args[name] = torch.cat([t, t], dim=-1)[..., ::2]  # same shape, stride 2 in head_dim
    assert args[name].shape == t.shape and args[name].stride(-1) == 2
    raises(ValueError, name, "contiguous", f"{name}.contiguous()", **args)


def test_unknown_kernel_lists_rungs():
    q, k, v = qkv()
    msg = raises(ValueError, "kernel='no-such-rung'", q=q, k=k, v=v, kernel="no-such-rung")
    for name in ATTENTION_RUNGS:
        assert repr(name) in msg


def test_unknown_family_lists_families():
    msg = raises_with(fa3.available_kernels, ValueError, "family='bogus'", family="bogus")
    for family in registry.FAMILIES:
        assert repr(family) in msg and fa3.available_kernels(family)


@pytest.mark.parametrize("kernel", GEMM_RUNGS)
def test_gemm_rung_is_not_an_attention_kernel(kernel):
    q, k, v = qkv()
    msg = raises(ValueError, f"kernel={kernel!r}", q=q, k=k, v=v, kernel=kernel)
    assert any(name in msg for name in ATTENTION_RUNGS)


@pytest.mark.parametrize("kernel", [None] + ATTENTION_RUNGS)
def test_cpu_tensors(kernel):
    q, k, v = qkv(head_dim=registry.get(kernel).head_dims[0] if kernel else ALL_HEAD_DIMS[0])
    raises(ValueError, "q", "cpu", "q.cuda()", q=q, k=k, v=v, kernel=kernel)


def test_non_hopper_gpu(monkeypatch):
    # a fresh memo of checked devices: on a real Hopper machine earlier tests have filled it
    monkeypatch.setattr(_checks, "HOPPER_SMS", {})
    monkeypatch.setattr(_checks, "_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError) as info:
        _checks.check_hopper(torch.device("cuda", 0), "q")
    msg = str(info.value)
    for w in ("q", "A100", "sm_80", "Hopper", "sm_90"):
        assert w in msg, f"{w!r} not in the message: {msg}"


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided", "not a tensor"])
def test_bad_out(no_device_check, bad):
    q, k, v = qkv()
    out = {
        "shape": torch.empty(q.shape[0], q.shape[1] + 1, *q.shape[2:], dtype=q.dtype),
        "dtype": torch.empty_like(q, dtype=torch.float16),
        "strided": torch.empty(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype)[..., : q.shape[-1]],
        "not a tensor": q.tolist(),
    }[bad]
    raises(ValueError, "out", q=q, k=k, v=v, out=out)


# ----------------------------------------------------------------------------- reference math
def direct_attention(q, k, v, causal, scale=None):
    """Attention written out row by row in float64, with the mask spelled out for each (i, j)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(batch, seqlen_q, heads_q, head_dim, dtype=torch.float64)
    lse = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads_q):
            hk = h // (heads_q // heads_kv)  # query heads are grouped onto consecutive kv heads
            for i in range(seqlen_q):
                visible = [j for j in range(seqlen_k) if not causal or j - i <= seqlen_k - seqlen_q]
                if not visible:
                    continue
                s = torch.stack([q[b, i, h] @ k[b, j, hk] for j in visible]) * scale
                m = s.max()
                p = torch.exp(s - m)
                lse[b, h, i] = m + torch.log(p.sum())
                out[b, i, h] = (p / p.sum()) @ v[b, visible, hk]
    return out, lse


def check_reference(q, k, v, causal, scale=None):
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=torch.float64)
    ref_out, ref_lse = direct_attention(q, k, v, causal, scale)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    return out, lse


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_direct(seqlen_q, seqlen_k, causal):
    torch.manual_seed(seqlen_q * 100 + seqlen_k)
    check_reference(rand(2, seqlen_q, 2, 16), rand(2, seqlen_k, 2, 16), rand(2, seqlen_k, 2, 16), causal)


def test_causal_mask_is_bottom_right():
    expected = torch.tensor([[1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 1, 0],
                             [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(3, 6), expected)
    # more queries than keys: the first seqlen_q - seqlen_k rows see nothing
    assert torch.equal(causal_mask(4, 2), torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool))


def test_reference_fully_masked_rows():
    torch.manual_seed(1)
    q, k, v = rand(1, 6, 2, 8), rand(1, 3, 2, 8), rand(1, 3, 2, 8)
    out, lse = check_reference(q, k, v, causal=True)
    # query i sees keys j <= i - 3: rows 0..2 see none
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
    assert torch.isfinite(lse[:, :, 3:]).all()


@pytest.mark.parametrize("heads_q, heads_kv", [(6, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_gqa(heads_q, heads_kv, causal):
    torch.manual_seed(heads_q)
    q, k, v = rand(2, 5, heads_q, 8), rand(2, 9, heads_kv, 8), rand(2, 9, heads_kv, 8)
    out, lse = check_reference(q, k, v, causal)
    # the same as plain multi-head attention with each kv head repeated for its group
    group = heads_q // heads_kv
    mha_out, mha_lse = attention_reference(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2),
                                           causal=causal, dtype=torch.float64)
    torch.testing.assert_close(out, mha_out)
    torch.testing.assert_close(lse, mha_lse)


def test_reference_softmax_scale():
    torch.manual_seed(2)
    check_reference(rand(1, 4, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8), causal=True, scale=0.3)


# ----------------------------------------------------------------------------- the backward
def _meta_qkv(requires_grad=True, **kw):
    return tuple(t.to("meta").requires_grad_(requires_grad) for t in qkv(**kw))


@pytest.mark.parametrize("bad, words", [("k5.3", ("not a backward rung", "backward rungs")),
                                        ("no-such-rung", ("no-such-rung", "available_kernels"))])
def test_bad_backward_kernel(no_device_check, bad, words):
    q, k, v = _meta_qkv()
    raises(ValueError, *words, q=q, k=k, v=v, backward_kernel=bad)


def test_deterministic_calls_dispatch_to_their_own_rung():
    """kernel=None with deterministic=True skips a rung at the head dims outside its
    `deterministic_head_dims`, and without a mask a rung that is `deterministic_masked_only` (the
    S^T rungs' ordered walks lead b2's only where they descend), and keeps the default elsewhere."""
    from fa3 import _dispatch, masking

    for d in registry.HEAD_DIMS:
        fast = _dispatch.backward_rung(None, d)
        for masked in (False, True):
            det = _dispatch.backward_rung(None, d, True, None, masked)
            assert d in det.head_dims
            assert det.deterministic_head_dims is None or d in det.deterministic_head_dims
            assert masked or not det.deterministic_masked_only
            if (fast.deterministic_head_dims is None or d in fast.deterministic_head_dims) and (
                    masked or not fast.deterministic_masked_only):
                assert det is fast
    assert _dispatch.backward_rung(None, 64).name == "b8" != _dispatch.backward_rung(None, 64, True).name
    masked = {d: _dispatch.backward_rung(None, d, True, None, True).name for d in (96, 128)}
    unmasked = {d: _dispatch.backward_rung(None, d, True).name for d in (96, 128)}
    assert masked == {96: "b4", 128: "b7"} and unmasked == {96: "b2", 128: "b2"}
    assert masking.masked(False, (-1, -1)) is False
    assert masking.masked(True, (-1, -1)) and masking.masked(False, (128, 0))


def test_default_head_dims_narrow_the_default():
    """kernel=None picks a rung only at its `default_head_dims` (and, deterministic, its
    `deterministic_head_dims`): b9 serves d192 and d256, but deterministic d256 goes to b2 (b9's
    ordered adds ran 0.53-0.71x of its own speed); an explicit backward_kernel still takes any head
    dim the rung supports."""
    from fa3 import _dispatch

    assert _dispatch.backward_rung(None, 256).name == "b9"
    assert _dispatch.backward_rung(None, 256, True).name == "b2"
    assert _dispatch.backward_rung(None, 192).name == "b9" == _dispatch.backward_rung(None, 192, True).name
    assert _dispatch.backward_rung("b2", 256).name == "b2"
    for spec in registry.KERNELS.values():
        assert spec.default_head_dims is None or set(spec.default_head_dims) <= set(spec.head_dims), spec.name


def test_backward_op_checks_its_arguments(no_device_check):
    q, k, v = qkv(heads_kv=4)  # CPU tensors run the op's real body (meta ones its fake)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 16)
    name = registry.fastest(registry.BACKWARD, q.shape[-1]).name
    op = torch.ops.fa3.attention_backward
    raises_with(op, ValueError, "dout", "shaped like the output", dout=out[:, :3], q=q, k=k, v=v, out=out,
                lse=lse, causal=False, softmax_scale=0.1, kernel=name, deterministic=False)
    raises_with(op, ValueError, "lse", "float32", dout=out, q=q, k=k, v=v, out=out,
                lse=lse.to(BF16), causal=False, softmax_scale=0.1, kernel=name, deterministic=False)
    raises_with(op, ValueError, "backward rungs", dout=out, q=q, k=k, v=v, out=out, lse=lse,
                causal=False, softmax_scale=0.1, kernel="g3", deterministic=False)


def test_varlen_backward_function_checks_its_arguments(no_device_check):
    """fa3.attention_varlen_backward (the packed backward of a given out, lse): the packed layouts'
    checks, each naming the argument."""
    q, k, v = (t[0] for t in qkv(heads_kv=4))  # (total, heads, d)
    cu = torch.tensor([0, 5, q.shape[0]], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
    call = fa3.attention_varlen_backward
    raises_with(call, ValueError, "lse", "(heads_q, total_q)", dout=out, q=q, k=k, v=v, out=out,
                lse=lse.t(), cu_seqlens_q=cu, cu_seqlens_k=cu)
    raises_with(call, ValueError, "dout", "shaped like the output", dout=out[:3], q=q, k=k, v=v, out=out, lse=lse,
                cu_seqlens_q=cu, cu_seqlens_k=cu)
    raises_with(call, ValueError, "cu_seqlens_k", "int32", dout=out, q=q, k=k, v=v, out=out, lse=lse,
                cu_seqlens_q=cu, cu_seqlens_k=cu.long())
    raises_with(call, ValueError, "backward rungs", dout=out, q=q, k=k, v=v, out=out, lse=lse,
                cu_seqlens_q=cu, cu_seqlens_k=cu, backward_kernel="k5.5")


def test_out_sharing_memory_with_an_input_is_refused(no_device_check):
    """out= aliasing q, k, v, a cache or a GEMM operand: refused by name (the kernels read K/V rows
    from many CTAs while others write the output; a backward reads q, k, v again). Separate
    buffers, also neighbours in one allocation or a packed qkv's views, pass."""
    from fa3 import _checks

    bf = torch.bfloat16
    q, k, v = (torch.randn(1, 8, 2, 64, dtype=bf) for _ in range(3))
    for out, name in ((q, "q"), (k, "k"), (v, "v")):
        raises_with(fa3.attention, ValueError, f"out shares memory with {name}", "separate tensor",
                    q=q, k=k, v=v, out=out)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    raises_with(fa3.attention_varlen, ValueError, "out shares memory with k", q=q[0], k=k[0], v=v[0],
                cu_seqlens_q=cu, cu_seqlens_k=cu, out=k[0])
    cache = torch.randn(1, 64, 2, 64, dtype=bf)
    raises_with(fa3.attention_with_kvcache, ValueError, "out shares memory with q", q=q[:, :1],
                k_cache=cache, v_cache=cache, cache_seqlens=3, out=q[:, :1])
    raises_with(fa3.attention_with_kvcache, ValueError, "out shares memory with k_cache",
                q=q[:, :1], k_cache=cache, v_cache=cache, cache_seqlens=3, out=cache[:, :1])
    new = torch.randn(1, 1, 2, 64, dtype=bf)  # one cache for k and v: fine to read, not to append to
    raises_with(fa3.attention_with_kvcache, ValueError, "v_cache shares memory with k_cache",
                "write one over the other", q=q[:, :1], k_cache=cache, v_cache=cache, k=new, v=new,
                cache_seqlens=3)
    a = torch.randn(64, 64, dtype=bf)
    raises_with(fa3.gemm, ValueError, "out shares memory with a", a=a, b=a.clone(), out=a)
    # no false alarms: neighbours in one buffer, a packed qkv's interleaved views, other devices
    buf = torch.empty(2, 8, 2, 64, dtype=bf)
    _checks.check_no_overlap(buf[1], "out", (("q", buf[0]),))
    qkv = torch.empty(1, 8, 3, 2, 64, dtype=bf)
    _checks.check_no_overlap(torch.empty(1, 8, 2, 64, dtype=bf), "out", tuple(zip("qkv", qkv.unbind(2))))
    # a view sharing a few bytes with the input's last row is caught
    with pytest.raises(ValueError, match="out shares memory with q"):
        flat = torch.empty(2 * 8 * 2 * 64, dtype=bf)
        _checks.check_no_overlap(flat[8 * 2 * 64 - 1:][: 8 * 2 * 64], "out", (("q", flat[: 8 * 2 * 64]),))
