"""The argument checks the entry points share, with their messages: tensors (type, rank, dtype,
unit-stride last dimension), q/k/v alike, preallocated outputs, and the Hopper GPU (whose SM count
the persistent kernels take). Every message names the argument and the fix; kernels never
re-validate.
"""

from __future__ import annotations

import functools

from types import SimpleNamespace
from typing import NamedTuple

import torch

from . import _dispatch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn,)  # what the FP8 forward takes
# any FP8 input routes a call to the FP8 forward, whose checks name what it does not take
FP8_LIKE = FP8_DTYPES + (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SM count of CUDA device `index`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# Devices that passed check_hopper -> their SM count (what persistent kernels take): one dict
# lookup per call answers both questions.
HOPPER_SMS: dict[torch.device, int] = {}


def check_hopper(device: torch.device, name: str) -> None:
    """`name` must live on an sm_90 GPU (H100/H200/H800): the kernels use Hopper-only instructions.

    While torch.compile or torch.export traces a call only the device type is checked: the
    registered op checks the GPU itself when it runs."""
    if device.type != "cuda":
        raise ValueError(f"{name} is on {device}; fa3 runs on a CUDA GPU: move it with {name}.cuda()")
    # tracing() first: traced code must not read (and so guard on) the memo
    if _dispatch.tracing() or device in HOPPER_SMS:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _device_capability(index)
    if cap != (9, 0):
        raise RuntimeError(
            f"{name} is on {torch.cuda.get_device_name(index)} (sm_{cap[0]}{cap[1]}); fa3's kernels "
            "need a Hopper GPU (sm_90: H100, H200, H800). Use torch.nn.functional."
            "scaled_dot_product_attention on other GPUs.")
    if device.index is not None:  # tensors' devices always carry an index
        HOPPER_SMS[device] = sm_count(index)


def check_tensor(t, name: str, ndim: int, dtype=None, unit_stride_last: bool = True,
                 dtypes=SUPPORTED_DTYPES) -> None:
    """Type, rank, dtype (one of `dtypes`: 16-bit, or FP8_DTYPES for the FP8 forward) and (unless
    `unit_stride_last` is False: GEMM operands may be transposed views) a unit-stride last
    dimension: what every kernel argument needs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        if dtypes is FP8_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; fa3's FP8 kernels take torch.float8_e4m3fn "
                            f"inputs (e5m2 is not supported): quantize with fa3.quantize_fp8({name})")
        raise TypeError(f"{name} has dtype {t.dtype}; fa3 supports torch.bfloat16 and torch.float16: "
                        f"convert with {name}.to(torch.bfloat16)")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the first argument is {dtype}; "
                        "all inputs must share one dtype")
    if unit_stride_last and t.stride(-1) != 1 and t.numel():
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); "
                         f"pass {name}.contiguous()")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes a strided tensor can touch."""
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def check_no_overlap(out, name: str, inputs,
                     why: str = "the output is written while {input} is still read") -> None:
    """`out` must not share memory with any of `inputs` ((name, tensor or None) pairs): the
    kernels read every K/V row from many CTAs while others write the output (and a backward reads
    q, k and v again), so an aliased output is silently wrong. `why`: the message's reason."""
    if _dispatch.tracing() or out.device.type == "meta" or not out.numel():
        return  # fake tensors have no addresses; meta ones all start at 0
    storage = out.untyped_storage().data_ptr()
    first = last = None
    for input_name, t in inputs:
        # tensors of different allocations never overlap: the common case costs one comparison
        if t is None or t.untyped_storage().data_ptr() != storage or not t.numel():
            continue
        if first is None:
            first, last = _byte_range(out)
        lo, hi = _byte_range(t)
        if lo < last and first < hi:
            raise ValueError(f"{name} shares memory with {input_name}: {why.format(input=input_name)}; "
                             f"pass a separate tensor (torch.empty_like)")


def check_output(out, name: str, like, inputs=()) -> None:
    """`out` must match `like`'s shape, dtype and device (a tensor, or anything with those three
    fields), contiguous and 16-byte aligned, and share no memory with `inputs` ((name, tensor)
    pairs)."""
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        raise ValueError(f"{name} must be a tensor of shape {tuple(like.shape)}, dtype {like.dtype} "
                         f"on {like.device}; allocate it with torch.empty_like(...)")
    # traced calls (torch.compile) copy the op's result into `out`: its address does not matter
    if not out.is_contiguous() or (not _dispatch.tracing() and out.data_ptr() % 16):
        raise ValueError(f"{name} must be contiguous and 16-byte aligned; allocate it with "
                         "torch.empty_like(..., memory_format=torch.contiguous_format)")
    check_no_overlap(out, name, inputs)


def prepared_output_ok(out, inputs) -> bool:
    """What a prepared launch (whose key holds out's shape, dtype and device) checks of out= per
    call: contiguous and 16-byte aligned (False: the full path takes the call, and check_output
    names what is wrong), sharing no memory with `inputs` ((name, tensor) pairs; raises as
    check_output does)."""
    if not out.is_contiguous() or out.data_ptr() % 16:
        return False
    check_no_overlap(out, "out", inputs)
    return True


class OutputSpec(NamedTuple):
    """What check_output compares `out` with, where no tensor of the output's kind exists."""
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def check_fp8_output(out, q, inputs=()) -> None:
    """A preallocated output of an FP8 call: shaped like q on its device, in bf16 or fp16 (the
    output's type)."""
    if not isinstance(out, torch.Tensor) or out.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out must be a torch.bfloat16 or torch.float16 tensor for FP8 inputs (the "
                        f"output's type), got {getattr(out, 'dtype', type(out).__name__)}")
    check_output(out, "out", OutputSpec(q.shape, out.dtype, q.device), inputs)


def output_like(q, v):
    """What an output must look like: q's shape with v's head dim (its last dimension), q's dtype
    and device (for check_output)."""
    if v.shape[-1] == q.shape[-1]:
        return q
    return SimpleNamespace(shape=torch.Size((*q.shape[:-1], v.shape[-1])), dtype=q.dtype, device=q.device)


# k and v's dimensions, as messages name them: a fixed-shape batch, a packed (varlen) one
KV_LAYOUT = "(batch, seqlen_k, heads_kv, head_dim)"
PACKED_KV_LAYOUT = "(total_k, heads_kv, head_dim)"


def check_qkv(q, k, v, kv_layout: str, dtypes=SUPPORTED_DTYPES):
    """What every q, k, v entry point needs, for any leading dimensions: types, ranks, dtypes (of
    `dtypes`), k and v alike but for v's head_dim (`kv_layout` names their dimensions), q's
    head_dim = k's, heads_q a multiple of heads_kv, one device. Returns (q.shape, k.shape); whether
    v's head_dim may differ is the rung's to say (fa3._dispatch.check_value_head_dim)."""
    ndim = kv_layout.count(",") + 1
    check_tensor(q, "q", ndim, dtypes=dtypes)
    check_tensor(k, "k", ndim, q.dtype, dtypes=dtypes)
    check_tensor(v, "v", ndim, q.dtype, dtypes=dtypes)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape  # (each .shape builds a new torch.Size)
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(f"k {tuple(k_shape)} and v {tuple(v_shape)} must have the same shape {kv_layout} "
                         "(v's head_dim aside)")
    head_dim, heads_q, heads_kv = q_shape[-1], q_shape[-2], k_shape[-2]
    if k_shape[-1] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k has head_dim {k_shape[-1]}; "
                         "fa3 needs the same head_dim for q and k")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv} "
                         "(GQA/MQA share each k/v head among heads_q // heads_kv query heads)")
    device = q.device
    if k.device != device or v.device != device:
        name, t = ("k", k) if k.device != device else ("v", v)
        raise ValueError(f"{name} is on {t.device} but q is on {device}; put them on one GPU")
    return q_shape, k_shape


