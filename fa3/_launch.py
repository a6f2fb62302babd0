"""What the launches share, once the arguments are checked: views the kernels can take (TMA-ready,
detached), per-device stand-ins for tensor arguments a kernel does not read, and the attention
forward kernel's launch, which fa3.attention and fa3.attention_varlen both end in.
"""

from __future__ import annotations

import math

import torch

from . import _checks, masking
from ._memo import BoundedMemo
from .compile import builders as _compile
from .kernels import config


def detached(*tensors):
    """Views that do not require grad (same memory): kernels take tensors through DLPack, which
    refuses tensors that require grad (they reach a kernel under no_grad, or through the op)."""
    return tuple(t.detach() if t.requires_grad else t for t in tensors)


def empty_output(q, v) -> torch.Tensor:
    """An attention call's output: q's shape with v's head dim (its last dimension), contiguous.
    (torch.empty parses a shape tuple ~1.5 us slower than empty_like, the common case.)"""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a (batch, seqlen, heads, head_dim) tensor has the 16-byte aligned base and strides
    kernels assume (TMA's rule), and a unit-stride last dimension. (Stride 0, an expanded tensor
    such as the gradient of a .sum(), does not count as aligned.)"""
    s0, s1, s2, s3 = t.stride()
    e = 16 // t.element_size()  # elements in 16 bytes: 8 bf16/fp16, 16 FP8
    return t.data_ptr() % 16 == 0 and s0 % e == 0 and s1 % e == 0 and s2 % e == 0 and s3 == 1 \
        and bool(s0 and s1 and s2)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself where tma_aligned (views such as q/k/v sliced from one packed qkv tensor pass
    without a copy), else a fresh (aligned) contiguous copy."""
    return t if tma_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def sinks_ready(sinks: torch.Tensor) -> torch.Tensor:
    """The (heads_q,) FP32 sinks as the kernels take them: detached, unit stride."""
    return sinks.detach().contiguous()


def no_keys(lse: torch.Tensor, sinks) -> torch.Tensor:
    """The LSE of rows that see no key, (..., heads_q, rows): -inf, or each head's sink."""
    if sinks is None:
        return lse.fill_(float("-inf"))
    return lse.copy_(sinks.detach()[:, None].expand_as(lse))


_STAND_IN: dict = {}


def stand_in(device, dtype=torch.int32) -> torch.Tensor:
    """One zero per device and dtype: what a kernel gets for a tensor argument it does not read."""
    t = _STAND_IN.get((device, dtype))
    if t is None:
        t = _STAND_IN[(device, dtype)] = torch.zeros(1, dtype=dtype, device=device)
    return t


_UNREAD_PARTIALS: dict = {}


def unread_partials(device, head_dim: int) -> tuple:
    """(O, LSE) split partials of rank 5 and 4 for a decode kernel launched with one split, which
    writes its result directly and never reads them: one pair per device and head dim."""
    pair = _UNREAD_PARTIALS.get((device, head_dim))
    if pair is None:
        pair = _UNREAD_PARTIALS[(device, head_dim)] = (
            torch.empty(1, 1, 1, 1, head_dim, dtype=torch.float32, device=device),
            torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device))
    return pair


def lse_and_partials(lse_shape: tuple, partial_shapes: tuple, keep_lse: bool, device, head_dim: int) -> tuple:
    """(lse, o_partial, lse_partial) of a split-KV decode call: the LSE allocated where the caller
    returns it (keep_lse) and otherwise the stream's scratch, the partials (partial_shapes: O's and
    LSE's, or () with one split: unread_partials) always the stream's scratch; one scratch lookup."""
    if keep_lse:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        scratch = stream_scratch(partial_shapes, device) if partial_shapes else ()
    else:
        *scratch, lse = stream_scratch(partial_shapes + (lse_shape,), device)
    return (lse, *scratch) if scratch else (lse, *unread_partials(device, head_dim))


_SCRATCH = BoundedMemo(32)  # (device, the current stream's handle, shapes) -> FP32 tensors of those shapes


def stream_scratch(shapes: tuple, device, counter: bool = False) -> tuple:
    """FP32 tensors of `shapes` that kernels write and no one reads after the call (an LSE not
    returned) or that only the call's own later kernels read (split-KV partials): kept per stream
    and shapes, reused by the next call on that stream (a stream runs its kernels in order), so a
    call allocates nothing for them; fresh ones while a CUDA graph is captured (the graph owns
    them). One lookup for all of a call's scratch; `counter`: a causal kernel's tile counter after
    them, zeroed once (every kernel leaves it at 0: common/scheduler.py)."""
    if torch.cuda.is_current_stream_capturing():
        return _new_scratch(shapes, device, counter)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index), shapes, counter)
    tensors = _SCRATCH.get(key)
    if tensors is None:
        tensors = _SCRATCH.remember(key, _new_scratch(shapes, device, counter))
    return tensors


