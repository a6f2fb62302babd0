"""The public API: validate once, allocate outputs, pick a rung, launch.

The argument checks every entry point shares and fa3.attention live here; fa3.gemm in fa3.matmul,
the backward's body in fa3.backward. Kernels never re-validate; every message names the argument
and the fix. Batch, seqlens and heads are dynamic in the compiled kernels, so new shapes never
recompile.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _compile, masking, registry

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# True while torch.compile or torch.export traces the call: checks that need real data (pointers,
# the GPU) are left to the registered op (fa3.ops), which runs them on real tensors.
_tracing = torch.compiler.is_compiling


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# Devices that passed check_hopper -> their SM count (what persistent kernels take): one dict
# lookup per call answers both questions.
_HOPPER_SMS: dict[torch.device, int] = {}


def check_hopper(device: torch.device, name: str) -> None:
    """`name` must live on an sm_90 GPU (H100/H200/H800): the kernels use Hopper-only instructions.

    While torch.compile or torch.export traces a call only the device type is checked: the
    registered op checks the GPU itself when it runs."""
    if device.type != "cuda":
        raise ValueError(f"{name} is on {device}; fa3 runs on a CUDA GPU: move it with {name}.cuda()")
    # _tracing() first: traced code must not read (and so guard on) the memo
    if _tracing() or device in _HOPPER_SMS:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _device_capability(index)
    if cap != (9, 0):
        raise RuntimeError(
            f"{name} is on {torch.cuda.get_device_name(index)} (sm_{cap[0]}{cap[1]}); fa3's kernels "
            "need a Hopper GPU (sm_90: H100, H200, H800). Use torch.nn.functional."
            "scaled_dot_product_attention on other GPUs.")
    if device.index is not None:  # tensors' devices always carry an index
        _HOPPER_SMS[device] = _sm_count(index)


def check_tensor(t, name: str, ndim: int, dtype=None, unit_stride_last: bool = True) -> None:
    """Type, rank, dtype and (unless `unit_stride_last` is False: GEMM operands may be
    transposed views) a unit-stride last dimension: what every kernel argument needs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; fa3 supports torch.bfloat16 and torch.float16: "
                        f"convert with {name}.to(torch.bfloat16)")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the first argument is {dtype}; "
                        "all inputs must share one dtype")
    if unit_stride_last and t.stride(-1) != 1 and t.numel():
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); "
                         f"pass {name}.contiguous()")


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Kernels assume 16-byte aligned base and strides (TMA's rule). Views that already satisfy it,
    such as q/k/v sliced from one packed qkv tensor, pass through without a copy; others are
    copied once into a fresh (aligned) contiguous tensor."""
    s0, s1, s2, s3 = t.stride()  # (batch, seqlen, heads, head_dim); 16 bytes = 8 bf16/fp16 elements
    # (stride 0: an expanded tensor, such as the gradient of a .sum(), is copied too)
    if t.data_ptr() % 16 == 0 and s0 % 8 == 0 and s1 % 8 == 0 and s2 % 8 == 0 and s3 == 1 \
            and s0 and s1 and s2:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_output(out, name: str, like: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        raise ValueError(f"{name} must be a tensor of shape {tuple(like.shape)}, dtype {like.dtype} "
                         f"on {like.device}; allocate it with torch.empty_like(...)")
    # traced calls (torch.compile) copy the op's result into `out`: its address does not matter
    if not out.is_contiguous() or (not _tracing() and out.data_ptr() % 16):
        raise ValueError(f"{name} must be contiguous and 16-byte aligned; allocate it with "
                         "torch.empty_like(..., memory_format=torch.contiguous_format)")


def check_qkv(q, k, v, kv_layout: str):
    """What every q, k, v entry point needs, for any leading dimensions: types, ranks, dtypes,
    k and v alike (`kv_layout` names their dimensions), one head_dim, heads_q a multiple of
    heads_kv, one device. Returns (q.shape, k.shape)."""
    ndim = kv_layout.count(",") + 1
    check_tensor(q, "q", ndim)
    check_tensor(k, "k", ndim, q.dtype)
    check_tensor(v, "v", ndim, q.dtype)
    q_shape, k_shape = q.shape, k.shape  # (each .shape builds a new torch.Size: read it once)
    if k_shape != v.shape:
        raise ValueError(f"k {tuple(k_shape)} and v {tuple(v.shape)} must have the same shape {kv_layout}")
    head_dim, heads_q, heads_kv = q_shape[-1], q_shape[-2], k_shape[-2]
    if k_shape[-1] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k and v have head_dim {k_shape[-1]}; "
                         "fa3 needs the same head_dim for q, k and v")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv} "
                         "(GQA/MQA share each k/v head among heads_q // heads_kv query heads)")
    device = q.device
    if k.device != device or v.device != device:
        name, t = ("k", k) if k.device != device else ("v", v)
        raise ValueError(f"{name} is on {t.device} but q is on {device}; put them on one GPU")
    return q_shape, k_shape


def _check_attention(q, k, v, kernel):
    q_shape, k_shape = check_qkv(q, k, v, "(batch, seqlen_k, heads_kv, head_dim)")
    if k_shape[0] != q_shape[0]:
        raise ValueError(f"q has batch {q_shape[0]} but k and v have batch {k_shape[0]}")
    spec = _memo_rung(_attention_rung, kernel, q_shape[3])
    check_hopper(q.device, "q")
    return spec


# (resolver, arguments) -> rung, for arguments the resolver accepted: eager calls skip the registry
# scan. Traced calls (torch.compile) bypass it, so compiled graphs never guard on its contents.
_RUNGS: dict[tuple, registry.KernelSpec] = {}


def _memo_rung(resolve, *args):
    """resolve(*args), remembered for eager calls (it raises for bad arguments: never stored)."""
    if _tracing():
        return resolve(*args)
    spec = _RUNGS.get((resolve, *args))
    if spec is None:
        spec = _RUNGS[(resolve, *args)] = resolve(*args)
    return spec


def _attention_rung(kernel, head_dim):
    """The attention rung `kernel` (None: the fastest for head_dim), checked to support head_dim."""
    return family_rung(registry.ATTENTION, kernel, head_dim, "q, k and v")


def family_rung(family, kernel, head_dim, operands):
    """The `family` rung `kernel` (None: the fastest for head_dim), checked to support head_dim;
    `operands` names what to pad in the message for an unsupported head_dim."""
    spec = registry.get(kernel) if kernel is not None else None
    if spec is not None and spec.family != family:
        raise ValueError(f"kernel={kernel!r} is a {spec.family} rung; {family} rungs are "
                         f"{registry.available_kernels(family)}")
    supported = spec.head_dims if spec is not None else sorted(
        {d for n in registry.available_kernels(family) for d in registry.get(n).head_dims})
    if head_dim not in supported:
        raise ValueError(f"head_dim={head_dim} is not supported{' by ' + kernel if kernel else ''}; "
                         f"supported head dims are {tuple(supported)}: pad {operands} to the next one")
    if spec is not None:
        return spec
    # the supported value equal to head_dim: a plain int even where torch.compile made it symbolic
    head_dim = next(d for d in supported if d == head_dim)
    return registry.get(_fastest_rung(family, head_dim))


def _backward_rung(kernel, head_dim):
    """The backward rung `kernel` (None: the fastest for head_dim), checked to support head_dim."""
    if kernel is None:
        # (a plain int even where torch.compile made head_dim symbolic; the forward checked it)
        head_dim = next(d for d in (64, 128, 256) if d == head_dim)
        return registry.get(_fastest_rung(registry.BACKWARD, head_dim))
    spec = registry.get(kernel)
    if spec.family != registry.BACKWARD:
        raise ValueError(f"backward_kernel={kernel!r} is not a backward rung ({spec.family}); backward rungs are "
                         f"{registry.available_kernels(registry.BACKWARD)}")
    if head_dim not in spec.head_dims:
        raise ValueError(f"head_dim={head_dim} is not supported by {kernel}; it supports "
                         f"{spec.head_dims}")
    return spec


@torch.compiler.assume_constant_result
def _fastest_rung(family: str, head_dim: int | None = None) -> str:
    """registry.fastest's name; torch.compile takes it as a constant (it cannot trace max(key=))."""
    return registry.fastest(family, head_dim).name


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              window_size=(-1, -1), softcap: float = 0.0,
              return_lse: bool = False, kernel: str | None = None, out=None,
              deterministic: bool = False, backward_kernel: str | None = None):
    """Exact softmax attention, softmax(q k^T * softmax_scale) v, as flash-attn computes it.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); bf16 or
    fp16 on a Hopper GPU; heads_q a multiple of heads_kv (GQA/MQA). head_dim 64, 128 or 256.
    causal: mask aligned to the bottom right when seqlen_q != seqlen_k (query i sees keys
    j <= i + seqlen_k - seqlen_q), as in flash-attn >= 2.1; rows that see no key give 0.
    softmax_scale: defaults to 1/sqrt(head_dim).
    window_size: (left, right) sliding-window (local) attention as flash-attn: query i sees keys
        j in [i + shift - left, i + shift + right], shift = seqlen_k - seqlen_q; -1 = unbounded.
    softcap: > 0 caps the scores as Gemma 2: s -> softcap * tanh(s / softcap) (s scaled first).
        Both are differentiable (the backward rungs compile them as the forward does).
    return_lse: also return the fp32 log-sum-exp of each row, (batch, heads_q, seqlen_q).
    kernel: a rung of fa3.available_kernels("attention"); None picks the fastest.
    out: optional preallocated output, shaped like q, same dtype and device, contiguous.
    deterministic: make the backward bitwise reproducible (dQ's FP32 partial sums are added in a
        fixed order; measured cost in worklog/backward.md). The forward is deterministic anyway.
    backward_kernel: a rung of fa3.available_kernels("backward"); None picks the fastest.
    Returns out shaped like q (and lse).

    Differentiable in q, k and v (whichever require grad), through torch.autograd, torch.compile
    and torch.utils.checkpoint; lse is returned as a non-differentiable output. GQA gradients of k
    and v are summed over the query heads that share them.

    This is the torch custom op `torch.ops.fa3.attention` (fa3.ops) behind a validating wrapper:
    torch.compile(fullgraph=True) and torch.export trace it without graph breaks, and new batch
    sizes or seqlens do not recompile. Kernels launch on torch's current CUDA stream without
    synchronizing the host, so calls can be captured in CUDA graphs (after a first eager call).
    """
    spec = _check_attention(q, k, v, kernel)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    causal = bool(causal)
    if out is not None:
        check_output(out, "out", q)
    window = tuple(window_size)
    if window != (-1, -1) or softcap:
        mask = masking.masking(causal, window, softcap, scale)
        check_variants(spec, mask, "kernel")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            check_variants(_memo_rung(_backward_rung, backward_kernel, q.shape[3]), mask, "backward_kernel")
    if direct_call_ok(q, k, v):
        out, lse = launch_attention(spec, q, k, v, causal, scale, out, window, softcap)
    else:
        bwd = _memo_rung(_backward_rung, backward_kernel, q.shape[3]).name
        result, lse = torch.ops.fa3.attention(q, k, v, causal, scale, spec.name, bool(deterministic), bwd,
                                              window[0], window[1], float(softcap))
        out = result if out is None else out.copy_(result)  # the op is functional
    return (out, lse) if return_lse else out