def check_sinks(sinks, heads_q: int, device) -> None:
    """Attention sinks: one float32 logit per query head, (heads_q,), on the inputs' device."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (heads_q={heads_q},), got "
                        f"{type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks has dtype {sinks.dtype}; it must be torch.float32 (one logit per query "
                        "head): pass sinks.float()")
    if sinks.shape != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q={heads_q},), one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}; move it with "
                         "sinks.to(q.device)")


def check_rung_sinks(spec, sinks, heads_q: int, device) -> None:
    """A forward call's sinks (None: nothing to check): check_sinks, and a rung (`kernel`) that
    compiles them."""
    if sinks is not None:
        check_sinks(sinks, heads_q, device)
        _dispatch.check_sinks(spec, "kernel")


def check_scale_tensor(t, name: str, forms: str, device, owner: str) -> None:
    """An FP8 scale or descale argument given (not None): a float32 tensor on `owner`'s `device`;
    `forms` names the shapes it may take, for the message."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (float32, {forms}) or None, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}; scales and descales are torch.float32: {name}.float()")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {owner} is on {device}; put it on {owner}'s device")


_UNIT_DESCALES: dict = {}  # device -> a float32 1 (1, 1)


def unit_descale(device) -> torch.Tensor:
    """A float32 1 of shape (1, 1) on `device`: the descale of None, and the kernels' descale stand-in
    (kept per device; one made while a graph is captured holds its 1 only in replays, so it is not kept)."""
    t = _UNIT_DESCALES.get(device)
    if t is None:
        t = torch.ones(1, 1, dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT_DESCALES[device] = t
    return t


def check_descale(t, name: str, batch: int, heads_kv: int, device) -> torch.Tensor:
    """An FP8 descale as the kernels take it: a float32 (batch, heads_kv) view on `device`, of any
    strides (no copy): from None (1), a 0-d or one-element tensor (broadcast), or a (batch,
    heads_kv) tensor (flash-attn's FA3 interface)."""
    if t is None:
        return unit_descale(device).expand(batch, heads_kv)
    check_scale_tensor(t, name, f"shape (batch, heads_kv) = ({batch}, {heads_kv}), or one element",
                       device, "q")
    if t.numel() == 1 and t.dim() <= 2:
        return t.reshape(1, 1).expand(batch, heads_kv)
    if tuple(t.shape) != (batch, heads_kv):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch, heads_kv) = "
                         f"({batch}, {heads_kv}), or hold one element (per tensor)")
    return t


