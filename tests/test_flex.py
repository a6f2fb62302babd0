"""Flex attention on K5 (fa3.flex_attention, fa3.attention(score_mod=, mask_mod=); worklog/flex.md).

CPU: argument errors named, the library's mods on torch tensors, each mod compiled into k5.5 at d128
for sm_90a with the instructions it must bring into the PTX, and the compile key (two mods apart,
one mod's tables of any value alike); BlockMasks checked (BLOCK_SIZE against the tiles, devices,
the dense fallback at d192/d256) and the block-sparse kernel compiled (it reads the lists). GPU:
each mod against a float64 reference built from the same function over materialized scores, causal
and not, GQA, ragged lengths, a fully masked row; block skipping against the reference of torch's
BlockMask semantics (listed blocks only, the mask_mod on partial blocks only).
Backward: CPU, the errors (a score mod without its derivative, captures that require grad, sinks,
out=; a BlockMask without its transposed lists, transposed lists that do not fit, deterministic
with a block mask), the backward's compile key and captures, the flex form and its block-sparse
form compiled on the rung a call takes at each head dim with no spill; GPU, dq/dk/dv of each
library mod (d64/d128, GQA, ragged lengths) and of other head dims, builtin causal, fully masked
rows, a user's derivative, deterministic calls, and the block-sparse backward (causal BlockMasks,
documents, empty Q and K/V tiles, per-head windows under GQA, lists alone; full + partial lists
and partial ones only; d64/d96/d128), against flex.reference's gradients in float64 (within 2x
the error of the same reference in bf16; a BlockMask through the reference of its semantics),
gradients' memory poisoned with NaN.
"""

import math
import re

import pytest
import torch

import fa3
import fa3.__main__ as cli
from conftest import poison_allocator, rel_err
from fa3 import flex, mods as fmods, registry
from fa3.compile import builders
from fa3.kernels import config

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
        ("causal_document", None, flex.causal_document(doc)),
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


def test_backward_errors_are_named():
    """What a call with mods and gradients refuses (before anything runs), and a score mod without
    its derivative, refused by the backward's Mods with what to provide."""
    q = torch.zeros(1, 128, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="with sinks are forward only"):
        fa3.attention(q, q, q, mask_mod=flex.causal, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="out= is not differentiable"):
        fa3.attention(q, q, q, mask_mod=flex.causal, out=torch.empty_like(q))

    def scaled(score, b, h, q_idx, kv_idx):
        return score * 2.0
    fmods.Mods(score_mod=scaled)  # the forward needs no derivative
    with pytest.raises(NotImplementedError, match=r"score_mod .*scaled has no derivative.*set .*scaled"
                                                  r"\.score_mod_grad.*a number.*a function \(out, b, h, q_idx, kv_idx\)"):
        fmods.Mods(score_mod=scaled, backward=True)
    scaled.score_mod_grad = "2"
    with pytest.raises(TypeError, match="score_mod_grad must be a number or a Python function"):
        fmods.Mods(score_mod=scaled, backward=True)
    scaled.score_mod_grad = lambda out, b, h, q_idx: 2.0
    with pytest.raises(TypeError, match=r"score_mod_grad .* takes 4 arguments.*\(out, b, h, q_idx, kv_idx\)"):
        fmods.Mods(score_mod=scaled, backward=True)
    table = torch.zeros(2, 33, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"captures 'table', which requires grad.*detach it"):
        fmods.Mods(score_mod=flex.relative_bias(table, 16)).aux(torch.device("cpu"))
    with torch.no_grad():  # no gradient asked for: taken as it is
        assert len(fmods.Mods(score_mod=flex.relative_bias(table, 16)).aux(torch.device("cpu"))) == 1


def test_backward_mods_key_and_captures():
    """The backward's key adds the score mod's derivative (the forward's stays as it was); its
    captured tensors follow the score and mask mods' in the kernel's aux tuple."""
    weights = torch.zeros(4)
    doc = torch.zeros(1, 8, dtype=torch.int32)

    def weighted(score, b, h, q_idx, kv_idx):
        return score * weights[h]
    weighted.score_mod_grad = lambda out, b, h, q_idx, kv_idx: weights[h] + 0.0
    forward = fmods.Mods(weighted, flex.document(doc))
    backward = fmods.Mods(weighted, flex.document(doc), backward=True)
    assert backward.key[:2] == forward.key and len(backward.key) == 3
    assert [t for t in backward.aux(torch.device("cpu"))] == [weights, doc, weights]
    assert backward.aux_spec() == [(torch.float32, 1), (torch.int32, 2), (torch.float32, 1)]
    assert fmods.Mods(flex.alibi(weights), backward=True).score_mod_grad == 1.0  # a bias: constant
    assert fmods.Mods(mask_mod=flex.causal, backward=True).score_mod_grad is None
    spec = registry.get("b7")
    key = builders.backward_key(spec, torch.bfloat16, 128, False)
    assert builders.backward_key(spec, torch.bfloat16, 128, False, mods=backward) != key
    assert builders.backward_key(spec, torch.bfloat16, 128, False, mods=None) == key  # no mods: as before


