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

# The ops are defined through torch.library.Library rather than torch.library.custom_op: the same
# schema and fake implementation (all torch.compile and torch.export read), without custom_op's
# Python layers around every call (its generic autograd kernel, a dynamo-disable wrapper, the
# output-aliasing check and a schema walk for defaults).
_LIBRARY = torch.library.Library("fa3", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_grad_enabled, _any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
# Backends whose kernel is the op's body (registered as CompositeExplicitAutograd; its checks refuse
# all but CUDA tensors). When one of them is all that is left below autograd (no Python key:
# FakeTensorMode, dispatch modes, functionalization), the autograd kernel calls the body itself
# instead of redispatching to it.
_BODY_KEYS = frozenset((torch._C.DispatchKey.CUDA, torch._C.DispatchKey.CPU))
# The keysets of plain tensors of those backends at the autograd key, as raw ints: the common case
# is one set lookup (the general test builds a key set and hashes an enum).
_PLAIN_KEYSETS = frozenset(
    (torch._C.DispatchKeySet(backend) | torch._C.DispatchKeySet(autograd)).raw_repr()
    for backend, autograd in ((torch._C.DispatchKey.CUDA, torch._C.DispatchKey.AutogradCUDA),
                              (torch._C.DispatchKey.CPU, torch._C.DispatchKey.AutogradCPU)))


def _below_autograd(op, body, keyset, args):
    """What the dispatcher would run below the autograd key: `body` on plain tensors, or else the
    redispatch (fake implementation, modes)."""
    if keyset.raw_repr() in _PLAIN_KEYSETS:
        return body(*args)
    below = keyset & _AFTER_AUTOGRAD
    if below.highestPriorityTypeId() in _BODY_KEYS:
        return body(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(below, *args)


class _NotDifferentiable(torch.autograd.Function):
    """A forward-only op's outputs for inputs that require grad: differentiating them raises."""

    @staticmethod
    def forward(ctx, op, body, keyset, *args):
        ctx.op = op
        return _below_autograd(op, body, keyset, args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op.name()} has no backward: it is forward-only")


def _define(name: str, schema: str, body, fake, function=_NotDifferentiable):
    """Define torch.ops.fa3.<name>: `body` runs it (on every backend: its checks refuse non-CUDA
    tensors), `fake` gives its outputs' shapes to tracing and meta tensors, and its autograd kernel
    runs `function` (a torch.autograd.Function taking (op, body, keyset, *all the op's arguments))
    when an input requires grad, else the body as the dispatcher would."""
    _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fa3::{name}", fake, lib=_LIBRARY)
    op = getattr(torch.ops.fa3, name).default
    # the dispatcher leaves out trailing arguments equal to their defaults: the Function gets them all
    defaults = tuple(argument.default_value for argument in op._schema.arguments)

    def autograd_kernel(keyset, *args):
        if _grad_enabled() and _any_requires_grad(*args):
            return function.apply(op, body, keyset, *args, *defaults[len(args):])
        if keyset.raw_repr() in _PLAIN_KEYSETS:  # (_below_autograd's common case, inline)
            return body(*args)
        return _below_autograd(op, body, keyset, args)

    _LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)


_ATTENTION_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, str kernel, "
                     "bool deterministic=False, str? backward_kernel=None, int window_left=-1, "
                     "int window_right=-1, float softcap=0.0, Tensor? sinks=None) -> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                    "float softmax_scale, str kernel, bool deterministic, int window_left=-1, "
                    "int window_right=-1, float softcap=0.0, Tensor? sinks=None) "
                    "-> (Tensor, Tensor, Tensor, Tensor)")


def attention(q, k, v, causal, softmax_scale, kernel, deterministic=False, backward_kernel=None,
              window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    """(out, lse) of rung `kernel`: out shaped like q (contiguous), lse (batch, heads_q, seqlen_q) fp32.
    `deterministic` and `backward_kernel` are for the backward (None: the fastest rung).
    A plain call (no window, softcap or sinks) like one that passed the checks runs its prepared
    launch (interface.prepare_plain), as fa3.attention's eager calls do."""
    plain = window_left == -1 and window_right == -1 and not softcap and sinks is None
    if plain:
        key = interface.plain_key(q, k, v, causal, softmax_scale, kernel)
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


# a plain call's key with its rung -> its prepared launch: the op's calls that passed the checks
_PLAIN_LAUNCHES = BoundedMemo()


def _sinks_grad_like(sinks, q):
    """The fake dsinks: shaped like sinks, or (0,) when there are none."""
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else torch.empty_like(sinks)


def _attention_fake(q, k, v, causal, softmax_scale, kernel, deterministic=False, backward_kernel=None,
                    window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    batch, seqlen_q, heads_q, _ = q.shape
    return _launch.empty_output(q, v), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, kernel, deterministic,
                       window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    """(dq, dk, dv, dsinks), each contiguous and shaped like its input, with backward rung
    `kernel` (dsinks: (0,) without sinks)."""
    spec = backward.check_backward(dout, q, k, v, out, lse, kernel, sinks=sinks, deterministic=deterministic)
    window = (window_left, window_right)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, softmax_scale), "backward_kernel")
    return backward.launch_attention_backward(spec, dout, q, k, v, out, lse, causal, softmax_scale,
                                               deterministic, window, softcap, sinks)


