"""fa3's kernels as torch custom ops (`torch.ops.fa3.*`).

    torch.ops.fa3.attention(q, k, v, causal, softmax_scale, kernel, deterministic=False,
                            backward_kernel=None, window_left=-1, window_right=-1, softcap=0.0,
                            sinks=None) -> (out, lse)   differentiable in q, k, v, sinks
    torch.ops.fa3.attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, kernel,
                                     deterministic, window_left=-1, window_right=-1, softcap=0.0,
                                     sinks=None) -> (dq, dk, dv, dsinks)
    torch.ops.fa3.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                                   window_left, window_right, softcap, kernel, deterministic=False,
                                   backward_kernel=None, sinks=None, max_seqlen_q=0) -> (out, lse)
                                   differentiable in q, k, v, sinks
    torch.ops.fa3.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                            causal, softmax_scale, kernel, deterministic,
                                            window_left, window_right, softcap, sinks=None)
                                            -> (dq, dk, dv, dsinks)
    torch.ops.fa3.attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, appended,
                                    causal, softmax_scale, num_splits, kernel, window_left=-1,
                                    window_right=-1, softcap=0.0, cu_seqlens_q=None, max_seqlen_q=0,
                                    max_seqlen_k=-1, cache_leftpad=None, sinks=None, q_descale=None,
                                    k_descale=None, v_descale=None, out_dtype=None) -> (out, lse)
    torch.ops.fa3.attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale,
                                kernel, window_left, window_right, softcap, out_dtype,
                                cu_seqlens_q=None, cu_seqlens_k=None)
                                -> (out, lse)               forward only (FP8 e4m3 q, k, v)
    torch.ops.fa3.gemm(a, b, kernel) -> out
    torch.ops.fa3.gemm_fp8(a, b, scale_a, scale_b, kernel, out_dtype) -> out   forward only

`sinks`: optional (heads_q,) float32 attention-sink logits (16-bit inputs; the FP8 op takes none);
the backward ops return their gradient dsinks (a (0,) tensor when there are none).

All are functional (they allocate their outputs; nothing is mutated), so torch.compile and
torch.export trace them as single graph nodes, and their fake implementations give output shapes
from symbolic input shapes without touching a GPU or compiling a kernel. `kernel` is a rung name
(fa3.available_kernels()); fa3.attention and fa3.gemm resolve their `kernel=None` before calling.

The public functions validate and, in plain eager calls, run the same implementation without the
dispatcher (fa3._dispatch.direct_call_ok). When the ops do run (compiled graphs, dispatch modes,
autograd, or direct calls to torch.ops.fa3.*) they validate their arguments again on real tensors,
which is also where the GPU and pointer-alignment checks that tracing skips take place.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch, _launch, backward, fp8, interface, kvcache, masking, matmul, varlen
from .cache import checks as kvcache_checks
from ._memo import BoundedMemo

_ATTENTION_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, str kernel, "
                     "bool deterministic=False, str? backward_kernel=None, int window_left=-1, "
                     "int window_right=-1, float softcap=0.0, Tensor? sinks=None) -> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                    "float softmax_scale, str kernel, bool deterministic, int window_left=-1, "
                    "int window_right=-1, float softcap=0.0, Tensor? sinks=None) "
                    "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("fa3::attention", mutates_args=(), schema=_ATTENTION_SCHEMA)
def attention(q, k, v, causal, softmax_scale, kernel, deterministic=False, backward_kernel=None,
              window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    """(out, lse) of rung `kernel`: out shaped like q (contiguous), lse (batch, heads_q, seqlen_q) fp32.
    `deterministic` and `backward_kernel` are for the backward (None: the fastest rung).
    A plain call (no window, softcap or sinks) like one that passed the checks runs its prepared
    launch (interface.prepare_plain), as fa3.attention's eager calls do."""
    plain = window_left == -1 and window_right == -1 and not softcap and sinks is None
    if plain:
        key = (kernel, interface.plain_key(q, k, v, causal, softmax_scale))
        launch = _PLAIN_LAUNCHES.get(key)
        if launch is not None and interface.data_aligned(q, k, v):
            return launch(q, k, v)
    spec = interface.check_attention(q, k, v, kernel)
    window = (window_left, window_right)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, softmax_scale), "kernel")
    _checks.check_rung_sinks(spec, sinks, q.shape[-2], q.device)
    result = interface.launch_attention(spec, q, k, v, causal, softmax_scale, None, window, softcap, sinks)
    if plain:
        _PLAIN_LAUNCHES.remember(key, interface.prepare_plain(spec, q, k, v, causal, softmax_scale))
    return result