def test_block_sparse_backward_errors():
    """With gradients a BlockMask's transposed lists are walked (fa3.flex.block_mask_q_lists): one
    made without them is refused by name, so are transposed lists that do not fit the call and
    deterministic=True (a sparse walk skips the ordered dQ's turns), before anything runs."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16, requires_grad=True)
    counts, indices = torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    no_q_lists = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=128, seq_lengths=(256, 256),
                                          compute_q_blocks=False)
    with pytest.raises(ValueError, match=r"no q_num_blocks / q_indices .*compute_q_blocks=True"):
        fa3.flex_attention(q, q, q, block_mask=no_q_lists)
    assert flex.block_mask_plan(no_q_lists, q, q)[1] is not None  # the forward alone does not read them
    # K/V lists wider than the keys' blocks: the forward takes them, the backward's rows would not fit
    wide = BlockMask.from_kv_blocks(counts, torch.zeros(1, 1, 2, 3, dtype=torch.int32), BLOCK_SIZE=128,
                                    seq_lengths=(256, 256))
    with pytest.raises(ValueError, match=r"transposed lists \(q_num_blocks \(1, 1, 3\).*counts \(1, 1, 2\)"):
        fa3.flex_attention(q, q, q, block_mask=wide)
    causal = create_block_mask(flex.causal, None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="deterministic=True is not supported with a block mask and gradients"):
        fa3.flex_attention(q, q, q, block_mask=causal, deterministic=True)
    lists = flex.block_mask_q_lists(causal, q, q, 4)
    assert [tuple(t.shape) for t in lists] == [(1, 1, 2), (1, 1, 2, 2)] * 2
    assert all(t.dtype == torch.int32 for t in lists)
    assert len(flex.block_mask_q_lists(causal, q, q, 2)) == 2


def test_block_sparse_backward_refusals():
    """The block-sparse backward's kernel refuses what its walk cannot do (an ordered dQ, a causal
    variant, statistics in registers), and the configurations that fit it include the ones calls
    take at d64-d128."""
    spec = registry.get("b7")
    mods = fmods.Mods(mask_mod=flex.causal, backward=True)
    with pytest.raises(ValueError, match="adds dQ unordered"):
        builders._build_backward(spec, torch.bfloat16, 128, False, deterministic=True, mods=mods, block_lists=2)
    with pytest.raises(ValueError, match="no causal, window or varlen"):
        builders._build_backward(spec, torch.bfloat16, 128, True, mods=mods, block_lists=4)
    with pytest.raises(ValueError, match=r"statistics through SMEM"):
        builders._build_backward(registry.get("b2"), torch.bfloat16, 128, False, mods=mods, block_lists=2)
    for head_dim in (64, 96, 128):
        cfg = config.backward_config(_flex_backward_rung(head_dim).config, head_dim)
        assert config.block_mask_backward_fits(cfg), head_dim
    assert not config.block_mask_backward_fits(config.backward_config(registry.get("b9").config, 192))
    assert not config.block_mask_backward_fits(config.backward_config(registry.get("b2").config, 256))
    assert not config.block_mask_backward_fits(config.backward_config(registry.get("b2").config, 128))
    assert config.block_mask_backward_fits(config.backward_config(registry.get("b8").config, 64))


# the backward rung of a call with mods at each head dim (registry.fastest, or config.FLEX_BACKWARD)
def _flex_backward_rung(head_dim):
    return registry.get(config.FLEX_BACKWARD.get(head_dim) or registry.fastest(registry.BACKWARD, head_dim).name)


@pytest.mark.parametrize("head_dim, case, gqa", [
    (64, "alibi_document", True), (64, "sliding_window", True), (96, "softcap", False),
    (128, "relative_bias", True), (128, "softcap", False), (192, "alibi_document", False), (256, "softcap", True)],
    ids=lambda x: str(x))
def test_mods_compile_into_the_backward(head_dim, case, gqa):
    """The backward's flex form (kernels/bwd_ws.FlexBackward) on the rung a call with mods takes,
    for sm_90a: no register spilled, the WGMMAs not serialized; softcap's derivative (a function of
    the mod's output, recovered from P) brings its lg2 and the mask mods their selects."""
    name, score_mod, mask_mod = next(c for c in library() if c[0] == case)
    spec = _flex_backward_rung(head_dim)
    report = builders.build_report(builders._build_backward, spec, torch.bfloat16, head_dim, False, gqa=gqa,
                                   mods=fmods.Mods(score_mod, mask_mod, backward=True))
    assert report.spill_bytes == 0 and not report.serialized_wgmma, f"{spec.name} d{head_dim}: {report.summary()}"
    assert ("lg2.approx" in report.ptx) == (case == "softcap"), name


# (head_dim, score mod, mask mod, GQA): at d128 (b7) the table-reading mods spill 8-16 B with block lists
# (worklog/flex.md), ALiBi + documents under GQA and documents under GQA 8 B without them too
@pytest.mark.parametrize("head_dim, score, mask, gqa", [(64, "alibi", "document", True), (64, "relative_bias", "causal", True),
                                                        (96, "softcap", "document", False),
                                                        (128, "softcap", "causal", True), (128, "alibi", "document", False)],
                         ids=lambda x: str(x))
