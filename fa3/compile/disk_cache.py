"""The on-disk compile cache: a new process loads in milliseconds what took seconds to compile.

Where: FA3_CACHE_DIR, else $XDG_CACHE_HOME/fa3, else ~/.cache/fa3. FA3_DISK_CACHE=0 turns it off.

What: one file per compiled kernel, named by the SHA-256 of its key. The key is everything compiled
in (the in-memory key of fa3.compile.builders: rung, dtype, head_dim or layouts, causal, tile config,
target arch, DSL version) plus what the stored object depends on: fa3's version and kernel
sources, the DSL runtime build, the TVM-FFI version and the host CPU's instruction-set level (the
DSL compiles host code for the CPU it runs on). The file holds a header (format, SHA-256 of the
payload, the key) and the payload: the object file that the DSL's `export_to_c` writes for a
TVM-FFI function.

Loading: where a C compiler is found (to link, once), the object is linked into a shared library
beside the entry (`<entry>-<payload hash>.so`) and loaded with TVM-FFI next to the DSL's runtime
library: a hit then never imports cutlass, which costs from half a second to seconds. Otherwise
`cute.runtime.load_module` links the object in memory (importing cutlass).

Safety: entries are written to a temporary file in the same folder and moved into place with
os.replace, so readers see a whole entry or none, and two processes filling the same entry at once
both succeed. An entry that does not match its header (truncated, corrupt, another key) or does not
load is logged, compiled afresh and overwritten. Failing to write only logs: the cache is an
optimisation, never a reason for a call to fail.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import dsl

log = logging.getLogger("fa3")

FORMAT = b"fa3-kernel-cache 1"
SUFFIX = ".fa3k"
RUNTIME_LIBRARY = "libcute_dsl_runtime.so"


def directory() -> Path | None:
    """The cache folder (not created here), or None when FA3_DISK_CACHE=0."""
    if os.environ.get("FA3_DISK_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if os.environ.get("FA3_CACHE_DIR"):
        return Path(os.environ["FA3_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fa3"


def digest(key: tuple) -> str:
    """Hex SHA-256 of the key's repr: keys hold only str, int, bool and tuples, whose repr is stable."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


class Store:
    """Entries of bytes under a folder, one file per key; see the module docstring."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: tuple) -> Path:
        return self.root / (digest(key) + SUFFIX)

    def read(self, key: tuple) -> bytes | None:
        """The payload stored for `key`; None if there is none or it is damaged (logged)."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("fa3: cannot read cache entry %s (%s); compiling instead", path, exc)
            return None
        parts = blob.split(b"\n", 3)
        if len(parts) == 4 and parts[0] == FORMAT and parts[2] == repr(key).encode():
            payload = parts[3]
            if hashlib.sha256(payload).hexdigest().encode() == parts[1]:
                return payload
        log.warning("fa3: cache entry %s is damaged; compiling again and replacing it", path)
        return None

    def write(self, key: tuple, payload: bytes) -> Path | None:
        """Store `payload` for `key` atomically; returns the entry's path, or None if it failed."""
        path = self.path(key)
        header = b"\n".join([FORMAT, hashlib.sha256(payload).hexdigest().encode(), repr(key).encode()])
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(header + b"\n" + payload)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; entries may be shared by a team
            os.replace(tmp, path)
            return path
        except OSError as exc:
            log.warning("fa3: cannot write cache entry %s (%s)", path, exc)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return None


def store() -> Store | None:
    root = directory()
    return None if root is None else Store(root)