_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch_transforms = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled


def direct_call_ok(*tensors) -> bool:
    """Whether calling an op's implementation directly does exactly what dispatching through
    torch.ops.fa3 would: not traced (torch.compile, torch.export), no dispatch or function modes
    (FakeTensorMode, FlopCounterMode, ...), no functorch transforms, plain tensors that need no
    autograd, and no profiler (which should see the op by name). The dispatcher costs ~10 us a
    call; the eager wrappers skip it when this holds."""
    if _tracing() or _dispatch_modes() or _function_modes() \
            or _functorch_transforms() or _profiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True


def _detached(*tensors):
    """Views that do not require grad (same memory): kernels take tensors through DLPack, which
    refuses tensors that require grad (they reach a kernel under no_grad, or through the op)."""
    return tuple(t.detach() if t.requires_grad else t for t in tensors)


def check_variants(spec, mask: masking.Masking, argument: str) -> None:
    """A window or softcap needs a rung that compiles them (registry `variants`)."""
    if not mask.plain and not spec.variants:
        raise ValueError(f"{argument}={spec.name!r} supports neither window_size nor softcap; "
                         f"rungs that do: {[n for n in registry.available_kernels(spec.family) if registry.get(n).variants]}"
                         f" (or {argument}=None)")


def launch_attention(spec, q, k, v, causal: bool, scale: float, out=None, window=(-1, -1),
                     softcap: float = 0.0):
    """Allocate the outputs (`out` unless given) and launch rung `spec` on torch's current stream;
    returns (out, lse). The body of the fa3::attention op: arguments are validated already."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    device = q.device
    if out is None:  # (torch.empty parses a shape tuple ~1.5 us slower than this or separate ints)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=device)
    seqlen_k = k.shape[1]
    if out.numel() == 0 or seqlen_k == 0:  # nothing to compute, or no keys: O = 0, LSE = -inf
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = _detached(q, k, v)
    mask = masking.masking(causal, window, softcap, scale)
    args = [tma_ready(q), tma_ready(k), tma_ready(v), out, lse]
    if spec.needs_scores_workspace:
        args.append(torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.float32, device=device))
    run_attention(spec, q.dtype, head_dim, mask, args, device)
    return out, lse


def run_attention(spec, dtype, head_dim: int, mask: masking.Masking, args: list, device,
                  cu_seqlens=None):
    """Append the runtime arguments after (q, k, v, o, lse[, scores]) and launch: the scale, the
    persistent ones, and the variants' (cu_seqlens_q/k when varlen, window edges, softcap scale)."""
    fn = _compile.get_attention(spec, dtype, head_dim, mask.causal, cu_seqlens is not None,
                                mask.local, mask.softcap)
    args.append(mask.scale_log2)
    if spec.persistent:
        args.append(_HOPPER_SMS[device])
        args.append(_tile_counter(spec, mask.causal, device))
    if spec.variants:
        cu_q, cu_k = cu_seqlens if cu_seqlens is not None else (_stand_in(device),) * 2
        args += [cu_q, cu_k, mask.left, mask.right, mask.softcap_scale]
    fn(*args)


def _tile_counter(spec, causal: bool, device) -> torch.Tensor:
    """The GMEM counter a dynamically scheduled rung hands tiles out from: zeroed per call (on the
    call's stream, so graphs capture it). Static schedules never touch it: one shared stand-in."""
    if causal and spec.config.get("dynamic_schedule"):
        return torch.zeros(1, dtype=torch.int32, device=device)
    return _stand_in(device)


def _stand_in(device) -> torch.Tensor:
    """One int32 zero per device: what a kernel gets for a tensor argument it does not read."""
    t = _STAND_IN.get(device)
    if t is None:
        t = _STAND_IN[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


_STAND_IN: dict = {}


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
