"""Property-based tests of argument validation (hypothesis): random shapes, strides (non-contiguous,
transposed, expanded and misaligned views), dtypes, devices (CPU and meta) and index values for
every public entry point. Every call either runs or raises ValueError or TypeError with a message;
nothing else (no IndexError from an index op, no RuntimeError from a device mismatch, ...).

Each call is made three ways: as is (CPU and meta tensors must then be refused, by the device
check or an earlier one); past the device check with the launches replaced by stand-ins that
allocate the outputs, so that every later check is reached, and index values read on the host
(CPU tensors); and the same with value checks off, as under CUDA-graph capture, where the cache
append must stay inside the cache whatever the values.
"""

import contextlib
import math
from unittest import mock

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fa3  # noqa: E402
from fa3 import _checks, index_checks, interface, kvcache, matmul, registry, varlen  # noqa: E402

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOATS = [torch.float16, torch.float32, torch.int32]  # besides the call's own dtype
INDEX_DTYPES = [torch.int64, torch.float32]  # besides int32
HEAD_DIMS = [64, 128, 256, 96, 192, 80, 8, 0]
LAYOUTS = ["strided", "transposed", "expanded", "misaligned"]  # besides contiguous
MODES = ["as is", "checked", "unchecked"]
RUNGS = [None, None, "bogus"] + registry.available_kernels()


# ----------------------------------------------------------------------------- strategies
_CLEAN = [False]  # while a `calls` example is drawn: whether it has no odd values at all


def rarely(draw, usual, odd, one_in=8):
    """`usual`, or one time in `one_in` a value drawn from `odd` (never in a clean call): most calls
    get far enough to reach the later checks."""
    if _CLEAN[0]:
        return usual
    return draw(odd) if draw(st.integers(0, one_in - 1)) == 0 else usual


@st.composite
def calls(draw, arguments):
    """An example of the strategy `arguments`; half of them clean (every `rarely` gives its usual
    value), so that the checks after the first few are reached too."""
    _CLEAN[0] = draw(st.booleans())
    try:
        return draw(arguments)
    finally:
        _CLEAN[0] = False


@st.composite
def shape_like(draw, shape):
    """`shape`, or now and then with one dimension changed, dropped or added."""
    shape = list(shape)
    how = rarely(draw, "same", st.sampled_from(["change", "drop", "add"]), one_in=16)
    if how == "change" and shape:
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(0, 9))
    elif how == "drop" and shape:
        shape.pop(draw(st.integers(0, len(shape) - 1)))
    elif how == "add":
        shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(1, 3)))
    return tuple(shape)


@st.composite
def tensors(draw, shape, dtype=torch.bfloat16, device="cpu", values=None, dtypes=FLOATS):
    """A tensor of `shape` (now and then perturbed by shape_like), `dtype` (now and then one of
    `dtypes`), on `device` (now and then the other one), mostly contiguous (now and then strided,
    transposed, expanded or misaligned); filled from the strategy `values` when given (CPU)."""
    shape = draw(shape_like(shape))
    dtype = rarely(draw, dtype, st.sampled_from(dtypes), one_in=16)
    device = rarely(draw, device, st.just("meta" if device == "cpu" else "cpu"), one_in=16)
    layout = rarely(draw, "contiguous", st.sampled_from(LAYOUTS), one_in=8)
    n = len(shape)
    make = lambda s: torch.zeros(s, dtype=dtype, device=device)  # noqa: E731
    if layout == "strided" and n:
        dim = draw(st.integers(0, n - 1))
        wide = list(shape)
        wide[dim] *= 2
        t = make(wide)[(slice(None),) * dim + (slice(None, None, 2),)]  # every other element
    elif layout == "transposed" and n >= 2:
        i, j = draw(st.permutations(range(n)))[:2]
        swapped = list(shape)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        t = make(swapped).transpose(i, j)
    elif layout == "expanded" and n and shape[0] != 1:
        t = make((1, *shape[1:])).expand(*shape)
    elif layout == "misaligned":
        t = make((math.prod(shape) + 1,))[1:].view(shape)  # one element past an aligned base
    else:
        t = make(shape)
    if values is not None and t.device.type == "cpu" and t.numel() and not t.stride().count(0):
        t.copy_(torch.tensor(draw(st.lists(values, min_size=t.numel(), max_size=t.numel())),
                             dtype=torch.float64).view(t.shape))
    return t


