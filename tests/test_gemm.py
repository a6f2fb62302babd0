"""GPU tests: fa3.gemm against torch.matmul in float32, for every GEMM rung.

Inputs are fresh torch.randn; outputs are preallocated and poisoned with NaN so that any element a
kernel fails to write fails the test. Shapes cover ragged M/N/K tiles (1000x3000x520, 129x136x72,
1x8x8), more tiles than SMs (the persistent rung loops), every row/column-major combination
of a and b (transposed views, no copies), the layouts TMA cannot read in place (copied inside:
N, K or M not multiples of 8, strided, expanded and misaligned views), each tile shape the
persistent rung picks, and gradients against a float64 reference. Sizes are written M x N x K.
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


def odd(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as t in a layout TMA cannot read in place."""
    rows, cols = t.shape
    if how == "strided":  # every other column of a wider tensor
        wide = torch.empty(rows, 2 * cols, device=t.device, dtype=t.dtype)
        wide[:, ::2] = t
        return wide[:, ::2]
    if how == "offset":  # 2 bytes past a 16-byte boundary
        flat = torch.empty(rows * cols + 1, device=t.device, dtype=t.dtype)
        view = flat[1:].view(rows, cols)
        view.copy_(t)
        return view
    if how == "col":
        return t.t().contiguous().t()
    return t


