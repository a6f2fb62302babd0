"""CPU tests of the benchmark folder's tools: the profile tools (benchmarks/sass_stalls.py,
sass_waits.py), bench_attention's argument checks, and bench_flex's arguments and FLOP counts."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import pytest  # noqa: E402
import torch  # noqa: E402
import sass_stalls  # noqa: E402
import sass_waits  # noqa: E402

EXPORT = '''"Kernel Name","bwd_a"
"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x00","@!P0 STS.64 [R2], R4","120","4,096"
"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","900","8192"
"0x20","BAR.SYNC.DEFER_BLOCKING 0x1","2000","512"
"0x30","STS.128 [R6], R8","80","1024"

"Kernel Name","bwd_b"
"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x10","LDS.64 R2, [R4]","50","1024"
'''


def test_opcode_drops_predicate_and_modifiers():
    assert sass_stalls.opcode("@!P0 STS.64 [R2], R4") == "STS"
    assert sass_stalls.opcode("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24") == "HGMMA"
    assert sass_stalls.opcode("  ") == ""


def test_tables_split_per_kernel_and_sum_per_opcode(tmp_path, capsys):
    path = tmp_path / "export.csv"
    path.write_text(EXPORT)
    assert sass_stalls.main([str(path)]) == 0
    out = capsys.readouterr().out
    first, second = out.split("bwd_b")
    assert "bwd_a: 4 instructions" in first and "1 instructions" in second
    sts = next(line for line in first.splitlines() if line.startswith("STS"))
    assert "200" in sts and "5120" in sts  # 120 + 80 samples, 4096 + 1024 instructions
    bar = next(line for line in first.splitlines() if line.startswith("BAR"))
    assert bar.endswith("64.5%")  # 2000 of 3100 samples


def test_one_opcode_listed_instruction_by_instruction(tmp_path, capsys):
    """--opcode: each STS with its samples and share, most first, after the instruction before it."""
    path = tmp_path / "export.csv"
    path.write_text(EXPORT)
    assert sass_stalls.main([str(path), "--opcode", "STS", "--context", "1"]) == 0
    first = capsys.readouterr().out.split("bwd_b")[0]
    lines = [line for line in first.splitlines() if "STS" in line and "after" not in line]
    assert "2 STS instructions" in lines[0]
    assert lines[1].split()[:2] == ["120", "3.9%"] and lines[2].split()[:2] == ["80", "2.6%"]
    assert "after: BAR.SYNC.DEFER_BLOCKING 0x1" in first  # the STS.128's predecessor


def test_an_export_without_a_source_table_is_reported(tmp_path, capsys):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Metric Name","Metric Value"\n"0","duration","3.06"\n')
    assert sass_stalls.main([str(path)]) == 1
    assert "no table" in capsys.readouterr().out


# nvdisasm's layout: an address comment, the instruction, a semicolon; labels and blank lines between
SASS = """
        /*0100*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0120*/                   FMNMX R9, R24, R32, !PT ;
        /*0130*/                   FFMA R24, R24, UR9, -R14 ;
        /*0140*/                   MUFU.EX2 R24, R24 ;
