"""Sliding-window (local) attention and softcap on fa3.attention: GPU against the float reference,
and the argument checks.

Windows are flash-attn's (left, right) around the bottom-right-aligned diagonal; the cases cover
both sides bounded, one side, a window of width 1, causal + window, seqlen_q != seqlen_k with
lengths that are not multiples of any tile, and rows whose window holds no key.
"""

import pytest
import torch

import fa3
from fa3 import masking
from fa3.reference import attention_reference

from conftest import HEAD_DIM_PARAM, raises_with, rel_err

gpu = pytest.mark.gpu
TOL = 1.5e-2
# (window_size, causal, softcap)
CASES = [
    ((100, 50), False, 0.0),
    ((64, -1), True, 0.0),      # causal + left window: right = 0
    ((-1, 30), False, 0.0),
    ((0, 0), False, 0.0),       # each query sees one key
    ((-1, -1), False, 5.0),     # softcap alone
    ((200, 0), False, 10.0),    # both
]


def _check(shape, head_dim, window_size, causal, softcap, seed):
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s, h: torch.randn(b, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(sq, hq), mk(sk, hkv), mk(sk, hkv)
    q.mul_(3.0)  # larger scores: softcap changes them visibly
    out = torch.full_like(q, float("nan"))
    out, lse = fa3.attention(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                             return_lse=True, out=out)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL, f"relative error {rel_err(out, ref):.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE is -inf exactly where a row sees no key"
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2
    if softcap:  # the cap must matter in this data, or the test could not fail
        plain, _ = attention_reference(q, k, v, causal=causal, window_size=window_size)
        assert rel_err(plain, ref) > 10 * TOL


@gpu
@HEAD_DIM_PARAM
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"w{CASES[i][0]}-c{int(CASES[i][1])}-s{CASES[i][2]:g}")
def test_window_and_softcap_match_reference(head_dim, case):
    window_size, causal, softcap = CASES[case]
    _check((2, 300, 555, 4, 2), head_dim, window_size, causal, softcap, seed=case)
    _check((1, 700, 250, 2, 1), head_dim, window_size, causal, softcap, seed=case + 100)  # sq > sk


@gpu
def test_window_that_equals_causal_compiles_as_causal():
    assert masking.masking(False, (-1, 0), 0.0, 1.0).causal
    _check((1, 333, 333, 2, 2), 128, (-1, 0), False, 0.0, seed=5)


@gpu
def test_window_refuses_old_rungs():
    q = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    raises_with(fa3.attention, ValueError, "k2", "window_size", q=q, k=q, v=q, window_size=(8, 8),
                kernel="k2")


def test_window_and_softcap_validation():
    for window, words in (((-2, 0), (">= 0",)), ((1, 2, 3), ("pair",)), ("ab", ("pair",))):
        with pytest.raises(ValueError) as info:
            masking.masking(False, window, 0.0, 1.0)
        assert "window_size" in str(info.value) and all(w in str(info.value) for w in words)
    for cap in (-1.0, float("inf"), "x"):
        with pytest.raises(ValueError, match="softcap"):
            masking.masking(False, (-1, -1), cap, 1.0)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -0.125, 0.0])
def test_softmax_scale_must_be_finite_and_positive(no_device_check, scale):
    """A scale the online softmax cannot take (it subtracts the largest raw score) is refused by
    name on every entry point, plain or windowed, rather than computing inf or NaN."""
    for window, cap in (((-1, -1), 0.0), ((16, 0), 0.0), ((-1, -1), 30.0)):
        with pytest.raises(ValueError, match=r"softmax_scale=.*finite float > 0"):
            masking.masking(False, window, cap, scale)
    q = torch.empty(1, 8, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32, device="meta")
    calls = (lambda: fa3.attention(q, q, q, softmax_scale=scale),
             lambda: fa3.attention_varlen(q[0], q[0], q[0], cu, cu, softmax_scale=scale),
             lambda: fa3.flash_attn_func(q, q, q, softmax_scale=scale),
             lambda: fa3.attention_with_kvcache(q[:, :1], q, q, cache_seqlens=3, softmax_scale=scale))
    for call in calls:
        with pytest.raises(ValueError, match="softmax_scale"):
            call()


def test_masking_canonical_forms():
    m = masking.masking(True, (64, 10), 0.0, 0.125)  # causal sets right = 0
    assert (m.causal, m.local, m.left, m.right) == (False, True, 64, 0)
    m = masking.masking(False, (-1, 5), 0.0, 0.125)
    assert (m.causal, m.local, m.left, m.right) == (False, True, masking.UNBOUNDED, 5)
    m = masking.masking(False, (-1, -1), 50.0, 0.125)
    assert m.plain is False and m.softcap and abs(m.softcap_scale - 0.125 / 50) < 1e-12
    assert abs(m.scale_log2 - 50 * masking.LOG2E) < 1e-9
    assert masking.masking(False, (-1, -1), 0.0, 0.125).plain
