"""fa3.gemm: validate once, pick a rung, launch (the GEMM half of the public API).

The checks it shares with attention (tensors, outputs, the Hopper GPU) live in fa3._checks, the
rung memo and the eager fast path in fa3._dispatch.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch, _launch, index_checks, registry
from .compile import builders as _compile
from ._memo import BoundedMemo

_TMA_BYTES = 16  # TMA's alignment for row strides and base addresses
K_TILE_BYTES = 128  # a K tile's row, as kernels/gemm.py sizes it: 64 16-bit or 128 FP8 elements

# Output tiles (tile_m, tile_n) of the persistent rung, largest first: a problem takes the first
# whose tile count fills ~90% of the SMs (fewer tiles leave SMs idle, which costs more than smaller
# tiles do), 128-row tiles only for M > 64 (a 64-row tile on one MMA warpgroup wastes no rows).
# From `bench_gemm.py --sweep` (worklog/gemm.md, "The sweep").
PERSISTENT_TILES = ((128, 256), (64, 256), (64, 128), (64, 64))
_FILL = 0.9
# FP8 splits K only below a quarter of the SMs: with half the bytes per tile, the partials' round
# trip costs more than idle SMs do (worklog/fp8.md: split in 2 was slower at 48% of the SMs).
_FP8_SPLIT_FILL = 0.25
MAX_SPLITS = 8
MIN_SPLIT_K_TILES = 4


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _tma_elems(t: torch.Tensor) -> int:
    """Elements in TMA's 16 bytes: 8 of a 16-bit type, 16 FP8."""
    return _TMA_BYTES // t.element_size()


def _aligned_view(t: torch.Tensor):
    """(view, layout) of a 2-D operand that TMA can read as it is (no copy), else None: layout "row"
    if the second dimension has unit stride, "col" if the first does (a .t() view), and the other
    stride a multiple of 16 bytes (8 16-bit or 16 FP8 elements) and at least the unit-stride
    extent (no overlapping rows). A length-1 dimension's stride is meaningless, so it is set to an
    aligned value (a view)."""
    rows, cols = t.shape
    if not _dispatch.tracing() and t.data_ptr() % _TMA_BYTES:
        return None
    elems = _tma_elems(t)
    for layout, unit, extent, other, lead in (("row", t.stride(1), cols, rows, t.stride(0)),
                                               ("col", t.stride(0), rows, cols, t.stride(1))):
        if unit != 1 and extent != 1:
            continue
        if other == 1:
            lead = _round_up(extent, elems)
        if lead % elems == 0 and lead >= extent:
            strides = (lead, 1) if layout == "row" else (1, lead)
            return (t if strides == t.stride() else t.as_strided(t.shape, strides)), layout
    return None


