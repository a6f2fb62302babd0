"""fa3.attention_varlen (packed variable-length batches): GPU against the float reference per
sequence, and the argument checks.

Sequences of 0, 1 and tile-ragged lengths, keys longer or shorter than queries (causal leaves
rows with no key), GQA, output poisoned with NaN and stores checked not to cross sequences.
"""

import pytest
import torch

import fa3
from fa3 import _dispatch, index_checks, registry
from fa3.reference import attention_reference

from conftest import HEAD_DIM_PARAM, HAS_HOPPER, raises_with, rel_err

gpu = pytest.mark.gpu
TOL = 1.5e-2


def _cu(lengths, device="cuda"):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _packed(lens_q, lens_k, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(sum(lens_q), hq), mk(sum(lens_k), hkv), mk(sum(lens_k), hkv)


def _reference(q, k, v, lens_q, lens_k, **kw):
    outs, lses = [], []
    cq, ck = _cu(lens_q, "cpu").tolist(), _cu(lens_k, "cpu").tolist()
    for b in range(len(lens_q)):
        o, lse = attention_reference(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]],
                                     v[None, ck[b]:ck[b + 1]], **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


LENS = [  # (lens_q, lens_k)
    ([300, 1, 0, 129, 1000, 64], None),                  # self-attention lengths (k = q)
    ([1, 77, 500, 2], [600, 77, 130, 0]),                # keys longer, shorter, none
    ([5] * 40, [200] * 40),                              # many entries: the tile search spans chunks
]


@gpu
@HEAD_DIM_PARAM
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(LENS)))
def test_varlen_matches_reference(head_dim, causal, case):
    lens_q, lens_k = LENS[case]
    lens_k = lens_k or lens_q
    q, k, v = _packed(lens_q, lens_k, 6, 2, head_dim, seed=case)
    out, lse = fa3.attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                    causal=causal, return_lse=True)
    ref, ref_lse = _reference(q, k, v, lens_q, lens_k, causal=causal)
    assert out.shape == q.shape and lse.shape == (6, q.shape[0])
    assert not out.isnan().any(), "NaN: a row was not written"
    assert rel_err(out, ref) < TOL, f"relative error {rel_err(out, ref):.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2


@gpu
def test_varlen_window_softcap_and_agrees_with_padded_attention():
    lens = [513, 100, 1]
    q, k, v = _packed(lens, lens, 4, 4, 128, seed=9)
    out = fa3.attention_varlen(q, k, v, _cu(lens), _cu(lens), causal=True, window_size=(64, 0), softcap=15.0)
    ref, _ = _reference(q, k, v, lens, lens, causal=True, window_size=(64, 0), softcap=15.0)
    assert rel_err(out, ref) < TOL
    # one sequence through fa3.attention gives the same rows, bit for bit in the kernel's tiles
    dense = fa3.attention(q[None, :513], k[None, :513], v[None, :513], causal=True)
    assert rel_err(fa3.attention_varlen(q, k, v, _cu(lens), _cu(lens), causal=True)[:513], dense[0]) < 1e-3


@gpu
def test_varlen_in_cuda_graph_and_torch_compile():
    lens = [100, 300]
    q, k, v = _packed(lens, lens, 4, 2, 64, seed=3)
    cu = _cu(lens)
    expected = fa3.attention_varlen(q, k, v, cu, cu, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa3.attention_varlen(q, k, v, cu, cu, causal=True)
    graph.replay()
    assert torch.equal(out, expected)
    compiled = torch.compile(lambda *a: fa3.attention_varlen(*a, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu, cu), expected)


@gpu
def test_varlen_backward_rung_must_take_packed_batches(monkeypatch):
    """A backward rung without the varlen variant is refused by name before anything runs."""
    import dataclasses

    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    plain = dataclasses.replace(registry.get("b1"), variants=("local", "softcap"))
    monkeypatch.setattr(registry, "get", lambda name, _get=registry.get: plain if name == "b1" else _get(name))
    monkeypatch.setattr(_dispatch, "_RUNGS", {})  # resolved rungs are remembered
    raises_with(fa3.attention_varlen, ValueError, "backward_kernel='b1'", "packed", q=q, k=q, v=q,
                cu_seqlens_q=cu, cu_seqlens_k=cu, backward_kernel="b1")


@gpu
def test_varlen_offset_values_are_checked(strict_index_checks):
    """Bad offsets are refused by the call that passes them (strict mode; the deferred default's
    later raise is tests/test_bad_values.py's)."""
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    call = lambda cu_q, cu_k=good, **kw: dict(q=q, k=q, v=q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    t = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")
    raises_with(fa3.attention_varlen, ValueError, "cu_seqlens_q", "decreases", **call(t(0, 6, 4, 10), t(0, 1, 2, 10)))
    raises_with(fa3.attention_varlen, ValueError, "cu_seqlens_q[-1] = 9", "q.shape[0] = 10", **call(t(0, 4, 9)))
    raises_with(fa3.attention_varlen, ValueError, "cu_seqlens_k[0]", **call(good, t(1, 4, 10)))
    raises_with(fa3.attention_varlen, ValueError, "max_seqlen_q=5", "6", **call(good, max_seqlen_q=5))


# ----------------------------------------------------------------------------- CPU
def test_varlen_validation_messages():
    q = torch.randn(10, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    args = lambda **over: {**dict(q=q, k=q[:, :2], v=q[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu), **over}
    raises = lambda exc, *words, **over: raises_with(fa3.attention_varlen, exc, *words, **args(**over))
    raises(ValueError, "cu_seqlens_q", "int32", cu_seqlens_q=cu.long())
    raises(ValueError, "cu_seqlens_k", "batch + 1 = 3", cu_seqlens_k=cu[:2])
    raises(ValueError, "q must have 3 dimensions", q=q[None])
    raises(ValueError, "heads_q=4", "heads_kv=3", k=q[:, :3], v=q[:, :3])
    raises(ValueError, "head_dim", k=q[:, :2, :64], v=q[:, :2, :64])
    raises(ValueError, "head_dim=80", "pad", q=q[..., :80], k=q[:, :2, :80], v=q[:, :2, :80])
    if not HAS_HOPPER:
        raises((ValueError, RuntimeError), "GPU")


def test_varlen_offset_checks_on_host_values():
    cu = lambda *x: torch.tensor(x, dtype=torch.int32)
    ok = cu(0, 3, 3, 8)
    index_checks.check_offset_values(ok, ok, 8, 8, 5, None)  # empty sequences are fine
    for bad_q, words in ((cu(0, 3, 2, 8), "decreases"), (cu(0, 3, 3, 7), "q.shape[0] = 8"),
                         (cu(2, 3, 3, 8), "start at 0")):
        with pytest.raises(ValueError) as info:
            index_checks.check_offset_values(bad_q, ok, 8, 8, None, None)
        assert words in str(info.value)


def test_varlen_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(37, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(50, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.fa3.attention_varlen(q, k, k, cu, cu, True, 0.1, -1, -1, 0.0, "k5.5")
    assert out.shape == q.shape and lse.shape == (8, 37) and lse.dtype == torch.float32
