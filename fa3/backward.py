"""The backward of fa3.attention and fa3.attention_varlen: the backward ops' checks and bodies.

    preprocess (D = rowsum(dO * O), LSE * log2 e)  ->  main kernel (dK, dV; dQ summed in FP32)
    ->  postprocess (dQ * softmax_scale -> dtype; GQA: dK and dV summed over each group)

Attention sinks need nothing of the kernels: the forward's LSE includes each head's sink, so
P = exp(S - LSE) are the probabilities of the keys, and dS = P (dP - D) holds as it is (the sink
adds no value, so D = rowsum(dO * O) is still sum_j P_j dP_j). The sink's own gradient is
d sinks_h = -sum over the rows of head h of exp(sinks_h - LSE) * D (sink_grad), from the
preprocess's D.

`attention_backward` (and `attention_varlen_backward`, for packed batches) runs the three for a
given forward result (out, lse): what a caller that merges several attention calls needs (fa3.context_parallel_attention differentiates each ring step
with the merged out and lse). The autograd registration that calls it is in fa3.ops; the rung
choice in fa3._dispatch.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, masking, varlen_checks
from . import mods as _mods
from .compile import builders as _compile
from .kernels import config


def check_backward(dout, q, k, v, out, lse, kernel, cu_seqlens=None, sinks=None, deterministic=False,
                   masked=False):
    """The backward op's arguments: the forward's (checked again: the op can be called directly)
    plus dout and out shaped like q and the forward's FP32 lse: (batch, heads_q, seqlen_q), or
    (heads_q, total_q) for a packed batch (`cu_seqlens`: its (cu_seqlens_q, cu_seqlens_k)).
    `masked` (masking.masked): whether the call has a causal mask or window (picks kernel=None's
    deterministic rung)."""
    if cu_seqlens is None:
        _checks.check_attention(q, k, v, None)
        batch, seqlen_q, heads_q, head_dim = q.shape
        lse_shape, lse_layout = (batch, heads_q, seqlen_q), "(batch, heads_q, seqlen_q)"
    else:
        varlen_checks.check_varlen(q, k, v, *cu_seqlens, None, None, None, check_values=False)
        total_q, heads_q, head_dim = q.shape
        lse_shape, lse_layout = (heads_q, total_q), "(heads_q, total_q)"
    spec = _dispatch.memo_rung(_dispatch.backward_rung, kernel, head_dim, bool(deterministic), v.shape[-1],
                               bool(masked))
    if cu_seqlens is not None:
        varlen_checks.check_varlen_rung(spec, "backward_kernel")
    like = _checks.output_like(q, v)  # q's shape with v's head dim
    for name, t in (("dout", dout), ("out", out)):
        _checks.check_tensor(t, name, q.dim(), q.dtype, unit_stride_last=False)  # any strides: copied if needed
        if t.shape != like.shape or t.device != q.device:
            raise ValueError(f"{name} must be shaped like the output {tuple(like.shape)} (q's shape with v's "
                             f"head dim) on {q.device}, got {tuple(t.shape)} on {t.device}")
    if not isinstance(lse, torch.Tensor) or lse.shape != lse_shape \
            or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be the forward's {lse_layout} = {lse_shape} float32 "
                         f"log-sum-exp on {q.device}")
    if sinks is not None:
        _checks.check_sinks(sinks, heads_q, q.device)
    return spec


def sink_grad(sinks, lse, dsum, rows: int):
    """d sinks_h = -sum_{batch, rows} exp(sinks_h - LSE) * D: lse (batch, heads_q, >= rows) with
    the sinks included, dsum the preprocess's D (batch, heads_q, >= rows); (heads_q,) FP32. (A sink
    of -inf in a row with no key: exp(nan) is taken as 0, the sink's probability.)"""
    p_sink = torch.exp(sinks.detach()[None, :, None] - lse[..., :rows]).nan_to_num_(0.0)
    return -(p_sink * dsum[..., :rows]).sum(dim=(0, 2))