def _padded(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) view of a fresh (rows, cols rounded up to 16 bytes) buffer: rows 16-byte
    aligned."""
    return torch.empty(rows, _round_up(cols, _tma_elems(like)), dtype=like.dtype, device=like.device)[:, :cols]


def tma_operand(t: torch.Tensor):
    """(view, layout): `t` itself if TMA can read it, else a row-major copy with 16-byte aligned
    rows (ragged or misaligned strides, odd offsets, expanded or strided views: what `a @ b` takes
    and TMA cannot). The copy costs one pass over the operand, far less than the GEMM."""
    ready = _aligned_view(t)
    if ready is not None:
        return ready
    copy = _padded(*t.shape, t)
    copy.copy_(t)
    return copy, "row"


def persistent_tiles(m: int, n: int, sm_count: int) -> tuple:
    """Config overrides of the persistent rung for an (m, n) output: () keeps its 128x256 tiles."""
    return tile_overrides(*_tile_shape(m, n, sm_count))


def _tile_shape(m: int, n: int, sm_count: int) -> tuple[int, int]:
    for tile_m, tile_n in PERSISTENT_TILES:
        if tile_m > 64 and m <= 64:
            continue
        if _tiles(m, n, tile_m, tile_n) >= _FILL * sm_count:
            break
    return tile_m, tile_n


def _tiles(m, n, tile_m, tile_n) -> int:
    return -(-m // tile_m) * -(-n // tile_n)


def tile_overrides(tile_m: int, tile_n: int) -> tuple:
    """The persistent rung's config overrides for (tile_m, tile_n): one MMA warpgroup per 64 rows;
    () for its registry tiles (one compile, one cache entry)."""
    if (tile_m, tile_n) == PERSISTENT_TILES[0]:
        return ()
    return (("mma_warpgroups", tile_m // 64), ("tile_m", tile_m), ("tile_n", tile_n))


def a_box_rows(m: int, a_layout: str) -> tuple:
    """Config override for M <= 32 (64-row tiles then): TMA loads only the top 8, 16 or 32 rows of
    each A tile (out-of-bounds box rows are slow: worklog/gemm.md, "The short A box"). Row-major A
    only; () otherwise."""
    if m > 32 or a_layout != "row":
        return ()
    return (("a_rows", 8 if m <= 8 else 16 if m <= 16 else 32),)


def k_splits(m: int, n: int, k: int, sm_count: int, tile_k: int = 64, fp8: bool = False) -> int:
    """Split-K count of the persistent rung: when even its smallest tiles leave SMs idle (a short
    wide output: decode-time projections, M = 1..64 against N = 4096), the K range is split so that
    tiles x splits fills them, each split keeping >= MIN_SPLIT_K_TILES K tiles (the partials'
    round trip through L2 must stay small beside the split's loads). No split is empty. FP8 splits
    only below a quarter of the SMs (_FP8_SPLIT_FILL)."""
    return _split_count(_tiles(m, n, *_tile_shape(m, n, sm_count)), k, sm_count, tile_k, fp8)


def _split_count(tiles: int, k: int, sm_count: int, tile_k: int, fp8: bool = False) -> int:
    """k_splits for an output of `tiles` tiles (the host path has them already)."""
    k_tiles = -(-k // tile_k)
    if tiles >= (_FP8_SPLIT_FILL if fp8 else _FILL) * sm_count:
        return 1
    splits = max(1, min(sm_count // tiles, k_tiles // MIN_SPLIT_K_TILES, MAX_SPLITS))
    per_split = -(-k_tiles // splits)
    return -(-k_tiles // per_split)


class _SplitBuffers:
    """Per device: split-K's tile counters (int32, zero between launches: the last split of a tile
    resets its counter) and a one-element stand-in workspace for launches without splits. Kernels
    on one stream run in order, so one set of counters serves them all; launches that may overlap
    (several streams) and split must not share a device."""

    def __init__(self):
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, tiles: int):
        buffers = self._by_device.get(device)
        if buffers is None or buffers[0].numel() < tiles:
            size = max(1024, tiles)
            buffers = self._by_device[device] = (torch.zeros(size, dtype=torch.int32, device=device),
                                                 torch.empty(1, dtype=torch.float32, device=device))
        return buffers


SPLIT_BUFFERS = _SplitBuffers()


def _gemm_rung(kernel):
    """The GEMM rung `kernel` (None: the fastest)."""
    spec = registry.get(kernel if kernel is not None else _dispatch.fastest_rung(registry.GEMM))
    if spec.family != registry.GEMM:
        raise ValueError(f"kernel={kernel!r} is an attention rung; GEMM rungs are "
                         f"{registry.available_kernels(registry.GEMM)}")
    return spec


def check_gemm(a, b, out, kernel):
    """Validate fa3.gemm's arguments (any 2-D pair that a @ b takes); returns the rung's spec."""
    _checks.check_tensor(a, "a", 2, unit_stride_last=False)
    _checks.check_tensor(b, "b", 2, a.dtype, unit_stride_last=False)
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns (K = {k}) must "
                         f"equal b's rows ({b.shape[0]}) for a @ b")
    spec = _dispatch.memo_rung(_gemm_rung, kernel)
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}; put them on one GPU")
    if out is not None:
        _checks.check_output(out, "out", _checks.OutputSpec(torch.Size((m, n)), a.dtype, a.device),
                             (("a", a), ("b", b)))
    _checks.check_hopper(a.device, "a")
    return spec


def gemm(a, b, *, out=None, kernel: str | None = None, scale_a=None, scale_b=None, out_dtype=None):
    """a @ b for 2-D bf16/fp16 tensors on a Hopper GPU: FP32 accumulation, output in the input dtype.
    FP8: float8_e4m3fn a and b give scale_a * scale_b * (a @ b) in out_dtype (bf16 by default, or
    fp16), as torch._scaled_mm: scales are one-element float32 tensors (or None: 1), or row-wise
    (scale_a (M, 1) per row of a, scale_b (1, N) per column of b), read on the GPU; forward only. FP8 WGMMA reads K-major operands: a row-major and b column-major (b =
    w.t() of a row-major (N, K) w) are read in place, other layouts are copied first.

    a: (M, K), b: (K, N), one dtype, any strides. Row-major (contiguous) and column-major (.t()
    views) operands with 16-byte aligned rows are read in place; anything else TMA cannot read
    (a dimension not a multiple of 8 in a contiguous tensor, strided or expanded views, odd
    offsets) is first copied into an aligned buffer, and so is the output when N is not a multiple
    of 8 (then copied into the result).
    kernel: a rung of fa3.available_kernels("gemm"); None picks the fastest, whose tile shape is
    chosen per problem (PERSISTENT_TILES).
    out: optional preallocated (M, N) output, same dtype and device, contiguous.
    Returns out. M or N = 0 gives an empty result; K = 0 gives zeros.

    Like fa3.attention, this is a torch custom op (`torch.ops.fa3.gemm`) behind a validating
    wrapper: it traces under torch.compile and torch.export, can be captured in CUDA graphs, and
    is differentiable (dA = dC B^T and dB = A^T dC on the same kernels, through transposed views).
    """
    index_checks.raise_pending()  # an earlier call's bad index values (deferred checks)
    # (traced calls never read the memo: compiled graphs must not guard on its contents)
    plain = kernel is None and scale_a is None and scale_b is None and out_dtype is None \
        and not _dispatch.tracing()
    if plain:  # a call like one that ran before: its launch is prepared (prepare_plain_gemm)
        try:
            key = plain_gemm_key(a, b, out=out)
            launch = _PLAIN_GEMMS.get(key)
        except (AttributeError, TypeError):  # not tensors (check_gemm names them), symbolic shapes
            key = launch = None
        if launch is not None and _dispatch.direct_call_ok(a, b) and not _dispatch.profiling() \
                and gemm_data_aligned(a, b) and (out is None or _checks.prepared_output_ok(out, (("a", a), ("b", b)))):
            return launch(a, b, out)
    if (isinstance(a, torch.Tensor) and a.dtype in _checks.FP8_LIKE) or scale_a is not None \
            or scale_b is not None or out_dtype is not None:
        return gemm_fp8(a, b, scale_a, scale_b, out, out_dtype, kernel)
    spec = check_gemm(a, b, out, kernel)
    if _dispatch.direct_call_ok(a, b):
        with _dispatch.op_range("fa3::gemm"):
            result = launch_gemm(spec, a, b, out)
        if plain and key is not None:
            _PLAIN_GEMMS.remember(key, prepare_plain_gemm(spec, a, b))
        return result
    result = torch.ops.fa3.gemm(a, b, spec.name)
    return result if out is None else out.copy_(result)  # the op is functional


# the key of a plain call (a and b's shapes, strides, dtypes and devices) -> its prepared launch
_PLAIN_GEMMS = BoundedMemo()


def plain_gemm_key(a, b, rung: str | None = None, out=None) -> tuple:
    """What a prepared GEMM launch (prepare_plain_gemm) assumes of a call: a and b's shapes,
    strides, dtypes and devices (and the rung, where the caller names one; out='s shape, dtype and
    device, where given)."""
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device, rung,
            None if out is None else (out.shape, out.dtype, out.device))


def gemm_data_aligned(a, b) -> bool:
    """What a prepared GEMM launch checks per call beyond its key: TMA-aligned data."""
    return not (a.data_ptr() | b.data_ptr()) % _TMA_BYTES


def prepare_plain_gemm(spec, a, b):
    """launch_gemm's launch for a plain bf16/fp16 call (no FP8 or named rung) that ran with
    these a and b, made once: a function of (a, b[, out]) that allocates the output unless given (and a split-K
    workspace) and calls the compiled GEMM, for later calls with the same shapes, strides, dtypes
    and devices and 16-byte aligned data. None where launch_gemm does more (an empty or K = 0
    problem, operands TMA cannot read as they are, a ragged N, a ladder rung)."""
    (m, k), n = a.shape, b.shape[1]
    ready_a, ready_b = _aligned_view(a), _aligned_view(b)
    if m == 0 or n == 0 or k == 0 or ready_a is None or ready_b is None or ready_a[0] is not a \
            or ready_b[0] is not b or n % _tma_elems(a) or spec.cls != "PersistentGemm" \
            or a.device not in _checks.HOPPER_SMS:
        return None
    device, dtype = a.device, a.dtype
    sm_count = _checks.HOPPER_SMS[device]
    tile_m, tile_n = _tile_shape(m, n, sm_count)
    tiles = tile_overrides(tile_m, tile_n) + a_box_rows(m, ready_a[1])
    output_tiles = _tiles(m, n, tile_m, tile_n)
    splits = _split_count(output_tiles, k, sm_count, K_TILE_BYTES // a.element_size(), fp8=False)
    fn = _compile.get_gemm(spec, dtype, ready_a[1], ready_b[1], tiles, None, False)
    scales = (_launch.stand_in(device, torch.float32),) * 2
    workspace_size = output_tiles * splits * tile_m * tile_n

    def launch(a, b, out=None):
        if a.requires_grad or b.requires_grad:  # (under no_grad) as launch_gemm
            a, b = _launch.detached(a, b)
        if out is None:
            out = torch.empty(m, n, dtype=dtype, device=device)
        counters, workspace = SPLIT_BUFFERS.get(device, sm_count)
        if splits > 1:  # the split-K partial tiles: the stream's scratch (read only by this call's kernel)
            workspace = _launch.stream_scratch((workspace_size,), device)[0]
        fn(a, b, out, sm_count, workspace, counters, splits, *scales)
        return out
    return launch


def launch_gemm(spec, a, b, out=None, scales=None, out_dtype=None):
    """Allocate `out` unless given and launch rung `spec` on torch's current stream; the body of
    the fa3::gemm op (and of fa3::gemm_fp8: `scales` = (scale_a, scale_b), one-element FP32
    tensors, C in `out_dtype`). a and b are checked operands, in any layout (FP8's are made
    K-major first)."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    out_dtype = out_dtype or a.dtype
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if a.requires_grad or b.requires_grad:
        a, b = _launch.detached(a, b)
    if scales is None:
        a, a_layout = tma_operand(a)
        b, b_layout = tma_operand(b)
        scales = (_launch.stand_in(a.device, torch.float32),) * 2
    else:  # FP8 WGMMA reads K-major operands only: A row-major, B column-major
        a, a_layout = k_major(a), "row"
        b, b_layout = k_major(b.t()).t(), "col"
    sm_count = _checks.HOPPER_SMS[a.device]
    tiles, splits = (), 1
    counters, workspace = SPLIT_BUFFERS.get(a.device, sm_count)
    if spec.cls == "PersistentGemm":  # the ladder rungs g1/g2 keep their tiles
        tile_m, tile_n = _tile_shape(m, n, sm_count)
        tiles = tile_overrides(tile_m, tile_n) + a_box_rows(m, a_layout)
        output_tiles = _tiles(m, n, tile_m, tile_n)
        splits = _split_count(output_tiles, k, sm_count, K_TILE_BYTES // a.element_size(),
                              fp8=a.element_size() == 1)
        if splits > 1:  # the split-K partial tiles: the stream's scratch (read only by this call's kernel)
            workspace = _launch.stream_scratch((output_tiles * splits * tile_m * tile_n,), a.device)[0]
    row_scales = max(s.numel() for s in scales) > 1
    fn = _compile.get_gemm(spec, a.dtype, a_layout, b_layout, tiles,
                           None if out_dtype == a.dtype else out_dtype, row_scales)
    # TMA stores 16-byte aligned rows: a ragged N goes through a padded buffer
    c = out if n % _tma_elems(out) == 0 and out.data_ptr() % _TMA_BYTES == 0 else _padded(m, n, out)
    fn(a, b, c, sm_count, workspace, counters, splits, *scales)
    return out if c is out else out.copy_(c)