def test_block_sparse_backward_compiles(head_dim, score, mask, gqa):
    """The block-sparse backward (kernels/bwd_ws.BlockSparseFlexBackward) on the rung a call takes,
    for sm_90a, a score mod beside a mask mod, with and without full-block lists: no register
    spilled, the WGMMAs not serialized; the transposed lists are its last arguments and the kernel
    reads each."""
    mods_by_name = {c[0]: c for c in library()}
    mods = fmods.Mods(mods_by_name[score][1], mods_by_name[mask][2], backward=True)
    spec = _flex_backward_rung(head_dim)
    dense = builders._build_backward(spec, torch.bfloat16, head_dim, False, gqa=gqa, mods=mods,
                                     extra_options="--keep-ptx").artifacts.PTX
    for lists in (2, 4):
        report = builders.build_report(builders._build_backward, spec, torch.bfloat16, head_dim, False, gqa=gqa,
                                       mods=mods, block_lists=lists)
        assert report.spill_bytes == 0 and not report.serialized_wgmma, \
            f"{spec.name} d{head_dim} {lists} lists: {report.summary()}"
        params = _entry_params(report.ptx)
        assert len(params) == len(_entry_params(dense)) + lists
        unread = [name for name, reads in params[-lists:] if not reads]
        assert not unread, f"{lists} lists: the kernel never reads {unread}"


def test_block_sparse_backward_compile_key():
    spec = registry.get("b4")
    mods = fmods.Mods(mask_mod=flex.causal, backward=True)

    def key(block_lists):
        return builders.backward_key(spec, torch.bfloat16, 64, False, mods=mods, block_lists=block_lists)
    assert len({key(0), key(2), key(4)}) == 3
    assert key(0) == builders.backward_key(spec, torch.bfloat16, 64, False, mods=mods)