.L_x_7:
        /*0150*/              @!P1 FFMA R25, R25, UR9, -R14 ;
        /*0160*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0170*/                   MUFU.EX2 R25, R25 ;
        /*0180*/                   MUFU.RCP R3, R3 ;
        /*0190*/                   MUFU.EX2 R26, R26 ;
        /*01a0*/                   HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR24].tnspB, R88 ;
        /*01b0*/                   MUFU.EX2 R27, R27 ;
        /*01c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
"""


def test_sass_waits_finds_each_overlapped_step(tmp_path, capsys):
    ops = sass_waits.instructions(SASS)
    assert ops[0].startswith("HGMMA") and ops[3] == "FFMA R24, R24, UR9, -R14" and len(ops) == 13
    # the last 0x1 has no 0x0 after it; MUFU.RCP is no exp2; the count after stops at the HGMMA
    assert sass_waits.overlapped_steps(ops) == [
        {"at": 1, "between": 5, "ffma_before": 2, "exp2_before": 1, "exp2_after": 2}]
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    assert sass_waits.main(["--sass", str(path)]) == 0
    assert "5 instructions after the wait for S; before it 2 FFMA and 1 exp2, after it 2 exp2" in capsys.readouterr().out
    path.write_text(SASS.replace("0x0 ;", "0x2 ;"))
    assert sass_waits.main(["--sass", str(path)]) == 1


def test_bench_attention_gqa_groups_must_divide_the_heads(capsys):
    bench_attention = pytest.importorskip("bench_attention")
    assert bench_attention.parse_args(["--backward", "--gqa", "4", "--head-dims", "64,128,256"]).gqa == 4
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--gqa", "3", "--head-dims", "128"])
    assert "16 heads of head dim 128 do not divide into groups of 3" in capsys.readouterr().err


def test_bench_attention_default_column_calls_the_dispatch(monkeypatch):
    """--kernels default times kernel=None / backward_kernel=None (what a user's call runs), at every
    head dim the dispatch serves; other names are still checked against the registry."""
    bench_attention = pytest.importorskip("bench_attention")
    assert bench_attention.parse_args(["--backward", "--kernels", "default,b2"]).kernels == ["default", "b2"]
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--kernels", "defaults"])
    calls = []
    monkeypatch.setattr(bench_attention.fa3, "attention", lambda *a, **kw: calls.append(kw))
    backward = bench_attention.backward_rung_runner("default", deterministic=True)
    assert backward.name == "default+det" and backward.skip(1, 2048, 32, 64) is None
    assert "not supported" in backward.skip(1, 2048, 32, 80)
    x = torch.zeros(1, 4, 2, 64)
    backward.make(x, x, x, True)()
    bench_attention.rung_runner("default").make(x, x, x, False)()
    assert calls[0]["backward_kernel"] is None and calls[0]["deterministic"] is True
    assert calls[1]["kernel"] is None


def test_variants_register_experiment_rows():
    """benchmarks/variants.py: a configuration value and a class attribute changed under a new name,
    both in the compile-cache key; typos and taken names refused."""
    variants = pytest.importorskip("variants")
    from fa3 import registry
    from fa3.kernels import config

    try:
        spec = variants.register("b7x=b7:prefetch_stats=true,dkv_bulk_add=false")
        assert config.backward_config(spec.config, 128).prefetch_stats is True and spec.speed_rank == 0
        assert not config.backward_config(registry.get("b7").config, 128).prefetch_stats
        assert spec.load_class().dkv_bulk_add is False
        assert registry.get("b7").load_class().dkv_bulk_add is True
        assert ("dkv_bulk_add", False) in config.key(spec.config, config.backward_config(spec.config, 128))
        d256 = config.backward_config(variants.register("b2x=b2:ordered_dq=0").config, 256)
        assert d256.ordered_dq == 0 and d256.q_stages == 1  # over the per-head-dim row too
        with pytest.raises(ValueError, match="no setting prefetch_stat"):
            variants.register("b7y=b7:prefetch_stat=1")
        with pytest.raises(ValueError, match="already a rung"):
            variants.register("b7=b2:ordered_dq=1")
        # head_dims replaces the base's (b4 serves 64, 96 and 128): the prepared d64 rung
        wide = variants.register("b8x=b4:tile_m=128,dq_buffers=1,ds_from_rounded_p=1,dv_under_dp=0,head_dims=64")
        assert wide.head_dims == (64,) and config.backward_config(wide.config, 64).tile_m == 128
        assert registry.get("b4").head_dims == (64, 96, 128)
        assert variants.register("b2y=b2:ordered_dq=1,head_dims=64/128").head_dims == (64, 128)
        # a K5 variant runs flex attention's mods and block masks as its base does (bench_flex --kernels)
        static = variants.register("k55s=k5.5:dynamic_schedule=0")
        assert static.takes_mods() and registry.get("k5.5").takes_mods() and not spec.takes_mods()
        assert not any(registry.get(n).takes_mods() for n in ("k4.2", "s1", "m1", "f1"))
    finally:
        for name in ("b7x", "b2x", "b7y", "b8x", "b2y", "k55s"):
            registry.KERNELS.pop(name, None)


def test_racecheck_summary_is_read_exactly():
    """The sanitizer tests' racecheck verdict: clean only on "0 hazards displayed (0 errors"."""
    from conftest import racecheck_clean

    assert racecheck_clean("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    assert not racecheck_clean("========= RACECHECK SUMMARY: 100 hazards displayed (1161346 errors, 0 warnings)")
    assert not racecheck_clean("========= RACECHECK SUMMARY: 10 hazards displayed (10 errors, 0 warnings)")
    assert not racecheck_clean("done")


def test_value_head_dim_flops_count_each_gemm():
    """bench_value_head_dim's FLOPs: with dv == d the papers' count (forward 4 d, backward 2.5x);
    with dv != d each GEMM at its own width, halved causal."""
    from bench_value_head_dim import pair_flops

    from fa3.timing import attention_flops

    assert pair_flops(2, 3, 1024, 128, 128, False, False) == attention_flops(2, 3, 1024, 1024, 128, False)
    assert pair_flops(2, 3, 1024, 128, 128, True, True) == 2.5 * attention_flops(2, 3, 1024, 1024, 128, True)
    assert pair_flops(1, 1, 10, 192, 128, False, False) == 2 * (192 + 128) * 100
    assert pair_flops(1, 1, 10, 192, 128, False, True) == 2 * (3 * 192 + 2 * 128) * 100


def test_alternating_rounds_order_medians_and_skips():
    """bench_attention's rounds: order reversed every other round, the median of each runner's
    rounds (of two, the faster), a runner that asks to be skipped not timed again."""
    from types import SimpleNamespace

    from bench_attention import alternating_rounds

    runners = [SimpleNamespace(name=n) for n in ("a", "b", "c")]
    order, ms = [], {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0]}

    def time_one(r, rnd):
        order.append(r.name)
        return "refused" if r.name == "c" else ms[r.name][rnd]

    medians, skipped = alternating_rounds(runners, 3, time_one)
    assert order == ["a", "b", "c", "b", "a", "a", "b"]
    assert medians == {"a": 2.0, "b": 5.0} and skipped == {"c": "refused"}
    assert alternating_rounds(runners[:1], 2, lambda r, rnd: [2.0, 1.0][rnd])[0] == {"a": 1.0}


def test_ptx_identity_check_saves_and_compares(tmp_path, capsys):
    """benchmarks/ptx_identity.py (the check a refactor of the kernels runs before and after): its
    labels cover every family, and a configuration hashed twice compares identical; a changed hash
    is reported and fails the comparison."""
    import ptx_identity

    labels = [label for label, *_ in ptx_identity.jobs()]
    assert len(labels) == len(set(labels)) > 400
    for family in ("k5.5 d128", "f1 d128", "cache_prefill", "s1 fp8 bf16-q", "g3 bf16", "b7 d128", "post b9",
                   "pre d128"):
        assert any(label.startswith(family) for label in labels), family
    saved = str(tmp_path / "before.txt")
    assert ptx_identity.main(["--only", "^s1 d64$", "--save", saved]) == 0
    assert ptx_identity.main(["--only", "^s1 d64$", "--compare", saved]) == 0
    assert "1 of 1 configurations identical" in capsys.readouterr().out
    label, _, digest = open(saved).read().strip().rpartition(" | ")
    open(saved, "w").write(f"{label} | {'0' * len(digest)}\n")
    assert ptx_identity.main(["--only", "^s1 d64$", "--compare", saved]) == 1
    assert "DIFFERS" in capsys.readouterr().out


def test_bench_flex_arguments():
    bench_flex = pytest.importorskip("bench_flex")
    args = bench_flex.parse_args(["--short", "--cases", "documents", "--peers", "none"])
    assert args.seqlens == list(bench_flex.SHORT_SEQLENS) and args.cases == ["documents"] and args.peers == []
    with pytest.raises(SystemExit):
        bench_flex.parse_args(["--cases", "sliding"])
    with pytest.raises(SystemExit):
        bench_flex.parse_args(["--peers", "xformers"])
    assert bench_flex.parse_args(["--backward"]).backward and not args.backward
    from fa3 import registry

    try:
        with_rows = bench_flex.parse_args(["--kernels", "k55t", "--variant", "k55t=k5.5:dynamic_schedule=0"])
        assert with_rows.kernels == ["k55t"] and not registry.get("k55t").config.base.dynamic_schedule
    finally:
        registry.KERNELS.pop("k55t", None)
    if not torch.cuda.is_available():
        assert bench_flex.main(["--short"]) == 2  # a message, no traceback


def test_bench_flex_backward_step():
    """--backward: 3.5 times the forward's FLOPs; each column differentiates its own leaves (torch
    its contiguous copies), and the step's gradients are those of its output against one dout."""
    bench_flex = pytest.importorskip("bench_flex")
    forward = bench_flex.Problem("alibi", 64, 40, None, device="cpu")
    p = bench_flex.Problem("alibi", 64, 40, None, device="cpu", backward=True)
    assert p.flops == pytest.approx(3.5 * forward.flops)
    assert all(t.requires_grad and t.is_leaf for t in p.leaves("torch flex") + p.leaves("fa3 flex"))
    assert p.leaves("torch flex")[0] is not p.q and p.leaves("fa4 flex")[0] is p.q
    seen = []
    for t in p.leaves("fa3 flex"):
        t.register_hook(seen.append)
    step = bench_flex.training_step(lambda: (p.qt * p.kt.sum() + p.vt, None), p.leaves("fa3 flex"))
    assert step().shape == p.qt.shape and len(seen) == 3 and all(g.abs().sum() > 0 for g in seen)


@pytest.mark.parametrize("case, documents", [("causal", None), ("documents", 5), ("causal-documents", 5),
                                             ("alibi", None)])
def test_bench_flex_counts_visible_pairs(case, documents):
    """The TFLOP/s count only what the mask leaves: the row's pairs equal the visible (query, key)
    pairs of its mask (the mods' float64 reference's mask), averaged over the batch."""
    bench_flex = pytest.importorskip("bench_flex")
    p = bench_flex.Problem(case, 128, 300, documents, device="cpu")
    b = torch.arange(p.batch).view(-1, 1, 1, 1)
    q_idx, kv_idx = torch.arange(300).view(1, 1, -1, 1), torch.arange(300).view(1, 1, 1, -1)
    visible = torch.ones(p.batch, 1, 300, 300, dtype=torch.bool)
    if p.mask_mod is not None:
        visible = visible & p.mask_mod(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), q_idx, kv_idx)
        assert p.block_mask is not None and p.block_mask.seq_lengths == (300, 300)
    assert p.pairs == pytest.approx(visible.sum().item() / p.batch)
    assert p.flops == pytest.approx(4 * p.batch * p.heads * 128 * p.pairs)
    if case.endswith("documents"):
        assert p.doc_ids.shape == (p.batch, 300) and int(p.doc_ids.max()) == documents - 1
        # the packed view: every document one entry, the batch's tokens in order
        lengths = p.cu_seqlens.diff()
        assert len(lengths) == p.batch * documents and int(p.cu_seqlens[-1]) == p.batch * 300
        runs = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in p.doc_ids.cpu()])
        assert torch.equal(lengths.cpu().long(), runs) and p.max_length == int(lengths.max())
    if case == "alibi":
        assert p.score_mod is not None and p.slopes.shape == (p.heads,)
