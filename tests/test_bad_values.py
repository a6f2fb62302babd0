"""Bad values of the index arguments (cache_seqlens, block_table, cu_seqlens_q/k, an append past
the capacity): eager calls refuse them with a ValueError naming the argument, the entry, the value
and the bound; captured calls (no host reads there) run with clamped values, touching no memory
outside their tensors; and the CUDA context survives either way.

CPU: the host checks (fa3.index_checks) on CPU tensors, and the append's index clamping.
GPU: each bad value in its own process (under compute-sanitizer's memcheck where installed):
(a) the eager call raises ValueError with the message (a refused append writes nothing), (b) a
CUDA graph captured with good values and replayed with the bad one completes, (c) a good call
afterwards runs; memcheck must report 0 errors. (memcheck sees accesses outside an allocation; the
caching allocator keeps several tensors in one, so a read a little past a tensor may go unseen.)
"""

import json

import pytest
import torch

import fa3
from fa3 import _checks, index_checks
from fa3.cache import append as cache_append

from conftest import INDEX_PROBLEMS, MEMCHECK, compute_sanitizer, raises_with, run_script

BF16 = torch.bfloat16
CAPACITY, PAGE, PAGES = 256, 64, 8  # two sequences; paged: 4 pages of 64 each, 8 in the pool


# ----------------------------------------------------------------------------- CPU: host checks
def _lengths(*values):
    return torch.tensor(values, dtype=torch.int32)


def _check(seqlens, table=None, appended=0, num_pages=PAGES):
    """start_cache_check then wait, on CPU tensors (the same code as on the GPU, without the event)."""
    page_size = CAPACITY if table is None else PAGE
    capacity = CAPACITY if table is None else table.shape[1] * PAGE
    index_checks.start_cache_check(seqlens, table, capacity, appended, page_size, num_pages)()