def test_block_mask_checked():
    from torch.nn.attention.flex_attention import create_block_mask

    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16)
    block = create_block_mask(flex.causal, 1, 1, 256, 256, device="cpu")
    with pytest.raises(ValueError, match=r"made for \(seqlen_q, seqlen_kv\) = \(256, 256\)"):
        fa3.flex_attention(q, q, q, block_mask=block)
    block = create_block_mask(flex.causal, 3, 1, 300, 300, device="cpu")
    with pytest.raises(ValueError, match=r"\(batch, heads\) = \(3, 1\)"):
        fa3.flex_attention(q, q, q, block_mask=block)
    mod, lists = flex.block_mask_plan(create_block_mask(flex.causal, 1, 1, 300, 300, device="cpu"), q, q)
    assert mod is flex.causal and len(lists) == 4 and all(t.dtype == torch.int32 for t in lists)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_block_mask_block_size_must_be_the_tiles(head_dim):
    from torch.nn.attention.flex_attention import create_block_mask

    q = torch.zeros(1, 2, 300, head_dim, dtype=torch.bfloat16)
    block = create_block_mask(flex.causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(ValueError, match=r"block_mask has BLOCK_SIZE=\(64, 64\).*128 x 128 tiles.*"
                                         r"create_block_mask\(\.\.\., BLOCK_SIZE=128\)"):
        fa3.flex_attention(q, q, q, block_mask=block)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE=\(64, 64\)"):
        fa3.flex_attention(q, q, q, block_mask=block, kernel="k5.2")
    _, lists = flex.block_mask_plan(create_block_mask(flex.causal, None, None, 300, 300, device="cpu"), q, q)
    assert lists is not None and [t.dim() for t in lists] == [3, 4, 3, 4]


def test_block_mask_dense_fallback():
    """d192 / d256 (K/V tiles of 96 / 64 keys): any BLOCK_SIZE, its mask_mod applied everywhere;
    a BlockMask with no mask_mod refused there, accepted where blocks are skipped."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    block = create_block_mask(flex.causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    for head_dim in (192, 256):
        q = torch.zeros(1, 2, 300, head_dim, dtype=torch.bfloat16)
        assert flex.block_mask_plan(block, q, q) == (flex.causal, None)
    counts = torch.ones(1, 1, 3, dtype=torch.int32)
    indices = torch.arange(3, dtype=torch.int32).repeat(1, 1, 3, 1)
    no_mod = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=128, seq_lengths=(300, 300))
    with pytest.raises(ValueError, match="no mask_mod of its own"):
        flex.block_mask_plan(no_mod, torch.zeros(1, 2, 300, 256), torch.zeros(1, 2, 300, 256))
    mod, lists = flex.block_mask_plan(no_mod, torch.zeros(1, 2, 300, 128), torch.zeros(1, 2, 300, 128))
    assert mod is None and len(lists) == 2


def test_block_mask_device_checked():
    from torch.nn.attention.flex_attention import create_block_mask

    block = create_block_mask(flex.causal, None, None, 300, 300, device="cpu")
    q = torch.zeros(1, 2, 300, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"block_mask's kv_num_blocks is on cpu, but query is on meta"):
        flex.block_mask_plan(block, q, q)


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
    "causal_document": ["setp.ge.s32", "ld.global.b32"],
    "prefix_lm": ["setp.lt.s32"], "prefix_lm_per_batch": ["ld.global.b32"],
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


def test_capture_indexed_with_the_wrong_rank_named():
    """A captured tensor indexed with more coordinates than its rank: the error names the mod, the
    captured tensor with its shape, and says what the compiler's "weakly congruent" means."""
    doc_ids = torch.zeros(64, dtype=torch.int32)  # 1-D, read as doc_ids[b, q_idx]

    def two_index_documents(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    with pytest.raises(ValueError, match=r"mask_mod .*two_index_documents.* could not be compiled .*one coordinate "
                                         r"per dimension.*'doc_ids' \(64,\) torch.int32"):
        _ptx(fmods.Mods(mask_mod=two_index_documents))


def _block_sparse_ptx(block_lists, head_dim, rung, mods):
    short = config.block_mask_short(registry.get(rung).config, head_dim)
    report = builders.build_report(builders._build_attention, registry.get(rung), torch.bfloat16, head_dim, False,
                                   short=short, mods=mods, block_lists=block_lists)
    assert report.spill_bytes == 0 and not report.serialized_wgmma, report.summary()
    return report.ptx


def _entry_params(ptx: str) -> list[tuple[str, int]]:
    """(name, how often the kernel's body reads it) of each parameter of the PTX's entry."""
    start = ptx.index(".entry")
    end = ptx.index(")", start)
    return [(name, ptx[end:].count("[" + name)) for name in re.findall(r"(\w+_param_\d+)", ptx[start:end])]


@pytest.mark.parametrize("rung, head_dim", [("k5.5", 128), ("k5.5", 64), ("k5.5", 96), ("k5.2", 128)])
def test_block_sparse_kernel_compiles(rung, head_dim):
    """The block-sparse flex kernel for sm_90a (k5.5: the overlapped mainloop, d64 and d96 on its
    128-row tiles; k5.2: one tile at a time), with and without full-block lists, no register spilled (the
    document mask; ALiBi beside it spills at d128 with or without a block mask): the lists are
    its last arguments (a tensor each, beyond the flex kernel without a block mask), and the kernel
    reads every one of them. Its tiles, which differ in length, are handed out from the tile counter
    where the rung schedules dynamically (k5.5), as causal tiles are; the flex kernel without a block
    mask (non-causal) touches no counter."""
    mods = fmods.Mods(mask_mod=flex.document(torch.zeros(1, 8, dtype=torch.int32)))
    short = config.block_mask_short(registry.get(rung).config, head_dim)
    dense = builders._build_attention(registry.get(rung), torch.bfloat16, head_dim, False, short=short, mods=mods,
                                      extra_options="--keep-ptx").artifacts.PTX
    assert "atom.global.add" not in dense
    for lists in (2, 4):
        ptx = _block_sparse_ptx(lists, head_dim, rung, mods)
        params = _entry_params(ptx)
        assert len(params) == len(_entry_params(dense)) + lists
        unread = [name for name, reads in params[-lists:] if not reads]
        assert not unread, f"{lists} lists: the kernel never reads {unread}"
        assert ("atom.global.add" in ptx) == registry.get(rung).config.base.dynamic_schedule


def test_block_sparse_compile_key():
    spec = registry.get("k5.5")
    mods = fmods.Mods(mask_mod=flex.causal)

    def key(block_lists):
        return builders.attention_key(spec, torch.bfloat16, 128, False, mods=mods, block_lists=block_lists)
    assert len({key(0), key(2), key(4)}) == 3
    assert key(0) == builders.attention_key(spec, torch.bfloat16, 128, False, mods=mods)


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


# ----------------------------------------------------------------------------- GPU: block skipping
def _listed(counts, indices, kv_blocks):
    """(B, H, q_blocks, kv_blocks) bool: the blocks a pair of BlockMask lists names."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
    dense = torch.zeros(*counts.shape, kv_blocks + 1, dtype=torch.bool, device=counts.device)
    dense.scatter_(-1, torch.where(valid, indices.long(), kv_blocks), True)
    return dense[..., :kv_blocks]


def block_semantics(block_mask, batch, heads):
    """torch's BlockMask semantics as a mask mod for flex.reference: (b, h, q, kv) is visible where
    its block is full, or partial and the BlockMask's mask_mod says so; unlisted blocks hidden."""
    block_q, block_kv = block_mask.BLOCK_SIZE
    kv_blocks = block_mask.kv_indices.shape[-1]

    def expand(t):
        return t.expand(batch, heads, *t.shape[2:])
    partial = expand(_listed(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks))
    full = torch.zeros_like(partial)
    if block_mask.full_kv_num_blocks is not None:
        full = expand(_listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks))
    mod = block_mask.mask_mod

    def visible(b, h, q_idx, kv_idx):
        qb, kb = q_idx // block_q, kv_idx // block_kv
        keep = partial[b, h, qb, kb]
        if mod is not None and getattr(mod, "__name__", "") != "noop_mask":
            keep = keep & mod(b, h, q_idx, kv_idx)
        return full[b, h, qb, kb] | keep
    return visible


def without_full_blocks(block_mask):
    """The same mask with its full blocks listed as partial ones (no full lists)."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_blocks = block_mask.kv_indices.shape[-1]
    listed = _listed(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks)
    listed |= _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks)
    counts = listed.sum(-1).to(torch.int32)
    indices = torch.argsort(listed.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                    mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)


def _qkv(batch, heads, heads_kv, seqlen_q, seqlen_kv, head_dim, seed):
    torch.manual_seed(seed)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, heads_kv, seqlen_kv, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    return q, k, v


def _check_block_mask(q, k, v, block_mask, name, score_mod=None, kernel=None):
    batch, heads = q.shape[:2]
    out, lse = fa3.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                  return_lse=True, kernel=kernel)
    ref_out, ref_lse = flex.reference(q, k, v, score_mod, block_semantics(block_mask, batch, heads))
    _check(out, lse, ref_out, ref_lse, name)
    return out, lse


def _random_documents(batch, seqlen, count, seed):
    """(batch, seqlen) int32 document ids: `count` documents of ragged lengths per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(batch):
        cuts = torch.sort(torch.randperm(seqlen - 1, generator=g)[:count - 1] + 1).values
        ids.append(torch.bucketize(torch.arange(seqlen), cuts, right=True))
    return torch.stack(ids).to(torch.int32).cuda()


BLOCK_KERNELS = [(128, None), (64, None), (96, None), (128, "k5.2")]  # k5.2: the mainloop without overlap


@gpu
@pytest.mark.parametrize("head_dim, kernel", BLOCK_KERNELS, ids=lambda x: str(x))
@pytest.mark.parametrize("full_blocks", [True, False], ids=["full", "partial_only"])
@pytest.mark.parametrize("seqlen", [1024, 1000], ids=lambda s: f"s{s}")
def test_block_mask_causal(head_dim, kernel, full_blocks, seqlen):
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _qkv(2, 4, 4, seqlen, seqlen, head_dim, 10)
    block = create_block_mask(flex.causal, None, None, seqlen, seqlen, device="cuda")
    if not full_blocks:
        block = without_full_blocks(block)
    _check_block_mask(q, k, v, block, f"causal d{head_dim} {kernel}", kernel=kernel)


@gpu
@pytest.mark.parametrize("head_dim, kernel", BLOCK_KERNELS, ids=lambda x: str(x))
@pytest.mark.parametrize("documents", [4, 17])
def test_block_mask_documents(head_dim, kernel, documents):
    """Ragged documents per sequence (B=2 masks, H broadcast), 1500 keys (a ragged last tile), an
    ALiBi score mod on every listed block."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 1500
    q, k, v = _qkv(2, 4, 4, seqlen, seqlen, head_dim, 11)
    mask_mod = flex.document(_random_documents(2, seqlen, documents, 12))
    block = create_block_mask(mask_mod, 2, None, seqlen, seqlen, device="cuda")
    score_mod = flex.alibi(flex.alibi_slopes(4, "cuda"))
    _check_block_mask(q, k, v, block, f"documents {documents} d{head_dim}", score_mod=score_mod, kernel=kernel)
    _check_block_mask(q, k, v, without_full_blocks(block), "documents, no full lists", score_mod=score_mod,
                      kernel=kernel)


@gpu
@pytest.mark.parametrize("head_dim, kernel", BLOCK_KERNELS, ids=lambda x: str(x))
def test_block_mask_empty_query_tiles(head_dim, kernel):
    """Q tiles 1 and 2 (rows 128-383) have no block at all: O = 0 and LSE = -inf, no NaN; the tiles
    around them (and the next tile a CTA takes after an empty one) are right."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 1100

    def hides_rows(b, h, q_idx, kv_idx):
        return ((q_idx < 128) | (q_idx >= 384)) & (kv_idx <= q_idx)
    q, k, v = _qkv(3, 4, 4, seqlen, seqlen, head_dim, 13)
    block = create_block_mask(hides_rows, None, None, seqlen, seqlen, device="cuda")
    assert not block.kv_num_blocks[..., 1:3].any() and not block.full_kv_num_blocks[..., 1:3].any()
    out, lse = _check_block_mask(q, k, v, block, "empty Q tiles", kernel=kernel)
    assert torch.all(out[:, :, 128:384] == 0) and torch.all(lse[:, :, 128:384] == -math.inf)


@gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_block_mask_gqa_per_head(head_dim):
    """8 query heads over 2 KV heads, a BlockMask per (batch, query head): each head's window."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen_q, seqlen_kv = 1000, 1337  # neither a multiple of 128, and apart

    def per_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 337) & (q_idx + 337 - kv_idx <= 96 * (h + 1) + 40 * b)
    q, k, v = _qkv(2, 8, 2, seqlen_q, seqlen_kv, head_dim, 14)
    block = create_block_mask(per_head_window, 2, 8, seqlen_q, seqlen_kv, device="cuda")
    _check_block_mask(q, k, v, block, "GQA per-head windows")
    _check_block_mask(q, k, v, without_full_blocks(block), "GQA per-head windows, no full lists")


def _lists_alone_masks(seqlen: int, shifted_first: bool, device="cuda"):
    """(sparse, full) over seqlen x seqlen in 128-blocks: `sparse` a BlockMask without a mask_mod
    whose Q tile m lists K/V tiles m and (m + 3) % blocks as partial blocks (the shifted one first
    or second); `full` every block full, with a mask_mod that hides everything (never run there)."""
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-seqlen // 128)
    rows = torch.arange(blocks, device=device)
    pair = [(rows + 3) % blocks, rows] if shifted_first else [rows, (rows + 3) % blocks]
    indices = torch.stack(pair, dim=-1)
    indices = torch.cat([indices, torch.zeros(blocks, blocks - 2, dtype=indices.dtype, device=device)], dim=-1)
    counts = torch.full((1, 1, blocks), 2, dtype=torch.int32, device=device)
    sparse = BlockMask.from_kv_blocks(counts, indices.to(torch.int32)[None, None], BLOCK_SIZE=128,
                                      seq_lengths=(seqlen, seqlen))

    def hides_everything(b, h, q_idx, kv_idx):
        return q_idx < 0
    every = torch.arange(blocks, dtype=torch.int32, device=device).repeat(1, 1, blocks, 1)
    full = BlockMask.from_kv_blocks(torch.zeros(1, 1, blocks, dtype=torch.int32, device=device), every,
                                    torch.full((1, 1, blocks), blocks, dtype=torch.int32, device=device), every,
                                    BLOCK_SIZE=128, mask_mod=hides_everything, seq_lengths=(seqlen, seqlen))
    return sparse, full


@gpu
def test_block_mask_lists_alone():
    """The lists decide: a BlockMask without a mask_mod (from_kv_blocks' noop) whose lists name
    only some blocks gives block-level attention over exactly those (skipping is not optional), and
    full blocks never run the mask_mod: one that hides everything, with every block full, changes
    nothing. 1000 keys: the ragged last tile is a full block here, and the first one visited."""
    q, k, v = _qkv(2, 4, 4, 1000, 1000, 128, 15)
    sparse, full = _lists_alone_masks(1000, shifted_first=False)
    _check_block_mask(q, k, v, sparse, "lists alone")
    out, lse = _check_block_mask(q, k, v, full, "full blocks skip the mask_mod")
    dense_out, dense_lse = flex.reference(q, k, v)
    _check(out, lse, dense_out, dense_lse, "full blocks: dense attention")


@gpu
def test_block_mask_broadcast_matches_per_batch():
    """B=None/H=None (one list for every (batch, head)) against the same mask made per (batch, head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 777
    q, k, v = _qkv(3, 4, 4, seqlen, seqlen, 128, 16)
    mask_mod = flex.sliding_window(200)
    shared = create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")
    own = create_block_mask(mask_mod, 3, 4, seqlen, seqlen, device="cuda")
    out_shared, _ = _check_block_mask(q, k, v, shared, "B=None, H=None")
    out_own, _ = _check_block_mask(q, k, v, own, "B=3, H=4")
    torch.testing.assert_close(out_shared, out_own, atol=0, rtol=0)


# ----------------------------------------------------------------------------- GPU: gradients
def _flex_grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) through autograd on fresh leaves, the gradients' memory
    poisoned with NaN first (anything left unwritten shows)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    poison_allocator()
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def _check_grads(got, q, k, v, dout, score_mod, mask_mod, name, floor=2e-3):
    """(out, dq, dk, dv) against flex.reference's in float64, each within 2x the error of the same
    reference computed in the inputs' dtype (+ floor), no NaN; fully masked rows' dq exactly 0."""
    def reference(dtype):
        return _flex_grads(lambda q, k, v: flex.reference(q, k, v, score_mod, mask_mod, dtype=dtype)[0],
                           q, k, v, dout.to(dtype))
    exact, low = reference(torch.float64), reference(q.dtype)
    for what, g, ref, base in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert g.shape == ref.shape and g.dtype == q.dtype, f"{name}: {what}"
        assert torch.isfinite(g).all(), f"{name}: {what} has NaN/inf"
        err, base_err = rel_err(g, ref), rel_err(base, ref)
        assert err <= 2 * base_err + floor, f"{name}: {what} rel err {err:.2e} vs {q.dtype} reference {base_err:.2e}"
    if mask_mod is not None:
        dev = q.device
        b, h, qi, ki = (torch.arange(n, device=dev).view(*([1] * i), -1, *([1] * (3 - i)))
                        for i, n in enumerate((q.shape[0], q.shape[1], q.shape[2], k.shape[2])))
        sees = torch.as_tensor(mask_mod(b, h, qi, ki), device=dev).expand(*q.shape[:3], k.shape[2]).any(-1)
        assert torch.all(got[1][~sees] == 0), f"{name}: rows that see no key must get dq = 0"


def _flex_call(score_mod, mask_mod, **kw):
    """fa3 with the mods, in flex layout: fa3.flex_attention for a score mod alone (torch's
    signature), fa3.attention(score_mod=, mask_mod=) otherwise."""
    def call(q, k, v):
        if mask_mod is None:
            return fa3.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)
        return fa3.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                             mask_mod=mask_mod, **kw).transpose(1, 2)
    return call