def check_offsets(cu, name: str, device, batch=None, batch_source: str = "cu_seqlens_q") -> None:
    """cu_seqlens-style offsets: a contiguous 1-D int32 tensor of batch + 1 entries on `device`
    (`batch_source`: where the batch was read; their values: fa3.index_checks)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                         f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}: "
                         "use .to(torch.int32)")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; move it with .to(q.device)")
    if cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        raise ValueError(f"{name} has {cu.shape[0]} entries; it needs batch + 1"
                         f"{f' = {batch + 1} ({batch_source} has batch {batch})' if batch is not None else ''}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous: pass {name}.contiguous()")


def check_attention(q, k, v, kernel):
    """fa3.attention's q, k, v (batch, seqlen, heads, head_dim) and rung; returns the rung's spec
    (the forward's check, and the backward's of the same tensors)."""
    q_shape, k_shape = check_qkv(q, k, v, KV_LAYOUT)
    if k_shape[0] != q_shape[0]:
        raise ValueError(f"q has batch {q_shape[0]} but k and v have batch {k_shape[0]}")
    spec = _dispatch.memo_rung(_dispatch.attention_rung, kernel, q_shape[3])
    head_dim_v = v.shape[3]
    if head_dim_v != q_shape[3]:
        _dispatch.check_value_head_dim(spec, q_shape[3], head_dim_v, "kernel")
    check_hopper(q.device, "q")
    return spec
