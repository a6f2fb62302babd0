"""CPU tests: every rung of the registry compiles for sm_90a and emits the PTX it promises.

No GPU is needed: the DSL compiles against fake tensors with symbolic shapes. Attention rungs are
compiled at head_dim 128 causal, and at 64 and 256 non-causal where the rung supports them, and
each family's default rung at 96 (causal) and 192; GEMM rungs with their family's defaults. ptxas' registers and spills are printed for each.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import fa3.__main__ as cli
from fa3.compile import builders as _compile, kvcache as _compile_kvcache, dsl as _dsl
from fa3 import matmul, registry
from fa3.cache import split_plan
from fa3.kernels import config

cli.prepare_dsl_env()  # before the first compile imports cutlass: sm_90a, no PTX files in the cwd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_cases():
    for name, spec in registry.KERNELS.items():
        if spec.family not in cli.HEAD_DIM_FAMILIES:
            yield pytest.param(name, None, False, id=name)
            continue
        main = 128 if 128 in spec.head_dims else spec.head_dims[0]
        yield pytest.param(name, main, True, id=f"{name}-d{main}-causal")
        for d in (64, 256):
            if d in spec.head_dims and d != main:
                yield pytest.param(name, d, False, id=f"{name}-d{d}")
        # d96 (64-byte swizzle) and d192 (tiles of their own): the rung each family defaults to
        for d in (96, 192):
            if d in spec.head_dims and registry.fastest(spec.family, d).name == name:
                yield pytest.param(name, d, d == 96, id=f"{name}-d{d}{'-causal' if d == 96 else ''}")


@pytest.mark.parametrize("name, head_dim, causal", list(compile_cases()))
def test_compiles_with_promised_ptx(name, head_dim, causal, capsys):
    spec = registry.get(name)
    result = cli.compile_rung(spec, torch.bfloat16, head_dim, causal)
    with capsys.disabled():
        print(f"\n  {result.line()}", end="")
    ptx = result.report.ptx
    assert f".target {_dsl.TARGET_ARCH}" in ptx
    assert len(result.report.cubin) > 0
    assert result.report.registers, "ptxas reported no register counts"
    for promise in spec.ptx_promises:
        assert promise in ptx, f"{name}: promised {promise!r} is not in the PTX"
    for forbidden in spec.ptx_forbids:
        assert forbidden not in ptx, f"{name}: forbidden {forbidden!r} is in the PTX"
    if spec.family == registry.BACKWARD or head_dim in (96, 192):  # (backward: five accumulators)
        assert result.report.spill_bytes == 0, f"{name}: ptxas spills ({result.resources()})"
    assert not result.report.serialized_wgmma, f"{name}: ptxas serialized the WGMMAs (C7512: registers)"


@pytest.mark.parametrize("name", registry.available_kernels(registry.BACKWARD))
def test_backward_deterministic_variant_compiles(name):
    """deterministic=True adds the ordered dQ accumulation: an acquire spin and a release count."""
    spec = registry.get(name)
    head_dim = 64 if 64 in spec.head_dims else min(spec.head_dims)  # a head dim the rung serves
    # (b8, d64 on 128-row tiles, spills 124 B with GQA here: kernel=None sends deterministic calls
    # to b2)
    report = _compile.compile_report(spec, torch.bfloat16, head_dim=head_dim, causal=True,
                                     deterministic=True, gqa=name != "b8")
    assert "ld.acquire.gpu.global" in report.ptx and "atom.global.release" in report.ptx
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("name, static, promises", [
    ("k5.5", dict(head_dim=128, causal=True, varlen=True), ("vote.sync.ballot",)),  # tile search
    ("k5.5", dict(head_dim=128, causal=False, softcap=True), ("tanh.approx.f32",)),
    ("k5.5", dict(head_dim=64, causal=False, local=True), ("wgmma.mma_async",)),
    ("f1", dict(head_dim=128, causal=False, softcap=True), ("tanh.approx.f32", ".e4m3.e4m3")),
    ("f1", dict(head_dim=64, causal=True, local=True), (".e4m3.e4m3",)),
    ("s1", dict(head_dim=128, causal=True, paged=True, local=True, softcap=True), ("tanh.approx.f32",)),
    # pages that do not hold whole key blocks: cp.async row gathers completing on the ring's mbarriers
    *[("s1", dict(head_dim=d, causal=True, paged=True, gather=True), ("cp.async.cg.shared.global",
                                                                      "cp.async.mbarrier.arrive.noinc"))
      for d in (64, 128, 256)],
    ("s1", dict(head_dim=128, causal=True, paged=True, gather=True, varlen=True, local=True, softcap=True),
     ("cp.async.mbarrier.arrive.noinc", "tanh.approx.f32")),
    ("s1", dict(head_dim=128, causal=True, paged=True, varlen=True), ("cp.async.bulk.tensor",)),
    ("s1", dict(head_dim=64, causal=False, paged=False, varlen=True), ("cp.async.bulk.tensor",)),
    ("s1", dict(head_dim=128, causal=True, leftpad=True, local=True), ("cp.async.bulk.tensor",)),
    ("b2", dict(head_dim=128, causal=False, local=True, softcap=True), ("tanh.approx.f32", "lg2.approx")),
    ("b1", dict(head_dim=128, causal=False, local=True, softcap=True), ("tanh.approx.f32", "lg2.approx")),
    # packed batches: dQ in fragment order too, each entry's Q tiles in whole-tile slots
    *[(name, dict(head_dim=128, causal=True, varlen=True, deterministic=True),
       ("vote.sync.ballot", "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"))
      for name in ("b2", "b3", "b4", "b7")],
    ("b8", dict(head_dim=64, causal=False, varlen=True, gqa=True), ("vote.sync.ballot",)),
    ("b3", dict(head_dim=128, causal=False, local=True, gqa=True), ("shfl.sync.idx",)),
    ("b1", dict(head_dim=64, causal=True, varlen=True, gqa=True), ("vote.sync.ballot",)),
    # attention sinks: one more exp2 and a max per row in the epilogue, nothing in the mainloop
    ("k5.5", dict(head_dim=128, causal=True, sinks=True), ("lg2.approx",)),
    ("k5.5", dict(head_dim=64, causal=False, varlen=True, local=True, sinks=True), ("vote.sync.ballot",)),
    ("s1", dict(head_dim=128, causal=True, paged=True, sinks=True), ("lg2.approx",)),
    # a serving engine's call on gpt-oss-like and d96/d192 models: packed queries, row gathers, sinks
    *[("s1", dict(head_dim=d, causal=True, paged=True, gather=True, varlen=True, sinks=True),
       ("cp.async.mbarrier.arrive.noinc", "lg2.approx")) for d in (64, 96, 192)],
    # d96 on 192-row tiles with every variant, and on the short-query tiles
    ("k5.5", dict(head_dim=96, causal=False, varlen=True, softcap=True, sinks=True), ("vote.sync.ballot", "tanh.approx.f32")),
    ("k5.5", dict(head_dim=96, causal=True, short=True), ("wgmma.mma_async",)),
    # d192 packed batches (80-wide K/V tiles: 96 spill); d96 deterministic GQA packed backward
    ("k5.5", dict(head_dim=192, causal=True, varlen=True, sinks=True), ("vote.sync.ballot",)),
    ("b2", dict(head_dim=96, causal=True, deterministic=True, gqa=True, varlen=True), ("st.shared.v4.b32",)),
    # v's head dim other than q/k's: (192, 128) on 128-wide K/V tiles, (128, 64)
    ("k5.5", dict(head_dim=192, head_dim_v=128, causal=True), ("wgmma.mma_async",)),
    ("k5.5", dict(head_dim=128, head_dim_v=64, causal=False, varlen=True), ("vote.sync.ballot",)),
    # and its backward: b9 at (192, 128) (dV^T's MMA splits d, dK^T's the keys), b2 at (128, 64),
    # deterministic GQA (FP32 slices of v's width) and packed with GQA (bulk row adds)
    ("b9", dict(head_dim=192, head_dim_v=128, causal=True), ("stmatrix.sync.aligned.m8n8.x4.trans",)),
    ("b9", dict(head_dim=192, head_dim_v=128, causal=False, deterministic=True, gqa=True), ("wgmma.mma_async",)),
    ("b2", dict(head_dim=128, head_dim_v=64, causal=False, gqa=True, varlen=True), ("cp.reduce.async.bulk",)),
    ("b2", dict(head_dim=192, head_dim_v=128, causal=True, deterministic=True), ("wgmma.mma_async",)),
    # (128, 64) on b7 (its default); b4 prepared, not listed in its value_head_dims (not GPU-run)
    ("b7", dict(head_dim=128, head_dim_v=64, causal=True), ("wgmma.mma_async",)),
    ("b4", dict(head_dim=128, head_dim_v=64, causal=False, gqa=True, varlen=True), ("cp.reduce.async.bulk",)),
    # FP8 packed batches (V^T read from each entry's own 16-aligned column)
    ("f1", dict(head_dim=128, causal=True, varlen=True), (".e4m3.e4m3", "vote.sync.ballot")),
    ("f1", dict(head_dim=256, causal=False, varlen=True, local=True), (".e4m3.e4m3", "vote.sync.ballot")),
    ("f2", dict(head_dim=128, causal=True, varlen=True), (".e4m3.e4m3", "ldmatrix.sync.aligned.m8n8.x4.trans")),
    ("f2", dict(head_dim=256, causal=False, varlen=True, local=True), (".e4m3.e4m3", "stmatrix.sync.aligned")),
    ("f2", dict(head_dim=64, causal=True, local=True, softcap=True), (".e4m3.e4m3", "tanh.approx.f32")),
])
def test_variants_compile(name, static, promises):
    """The variants (varlen, sliding window, softcap; forward and backward) compile for sm_90a
    without spilling."""
    report = _compile.compile_report(registry.get(name), torch.bfloat16, **static)
    for promise in promises:
        assert promise in report.ptx, f"{name} {static}: {promise!r} missing"
    assert report.spill_bytes == 0, f"{name} {static} spills"
    assert not report.serialized_wgmma, f"{name} {static}: ptxas serialized the WGMMAs (C7512)"


@pytest.mark.parametrize("head_dim, causal, paged, page_rows", [(128, True, True, 16), (128, False, False, 0),
                                                              (256, True, True, 0), (96, True, True, 16)])
def test_cache_prefill_compiles(head_dim, causal, paged, page_rows):
    """K5 over a KV cache (a serving step's prompt chunks): a TMA box per page or per key block,
    no spills, WGMMAs not serialized."""
    spec = registry.get(split_plan.PREFILL_RUNG)
    report = _compile.build_report(_compile_kvcache.build_cache_prefill, spec, torch.bfloat16, head_dim, causal, paged,
                                   page_rows, 128)
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in report.ptx and "setmaxnreg" in report.ptx
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("tile_m, tile_n, a_rows", [(*tiles, ()) for tiles in matmul.PERSISTENT_TILES[1:]]
                         + [(64, 64, matmul.a_box_rows(1, "row"))])
def test_persistent_gemm_tile_shapes_compile(tile_m, tile_n, a_rows):
    """The tile shapes fa3.gemm picks per problem (and the short A box of M <= 32) compile for
    sm_90a with the rung's PTX, no spills."""
    spec = registry.get("g3")
    tiles = matmul.tile_overrides(tile_m, tile_n) + a_rows
    report = _compile.compile_report(spec, torch.bfloat16, tiles=tiles)
    for promise in spec.ptx_promises:
        assert promise in report.ptx, f"{tile_m}x{tile_n}: {promise!r} missing"
    assert report.spill_bytes == 0, f"{tile_m}x{tile_n} spills"


@pytest.mark.parametrize("name, row_scales", [(n, False) for n in registry.available_kernels(registry.GEMM)]
                         + [("g3", True)])
def test_fp8_gemm_compiles(name, row_scales):
    """Every GEMM rung on e4m3 operands (K-major, bf16 C), and the default's row-wise scales: FP8
    WGMMA in the PTX, no spills, no serialized WGMMAs."""
    report = _compile.compile_report(registry.get(name), torch.float8_e4m3fn, a_layout="row", b_layout="col",
                                     out_dtype=torch.bfloat16, row_scales=row_scales)
    assert "wgmma.mma_async" in report.ptx and ".e4m3.e4m3" in report.ptx
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("max_queries", [0, 128])
def test_sinks_combine_compiles(max_queries):
    """The split-KV combine with the sinks as one more term compiles without spilling; with
    max_queries it finds each row's entry (a warp ballot over cu_seqlens_q) to skip K5's rows."""
    report = _compile.build_report(_compile_kvcache.build_combine, torch.bfloat16, 128, sinks=True, max_queries=max_queries)
    assert "ex2.approx" in report.ptx and report.registers and report.spill_bytes == 0
    assert ("vote.sync.ballot" in report.ptx) == bool(max_queries)


@pytest.mark.parametrize("name,paged,sinks", [("s1", False, False), ("s2", True, True)])
def test_split_decode_compiles_with_its_combine(name, paged, sinks):
    """A split call's decode kernel and the combine in one compiled call (kernels/combine.py
    SplitKVWithCombine): both kernels in the module, the decode kernel's PTX as when it is compiled
    alone but for letting its dependent launch (griddepcontrol.launch_dependents), the combine
    waiting for its grid (griddepcontrol.wait), no spills."""
    spec = registry.get(name)
    alone = _compile.build_report(_compile_kvcache.build_kvcache, spec, torch.bfloat16, 128, True, paged=paged,
                                  sinks=sinks)
    both = _compile.build_report(_compile_kvcache.build_kvcache, spec, torch.bfloat16, 128, True, paged=paged,
                                 sinks=sinks, with_combine=True)
    entries = lambda ptx: {part.split("(")[0].split("_object")[0].split()[-1]: "\n".join(part.splitlines()[1:])
                           for part in ptx.split(".visible .entry ")[1:]}
    alone_entries, both_entries = entries(alone.ptx), entries(both.ptx)
    assert len(alone_entries) == 1 and len(both_entries) == 2
    assert any("SplitKVCombine" in name for name in both_entries)
    (decode_name, decode_body), = alone_entries.items()
    (combine_body,) = (body for name, body in both_entries.items() if "SplitKVCombine" in name)
    body = lambda text: text.split("// .globl")[0].rstrip()
    with_combine = body(both_entries[decode_name])
    trigger = "\t// begin inline asm\n\tgriddepcontrol.launch_dependents;\n\t// end inline asm\n"
    assert with_combine.count(trigger) == 1 and "griddepcontrol" not in decode_body
    assert "griddepcontrol.wait" in combine_body
    assert with_combine.replace(trigger, "") == body(decode_body)
    assert both.spill_bytes == 0


def test_mla_compiles_with_its_combine():
    """A split MLA call's M1 and its combine (at the latent's 512 columns) in one compiled call."""
    from fa3.compile import mla as compile_mla

    report = _compile.build_report(compile_mla.build_mla, registry.get("m1"), torch.bfloat16, with_combine=True)
    entries = report.ptx.split(".visible .entry ")[1:]
    assert len(entries) == 2 and any("SplitKVCombine" in e.split("(")[0] for e in entries)
    assert "griddepcontrol.launch_dependents" in report.ptx and "griddepcontrol.wait" in report.ptx
    assert report.spill_bytes == 0


def test_mla_dense_non_causal_compiles():
    """M1 (MLA decode) on a dense cache without the causal mask (the registry row compiles it paged
    and causal): S (m64n64k16, 36 k-steps over q and qv) and P V (m64n256k16, a warpgroup's half of
    O) on WGMMA, P through SMEM (stmatrix, handed over on an mbarrier pair, no named barrier's
    bar.arrive), no spills, WGMMAs not serialized. The row factors and the epilogue's 1/l go on
    that pair too: the only CTA barriers are the barriers' setup and Q's load (racecheck did not
    see the epilogue's two order 1/l after warpgroup 0's own 128-thread barrier)."""
    report = _compile.compile_report(registry.get("m1"), torch.bfloat16, causal=False, paged=False)
    assert "m64n64k16" in report.ptx and "m64n256k16" in report.ptx and "stmatrix" in report.ptx
    assert "mbarrier.arrive.shared" in report.ptx and "bar.arrive" not in report.ptx
    assert len(re.findall(r"\b(?:bar|barrier)\.sync(?:\.aligned)?\s+0;", report.ptx)) == 2
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("causal, gather, varlen", [(True, True, False), (False, True, False), (True, True, True),
                                                    (False, False, True), (True, False, True)],
                         ids=["gather-causal", "gather", "gather-varlen-causal", "paged-varlen", "paged-varlen-causal"])
def test_mla_gathers_and_packed_entries_compile(causal, gather, varlen):
    """M1 on pages of any size (gather: warpgroup 1's threads copy the key block's rows with cp.async,
    completing on the ring's full barrier through cp.async.mbarrier.arrive.noinc, no TMA) and over
    packed entries of different lengths (varlen: each CTA finds its entry with a warp scan over
    cu_seqlens_q): no spills, WGMMAs not serialized."""
    report = _compile.compile_report(registry.get("m1"), torch.bfloat16, causal=causal, paged=True, gather=gather,
                                     varlen=varlen)
    assert "m64n64k16" in report.ptx and "m64n256k16" in report.ptx
    assert ("cp.async.mbarrier.arrive.noinc" in report.ptx) == gather
    assert ("cp.async.bulk.tensor" in report.ptx) != gather
    assert ("shfl.sync.up" in report.ptx) == varlen
    assert report.spill_bytes == 0 and not report.serialized_wgmma


def test_combine_takes_the_latent_width():
    """The split-KV combine at MLA's 512-wide O rows: four warps a row, 128 columns each, sixteen
    splits' columns in flight a lane (64 registers of partials, as at d <= 256), no spills; rows up
    to 256 wide stay one warp's."""
    from fa3.kernels.combine import SplitKVCombine

    wide, narrow = SplitKVCombine(None, 512), SplitKVCombine(None, 256)
    assert (wide.slices, wide.columns, wide.chunk) == (4, 128, 16) and (narrow.slices, narrow.chunk) == (1, 8)
    report = _compile.build_report(_compile_kvcache.build_combine, torch.bfloat16, 512)
    assert "ex2.approx" in report.ptx and report.registers and report.spill_bytes == 0
    # each lane's loads of one chunk: 16 splits x 4 columns, issued together
    assert report.ptx.count("ld.global") >= 16 * 4


def test_entry_order_compiles():
    """The KV-cache entries' sort (kernels/entry_order.py): a histogram of shared atomics, a scan,
    one slot per entry, in one CTA."""
    report = _compile.build_report(_compile_kvcache.build_entry_order)
    assert "atom.shared" in report.ptx and "shfl.sync.up" in report.ptx and report.spill_bytes == 0


@pytest.mark.parametrize("head_dim,head_dim_v,layout", [(64, None, ()), (96, None, ()), (256, None, ()),
                                                        (192, 128, ()), (64, None, (True, 128, True)),
                                                        (256, None, (True, 64, True)), (128, None, (True, 64, False))],
                         ids=["d64", "d96", "d256", "d192-128", "d64-slots", "d256-slots", "d128-slots-packed-dq"])
def test_backward_preprocess_compiles(head_dim, head_dim_v, layout):
    """The backward's preprocess reads O and dO (head_dim_v wide) and zeroes the dQ accumulator
    (head_dim wide) in 16-byte vectors (no 16-bit loads), without spilling; packed batches too
    (statistics, and in fragment order dQ, in whole-tile slots: each CTA finds its Q tile's entry
    with warp shuffles)."""
    report = _compile.build_report(_compile._build_preprocess, torch.bfloat16, head_dim, head_dim_v, *layout)
    assert report.ptx.count("ld.global.v4") == 8 and "st.global.v4" in report.ptx
    assert ("shfl.sync.up" in report.ptx) == bool(layout)
    assert "ld.global.b16" not in report.ptx and "ld.global.u16" not in report.ptx
    assert report.registers and report.spill_bytes == 0


@pytest.mark.parametrize("name,head_dim,varlen", [("b2", 64, False), ("b2", 192, False), ("b2", 256, True),
                                                  ("b3", 96, False), ("b4", 96, True), ("b6", 128, False), ("b8", 64, True),
                                                  ("b7", 128, False), ("b7", 128, True)])
def test_fragment_dq_postprocess_compiles(name, head_dim, varlen):
    """The postprocess of each rung's fragment-order dQ (and of a packed batch's): 16-byte loads of
    the accumulator and 16-byte stores of dQ, no spills."""
    report = _compile.build_report(_compile._build_postprocess, registry.get(name), torch.bfloat16, head_dim, varlen)
    assert "ld.global.v4" in report.ptx and "st.global.v4" in report.ptx
    # 32-bit loads: only cu_seqlens_q's (the tile search and the entry's span), when packed
    assert report.ptx.count("ld.global.b32") == (4 if varlen else 0)
    assert report.registers and report.spill_bytes == 0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_value_transpose_compiles(head_dim, packed):
    """The FP8 forward's V^T kernel (and its packed-batch variant): 16-byte stores (st.global.v4),
    32-bit loads, no spills."""
    report = _compile.build_report(_compile._build_value_transpose, head_dim, packed)
    assert report.ptx.count("st.global.v4") == 4 and "ld.global.u8" not in report.ptx
    assert report.registers and report.spill_bytes == 0


def test_sinks_are_in_the_compile_keys():
    spec = registry.get("k5.5")
    assert _compile.attention_key(spec, torch.bfloat16, 128, True) != \
        _compile.attention_key(spec, torch.bfloat16, 128, True, sinks=True)
    s1 = registry.get("s1")
    assert _compile_kvcache.kvcache_key(s1, torch.bfloat16, 128, True) != \
        _compile_kvcache.kvcache_key(s1, torch.bfloat16, 128, True, sinks=True)


def test_short_queries_pick_their_tiles():
    """d96 on k5.5: 192 x 112 tiles (96-wide causal) from 2k query rows (4k causal), d128's 128 x
    128 below; d64 causal 128-row tiles under 2k rows; unknown lengths (a packed batch without
    max_seqlen_q) take the long tiles; the two are separate compile-cache entries; d128-d256 have
    no rule."""
    spec = registry.get("k5.5")
    tiles = lambda d, short=False, causal=False: config.forward_config(spec.config, d, causal=causal,
                                                                       short=short)
    assert (tiles(96).tile_m, tiles(96).tile_n) == (192, 112) and tiles(96, causal=True).tile_n == 96
    assert (tiles(96, short=True).tile_m, tiles(96, short=True).tile_n) == (128, 128)
    rules = spec.config
    assert rules.is_short(96, None, False, 2047) and not rules.is_short(96, None, False, 2048)
    assert rules.is_short(96, None, True, 4095) and not rules.is_short(96, None, True, 4096)
    assert not rules.is_short(96, None, False, None)
    assert rules.is_short(64, None, True, 2047) and not rules.is_short(64, None, True, 2048)
    assert not rules.is_short(64, None, False, 1) and tiles(64, short=True).tile_m == 128
    assert not any(rules.is_short(d, None, c, 1) for d in (128, 192, 256) for c in (False, True))
    assert tiles(128, short=True) == tiles(128)
    assert _compile.attention_key(spec, torch.bfloat16, 96, False) != \
        _compile.attention_key(spec, torch.bfloat16, 96, False, short=True)


def test_attention_key_covers_static_configuration():
    rungs = [registry.get(n) for n in registry.available_kernels(registry.ATTENTION)]
    spec = rungs[0]
    base = _compile.attention_key(spec, torch.bfloat16, 128, False)
    assert base == _compile.attention_key(spec, torch.bfloat16, 128, False)
    variants = [
        _compile.attention_key(spec, torch.float16, 128, False),
        _compile.attention_key(spec, torch.bfloat16, 64, False),
        _compile.attention_key(spec, torch.bfloat16, 128, True),
    ] + [_compile.attention_key(other, torch.bfloat16, 128, False) for other in rungs[1:]]
    keys = [base] + variants
    assert len(set(keys)) == len(keys), "two static configurations share a compile-cache key"
    for key in keys:
        hash(key)


def _python(*args, cwd=None, timeout=300):
    """A fresh interpreter that finds this source tree, without the DSL settings of this one:
    the code under test must make them itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUTE_DSL_ARCH", "CUTE_DSL_DUMP_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _run_cli(*args, tmp_path):
    return _python("-m", "fa3", *args, cwd=tmp_path)


def test_cli_compile(tmp_path):
    name = registry.available_kernels(registry.ATTENTION)[0]
    out = tmp_path / "out"
    proc = _run_cli("compile", "--kernel", name, "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ptx, cubin = out / f"{name}.ptx", out / f"{name}.cubin"
    assert ptx.stat().st_size > 0 and cubin.stat().st_size > 0
    assert f".target {_dsl.TARGET_ARCH}" in ptx.read_text()
    assert "registers" in proc.stdout and "PTX promises ok" in proc.stdout
    for promise in registry.get(name).ptx_promises:
        assert f"{promise!r}: present" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the compile left files in the cwd"


def test_cli_rejects_unknown_kernel(tmp_path):
    proc = _run_cli("compile", "--kernel", "no-such-rung", "--out", str(tmp_path), tmp_path=tmp_path)
    assert proc.returncode != 0
    assert "--kernel" in proc.stderr and all(n in proc.stderr for n in registry.available_kernels())


def test_importing_fa3_does_not_import_cutlass():
    """CUTE_DSL_ARCH only works if it is set before cutlass is imported."""
    code = "import sys, fa3, fa3.__main__; assert 'cutlass' not in sys.modules, 'cutlass imported'"
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name,head_dim", [("b2", 64), ("b2", 256), ("b7", 128), ("b9", 192), ("b9", 256)])
def test_gqa_dkv_bulk_add_compiles(name, head_dim):
    """The GQA dK/dV path by bulk reduce-adds of SMEM rows (`dkv_bulk_add`, on from B2): no scalar
    atomics left, dK and dV one bulk reduce-add each, no spills."""
    spec = registry.get(name)
    assert spec.load_class().dkv_bulk_add
    report = _compile.compile_report(spec, torch.bfloat16, head_dim=head_dim, causal=True, gqa=True)
    assert "red.global" not in report.ptx
    assert report.ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") >= 3
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("causal", [False, True])
def test_wide_d64_rung_fits(causal):
    """b8: b4 on 128 x 128 tiles at d64, fitting by dS^T from the rounded P^T and one dQ buffer a
    warpgroup: no spills, no serialized WGMMAs, 16-byte dQ stores and one bulk reduce-add a
    warpgroup (two a Q tile); dS^T multiplied in 16-bit pairs (P^T never widened back), except
    with capped scores."""
    spec = registry.get("b8")
    report = _compile.compile_report(spec, torch.bfloat16, head_dim=64, causal=causal)
    assert report.ptx.count("st.shared.v4") == 8
    assert report.ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert report.ptx.count("mul.rn.bf16x2") == 32 and "cvt.f32.bf16" not in report.ptx
    assert report.spill_bytes == 0 and not report.serialized_wgmma
    if not causal:
        report = _compile.compile_report(spec, torch.bfloat16, head_dim=64, causal=False, softcap=True)
        assert "mul.rn.bf16x2" not in report.ptx and "tanh.approx.f32" in report.ptx
        assert report.spill_bytes == 0 and not report.serialized_wgmma


def _variant_report(text: str, head_dim: int, causal: bool):
    """The compile report of an experiment row (benchmarks/variants.py, NAME=BASE:key=value,...),
    registered for this call only."""
    benchmarks = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import variants

    try:
        spec = variants.register(text)
        return _compile.compile_report(spec, torch.bfloat16, head_dim=head_dim, causal=causal)
    finally:
        registry.KERNELS.pop(text.split("=", 1)[0], None)


def test_ds_in_pairs_compiles_on_the_row_rungs():
    """Prepared for a GPU run (worklog/backward.md): b9 with dS from the rounded P's pairs
    (`ds_in_pairs`, b8's on S^T; here dS's rows share D), as the experiment row the worklog gives:
    one mul.rn.bf16x2 a pair, no spills."""
    report = _variant_report("b9x=b9:ds_in_pairs=1", 192, causal=True)
    assert report.ptx.count("mul.rn.bf16x2") == 12  # 64 x 96 scores: 24 a thread, in pairs
    assert report.spill_bytes == 0 and not report.serialized_wgmma


def test_stat_group_compiles_on_b8():
    """Prepared for a GPU run (worklog/backward.md): b8 with the LSE of 16 columns read ahead of
    their exp2s (`stat_group`), measured 0 to +3%, as the experiment row the worklog gives: no
    spills, WGMMAs not serialized, the same SMEM reads as b8."""
    grouped = _variant_report("b8g16=b8:stat_group=16", 64, causal=True)
    plain = _compile.compile_report(registry.get("b8"), torch.bfloat16, head_dim=64, causal=True)
    assert grouped.spill_bytes == 0 and not grouped.serialized_wgmma
    assert grouped.ptx.count("ld.shared") == plain.ptx.count("ld.shared")


@pytest.mark.parametrize("head_dim,head_dim_v,deterministic", [(192, None, False), (256, None, False),
                                                            (192, 128, False), (192, None, True)])
def test_b9_dq_turns_are_mbarriers(head_dim, head_dim_v, deterministic):
    """b9's warpgroups take the one-share dQ buffer in turns through mbarriers (racecheck orders
    those), not named barriers: no `bar.sync`/`bar.arrive` on B2's dQ barrier ids (2-5)."""
    import re

    value = {"head_dim_v": head_dim_v} if head_dim_v else {}
    report = _compile.compile_report(registry.get("b9"), torch.bfloat16, head_dim=head_dim, causal=False,
                                     deterministic=deterministic, **value)
    assert not re.search(r"\bbar\.(sync|arrive)\s+[2-5],", report.ptx)
    assert report.ptx.count("mbarrier.try_wait.parity") >= 4  # Q ring, K/V, and the two turns
    assert report.spill_bytes == 0 and not report.serialized_wgmma


