"""fa3.attention: validate once, allocate outputs, pick a rung, launch.

Its checks and its launch are here; what the entry points share (argument checks and messages, the
Hopper check, rung choice and its memo, the direct-call test, TMA-ready and detached views) is in
fa3._checks, fa3._dispatch and fa3._launch; fa3.ops registers the op behind it and its backward.
Batch, seqlens and heads are dynamic in the compiled kernels, so new shapes never recompile.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _checks, _dispatch, _launch, backward, fp8, index_checks, kvcache, masking
from . import mods as _mods
from ._checks import check_attention
from ._memo import BoundedMemo
from .kernels import config


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              window_size=(-1, -1), softcap: float = 0.0,
              return_lse: bool = False, kernel: str | None = None, out=None,
              deterministic: bool = False, backward_kernel: str | None = None, sinks=None,
              q_descale=None, k_descale=None, v_descale=None, score_mod=None, mask_mod=None):
    """Exact softmax attention, softmax(q k^T * softmax_scale) v, as flash-attn computes it.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); bf16 or
    fp16 on a Hopper GPU; heads_q a multiple of heads_kv (GQA/MQA). head_dim 64, 96, 128, 192 or
    256. v's head dim may differ from q's and k's as (q/k, v) = (192, 128) (DeepSeek's MLA prefill)
    or (128, 64), forward and backward (b9 at (192, 128), b7 at (128, 64), b2 at both): out and dv
    then have v's head dim.
    causal: mask aligned to the bottom right when seqlen_q != seqlen_k (query i sees keys
    j <= i + seqlen_k - seqlen_q), as in flash-attn >= 2.1; rows that see no key give 0.
    softmax_scale: defaults to 1/sqrt(head_dim).
    window_size: (left, right) sliding-window (local) attention as flash-attn: query i sees keys
        j in [i + shift - left, i + shift + right], shift = seqlen_k - seqlen_q; -1 = unbounded.
    softcap: > 0 caps the scores as Gemma 2: s -> softcap * tanh(s / softcap) (s scaled first).
        Both are differentiable (the backward rungs compile them as the forward does).
    return_lse: also return the fp32 log-sum-exp of each row, (batch, heads_q, seqlen_q).
    kernel: a rung of fa3.available_kernels("attention"); None picks the fastest. A forward-only
        eager call shaped like a decode step over a long context (a KV head's queries in one tile,
        K and V of 32 MiB or more) runs on the KV-cache kernel (rung s1, the keys split across
        CTAs; fa3.kvcache.decodes_over_keys); traced, compiled and differentiated calls, and calls
        that name a rung, run the attention rung.
    out: optional preallocated output, shaped like q, same dtype and device, contiguous.
    deterministic: make the backward bitwise reproducible (dQ's FP32 partial sums are added in a
        fixed order; measured cost in worklog/backward.md). The forward is deterministic anyway.
    backward_kernel: a rung of fa3.available_kernels("backward"); None picks the fastest.
    sinks: optional attention sinks (gpt-oss), a float32 (heads_q,) tensor of finite logits: head
        h's sink joins the denominator of each of its rows, taking probability mass but adding no
        value: out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sinks[h])), and lse includes
        it (a row that sees no key gives 0 and lse = sinks[h]). Differentiable.
    Returns out shaped like q (and lse).

    FP8: q, k, v in torch.float8_e4m3fn (fa3.quantize_fp8) with q_descale, k_descale, v_descale:
    float32 (batch, heads_kv), or one element per tensor, or None (1); attention of the dequantized
    inputs (x * x_descale), output bf16 (or out='s dtype, bf16 or fp16). Causal, GQA, lse,
    window_size and softcap as above; head_dim 64, 128 or 256 (v's as q's); no sinks; `kernel`
    names an "attention_fp8" rung. Forward only (inputs that require grad are refused). See fa3.fp8.

    score_mod(score, b, h, q_idx, kv_idx) -> score, mask_mod(b, h, q_idx, kv_idx) -> bool: flex
        attention's functions (torch.nn.attention.flex_attention's signatures; fa3.flex's library),
        compiled into the K5 forward once per function and configuration (fa3.mods: captured
        tensors are kernel arguments, captured numbers compile-time constants). The score mod sees
        softmax_scale * q k^T; the mask mod hides the scores it returns False for, on top of
        causal / window_size; rows that see no key give 0 and lse = -inf. h is the query head, the
        indices are positions in the sequences. Differentiable in q, k, v on the backward rungs
        b2-b9 (the mods recomputed there; a score mod must carry its derivative,
        `score_mod.score_mod_grad`, fa3.mods; captured tensors get no gradient; not with sinks or
        out=). Eager only (not under torch.compile), 16-bit q/k/v; a score mod excludes softcap
        (fa3.flex.softcap is the mod).

    Differentiable in q, k, v and sinks (whichever require grad), through torch.autograd, torch.compile
    and torch.utils.checkpoint; lse is returned as a non-differentiable output. GQA gradients of k
    and v are summed over the query heads that share them.

    This is the torch custom op `torch.ops.fa3.attention` (fa3.ops) behind a validating wrapper:
    torch.compile(fullgraph=True) and torch.export trace it without graph breaks, and new batch
    sizes or seqlens do not recompile. Kernels launch on torch's current CUDA stream without
    synchronizing the host, so calls can be captured in CUDA graphs (after a first eager call).
    """
    index_checks.raise_pending()  # an earlier call's bad index values (deferred checks)
    if score_mod is not None or mask_mod is not None:
        out, lse = attention_with_mods(q, k, v, score_mod, mask_mod, causal=causal, softmax_scale=softmax_scale,
                                       window_size=window_size, softcap=softcap, kernel=kernel, out=out,
                                       sinks=sinks, fp8=(q_descale, k_descale, v_descale),
                                       deterministic=deterministic, backward_kernel=backward_kernel)
        return (out, lse) if return_lse else out
    # a plain call like one that ran before: its launch is prepared (prepare_plain)
    plain = sinks is None and kernel is None and not softcap and q_descale is None \
        and k_descale is None and v_descale is None and window_size == (-1, -1) and type(causal) is bool \
        and (softmax_scale is None or type(softmax_scale) is float) and not _dispatch.tracing()
    if plain:
        try:
            key = plain_key(q, k, v, causal, softmax_scale, out=out)
            launch = _PLAIN_LAUNCHES.get(key)
        except (AttributeError, TypeError):  # not tensors (check_attention names them), symbolic shapes
            key = launch = plain = None
        if launch is not None and _dispatch.direct_call_ok(q, k, v) and not _dispatch.profiling() \
                and data_aligned(q, k, v) \
                and (out is None or _checks.prepared_output_ok(out, (("q", q), ("k", k), ("v", v)))):
            if return_lse:
                return launch(q, k, v, out=out)
            return launch(q, k, v, False, out)[0]
        # the same with gradients: fa3's autograd.Function with the forward and backward chosen then
        grad_call = _GRAD_CALLS.get((key, deterministic, backward_kernel)) if plain and out is None else None
        if grad_call is not None and torch.is_grad_enabled() \
                and (q.requires_grad or k.requires_grad or v.requires_grad) and _dispatch.eager_autograd_ok(q, k, v) \
                and not _dispatch.profiling() and data_aligned(q, k, v):
            out, lse = backward.DifferentiableAttention.apply(*grad_call, "fa3::attention_backward", q, k, v)
            return (out, lse) if return_lse else out
    if fp8.is_fp8_call(q, q_descale, k_descale, v_descale):
        return fp8.attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                                 softmax_scale=softmax_scale, window=window_size, softcap=softcap,
                                 return_lse=return_lse, kernel=kernel, out=out, sinks=sinks)
    spec = check_attention(q, k, v, kernel)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    causal = bool(causal)
    if out is not None:
        _checks.check_output(out, "out", _checks.output_like(q, v), (("q", q), ("k", k), ("v", v)))
    window = tuple(window_size)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or getattr(sinks, "requires_grad", False))
    backward_spec = None  # checked now where there will be a backward (v's head dim, the variants)
    if needs_grad:
        backward_spec = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[3],
                                            bool(deterministic), v.shape[3], masking.masked(causal, window))
    if window != (-1, -1) or softcap:
        mask = masking.masking(causal, window, softcap, scale)
        _dispatch.check_variants(spec, mask, "kernel")
        if needs_grad:
            _dispatch.check_variants(backward_spec, mask, "backward_kernel")
    _checks.check_rung_sinks(spec, sinks, q.shape[2], q.device)
    if _dispatch.direct_call_ok(q, k, v) and (sinks is None or _dispatch.direct_call_ok(sinks)):
        with _dispatch.op_range("fa3::attention"):
            if kernel is None and kvcache.decodes_over_keys(q, k, v):  # a decode step: S1 (no gradient)
                out, lse = kvcache.decode_attention(q, k, v, causal, scale, out, window, softcap, sinks)
                prepare = kvcache.prepare_decode
            else:
                out, lse = launch_attention(spec, q, k, v, causal, scale, out, window, softcap, sinks)
                prepare = functools.partial(prepare_plain, spec)
        if plain:
            _PLAIN_LAUNCHES.remember(key, prepare(q, k, v, causal, scale))
    # (eager_autograd_ok first: a traced call must not guard on which devices were checked so far)
    elif out is None and sinks is None and _dispatch.eager_autograd_ok(q, k, v) \
            and q.device in _checks.HOPPER_SMS:  # gradients, eagerly: fa3's own autograd.Function
        forward = None
        if plain:  # (calls with gradients never take the decode route: a memo of their own)
            forward = _GRAD_FORWARDS.get(key) or _GRAD_FORWARDS.remember(key, prepare_plain(spec, q, k, v, causal,
                                                                                            scale))
        if forward is None:
            forward = functools.partial(launch_attention, spec, causal=causal, scale=scale, window=window,
                                        softcap=softcap)
        gradients = backward.dense_gradients(backward_spec, causal, scale, bool(deterministic), window,
                                             float(softcap))
        if plain and type(deterministic) is bool \
                and (backward_kernel is None or type(backward_kernel) is str):
            _GRAD_CALLS.remember((key, deterministic, backward_kernel), (forward, gradients))
        with _dispatch.op_range("fa3::attention"):
            out, lse = backward.DifferentiableAttention.apply(forward, gradients, "fa3::attention_backward",
                                                              q, k, v)
    else:
        if backward_spec is None:  # the op names one, never run without gradients
            backward_spec = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[3],
                                                bool(deterministic), None, masking.masked(causal, window))
        bwd = backward_spec.name
        result, lse = torch.ops.fa3.attention(q, k, v, causal, scale, spec.name, bool(deterministic), bwd,
                                              window[0], window[1], float(softcap), sinks)
        out = result if out is None else out.copy_(result)  # the op is functional
    return (out, lse) if return_lse else out


MODS_RUNG = "k5.5"  # the rung a call with mods runs on unless it names another K5 rung


def attention_with_mods(q, k, v, score_mod, mask_mod, *, causal=False, softmax_scale=None,
                        window_size=(-1, -1), softcap=0.0, kernel=None, out=None, sinks=None,
                        fp8=(None, None, None), block_lists=None, q_block_lists=None, deterministic=False,
                        backward_kernel=None):
    """fa3.attention with a score mod and/or a mask mod: checked, then K5's flex form (eager). With
    q, k or v requiring grad, through DifferentiableAttention: the backward rung's flex form
    recomputes the modded scores (fa3.backward.mods_gradients; not with sinks or out=).
    `block_lists`: None, or a BlockMask's int32 lists, checked by fa3.flex (the block-sparse
    kernel: no causal, window or softcap then); with gradients `q_block_lists`, its transposed
    lists as many (q_num_blocks, q_indices[, full_q_*]), which the block-sparse backward walks
    (not deterministic). Returns (out, lse)."""
    if any(x is not None for x in fp8) or q.dtype == torch.float8_e4m3fn:
        raise NotImplementedError("score_mod / mask_mod take 16-bit q, k, v (FP8 is not supported)")
    if score_mod is not None and softcap:
        raise ValueError("score_mod and softcap are exclusive: the cap is a score mod (fa3.flex.softcap)")
    if _dispatch.tracing():
        raise NotImplementedError("score_mod / mask_mod run eagerly only for now (not under torch.compile "
                                  "or torch.export)")
    needs_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    if needs_grad:
        _check_mods_grad(q, k, v, out, sinks, block_lists, q_block_lists, deterministic)
    mods = _mods.Mods(score_mod, mask_mod)
    spec = check_attention(q, k, v, MODS_RUNG if kernel is None else kernel)
    if not spec.takes_mods():
        raise ValueError(f"kernel={kernel!r}: score_mod / mask_mod run on the K5 rungs (k5.1-k5.5) only")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if out is not None:
        _checks.check_output(out, "out", _checks.output_like(q, v), (("q", q), ("k", k), ("v", v)))
    window = tuple(window_size)
    if window != (-1, -1) or softcap:
        _dispatch.check_variants(spec, masking.masking(bool(causal), window, softcap, scale), "kernel")
    _checks.check_rung_sinks(spec, sinks, q.shape[2], q.device)
    mods.aux(q.device)  # the captured tensors' devices, before anything is launched
    if block_lists is not None and (causal or window != (-1, -1) or softcap):
        raise ValueError("a block mask takes no causal, window_size or softcap: write them as mods")
    if needs_grad:
        if backward_kernel is None and not deterministic:
            backward_kernel = config.FLEX_BACKWARD.get(q.shape[3])
        backward_spec = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[3],
                                            bool(deterministic), v.shape[3], masking.masked(causal, window))
        if backward_spec.module != "bwd_ws":
            raise ValueError(f"backward_kernel={backward_spec.name!r}: the backward of score_mod / mask_mod runs on "
                             f"the warp-specialized backward rungs (b2-b9), not on {backward_spec.name}")
        if block_lists is not None:
            cfg = config.backward_config(backward_spec.config, q.shape[3], v.shape[3])
            if not config.block_mask_backward_fits(cfg):
                block = config.BLOCK_MASK_TILE
                raise ValueError(f"backward_kernel={backward_spec.name!r} runs {cfg.tile_m} x {cfg.tile_n} tiles at "
                                 f"head_dim={q.shape[3]}{', dQ in order' if cfg.ordered_dq else ''}: the block-sparse "
                                 f"backward walks {block[0]} x {block[1]} blocks on {block[1]}-key K/V tiles and Q "
                                 f"tiles that divide {block[0]} rows, dQ unordered (backward_kernel=None picks one)")
        if window != (-1, -1) or softcap:
            _dispatch.check_variants(backward_spec, masking.masking(bool(causal), window, softcap, scale),
                                     "backward_kernel")
        forward = functools.partial(launch_attention, spec, causal=bool(causal), scale=scale, window=window,
                                    softcap=softcap, mods=mods, block_lists=block_lists)
        gradients = backward.mods_gradients(backward_spec, score_mod, mask_mod, bool(causal), scale,
                                            bool(deterministic), window, float(softcap), q_block_lists)
        with _dispatch.op_range("fa3::attention"):
            return backward.DifferentiableAttention.apply(forward, gradients, "fa3::attention_backward", q, k, v)
    with _dispatch.op_range("fa3::attention"):
        return launch_attention(spec, q, k, v, bool(causal), scale, out, window, softcap, sinks, mods, block_lists)


def _check_mods_grad(q, k, v, out, sinks, block_lists, q_block_lists, deterministic):
    """What a call with mods and gradients must not have (the backward's flex form has no sinks and
    writes no out=; with a block mask it walks the transposed lists, unordered)."""
    if sinks is not None:
        raise NotImplementedError("score_mod / mask_mod with sinks are forward only: q, k, v must not require "
                                  "grad there (call under torch.no_grad(), or detach them)")
    if out is not None:
        raise ValueError("out= is not differentiable: with score_mod / mask_mod and q, k or v requiring grad, "
                         "drop out= (the result is returned)")
    if block_lists is not None:
        if deterministic:
            raise ValueError("deterministic=True is not supported with a block mask and gradients: the block-sparse "
                             "backward adds dQ unordered (the deterministic order takes every K/V tile of a Q tile "
                             "in turn, and a block mask's walk skips some)")
        assert q_block_lists is not None and len(q_block_lists) == len(block_lists), \
            "fa3.flex passes a block mask's transposed lists where gradients are needed"
    if not _dispatch.eager_autograd_ok(q, k, v):
        raise NotImplementedError("score_mod / mask_mod with gradients run eagerly on plain tensors only (not "
                                  "under tensor subclasses, dispatch modes or functorch transforms)")


# the key of a plain call (q, k, v's shapes, strides, dtypes and devices; causal; softmax_scale) ->
# its prepared launch, for calls that passed every check with q, k and v as they are
_PLAIN_LAUNCHES = BoundedMemo()
_GRAD_FORWARDS = BoundedMemo()  # the same key -> the forward of a call that needs gradients
# (the same key, deterministic, backward_kernel) -> (forward, gradients) of such a call that passed every check
_GRAD_CALLS = BoundedMemo()


def plain_key(q, k, v, causal: bool, softmax_scale, rung: str | None = None, out=None) -> tuple:
    """What a prepared launch (prepare_plain) assumes of a call: q, k and v's shapes, strides,
    dtypes and devices, causal and the scale as given (and the rung, where the caller names one:
    one flat tuple, cheaper to hash than a pair; and out='s shape, dtype and device, where given)."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, causal, softmax_scale, rung,
            None if out is None else (out.shape, out.dtype, out.device))