def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, kernel, deterministic,
                             window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            _sinks_grad_like(sinks, q))


def _keep_for_backward(ctx, saved, lse, causal, softmax_scale, left, right, softcap, deterministic,
                       backward_kernel):
    """What an attention Function's backward reads: the tensors `saved`, the masking and the
    backward's choices; lse returned as a non-differentiable output."""
    ctx.save_for_backward(*saved)
    ctx.causal, ctx.softmax_scale, ctx.window, ctx.softcap = causal, softmax_scale, (left, right), softcap
    ctx.deterministic, ctx.backward_kernel = deterministic, backward_kernel
    ctx.mark_non_differentiable(lse)


class _DifferentiableAttention(torch.autograd.Function):
    """fa3::attention's autograd: the backward through torch.ops.fa3.attention_backward, with
    backward_kernel or the fastest backward rung for the call. Differentiable in q, k, v, sinks."""

    @staticmethod
    def forward(ctx, op, body, keyset, q, k, v, causal, softmax_scale, kernel, deterministic, backward_kernel,
                left, right, softcap, sinks):
        out, lse = _below_autograd(op, body, keyset, (q, k, v, causal, softmax_scale, kernel, deterministic,
                                                      backward_kernel, left, right, softcap, sinks))
        _keep_for_backward(ctx, (q, k, v, out, lse, sinks), lse, causal, softmax_scale, left, right, softcap,
                           deterministic, backward_kernel)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kernel = ctx.backward_kernel or _dispatch.backward_rung(None, q.shape[3], ctx.deterministic, v.shape[3],
                                                                masking.masked(ctx.causal, ctx.window)).name
        dq, dk, dv, dsinks = torch.ops.fa3.attention_backward(dout, q, k, v, out, lse, ctx.causal,
                                                              ctx.softmax_scale, kernel, ctx.deterministic,
                                                              ctx.window[0], ctx.window[1], ctx.softcap, sinks)
        return (None, None, None, dq, dk, dv) + (None,) * 8 + (dsinks if sinks is not None else None,)


_define("attention", _ATTENTION_SCHEMA, attention, _attention_fake, _DifferentiableAttention)
_define("attention_backward", _BACKWARD_SCHEMA, attention_backward, _attention_backward_fake)


def gemm(a, b, kernel):
    """a @ b with rung `kernel`: a new contiguous (M, N) tensor in a's dtype (a call like one that
    passed the checks: its prepared launch, matmul.prepare_plain_gemm)."""
    key = matmul.plain_gemm_key(a, b, kernel)
    launch = _PLAIN_GEMMS.get(key)
    if launch is not None and matmul.gemm_data_aligned(a, b):
        return launch(a, b)
    spec = matmul.check_gemm(a, b, None, kernel)
    result = matmul.launch_gemm(spec, a, b)
    _PLAIN_GEMMS.remember(key, matmul.prepare_plain_gemm(spec, a, b))
    return result


_PLAIN_GEMMS = BoundedMemo()  # a plain GEMM's key with its rung -> its prepared launch


def _gemm_fake(a, b, kernel):
    return a.new_empty((a.shape[0], b.shape[1]))


class _DifferentiableGemm(torch.autograd.Function):
    """fa3::gemm's autograd: dA = dC B^T and dB = A^T dC, the same op on transposed views (no copies)."""

    @staticmethod
    def forward(ctx, op, body, keyset, a, b, kernel):
        ctx.save_for_backward(a, b)
        ctx.kernel = kernel
        return _below_autograd(op, body, keyset, (a, b, kernel))

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da = torch.ops.fa3.gemm(dc, b.t(), ctx.kernel) if ctx.needs_input_grad[3] else None
        db = torch.ops.fa3.gemm(a.t(), dc, ctx.kernel) if ctx.needs_input_grad[4] else None
        return None, None, None, da, db, None


_define("gemm", "(Tensor a, Tensor b, str kernel) -> Tensor", gemm, _gemm_fake, _DifferentiableGemm)


def gemm_fp8(a, b, scale_a, scale_b, kernel, out_dtype):
    """scale_a * scale_b * (a @ b) on e4m3 a, b with rung `kernel`: a new (M, N) tensor in
    out_dtype. No autograd: the FP8 GEMM is forward-only."""
    spec, scales, out_dtype = matmul.check_gemm_fp8(a, b, scale_a, scale_b, None, out_dtype, kernel)
    return matmul.launch_gemm(spec, a, b, None, scales, out_dtype)