@pytest.mark.parametrize("causal", [False, True])
def test_dq_counters_only_in_ordered_walks(causal):
    """The dQ counters (mLock) exist only where dQ is ordered (an unordered call passes a
    one-element stand-in): b2 unordered bumps no counter (no release atomics in its PTX), ordered
    it does, and the late bump (`defers_dq_bump`) is only ever taken by ordered walks, never by
    ones of K/V tiles that span a single Q tile (worklog/backward.md)."""
    spec = registry.get("b2")
    for deterministic in (False, True):
        report = _compile.compile_report(spec, torch.bfloat16, head_dim=128, causal=causal,
                                         deterministic=deterministic)
        assert ("atom.global.release.add" in report.ptx) == deterministic
    cls, dtype = spec.load_class(), _dsl.import_cute()[0].BFloat16
    for rung in [s for s in registry.KERNELS.values() if s.family == registry.BACKWARD]:
        name = rung.name
        for head_dim in rung.head_dims:
            for deterministic in (False, True):
                kernel = rung.load_class()(dtype=dtype, head_dim=head_dim, causal=causal,
                                           config=config.backward_config(rung.config, head_dim),
                                           deterministic=deterministic)
                if kernel.defers_dq_bump:
                    assert kernel.ordered_dq, (name, head_dim, deterministic)
                    assert kernel.tile_n >= 2 * kernel.tile_m, (name, head_dim)
    b2_d128 = cls(dtype=dtype, head_dim=128, causal=causal, config=config.backward_config(spec.config, 128),
                  deterministic=True)
    assert b2_d128.defers_dq_bump  # (the check above can fail)