# (rung, a plain call's key) -> its prepared launch: the op's calls that passed the checks
_PLAIN_LAUNCHES = BoundedMemo()


def _sinks_grad_like(sinks, q):
    """The fake dsinks: shaped like sinks, or (0,) when there are none."""
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else torch.empty_like(sinks)


@attention.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, kernel, deterministic=False, backward_kernel=None,
                    window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    batch, seqlen_q, heads_q, _ = q.shape
    return _launch.empty_output(q, v), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("fa3::attention_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, kernel, deterministic,
                       window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    """(dq, dk, dv, dsinks), each contiguous and shaped like its input, with backward rung
    `kernel` (dsinks: (0,) without sinks)."""
    spec = backward.check_backward(dout, q, k, v, out, lse, kernel, sinks=sinks, deterministic=deterministic)
    window = (window_left, window_right)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, softmax_scale), "backward_kernel")
    return backward.launch_attention_backward(spec, dout, q, k, v, out, lse, causal, softmax_scale,
                                               deterministic, window, softcap, sinks)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, kernel, deterministic,
                             window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            _sinks_grad_like(sinks, q))


def _save_for_backward(ctx, inputs, output):
    q, k, v, causal, softmax_scale, _, deterministic, backward_kernel, left, right, softcap, sinks = inputs
    out, lse = output
    ctx.window, ctx.softcap = (left, right), softcap
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.deterministic, ctx.backward_kernel = deterministic, backward_kernel
    ctx.mark_non_differentiable(lse)


def _attention_grads(ctx, dout, _dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    kernel = ctx.backward_kernel or _dispatch.backward_rung(None, q.shape[3], ctx.deterministic, v.shape[3],
                                                            masking.masked(ctx.causal, ctx.window)).name
    dq, dk, dv, dsinks = torch.ops.fa3.attention_backward(dout, q, k, v, out, lse, ctx.causal,
                                                          ctx.softmax_scale, kernel, ctx.deterministic,
                                                          ctx.window[0], ctx.window[1], ctx.softcap, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, (dsinks if sinks is not None else None)


attention.register_autograd(_attention_grads, setup_context=_save_for_backward)


@torch.library.custom_op("fa3::gemm", mutates_args=(), schema="(Tensor a, Tensor b, str kernel) -> Tensor")
def gemm(a, b, kernel):
    """a @ b with rung `kernel`: a new contiguous (M, N) tensor in a's dtype (a call like one that
    passed the checks: its prepared launch, matmul.prepare_plain_gemm)."""
    key = (kernel, matmul.plain_gemm_key(a, b))
    launch = _PLAIN_GEMMS.get(key)
    if launch is not None and matmul.gemm_data_aligned(a, b):
        return launch(a, b)
    spec = matmul.check_gemm(a, b, None, kernel)
    result = matmul.launch_gemm(spec, a, b)
    _PLAIN_GEMMS.remember(key, matmul.prepare_plain_gemm(spec, a, b))
    return result


_PLAIN_GEMMS = BoundedMemo()  # (rung, a plain GEMM's key) -> its prepared launch


@gemm.register_fake
def _gemm_fake(a, b, kernel):
    return a.new_empty((a.shape[0], b.shape[1]))


def _gemm_save(ctx, inputs, output):
    a, b, ctx.kernel = inputs
    ctx.save_for_backward(a, b)


def _gemm_grads(ctx, dc):
    """dA = dC B^T and dB = A^T dC: the same op on transposed views (no copies)."""
    a, b = ctx.saved_tensors
    da = torch.ops.fa3.gemm(dc, b.t(), ctx.kernel) if ctx.needs_input_grad[0] else None
    db = torch.ops.fa3.gemm(a.t(), dc, ctx.kernel) if ctx.needs_input_grad[1] else None
    return da, db, None


gemm.register_autograd(_gemm_grads, setup_context=_gemm_save)


@torch.library.custom_op("fa3::gemm_fp8", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, str kernel, "
                                "ScalarType out_dtype) -> Tensor")
def gemm_fp8(a, b, scale_a, scale_b, kernel, out_dtype):
    """scale_a * scale_b * (a @ b) on e4m3 a, b with rung `kernel`: a new (M, N) tensor in
    out_dtype. No autograd: the FP8 GEMM is forward-only."""
    spec, scales, out_dtype = matmul.check_gemm_fp8(a, b, scale_a, scale_b, None, out_dtype, kernel)
    return matmul.launch_gemm(spec, a, b, None, scales, out_dtype)


@gemm_fp8.register_fake
def _gemm_fp8_fake(a, b, scale_a, scale_b, kernel, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, "
                  "float softmax_scale, int window_left, int window_right, float softcap, str kernel, "
                  "bool deterministic=False, str? backward_kernel=None, Tensor? sinks=None, "
                  "int max_seqlen_q=0) -> (Tensor, Tensor)")
_VARLEN_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                           "Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, float softmax_scale, "
                           "str kernel, bool deterministic, int window_left, int window_right, "
                           "float softcap, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("fa3::attention_varlen", mutates_args=(), schema=_VARLEN_SCHEMA)
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_left,
                     window_right, softcap, kernel, deterministic=False, backward_kernel=None, sinks=None,
                     max_seqlen_q=0):
    """(out (total_q, heads_q, d), lse (heads_q, total_q)) of a packed variable-length batch
    (max_seqlen_q: the longest query sequence, 0 if unknown; it only picks tiles)."""
    spec = varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, kernel)
    _checks.check_rung_sinks(spec, sinks, q.shape[1], q.device)
    return varlen.launch_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                                (window_left, window_right), softcap, sinks=sinks,
                                max_seqlen_q=max_seqlen_q or None)


