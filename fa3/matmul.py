"""fa3.gemm: validate once, pick a rung, launch (the GEMM half of the public API).

The checks it shares with attention (tensors, outputs, the Hopper GPU, rung memo, the eager fast
path) live in fa3.interface and are called through it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _compile, interface, registry

_TMA_ELEMS = 8  # 16 bytes of a 16-bit type: TMA's alignment for row strides and base addresses


class _OutputSpec(NamedTuple):  # what interface.check_output compares `out` against, without allocating
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _round_up(x: int, to: int = _TMA_ELEMS) -> int:
    return -(-x // to) * to


def _gemm_operand(t: torch.Tensor, name: str, dims: tuple[str, str]):
    """(view, layout) of a 2-D GEMM operand whose dimensions are called `dims`: layout "row" if the
    second dimension has unit stride (contiguous), "col" if the first does (a .t() view). The
    unit-stride dimension's length and the other stride must be multiples of 8 (16 bytes: TMA).
    A length-1 dimension's stride is meaningless, so it is set to an aligned value (a view)."""
    rows, cols = t.shape
    lead = t.stride(0)
    if t.stride(1) == 1 and rows > 1 and cols % _TMA_ELEMS == 0 and lead % _TMA_ELEMS == 0 \
            and lead >= cols and (interface._tracing() or t.data_ptr() % 16 == 0):
        return t, "row"  # the common case (a contiguous tensor), decided without the search below
    candidates = [layout for layout, unit, extent in (("row", t.stride(1), cols), ("col", t.stride(0), rows))
                  if unit == 1 or extent == 1]
    if not candidates:
        raise ValueError(f"{name} has strides {t.stride()}: neither dimension is contiguous; pass "
                         f"{name}.contiguous()")
    problems = []
    for layout in candidates:
        unit_dim = 1 if layout == "row" else 0
        extent, other = t.shape[unit_dim], t.shape[1 - unit_dim]
        lead = t.stride(1 - unit_dim) if other > 1 else _round_up(extent)
        if extent % _TMA_ELEMS:
            problems.append(f"{name} is {'row' if layout == 'row' else 'column'}-major, so {dims[unit_dim]} = {extent} must be a multiple "
                            f"of {_TMA_ELEMS} (TMA reads 16-byte aligned rows); pad {name} with zeros to "
                            f"{dims[unit_dim]} = {_round_up(extent)}"
                            + ("" if dims[unit_dim] == "K" else " and slice the result"))
        elif lead % _TMA_ELEMS or lead < extent:  # misaligned, or overlapping (expanded) rows
            problems.append(f"{name} has strides {t.stride()}: its {'row' if layout == 'row' else 'column'} "
                            f"stride {lead} must be a multiple of {_TMA_ELEMS} elements (16 bytes, TMA) "
                            f"and at least {extent}; pass {name}.contiguous()")
        else:
            strides = (lead, 1) if layout == "row" else (1, lead)
            view = t if strides == t.stride() else t.as_strided(t.shape, strides)
            if not interface._tracing() and view.data_ptr() % 16:  # traced: fa3::gemm checks when it runs
                raise ValueError(f"{name}.data_ptr() is not 16-byte aligned (a view at an odd offset); "
                                 f"pass {name}.clone()")
            return view, layout
    raise ValueError(problems[0])


def _gemm_rung(kernel):
    """The GEMM rung `kernel` (None: the fastest)."""
    spec = registry.get(kernel if kernel is not None else interface._fastest_rung(registry.GEMM))
    if spec.family != registry.GEMM:
        raise ValueError(f"kernel={kernel!r} is an attention rung; GEMM rungs are "
                         f"{registry.available_kernels(registry.GEMM)}")
    return spec


def _check_gemm(a, b, out, kernel):
    """Validate fa3.gemm's arguments; returns (spec, a, a_layout, b, b_layout) with operands as
    TMA-ready views (no copies). Layout checks run only when a kernel will be launched."""
    interface.check_tensor(a, "a", 2, unit_stride_last=False)
    interface.check_tensor(b, "b", 2, a.dtype, unit_stride_last=False)
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's columns (K = {k}) must "
                         f"equal b's rows ({b.shape[0]}) for a @ b")
    spec = interface._memo_rung(_gemm_rung, kernel)
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but a is on {a.device}; put them on one GPU")
    if out is not None:
        interface.check_output(out, "out", _OutputSpec(torch.Size((m, n)), a.dtype, a.device))
    a, a_layout, b, b_layout = gemm_operands(a, b)
    interface.check_hopper(a.device, "a")
    return spec, a, a_layout, b, b_layout


def gemm_operands(a, b):
    """(a, a_layout, b, b_layout): both operands as TMA-ready views, checked. Layouts are checked
    only when a kernel will be launched (M, N and K all nonzero); otherwise both are "row"."""
    (m, k), n = a.shape, b.shape[1]
    if not (m and n and k):
        return a, "row", b, "row"
    a, a_layout = _gemm_operand(a, "a", ("M", "K"))
    b, b_layout = _gemm_operand(b, "b", ("K", "N"))
    if n % _TMA_ELEMS:
        raise ValueError(f"N = {n} (b.shape[1]) must be a multiple of {_TMA_ELEMS}: the output's rows "
                         f"are written by TMA, which needs 16-byte aligned rows; pad b with zero "
                         f"columns to N = {_round_up(n)} and slice the result")
    return a, a_layout, b, b_layout


def gemm(a, b, *, out=None, kernel: str | None = None):
    """a @ b for 2-D bf16/fp16 tensors on a Hopper GPU: FP32 accumulation, output in the input dtype.

    a: (M, K), b: (K, N), one dtype. Either may be row-major (contiguous) or column-major (a .t()
    view): no copies are made. The contiguous dimension of each (K for a row-major a, N for a
    row-major b, M for a column-major a, K for a column-major b), and N, must be multiples of 8.
    kernel: a rung of fa3.available_kernels("gemm"); None picks the fastest.
    out: optional preallocated (M, N) output, same dtype and device, contiguous.
    Returns out. M or N = 0 gives an empty result; K = 0 gives zeros.

    Like fa3.attention, this is a torch custom op (`torch.ops.fa3.gemm`) behind a validating
    wrapper: it traces under torch.compile and torch.export and can be captured in CUDA graphs.
    """
    spec, a_view, a_layout, b_view, b_layout = _check_gemm(a, b, out, kernel)
    if interface.direct_call_ok(a, b):
        return launch_gemm(spec, a_view, a_layout, b_view, b_layout, out)
    result = torch.ops.fa3.gemm(a, b, spec.name)
    return result if out is None else out.copy_(result)  # the op is functional


def launch_gemm(spec, a, a_layout, b, b_layout, out=None):
    """Allocate `out` unless given and launch rung `spec` on torch's current stream; the body of
    the fa3::gemm op. a and b are gemm_operands' views."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    fn = _compile.get_gemm(spec, a.dtype, a_layout, b_layout)
    if a.requires_grad or b.requires_grad:
        a, b = interface._detached(a, b)
    fn(a, b, out, interface._HOPPER_SMS[a.device])
    return out