# ----------------------------------------------------------------------------- what a key adds
def _host_isa() -> str:
    """The machine and, on x86-64, its psABI level (v1..v4): the DSL emits host code for the CPU it
    compiles on, so an entry may use instructions (AVX-512) another machine lacks."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                         set())
    except OSError:
        return machine
    levels = [("v2", {"cx16", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
              ("v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}),
              ("v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})]
    level = "v1"
    for name, needs in levels:
        if not needs <= flags:
            break
        level = name
    return f"{machine}-{level}"


def _source_digest() -> str:
    """SHA-256 over the sources that decide what a kernel compiles to: the kernels package, the
    compile modules (builders and keys) and the fake signatures they compile against. A source edit
    invalidates entries even without a version bump."""
    h = hashlib.sha256()
    spec = importlib.util.find_spec("fa3.kernels")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    files = [(root, p) for root in roots for p in sorted(root.rglob("*.py"))]
    here = Path(__file__).parent
    files += [(here, here / name) for name in ("builders.py", "core.py", "kvcache.py", "signatures.py")]
    for root, p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def runtime_library() -> str | None:
    """The DSL's runtime library (libcute_dsl_runtime.so), found without importing cutlass: the
    DSL's CUTE_DSL_LIBS override, else the one runtime build installed beside the DSL package.
    None when there is none or more than one (the DSL itself then decides)."""
    override = [p for p in os.environ.get("CUTE_DSL_LIBS", "").split(os.pathsep)
                if Path(p).name == RUNTIME_LIBRARY]
    if override:
        return override[0]
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    found = {str(p) for root in roots for p in [*root.glob(f"cu*/lib/{RUNTIME_LIBRARY}"),
                                                 *root.glob(f"lib/{RUNTIME_LIBRARY}")]}
    return found.pop() if len(found) == 1 else None



@functools.lru_cache(maxsize=None)
def _environment() -> tuple:
    """(fa3 version, source digest, DSL runtime build, TVM-FFI version, host ISA): once a process,
    and without importing cutlass, so that a cache hit never does."""
    fa3 = sys.modules.get("fa3")
    runtime = runtime_library()
    build = Path(runtime).parent.parent.name if runtime else "unknown"  # .../cu13/lib/libcute_dsl_runtime.so
    try:
        import tvm_ffi

        tvm_ffi_version = tvm_ffi.__version__
    except ImportError:
        tvm_ffi_version = "none"
    return (("fa3", getattr(fa3, "__version__", "unknown")), ("sources", _source_digest()),
            ("dsl_runtime", build), ("tvm_ffi", tvm_ffi_version), ("host", _host_isa()))


def entry_key(key: tuple) -> tuple:
    """The on-disk key of an in-memory compile key."""
    return (*key, *_environment())


# ----------------------------------------------------------------------------- loading and storing
_KEEP: list = []  # compiled objects and loaded modules: what they own lives as long as we do


def fast_callable(compiled):
    """The bare tvm_ffi.Function inside a compiled TVM-FFI kernel when there is one: calling it
    skips the DSL's Python keyword-argument wrapper (a few us a call). fa3 always calls kernels
    with positional arguments, which is what that wrapper would pass on."""
    raw = getattr(compiled, "__tvm_ffi_object__", lambda: None)()
    if raw is None or compiled.execution_args.has_pointer_address_arg_specs:
        return compiled
    _KEEP.append(compiled)
    return raw


def _symbol(ekey: tuple) -> str:
    return "fa3_" + digest(ekey)[:24]  # a C identifier, unique per entry


def _c_compiler() -> str | None:
    """A C compiler driver to link objects into shared libraries ($CC, cc, gcc or clang)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


def shared_library(cache: Store, ekey: tuple, payload: bytes) -> Path | None:
    """The entry's object linked into a shared library beside it (linked now if it is not there;
    named by the payload's hash, so it always matches the entry); None without a C compiler."""
    path = cache.root / f"{digest(ekey)}-{hashlib.sha256(payload).hexdigest()[:16]}.so"
    if path.exists():
        return path
    cc = _c_compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="fa3-link-") as tmp:
        obj, lib = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        with open(obj, "wb") as f:
            f.write(payload)
        subprocess.run([cc, "-shared", "-o", lib, obj], check=True, capture_output=True, timeout=120)
        fd, staged = tempfile.mkstemp(dir=cache.root, prefix=".tmp-", suffix=".so")
        with os.fdopen(fd, "wb") as f:
            f.write(Path(lib).read_bytes())
    os.chmod(staged, 0o755)
    os.replace(staged, path)
    return path


