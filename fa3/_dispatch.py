"""Which implementation serves a call: the rung, and whether the call may skip torch's dispatcher.

Rungs: `kernel=None` picks the fastest rung of a family for the head dim; a named rung is checked
against its family, the head dim and the variants the call needs (window, softcap), in messages
that name the argument. Eager calls remember what they resolved (memo_rung: one dict lookup).

Direct calls: a plain eager call runs an op's implementation itself (direct_call_ok), and an
eager call that needs gradients runs fa3's own autograd.Function (eager_autograd_ok); traced
calls, dispatch and function modes and functorch transforms go through torch.ops.fa3 (fa3.ops). Under torch.profiler a direct call runs inside a range named as its op (op_range), so
profiles name it as they would the op, without the dispatcher and without the op's copy into out=.
"""

from __future__ import annotations

import contextlib

import torch

from . import masking, registry

# True while torch.compile or torch.export traces the call: checks that need real data (pointers,
# the GPU) are left to the registered op (fa3.ops), which runs them on real tensors.
tracing = torch.compiler.is_compiling
# How many dispatch modes (FakeTensorMode, ...) are active: their tensors hold no values.
dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch_transforms = torch._C._are_functorch_transforms_active
profiling = torch._C._autograd._profiler_enabled  # torch.profiler is recording


def _intercepted() -> bool:
    """Whether torch would see the call: traced, under a dispatch or function mode, or inside a
    functorch transform (an op call then does more than its implementation)."""
    return tracing() or dispatch_modes() or _function_modes() or _functorch_transforms()


def direct_call_ok(*tensors) -> bool:
    """Whether calling an op's implementation directly does exactly what dispatching through
    torch.ops.fa3 would: not traced (torch.compile, torch.export), no dispatch or function modes
    (FakeTensorMode, FlopCounterMode, ...), no functorch transforms, and plain tensors that need no
    autograd. The dispatcher's round trip costs more than the implementation's own Python; the
    eager wrappers skip it when this holds (and name the call for a profiler with op_range)."""
    return not tracing() and untraced_call_ok(*tensors)


def untraced_call_ok(*tensors) -> bool:
    """direct_call_ok for a caller that has just asked tracing() itself."""
    if dispatch_modes() or _function_modes() or _functorch_transforms():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True


def eager_autograd_ok(*tensors) -> bool:
    """Whether a call that needs gradients may run through fa3's own torch.autograd.Function
    instead of the op's autograd registration (fa3.backward.DifferentiableAttention): eager, as
    direct_call_ok, but the tensors may require grad. The op's autograd registration costs its
    dispatch per call; compiled graphs and transforms still go through the op."""
    if _intercepted():
        return False
    return all(type(t) is torch.Tensor for t in tensors)


_NO_RANGE = contextlib.nullcontext()


def op_range(op: str):
    """The context a direct call runs in: under torch.profiler a range named `op` ("fa3::attention",
    ...), so profiles show the call by its op's name; otherwise nothing. (Dispatching to the op
    instead would cost the dispatcher, and a functional op's result must be copied into out=.)"""
    return torch.profiler.record_function(op) if profiling() else _NO_RANGE


# (resolver, arguments) -> rung, for arguments the resolver accepted: eager calls skip the registry
# scan. Traced calls (torch.compile) bypass it, so compiled graphs never guard on its contents.
_RUNGS: dict[tuple, registry.KernelSpec] = {}


def memo_rung(resolve, *args):
    """resolve(*args), remembered for eager calls (it raises for bad arguments: never stored)."""
    if tracing():
        return resolve(*args)
    spec = _RUNGS.get((resolve, *args))
    if spec is None:
        spec = _RUNGS[(resolve, *args)] = resolve(*args)
    return spec


def attention_rung(kernel, head_dim):
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
    return registry.get(fastest_rung(family, head_dim))


