"""Flex attention on K5 (fa3.flex_attention, fa3.attention(score_mod=, mask_mod=); worklog/flex.md).

CPU: argument errors named, the library's mods on torch tensors, each mod compiled into k5.5 at d128
for sm_90a with the instructions it must bring into the PTX, and the compile key (two mods apart,
one mod's tables of any value alike). GPU: each mod against a float64 reference built from the
same function over materialized scores, causal and not, GQA, ragged lengths, a fully masked row.
"""

import math

import pytest
import torch

import fa3
import fa3.__main__ as cli
from fa3 import flex, mods as fmods, registry
from fa3.compile import builders

cli.prepare_dsl_env()  # before the first compile imports cutlass: sm_90a, no PTX files in the cwd

gpu = pytest.mark.gpu


def library(batch=2, heads=4, seqlen=300, device="cpu"):
    """(name, score_mod, mask_mod) of every library mod, tables on `device`."""
    g = torch.Generator().manual_seed(0)
    doc = torch.cumsum(torch.rand(batch, seqlen, generator=g) < 0.02, dim=1).to(torch.int32).to(device)
    table = torch.randn(heads, 33, generator=g).to(device)
    return [
        ("causal", None, flex.causal),
        ("sliding_window", None, flex.sliding_window(64)),
        ("document", None, flex.document(doc)),
        ("prefix_lm", None, flex.prefix_lm(40)),
        ("prefix_lm_per_batch", None, flex.prefix_lm(torch.tensor([7, 130], dtype=torch.int32, device=device))),
        ("alibi", flex.alibi(flex.alibi_slopes(heads).to(device)), None),
        ("softcap", flex.softcap(20.0), None),
        ("relative_bias", flex.relative_bias(table, 16), None),
        ("alibi_document", flex.alibi(flex.alibi_slopes(heads).to(device)), flex.document(doc)),
    ]


