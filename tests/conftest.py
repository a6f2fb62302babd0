"""Shared test setup.

Without a GPU the DSL would compile for sm_100a: pin sm_90a *before* anything imports cutlass.
GPU tests carry the `gpu` marker and skip cleanly unless a Hopper GPU is present.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

from fa3.reference import attention_reference  # noqa: E402

# FA3_VARIANTS="b7p=b7:prefetch_stats=1;b9t=b9:tile_n=64" adds experiment rows
# (benchmarks/variants.py) to the registry before the test modules list its rungs: the GPU
# tests then run a prepared setting like any rung, before it becomes a default.
if os.environ.get("FA3_VARIANTS"):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
    import variants  # noqa: E402

    for _text in filter(None, os.environ["FA3_VARIANTS"].split(";")):
        variants.register(_text)
from fa3.registry import HEAD_DIMS  # noqa: E402  (every head dim the default rungs serve)

# @HEAD_DIM_PARAM on a test: once per head dim, with ids d64 ... d256 (`-k d96` picks one)
HEAD_DIM_PARAM = pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")


MAX_WORKERS = 8  # `-n auto`'s cap: each worker compiles kernels (0.6 GB resident) and, on a GPU, holds a CUDA context


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto` (pytest-xdist; the README's test command): a worker a core, at most
    MAX_WORKERS."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_HOPPER:
            item.add_marker(skip)


@pytest.fixture
def no_device_check(monkeypatch):
    """Let CPU and meta tensors through the Hopper device check, to reach the checks (and fake
    implementations) that come after it."""
    from fa3 import _checks

    monkeypatch.setattr(_checks, "check_hopper", lambda device, name: None)


@pytest.fixture
def cpu_as_hopper(monkeypatch):
    """The CPU device taken for a Hopper GPU of 132 SMs on one stream (handle 7), no graph being
    captured: the host path's memos and plans run on CPU tensors (with kernels the test replaces)."""
    import fa3

    monkeypatch.setitem(fa3._checks.HOPPER_SMS, torch.device("cpu"), 132)
    monkeypatch.setattr(fa3._checks, "check_hopper", lambda device, name: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)  # (CPU builds lack it)


@pytest.fixture(autouse=True)
def settled_index_checks():
    """A test's deferred index checks settle before the next test starts: a bad value a test left
    behind fails that test, not the one after it."""
    yield
    from fa3 import index_checks

    index_checks.check_index_values()


@pytest.fixture
def strict_index_checks():
    """Index values checked within the call (fa3.set_index_checks("strict")): for tests that assert
    a bad value is refused by the call that passes it, before anything is written. The default,
    deferred mode (the error raised by a later call) is tests/test_bad_values.py's and
    tests/test_host_path.py's."""
    import fa3

    previous = fa3.set_index_checks("strict")
    yield
    fa3.set_index_checks(previous)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, computed in float64; NaN anywhere makes it NaN (and fails)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(nbytes=1 << 28):
    """Fill a large block of the caching allocator's memory with NaN and free it: the gradients
    and scratch buffers allocated next reuse it, so anything left unwritten reads as NaN."""
    torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))


def autograd_grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of fn(q, k, v) through autograd, on fresh leaves, the gradients' memory
    poisoned first."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    poison_allocator()
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


def reference_grads(q, k, v, dout, causal, scale, dtype, window=(-1, -1), softcap=0.0):
    """(out, dq, dk, dv) of the reference attention computed in `dtype` (float64: the exact ones)."""
    def fn(q, k, v):
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=dtype,
                                   window_size=window, softcap=softcap)[0]

    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(dtype))
    return out, q.grad, k.grad, v.grad


def assert_close_to_reference(got, exact, low, dtype, floor):
    """(out, dq, dk, dv) against float64, within 2x PyTorch's own error in `dtype` (+ floor)."""
    for name, g, ref, base in zip(("out", "dq", "dk", "dv"), got, exact, low):
        assert g.shape == ref.shape and g.dtype == dtype
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        err, base_err = rel_err(g, ref), rel_err(base.to(ref.dtype), ref)
        assert err <= 2 * base_err + floor, f"{name}: rel err {err:.2e} vs PyTorch {dtype} {base_err:.2e}"
    return got


def raises_with(fn, exc, *words, **call):
    """fn(**call) raises `exc` whose message contains every word of `words`; returns the message."""
    with pytest.raises(exc) as info:
        fn(**call)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in the message: {msg}"
    return msg


# memcheck's options in every test: errors of the CUDA API calls that the DSL's compiler makes
# (probing the driver while it builds a kernel that is not in the disk cache yet) are not memory
# errors; the tests count memory errors only.
MEMCHECK = ["--tool", "memcheck", "--report-api-errors", "no"]
RACECHECK = ["--tool", "racecheck", "--racecheck-report", "hazard"]


def racecheck_clean(report: str) -> bool:
    """Whether a racecheck run reported no hazard: its summary line reads exactly "RACECHECK
    SUMMARY: 0 hazards displayed (0 errors, ...". (A bare "0 hazards displayed" also matches
    "100 hazards displayed": the check the tests used to make passed with thousands of them.)"""
    import re

    return re.search(r"RACECHECK SUMMARY: 0 hazards displayed \(0 errors", report) is not None