@attention_varlen.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_left,
                           window_right, softcap, kernel, deterministic=False, backward_kernel=None,
                           sinks=None, max_seqlen_q=0):
    total_q, heads_q, _ = q.shape
    return _launch.empty_output(q, v), q.new_empty((heads_q, total_q), dtype=torch.float32)


@torch.library.custom_op("fa3::attention_varlen_backward", mutates_args=(), schema=_VARLEN_BACKWARD_SCHEMA)
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                              kernel, deterministic, window_left, window_right, softcap, sinks=None):
    """(dq, dk, dv, dsinks) of a packed batch, each contiguous and shaped like its input."""
    spec = backward.check_backward(dout, q, k, v, out, lse, kernel, (cu_seqlens_q, cu_seqlens_k), sinks,
                                   deterministic)
    window = (window_left, window_right)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, softmax_scale), "backward_kernel")
    return backward.launch_varlen_backward(spec, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                           causal, softmax_scale, deterministic, window, softcap, sinks)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal,
                                    softmax_scale, kernel, deterministic, window_left, window_right,
                                    softcap, sinks=None):
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            _sinks_grad_like(sinks, q))


def _varlen_save_for_backward(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, causal, softmax_scale, left, right, softcap, _, deterministic, backward_kernel,
     sinks, _max_seqlen_q) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
    ctx.causal, ctx.softmax_scale, ctx.window, ctx.softcap = causal, softmax_scale, (left, right), softcap
    ctx.deterministic, ctx.backward_kernel = deterministic, backward_kernel
    ctx.mark_non_differentiable(lse)


def _varlen_grads(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
    kernel = ctx.backward_kernel or _dispatch.backward_rung(None, q.shape[2], ctx.deterministic, v.shape[2],
                                                            masking.masked(ctx.causal, ctx.window)).name
    dq, dk, dv, dsinks = torch.ops.fa3.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, ctx.causal, ctx.softmax_scale, kernel, ctx.deterministic,
        ctx.window[0], ctx.window[1], ctx.softcap, sinks)
    return (dq, dk, dv) + (None,) * 10 + (dsinks if sinks is not None else None, None)


attention_varlen.register_autograd(_varlen_grads, setup_context=_varlen_save_for_backward)


_KVCACHE_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                   "int appended, bool causal, float softmax_scale, int num_splits, str kernel, "
                   "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? cu_seqlens_q=None, "
                   "int max_seqlen_q=0, int max_seqlen_k=-1, Tensor? cache_leftpad=None, Tensor? sinks=None, "
                   "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
                   "ScalarType? out_dtype=None) -> (Tensor, Tensor)")


