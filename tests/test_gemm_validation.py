"""CPU tests: every bad argument to fa3.gemm fails with a message that names it and the fix; TMA-ready
layouts (row/column-major with aligned rows, length-1 dimensions) are used as views without copies,
and every other layout that a @ b takes is copied into an aligned buffer, never refused.

Shape and dtype checks run before the device check, so CPU tensors reach all of them; a valid call
on CPU tensors ends at "move it with a.cuda()".
"""

import pytest
import torch

import fa3
from fa3.compile import builders as _compile
from fa3 import matmul, registry
from conftest import raises_with

BF16 = torch.bfloat16
GEMM_RUNGS = registry.available_kernels(registry.GEMM)


def mats(m=16, k=32, n=24, dtype=BF16):
    return torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)


def raises(exc, *words, **call):
    """fa3.gemm(**call) raises `exc` whose message contains every word of `words`."""
    return raises_with(fa3.gemm, exc, *words, **call)


def test_gemm_is_exported():
    assert fa3.gemm is matmul.gemm and "gemm" in fa3.__all__
    assert GEMM_RUNGS == ["g1", "g2", "g3", "g4"]


@pytest.mark.parametrize("name", ["a", "b"])
def test_non_tensor(name):
    args = dict(zip("ab", mats()))
    args[name] = args[name].tolist()
    raises(TypeError, f"{name} must be a torch.Tensor", "list", **args)


