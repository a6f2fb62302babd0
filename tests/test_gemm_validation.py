"""CPU tests: every bad argument to fa3.gemm fails with a message that names it and the fix, and
good layouts (row/column-major, length-1 dimensions) are accepted as views without copies.

Shape, dtype and layout checks run before the device check, so CPU tensors reach all of them; a
valid call on CPU tensors ends at "move it with a.cuda()".
"""

import pytest
import torch

import fa3
from fa3 import _compile, matmul, registry
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
    assert GEMM_RUNGS == ["g1", "g2", "g3"]


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


@pytest.mark.parametrize("m, k, n, name, dim", [
    (16, 30, 24, "a", "K = 30"),   # row-major a: K is its contiguous dimension
    (16, 32, 20, "b", "N = 20"),   # row-major b: N is
])
def test_misaligned_contiguous_dim(m, k, n, name, dim):
    a, b = mats(m, k, n)
    raises(ValueError, name, dim, "multiple of 8", "pad", a=a, b=b)


def test_misaligned_column_major_a_names_m():
    a = torch.randn(32, 12, dtype=BF16).t()  # (12, 32), M contiguous
    raises(ValueError, "a", "column-major", "M = 12", "multiple of 8", a=a, b=torch.randn(32, 24, dtype=BF16))


def test_misaligned_n_with_column_major_b():
    b = torch.randn(20, 32, dtype=BF16).t()  # (32, 20), K contiguous: b is fine, C's rows are not
    raises(ValueError, "N = 20", "multiple of 8", "output", a=torch.randn(16, 32, dtype=BF16), b=b)


def test_misaligned_row_stride():
    a = torch.randn(16, 36, dtype=BF16)[:, :32]  # K = 32 is fine, the row stride 36 is not
    raises(ValueError, "a", "stride", "36", "a.contiguous()", a=a, b=torch.randn(32, 24, dtype=BF16))


def test_no_unit_stride_dimension():
    a = torch.randn(16, 64, dtype=BF16)[:, ::2]
    raises(ValueError, "a", "contiguous", "a.contiguous()", a=a, b=torch.randn(32, 24, dtype=BF16))


def test_expanded_rows_rejected():
    a = torch.randn(1, 32, dtype=BF16).expand(16, 32)
    raises(ValueError, "a", "stride", "a.contiguous()", a=a, b=torch.randn(32, 24, dtype=BF16))


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
    view, got = matmul._gemm_operand(t, "a", ("M", "K"))
    assert (got, view.stride()) == (layout, strides) and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("stored, layout, strides", [
    ((32, 16), "col", (1, 16)),     # a.t(): M contiguous
    ((8, 1), "row", (8, 1)),        # a (1, 8) seen through .t() of (8, 1): both strides 1
    ((1, 16), "col", (1, 16)),      # a (16, 1), K = 1: only the column-major view is aligned
])
def test_transposed_operands_are_views(stored, layout, strides):
    t = torch.randn(*stored, dtype=BF16).t()
    view, got = matmul._gemm_operand(t, "a", ("M", "K"))
    assert (got, view.stride()) == (layout, strides) and view.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("a_layout, b_layout", [("row", "row"), ("col", "col")])
def test_gemm_key_covers_layouts_and_dtype(a_layout, b_layout):
    g1, g3 = registry.get("g1"), registry.get("g3")
    key = _compile.gemm_key(g1, BF16, a_layout, b_layout)
    others = [_compile.gemm_key(g1, torch.float16, a_layout, b_layout),
              _compile.gemm_key(g3, BF16, a_layout, b_layout),
              _compile.gemm_key(g1, BF16, "col" if a_layout == "row" else "row", b_layout)]
    assert len({key, *others}) == 4