@pytest.mark.parametrize("m, n, k", [(1, 100, 30), (257, 100, 72), (33, 7, 13), (130, 1, 264), (5, 24, 1)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("kernel", RUNGS)
def test_ragged_shapes(kernel, m, n, k):
    """N, K, M not multiples of 8 (copied into aligned buffers inside), row- and column-major."""
    a, b = operands(m, n, k, torch.bfloat16, seed=2)
    check(kernel, a, b)
    check(kernel, odd(a, "col"), odd(b, "col"))
    assert fa3.gemm(a, b, kernel=kernel).is_contiguous()


@pytest.mark.parametrize("a_how, b_how", [("strided", "row"), ("row", "offset"), ("offset", "strided"),
                                          ("col", "strided")])
def test_views_tma_cannot_read(a_how, b_how):
    a, b = operands(96, 136, 80, torch.bfloat16, seed=3)
    check(None, odd(a, a_how), odd(b, b_how))
    expanded = a[:1].expand(96, 80)
    check(None, expanded, b)


@pytest.mark.parametrize("m, n, k", [(2048, 4096, 264), (512, 4096, 200), (256, 3840, 136), (128, 4096, 72),
                                     (16, 128256 // 8, 64)], ids=lambda x: str(x))
def test_each_persistent_tile_shape(m, n, k):
    a, b = operands(m, n, k, torch.bfloat16, seed=4)
    check("g3", a, b)


def test_tile_shapes_covered():
    """The shapes above reach every tile shape of PERSISTENT_TILES on this GPU."""
    from fa3 import matmul
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(2048, 4096), (512, 4096), (256, 3840), (128, 4096)]
    got = {matmul.persistent_tiles(m, n, sms) for m, n in shapes}
    assert len(got) == len(matmul.PERSISTENT_TILES), got


@pytest.mark.parametrize("a_layout, b_layout", [("row", "row"), ("col", "row"), ("row", "col")])
@pytest.mark.parametrize("m, n, k", [(200, 136, 264), (1, 100, 30)], ids=lambda x: str(x))
def test_gradients(m, n, k, a_layout, b_layout):
    a, b = operands(m, n, k, torch.bfloat16, a_layout, b_layout, seed=5)
    a.requires_grad_(True)
    b.requires_grad_(True)
    dc = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    (fa3.gemm(a, b) * dc).sum().backward()
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    ((a64 @ b64) * dc.double()).sum().backward()
    for name, got, want in (("a", a.grad, a64.grad), ("b", b.grad, b64.grad)):
        assert got is not None and got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        err = rel_err(got, want)
        assert err < TOLERANCE[torch.bfloat16], f"d{name}: relative error {err:.2e}"


def test_gradients_under_compile():
    a, b = operands(128, 256, 64, torch.bfloat16, seed=6)
    a.requires_grad_(True)
    b.requires_grad_(True)
    fn = torch.compile(lambda x, y: (fa3.gemm(x, y).float() ** 2).sum(), fullgraph=True)
    fn(a, b).backward()
    ref_a, ref_b = a.detach().float().requires_grad_(True), b.detach().float().requires_grad_(True)
    ((ref_a @ ref_b) ** 2).sum().backward()
    assert rel_err(a.grad, ref_a.grad) < 2e-2 and rel_err(b.grad, ref_b.grad) < 2e-2


SPLIT_SHAPES = [(1, 4096, 4096), (16, 4096, 14336), (64, 4096, 1000), (3, 1024, 4096), (40, 2056, 520)]


@pytest.mark.parametrize("m, n, k", SPLIT_SHAPES, ids=lambda x: str(x))
def test_split_k(m, n, k):
    """Short wide outputs split K across CTAs (the last split of a tile sums the FP32 partials in
    order): right, bit-identical from call to call, and the tile counters are left at zero (a
    third call after two still matches)."""
    from fa3 import matmul
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert matmul.k_splits(m, n, k, sms) > 1, "this shape should split"
    a, b = operands(m, n, k, torch.bfloat16, seed=7)
    check(None, a, b)
    first, second = fa3.gemm(a, b), fa3.gemm(a, b)
    assert torch.equal(first, second), "split-K is not deterministic"
    counters, _ = matmul.SPLIT_BUFFERS.get(a.device, sms)
    assert int(counters.abs().sum()) == 0, "a tile counter was left nonzero"


def test_split_k_in_cuda_graph():
    a, b = operands(8, 4096, 4096, torch.bfloat16, seed=8)
    out = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
    fa3.gemm(a, b, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa3.gemm(a, b, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, a.float() @ b.float()) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 7, 16, 20, 32, 33])
def test_small_m_a_box(m):
    """M <= 32 loads only the top 8/16/32 rows of each A tile; the rows below are stale SMEM and
    must not reach the output (NaN-poisoned out; K split or not)."""
    for n, k in ((1000, 300), (4096, 4096)):
        a, b = operands(m, n, k, torch.bfloat16, seed=9)
        check(None, a, b)
        check(None, odd(a, "col"), b)  # column-major A keeps the full box


# ----------------------------------------------------------------------------- FP8
FP8_SHAPES = [(1000, 3000, 520), (129, 136, 72), (1, 4096, 4096), (2048, 4096, 264), (8, 1024, 14336)]


def fp8_operands(m, n, k, b_layout="col", seed=0):
    """a (m, k) and b (k, n) quantized per tensor (fa3.quantize_fp8): b column-major (a weight's
    .t()) unless b_layout is "row"; and their dequantized float64 values."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a, sa = fa3.quantize_fp8(torch.randn(m, k, device="cuda", generator=gen) * 3)
    if b_layout == "col":
        w, sb = fa3.quantize_fp8(torch.randn(n, k, device="cuda", generator=gen) / 2)
        b = w.t()
    else:
        b, sb = fa3.quantize_fp8(torch.randn(k, n, device="cuda", generator=gen) / 2)
    ref = (a.double() * sa.double()) @ (b.double() * sb.double())
    return a, b, sa, sb, ref


@pytest.mark.parametrize("m, n, k", FP8_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in FP8_SHAPES])
@pytest.mark.parametrize("kernel", RUNGS)
def test_fp8_matches_dequantized_product(kernel, m, n, k):
    """scale_a * scale_b * (a @ b) in bf16 against the float64 product of the dequantized inputs;
    the output poisoned with NaN; torch._scaled_mm within the same error where it takes the shape
    (K and N multiples of 16; fa3.gemm takes any)."""
    a, b, sa, sb, ref = fp8_operands(m, n, k, seed=m + n)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = fa3.gemm(a, b, scale_a=sa, scale_b=sb, out=out, kernel=kernel)
    assert got is out and torch.isfinite(out).all(), f"{kernel}: unwritten (NaN) outputs"
    err = rel_err(out, ref)
    assert err < 1e-2, f"{kernel}: relative error {err:.2e}"
    if k % 16 == 0 and n % 16 == 0:  # (what torch._scaled_mm takes)
        peer = rel_err(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), ref)
        print(f"\n  {kernel} {m}x{n}x{k}: rel err {err:.2e} (torch._scaled_mm {peer:.2e})", end="")
        assert err < 2 * peer + 1e-3


@pytest.mark.parametrize("case", ["row-major b", "col-major a", "fp16 out", "no scales", "ragged n"])
def test_fp8_layouts_and_outputs(case):
    """Layouts FP8 WGMMA cannot read (row-major b, column-major a) are copied K-major; out_dtype
    fp16; scales None (1); N not a multiple of 16 (a padded output)."""
    m, n, k = 300, 520 if case != "ragged n" else 517, 256
    a, b, sa, sb, ref = fp8_operands(m, n, k, b_layout="row" if case == "row-major b" else "col", seed=3)
    if case == "col-major a":
        a = a.t().contiguous().t()
    kwargs = dict(scale_a=sa, scale_b=sb)
    if case == "no scales":
        kwargs = {}
        ref = a.double() @ b.double()
    if case == "fp16 out":
        kwargs["out_dtype"] = torch.float16
    got = fa3.gemm(a, b, **kwargs)
    assert got.dtype == (torch.float16 if case == "fp16 out" else torch.bfloat16) and got.shape == (m, n)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("m, n, k", [(1024, 3072, 512), (129, 136, 72), (1, 4096, 4096), (2048, 4096, 264)])
@pytest.mark.parametrize("form", ["rows and columns", "rows only", "columns only"])
def test_fp8_row_wise_scales(m, n, k, form):
    """scale_a (M, 1) per row of a and scale_b (1, N) per column of b (torch._scaled_mm's row-wise
    scaling), or one of them per tensor, against the float64 product; torch._scaled_mm's own
    row-wise result within the same error where it takes the shape; output poisoned."""
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x, w = torch.randn(m, k, device="cuda", generator=gen), torch.randn(n, k, device="cuda", generator=gen)
    x[: m // 2] *= 40  # rows of very different ranges: one scale would crush the small ones
    sa = x.abs().amax(1, keepdim=True).clamp(min=1e-6) / 448
    sb = (w.abs().amax(1, keepdim=True).clamp(min=1e-6) / 448).t()
    if form == "rows only":
        sb = torch.ones(1, device="cuda")
    if form == "columns only":
        sa = torch.ones(1, device="cuda")
    a = (x / sa).to(torch.float8_e4m3fn)
    b = (w.t() / sb).to(torch.float8_e4m3fn) if form != "rows only" else w.t().to(torch.float8_e4m3fn)
    ref = (a.double() * sa.double()) @ (b.double() * sb.double())
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    fa3.gemm(a, b, scale_a=sa, scale_b=sb, out=out)
    err = rel_err(out, ref)
    assert torch.isfinite(out).all() and err < 1e-2, f"{form}: rel err {err:.2e}"
    if form == "rows and columns" and m % 16 == 0 and n % 16 == 0 and k % 16 == 0:
        peer = rel_err(torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), ref)
        assert err < 2 * peer + 1e-3, f"rel err {err:.2e}, torch._scaled_mm {peer:.2e}"


def test_fp8_under_compile_and_graphs():
    """torch.compile reaches the fa3::gemm_fp8 op; a CUDA graph replays it with new values."""
    a, b, sa, sb, ref = fp8_operands(256, 512, 1024, seed=5)
    compiled = torch.compile(lambda a, b, sa, sb: fa3.gemm(a, b, scale_a=sa, scale_b=sb), fullgraph=True)
    assert rel_err(compiled(a, b, sa, sb), ref) < 1e-2
    out = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
    fa3.gemm(a, b, scale_a=sa, scale_b=sb, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa3.gemm(a, b, scale_a=sa, scale_b=sb, out=out)
    a2, b2, sa2, sb2, ref2 = fp8_operands(256, 512, 1024, seed=6)
    a.copy_(a2)
    b.copy_(b2)
    sa.copy_(sa2)
    sb.copy_(sb2)
    graph.replay()
    assert rel_err(out, ref2) < 1e-2
