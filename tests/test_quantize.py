"""CPU tests of the FP8 host helpers (fa3.quantize): scales per tensor/head/block, their shapes and
round trips, the Hadamard rotation's invariance of q k^T, and its RMSE gain on outlier data."""

import pytest
import torch

import fa3
from fa3 import quantize

from conftest import raises_with, rel_err


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("granularity, kwargs, descale_shape", [
    ("tensor", {}, ()),
    ("head", {}, (2, 8)),
    ("head", {"num_heads_kv": 2}, (2, 2)),
    ("block", {"block_size": 64}, (2, 8, 4)),  # 200 rows: 3 full blocks of 64 and a ragged one
])
def test_quantize_shapes_and_round_trip(granularity, kwargs, descale_shape):
    x = _x(2, 200, 8, 64) * 3
    x_fp8, descale = fa3.quantize_fp8(x, granularity, **kwargs)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert descale.dtype == torch.float32 and tuple(descale.shape) == descale_shape
    back = fa3.dequantize_fp8(x_fp8, descale, block_size=kwargs.get("block_size", 128))
    err = rel_err(back, x)
    print(f"\n  {granularity} {kwargs}: round-trip relative error {err:.2e}")
    assert 0 < err < 0.04  # e4m3: 3 mantissa bits, ~2-3% relative RMS error
    # every group reaches e4m3's top: amax maps to 448 exactly
    assert x_fp8.float().abs().max().item() == quantize.E4M3_MAX


def test_finer_scales_are_no_worse_on_uneven_heads():
    """A head 10^4 times larger than the others: one tensor scale crushes the small heads into e4m3's
    subnormals, per-head scales do not."""
    x = _x(1, 256, 4, 64)
    x[:, :, 0] *= 1e4
    errs = {}
    for g in ("tensor", "head", "block"):
        x_fp8, s = fa3.quantize_fp8(x, g)
        small = fa3.dequantize_fp8(x_fp8, s)[:, :, 1:]
        errs[g] = rel_err(small, x[:, :, 1:])
    print(f"\n  small heads' error by granularity: {errs}")
    assert errs["head"] < errs["tensor"] / 2 and errs["block"] <= errs["head"] * 1.01


def test_zero_and_empty_inputs():
    x_fp8, s = fa3.quantize_fp8(torch.zeros(1, 16, 2, 64), "head")
    assert torch.equal(s, torch.ones(1, 2)) and not x_fp8.float().any()
    x_fp8, s = fa3.quantize_fp8(torch.zeros(1, 0, 2, 64), "head")
    assert x_fp8.shape == (1, 0, 2, 64) and s.shape == (1, 2)
    x_fp8, s = fa3.quantize_fp8(torch.zeros(0), "tensor")
    assert s.item() == 1.0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_is_orthogonal_and_keeps_qk(d):
    """In float64, (q M)(k M)^T equals q k^T to rounding, norms are kept, and the rotation differs
    from the identity; a different seed is a different rotation."""
    q, k = _x(2, 33, 4, d, dtype=torch.float64, seed=1), _x(2, 47, 4, d, dtype=torch.float64, seed=2)
    qr, kr = fa3.hadamard_rotate(q, seed=7), fa3.hadamard_rotate(k, seed=7)
    assert qr.dtype == torch.float64 and qr.shape == q.shape
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    sr = torch.einsum("bqhd,bkhd->bhqk", qr, kr)
    assert rel_err(sr, s) < 1e-13
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-13)
    assert rel_err(qr, q) > 0.5
    assert rel_err(fa3.hadamard_rotate(q, seed=8), qr) > 0.1
    # against the explicit matrix: H by Sylvester's construction, times the signs
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    m = torch.diag(quantize.random_signs(d, 7, dtype=torch.float64)) @ h / d ** 0.5
    assert rel_err(qr, q @ m) < 1e-13


def test_hadamard_lowers_fp8_error_on_outliers():
    """FlashAttention-3's incoherent processing: q and k with a few outlier channels (as LLM
    activations have), quantized per head; the error of the FP8 scores q k^T drops with the
    rotation (the paper reports 2.6x on its outlier distribution)."""
    d = 128
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 512, 4, d, generator=gen)
    k = torch.randn(2, 512, 4, d, generator=gen)
    outliers = torch.randint(0, d, (4,), generator=gen)
    q[..., outliers] *= 40
    k[..., outliers] *= 40
    exact = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())

    def scores_error(rotate):
        (qq, sq), (kq, sk) = (fa3.quantize_fp8(t, "head", hadamard=rotate, seed=11) for t in (q, k))
        deq = [fa3.dequantize_fp8(t, s, dtype=torch.float64) for t, s in ((qq, sq), (kq, sk))]
        return rel_err(torch.einsum("bqhd,bkhd->bhqk", *deq), exact)

    plain, rotated = scores_error(False), scores_error(True)
    print(f"\n  FP8 q k^T relative error: plain {plain:.3e}, Hadamard {rotated:.3e} "
          f"({plain / rotated:.2f}x lower)")
    assert rotated < plain / 1.5


@pytest.mark.parametrize("call, exc, words", [
    (lambda: fa3.quantize_fp8(torch.zeros(2, 3), "head"), ValueError, ("granularity='head'", "(batch, seqlen")),
    (lambda: fa3.quantize_fp8(torch.zeros(1, 4, 2, 8), "row"), ValueError, ("granularity='row'", "'block'")),
    (lambda: fa3.quantize_fp8(torch.zeros(1, 4, 6, 8), "head", num_heads_kv=4), ValueError,
     ("num_heads_kv=4", "6 heads")),
    (lambda: fa3.quantize_fp8(torch.zeros(1, 4, 6, 8), "tensor", num_heads_kv=2), ValueError,
     ("num_heads_kv",)),
    (lambda: fa3.quantize_fp8(torch.zeros(1, 4, 6, 8), "block", block_size=0), ValueError,
     ("block_size=0",)),
    (lambda: fa3.quantize_fp8(torch.zeros(4, dtype=torch.int32)), TypeError, ("torch.int32",)),
    (lambda: fa3.quantize_fp8([1.0, 2.0]), TypeError, ("torch.Tensor", "list")),
    (lambda: fa3.hadamard_rotate(torch.zeros(2, 96)), ValueError, ("power of two", "(2, 96)")),
    (lambda: fa3.hadamard_rotate(torch.zeros(4, dtype=torch.float8_e4m3fn)), TypeError,
     ("float8_e4m3fn",)),
])
def test_bad_inputs(call, exc, words):
    raises_with(call, exc, *words)
