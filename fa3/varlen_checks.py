"""A packed batch's checks (fa3.attention_varlen's and its backward's): the offsets, the tensors'
layouts and a rung that compiles the varlen variant. Apart from varlen.py so that the backward,
which varlen's eager gradients call, checks packed batches without importing varlen."""

from __future__ import annotations

import torch

from . import _checks, _dispatch, index_checks, registry


def check_varlen_rung(spec, argument: str) -> None:
    """A packed batch needs a rung that compiles the varlen variant (registry `variants`)."""
    if "varlen" not in spec.variants:
        raise ValueError(f"{argument}={spec.name!r} cannot take packed batches; rungs that can: "
                         f"{_varlen_rungs(spec.family)} (or {argument}=None)")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel, check_values=True):
    """attention_varlen's arguments (the offsets' values too, where check_values and the call allow
    a host copy: fa3.index_checks); returns the rung's spec."""
    (total_q, _, head_dim), (total_k, _, _) = _checks.check_qkv(q, k, v, _checks.PACKED_KV_LAYOUT)
    index_checks.check_packed_offsets(cu_seqlens_q, cu_seqlens_k, q.device, total_q, total_k,
                                      max_seqlen_q, max_seqlen_k, check_values)
    spec = _dispatch.memo_rung(_varlen_rung, kernel, head_dim)
    if v.shape[2] != head_dim:
        _dispatch.check_value_head_dim(spec, head_dim, v.shape[2], "kernel")
    _checks.check_hopper(q.device, "q")
    return spec


def _varlen_rung(kernel, head_dim):
    """An attention rung that compiles the varlen variant (None: the fastest such rung)."""
    if kernel is not None:
        spec = _dispatch.family_rung(registry.ATTENTION, kernel, head_dim, "q, k and v")
        check_varlen_rung(spec, "kernel")
        return spec
    _dispatch.family_rung(registry.ATTENTION, None, head_dim, "q, k and v")  # head_dim's message
    return registry.get(_fastest_varlen_rung())


@torch.compiler.assume_constant_result
def _fastest_varlen_rung() -> str:
    """(torch.compile takes it as a constant: it cannot trace max(key=))"""
    return max((registry.get(n) for n in _varlen_rungs()), key=lambda s: s.speed_rank).name


def _varlen_rungs(family: str = registry.ATTENTION):
    """The rungs of `family` that compile the varlen variant."""
    return [n for n in registry.available_kernels(family) if "varlen" in registry.get(n).variants]
