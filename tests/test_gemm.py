"""GPU tests: fa3.gemm against torch.matmul in float32, for every GEMM rung.

Inputs are fresh torch.randn; outputs are preallocated and poisoned with NaN so that any element a
kernel fails to write fails the test. Shapes cover ragged M/N/K tiles (1000x3000x520, 129x136x72,
1x8x8), more tiles than SMs (the persistent rung loops), and every row/column-major combination
of a and b (transposed views, no copies). Sizes are written M x N x K.
"""

import pytest
import torch

import fa3
from fa3 import registry
from conftest import rel_err

pytestmark = pytest.mark.gpu

RUNGS = registry.available_kernels(registry.GEMM)
DTYPES = [torch.bfloat16, torch.float16]
# output rounding dominates: 2^-9 (bf16) and 2^-12 (fp16) per element, relative
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(1000, 3000, 520), (129, 136, 72), (1, 8, 8), (256, 512, 64), (2048, 4096, 264)]


def operands(m, n, k, dtype, a_layout="row", b_layout="row", seed=0):
    """a (m, k), b (k, n); "col" makes the operand a .t() view of a contiguous tensor."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(rows, cols, layout):
        shape = (rows, cols) if layout == "row" else (cols, rows)
        t = torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
        return t if layout == "row" else t.t()

    return make(m, k, a_layout), make(k, n, b_layout)


def check(kernel, a, b):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
    got = fa3.gemm(a, b, out=out, kernel=kernel)
    torch.cuda.synchronize()
    assert got is out
    ref = a.float() @ b.float()
    assert torch.isfinite(out).all(), f"{kernel}: unwritten (NaN) or non-finite outputs"
    err = rel_err(out, ref)
    assert err < TOLERANCE[a.dtype], f"{kernel}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, n, k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("kernel", RUNGS)
def test_matches_matmul(kernel, m, n, k, dtype):
    check(kernel, *operands(m, n, k, dtype))


@pytest.mark.parametrize("a_layout, b_layout", [("col", "row"), ("row", "col"), ("col", "col")])
@pytest.mark.parametrize("kernel", RUNGS)
def test_transposed_operands(kernel, a_layout, b_layout):
    a, b = operands(264, 392, 200, torch.bfloat16, a_layout, b_layout)
    assert (a.stride(0) == 1) == (a_layout == "col") and (b.stride(0) == 1) == (b_layout == "col")
    check(kernel, a, b)


@pytest.mark.parametrize("kernel", RUNGS)
def test_default_output_and_repeat(kernel):
    a, b = operands(384, 512, 128, torch.bfloat16, seed=1)
    first = fa3.gemm(a, b, kernel=kernel)
    assert first.shape == (384, 512) and first.dtype == a.dtype and first.is_contiguous()
    assert torch.equal(first, fa3.gemm(a, b, kernel=kernel)), "two calls differ"


def test_default_kernel_is_fastest():
    a, b = operands(128, 256, 64, torch.bfloat16)
    assert torch.equal(fa3.gemm(a, b), fa3.gemm(a, b, kernel=registry.fastest(registry.GEMM).name))


def test_empty_and_zero_k():
    a, b = operands(0, 64, 32, torch.bfloat16)
    assert fa3.gemm(a, b).shape == (0, 64)
    a, b = operands(16, 64, 0, torch.bfloat16)
    out = torch.full((16, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fa3.gemm(a, b, out=out), torch.zeros_like(out))
