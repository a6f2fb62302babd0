"""GPU correctness of every attention rung against a float reference (and SDPA where it agrees).

Fresh random inputs per case, outputs poisoned with NaN before the call, ragged seqlens that are
not multiples of any tile (including 1), seqlen_q != seqlen_k, causal (bottom-right), GQA/MQA, and
rows with no visible key.
"""

import pytest
import torch
import torch.nn.functional as F

import fa3
from fa3.compile import core as _compile_core
from fa3 import registry
from fa3.reference import attention_reference

from conftest import HEAD_DIM_PARAM, rel_err

pytestmark = pytest.mark.gpu

RUNGS = registry.available_kernels(registry.ATTENTION)
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [
    (2, 128, 128, 4, 4),
    (1, 1, 1, 2, 1),
    (2, 113, 203, 6, 2),   # ragged, seqlen_q < seqlen_k, GQA 3:1
    (1, 203, 113, 4, 1),   # seqlen_q > seqlen_k: causal leaves rows with no key (MQA)
    (1, 257, 1000, 2, 2),
]
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}


def _inputs(shape, head_dim, dtype, seed):
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, h: torch.randn(b, s, h, head_dim, device="cuda", dtype=dtype, generator=g)
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


def _check(kernel, shape, head_dim, causal, dtype=torch.bfloat16, seed=0):
    q, k, v = _inputs(shape, head_dim, dtype, seed)
    out = torch.full_like(q, float("nan"))
    out, lse = fa3.attention(q, k, v, causal=causal, kernel=kernel, return_lse=True, out=out)
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    assert not out.isnan().any(), "NaN in the output (unwritten elements or a bad masked row)"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE is -inf exactly where a row sees no key"
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2
    return out


@pytest.mark.parametrize("kernel", RUNGS)
@HEAD_DIM_PARAM
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(kernel, head_dim, causal, shape):
    if head_dim not in registry.get(kernel).head_dims:
        pytest.skip(f"{kernel} does not support head_dim {head_dim}")
    _check(kernel, shape, head_dim, causal, seed=hash((kernel, head_dim, causal, shape)) % 1000)


@pytest.mark.parametrize("head_dim, causal", [(96, False), (96, True), (64, True)])
def test_short_and_long_query_tiles(head_dim, causal):
    """k5.5 runs 128-row tiles on short query sequences where 192-row ones are slower (registry
    `short_queries`: d96 under 2k rows, 4k causal; d64 causal under 2k): right on both sides of the
    threshold, ragged; a packed batch without max_seqlen_q (long tiles) agrees with the same batch
    given it (short tiles)."""
    threshold = registry.get("k5.5").config.short_queries[head_dim][int(causal)]
    for rows in (threshold - 77, threshold + 77):
        _check("k5.5", (1, rows, rows, 2, 1), head_dim, causal, seed=rows)
    g = torch.Generator(device="cuda").manual_seed(int(causal))
    lens = [300, 1, 777]
    cu = torch.tensor([0, 300, 301, 1078], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (4, 2, 2))
    short = fa3.attention_varlen(q, k, v, cu, cu, max(lens), causal=causal, kernel="k5.5")
    long = fa3.attention_varlen(q, k, v, cu, cu, causal=causal, kernel="k5.5")
    ref = torch.cat([attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)[0][0]
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert rel_err(short, ref) < 1.5e-2 and rel_err(long, ref) < 1.5e-2


@pytest.mark.parametrize("deterministic", [False, True])
def test_causal_head_groups_with_a_remainder(deterministic):
    """13 heads of 4096 rows: the causal forward launches heads in groups of 9, the backward in
    groups of 4 or 8, neither dividing 13, so each order's first group is the smaller one
    (scheduler.head_group_tile): every tile computed once, forward and backward, against SDPA in
    FP32."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(1, 4096, 13, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    out = fa3.attention(q, k, v, causal=True, deterministic=deterministic)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float().transpose(1, 2))
    assert rel_err(out, ref.transpose(1, 2)) < 1.5e-2
    for name, got, want in zip("qkv", grads, ref_grads):
        assert not got.isnan().any(), f"NaN in d{name}"
        assert rel_err(got, want.transpose(1, 2)) < 2e-2, f"d{name}"


def _head_dim(kernel, preferred=128):
    """`preferred` where the rung supports it, else its first head dim (k5.5 is d64 only)."""
    dims = registry.get(kernel).head_dims
    return preferred if preferred in dims else dims[0]


@pytest.mark.parametrize("kernel", RUNGS)
def test_fp16(kernel):
    _check(kernel, (2, 150, 150, 4, 2), _head_dim(kernel), True, dtype=torch.float16, seed=7)


@pytest.mark.parametrize("kernel", RUNGS)
def test_nan_scores_terminate(kernel):
    """A NaN in Q poisons its rows, never the others, and never stalls the pipeline (K5.4 makes K's
    release depend on the row sums: the test that NaN cannot block it)."""
    q, k, v = _inputs((1, 300, 300, 2, 2), _head_dim(kernel), torch.bfloat16, seed=5)
    q[0, 7, 1, 0] = float("nan")
    out = fa3.attention(q, k, v, kernel=kernel)
    torch.cuda.synchronize()
    assert out[0, 7, 1].isnan().all()
    clean = torch.ones_like(out, dtype=torch.bool)
    clean[0, 7, 1] = False
    ref, _ = attention_reference(q.nan_to_num(), k, v)
    assert rel_err(out[clean], ref[clean]) < 1.5e-2


@pytest.mark.parametrize("kernel", RUNGS)
def test_matches_sdpa(kernel):
    q, k, v = _inputs((2, 300, 300, 8, 8), _head_dim(kernel), torch.bfloat16, seed=3)
    for causal in (False, True):  # seqlen_q == seqlen_k: SDPA's top-left causal is the same mask
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
        assert rel_err(fa3.attention(q, k, v, causal=causal, kernel=kernel), ref.transpose(1, 2)) < 1.5e-2


@pytest.mark.parametrize("kernel", RUNGS)
def test_packed_qkv_strides_and_scale(kernel):
    """q, k, v sliced from one packed tensor (non-contiguous heads), custom softmax_scale."""
    qkv = torch.randn(2, 177, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out = fa3.attention(q, k, v, softmax_scale=0.3, kernel=kernel)
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3)
    assert rel_err(out, ref) < 1.5e-2


def test_new_shapes_do_not_recompile():
    q, k, v = _inputs((1, 100, 100, 2, 2), 64, torch.bfloat16, seed=1)
    fa3.attention(q, k, v, kernel="k2")
    n = len(_compile_core.CACHE)
    for shape in [(3, 77, 310, 4, 2), (1, 1, 5, 8, 1)]:
        q, k, v = _inputs(shape, 64, torch.bfloat16, seed=2)
        fa3.attention(q, k, v, kernel="k2")
    assert len(_compile_core.CACHE) == n


def test_empty_inputs():
    q, k, v = _inputs((0, 16, 16, 2, 2), 128, torch.bfloat16, seed=0)
    assert fa3.attention(q, k, v).shape == q.shape
    q, k, v = _inputs((1, 16, 0, 2, 2), 128, torch.bfloat16, seed=0)
    out, lse = fa3.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_default_kernel_is_fastest():
    assert fa3.interface.check_attention(*_inputs((1, 8, 8, 1, 1), 128, torch.bfloat16, 0), None) \
        is registry.fastest(registry.ATTENTION, 128)