LIBRARY_NAMES = [c[0] for c in library()]


@gpu
@pytest.mark.parametrize("name", LIBRARY_NAMES)
@pytest.mark.parametrize("heads_kv", [4, 2], ids=lambda h: f"hkv{h}")
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
def test_flex_backward_library(head_dim, heads_kv, name):
    """Each library mod, forward and backward, against float64 (seqlens 300 and 457: neither a
    multiple of a tile; GQA 4 query heads over 2), on the rung a call with mods takes (b7 at d128,
    b4 at d64: kernels/config.FLEX_BACKWARD)."""
    _, score_mod, mask_mod = next(c for c in library(seqlen=457, device="cuda") if c[0] == name)
    q, k, v = _qkv(2, 4, heads_kv, 457, 457, head_dim, 21)
    dout = torch.randn_like(q)
    got = _flex_grads(_flex_call(score_mod, mask_mod), q, k, v, dout)
    _check_grads(got, q, k, v, dout, score_mod, mask_mod, f"{name} d{head_dim} hkv{heads_kv}")


@gpu
@pytest.mark.parametrize("head_dim", [96, 192, 256], ids=lambda d: f"d{d}")
def test_flex_backward_other_head_dims(head_dim):
    """The capped scores with documents (a derivative from P and a table read together) and ALiBi
    with a sliding window, at the head dims of b4 and b9, seqlen 300."""
    library_ = {c[0]: c for c in library(seqlen=300, device="cuda")}
    _, _, documents = library_["document"]
    cases = (("softcap_document", flex.softcap(20.0), documents),
             ("alibi_window", library_["alibi"][1], flex.sliding_window(64)))
    q, k, v = _qkv(2, 4, 2, 300, 300, head_dim, 22)
    dout = torch.randn_like(q)
    for name, score_mod, mask_mod in cases:
        got = _flex_grads(_flex_call(score_mod, mask_mod), q, k, v, dout)
        _check_grads(got, q, k, v, dout, score_mod, mask_mod, f"{name} d{head_dim}")


@gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 300), (200, 457)])
def test_flex_backward_with_builtin_causal(seqlen_q, seqlen_k):
    """fa3's bottom-right causal beside a score mod, seqlen_q != seqlen_k (rows that see no key
    when seqlen_q > seqlen_k do not occur here; the reference masks both)."""
    q, k, v = _qkv(1, 4, 4, seqlen_q, seqlen_k, 128, 23)
    dout = torch.randn_like(q)
    shift = seqlen_k - seqlen_q
    score_mod = flex.relative_bias(torch.randn(4, 33, device="cuda"), 16)

    def bottom_right(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift

    def call(q, k, v):
        return fa3.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                             score_mod=score_mod).transpose(1, 2)
    got = _flex_grads(call, q, k, v, dout)
    _check_grads(got, q, k, v, dout, score_mod, bottom_right, "relative_bias causal")


@gpu
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
def test_flex_backward_fully_masked_rows(head_dim):
    """Rows 100..199 see no key: their dq is exactly 0, and nothing is NaN (their LSE is -inf)."""
    def hides_rows(b, h, q_idx, kv_idx):
        return (q_idx < 100) | (q_idx >= 200)
    q, k, v = _qkv(1, 2, 2, 300, 300, head_dim, 24)
    dout = torch.randn_like(q)
    got = _flex_grads(_flex_call(flex.softcap(10.0), hides_rows), q, k, v, dout)
    assert torch.all(got[1][:, :, 100:200] == 0)
    _check_grads(got, q, k, v, dout, flex.softcap(10.0), hides_rows, "fully masked rows")