def _no_sink_grad(sinks, q):
    """dsinks when the kernels do not run: zeros, or (0,) without sinks."""
    if sinks is None:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    return torch.zeros_like(sinks, memory_format=torch.contiguous_format)


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False,
                       softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                       deterministic: bool = False, backward_kernel: str | None = None, sinks=None):
    """(dq, dk, dv) of fa3.attention(q, k, v, ...) for the upstream gradient `dout`, given the
    forward's `out` (shaped like q) and FP32 `lse` (batch, heads_q, seqlen_q), with the forward's
    causal, softmax_scale, window_size and softcap.

    `out` and `lse` need not come from this q, k, v: with the out and lse of attention over a
    larger key set (merged from blocks, as ring attention does), the result is this key block's
    share of the gradient: dq summed over blocks, and this block's dk and dv, are exact. GQA: dk
    and dv are summed over each group. Not differentiable itself (a plain function, not autograd).
    deterministic and backward_kernel: as in fa3.attention.
    sinks: the forward's attention sinks, (heads_q,) float32: then (dq, dk, dv, dsinks). (dq, dk and
    dv need only the lse, which includes the sinks; dsinks depends on out, lse and dout alone, so
    it is the same for every key block of a merged result: take it once.)"""
    spec = check_backward(dout, q, k, v, out, lse, backward_kernel, sinks=sinks, deterministic=deterministic,
                          masked=masking.masked(causal, window_size))
    return _backward(spec, (dout, q, k, v, out, lse), None, causal, softmax_scale, window_size, softcap,
                     deterministic, sinks)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                              softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                              deterministic: bool = False, backward_kernel: str | None = None, sinks=None):
    """attention_backward for a packed batch (fa3.attention_varlen's layouts: q (total_q, heads_q, d),
    out like q, lse (heads_q, total_q) FP32, int32 offsets cu_seqlens_q/k on q's device): the
    gradient of a given forward result, e.g. one key block's share of a merged one. Sequences may
    be empty; a query row whose sequence has no key gets dq = 0."""
    spec = check_backward(dout, q, k, v, out, lse, backward_kernel, (cu_seqlens_q, cu_seqlens_k), sinks,
                          deterministic, masking.masked(causal, window_size))
    return _backward(spec, (dout, q, k, v, out, lse), (cu_seqlens_q, cu_seqlens_k), causal, softmax_scale,
                     window_size, softcap, deterministic, sinks)


def _backward(spec, tensors, cu_seqlens, causal, softmax_scale, window_size, softcap, deterministic, sinks):
    """The body both public backward calls share: the masking's check, then the launch directly
    or through the op (traced, under modes)."""
    q = tensors[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window, causal, softcap, deterministic = tuple(window_size), bool(causal), float(softcap), bool(deterministic)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, scale), "backward_kernel")
    direct = _dispatch.direct_call_ok(*tensors) and (sinks is None or _dispatch.direct_call_ok(sinks))
    if cu_seqlens is None and direct:
        with _dispatch.op_range("fa3::attention_backward"):
            grads = launch_attention_backward(spec, *tensors, causal, scale, deterministic, window, softcap,
                                              sinks)
    elif cu_seqlens is None:
        grads = torch.ops.fa3.attention_backward(*tensors, causal, scale, spec.name, deterministic, window[0],
                                                 window[1], softcap, sinks)
    elif direct:
        with _dispatch.op_range("fa3::attention_varlen_backward"):
            grads = launch_varlen_backward(spec, *tensors, *cu_seqlens, causal, scale, deterministic, window,
                                           softcap, sinks)
    else:
        grads = torch.ops.fa3.attention_varlen_backward(*tensors, *cu_seqlens, causal, scale, spec.name,
                                                        deterministic, window[0], window[1], softcap, sinks)
    return tuple(grads) if sinks is not None else tuple(grads[:3])


