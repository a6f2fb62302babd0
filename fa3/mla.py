"""MLA decode against a latent KV cache: flash-attn 3's `qv`, as vLLM's FlashAttention MLA backend
and SGLang call it (fa3.attention_with_kvcache(..., qv=), fa3.attention_varlen over a cache with
qv=, and flash-attn's names).

DeepSeek's multi-head latent attention caches, per token, one latent vector (kv_lora_rank = 512
wide: v_cache) and one rotary key (64 wide: k_cache), shared by every query head (heads_kv = 1).
With the key up-projection absorbed into the query, each head's scores are

    S = (q k^T + qv v^T) * softmax_scale,  O = softmax(S) v   (out: v's 512 columns)

q being the rotary part of the query (64 wide) and qv the absorbed one (512 wide). softmax_scale
defaults to 1 / sqrt(64 + 512), as flash-attn 3's (DeepSeek passes its own, 1 / sqrt(192) times
its YaRN factor). The kernel is kernels/mla_decode.py (M1): each KV head's query heads times the
queries packed into 64-row tiles, the key range split across CTAs from shapes alone (no host sync,
so a step captures in a CUDA graph), the partials merged by the combine at 512 columns.

What it takes now: bf16 / fp16, d 64 + 512, any heads_kv dividing heads_q, 1 or more queries a
sequence (packed queries: entries of any lengths up to max_seqlen_q), causal or not, a dense cache
or pages of any size (a multiple of 64 rows: one TMA box a key block; any other, vLLM's 16 or
SGLang's 1: cp.async row gathers), new k / v appended into the cache first. Refused with a message:
FP8 caches and queries, window, softcap, sinks, left padding, packed appends, torch.compile tracing.

Bad index values are handled as every cache call's: the kernel clamps lengths to the capacity and
page indices to the pool, and eager calls check the values on the host behind the kernels
(fa3.index_checks).
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, index_checks, masking
from ._memo import BoundedMemo, layout
from .cache.append import append_to_cache
from .cache.checks import check_mla
from .cache.split_plan import plan_mla_splits
from .compile import mla as _compile_mla


def default_scale(q, qv) -> float:
    """flash-attn 3's softmax_scale under qv: 1 / sqrt(q's head dim + qv's)."""
    return 1.0 / math.sqrt(q.shape[-1] + qv.shape[-1])


def refuse_options(window_size, softcap, sinks, cache_leftpad, cu_seqlens_k_new, descales) -> None:
    """What an MLA call does not take yet, each refused by name."""
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} with qv: sliding windows are not implemented "
                                  "for MLA decode; leave it at (-1, -1)")
    if softcap:
        raise NotImplementedError(f"softcap={softcap} with qv is not implemented; leave it at 0.0")
    if sinks is not None:
        raise NotImplementedError("sinks with qv are not implemented; leave them at None")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad with qv is not implemented; leave it at None")
    if cu_seqlens_k_new is not None:
        raise NotImplementedError("packed new k/v (cu_seqlens_k_new) with qv are not implemented: pass k and v "
                                  "as (batch, new_tokens, heads_kv, d), or write them into the cache first")
    names = ("q_descale", "k_descale", "v_descale")
    given = [n for n, d in zip(names, descales) if d is not None]
    if given:
        raise NotImplementedError(f"{', '.join(given)} with qv: MLA over an FP8 cache is not implemented yet; "
                                  "pass bf16 / fp16 q, qv and caches without descales")


def is_ragged(cu_seqlens_q, batch: int, total_q: int, max_seqlen_q: int) -> bool:
    """Whether packed queries need the kernel's varlen layout (entries found from cu_seqlens_q on the
    GPU): any but batch entries of max_seqlen_q each (total_q = batch x max_seqlen_q, with no entry
    longer than max_seqlen_q: the deferred index check holds the offsets to that), which it reads
    as (batch, max_seqlen_q) like unpacked queries. Host integers only: a captured graph replays it."""
    return cu_seqlens_q is not None and total_q != batch * max_seqlen_q


# the static part of a plain MLA call (mla_attention's key) -> its MlaLaunch, whose index check and plan hold
_MLA_CALLS = BoundedMemo()