@torch.library.custom_op("fa3::attention_kvcache", mutates_args=(), schema=_KVCACHE_SCHEMA)
def attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, appended, causal, softmax_scale,
                      num_splits, kernel, window_left=-1, window_right=-1, softcap=0.0, cu_seqlens_q=None,
                      max_seqlen_q=0, max_seqlen_k=-1, cache_leftpad=None, sinks=None, q_descale=None,
                      k_descale=None, v_descale=None, out_dtype=None):
    """(out, lse) against the cache, whose last `appended` tokens per sequence are already written
    (fa3.attention_with_kvcache appends them before calling). Packed queries (cu_seqlens_q): q and
    out (total_q, heads_q, d), lse (heads_q, total_q). An FP8 cache: the descales (no q_descale for
    16-bit q), out in out_dtype (None: bf16 for FP8 q, q's dtype for 16-bit q)."""
    window = (window_left, window_right)
    packed = cu_seqlens_q is not None
    spec, seqlens, capacity, _, max_q = kvcache_checks.check_kvcache(
        q, k_cache, v_cache, None, None, cache_seqlens, block_table, kernel, window, softcap, cu_seqlens_q,
        max_seqlen_q if packed else None, cache_leftpad=cache_leftpad)
    _checks.check_rung_sinks(spec, sinks, q.shape[-2], q.device)
    descales = kvcache_checks.check_descales(q, k_cache, (q_descale, k_descale, v_descale), seqlens.shape[0],
                                             k_cache.shape[2])
    kvcache_checks.check_out_dtype(out_dtype, q, descales)
    masking.check_scale(softmax_scale)
    return kvcache.launch_kvcache(spec, q, k_cache, v_cache, seqlens, block_table, capacity, appended,
                                  causal, softmax_scale, num_splits, window, softcap, cu_seqlens_q, max_q,
                                  max_seqlen_k, None, cache_leftpad, sinks, descales, out_dtype)


@attention_kvcache.register_fake
def _attention_kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table, appended, causal,
                            softmax_scale, num_splits, kernel, window_left=-1, window_right=-1,
                            softcap=0.0, cu_seqlens_q=None, max_seqlen_q=0, max_seqlen_k=-1, cache_leftpad=None,
                            sinks=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    if q.dtype in _checks.FP8_LIKE:
        out_dtype = out_dtype or torch.bfloat16
    out = q.new_empty(q.shape, dtype=out_dtype or q.dtype)
    if cu_seqlens_q is not None:
        total_q, heads_q, _ = q.shape
        return out, q.new_empty((heads_q, total_q), dtype=torch.float32)
    batch, seqlen_q, heads_q, _ = q.shape
    return out, q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


_FP8_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor q_descale, Tensor k_descale, Tensor v_descale, "
               "bool causal, float softmax_scale, str kernel, int window_left, int window_right, "
               "float softcap, ScalarType out_dtype, Tensor? cu_seqlens_q=None, "
               "Tensor? cu_seqlens_k=None) -> (Tensor, Tensor)")


@torch.library.custom_op("fa3::attention_fp8", mutates_args=(), schema=_FP8_SCHEMA)
def attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, kernel, window_left,
                  window_right, softcap, out_dtype, cu_seqlens_q=None, cu_seqlens_k=None):
    """(out in out_dtype, lse) of FP8 rung `kernel` on e4m3 q, k, v and their descales; with
    cu_seqlens_q/k a packed batch (attention_varlen's layouts). No autograd: FP8 attention is
    forward-only (fa3.attention refuses inputs that require grad)."""
    cu_seqlens = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)
    spec, descales = fp8.check_attention_fp8(q, k, v, q_descale, k_descale, v_descale, kernel,
                                             cu_seqlens=cu_seqlens)
    mask = masking.masking(causal, (window_left, window_right), softcap, softmax_scale)
    _dispatch.check_variants(spec, mask, "kernel")
    return fp8.launch_attention_fp8(spec, q, k, v, descales, mask, out_dtype, None, cu_seqlens)


@attention_fp8.register_fake
def _attention_fp8_fake(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, kernel,
                        window_left, window_right, softcap, out_dtype, cu_seqlens_q=None,
                        cu_seqlens_k=None):
    heads_q = q.shape[-2]
    return (q.new_empty(q.shape, dtype=out_dtype),
            q.new_empty((*q.shape[:-3], heads_q, q.shape[-3]), dtype=torch.float32))