def _gemm_fp8_fake(a, b, scale_a, scale_b, kernel, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_define("gemm_fp8", "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, str kernel, ScalarType out_dtype) "
        "-> Tensor", gemm_fp8, _gemm_fp8_fake)


_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, "
                  "float softmax_scale, int window_left, int window_right, float softcap, str kernel, "
                  "bool deterministic=False, str? backward_kernel=None, Tensor? sinks=None, "
                  "int max_seqlen_q=0) -> (Tensor, Tensor)")
_VARLEN_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                           "Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, float softmax_scale, "
                           "str kernel, bool deterministic, int window_left, int window_right, "
                           "float softcap, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)")


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


def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window_left,
                           window_right, softcap, kernel, deterministic=False, backward_kernel=None,
                           sinks=None, max_seqlen_q=0):
    total_q, heads_q, _ = q.shape
    return _launch.empty_output(q, v), q.new_empty((heads_q, total_q), dtype=torch.float32)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                              kernel, deterministic, window_left, window_right, softcap, sinks=None):
    """(dq, dk, dv, dsinks) of a packed batch, each contiguous and shaped like its input."""
    spec = backward.check_backward(dout, q, k, v, out, lse, kernel, (cu_seqlens_q, cu_seqlens_k), sinks,
                                   deterministic)
    window = (window_left, window_right)
    _dispatch.check_variants(spec, masking.masking(causal, window, softcap, softmax_scale), "backward_kernel")
    return backward.launch_varlen_backward(spec, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                           causal, softmax_scale, deterministic, window, softcap, sinks)


def _attention_varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal,
                                    softmax_scale, kernel, deterministic, window_left, window_right,
                                    softcap, sinks=None):
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            _sinks_grad_like(sinks, q))


class _DifferentiableVarlen(torch.autograd.Function):
    """fa3::attention_varlen's autograd: the backward through torch.ops.fa3.attention_varlen_backward.
    Differentiable in q, k, v, sinks."""

    @staticmethod
    def forward(ctx, op, body, keyset, q, k, v, cu_q, cu_k, causal, softmax_scale, left, right, softcap, kernel,
                deterministic, backward_kernel, sinks, max_seqlen_q):
        out, lse = _below_autograd(op, body, keyset, (q, k, v, cu_q, cu_k, causal, softmax_scale, left, right,
                                                      softcap, kernel, deterministic, backward_kernel, sinks,
                                                      max_seqlen_q))
        _keep_for_backward(ctx, (q, k, v, out, lse, cu_q, cu_k, sinks), lse, causal, softmax_scale, left, right,
                           softcap, deterministic, backward_kernel)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        kernel = ctx.backward_kernel or _dispatch.backward_rung(None, q.shape[2], ctx.deterministic, v.shape[2],
                                                                masking.masked(ctx.causal, ctx.window)).name
        dq, dk, dv, dsinks = torch.ops.fa3.attention_varlen_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, ctx.causal, ctx.softmax_scale, kernel, ctx.deterministic,
            ctx.window[0], ctx.window[1], ctx.softcap, sinks)
        return (None, None, None, dq, dk, dv) + (None,) * 10 + (dsinks if sinks is not None else None, None)


_define("attention_varlen", _VARLEN_SCHEMA, attention_varlen, _attention_varlen_fake, _DifferentiableVarlen)
_define("attention_varlen_backward", _VARLEN_BACKWARD_SCHEMA, attention_varlen_backward,
        _attention_varlen_backward_fake)


_KVCACHE_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
                   "int appended, bool causal, float softmax_scale, int num_splits, str kernel, "
                   "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? cu_seqlens_q=None, "
                   "int max_seqlen_q=0, int max_seqlen_k=-1, Tensor? cache_leftpad=None, Tensor? sinks=None, "
                   "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
                   "ScalarType? out_dtype=None) -> (Tensor, Tensor)")


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


_define("attention_kvcache", _KVCACHE_SCHEMA, attention_kvcache, _attention_kvcache_fake)


_FP8_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor q_descale, Tensor k_descale, Tensor v_descale, "
               "bool causal, float softmax_scale, str kernel, int window_left, int window_right, "
               "float softcap, ScalarType out_dtype, Tensor? cu_seqlens_q=None, "
               "Tensor? cu_seqlens_k=None) -> (Tensor, Tensor)")


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


def _attention_fp8_fake(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, kernel,
                        window_left, window_right, softcap, out_dtype, cu_seqlens_q=None,
                        cu_seqlens_k=None):
    heads_q = q.shape[-2]
    return (q.new_empty(q.shape, dtype=out_dtype),
            q.new_empty((*q.shape[:-3], heads_q, q.shape[-3]), dtype=torch.float32))


_define("attention_fp8", _FP8_SCHEMA, attention_fp8, _attention_fp8_fake)
