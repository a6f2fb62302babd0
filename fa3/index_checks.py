"""Host checks of the values of index arguments: cu_seqlens_q/k, cache_seqlens and block_table.

Kernels read these on the GPU, and a bad value would send a load or a store outside its tensor.
Eager calls copy what the checks need to the host (one small copy and one sync a call) and refuse
bad values with a ValueError naming the argument, the entry, the value, the bound and the fix.
Nothing may synchronize while a CUDA graph is captured or torch.compile traces, so there (and in
direct calls of the torch.ops.fa3 ops) the values are not read on the host; the kernels clamp
instead: lengths to [0, capacity], page indices to [0, num_pages), and an append's first position
to [0, capacity - new_tokens] (fa3.kvcache.append_to_cache). Clamped values give meaningless
results, never reads or writes outside the tensors.
"""

from __future__ import annotations

import torch

from . import _dispatch


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
    for name, cu, total, total_name, max_len, max_name in (
            ("cu_seqlens_q", values[:n], total_q, "q.shape[0]", max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", values[n:], total_k, "k.shape[0]", max_seqlen_k, "max_seqlen_k")):
        if cu[0] != 0:
            raise ValueError(f"{name}[0] = {cu[0]}; offsets start at 0")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        bad = next((i for i, length in enumerate(lengths) if length < 0), None)
        if bad is not None:
            raise ValueError(f"{name} decreases at entry {bad + 1} ({cu[bad]} -> {cu[bad + 1]}); "
                             "offsets must be non-decreasing (a cumulative sum of lengths)")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] = {cu[-1]} but {total_name} = {total}; the last offset is "
                             "the packed length")
        if lengths and max_len is not None and max(lengths) > max_len:
            raise ValueError(f"{max_name}={max_len} but a sequence has {max(lengths)} tokens")


# ----------------------------------------------------------------------------- KV caches
def _capacity_source(block_table, page_size: int) -> str:
    if block_table is None:
        return f"k_cache.shape[1] = {page_size}"
    return f"block_table.shape[1] * page_size = {block_table.shape[1]} * {page_size}"


def check_cache_lengths(lengths, capacity: int, appended: int, block_table, page_size: int,
                        indexed: bool = True) -> None:
    """Host lengths (a list: cache_seqlens per batch entry, or [the int] when `indexed` is False):
    each in [0, capacity], and within it after the append of `appended` new tokens.
    `page_size` is k_cache.shape[1] (the dense capacity when block_table is None)."""
    if min(lengths, default=0) >= 0 and max(lengths, default=0) + appended <= capacity:
        return
    for b, n in enumerate(lengths):
        if 0 <= n and n + appended <= capacity:
            continue
        name = f"cache_seqlens[{b}]" if indexed else "cache_seqlens"
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
                         f"{bound}: keep cache_seqlens + new_tokens <= {capacity}, or allocate a larger "
                         "cache (more pages per sequence)")