def data_aligned(q, k, v) -> bool:
    """The one thing a prepared launch checks per call beyond its key: 16-byte aligned data (its
    key holds the strides)."""
    return not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16


def prepare_plain(spec, q, k, v, causal: bool, scale: float):
    """The launch of rung `spec` for a plain call (no window, softcap, sinks or FP8) that ran
    with these q, k, v (checked and launched by launch_attention): a function of (q, k, v) that
    allocates out (unless given: _checks.prepared_output_ok) and lse (keep_lse=False: the LSE,
    which the caller drops, in the stream's scratch) and calls the compiled kernel with its other
    arguments made once, for
    later calls with the same shapes, strides, dtypes and devices, and 16-byte aligned data (what
    launch_attention's tma_ready would pass as they are). None where launch_attention does more
    (no keys, an empty output, v's head dim apart, a scores workspace)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    device = q.device
    if q.numel() == 0 or k.shape[1] == 0 or v.shape[3] != head_dim or spec.needs_scores_workspace \
            or device not in _checks.HOPPER_SMS or not all(_launch.tma_aligned(t) for t in (q, k, v)):
        return None
    mask = masking.masking(causal, (-1, -1), 0.0, scale)
    fn, lead, tail = _launch.attention_kernel(spec, q.dtype, head_dim, mask, device, rows=seqlen_q)
    counted = spec.persistent and mask.causal and spec.config.base.dynamic_schedule  # a counter a call
    if spec.persistent and not counted:
        lead.append(_launch.tile_counter(spec, False, device))  # (the shared stand-in)
    lse_shape = (batch, heads_q, seqlen_q)

    def launch(q, k, v, keep_lse: bool = True, out=None):
        if q.requires_grad or k.requires_grad or v.requires_grad:  # (under no_grad) as launch_attention
            q, k, v = _launch.detached(q, k, v)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if keep_lse:
            lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
            counter = (_launch.stream_counter(device),) if counted else ()
        else:  # the dropped LSE and (causal) the tile counter in one lookup
            lse, *counter = _launch.stream_scratch((lse_shape,), device, counter=counted)
        fn(q, k, v, out, lse, *lead, *counter, *tail)
        return out, lse
    return launch


def launch_attention(spec, q, k, v, causal: bool, scale: float, out=None, window=(-1, -1),
                     softcap: float = 0.0, sinks=None, mods=None, block_lists=None):
    """Allocate the outputs (`out` unless given) and launch rung `spec` on torch's current stream;
    returns (out, lse). The body of the fa3::attention op: arguments are validated already."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    head_dim_v = v.shape[3]
    device = q.device
    if out is None:
        out = _launch.empty_output(q, v)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
    seqlen_k = k.shape[1]
    if out.numel() == 0 or seqlen_k == 0:  # nothing to compute, or no keys: O = 0, LSE = -inf
        out.zero_()
        _launch.no_keys(lse, sinks)
        return out, lse
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = _launch.detached(q, k, v)
    if sinks is not None:
        sinks = _launch.sinks_ready(sinks)
    mask = masking.masking(causal, window, softcap, scale)
    args = [_launch.tma_ready(q), _launch.tma_ready(k), _launch.tma_ready(v), out, lse]
    if spec.needs_scores_workspace:
        args.append(torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.float32, device=device))
    _launch.run_attention(spec, q.dtype, head_dim, mask, args, device, sinks=sinks,
                          head_dim_v=None if head_dim_v == head_dim else head_dim_v, rows=seqlen_q, mods=mods,
                          block_lists=block_lists)
    return out, lse