class DifferentiableAttention(torch.autograd.Function):
    """fa3.attention's and fa3.attention_varlen's eager calls that need gradients: the forward
    launched as given, the backward launched directly (`gradients`: launch_attention_backward or
    launch_varlen_backward with the rung and masks chosen at the call). The same kernels and saved
    tensors as the ops' autograd registrations (fa3.ops), without their dispatch; traced calls,
    modes and transforms use the ops. Arguments are checked by the caller.
    apply(forward, gradients, op, q, k, v) -> (out, lse): forward(q, k, v) returns (out, lse);
    gradients(dout, q, k, v, out, lse) returns (dq, dk, dv); `op` names the backward for a profiler
    ("fa3::attention_backward"); lse is not differentiable."""

    @staticmethod
    def forward(ctx, forward, gradients, op, q, k, v):
        out, lse = forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.gradients, ctx.op = gradients, op
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient made (a fill launch) for the unused lse
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        if dout is None:  # out took no part in what is differentiated
            return None, None, None, None, None, None
        with _dispatch.op_range(ctx.op):
            dq, dk, dv = ctx.gradients(dout, *ctx.saved_tensors)
        return None, None, None, dq, dk, dv


def dense_gradients(spec, causal: bool, scale: float, deterministic: bool, window, softcap: float):
    """DifferentiableAttention's `gradients` for fa3.attention's layout, with backward rung spec."""
    def gradients(dout, q, k, v, out, lse):
        return launch_attention_backward(spec, dout, q, k, v, out, lse, causal, scale, deterministic, window,
                                         softcap)[:3]
    return gradients


def mods_gradients(spec, score_mod, mask_mod, causal: bool, scale: float, deterministic: bool, window,
                   softcap: float, block_lists=None):
    """DifferentiableAttention's `gradients` for fa3.attention with a score and/or mask mod (the
    flex form of backward rung spec, kernels/bwd_ws.FlexBackward): the mods are taken for the
    backward when it runs (fa3.mods.Mods(backward=True), which refuses a score mod without its
    derivative, naming what to provide). `block_lists`: None, or a BlockMask's transposed int32
    lists (q_num_blocks, q_indices[, full_q_num_blocks, full_q_indices]), checked by fa3.flex: the
    block-sparse form (BlockSparseFlexBackward) walks them."""
    def gradients(dout, q, k, v, out, lse):
        mods = _mods.Mods(score_mod, mask_mod, backward=True)
        return launch_attention_backward(spec, dout, q, k, v, out, lse, causal, scale, deterministic, window,
                                         softcap, mods=mods, block_lists=block_lists)[:3]
    return gradients


def packed_gradients(spec, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, deterministic: bool, window,
                     softcap: float):
    """DifferentiableAttention's `gradients` for a packed batch (fa3.attention_varlen's layout)."""
    def gradients(dout, q, k, v, out, lse):
        return launch_varlen_backward(spec, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                      deterministic, window, softcap)[:3]
    return gradients


_NO_LOCK: dict[torch.device, torch.Tensor] = {}  # a stand-in for the counters when not deterministic


def _fragment_dq(spec) -> bool:
    """Whether the rung adds dQ in fragment order (kernels/bwd_post.py): its accumulator is then
    head-major, in whole Q tiles, converted by its own postprocess."""
    return getattr(spec.load_class(), "FRAGMENT_DQ", False)