# ----------------------------------------------------------------------------- CPU
def test_argument_errors_are_named():
    q = torch.zeros(1, 128, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"score_mod .* takes 4 arguments"):
        fa3.attention(q, q, q, score_mod=lambda s, b, h, q_idx: s)
    with pytest.raises(TypeError, match="must be a Python function"):
        fa3.attention(q, q, q, mask_mod=object())
    with pytest.raises(ValueError, match="exclusive"):
        fa3.attention(q, q, q, score_mod=flex.softcap(5.0), softcap=5.0)
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="forward only for now"):
        fa3.attention(qg, qg, qg, mask_mod=flex.causal)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fa3.flex_attention(torch.zeros(1, 4, 128, 128), torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, 128))
    with pytest.raises(ValueError, match="0-dim tensor"):
        fmods.Mods(mask_mod=_captures(torch.tensor(3)))
    with pytest.raises(ValueError, match="of type list"):
        fmods.Mods(mask_mod=_captures([1, 2]))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        fmods.Mods(score_mod=flex.alibi(torch.zeros(4, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"captures 'doc_ids' on cpu, but q is on cuda"):
        fmods.Mods(mask_mod=flex.document(torch.zeros(1, 8, dtype=torch.int32))).aux(torch.device("cuda", 0))


GLOBAL_TABLE = torch.zeros(4)


def test_global_tensor_refused_by_name():
    def reads_global(score, b, h, q_idx, kv_idx):
        return score + GLOBAL_TABLE[h]
    with pytest.raises(ValueError, match="global tensor 'GLOBAL_TABLE'"):
        fmods.Mods(score_mod=reads_global)


def _captures(value):
    def mask(b, h, q_idx, kv_idx):
        return value[0] > q_idx
    return mask


def test_block_mask_checked():
    from torch.nn.attention.flex_attention import create_block_mask

    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    block = create_block_mask(flex.causal, 1, 1, 256, 256, device="cpu")
    with pytest.raises(ValueError, match=r"made for \(seqlen_q, seqlen_kv\) = \(256, 256\)"):
        fa3.flex_attention(q, q, q, block_mask=block)
    block = create_block_mask(flex.causal, 3, 1, 300, 300, device="cpu")
    with pytest.raises(ValueError, match=r"\(batch, heads\) = \(3, 1\)"):
        fa3.flex_attention(q, q, q, block_mask=block)
    assert flex.block_mask_mod(create_block_mask(flex.causal, 1, 1, 300, 300, device="cpu"),
                               300, 300, 1, 2) is flex.causal


def test_library_runs_on_torch_tensors():
    """Each mod on broadcast index tensors (what the reference does), and torch's causal mask."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, dtype=torch.float64) for _ in range(3))
    for name, score_mod, mask_mod in library():
        out, lse = flex.reference(q, k, v, score_mod, mask_mod)
        assert out.shape == q.shape and lse.shape == q.shape[:3], name
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
    out, _ = flex.reference(q, k, v, None, flex.causal)
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expect)


# instructions each mod brings into k5.5's d128 PTX (beyond the kernel without mods)
PTX_NEEDS = {
    "causal": ["setp.ge.s32"], "sliding_window": ["setp.ge.s32"], "document": ["ld.global.b32"],
    "prefix_lm": ["setp.le.s32"], "prefix_lm_per_batch": ["ld.global.b32"],
    "alibi": ["cvt.rn.f32.s32", "ld.global.b32"], "softcap": ["tanh.approx.f32"],
    "relative_bias": ["ld.global.b32", "max.s32"], "alibi_document": ["cvt.rn.f32.s32", "ld.global.b32"],
}


def _ptx(mods, causal=False):
    return builders._build_attention(registry.get("k5.5"), torch.bfloat16, 128, causal, mods=mods,
                                     extra_options="--keep-ptx").artifacts.PTX


@pytest.fixture(scope="module")
def plain_ptx():
    return _ptx(None)


@pytest.mark.parametrize("case", library(), ids=lambda c: c[0])
def test_mod_compiles_into_k5(case, plain_ptx):
    name, score_mod, mask_mod = case
    ptx = _ptx(fmods.Mods(score_mod, mask_mod))
    for needed in PTX_NEEDS[name]:
        assert ptx.count(needed) > plain_ptx.count(needed), f"{name}: no {needed!r} of its own in the PTX"
    if mask_mod is not None:  # -inf selected where the mask mod says False, on every tile
        assert ptx.count("selp.f32") > plain_ptx.count("selp.f32"), name
    assert ptx.count("ex2.approx") == plain_ptx.count("ex2.approx"), f"{name}: the softmax changed"


def test_wrong_result_type_named():
    def int_score(score, b, h, q_idx, kv_idx):
        return q_idx - kv_idx
    with pytest.raises(ValueError, match=r"score_mod .*int_score.* could not be compiled.*not a float32 score"):
        _ptx(fmods.Mods(score_mod=int_score))


def test_compile_key():
    spec = registry.get("k5.5")

    def key(mods):
        return builders.attention_key(spec, torch.bfloat16, 128, False, mods=mods)
    doc_a = flex.document(torch.zeros(2, 64, dtype=torch.int32))
    doc_b = flex.document(torch.ones(3, 99, dtype=torch.int32))  # other values and shape: same kernel
    assert key(fmods.Mods(mask_mod=doc_a)) == key(fmods.Mods(mask_mod=doc_b))
    assert key(fmods.Mods(mask_mod=flex.causal)) != key(fmods.Mods(mask_mod=doc_a))
    assert key(fmods.Mods(mask_mod=flex.sliding_window(64))) != key(fmods.Mods(mask_mod=flex.sliding_window(32)))
    assert key(fmods.Mods(score_mod=flex.alibi(torch.zeros(4)))) != \
        key(fmods.Mods(score_mod=flex.alibi(torch.zeros(4, dtype=torch.bfloat16))))
    assert key(fmods.Mods(mask_mod=flex.causal)) != key(fmods.Mods(score_mod=flex.softcap(5.0)))
    assert key(None) == builders.attention_key(spec, torch.bfloat16, 128, False)  # no mods: the key as before


# ----------------------------------------------------------------------------- GPU
def _check(out, lse, ref_out, ref_lse, name):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2, msg=name)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: rows that see no key"
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-3, msg=name)


@gpu
@pytest.mark.parametrize("seqlen", [300, 1024], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("heads_kv", [4, 2], ids=lambda h: f"hkv{h}")
def test_flex_library_against_reference(seqlen, heads_kv):
    torch.manual_seed(0)
    q = torch.randn(2, 4, seqlen, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, heads_kv, seqlen, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for name, score_mod, mask_mod in library(seqlen=seqlen, device="cuda"):
        ref_out, ref_lse = flex.reference(q, k, v, score_mod, mask_mod)
        if mask_mod is None:  # torch's signature (a mask mod alone reaches it through a BlockMask)
            out, lse = fa3.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True, return_lse=True)
        else:
            out, lse = _attention_torch_layout(q, k, v, score_mod, mask_mod)
        _check(out, lse, ref_out, ref_lse, name)


def _attention_torch_layout(q, k, v, score_mod, mask_mod, causal=False):
    out, lse = fa3.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                             score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    return out.transpose(1, 2), lse


@gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 300), (200, 457)])
def test_mods_with_builtin_causal(seqlen_q, seqlen_k):
    """fa3's bottom-right causal and a mod together: the reference masks both."""
    torch.manual_seed(1)
    q = torch.randn(1, 4, seqlen_q, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, seqlen_k, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    shift = seqlen_k - seqlen_q
    table = torch.randn(4, 33, device="cuda")
    score_mod = flex.relative_bias(table, 16)

    def bottom_right(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift
    ref_out, ref_lse = flex.reference(q, k, v, score_mod, bottom_right)
    out, lse = _attention_torch_layout(q, k, v, score_mod, None, causal=True)
    _check(out, lse, ref_out, ref_lse, "relative_bias causal")


@gpu
def test_fully_masked_rows_give_zero():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def hides_rows(b, h, q_idx, kv_idx):  # rows 100..199 see nothing
        return (q_idx < 100) | (q_idx >= 200)
    out, lse = _attention_torch_layout(q, k, v, None, hides_rows)
    assert torch.all(out[:, :, 100:200] == 0) and torch.all(lse[:, :, 100:200] == -math.inf)
    ref_out, ref_lse = flex.reference(q, k, v, None, hides_rows)
    _check(out, lse, ref_out, ref_lse, "fully masked rows")


@gpu
def test_block_mask_and_torch_flex_agree():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask_mod = flex.sliding_window(100)
    block = create_block_mask(mask_mod, 1, 1, 384, 384, device="cuda")
    score_mod = flex.alibi(flex.alibi_slopes(4).cuda())
    out = fa3.flex_attention(q, k, v, score_mod=score_mod, block_mask=block)
    expect = flex_attention(q, k, v, score_mod=score_mod, block_mask=block)
    torch.testing.assert_close(out, expect, atol=2e-2, rtol=2e-2)
