"""The compile machinery every kernel family shares: the options, compiling against fake tensors
for torch's stream, and the two caches in front of the builders (an in-process dict by full key,
loaded from or saved to the disk cache, and the per-call fast lookup each family keys its own way).
compile/builders.py and compile/kvcache.py hold the families' keys, builders and getters.
"""

from __future__ import annotations

import threading

from . import disk_cache, dsl

LOCK = threading.Lock()
CACHE: dict[tuple, object] = {}
FAST: dict[tuple, object] = {}  # a family's short key (rung, dtype, head_dim, ...) -> compiled: the per-call lookup


def options(extra: str = "") -> str:
    return f"--enable-tvm-ffi --gpu-arch {dsl.TARGET_ARCH} {extra}".strip()


def compile_kernel(kernel, fake_args, extra_options):
    """Compile for torch's current stream (TVM-FFI: called with plain torch tensors)."""
    _, cute = dsl.import_cute()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fake_args, stream, options=options(extra_options))


def compiled(fast_key, key, build, *args):
    """A family's kernel through the per-call memo: FAST[fast_key] (one dict lookup on a hit); on a
    miss only, the full key `key(*args)` (configuration, arch, DSL version) and `cached` with
    `build(*args)` (key and build take the same arguments)."""
    fn = FAST.get(fast_key)
    if fn is None:
        fn = FAST[fast_key] = cached(key(*args), lambda: build(*args))
    return fn


def compiled_in_process(key, build):
    """A kernel that is never stored on disk (a flex mod's: its code may read globals no key can
    see), through the per-call memo by its full key `key`: built once in this process."""
    fn = FAST.get(key)
    if fn is None:
        fn = FAST[key] = cached(key, build, persist=False)
    return fn


def cached(key, build, persist: bool = True):
    """The kernel for `key` (a callable), loaded from the disk cache or built and stored there,
    once even across threads, on first use (persist=False: built, kept in this process only)."""
    fn = CACHE.get(key)
    if fn is None:
        with LOCK:
            fn = CACHE.get(key)
            if fn is None:
                fn = CACHE[key] = _load_or_build(key, build) if persist else \
                    disk_cache.fast_callable(build())
    return fn


def _load_or_build(key, build):
    fn = disk_cache.load(key)  # a hit does not import cutlass
    if fn is None:
        compiled = build()
        disk_cache.save(key, compiled)
        fn = disk_cache.fast_callable(compiled)
    return fn