def compute_sanitizer():
    """The path of NVIDIA's compute-sanitizer, or None where it is not installed."""
    import shutil

    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


# Python source for the subprocess scripts of the bad-index-value tests (test_bad_values.py,
# test_sanitizer.py), after `import torch`: the small problems whose index tensors they corrupt.
INDEX_PROBLEMS = r'''
g = torch.Generator(device="cuda").manual_seed(0)
rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
i32 = lambda *values: torch.tensor(values, dtype=torch.int32, device="cuda")


def index_problem(entry):
    """((q, k, v), args): a packed batch of two sequences (entry "varlen"), one query token
    against a dense or a paged KV cache ("dense"; "paged": pages of 64, "paged16": of 16; k and v
    being the caches), or packed queries over a paged cache ("cachevarlen"; "cachechunks": one
    entry long enough for K5; "cachemany": 150 decodes, which S1 takes longest first); `args`
    holds the index tensors by argument name."""
    if entry == "varlen":
        return ((rand(300, 4, 128), rand(300, 2, 128), rand(300, 2, 128)),
                {"cu_seqlens_q": i32(0, 100, 300), "cu_seqlens_k": i32(0, 100, 300)})
    if entry == "cachevarlen":  # packed queries (2 and 3 tokens) over a cache of pages of 16
        k_cache = rand(32, 16, 2, 128)
        return ((rand(5, 8, 128), k_cache, rand(*k_cache.shape)),
                {"cu_seqlens_q": i32(0, 2, 5), "seqused_k": i32(10, 192),
                 "block_table": torch.arange(32, dtype=torch.int32, device="cuda").view(2, 16)})
    if entry == "cachechunks":  # a 200-token prompt chunk (K5) and a decode (S1) over pages of 16
        k_cache = rand(64, 16, 2, 128)
        return ((rand(201, 8, 128), k_cache, rand(*k_cache.shape)),
                {"cu_seqlens_q": i32(0, 200, 201), "seqused_k": i32(300, 192),
                 "block_table": torch.arange(64, dtype=torch.int32, device="cuda").view(2, 32)})
    if entry == "cachemany":  # 150 decodes over pages of 16: more S1 CTAs than a wave, so sorted
        k_cache = rand(300, 16, 2, 128)
        return ((rand(150, 8, 128), k_cache, rand(*k_cache.shape)),
                {"cu_seqlens_q": torch.arange(151, dtype=torch.int32, device="cuda"),
                 "seqused_k": torch.arange(150, dtype=torch.int32, device="cuda") * 7 % 32 + 1,
                 "block_table": torch.arange(300, dtype=torch.int32, device="cuda").view(150, 2)})
    paged = entry in ("paged", "paged16")
    page = 16 if entry == "paged16" else 64
    k_cache = rand(512 // page, page, 2, 128) if paged else rand(2, 256, 2, 128)
    table = torch.arange(512 // page, dtype=torch.int32, device="cuda").view(2, -1) if paged else None
    return ((rand(2, 1, 8, 128), k_cache, rand(*k_cache.shape)),
            {"cache_seqlens": i32(10, 192), "block_table": table})
'''


def run_script(tmp_path, script: str, *args, sanitizer=None, timeout=900) -> str:
    """Run `script` (Python source) in a fresh process with `args`, under compute-sanitizer with the
    options `sanitizer` (a list, e.g. ["--tool", "racecheck"]; None: plainly), with this checkout's
    fa3 importable; returns stdout + stderr (a process that a bad access ends cannot take pytest
    with it)."""
    import subprocess
    import sys

    path = tmp_path / "script.py"
    path.write_text(script)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(path), *args]
    if sanitizer is not None:
        tool = compute_sanitizer()
        assert tool is not None, "compute-sanitizer is not installed: check compute_sanitizer() first"
        command = [tool, *sanitizer, *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    return proc.stdout + proc.stderr


def make_kv_cache(batch, capacity, heads_kv, d, lens, page_size, gen, device="cuda", d_v=None):
    """Dense (batch, capacity, ...) bf16 K/V (V's head dim d_v, default d) with NaN past each
    length, and the same as permuted pages with a block table when page_size is given. Returns
    (k_dense, v_dense, k_cache, v_cache, table)."""
    k = torch.randn(batch, capacity, heads_kv, d, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, capacity, heads_kv, d_v or d, device=device, dtype=torch.bfloat16, generator=gen)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    if page_size is None:
        return k, v, k, v, None
    per_seq = capacity // page_size
    perm = torch.randperm(batch * per_seq, device=device, generator=gen)
    table = perm.view(batch, per_seq).to(torch.int32)
    pages_k = torch.empty(batch * per_seq, page_size, heads_kv, d, device=device, dtype=k.dtype)
    pages_v = torch.empty(batch * per_seq, page_size, heads_kv, v.shape[3], device=device, dtype=v.dtype)
    pages_k[perm] = k.view(pages_k.shape)
    pages_v[perm] = v.view(pages_v.shape)
    return k, v, pages_k, pages_v, table


def cache_reference(q, k_dense, v_dense, lens, causal, window_size=(-1, -1), softcap=0.0):
    """(out, lse) of each batch entry against its first lens[b] keys, by fa3.reference."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = attention_reference(q[b:b + 1], k_dense[b:b + 1, :n], v_dense[b:b + 1, :n], causal,
                                     window_size=window_size, softcap=softcap)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