def _bad(words, *args, **kw):
    with pytest.raises(ValueError) as info:
        _check(*args, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"
    return str(info.value)


def _table(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_good_values_pass():
    _check(_lengths(0, 256))
    _check(_lengths(254, 0), appended=2)
    _check(_lengths(256, 0), _table([0, 1, 2, 3], [4, 5, 6, 7]))
    # entries past a sequence's used pages are never read: stale or -1 is fine (serving engines)
    _check(_lengths(64, 65), _table([7, -1, -1, 100000], [0, 1, -1, -1]))
    _check(_lengths(63, 0), _table([7, -1, -1, -1], [0, -1, -1, -1]), appended=1)
    _check(_lengths(0, 0), _table([-1, -1, -1, -1], [-1, -1, -1, -1]), num_pages=0)
    _check(_lengths())  # an empty batch


def test_unchanged_values_are_not_copied_again(monkeypatch):
    """The layers of a decode step pass the same tensors: only the first call copies them. Any
    in-place change (torch's version counter), another tensor or other bounds copies again."""
    copies = []
    start_host_copy = index_checks.start_host_copy
    monkeypatch.setattr(index_checks, "start_host_copy", lambda ts: copies.append(1) or start_host_copy(ts))
    seqlens, table = _lengths(64, 65), _table([0, 1, 2, 3], [4, 5, 6, 7])
    for _ in range(3):
        _check(seqlens, table)
    assert len(copies) == 1
    _check(seqlens, table, appended=1)  # other bounds
    assert len(copies) == 2
    table[1, 1] = 100000  # in place, used by sequence 1: refused even though the object is the same
    _bad(["block_table[1, 1] = 100000"], seqlens, table)
    _bad(["block_table[1, 1] = 100000"], seqlens, table)  # a failed check is never remembered
    table[1, 1] = 5
    _check(seqlens, table)
    seqlens[0] = -3
    _bad(["cache_seqlens[0] = -3"], seqlens, table)
    _check(_lengths(64, 65), _table([0, 1, 2, 3], [4, 5, 6, 7]))  # new tensors: copied, checked
    with torch.inference_mode():  # no version counter: copied every time
        seqlens, table = _lengths(64, 65), _table([0, 1, 2, 3], [4, 5, 6, 7])
    before = len(copies)
    _check(seqlens, table)
    _check(seqlens, table)
    assert len(copies) == before + 2


def test_unchanged_offsets_are_not_copied_again(monkeypatch):
    """attention_varlen's offsets through the same memo: a packed model's layers pass the same
    cu_seqlens, so only the first call syncs; an in-place change or other bounds checks again."""
    copies = []
    start_host_copy = index_checks.start_host_copy
    monkeypatch.setattr(index_checks, "start_host_copy", lambda ts: copies.append(1) or start_host_copy(ts))
    cu_q, cu_k = (torch.tensor(v, dtype=torch.int32) for v in ([0, 3, 7], [0, 5, 9]))
    for _ in range(3):
        index_checks.start_offsets_check(cu_q, cu_k, 7, 9, None, None)()
    assert len(copies) == 1
    index_checks.start_offsets_check(cu_q, cu_k, 7, 9, 4, None)()  # other bounds
    assert len(copies) == 2
    cu_k[1] = 10  # in place: refused although the objects are the same
    for _ in range(2):  # a failed check is never remembered
        with pytest.raises(ValueError, match=r"cu_seqlens_k decreases at entry 2 \(10 -> 9\)"):
            index_checks.start_offsets_check(cu_q, cu_k, 7, 9, 4, None)()
    assert len(copies) == 4


def test_remembered_check_asks_nothing_else(monkeypatch):
    """A call that passes the remembered tensors, unmodified, reuses the check without asking
    whether values may be read now (that question costs an eager decode call more host time than
    the memo); a miss asks, and a no (as under CUDA-graph capture) copies and checks nothing."""
    seqlens, table = _lengths(64, 65), _table([0, 1, 2, 3], [4, 5, 6, 7])
    asked, readable = [], [True]
    monkeypatch.setattr(index_checks, "values_checkable", lambda device: asked.append(device) or readable[0])

    def start(lengths, tbl):
        return index_checks.start_cache_check(lengths, tbl, 4 * PAGE, 0, PAGE, PAGES, torch.device("cpu"))
    start(seqlens, table)()
    start(seqlens, table)()
    assert len(asked) == 1
    bad = _table([0, 1, 2, 3], [4, 100000, 6, 7])  # sequence 1 uses its first two pages
    readable[0] = False
    start(seqlens, bad)()  # not readable now: no copy, no error (the kernel clamps)
    readable[0] = True
    with pytest.raises(ValueError, match="block_table"):
        start(seqlens, bad)()
    assert len(asked) == 3


def test_bad_cache_seqlens():
    _bad(["cache_seqlens[0] = 100000", "capacity of 256", "k_cache.shape[1] = 256", "[0, 256]"],
         _lengths(100000, 3))
    _bad(["cache_seqlens[1] = -7", "negative", "[0, 256]"], _lengths(3, -7))
    _bad(["cache_seqlens[0] = 257", "block_table.shape[1] * page_size = 4 * 64"],
         _lengths(257, 3), _table([0, 1, 2, 3], [4, 5, 6, 7]))


def test_append_past_capacity():
    _bad(["cache_seqlens[1] = 255", "2 new tokens", "is 257", "<= 256"], _lengths(3, 255), appended=2)
    _bad(["cache_seqlens[0] = 250", "8 new tokens", "<= 256"], _lengths(250, 0),
         _table([0, 1, 2, 3], [4, 5, 6, 7]), appended=8)


def test_bad_block_table():
    table = _table([0, 1, 2, 3], [4, 5, 6, 7])
    for value in (100000, -7, PAGES):
        bad = table.clone()
        bad[1, 0] = value
        _bad([f"block_table[1, 0] = {value}", "num_pages = k_cache.shape[0] = 8", "[0, 8)"],
             _lengths(10, 192), bad)
    bad = table.clone()
    bad[1, 3] = 100000  # read only by the appended tokens (positions 192, 193)
    _check(_lengths(10, 192), bad)
    _bad(["block_table[1, 3] = 100000"], _lengths(10, 192), bad, appended=2)


def test_int_cache_seqlens_checked_in_every_call():
    q = torch.randn(2, 1, 8, 128, dtype=BF16)
    kc = torch.randn(2, CAPACITY, 2, 128, dtype=BF16)
    call = {"q": q, "k_cache": kc, "v_cache": kc}
    raises_with(fa3.attention_with_kvcache, ValueError, "cache_seqlens = 100000", "capacity of 256",
                cache_seqlens=100000, **call)
    raises_with(fa3.attention_with_kvcache, ValueError, "cache_seqlens = -7", "negative", cache_seqlens=-7,
                **call)


@pytest.mark.parametrize("paged", [False, True])
def test_append_clamps_unchecked_values(paged):
    """Under capture nothing is checked: the append's indices are clamped into the cache (torch's
    index ops would assert on the device; on CPU they raise IndexError)."""
    new = 2
    k = torch.randn(2, new, 2, 8)
    if paged:
        cache = torch.zeros(PAGES, PAGE, 2, 8)
        table = _table([0, 1, 2, 3], [-7, 100000, 6, 7])
        seqlens = _lengths(100000, 0)
    else:
        cache, table, seqlens = torch.zeros(2, CAPACITY, 2, 8), None, _lengths(-7, 100000)
    v_cache = torch.zeros_like(cache)
    cache_append.append_to_cache(cache, v_cache, k, k, seqlens, table, CAPACITY)
    if paged:  # entry 0 at the end of its last page (3); entry 1's page -7 clamped to page 0
        assert torch.equal(cache[3, PAGE - new:], k[0]) and torch.equal(cache[0, :new], k[1])
    else:  # -7 -> position 0; 100000 -> the last `new` positions
        assert torch.equal(cache[0, :new], k[0]) and torch.equal(cache[1, CAPACITY - new:], k[1])
    assert torch.equal(v_cache, cache)


def test_eager_append_refused_before_writing(monkeypatch):
    """The eager check waits for its values before the append: a refused call leaves the cache as
    it was (CPU tensors let through the device checks)."""
    monkeypatch.setattr(_checks, "check_hopper", lambda device, name: None)
    monkeypatch.setattr(index_checks, "values_checkable", lambda device: True)
    kc, vc = torch.zeros(PAGES, PAGE, 2, 128, dtype=BF16), torch.zeros(PAGES, PAGE, 2, 128, dtype=BF16)
    k = torch.randn(2, 2, 2, 128, dtype=BF16)
    table = _table([0, 1, 2, 3], [4, 5, 6, 100000])
    raises_with(fa3.attention_with_kvcache, ValueError, "block_table[1, 3] = 100000",
                q=torch.randn(2, 1, 8, 128, dtype=BF16), k_cache=kc, v_cache=vc, k=k, v=k,
                cache_seqlens=_lengths(10, 192), block_table=table)
    assert not kc.any() and not vc.any()


def test_host_lengths_need_no_device_copy(monkeypatch):
    """An int cache_seqlens over a dense cache is checked on the host (check_kvcache): the call
    starts no device-to-host copy (and so no sync) for it; a tensor of lengths is copied."""
    from fa3 import kvcache

    copies = []
    monkeypatch.setattr(_checks, "check_hopper", lambda device, name: None)
    monkeypatch.setattr(index_checks, "values_checkable", lambda device: True)
    monkeypatch.setattr(index_checks, "start_host_copy", lambda tensors: copies.append(len(tensors)) or
                        ([t.clone() for t in tensors], lambda: None))
    monkeypatch.setattr(kvcache, "launch_kvcache", lambda spec, q, *a, **kw: (torch.zeros_like(q), None))
    kc = torch.zeros(2, CAPACITY, 2, 128, dtype=BF16)
    q = torch.randn(2, 1, 8, 128, dtype=BF16)
    fa3.attention_with_kvcache(q, kc, kc, cache_seqlens=100)
    assert copies == []
    raises_with(fa3.attention_with_kvcache, ValueError, "cache_seqlens", q=q, k_cache=kc, v_cache=kc,
                cache_seqlens=CAPACITY + 1)
    fa3.attention_with_kvcache(q, kc, kc, cache_seqlens=_lengths(100, 7))
    assert copies == [1]


def _deferrable_copies(monkeypatch):
    """CPU stand-ins for the device copies (whose completion the list `done` controls), and every
    device readable: the deferred path as a GPU call takes it. Returns (done, copies)."""
    done, copies = [False], []

    class Copy(index_checks._Staging):
        def __init__(self):
            pass

        def __call__(self):
            done[0] = True

        def done(self):
            return done[0]

        def release(self):
            pass

    monkeypatch.setattr(index_checks, "start_host_copy",
                        lambda ts: copies.append(1) or ([t.clone() for t in ts], Copy()))
    monkeypatch.setattr(index_checks, "values_checkable", lambda device: True)
    return done, copies


def _start(seqlens, table=None, appended=0):
    page_size = CAPACITY if table is None else PAGE
    capacity = CAPACITY if table is None else table.shape[1] * PAGE
    return index_checks.start_cache_check(seqlens, table, capacity, appended, page_size, PAGES, torch.device("cpu"))


@pytest.fixture
def index_mode():
    """Restores the index-check mode a test sets."""
    previous = index_checks.set_index_checks(index_checks.DEFERRED)
    yield index_checks.set_index_checks
    index_checks.set_index_checks(previous)


def test_deferred_checks_raise_later_without_waiting(monkeypatch, index_mode):
    """Deferred (the default): the call returns at once; the first later call that finds the copy
    done raises (raise_pending never waits); check_index_values waits; each bad value is reported
    once, and its check forgotten (the same tensors, still bad, are copied and refused again)."""
    done, copies = _deferrable_copies(monkeypatch)
    seqlens = _lengths(100000, 3)
    _start(seqlens)()  # nothing raised, nothing waited for
    assert copies == [1]
    index_checks.raise_pending()  # the copy is not done: nothing to say yet
    done[0] = True
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 100000 .*found after the fa3 call"):
        index_checks.raise_pending()
    index_checks.raise_pending()
    index_checks.check_index_values()  # reported once
    done[0] = False
    _start(seqlens, appended=0)()
    assert copies == [1, 1]  # the failed check was not remembered
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 100000"):
        index_checks.check_index_values()  # waits for the copy (done[0] becomes True)
    good = _lengths(3, 4)
    done[0] = False
    for _ in range(3):  # a model's layers: one copy, remembered while it is pending
        _start(good)()
    assert copies == [1, 1, 1]
    index_checks.check_index_values()


def test_deferred_checks_raise_in_order_and_bound_the_queue(monkeypatch, index_mode):
    """Checks settle in the order their calls came; past MAX_PENDING the oldest is waited for."""
    done, _ = _deferrable_copies(monkeypatch)
    _start(_lengths(3, -7))()
    _start(_lengths(100000, 3))()
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -7"):
        index_checks.check_index_values()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 100000"):
        index_checks.check_index_values()
    monkeypatch.setattr(index_checks, "MAX_PENDING", 2)
    done[0] = False
    for n in range(3):
        _start(_lengths(n, n))()
    assert done[0]  # the third waited for the first
    index_checks.check_index_values()


def test_strict_and_off_modes(monkeypatch, index_mode):
    """strict: the call's wait raises (after waiting for its copy); off: nothing is copied."""
    done, copies = _deferrable_copies(monkeypatch)
    index_mode(index_checks.STRICT)
    wait = _start(_lengths(3, 257))
    assert not done[0]
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 257"):
        wait()
    index_mode(index_checks.OFF)
    _start(_lengths(3, 257))()
    assert copies == [1]
    index_checks.check_index_values()
    with pytest.raises(ValueError, match="mode='eager'.*deferred"):
        index_mode("eager")


# ----------------------------------------------------------------------------- GPU: subprocesses
# name -> (entry, argument, index, bad value, new tokens appended, words of the eager message)
CASES = {
    "dense-seqlens-past-capacity": ("dense", "cache_seqlens", 0, 100000, 0,
                                    ["cache_seqlens[0] = 100000", "capacity of 256"]),
    "dense-seqlens-negative": ("dense", "cache_seqlens", 1, -7, 0, ["cache_seqlens[1] = -7", "negative"]),
    "dense-append-past-capacity": ("dense", "cache_seqlens", 1, 255, 2, ["cache_seqlens[1] = 255", "is 257"]),
    "paged-seqlens-past-capacity": ("paged", "cache_seqlens", 0, 100000, 0,
                                    ["cache_seqlens[0] = 100000", "4 * 64"]),
    "paged-seqlens-negative": ("paged", "cache_seqlens", 1, -7, 0, ["cache_seqlens[1] = -7", "negative"]),
    "paged-append-past-capacity": ("paged", "cache_seqlens", 1, 255, 2, ["cache_seqlens[1] = 255", "is 257"]),
    "paged-table-past-pool": ("paged", "block_table", [1, 0], 100000, 0,
                              ["block_table[1, 0] = 100000", "num_pages = k_cache.shape[0] = 8"]),
    "paged-table-negative": ("paged", "block_table", [0, 0], -7, 0, ["block_table[0, 0] = -7"]),
    "paged-append-into-bad-page": ("paged", "block_table", [1, 3], 100000, 2, ["block_table[1, 3] = 100000"]),
    "varlen-cu-k-past-total": ("varlen", "cu_seqlens_k", 2, 100000, 0,
                               ["cu_seqlens_k[-1] = 100000", "k.shape[0] = 300"]),
    "varlen-cu-k-decreasing": ("varlen", "cu_seqlens_k", 1, 100000, 0, ["cu_seqlens_k decreases at entry 2"]),
    "varlen-cu-q-negative": ("varlen", "cu_seqlens_q", 1, -7, 0, ["cu_seqlens_q decreases at entry 1"]),
    # pages of 16 (row gathers): the same bounds, read row by row
    "paged16-seqlens-past-capacity": ("paged16", "cache_seqlens", 0, 100000, 0,
                                      ["cache_seqlens[0] = 100000", "16 * 16"]),
    "paged16-table-past-pool": ("paged16", "block_table", [1, 0], 100000, 0,
                                ["block_table[1, 0] = 100000", "num_pages = k_cache.shape[0] = 32"]),
    "paged16-table-negative": ("paged16", "block_table", [0, 0], -7, 0, ["block_table[0, 0] = -7"]),
    "paged16-append-into-bad-page": ("paged16", "block_table", [1, 12], 100000, 2, ["block_table[1, 12] = 100000"]),
    # packed queries over a paged cache (vLLM's call)
    "cachevarlen-cu-q-decreasing": ("cachevarlen", "cu_seqlens_q", 1, 100000, 0,
                                    ["cu_seqlens_q decreases at entry 2"]),
    "cachevarlen-seqused-past-capacity": ("cachevarlen", "seqused_k", 1, 100000, 0, ["seqused_k[1] = 100000"]),
    "cachevarlen-table-past-pool": ("cachevarlen", "block_table", [1, 3], 100000, 0,
                                    ["block_table[1, 3] = 100000"]),
}

GPU_SCRIPT = r'''
import json, sys
import torch
import fa3
''' + INDEX_PROBLEMS + r'''
entry, argument, index, value, new, words = json.loads(sys.argv[1])
index = tuple(index) if isinstance(index, list) else index
(q, k, v), args = index_problem(entry)
if entry == "varlen":
    call = lambda: fa3.attention_varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], causal=True)
    caches = []
elif entry == "cachevarlen":
    call = lambda: fa3.attention_varlen(q, k, v, args["cu_seqlens_q"], None, 3, 256, causal=True,
                                        block_table=args["block_table"], seqused_k=args["seqused_k"])
    caches = [k, v]
else:
    k_new = rand(2, new, 2, 128) if new else None
    v_new = rand(2, new, 2, 128) if new else None
    call = lambda: fa3.attention_with_kvcache(q, k, v, k_new, v_new, causal=True,
                                              cache_seqlens=args["cache_seqlens"],
                                              block_table=args["block_table"])
    caches = [k, v]
good = args[argument].clone()
expected = call()  # compiles, with good values
torch.cuda.synchronize()

def refused(run, when):
    """The ValueError that run() raises, with the case's words; `when` names the step."""
    try:
        run()
    except ValueError as exc:
        message = str(exc)
    else:
        raise SystemExit(f"FAIL: {when}: the bad value was not reported")
    missing = [w for w in words if w not in message]
    assert not missing, f"{when}: {missing} not in the message: {message}"
    return message


# (a) eager, strict: refused in the call, naming the value; a refused append writes nothing
before = [c.clone() for c in caches]
args[argument][index] = value
previous = fa3.set_index_checks("strict")
message = refused(call, "strict")
fa3.set_index_checks(previous)
torch.cuda.synchronize()
assert all(torch.equal(a, b) for a, b in zip(before, caches)), "the refused call wrote into the cache"
print("strict:", message)

# (a') eager, deferred (the default): the call returns (its kernels clamp), and the error comes
# from fa3.check_index_values(), or from the next call once the copy is done; no sync in the call
for caught_by in ("check_index_values", "next call"):
    for c, b in zip(caches, before):
        c.copy_(b)
    torch.cuda.set_sync_debug_mode("error")
    call()
    torch.cuda.set_sync_debug_mode(0)
    if caught_by == "check_index_values":
        message = refused(fa3.check_index_values, caught_by)
    else:
        torch.cuda.synchronize()
        message = refused(call, caught_by)
    assert "found after the fa3 call" in message, message
    fa3.check_index_values()  # nothing left pending
print("deferred:", message)

# (b) captured with good values, replayed with the bad one: clamped, no error
args[argument].copy_(good)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = call()
args[argument][index] = value
for _ in range(2):
    graph.replay()
torch.cuda.synchronize()
print("replayed with the bad value")

# (c) the context still works
args[argument].copy_(good)
after = call()
torch.cuda.synchronize()
assert torch.isfinite(after).all() and torch.isfinite(expected).all()
print("done")
'''


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_bad_value_on_gpu(case, tmp_path):
    tool = compute_sanitizer()
    report = run_script(tmp_path, GPU_SCRIPT, json.dumps(CASES[case]),
                        # memory errors only: driver-API lookups (cuGetProcAddress) that fail
                        # by design are not what this test is about
                        sanitizer=MEMCHECK if tool else None)
    assert "done" in report and "FAIL" not in report, report[-4000:]
    if tool:
        assert "ERROR SUMMARY: 0 errors" in report, report[-4000:]
