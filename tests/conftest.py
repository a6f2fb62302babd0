"""Shared test setup.

Without a GPU the DSL would compile for sm_100a: pin sm_90a *before* anything imports cutlass.
GPU tests carry the `gpu` marker and skip cleanly unless a Hopper GPU is present.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_HOPPER:
            item.add_marker(skip)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, computed in float64; NaN anywhere makes it NaN (and fails)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def raises_with(fn, exc, *words, **call):
    """fn(**call) raises `exc` whose message contains every word of `words`; returns the message."""
    with pytest.raises(exc) as info:
        fn(**call)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in the message: {msg}"
    return msg