def launch_attention_backward(spec, dout, q, k, v, out, lse, causal: bool, scale: float,
                              deterministic: bool, window=(-1, -1), softcap: float = 0.0, sinks=None,
                              mods=None, block_lists=None):
    """(dq, dk, dv, dsinks) for rung `spec`: preprocess (D, LSE * log2 e), the main kernel (dK, dV
    per query head; dQ summed in FP32), postprocess (dQ * scale -> dtype; GQA: dK/dV from the FP32
    sums the kernel added, or, deterministic, summed over each group from one FP32 slice per query
    head); dsinks: sink_grad, or (0,) without sinks. `mods`: None, or fa3.mods.Mods(backward=True)
    (the main kernel's flex form); `block_lists` (with mods): None, or a BlockMask's transposed
    lists (the block-sparse form: the statistics and the dQ accumulator in whole blocks, whose last
    Q tile may lie past seqlen_q, kernels/common/q_walk.py).
    The body of the fa3::attention_backward op: arguments are validated already."""
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if dq.numel() == 0 or k.shape[1] == 0:  # nothing to differentiate, or no key: all gradients 0
        return dq.zero_(), dk.zero_(), dv.zero_(), _no_sink_grad(sinks, q)
    cfg = config.backward_config(spec.config, q.shape[3], v.shape[3])
    tile_m = cfg.tile_m
    q_tiles = -(-q.shape[1] // tile_m)
    if block_lists is not None:  # whole BlockMask blocks of Q tiles
        block_m = config.BLOCK_MASK_TILE[0]
        q_tiles = -(-q.shape[1] // block_m) * (block_m // tile_m)
    # statistics padded to whole Q tiles: the kernel reads them unchecked (a Q tile that is not a
    # multiple of 64 reads its statistics in 64-row blocks: up to 63 rows more); dQ too: b1 adds
    # it with unchecked scalar atomics, b2 on in fragment order (whole tiles of a head-major
    # accumulator)
    dsinks = _run(spec, cfg, dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, window,
                  softcap, stat_rows=q_tiles * tile_m + (-tile_m) % 64, dq_rows=q_tiles * tile_m,
                  lock_tiles=q_tiles, sinks=sinks, mods=mods, block_lists=block_lists)
    return dq, dk, dv, dsinks


def launch_varlen_backward(spec, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal: bool,
                           scale: float, deterministic: bool, window=(-1, -1), softcap: float = 0.0,
                           sinks=None):
    """(dq, dk, dv, dsinks) of a packed batch (fa3.attention_varlen's layouts; lse (heads_q, total_q)):
    the same three steps with one batch entry holding every sequence (kernels/bwd.py, varlen)."""
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if dq.numel() == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), _no_sink_grad(sinks, q)
    total_q, entries = q.shape[0], cu_seqlens_q.shape[0] - 1
    cfg = config.backward_config(spec.config, q.shape[2], v.shape[2])
    tile_m = cfg.tile_m
    # the statistics in whole-tile slots, each entry's tiles from its own (kernels/bwd_pre.py;
    # kernels/bwd.py, packed_q_tile), as many as the counters; dQ too in fragment order, else
    # packed, where a last Q tile may add its (zero) rows past the packed end (b1: tile_m rows of slack)
    slots = total_q // tile_m + entries + 1
    dq_rows = slots * tile_m if _fragment_dq(spec) else total_q + tile_m
    dsinks = _run(spec, cfg, *(t.unsqueeze(0) for t in (dout, q, k, v, out, lse, dq, dk, dv)), causal,
                  scale, deterministic, window, softcap, stat_rows=slots * tile_m, dq_rows=dq_rows,
                  lock_tiles=slots, cu_seqlens=(cu_seqlens_q, cu_seqlens_k), sinks=sinks)
    return dq, dk, dv, dsinks


def _run(spec, cfg, dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, window, softcap,
         stat_rows: int, dq_rows: int, lock_tiles: int, cu_seqlens=None, sinks=None, mods=None, block_lists=None):
    """Preprocess, main kernel and postprocess into dq, dk, dv, all in the 4-D (batch, seqlen,
    heads, d) layout; `cfg`: the rung's configuration at this head dim (config.backward_config);
    `stat_rows`, `dq_rows`, `lock_tiles`: the extents of the FP32 statistics, the dQ accumulator
    and the deterministic counters per (batch, head); `mods`: the flex form's (its captured
    tensors one more argument; a score mod's scales as the forward's, masking.for_score_mod);
    `block_lists`: None, or (with mods) a BlockMask's transposed lists, the last argument.
    Returns dsinks (sink_grad), or a (0,) tensor without sinks."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    value_dim = None if head_dim_v == head_dim else head_dim_v  # (the compile key's head_dim_v)
    device, dtype = q.device, q.dtype
    if q.requires_grad or k.requires_grad or v.requires_grad or out.requires_grad or dout.requires_grad:
        q, k, v, out, dout = _launch.detached(q, k, v, out, dout)
    q, k, v, dout = (_launch.tma_ready(t) for t in (q, k, v, dout))
    out = _launch.tma_ready(out)  # the preprocess reads it in 16-byte vectors
    fragment_dq = _fragment_dq(spec)
    # the statistics and the dQ accumulator: the call's own kernels write and read them (the
    # preprocess writes LSE2 and D and zeroes dQ's sums), so small ones are the stream's scratch
    # (no allocation a step); the dQ sums head-major with fragment_dq (each Q tile's share
    # contiguous), seen as (batch, rows, heads, d)
    stats = (batch, heads_q, stat_rows)
    sums = (batch, heads_q, dq_rows, head_dim) if fragment_dq else (batch, dq_rows, heads_q, head_dim)
    lse2, dsum, dq_acc = _launch.small_scratch((stats, stats, sums), device)
    if fragment_dq:
        dq_acc = dq_acc.transpose(1, 2)
    cu_q, cu_k = cu_seqlens if cu_seqlens is not None else (_launch.stand_in(device),) * 2
    packed = cu_seqlens is not None
    _compile.get_backward_preprocess(dtype, head_dim, value_dim, packed, cfg.tile_m, fragment_dq)(
        out, dout, lse, lse2, dsum, dq_acc, cu_q)  # zeroes dq_acc
    if sinks is None:
        dsinks = _no_sink_grad(None, q)
    elif packed:  # D in slots there: the packed rows' D again, (1, heads_q, total_q)
        dsinks = sink_grad(sinks, lse, (dout.float() * out.float()).sum(-1).transpose(1, 2), seqlen_q)
    else:
        dsinks = sink_grad(sinks, lse, dsum, seqlen_q)
    gqa = heads_q != heads_kv
    if gqa and not deterministic:  # the kernel adds each query head's share with FP32 atomics
        dk_h = torch.zeros(batch, seqlen_k, heads_kv, head_dim, dtype=torch.float32, device=device)
        dv_h = torch.zeros(batch, seqlen_k, heads_kv, head_dim_v, dtype=torch.float32, device=device)
    elif gqa:  # one slice per query head in FP32, summed over each group below in a fixed order
        dk_h = torch.empty(batch, seqlen_k, heads_q, head_dim, dtype=torch.float32, device=device)
        dv_h = torch.empty(batch, seqlen_k, heads_q, head_dim_v, dtype=torch.float32, device=device)
    else:
        dk_h, dv_h = dk, dv
    if deterministic or cfg.ordered_dq:  # the dQ turn counters
        lock = torch.zeros(batch, heads_q, lock_tiles, dtype=torch.int32, device=device)
    else:
        lock = _NO_LOCK.get(device)
        if lock is None:
            lock = _NO_LOCK[device] = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    mask = masking.masking(causal, window, softcap, scale)  # as the forward saw the scores
    fn = _compile.get_backward(spec, dtype, head_dim, mask.causal, bool(deterministic), gqa, mask.local,
                               mask.softcap, packed, value_dim, mods, len(block_lists or ()))
    aux = ()
    if mods is not None:  # (mods that capture no tensor: a stand-in, as the kernel's signature has)
        aux = (mods.aux(device) or (_launch.stand_in(device),),)
        if mods.score_mod is not None:
            mask = masking.for_score_mod(mask)
        if block_lists is not None:
            aux += (tuple(block_lists),)
    fn(q, k, v, dout, lse2, dsum, dq_acc, dk_h, dv_h, lock, mask.scale_log2, scale, mask.left,
       mask.right, mask.softcap_scale, cu_q, cu_k, *aux)
    if fragment_dq:
        _compile.get_backward_postprocess(spec, dtype, head_dim, cu_seqlens is not None)(dq_acc, dq, scale, cu_q)
    else:
        torch.mul(dq_acc[:, :seqlen_q], scale, out=dq)
    if gqa and not deterministic:
        dk.copy_(dk_h)
        dv.copy_(dv_h)
    elif gqa:
        group = heads_q // heads_kv
        torch.sum(dk_h.view(batch, seqlen_k, heads_kv, group, head_dim), dim=3, out=dk)
        torch.sum(dv_h.view(batch, seqlen_k, heads_kv, group, head_dim_v), dim=3, out=dv)
    return dsinks
