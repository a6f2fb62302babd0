"""The public API: validate once, allocate outputs, pick a rung, launch.

Every check lives here (kernels never re-validate) and every message names the argument and the
fix. Batch, seqlens and heads are dynamic in the compiled kernels, so new shapes never recompile.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _compile, registry

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_LOG2E = math.log2(math.e)


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_hopper(device: torch.device, name: str) -> None:
    """`name` must live on an sm_90 GPU (H100/H200/H800): the kernels use Hopper-only instructions."""
    if device.type != "cuda":
        raise ValueError(f"{name} is on {device}; fa3 runs on a CUDA GPU: move it with {name}.cuda()")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _device_capability(index)
    if cap != (9, 0):
        raise RuntimeError(
            f"{name} is on {torch.cuda.get_device_name(index)} (sm_{cap[0]}{cap[1]}); fa3's kernels "
            "need a Hopper GPU (sm_90: H100, H200, H800). Use torch.nn.functional."
            "scaled_dot_product_attention on other GPUs.")


def check_tensor(t, name: str, ndim: int, dtype=None) -> None:
    """Type, rank, dtype and a unit-stride last dimension: what every kernel argument needs."""
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
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); "
                         f"pass {name}.contiguous()")


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Kernels assume 16-byte aligned base and strides (TMA's rule). Views that already satisfy it,
    such as q/k/v sliced from one packed qkv tensor, pass through without a copy; others are
    copied once into a fresh (aligned) contiguous tensor."""
    elems = 16 // t.element_size()
    if t.data_ptr() % 16 == 0 and all(s % elems == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_output(out, name: str, like: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        raise ValueError(f"{name} must be a tensor of shape {tuple(like.shape)}, dtype {like.dtype} "
                         f"on {like.device}; allocate it with torch.empty_like(...)")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned; allocate it with "
                         "torch.empty_like(..., memory_format=torch.contiguous_format)")


def _check_attention(q, k, v, kernel):
    check_tensor(q, "q", 4)
    check_tensor(k, "k", 4, q.dtype)
    check_tensor(v, "v", 4, q.dtype)
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         "(batch, seqlen_k, heads_kv, head_dim)")
    if k.shape[0] != batch:
        raise ValueError(f"q has batch {batch} but k and v have batch {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k and v have head_dim {k.shape[3]}; "
                         "fa3 needs the same head_dim for q, k and v")
    heads_kv = k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv} "
                         "(GQA/MQA share each k/v head among heads_q // heads_kv query heads)")
    spec = registry.get(kernel) if kernel is not None else None
    if spec is not None and spec.family != registry.ATTENTION:
        raise ValueError(f"kernel={kernel!r} is a GEMM rung; attention rungs are "
                         f"{registry.available_kernels(registry.ATTENTION)}")
    supported = spec.head_dims if spec is not None else sorted(
        {d for n in registry.available_kernels(registry.ATTENTION) for d in registry.get(n).head_dims})
    if head_dim not in supported:
        raise ValueError(f"head_dim={head_dim} is not supported{' by ' + kernel if kernel else ''}; "
                         f"supported head dims are {tuple(supported)}: pad q, k and v to the next one")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; put them on one GPU")
    check_hopper(q.device, "q")
    return spec or registry.fastest(registry.ATTENTION, head_dim)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, kernel: str | None = None, out=None):
    """Exact softmax attention, softmax(q k^T * softmax_scale) v, as flash-attn computes it.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); bf16 or
    fp16 on a Hopper GPU; heads_q a multiple of heads_kv (GQA/MQA). head_dim 64, 128 or 256.
    causal: mask aligned to the bottom right when seqlen_q != seqlen_k (query i sees keys
    j <= i + seqlen_k - seqlen_q), as in flash-attn >= 2.1; rows that see no key give 0.
    softmax_scale: defaults to 1/sqrt(head_dim).
    return_lse: also return the fp32 log-sum-exp of each row, (batch, heads_q, seqlen_q).
    kernel: a rung of fa3.available_kernels("attention"); None picks the fastest.
    out: optional preallocated output, shaped like q, same dtype and device, contiguous.
    Returns out shaped like q (and lse).
    """
    spec = _check_attention(q, k, v, kernel)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        check_output(out, "out", q)
    lse = torch.empty(batch, heads_q, seqlen_q, device=q.device, dtype=torch.float32)
    if out.numel() == 0 or seqlen_k == 0:  # nothing to compute, or no keys: O = 0, LSE = -inf
        out.zero_()
        lse.fill_(float("-inf"))
    else:
        fn = _compile.get_attention(spec, q.dtype, head_dim, causal)
        args = [tma_ready(q), tma_ready(k), tma_ready(v), out, lse]
        if spec.needs_scores_workspace:
            args.append(torch.empty(batch, heads_q, seqlen_q, seqlen_k, device=q.device,
                                    dtype=torch.float32))
        fn(*args, scale * _LOG2E)
    return (out, lse) if return_lse else out