@st.composite
def scalars(draw):
    """Keyword arguments every attention entry point takes, with odd values now and then."""
    return {
        "causal": draw(st.booleans()),
        "softmax_scale": rarely(draw, None, st.sampled_from([0.125, 0.0, -1.0, float("nan"), float("inf")])),
        "window_size": rarely(draw, (-1, -1), st.sampled_from([(16, 0), (0, 0), (-2, 3), (5,), "ab",
                                                               (100000, 100000)]), one_in=6),
        "softcap": rarely(draw, 0.0, st.sampled_from([5.0, -1.0, float("nan"), float("inf")]), one_in=6),
    }


@st.composite
def attention_args(draw):
    device = draw(st.sampled_from(["cpu", "meta"]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    batch, sq, sk = draw(st.integers(0, 3)), draw(st.integers(0, 70)), draw(st.integers(0, 70))
    hkv = draw(st.sampled_from([1, 2, 3]))
    hq, d = hkv * draw(st.sampled_from([1, 2, 4])), rarely(draw, 128, st.sampled_from(HEAD_DIMS), one_in=3)
    q = draw(tensors((batch, sq, hq, d), dtype, device))
    k = draw(tensors((batch, sk, hkv, d), dtype, device))
    args = {"q": q, "k": k, "v": draw(st.sampled_from([k, draw(tensors((batch, sk, hkv, d), dtype, device))])),
            **draw(scalars())}
    if draw(st.booleans()):
        args["out"] = draw(tensors(tuple(q.shape), q.dtype, device))
    args["kernel"] = rarely(draw, None, st.sampled_from(RUNGS), one_in=4)
    args["return_lse"] = draw(st.booleans())
    return args


def offsets(total, batch):
    """Valid cumulative offsets of `batch` lengths summing to `total`, or random values."""
    lengths = st.lists(st.integers(0, total), min_size=batch, max_size=batch)
    valid = lengths.map(lambda ls: [0] + [min(total, sum(ls[:i + 1])) for i in range(len(ls) - 1)] + [total]
                        if ls else [total])
    return st.one_of(valid, st.lists(st.integers(-5, total + 5), min_size=batch + 1, max_size=batch + 1))


@st.composite
def varlen_args(draw):
    device = draw(st.sampled_from(["cpu", "meta"]))
    tq, tk, batch = draw(st.integers(0, 90)), draw(st.integers(0, 90)), draw(st.integers(0, 4))
    hkv = draw(st.sampled_from([1, 2, 3]))
    hq, d = hkv * draw(st.sampled_from([1, 2])), rarely(draw, 128, st.sampled_from(HEAD_DIMS), one_in=3)
    k = draw(tensors((tk, hkv, d), device=device))
    args = {"q": draw(tensors((tq, hq, d), device=device)), "k": k, "v": k}
    for name, total in (("cu_seqlens_q", tq), ("cu_seqlens_k", tk)):
        cu = draw(offsets(total, batch))
        args[name] = rarely(draw, torch.tensor(cu, dtype=torch.int32, device=device),  # in order
                            tensors((len(cu),), torch.int32, device, st.sampled_from(cu), INDEX_DTYPES))
    args["max_seqlen_q"] = draw(st.sampled_from([None, tq, 1]))
    args["max_seqlen_k"] = draw(st.sampled_from([None, tk]))
    args.update(draw(scalars()))
    args["kernel"] = draw(st.sampled_from(RUNGS))
    return args


@st.composite
def kvcache_args(draw):
    device = draw(st.sampled_from(["cpu", "meta"]))
    batch, sq, new = draw(st.integers(0, 3)), draw(st.integers(0, 5)), draw(st.integers(0, 3))
    hkv = draw(st.sampled_from([1, 2]))
    hq, d = hkv * draw(st.sampled_from([1, 4])), rarely(draw, 128, st.sampled_from([64, 96]))
    paged = draw(st.booleans())
    page_size = rarely(draw, 64, st.sampled_from([128, 48]))
    pages_per_seq, num_pages = draw(st.integers(0, 3)), draw(st.integers(0, 8))
    planes, rows = (num_pages, page_size) if paged else (batch, draw(st.integers(0, 130)))
    capacity = pages_per_seq * page_size if paged else rows
    cache = draw(tensors((planes, rows, hkv, d), device=device))
    args = {"q": draw(tensors((batch, sq, hq, d), device=device)), "k_cache": cache,
            "v_cache": draw(st.sampled_from([cache, torch.zeros_like(cache)]))}
    if new or draw(st.booleans()):
        k = draw(tensors((batch, new, hkv, d), device=device))
        args["k"], args["v"] = k, rarely(draw, k, st.none(), one_in=16)
    good = draw(st.booleans())
    lengths = st.integers(0, max(capacity - new, 0)) if good else st.integers(-10, capacity + 10)
    if draw(st.integers(0, 4)) == 0:
        args["cache_seqlens"] = draw(lengths)  # an int
    else:
        args["cache_seqlens"] = draw(tensors((batch,), torch.int32, device, lengths, INDEX_DTYPES))
    if paged:
        entries = st.integers(0, max(num_pages - 1, 0)) if good else st.integers(-3, num_pages + 3)
        args["block_table"] = draw(tensors((batch, pages_per_seq), torch.int32, device, entries, INDEX_DTYPES))
    args.update(draw(scalars()))
    args["num_splits"] = draw(st.sampled_from([0, 1, 3, -1]))
    args["kernel"] = rarely(draw, None, st.sampled_from(["s1", "k2", "bogus"]), one_in=4)
    return args


@st.composite
def gemm_args(draw):
    device = draw(st.sampled_from(["cpu", "meta"]))
    m, k, n = (draw(st.integers(0, 40)) for _ in range(3))
    args = {"a": draw(tensors((m, k), device=device)), "b": draw(tensors((k, n), device=device))}
    if draw(st.booleans()):
        args["out"] = draw(tensors((m, n), device=device))
    args["kernel"] = rarely(draw, None, st.sampled_from(["g3", "k2", "bogus"]), one_in=4)
    return args


# ----------------------------------------------------------------------------- the property
def _outputs(q_like, lse_shape):
    return (torch.empty(q_like.shape, dtype=q_like.dtype, device=q_like.device),
            torch.empty(lse_shape, dtype=torch.float32, device=q_like.device))


# stand-ins for the launches: the outputs, allocated as the real ones are, and no kernel
STAND_INS = {
    (interface, "launch_attention"): lambda spec, q, k, v, *a, **kw: _outputs(q, (q.shape[0], q.shape[2], q.shape[1])),
    (varlen, "launch_varlen"): lambda spec, q, *a, **kw: _outputs(q, (q.shape[1], q.shape[0])),
    (kvcache, "launch_kvcache"): lambda spec, q, *a, **kw: _outputs(q, (q.shape[0], q.shape[2], q.shape[1])),
    (matmul, "launch_gemm"): lambda spec, a, b, out=None: torch.empty(a.shape[0], b.shape[1], dtype=a.dtype,
                                                                       device=a.device),
}


@contextlib.contextmanager
def _mode(mode):
    if mode == "as is":
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_checks, "check_hopper", lambda device, name: None))
        checked = (lambda device: device.type == "cpu") if mode == "checked" else (lambda device: False)
        stack.enter_context(mock.patch.object(index_checks, "values_checkable", checked))
        for (module, name), fn in STAND_INS.items():
            stack.enter_context(mock.patch.object(module, name, fn))
        yield