def _first_bad_page(lengths, table, appended: int, page_size: int, num_pages: int):
    """(b, j, value) of the first block_table entry a sequence uses that is not a page, or None."""
    for b, (n, row) in enumerate(zip(lengths, table)):
        used = -(-(n + appended) // page_size)
        for j, page in enumerate(row[:used]):
            if not 0 <= page < num_pages:
                return b, j, page
    return None


def check_block_table(lengths, table, appended: int, page_size: int, num_pages: int) -> None:
    """Host values (lists): the entries each sequence uses, the first ceil((cache_seqlens[b] +
    new_tokens) / page_size) of its row, are pages of k_cache; entries past them are not read
    (serving engines leave them stale or -1)."""
    bad = _first_bad_page(lengths, table, appended, page_size, num_pages)
    if bad is not None:
        b, j, page = bad
        raise ValueError(f"block_table[{b}, {j}] = {page} is not a page of k_cache, which has "
                         f"num_pages = k_cache.shape[0] = {num_pages}; the entries sequence {b} uses (the "
                         f"first ceil((cache_seqlens[{b}] + new_tokens) / page_size)) must be in "
                         f"[0, {num_pages}): fix the table, or allocate the pages it names")


# A (page_size, device) -> arange(n) * page_size, the first key of each page, grown on demand
_PAGE_STARTS: dict = {}


def _page_starts(pages: int, page_size: int, device) -> torch.Tensor:
    starts = _PAGE_STARTS.get((page_size, device))
    if starts is None or starts.shape[0] < pages:
        starts = _PAGE_STARTS[(page_size, device)] = torch.arange(
            0, max(pages, 64) * page_size, page_size, dtype=torch.int32, device=device)
    return starts[:pages]


def start_cache_check(cache_seqlens: torch.Tensor, block_table, capacity: int, appended: int,
                      page_size: int, num_pages: int):
    """Launch the device side of the KV-cache checks and return `wait`, which waits for it (the one
    host sync) and raises ValueError for bad values.

    What comes to the host is cache_seqlens and, for a paged cache, the smallest and largest page
    index among the entries the sequences use (one masked min/max on the device); a table with a
    bad entry is then copied whole to name it. The copy is asynchronous: a caller that launches
    more work before `wait` keeps the GPU busy while the host waits for the small copy."""
    batch = cache_seqlens.shape[0]
    if batch == 0:
        return lambda: None
    summary = cache_seqlens
    paged = block_table is not None and block_table.shape[1] > 0
    if paged:
        ends = cache_seqlens + appended if appended else cache_seqlens
        used = _page_starts(block_table.shape[1], page_size, block_table.device) < ends[:, None]
        low, high = torch.aminmax(torch.where(used, block_table, 0))
        summary = torch.cat([cache_seqlens, low.view(1), high.view(1)])
    host = summary.to("cpu", non_blocking=True)
    done = torch.cuda.Event() if summary.is_cuda else None  # (CPU tensors: the tests)
    if done is not None:
        done.record()

    def wait():
        if done is not None:
            done.synchronize()
        values = host.tolist()
        lengths = values[:batch]
        check_cache_lengths(lengths, capacity, appended, block_table, page_size)
        if paged and not (0 <= values[batch] and values[batch + 1] < num_pages):
            check_block_table(lengths, block_table.tolist(), appended, page_size, num_pages)
    return wait


# ----------------------------------------------------------------------------- packed queries over a KV cache
_NO_KEYS = torch.zeros(1, dtype=torch.int32)  # offsets [0]: a packed call over a cache has no cu_seqlens_k


def start_packed_cache_check(cu_seqlens_q: torch.Tensor, total_q: int, max_seqlen_q: int,
                             seqused_k: torch.Tensor, block_table, capacity: int, page_size: int,
                             num_pages: int, lengths_name: str = "cache_seqlens"):
    """start_cache_check for packed queries over a KV cache (nothing appended), plus the values of
    cu_seqlens_q (check_offset_values' rules: start at 0, never decrease, end at total_q, no entry
    longer than max_seqlen_q). Both copies are asynchronous and `wait` syncs once; the cache
    checks' messages name the lengths as `lengths_name` (seqused_k in attention_varlen)."""
    wait_cache = start_cache_check(seqused_k, block_table, capacity, 0, page_size, num_pages)
    host_cu = cu_seqlens_q.to("cpu", non_blocking=True)
    done = torch.cuda.Event() if cu_seqlens_q.is_cuda else None
    if done is not None:
        done.record()

    def wait():
        if done is not None:
            done.synchronize()
        check_offset_values(host_cu, _NO_KEYS, total_q, 0, max_seqlen_q, None)
        try:
            wait_cache()
        except ValueError as exc:
            if lengths_name == "cache_seqlens":
                raise
            raise ValueError(str(exc).replace("cache_seqlens", lengths_name)) from None
    return wait


def start_leftpad_check(cache_leftpad: torch.Tensor, cache_seqlens: torch.Tensor):
    """flash-attn's cache_leftpad: where each sequence's keys start in a dense cache, in
    [0, cache_seqlens[b]]. Returns `wait`, as start_cache_check (one asynchronous copy)."""
    host = torch.stack([cache_leftpad, cache_seqlens]).to("cpu", non_blocking=True)
    done = torch.cuda.Event() if cache_leftpad.is_cuda else None
    if done is not None:
        done.record()

    def wait():
        if done is not None:
            done.synchronize()
        for b, (pad, n) in enumerate(zip(*host.tolist())):
            if not 0 <= pad <= n:
                raise ValueError(f"cache_leftpad[{b}] = {pad} is outside [0, cache_seqlens[{b}] = {n}]: it is "
                                 "the cache position where sequence b's keys start (the rows before it are "
                                 "padding); pass each sequence's first position")
    return wait