def _new_scratch(shapes: tuple, device, counter: bool) -> tuple:
    tensors = tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)
    return tensors + (torch.zeros(1, dtype=torch.int32, device=device),) if counter else tensors


SMALL_SCRATCH_BYTES = 8 << 20  # small_scratch's bound: a few steps' worth of small calls, held per stream


def small_scratch(shapes: tuple, device) -> tuple:
    """stream_scratch for FP32 tensors of `shapes` that a call's own kernels write and read, where
    they are small (SMALL_SCRATCH_BYTES in all: where the allocations' host time shows); larger
    ones are allocated (kept per stream they would hold their memory after the call)."""
    if 4 * sum(math.prod(shape) for shape in shapes) <= SMALL_SCRATCH_BYTES:
        return stream_scratch(shapes, device)
    return _new_scratch(shapes, device, False)


def tile_counter(spec, uneven: bool, device) -> torch.Tensor:
    """The GMEM counter a dynamically scheduled rung hands tiles out from (`uneven`: a call whose
    tiles differ in length, a causal or block-sparse one), reading 0 at launch: the
    current stream's, zeroed once (a stream runs its kernels in order, and each kernel leaves it at
    0: common/scheduler.py), or, while a CUDA graph is captured, a fresh zeroed one (the graph's
    own, so that replays on other streams never share one). Static schedules never touch it: one
    shared stand-in."""
    if not (uneven and spec.config.base.dynamic_schedule):
        return stand_in(device)
    return stream_counter(device)


def stream_counter(device) -> torch.Tensor:
    """tile_counter's counter for a rung known to count: the current stream's (its scratch)."""
    return stream_scratch((), device, counter=True)[0]


def attention_kernel(spec, dtype, head_dim: int, mask: masking.Masking, device, cu_seqlens=None, sinks=None,
                     head_dim_v=None, rows=None, mods=None, block_lists=None):
    """(the compiled forward, the runtime arguments before the tile counter, those after it): what
    follows (q, k, v, o, lse[, scores]) is the scale, the persistent ones (the SM count, then the
    tile counter: the caller's, tile_counter), and the variants' (cu_seqlens_q/k when varlen, window
    edges, softcap scale, the sinks (heads_q,) FP32). head_dim_v: V's head dim where it differs from
    head_dim; rows: the longest query sequence's length where known (it picks the rung's tiles for
    short ones); mods: None, or fa3.mods.Mods (K5's flex form: the mods' captured tensors follow
    the sinks as one tuple, and a score mod takes the scaled scores: softmax_scale rides in the
    softcap scale's place, scale_log2 is log2(e)); block_lists: None, or a BlockMask's int32 lists
    (with mods: the block-sparse kernel on the rung's block-mask tiles, kernels/config.py
    block_mask_short; the lists follow the mods' tensors as one tuple)."""
    if block_lists is None:
        short = spec.config.is_short(head_dim, head_dim_v, mask.causal, rows)
    else:
        short = config.block_mask_short(spec.config, head_dim)
    fn = _compile.get_attention(spec, dtype, head_dim, mask.causal, cu_seqlens is not None,
                                mask.local, mask.softcap, sinks is not None, head_dim_v, short, mods,
                                len(block_lists or ()))
    if mods is not None and mods.score_mod is not None:
        mask = masking.for_score_mod(mask)
    lead = [mask.scale_log2] + ([_checks.HOPPER_SMS[device]] if spec.persistent else [])
    tail = []
    if spec.variants:
        cu_q, cu_k = cu_seqlens if cu_seqlens is not None else (stand_in(device),) * 2
        tail = [cu_q, cu_k, mask.left, mask.right, mask.softcap_scale,
                stand_in(device, torch.float32) if sinks is None else sinks]
        if mods is not None:  # (mods that capture no tensor: a stand-in, as the kernel's signature has)
            tail.append(mods.aux(device) or (stand_in(device),))
        if block_lists is not None:
            tail.append(tuple(block_lists))
    return fn, lead, tail


def run_attention(spec, dtype, head_dim: int, mask: masking.Masking, args: list, device,
                  cu_seqlens=None, sinks=None, head_dim_v=None, rows=None, mods=None, block_lists=None):
    """Launch the forward with (q, k, v, o, lse[, scores]) = `args` and its runtime arguments
    (attention_kernel's, with this call's tile counter)."""
    fn, lead, tail = attention_kernel(spec, dtype, head_dim, mask, device, cu_seqlens, sinks, head_dim_v, rows,
                                      mods, block_lists)
    # (a block-sparse call's tiles differ in length as causal ones do: it counts too)
    counter = [tile_counter(spec, mask.causal or block_lists is not None, device)] if spec.persistent else []
    fn(*args, *lead, *counter, *tail)
