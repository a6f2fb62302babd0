"""The CuTe DSL, imported on first use for the architecture fa3 compiles to.

The DSL reads CUTE_DSL_ARCH once, when `cutlass` is first imported, and on a machine without a GPU
it would pick sm_100a: so nothing in fa3 imports cutlass at module import time, and everything
that needs it (the compiler, fa3.compile.builders; the disk cache's fallback loader, fa3.compile.disk_cache)
goes through import_cute, which pins sm_90a first.
"""

from __future__ import annotations

import functools
import os

import torch

TARGET_ARCH = "sm_90a"


def pin_target_arch() -> None:
    """Compile for TARGET_ARCH where no GPU says otherwise (call before cutlass is imported)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)


def import_cute():
    """(cutlass, cutlass.cute), the target architecture pinned first."""
    pin_target_arch()
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


@functools.lru_cache(maxsize=None)
def version() -> str:
    """The DSL's version (part of every compile-cache key)."""
    try:
        from importlib.metadata import version as package_version

        return package_version("nvidia-cutlass-dsl")
    except Exception:  # source-tree DSL without metadata
        cutlass, _ = import_cute()

        return getattr(cutlass, "__version__", "unknown")