def cache_rung(kernel, head_dim, rows: int, paged: bool, fp8_cache: bool):
    """family_rung for a KV-cache call, where kernel=None picks by the call's shape: the warp-split
    rung (registry.WARP_SPLIT_RUNG) where a KV head's `rows` query rows fit its tile and the cache
    is paged and/or FP8, else the fastest."""
    spec = family_rung(registry.KVCACHE, kernel, head_dim, "q and the cache")
    if kernel is not None or not (paged or fp8_cache):
        return spec
    warp_split = registry.get(registry.WARP_SPLIT_RUNG)
    return warp_split if rows <= warp_split.config.base.tile_m and head_dim in warp_split.head_dims else spec


def backward_rung(kernel, head_dim, deterministic=False, head_dim_v=None, masked=False):
    """The backward rung `kernel` (None: the fastest for head_dim, and for deterministic calls
    when `deterministic`, with a causal mask or window when `masked`: masking.masked), checked to
    support head_dim (and v's head_dim_v where it differs)."""
    value_dim = None if head_dim_v in (None, head_dim) else head_dim_v
    if kernel is None:
        # (plain ints even where torch.compile made the head dims symbolic; the forward checked them)
        head_dim = next(d for d in registry.HEAD_DIMS if d == head_dim)
        if value_dim is not None:
            value_dim = next((dv for d, dv in registry.VALUE_HEAD_DIMS if (d, dv) == (head_dim, value_dim)), value_dim)
        spec = registry.get(fastest_rung(registry.BACKWARD, head_dim, bool(deterministic), value_dim,
                                         bool(masked)))
    else:
        spec = registry.get(kernel)
        if spec.family != registry.BACKWARD:
            raise ValueError(f"backward_kernel={kernel!r} is not a backward rung ({spec.family}); backward rungs "
                             f"are {registry.available_kernels(registry.BACKWARD)}")
        if head_dim not in spec.head_dims:
            raise ValueError(f"head_dim={head_dim} is not supported by {kernel}; it supports "
                             f"{spec.head_dims}")
    if value_dim is not None:
        check_value_head_dim(spec, head_dim, value_dim, "backward_kernel")
    return spec


@torch.compiler.assume_constant_result
def fastest_rung(family: str, head_dim: int | None = None, deterministic: bool = False,
                 head_dim_v: int | None = None, masked: bool = False) -> str:
    """registry.fastest's name; torch.compile takes it as a constant (it cannot trace max(key=))."""
    return registry.fastest(family, head_dim, deterministic, head_dim_v, masked).name


def check_variants(spec, mask: masking.Masking, argument: str) -> None:
    """A window or softcap needs a rung that compiles them (registry `variants`)."""
    if not mask.plain and not spec.variants:
        raise ValueError(f"{argument}={spec.name!r} supports neither window_size nor softcap; "
                         f"rungs that do: {[n for n in registry.available_kernels(spec.family) if registry.get(n).variants]}"
                         f" (or {argument}=None)")


def check_value_head_dim(spec, head_dim, head_dim_v, argument: str) -> None:
    """v's head dim may differ from q's and k's only in the pairs the rung lists (registry
    `value_head_dims`: forward and backward rungs alike)."""
    if head_dim_v == head_dim or (head_dim, head_dim_v) in spec.value_head_dims:
        return
    pairs = ", ".join(map(str, registry.VALUE_HEAD_DIMS))
    takers = [n for n in registry.available_kernels(spec.family)
              if (head_dim, head_dim_v) in registry.get(n).value_head_dims]
    raise ValueError(f"v has head_dim {head_dim_v} but q and k have {head_dim}, which {argument}={spec.name!r} "
                     f"does not take: v's head dim may differ only as (q/k, v) in {pairs} "
                     f"(fa3.attention and fa3.attention_varlen, forward and backward; rungs that take this "
                     f"pair: {takers or 'none'}, or {argument}=None); else pad v to {head_dim} and slice "
                     f"the output")


def check_sinks(spec, argument: str) -> None:
    """Attention sinks need a rung that compiles them (registry `variants`)."""
    if registry.SINKS not in spec.variants:
        raise ValueError(f"{argument}={spec.name!r} does not support sinks; rungs that do: "
                         f"{[n for n in registry.available_kernels(spec.family) if registry.SINKS in registry.get(n).variants]}"
                         f" (or {argument}=None)")