def runs_or_refuses(fn, mode, **args):
    """fn(**args) runs or raises ValueError/TypeError with a message; as is (CPU and meta tensors
    cannot run), it must refuse."""
    with _mode(mode):
        try:
            fn(**args)
        except (ValueError, TypeError) as exc:
            assert str(exc), f"{type(exc).__name__} without a message"
            hypothesis.event(f"{mode}: refused ({str(exc)[:60]})")  # --hypothesis-show-statistics
            return
    hypothesis.event(f"{mode}: ran")
    assert mode != "as is", "a call on CPU or meta tensors was not refused"


# entry point -> (its arguments, flash-attn's name for it, the arguments that name does not take)
ENTRY_POINTS = {
    "attention": (attention_args, fa3.flash_attn_func, {"out", "kernel", "return_lse"}),
    "attention_varlen": (varlen_args, fa3.flash_attn_varlen_func, {"kernel"}),
    "attention_with_kvcache": (kvcache_args, fa3.flash_attn_with_kvcache, {"kernel"}),
    "gemm": (gemm_args, None, None),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@SETTINGS
@given(data=st.data(), mode=st.sampled_from(MODES), flash=st.booleans())
def test_entry_point_runs_or_refuses(entry, data, mode, flash):
    arguments, flash_fn, not_flash = ENTRY_POINTS[entry]
    args = data.draw(calls(arguments()))
    if flash and flash_fn is not None:  # flash-attn's name for it
        runs_or_refuses(flash_fn, mode, **{k: v for k, v in args.items() if k not in not_flash})
    else:
        runs_or_refuses(getattr(fa3, entry), mode, **args)
