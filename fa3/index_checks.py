"""Checks of the values of index arguments: cu_seqlens_q/k, cache_seqlens, block_table and the like.

Kernels read these on the GPU, and a bad value would send a load or a store outside its tensor, so
the kernels clamp every index they read: lengths to [0, capacity], page indices to [0, num_pages),
query offsets into q's rows, and an append's first position to [0, capacity - new_tokens]
(fa3.cache.append.append_to_cache). Clamped values give meaningless results, never reads or writes
outside the tensors, and the CUDA context survives.

What the user is told (set_index_checks): an eager call copies the values to pinned host memory
behind its kernels and does not wait ("deferred", the default); the first fa3 call of the thread
that finds the copy done checks them, and raises ValueError naming the argument, the entry, the
value, the bound and the fix (before that call runs); check_index_values() waits and raises the
same. "strict" waits for the copy in the call and raises before it returns (an append or an out=
is refused before anything is written): one host sync, for debugging. "off" never reads values.
A call that passes the tensors the last check saw, unmodified, copies nothing (_start_check): the
layers of a model pass the same offsets and cache lengths. Nothing may read values while a CUDA graph is captured or
torch.compile traces, nor in direct calls of the torch.ops.fa3 ops: there only the clamps apply.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import NamedTuple

import torch

from . import _checks, _dispatch


def values_checkable(device: torch.device) -> bool:
    """Whether the host may read index values now: tensors on a CUDA device (CPU and meta tensors
    never reach a kernel), outside torch.compile tracing, dispatch modes (FakeTensorMode's tensors
    hold no values) and CUDA-graph capture."""
    return device.type == "cuda" and not (_dispatch.tracing() or _dispatch.dispatch_modes()
                                          or torch.cuda.is_current_stream_capturing())


# ----------------------------------------------------------------------------- packed batches
def check_offset_values(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """Offsets start at 0, never decrease and end at the packed length; one small copy to the
    host (callers skip it where values_checkable says no: nothing may sync there)."""
    values = torch.cat([cu_q, cu_k]).tolist()
    n = cu_q.shape[0]
    check_offset_list("cu_seqlens_q", values[:n], total_q, "q.shape[0]", max_seqlen_q, "max_seqlen_q")
    check_offset_list("cu_seqlens_k", values[n:], total_k, "k.shape[0]", max_seqlen_k, "max_seqlen_k")


def check_offset_list(name, cu, total, total_name, max_len=None, max_name=None):
    """Host offsets (a list) `name`: start at 0, never decrease, end at `total` (`total_name`), no
    entry longer than max_len (None: unbounded)."""
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] == 0 and cu[-1] == total and (not lengths or (min(lengths) >= 0 and (max_len is None
                                                                                  or max(lengths) <= max_len))):
        return  # good offsets (most calls): no search for the first bad entry
    if cu[0] != 0:
        raise ValueError(f"{name}[0] = {cu[0]}; offsets start at 0")
    bad = next((i for i, length in enumerate(lengths) if length < 0), None)
    if bad is not None:
        raise ValueError(f"{name} decreases at entry {bad + 1} ({cu[bad]} -> {cu[bad + 1]}); "
                         "offsets must be non-decreasing (a cumulative sum of lengths)")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]} but {total_name} = {total}; the last offset is "
                         "the packed length")
    if lengths and max_len is not None and max(lengths) > max_len:
        raise ValueError(f"{max_name}={max_len} but a sequence has {max(lengths)} tokens")


def start_offsets_check(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k, device=None):
    """check_offset_values through _start_check: the copy and the sync only when these offsets
    were not the last ones checked (a packed model's layers, and its backward, pass the same
    cu_seqlens: only the first call pays). Returns `wait`, which checks (raising ValueError)."""
    return _start_check([cu_q, cu_k], ("offsets", total_q, total_k, max_seqlen_q, max_seqlen_k),
                        lambda host: check_offset_values(host[0], host[1], total_q, total_k, max_seqlen_q,
                                                         max_seqlen_k), device)


def check_packed_offsets(cu_q, cu_k, device, total_q, total_k, max_seqlen_q, max_seqlen_k,
                         check_values=True) -> None:
    """A packed batch's offsets (attention_varlen, bf16 and FP8): int32 (batch + 1,) on `device`,
    and (check_values, where values_checkable) their values."""
    _checks.check_offsets(cu_q, "cu_seqlens_q", device)
    _checks.check_offsets(cu_k, "cu_seqlens_k", device, batch=cu_q.shape[0] - 1)
    if check_values and values_checkable(device):  # (the memo skips offsets just checked)
        start_offsets_check(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k)()


# ----------------------------------------------------------------------------- KV caches
def _capacity_source(block_table, page_size: int) -> str:
    if block_table is None:
        return f"k_cache.shape[1] = {page_size}"
    return f"block_table.shape[1] * page_size = {block_table.shape[1]} * {page_size}"


def check_cache_lengths(lengths, capacity: int, appended, block_table, page_size: int,
                        indexed: bool = True, lengths_name: str = "cache_seqlens") -> None:
    """Host lengths (a list: cache_seqlens per batch entry, or [the int] when `indexed` is False):
    each in [0, capacity], and within it after the append of `appended` new tokens (an int, or a
    list: each entry's, for packed appends).
    `page_size` is k_cache.shape[1] (the dense capacity when block_table is None); the messages
    name the lengths `lengths_name` (attention_varlen's are seqused_k)."""
    if not isinstance(appended, list):
        if min(lengths, default=0) >= 0 and max(lengths, default=0) + appended <= capacity:
            return
        added = [appended] * len(lengths)
    else:
        added = appended
        if min(lengths, default=0) >= 0 and max(map(sum, zip(lengths, added)), default=0) <= capacity:
            return
    for b, (n, appended) in enumerate(zip(lengths, added)):
        if 0 <= n and n + appended <= capacity:
            continue
        name = f"{lengths_name}[{b}]" if indexed else lengths_name
        source = _capacity_source(block_table, page_size)
        bound = f"the cache's capacity of {capacity} tokens per sequence ({source})"
        if n < 0:
            raise ValueError(f"{name} = {n} is negative: it counts the tokens a sequence already holds in "
                             f"the cache, in [0, {capacity}] ({capacity}: the capacity per sequence, "
                             f"{source}); pass each sequence's length")
        if n > capacity:
            raise ValueError(f"{name} = {n} exceeds {bound}: it must be in [0, {capacity}]; pass each "
                             "sequence's length, or allocate a larger cache")
        raise ValueError(f"{name} = {n} plus the {appended} new tokens of k/v is {n + appended}, past "
                         f"{bound}: keep {lengths_name} + new_tokens <= {capacity}, or allocate a larger "
                         "cache (more pages per sequence)")


def _first_bad_page(lengths, table, appended, page_size: int, num_pages: int):
    """(b, j, value) of the first block_table entry a sequence uses that is not a page, or None.
    `table` is a CPU tensor; vectorized, since tables hold thousands of entries."""
    used = (torch.tensor(lengths, dtype=torch.int64) + torch.as_tensor(appended, dtype=torch.int64)
            + page_size - 1) // page_size
    in_use = torch.arange(table.shape[1])[None, :] < used[:, None]
    bad = (in_use & ((table < 0) | (table >= num_pages))).nonzero()
    if bad.shape[0] == 0:
        return None
    b, j = bad[0].tolist()
    return b, j, int(table[b, j])


def check_block_table(lengths, table, appended, page_size: int, num_pages: int,
                      lengths_name: str = "cache_seqlens") -> None:
    """Host values (lengths: a list; table: a CPU tensor or nested lists): the entries each
    sequence uses, the first ceil((cache_seqlens[b] + new_tokens) / page_size) of its row, are
    pages of k_cache; entries past them are not read (serving engines leave them stale or -1)."""
    bad = _first_bad_page(lengths, torch.as_tensor(table), appended, page_size, num_pages)
    if bad is not None:
        b, j, page = bad
        raise ValueError(f"block_table[{b}, {j}] = {page} is not a page of k_cache, which has "
                         f"num_pages = k_cache.shape[0] = {num_pages}; the entries sequence {b} uses (the "
                         f"first ceil(({lengths_name}[{b}] + new_tokens) / page_size)) must be in "
                         f"[0, {num_pages}): fix the table, or allocate the pages it names")


# ----------------------------------------------------------------------------- when values are checked
DEFERRED, STRICT, OFF = "deferred", "strict", "off"
MODES = (DEFERRED, STRICT, OFF)
_mode = os.environ.get("FA3_INDEX_CHECKS", DEFERRED).strip().lower() or DEFERRED
if _mode not in MODES:
    raise ValueError(f"FA3_INDEX_CHECKS={_mode!r}; it must be one of {MODES}")
MAX_PENDING = 64  # deferred checks a thread may have in flight before it waits for the oldest


def set_index_checks(mode: str) -> str:
    """When eager calls check the values of their index tensors (cu_seqlens_q/k, cache_seqlens,
    seqused_k, block_table, cache_leftpad, cu_seqlens_k_new); returns the mode it replaces.

    "deferred" (the default; FA3_INDEX_CHECKS sets it at import): the call copies the values to
    pinned host memory behind its kernels and returns without waiting; the kernels clamp bad
    values (nothing outside a tensor is read or written). The first fa3 call that finds the copy
    done checks the values and raises ValueError naming the argument, the entry and the value, and
    fa3.check_index_values() waits for every copy and raises the same. No call synchronizes.
    "strict": the call waits for the copy and raises before it returns (an append or an out= is
    refused before anything is written): one host sync per call with new index tensors, for
    debugging.
    "off": values are never read on the host (the kernels clamp, as under CUDA-graph capture)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; it must be one of {MODES}")
    previous, _mode = _mode, mode
    return previous


def check_index_values() -> None:
    """Wait for this thread's deferred index checks (set_index_checks) and raise the first bad value
    as ValueError. A synchronizing call: for the end of a step, or a test."""
    _settle(wait=True)


class _Staging:
    """A pinned int32 host buffer (grown on demand, reused once its check is done) and the event
    its copy records, for one device and thread.

    The copy is enqueued on the caller's stream before its kernel: it reads the values the kernel
    reads. (A side stream for the copy kept the kernels of back-to-back calls closer together, but
    cost host-bound calls more: worklog/adoption.md.)"""

    def __init__(self, device):
        self.device = device
        self.copied = torch.cuda.Event()
        self.host = torch.empty(0, dtype=torch.int32)

    def copy(self, tensors):
        """Host views of `tensors` (int32), filled once `self.copied` has completed."""
        n = sum(t.numel() for t in tensors)
        if self.host.shape[0] < n:
            self.host = torch.empty(max(n, 2 * self.host.shape[0], 1024), dtype=torch.int32,
                                    pin_memory=True)
        views, start = [], 0
        for t in tensors:
            views.append(self.host[start:start + t.numel()].view(t.shape))
            views[-1].copy_(t, non_blocking=True)
            start += t.numel()
        # on the tensors' device's stream, where the copies went (not the current device's: a model
        # split across GPUs calls with cuda:1 tensors while cuda:0 is current)
        self.copied.record(torch.cuda.current_stream(self.device))
        return views

    def __call__(self):
        """Wait until the views hold the values."""
        self.copied.synchronize()

    def done(self) -> bool:
        return self.copied.query()

    def release(self):
        """The buffer may be filled again (its views are read)."""
        _free_stagings(self.device).append(self)


class _ThreadState(threading.local):
    """A thread's checks: `pending` (deferred _Pending checks, in order), `checked` (the key and
    weak references of the last check that passed or was queued), `free` (device -> idle
    _Stagings). The class's None is what a thread reads before it sets its own (a read that finds
    it costs less than getattr's default, which goes through AttributeError)."""
    pending = None
    checked = None
    free = None


_PER_THREAD = _ThreadState()


def _free_stagings(device) -> list:
    per_device = _PER_THREAD.free
    if per_device is None:
        per_device = _PER_THREAD.free = {}
    free = per_device.get(device)
    if free is None:
        free = per_device[device] = []
    return free


def start_host_copy(tensors):
    """(host views of the int32 `tensors`, `copied`): calling copied() waits until the views hold
    the values. CUDA tensors are copied through a _Staging (a free one of this thread and device:
    one whose check is pending keeps its buffer); CPU ones (the tests) are their own views."""
    if not tensors[0].is_cuda:
        return list(tensors), nothing
    free = _free_stagings(tensors[0].device)
    staging = free.pop() if free else _Staging(tensors[0].device)
    return staging.copy(tensors), staging


def _unchanged_key(tensors, bounds):
    """A key that matches a later call's only if it passes the same tensor objects, not modified
    in place since (torch's version counter), with the same bounds; None where that cannot be told
    (inference tensors keep no version counter). The caller also checks that the objects are alive
    (an id can be reused)."""
    try:
        return tuple([(id(t), t._version) for t in tensors]) + bounds
    except RuntimeError:  # an inference tensor
        return None


def nothing():
    """The `wait` of a check with nothing left to read on the device."""
    pass


def nothing_to_start(*index_tensors):
    """The check of a call with no index tensor to read (one host length, a dense cache): its
    `wait` is `nothing`."""
    return nothing


class _Pending(NamedTuple):
    staging: _Staging
    host: list
    check: object  # check(host views): raises ValueError
    key: tuple | None


def raise_pending() -> None:
    """Raise the first bad value among this thread's deferred checks whose copies are done (no
    wait): the entry points call it first, so a call after a bad one raises before it runs. Not
    while a CUDA graph is captured: querying an event there would invalidate the capture. Not
    while torch.compile traces the call: the settling is host work a compiled graph cannot hold."""
    # (is_compiling first: dynamo then never reads the thread's state, whose list it would guard on)
    if not torch.compiler.is_compiling() and _PER_THREAD.pending \
            and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        _settle(wait=False)


def _settle(wait: bool) -> None:
    """Check the deferred copies in order: all of them (waiting for each) when `wait`, else those
    done, up to the first not done. A bad value's check is forgotten (the same tensors are copied
    again) and raised with what it means now."""
    pending = _PER_THREAD.pending
    while pending:
        first = pending[0]
        if wait:
            first.staging()
        elif not first.staging.done():
            return
        pending.pop(0)
        try:
            first.check(first.host)
        except ValueError as exc:
            last = _PER_THREAD.checked
            if last is not None and last[0] == first.key:
                _PER_THREAD.checked = None
            raise ValueError(f"{exc} (found after the fa3 call that passed it had returned: its kernels "
                             "clamped the bad values, so its output, and an append into the cache, are "
                             "meaningless; fa3.set_index_checks('strict') refuses such a call before it "
                             "runs)") from None
        finally:
            first.staging.release()


def _start_check(tensors, bounds, check, device=None):
    """Start checking the values of `tensors` (check(host views) raises ValueError) and return
    `wait`: in strict mode it waits for the copy and checks; deferred (CUDA tensors), the check is
    queued (raise_pending, check_index_values) and `wait` does nothing; CPU tensors (the tests) are
    checked by `wait` at once. A check that passes (deferred: that is started) is remembered, and a
    later call of this thread with the same tensors, unmodified (see _unchanged_key), and the same
    `bounds` skips the copy and the check: a model's layers pass the same cache_seqlens and
    block_table, and only the first of them needs them. The key is taken here, when the copy is
    enqueued.
    `device`: the call's; where values_checkable(device) says no, `wait` does nothing. It is asked
    only when the memo misses (it costs an eager decode call more host time than the memo). None
    (the tests' CPU tensors): always checked."""
    key = _unchanged_key(tensors, bounds)
    last = _PER_THREAD.checked
    if key is not None and last is not None and last[0] == key:
        for ref, t in zip(last[1], tensors):
            if ref() is not t:
                break
        else:
            return nothing
    if device is not None and (_mode == OFF or not values_checkable(device)):
        return nothing
    host, copied = start_host_copy(tensors)
    remembered = (key, [weakref.ref(t) for t in tensors]) if key is not None else None
    if _mode == DEFERRED and isinstance(copied, _Staging):
        pending = _PER_THREAD.pending
        if pending is None:
            pending = _PER_THREAD.pending = []
        pending.append(_Pending(copied, host, check, key))
        _PER_THREAD.checked = remembered
        if len(pending) > MAX_PENDING:  # the host is far ahead of the GPU: wait for the oldest
            first = pending[0]
            first.staging()
            _settle(wait=False)
        return nothing

    def wait():
        try:
            copied()
            check(host)
        finally:
            if isinstance(copied, _Staging):
                copied.release()
        _PER_THREAD.checked = remembered
    return wait


def start_cache_check(cache_seqlens: torch.Tensor, block_table, capacity: int, appended: int,
                      page_size: int, num_pages: int, device=None):
    """Start copying cache_seqlens (and block_table, paged) to the host and return `wait`, which
    waits for the copy (the one host sync) and raises ValueError for bad values.

    The caller launches its kernel before `wait` (the kernels clamp; see _Staging). A call that
    passes the same tensors as the last passing check, unmodified, skips the copy
    (_start_check: the layers of one decode step). On the host, the whole table's
    min and max decide in one step; only a table with an entry outside [0, num_pages) is searched
    for a bad entry among those the sequences use (serving engines leave the rest stale or -1)."""
    batch = cache_seqlens.shape[0]
    if batch == 0:
        return nothing
    paged = block_table is not None and block_table.shape[1] > 0
    tensors = [cache_seqlens] + ([block_table] if paged else [])
    return _start_check(tensors, (capacity, appended, page_size, num_pages),
                        lambda host: _check_cache_values(host[0], host[1] if paged else None, block_table,
                                                         capacity, appended, page_size, num_pages),
                        device)


def _check_cache_values(lengths, table, block_table, capacity: int, appended, page_size: int,
                        num_pages: int, lengths_name: str = "cache_seqlens") -> None:
    """The host copies of the cache lengths and (paged; else None) the table: the lengths as
    check_cache_lengths; the whole table's min and max decide in one step, and only a table with
    an entry outside [0, num_pages) is searched for a bad entry the sequences use."""
    lengths = lengths.tolist()
    check_cache_lengths(lengths, capacity, appended, block_table, page_size, lengths_name=lengths_name)
    if table is not None:
        low, high = torch.aminmax(table)
        if not (0 <= int(low) and int(high) < num_pages):
            check_block_table(lengths, table, appended, page_size, num_pages, lengths_name)


# ----------------------------------------------------------------------------- packed queries over a KV cache
def start_packed_cache_check(cu_seqlens_q: torch.Tensor, total_q: int, max_seqlen_q: int,
                             seqused_k: torch.Tensor, block_table, capacity: int, page_size: int,
                             num_pages: int, lengths_name: str = "cache_seqlens", device=None):
    """start_cache_check for packed queries over a KV cache (nothing appended), plus the values of
    cu_seqlens_q (check_offset_values' rules: start at 0, never decrease, end at total_q, no entry
    longer than max_seqlen_q): one copy of the three tensors, remembered as start_cache_check's.
    The cache checks' messages name the lengths `lengths_name` (seqused_k in attention_varlen)."""
    if seqused_k.shape[0] == 0:
        return nothing
    paged = block_table is not None and block_table.shape[1] > 0
    tensors = [cu_seqlens_q, seqused_k] + ([block_table] if paged else [])
    bounds = ("packed", total_q, max_seqlen_q, capacity, page_size, num_pages)

    def check(host):
        check_offset_list("cu_seqlens_q", host[0].tolist(), total_q, "q.shape[0]", max_seqlen_q, "max_seqlen_q")
        _check_cache_values(host[1], host[2] if paged else None, block_table, capacity, 0, page_size,
                            num_pages, lengths_name)
    return _start_check(tensors, bounds, check, device)


def start_append_check(cu_seqlens_k_new: torch.Tensor, total_new: int, cache_seqlens: torch.Tensor, block_table,
                       capacity: int, page_size: int, num_pages: int, cu_seqlens_q=None, total_q: int = 0,
                       max_seqlen_q: int = 0, device=None):
    """start_cache_check for packed appends (new k/v of each sequence's own length, rows
    [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1]) of k and v): the offsets (check_offset_list's
    rules, ending at k.shape[0]), each length and its append within the capacity, the pages the
    sequences use after the append, and (packed queries) cu_seqlens_q; one copy of all of them."""
    paged = block_table is not None and block_table.shape[1] > 0
    packed_q = cu_seqlens_q is not None
    tensors = [cu_seqlens_k_new, cache_seqlens] + ([cu_seqlens_q] if packed_q else []) + \
        ([block_table] if paged else [])
    bounds = ("append", total_new, capacity, page_size, num_pages, total_q, max_seqlen_q)

    def check(host):
        cu = host[0].tolist()
        check_offset_list("cu_seqlens_k_new", cu, total_new, "k.shape[0]")
        if packed_q:
            check_offset_list("cu_seqlens_q", host[2].tolist(), total_q, "q.shape[0]", max_seqlen_q, "max_seqlen_q")
        added = [b - a for a, b in zip(cu, cu[1:])]
        _check_cache_values(host[1], host[-1] if paged else None, block_table, capacity, added, page_size,
                            num_pages)
    return _start_check(tensors, bounds, check, device)


def start_leftpad_check(cache_leftpad: torch.Tensor, cache_seqlens: torch.Tensor, capacity: int,
                        appended: int, page_size: int, device=None):
    """start_cache_check for a left-padded dense cache (flash-attn's cache_leftpad): the lengths,
    and each sequence's first position in [0, cache_seqlens[b]]; one copy of both tensors."""
    if cache_seqlens.shape[0] == 0:
        return nothing
    tensors = [cache_seqlens, cache_leftpad]
    bounds = ("leftpad", capacity, appended, page_size)

    def check(host):
        lengths = host[0].tolist()
        check_cache_lengths(lengths, capacity, appended, None, page_size)
        for b, (pad, n) in enumerate(zip(host[1].tolist(), lengths)):
            if not 0 <= pad <= n:
                raise ValueError(f"cache_leftpad[{b}] = {pad} is outside [0, cache_seqlens[{b}] = {n}]: it is "
                                 "the cache position where sequence b's keys start (the rows before it are "
                                 "padding); pass each sequence's first position")
    return _start_check(tensors, bounds, check, device)