@gpu
def test_flex_backward_user_derivative():
    """A user's score mod with its derivative: a function that reads a captured tensor of its own
    (score * w[h]); without a derivative the backward refuses it, by name."""
    w = torch.rand(4, device="cuda") + 0.5

    def weighted(score, b, h, q_idx, kv_idx):
        return score * w[h]

    def weighted_grad(out, b, h, q_idx, kv_idx):
        return w[h] + 0.0
    q, k, v = _qkv(2, 4, 4, 333, 333, 128, 25)
    dout = torch.randn_like(q)
    qg = q.detach().clone().requires_grad_()
    out = fa3.flex_attention(qg, k, v, score_mod=weighted)
    with pytest.raises(NotImplementedError, match=r"weighted has no derivative.*score_mod_grad"):
        out.backward(dout)
    weighted.score_mod_grad = weighted_grad
    got = _flex_grads(_flex_call(weighted, None), q, k, v, dout)
    _check_grads(got, q, k, v, dout, weighted, None, "score * w[h]")
    weighted.score_mod_grad = 1.0  # a wrong (constant) derivative must show in dq and dk
    wrong = _flex_grads(_flex_call(weighted, None), q, k, v, dout)
    assert rel_err(wrong[1], got[1]) > 0.05 and rel_err(wrong[3], got[3]) < 1e-3  # dV takes no dS