def k_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (rows, K) as TMA reads a K-major operand: itself if it is one, else a row-major copy."""
    ready = _aligned_view(t)
    if ready is not None and ready[1] == "row":
        return ready[0]
    copy = _padded(*t.shape, t)
    copy.copy_(t)
    return copy


# ----------------------------------------------------------------------------- FP8
def check_gemm_fp8(a, b, scale_a, scale_b, out, out_dtype, kernel):
    """fa3.gemm's FP8 arguments; returns (spec, (scale_a, scale_b) as one-element FP32 tensors,
    out_dtype)."""
    if isinstance(a, torch.Tensor) and a.dtype not in _checks.FP8_LIKE:
        raise ValueError(f"scale_a and scale_b apply to FP8 operands; a has dtype {a.dtype}: quantize a "
                         "and b with fa3.quantize_fp8, or drop the scales")
    _checks.check_tensor(a, "a", 2, unit_stride_last=False, dtypes=_checks.FP8_DTYPES)
    _checks.check_tensor(b, "b", 2, a.dtype, unit_stride_last=False, dtypes=_checks.FP8_DTYPES)
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns (K = {k}) must "
                         f"equal b's rows ({b.shape[0]}) for a @ b")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise ValueError("the FP8 GEMM is forward-only: a or b requires grad; pass tensors that do not "
                         "(x.detach())")
    spec = _dispatch.memo_rung(_gemm_rung, kernel)
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}; put them on one GPU")
    out_dtype = out_dtype or (out.dtype if isinstance(out, torch.Tensor) else torch.bfloat16)
    if out_dtype not in _checks.SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported for FP8 operands: torch.bfloat16 or "
                        "torch.float16")
    if out is not None:
        _checks.check_output(out, "out", _checks.OutputSpec(torch.Size((m, n)), out_dtype, a.device),
                             (("a", a), ("b", b)))
    _checks.check_hopper(a.device, "a")
    scales = (_scale(scale_a, "scale_a", m, (m, 1), a.device), _scale(scale_b, "scale_b", n, (1, n), a.device))
    if scales[0].numel() != scales[1].numel() and min(scales[0].numel(), scales[1].numel()) == 1:
        # one of them per tensor, the other per row/column: the kernel takes both as vectors
        scales = (scales[0].expand(m).contiguous(), scales[1].expand(n).contiguous())
    return spec, scales, out_dtype


def _scale(t, name: str, extent: int, shape: tuple, device) -> torch.Tensor:
    """A scale as the kernel takes it: None (1) or a one-element float32 tensor (per tensor) -> (1,);
    `shape` (scale_a (M, 1) per row of a, scale_b (1, N) per column of b, as torch._scaled_mm's
    row-wise scaling; 1-D (extent,) too) -> (extent,) contiguous."""
    if t is None:
        return _ones(device)
    _checks.check_scale_tensor(t, name, f"one element or shape {shape}", device, "a")
    if t.numel() == 1 and t.dim() <= 2:
        return t.reshape(1)
    if tuple(t.shape) not in (shape, (extent,)):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; fa3's FP8 GEMM takes one element (per "
                         f"tensor) or {shape} (row-wise, as torch._scaled_mm)")
    return t.reshape(extent).contiguous()


_ONES: dict = {}


def _ones(device) -> torch.Tensor:
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def gemm_fp8(a, b, scale_a, scale_b, out, out_dtype, kernel):
    """fa3.gemm's FP8 branch (the public docstring is fa3.gemm's)."""
    spec, scales, out_dtype = check_gemm_fp8(a, b, scale_a, scale_b, out, out_dtype, kernel)
    if _dispatch.direct_call_ok(a, b, *scales):
        with _dispatch.op_range("fa3::gemm_fp8"):
            return launch_gemm(spec, a, b, out, scales, out_dtype)
    result = torch.ops.fa3.gemm_fp8(a, b, *scales, spec.name, out_dtype)
    return result if out is None else out.copy_(result)