def mla_attention(q, qv, k_cache, v_cache, k, v, seqlens, block_table, causal, softmax_scale, num_splits: int,
                  kernel=None, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None, out=None,
                  lengths_name="cache_seqlens", keep_lse: bool = True):
    """(out, lse) of an MLA call (module docstring), the unsupported options already refused
    (refuse_options). num_splits as split_request encodes it. out (..., d_v) like q but v's head
    dim; lse (batch, heads_q, seqlen_q), or (heads_q, total_q) with cu_seqlens_q.

    A plain call (no append, the default rung, plain tensors, lengths in a tensor) like one that
    ran before is remembered by its shapes, strides, dtypes, devices and options: its checks passed
    for those, so it pays only its index check, the allocations and the launch (MlaLaunch)."""
    plain = k is None and kernel is None and type(causal) is bool and type(seqlens) is torch.Tensor \
        and (softmax_scale is None or type(softmax_scale) is float) and not _dispatch.tracing()
    key = None
    if plain:
        try:
            key = (layout(q), layout(qv), layout(k_cache), layout(v_cache), layout(seqlens),
                   layout(block_table), layout(cu_seqlens_q), layout(out), max_seqlen_q, max_seqlen_k, causal,
                   softmax_scale, num_splits, lengths_name, keep_lse)
            launch = _MLA_CALLS.get(key)
        except (AttributeError, TypeError):  # not tensors (check_mla names them), symbolic shapes
            key = launch = None
        if launch is not None and _dispatch.direct_call_ok(q, qv, k_cache, v_cache) and not _dispatch.profiling() \
                and not (k_cache.data_ptr() | v_cache.data_ptr()) % 16 \
                and (out is None or _checks.prepared_output_ok(
                    out, (("q", q), ("qv", qv), ("k_cache", k_cache), ("v_cache", v_cache)))):
            wait = launch.start_check(seqlens, block_table, cu_seqlens_q)
            if out is not None:  # refuse before anything is written (strict mode)
                wait()
            out, lse = launch(q, qv, k_cache, v_cache, seqlens, block_table, out, cu_seqlens_q)
            wait()
            return out, lse
    given_lengths = seqlens
    spec, seqlens, capacity, appended, batch, seqlen_q = check_mla(
        q, qv, k_cache, v_cache, k, v, seqlens, block_table, kernel, cu_seqlens_q, max_seqlen_q, lengths_name)
    ragged = is_ragged(cu_seqlens_q, batch, q.shape[0], seqlen_q)
    d_v = qv.shape[-1]
    out_shape = (*q.shape[:-1], d_v)
    if out is not None:
        inputs = (("q", q), ("qv", qv), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
        _checks.check_output(out, "out", _checks.OutputSpec(torch.Size(out_shape), q.dtype, q.device), inputs)
    scale = default_scale(q, qv) if softmax_scale is None else float(softmax_scale)
    mask = masking.masking(bool(causal), (-1, -1), 0.0, scale)
    direct = _dispatch.direct_call_ok(q, qv, k_cache, v_cache, *(t for t in (k, v) if t is not None))
    if not direct:
        if _dispatch.tracing() or any(type(t) is not torch.Tensor for t in (q, qv, k_cache, v_cache)):
            raise NotImplementedError("qv under torch.compile, torch.export or a tensor subclass or mode is not "
                                      "implemented yet: call it eagerly (a CUDA graph captures it)")
        q, qv = q.detach(), qv.detach()  # inference: no gradient flows through a cache call
    launch = MlaLaunch(spec, q, qv, k_cache, block_table, capacity, mask, num_splits, batch, seqlen_q, max_seqlen_k,
                       keep_lse, cu_seqlens_q if ragged else None, lengths_name)
    # eager: the index values are checked on the host behind the kernels (deferred)
    wait = launch.start_check(seqlens, block_table, cu_seqlens_q, appended)
    refuse_first = k is not None or out is not None  # refuse before anything is written
    if refuse_first:
        wait()
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, capacity)
    with _dispatch.op_range("fa3::attention_mla"):
        out, lse = launch(q, qv, k_cache, v_cache, seqlens, block_table, out, cu_seqlens_q, appended)
    if key is not None and appended == 0 and direct and seqlens is given_lengths:  # (not a converted copy)
        _MLA_CALLS.remember(key, launch)
    if not refuse_first:  # after the launch (the kernel clamps): the GPU stays busy while the host waits
        wait()
    return out, lse