@functools.lru_cache(maxsize=None)
def _load_globally(*libraries: str) -> None:
    """dlopen each library once with RTLD_GLOBAL: the symbols of kernels loaded later (the DSL
    runtime's, TVM-FFI's) resolve against them."""
    for path in libraries:
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _load_shared(cache: Store, ekey: tuple, payload: bytes):
    """The kernel through a shared library and TVM-FFI alone: no cutlass import (which takes
    seconds on some machines). None where this route is not available."""
    runtime = runtime_library()
    try:
        library = shared_library(cache, ekey, payload) if runtime else None
    except (OSError, subprocess.SubprocessError) as exc:  # cannot link here: the DSL's loader will do
        log.debug("fa3: cannot link %s (%s: %s)", cache.path(ekey), type(exc).__name__, exc)
        return None
    if library is None:
        return None
    import tvm_ffi

    _load_globally(runtime, tvm_ffi.libinfo.find_libtvm_ffi())
    ctypes.CDLL(str(library))  # ctypes binds every symbol now: a missing one raises here, not mid-call
    module = tvm_ffi.load_module(str(library))
    fn = module[_symbol(ekey)]
    _KEEP.append(module)
    return fn


def _load_with_dsl(cache: Store, ekey: tuple, payload: bytes):
    """The kernel through the DSL's own loader (cute.runtime.load_module), which links the object
    in memory: needs no C compiler, but imports cutlass."""
    _, cute = dsl.import_cute()
    _load_globally(*cute.runtime.find_runtime_libraries(enable_tvm_ffi=False))  # load_module opens it RTLD_LOCAL
    with tempfile.TemporaryDirectory(prefix="fa3-load-") as tmp:
        obj = os.path.join(tmp, "kernel.o")
        with open(obj, "wb") as f:
            f.write(payload)
        module = cute.runtime.load_module(obj, enable_tvm_ffi=True)
        return getattr(module, _symbol(ekey))


def load(key: tuple):
    """The kernel stored for in-memory key `key`, as a tvm_ffi.Function; None on a miss (or if the
    entry cannot be loaded: it is logged, and compiling again replaces it)."""
    entry = _read(key)
    if entry is None:
        return None
    cache, ekey, payload = entry
    for route, loader in (("as a shared library", _load_shared), ("with the DSL's loader", _load_with_dsl)):
        try:
            fn = loader(cache, ekey, payload)
        except Exception as exc:
            log.warning("fa3: cannot load cache entry %s %s (%s: %s)", cache.path(ekey), route,
                        type(exc).__name__, exc)
            continue
        if fn is not None:
            log.debug("fa3: loaded %s from %s %s", key[0], cache.path(ekey), route)
            return fn
    return None


def save(key: tuple, compiled) -> Path | None:
    """Export `compiled` (a TVM-FFI compile) and store it for `key`, with its shared library when
    a C compiler is there; the entry's path, or None if it could not be written."""
    cache = store()
    if cache is None:
        return None
    ekey = entry_key(key)
    try:
        with tempfile.TemporaryDirectory(prefix="fa3-export-") as tmp:
            obj = os.path.join(tmp, "kernel.o")
            compiled.export_to_c(object_file_path=obj, function_name=_symbol(ekey))
            payload = Path(obj).read_bytes()
    except Exception as exc:
        log.warning("fa3: cannot export %s for the disk cache (%s: %s)", key[0], type(exc).__name__, exc)
        return None
    path = cache.write(ekey, payload)
    if path is not None:
        _link_quietly(cache, ekey, payload)
    return path


def _link_quietly(cache: Store, ekey: tuple, payload: bytes) -> None:
    try:
        shared_library(cache, ekey, payload)
    except Exception as exc:  # loading falls back to the DSL's loader
        log.debug("fa3: no shared library for %s (%s: %s)", cache.path(ekey), type(exc).__name__, exc)


def has(key: tuple) -> Path | None:
    """The path of a valid entry for `key` (its shared library linked if it can be), or None."""
    entry = _read(key)
    if entry is None:
        return None
    cache, ekey, payload = entry
    _link_quietly(cache, ekey, payload)
    return cache.path(ekey)


def _read(key: tuple):
    """(store, entry key, payload) of a valid entry for `key`, or None (no cache, or a miss)."""
    cache = store()
    if cache is None:
        return None
    ekey = entry_key(key)
    payload = cache.read(ekey)
    return None if payload is None else (cache, ekey, payload)