@pytest.mark.parametrize("name", ["a", "b"])
@pytest.mark.parametrize("rank", [1, 3])
def test_wrong_rank(name, rank):
    args = dict(zip("ab", mats()))
    args[name] = args[name][0] if rank == 1 else args[name][None]
    raises(ValueError, name, "2 dimensions", str(tuple(args[name].shape)), **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_unsupported_dtype(dtype):
    a, b = mats()
    raises(TypeError, "a", str(dtype), "bfloat16", a=a.to(dtype), b=b.to(dtype))


def test_mixed_dtypes():
    a, b = mats()
    raises(TypeError, "b", "torch.float16", "torch.bfloat16", "one dtype", a=a, b=b.half())


def test_inner_dims_mismatch():
    a, _ = mats(k=32)
    _, b = mats(k=40)
    raises(ValueError, "K = 32", "40", "a @ b", a=a, b=b)


# what a @ b takes and TMA cannot read in place: each is copied into a row-major buffer with
# 16-byte aligned rows (a @ b's values unchanged), never refused
ODD_OPERANDS = {
    "ragged K, row-major": lambda: torch.randn(16, 30, dtype=BF16),
    "ragged M, column-major": lambda: torch.randn(30, 12, dtype=BF16).t(),
    "misaligned row stride": lambda: torch.randn(16, 36, dtype=BF16)[:, :32],
    "no unit stride": lambda: torch.randn(16, 64, dtype=BF16)[:, ::2],
    "expanded rows": lambda: torch.randn(1, 32, dtype=BF16).expand(16, 32),
    "odd offset": lambda: torch.randn(16 * 33, dtype=BF16)[1:].view(-1)[: 16 * 32].view(16, 32),
}


@pytest.mark.parametrize("case", ODD_OPERANDS)
def test_odd_operands_are_copied_aligned(case):
    t = ODD_OPERANDS[case]()
    view, layout = matmul.tma_operand(t)
    assert layout == "row" and torch.equal(view, t) and view.data_ptr() != t.data_ptr()
    assert view.stride(1) == 1 and view.stride(0) % 8 == 0 and view.data_ptr() % 16 == 0


@pytest.mark.parametrize("m, k, n", [(16, 30, 24), (16, 32, 20), (12, 32, 100), (1, 7, 1)])
def test_ragged_shapes_pass_validation(m, k, n):
    a, b = mats(m, k, n)  # the layout no longer matters for validation: only the device does
    raises(ValueError, "a", "cpu", "a.cuda()", a=a, b=b)


@pytest.mark.parametrize("m, n, k, splits", [
    (8192, 8192, 8192, 1),      # tiles fill the SMs: no split
    (1, 4096, 4096, 2),         # 64 tiles of 64x64: two splits fill 128 SMs
    (3, 1024, 4096, 8),         # 16 tiles: capped at MAX_SPLITS
    (1, 4096, 64, 1),           # one K tile: nothing to split
    (1, 4096, 448, 1),          # 7 K tiles: splits would hold < MIN_SPLIT_K_TILES
    (16, 1024, 640, 2),         # 10 K tiles, 16 tiles: 2 splits of 5 (4 K tiles at least)
    (1, 4096, 4096 + 64, 2),    # 65 K tiles: splits of 33 and 32, none empty
])
def test_k_splits(m, n, k, splits):
    assert matmul.k_splits(m, n, k, 132) == splits


@pytest.mark.parametrize("m, layout, rows", [(1, "row", 8), (8, "row", 8), (9, "row", 16), (32, "row", 32),
                                              (33, "row", None), (1, "col", None)])
def test_a_box_rows(m, layout, rows):
    assert matmul.a_box_rows(m, layout) == (() if rows is None else (("a_rows", rows),))


def test_k_splits_never_empty():
    for k_tiles in range(1, 200):
        for m, n in ((1, 512), (1, 4096), (64, 2048)):
            splits = matmul.k_splits(m, n, 64 * k_tiles, 132)
            per_split = -(-k_tiles // splits)
            assert (splits - 1) * per_split < k_tiles, (m, n, k_tiles, splits)


@pytest.mark.parametrize("m, n, tiles", [
    (8192, 8192, ()),                       # plenty of 128x256 tiles: the default
    (2048, 4096, ()),                       # 256 tiles of 128x256
    (512, 4096, (64, 256)),                 # 64 tiles of 128x256 would idle half the SMs
    (128, 4096, (64, 64)),
    (1, 4096, (64, 64)),                    # never enough: the smallest
    (16, 128256, (64, 256)),                # small M: 64-row tiles, wide enough
])
def test_persistent_tiles(m, n, tiles):
    got = matmul.persistent_tiles(m, n, 132)
    want = () if not tiles else (("mma_warpgroups", 1), ("tile_m", tiles[0]), ("tile_n", tiles[1]))
    assert got == want


def test_cpu_tensors():
    a, b = mats()
    raises(ValueError, "a", "cpu", "a.cuda()", a=a, b=b)


@pytest.mark.parametrize("out, word", [(torch.empty(16, 23, dtype=BF16), "(16, 24)"),
                                       (torch.empty(16, 24, dtype=torch.float16), "bfloat16"),
                                       (torch.empty(24, 16, dtype=BF16).t(), "contiguous"),
                                       ("nope", "(16, 24)")])
def test_bad_out(out, word):
    a, b = mats()
    raises(ValueError, "out", word, a=a, b=b, out=out)


def test_attention_rung_is_not_a_gemm_kernel():
    a, b = mats()
    msg = raises(ValueError, "kernel='k1'", "GEMM rungs", a=a, b=b, kernel="k1")
    assert all(name in msg for name in GEMM_RUNGS)


def test_unknown_kernel():
    a, b = mats()
    raises(ValueError, "kernel='g9'", "'g3'", a=a, b=b, kernel="g9")


@pytest.mark.parametrize("shape, layout, strides", [
    ((16, 32), "row", (32, 1)),
    ((1, 8), "row", (8, 1)),        # one row: its stride is meaningless, made aligned
])
def test_row_major_operands_are_views(shape, layout, strides):
    t = torch.randn(*shape, dtype=BF16)
    view, got = matmul.tma_operand(t)
    assert (got, view.stride()) == (layout, strides) and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("stored, layout, strides", [
    ((32, 16), "col", (1, 16)),     # a.t(): M contiguous
    ((8, 1), "row", (8, 1)),        # a (1, 8) seen through .t() of (8, 1): both strides 1
    ((1, 16), "col", (1, 16)),      # a (16, 1), K = 1: only the column-major view is aligned
])
def test_transposed_operands_are_views(stored, layout, strides):
    t = torch.randn(*stored, dtype=BF16).t()
    view, got = matmul.tma_operand(t)
    assert (got, view.stride()) == (layout, strides) and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("a_layout, b_layout", [("row", "row"), ("col", "col")])
def test_gemm_key_covers_layouts_and_dtype(a_layout, b_layout):
    g1, g3 = registry.get("g1"), registry.get("g3")
    key = _compile.gemm_key(g1, BF16, a_layout, b_layout)
    others = [_compile.gemm_key(g1, torch.float16, a_layout, b_layout),
              _compile.gemm_key(g3, BF16, a_layout, b_layout),
              _compile.gemm_key(g1, BF16, "col" if a_layout == "row" else "row", b_layout)]
    assert len({key, *others}) == 4


# ----------------------------------------------------------------------------- FP8
FP8 = torch.float8_e4m3fn


def fp8_mats(m=16, k=32, n=24):
    a, b = mats(m, k, n, torch.float32)
    return a.to(FP8), b.t().contiguous().t().to(FP8)


@pytest.mark.parametrize("bad, exc, words", [
    (torch.ones(2), ValueError, ("scale_a", "(2,)", "(16, 1)", "row-wise")),
    (torch.ones(16, 2), ValueError, ("scale_a", "(16, 2)", "(16, 1)")),
    (torch.ones(1, dtype=torch.float16), TypeError, ("scale_a", "float16", "float32")),
    (torch.ones(1, device="meta"), ValueError, ("scale_a", "meta")),
    (2.0, TypeError, ("scale_a", "float")),
])
def test_fp8_bad_scale(no_device_check, bad, exc, words):
    a, b = fp8_mats()
    raises(exc, *words, a=a, b=b, scale_a=bad)


def test_fp8_checks():
    a, b = fp8_mats()
    raises(TypeError, "b", "torch.bfloat16", "float8_e4m3fn", a=a, b=b.to(BF16))
    raises(TypeError, "a", "float8_e5m2", "e5m2 is not supported", a=a.to(torch.float8_e5m2),
           b=b.to(torch.float8_e5m2))
    raises(ValueError, "scale_a", "FP8 operands", "bfloat16", a=a.to(BF16), b=b.to(BF16), scale_a=torch.ones(1))
    raises(TypeError, "out_dtype", "float32", a=a, b=b, out_dtype=torch.float32)
    raises(ValueError, "a", "cpu", "a.cuda()", a=a, b=b)
    raises(ValueError, "out", "(16, 24)", "bfloat16", a=a, b=b, out=torch.empty(16, 24, dtype=torch.float16),
           out_dtype=BF16)


def test_fp8_fake_shapes():
    a, b = (t.to("meta") for t in fp8_mats(33, 64, 48))
    s = torch.ones(1, device="meta")
    out = torch.ops.fa3.gemm_fp8(a, b, s, s, "g3", torch.float16)
    assert out.shape == (33, 48) and out.dtype == torch.float16


def test_gemm_key_covers_fp8_output():
    g3 = registry.get("g3")
    assert _compile.gemm_key(g3, FP8, "row", "col", BF16) != _compile.gemm_key(g3, FP8, "row", "col", BF16, True)
    assert _compile.gemm_key(g3, FP8, "row", "col", BF16) != _compile.gemm_key(g3, FP8, "row", "col", torch.float16)
    assert _compile.gemm_key(g3, BF16, "row", "col") == _compile.gemm_key(g3, BF16, "row", "col", BF16)


def test_fp8_splits_k_only_below_a_quarter_of_the_sms():
    """FP8 leaves 64 output tiles unsplit (measured faster) where 16-bit splits them; with 16 tiles
    both split."""
    assert matmul.k_splits(16, 4096, 4096, 132) == 2
    assert matmul.k_splits(16, 4096, 4096, 132, tile_k=128, fp8=True) == 1
    assert matmul.k_splits(8, 1024, 14336, 132, tile_k=128, fp8=True) > 1