class MlaLaunch:
    """An MLA call planned from what is static in it (shapes, the split plan, the compiled M1 with
    or without its combine, the index check's bounds); calling it with the call's tensors
    allocates what it returns and launches. Arguments validated, new tokens appended. Packed q of
    uniform entries (total_q = batch x seqlen_q rows) is viewed as (batch, seqlen_q): its out and
    lse too; cu_seqlens_q given (ragged entries, is_ragged): q is one plane of total_q rows, each
    entry's found by the kernel, seqlen_q their longest (it sizes the grid and the split plan)."""

    def __init__(self, spec, q, qv, k_cache, block_table, capacity: int, mask, num_splits: int, batch: int,
                 seqlen_q: int, max_seqlen_k, keep_lse: bool, cu_seqlens_q=None, lengths_name="cache_seqlens"):
        device, heads_q, heads_kv, d_v = q.device, q.shape[-2], k_cache.shape[2], qv.shape[-1]
        self.device, self.dtype, self.heads_q, self.d_v = device, q.dtype, heads_q, d_v
        self.packed, self.varlen = q.dim() == 3, cu_seqlens_q is not None
        self.batch, self.seqlen_q, self.keep_lse, self.scale_log2 = batch, seqlen_q, keep_lse, mask.scale_log2
        self.lse_shape = (heads_q, q.shape[0]) if self.packed else (batch, heads_q, seqlen_q)
        self.empty = q.numel() == 0 or batch == 0
        self.planes, self.rows = (1, q.shape[0]) if self.varlen else (batch, seqlen_q)
        keys = capacity if max_seqlen_k is None or num_splits < 0 else min(capacity, max(int(max_seqlen_k), 1))
        splits = plan_mla_splits(spec, batch, seqlen_q, heads_q, heads_kv, keys, _checks.HOPPER_SMS[device],
                                 num_splits)
        self.partials = ((splits, self.planes, self.rows, heads_q, d_v), (splits, self.planes, heads_q, self.rows)) \
            if splits > 1 else ()
        self.paged = block_table is not None
        gather = self.paged and k_cache.shape[1] % spec.config.base.tile_n != 0  # pages not holding whole key blocks
        self.fn = _compile_mla.get_mla(spec, q.dtype, mask.causal, self.paged, gather, self.varlen, splits > 1)
        self.no_table = _launch.stand_in(device).view(1, 1)
        self.no_offsets = _launch.stand_in(device)
        total_q, page_size, num_pages = q.shape[0], k_cache.shape[1], k_cache.shape[0]

        def start_check(seqlens, block_table, cu_seqlens_q, appended=0):
            if cu_seqlens_q is not None:
                return index_checks.start_packed_cache_check(cu_seqlens_q, total_q, seqlen_q, seqlens, block_table,
                                                             capacity, page_size, num_pages, lengths_name, device)
            return index_checks.start_cache_check(seqlens, block_table, capacity, appended, page_size, num_pages,
                                                  device)
        self.start_check = start_check

    def __call__(self, q, qv, k_cache, v_cache, seqlens, block_table, out, cu_seqlens_q=None, appended: int = 0):
        """(out, lse): out as given (checked) or allocated, lse (kept, or the stream's scratch)."""
        device, heads_q = self.device, self.heads_q
        if out is None:
            out = torch.empty((*q.shape[:-1], self.d_v), dtype=self.dtype, device=device)
        if self.empty:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
            return out.zero_(), lse.fill_(float("-inf"))
        # (out is contiguous and aligned: allocated here or checked; q and qv are copied where not 16-byte aligned)
        if self.packed:
            planes, rows = self.planes, self.rows
            q4, qv4 = (_launch.tma_ready(t.view(planes, rows, heads_q, t.shape[-1])) for t in (q, qv))
            out4 = out.view(planes, rows, heads_q, self.d_v)
        else:
            q4, qv4, out4 = _launch.tma_ready(q), _launch.tma_ready(qv), out
        lse, o_partial, lse_partial = _launch.lse_and_partials(self.lse_shape, self.partials, self.keep_lse, device,
                                                               self.d_v)
        lse3 = lse.view(heads_q, self.planes, self.rows).permute(1, 0, 2) if self.packed else lse
        table = block_table if self.paged else self.no_table
        cu = cu_seqlens_q if self.varlen else self.no_offsets
        self.fn(q4, qv4, k_cache, v_cache, seqlens, table, out4, lse3, o_partial, lse_partial, self.scale_log2,
                appended, cu, self.seqlen_q if self.varlen else 0)
        return out, lse