@gpu
def test_block_sparse_backward_alibi_documents_gqa():
    """flex_attention(block_mask=) with gradients: both passes skip the BlockMask's empty blocks
    (documents, ALiBi, 8 query heads over 2), against the reference of its mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 700
    mask_mod = flex.document(_random_documents(2, seqlen, 5, 26))
    score_mod = flex.alibi(flex.alibi_slopes(8, "cuda"))
    block = create_block_mask(mask_mod, 2, None, seqlen, seqlen, device="cuda")
    q, k, v = _qkv(2, 8, 2, seqlen, seqlen, 128, 26)
    dout = torch.randn_like(q)
    got = _flex_grads(lambda q, k, v: fa3.flex_attention(q, k, v, score_mod=score_mod, block_mask=block,
                                                         enable_gqa=True), q, k, v, dout)
    _check_grads(got, q, k, v, dout, score_mod, mask_mod, "block mask, GQA")
    with torch.no_grad():  # the forward without gradients is the same kernel
        sparse = fa3.flex_attention(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True)
    torch.testing.assert_close(sparse, got[0], atol=1e-2, rtol=1e-2)


@gpu
def test_flex_backward_deterministic():
    """deterministic=True with mods: the same bits twice (b2's ordered dQ at d128)."""
    q, k, v = _qkv(2, 4, 2, 500, 500, 128, 27)
    dout = torch.randn_like(q)
    call = _flex_call(flex.softcap(15.0), flex.sliding_window(128), deterministic=True)
    first, again = _flex_grads(call, q, k, v, dout), _flex_grads(call, q, k, v, dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    _check_grads(first, q, k, v, dout, flex.softcap(15.0), flex.sliding_window(128), "deterministic")



# ----------------------------------------------------------------------------- GPU: block-sparse backward
def _check_block_grads(q, k, v, block_mask, name, score_mod=None):
    """fa3.flex_attention's (out, dq, dk, dv) with `block_mask` (the block-sparse forward and
    backward) against the float64 reference of torch's BlockMask semantics (block_semantics), the
    gradients' memory poisoned with NaN first."""
    dout = torch.randn_like(q)
    got = _flex_grads(lambda q, k, v: fa3.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                         enable_gqa=True), q, k, v, dout)
    _check_grads(got, q, k, v, dout, score_mod, block_semantics(block_mask, q.shape[0], q.shape[1]), name)
    return got


@gpu
@pytest.mark.parametrize("head_dim", [128, 96, 64], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("full_blocks", [True, False], ids=["full", "partial_only"])
def test_block_sparse_backward_causal(head_dim, full_blocks):
    """A causal BlockMask (partial diagonal blocks, full blocks below), or the same blocks all
    listed as partial ones; seqlen 1030: the last block holds 6 rows, its second 64-row Q tile lies
    wholly past seqlen_q (visited on the padding, adding nothing)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 1030
    q, k, v = _qkv(2, 4, 4, seqlen, seqlen, head_dim, 30)
    block = create_block_mask(flex.causal, None, None, seqlen, seqlen, device="cuda")
    if not full_blocks:
        block = without_full_blocks(block)
    _check_block_grads(q, k, v, block, f"causal d{head_dim} {'full' if full_blocks else 'partial only'}")


@gpu
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
def test_block_sparse_backward_documents(head_dim):
    """Ragged documents (B=2 masks, H broadcast), seqlen 1100, ALiBi on every listed block, with
    and without full lists."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 1100
    q, k, v = _qkv(2, 4, 4, seqlen, seqlen, head_dim, 31)
    block = create_block_mask(flex.document(_random_documents(2, seqlen, 6, 32)), 2, None, seqlen, seqlen,
                              device="cuda")
    score_mod = flex.alibi(flex.alibi_slopes(4, "cuda"))
    _check_block_grads(q, k, v, block, f"documents d{head_dim}", score_mod)
    _check_block_grads(q, k, v, without_full_blocks(block), f"documents d{head_dim}, no full lists", score_mod)


@gpu
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
def test_block_sparse_backward_empty_tiles(head_dim):
    """Q blocks 1 and 2 see no key (empty Q tiles: dq = 0) and K/V blocks 4 and 5 are seen by no
    query (empty K/V tiles: dk = dv = 0 written, no NaN); seqlen 1000."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = 1000

    def holes(b, h, q_idx, kv_idx):
        return ((q_idx < 128) | (q_idx >= 384)) & (kv_idx <= q_idx) & ((kv_idx < 512) | (kv_idx >= 768))
    q, k, v = _qkv(2, 4, 4, seqlen, seqlen, head_dim, 33)
    block = create_block_mask(holes, None, None, seqlen, seqlen, device="cuda")
    assert not block.q_num_blocks[..., 4:6].any() and not block.full_q_num_blocks[..., 4:6].any()
    _, dq, dk, dv = _check_block_grads(q, k, v, block, f"empty tiles d{head_dim}")
    assert torch.all(dq[:, :, 128:384] == 0)
    assert torch.all(dk[:, :, 512:768] == 0) and torch.all(dv[:, :, 512:768] == 0)


@gpu
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
def test_block_sparse_backward_gqa_per_head(head_dim):
    """8 query heads over 2 KV heads, a BlockMask per (batch, query head) (each head's window),
    seqlen_q 1000 and seqlen_kv 1337 (neither a multiple of 128, and apart), with and without full
    lists: the K/V heads' dk, dv summed over their query heads' walks."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen_q, seqlen_kv = 1000, 1337

    def per_head_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 337) & (q_idx + 337 - kv_idx <= 96 * (h + 1) + 40 * b)
    q, k, v = _qkv(2, 8, 2, seqlen_q, seqlen_kv, head_dim, 34)
    block = create_block_mask(per_head_window, 2, 8, seqlen_q, seqlen_kv, device="cuda")
    _check_block_grads(q, k, v, block, f"GQA per-head windows d{head_dim}")
    _check_block_grads(q, k, v, without_full_blocks(block), f"GQA per-head windows d{head_dim}, no full lists")


@gpu
def test_block_sparse_backward_lists_alone():
    """A BlockMask without a mask_mod (the lists decide: block-level attention over exactly the
    listed blocks, in no particular order), and full blocks never running the mask_mod (one that
    hides everything, every block full: the dense gradients)."""
    q, k, v = _qkv(2, 4, 4, 1000, 1000, 128, 35)
    sparse, full = _lists_alone_masks(1000, shifted_first=True)
    _check_block_grads(q, k, v, sparse, "lists alone")
    _check_block_grads(q, k, v, full, "full blocks skip the mask_mod")  # (the reference: dense attention)
