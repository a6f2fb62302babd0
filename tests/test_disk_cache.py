"""CPU tests: the on-disk compile cache (fa3.compile.disk_cache) and `python -m fa3 compile --warm-cache`.

Keys change with everything compiled in; entries round-trip, are written atomically (concurrent
writers and readers never see a partial entry), and a damaged or unloadable entry is compiled
again and replaced. The flow through fa3.compile.builders runs with stand-ins for the DSL's export and
load; real kernels are exported and loaded both ways (as a shared library through TVM-FFI, which
does not import cutlass, and with the DSL's loader): loading works without a GPU, calling does not.
"""

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fa3
import fa3.__main__ as cli
from fa3.compile import builders as _compile, core as _compile_core, kvcache as _compile_kvcache
from fa3.compile import disk_cache as _disk_cache, dsl as _dsl
from fa3 import registry

BF16 = torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FA3_CACHE_DIR", str(root))
    monkeypatch.delenv("FA3_DISK_CACHE", raising=False)
    monkeypatch.setattr(_compile_core, "CACHE", {})  # a fresh process, as far as the cache can tell
    monkeypatch.setattr(_compile_core, "FAST", {})
    return root


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("*" + _disk_cache.SUFFIX)) if root.exists() else []


# ----------------------------------------------------------------------------- keys
def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FA3_DISK_CACHE", raising=False)
    monkeypatch.setenv("FA3_CACHE_DIR", str(tmp_path / "here"))
    assert _disk_cache.directory() == tmp_path / "here"
    monkeypatch.delenv("FA3_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _disk_cache.directory() == tmp_path / "xdg" / "fa3"
    monkeypatch.setenv("FA3_DISK_CACHE", "0")
    assert _disk_cache.directory() is None and _disk_cache.store() is None


def test_attention_key_changes_with_every_compiled_in_parameter(monkeypatch):
    spec = registry.get(registry.fastest(registry.ATTENTION, 128).name)
    key = lambda s=spec, dtype=BF16, head_dim=128, causal=False: _compile.attention_key(s, dtype, head_dim, causal)
    base = key()
    variants = [key(dtype=torch.float16), key(head_dim=64), key(causal=True),
                key(s=registry.get(registry.available_kernels(registry.ATTENTION)[0])),
                key(s=replace(spec, config=spec.config.replaced(tile_n=64))),
                key(s=replace(spec, config=replace(spec.config, per_head_dim={128: {"kv_stages": 7}})))]
    monkeypatch.setattr(_dsl, "TARGET_ARCH", "sm_90")
    variants.append(key())
    monkeypatch.undo()
    monkeypatch.setattr(_dsl, "version", lambda: "0.0.0")
    variants.append(key())
    assert len({base, *variants}) == len(variants) + 1


def test_gemm_key_changes_with_every_compiled_in_parameter(monkeypatch):
    spec = registry.get("g3")
    key = lambda s=spec, dtype=BF16, a="row", b="row": _compile.gemm_key(s, dtype, a, b)
    base = key()
    variants = [key(dtype=torch.float16), key(a="col"), key(b="col"), key(s=registry.get("g1")),
                key(s=replace(spec, config=spec.config.replaced(group_m=8))),
                _compile.gemm_key(spec, BF16, "row", "row", tiles=(("tile_n", 128),))]
    monkeypatch.setattr(_dsl, "version", lambda: "0.0.0")
    variants.append(key())
    assert len({base, *variants}) == len(variants) + 1


def test_entry_key_adds_what_the_object_depends_on(monkeypatch):
    key = ("k", "torch.bfloat16", 128)
    runtime = "/site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so"

    def entry(**patch):
        _disk_cache._environment.cache_clear()
        with monkeypatch.context() as m:
            for name, value in {"runtime_library": runtime, **patch}.items():
                m.setattr(_disk_cache, name, lambda value=value: value)
            return _disk_cache.entry_key(key)

    base = entry()
    assert base[:3] == key and base == entry()
    variants = [entry(_source_digest="edited"), entry(_host_isa="x86_64-v2"),
                entry(runtime_library=runtime.replace("cu13", "cu12"))]
    with monkeypatch.context() as m:
        m.setattr(fa3, "__version__", "9.9.9")
        variants.append(entry())
    _disk_cache._environment.cache_clear()
    assert len({base, *variants}) == len(variants) + 1
    assert _disk_cache._host_isa()  # e.g. x86_64-v4


def test_runtime_library_found_without_cutlass(monkeypatch):
    found = _disk_cache.runtime_library()
    assert found is None or os.path.isfile(found)
    monkeypatch.setenv("CUTE_DSL_LIBS", os.pathsep.join(["/a/libother.so", "/b/cu13/lib/libcute_dsl_runtime.so"]))
    assert _disk_cache.runtime_library() == "/b/cu13/lib/libcute_dsl_runtime.so"


# ----------------------------------------------------------------------------- the store
def test_store_round_trip(tmp_path):
    store = _disk_cache.Store(tmp_path)
    key, other = ("a", 1, True), ("a", 1, False)
    assert store.read(key) is None
    path = store.write(key, b"\x7fELF payload\nwith newlines\n")
    assert path == store.path(key) != store.path(other) and path.parent == tmp_path
    assert store.read(key) == b"\x7fELF payload\nwith newlines\n" and store.read(other) is None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty", "another key", "old format"])
def test_damaged_entry_is_a_miss_and_is_replaced(tmp_path, caplog, damage):
    store = _disk_cache.Store(tmp_path)
    key = ("rung", "torch.float16", 64)
    path = store.write(key, bytes(range(256)) * 4)
    blob = path.read_bytes()
    path.write_bytes({
        "flip a payload byte": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:],
        "truncate": blob[: len(blob) // 2],
        "empty": b"",
        "another key": blob.replace(repr(key).encode(), repr(("rung", "torch.float16", 65)).encode()),
        "old format": blob.replace(_disk_cache.FORMAT, b"fa3-kernel-cache 0"),
    }[damage])
    assert store.read(key) is None and "damaged" in caplog.text
    store.write(key, b"fresh")
    assert store.read(key) == b"fresh"


def test_concurrent_writers_and_readers_see_whole_entries(tmp_path, caplog):
    store = _disk_cache.Store(tmp_path)
    key = ("shared",)
    payloads = {bytes([i]) * (1000 + 997 * i) for i in range(6)}
    seen, stop = [], threading.Event()

    def writer(payload):
        for _ in range(30):
            assert store.write(key, payload) is not None

    def reader():
        while not stop.is_set():
            seen.append(store.read(key))

    readers = [threading.Thread(target=reader) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert store.read(key) in payloads
    assert set(seen) <= payloads | {None} and "damaged" not in caplog.text
    assert len(list(tmp_path.iterdir())) == 1


# ----------------------------------------------------------------------------- through fa3.compile.builders
class StandInKernel:
    """A 'compiled kernel' whose export writes its payload and whose call says where it came from."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def export_to_c(self, object_file_path, function_name):
        Path(object_file_path).write_bytes(function_name.encode() + b"|" + self.payload)

    def __call__(self):
        return "built", self.payload


def stand_in_load_module(path, enable_tvm_ffi=False):
    """load_module's stand-in: the exported symbol, as a function that says it was loaded."""
    symbol, _, payload = Path(path).read_bytes().partition(b"|")
    if payload == b"unloadable":
        raise RuntimeError("undefined symbol: _cudaLibraryLoadData")
    return SimpleNamespace(**{symbol.decode(): lambda: ("loaded", payload)})


@pytest.fixture
def stand_in_dsl(monkeypatch, cache_dir):
    """The DSL's side replaced: export writes the payload, the DSL's loader reads it back, and no
    shared library is linked (there is no C compiler)."""
    cute = SimpleNamespace(runtime=SimpleNamespace(find_runtime_libraries=lambda enable_tvm_ffi=False: [],
                                                   load_module=stand_in_load_module))
    monkeypatch.setattr(_dsl, "import_cute", lambda: (None, cute))
    monkeypatch.setattr(_disk_cache, "_c_compiler", lambda: None)
    built = []

    def build(payload=None):
        built.append(payload or b"kernel %d" % len(built))
        return StandInKernel(built[-1])

    return build, built


KEY = ("k5.3", "torch.bfloat16", 128, False)


def new_process(monkeypatch):
    monkeypatch.setattr(_compile_core, "CACHE", {})
    monkeypatch.setattr(_compile_core, "FAST", {})


def test_compile_once_then_load(stand_in_dsl, cache_dir, monkeypatch):
    build, built = stand_in_dsl
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 0")
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 0")  # in memory
    assert len(entries(cache_dir)) == 1
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("loaded", b"kernel 0")
    assert built == [b"kernel 0"]
    new_process(monkeypatch)
    assert _compile_core.cached(KEY[:-1] + (True,), build)() == ("built", b"kernel 1")  # another key
    assert len(entries(cache_dir)) == 2


def test_damaged_entry_self_heals(stand_in_dsl, cache_dir, monkeypatch, caplog):
    build, built = stand_in_dsl
    _compile_core.cached(KEY, build)
    (entry,) = entries(cache_dir)
    entry.write_bytes(entry.read_bytes()[:-3])
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 1") and "damaged" in caplog.text
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("loaded", b"kernel 1")


def test_unloadable_entry_self_heals(stand_in_dsl, cache_dir, monkeypatch, caplog):
    build, built = stand_in_dsl
    _compile_core.cached(KEY, lambda: build(b"unloadable"))
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 1") and "cannot load" in caplog.text
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("loaded", b"kernel 1")


def test_cache_off_or_unwritable_still_compiles(stand_in_dsl, cache_dir, monkeypatch, caplog, tmp_path):
    build, built = stand_in_dsl
    monkeypatch.setenv("FA3_DISK_CACHE", "0")
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 0") and not entries(cache_dir)
    monkeypatch.delenv("FA3_DISK_CACHE")
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("FA3_CACHE_DIR", str(tmp_path / "a-file"))
    new_process(monkeypatch)
    assert _compile_core.cached(KEY, build)() == ("built", b"kernel 1") and "cannot write" in caplog.text


# ----------------------------------------------------------------------------- the real DSL
HAS_CC = _disk_cache._c_compiler() is not None and _disk_cache.runtime_library() is not None


@pytest.mark.parametrize("route", [
    pytest.param("shared library", marks=pytest.mark.skipif(not HAS_CC, reason="no C compiler")),
    "DSL loader"])
def test_real_kernel_exports_and_loads(cache_dir, monkeypatch, route):
    """A real compile goes to disk, and a new process gets it back as a TVM-FFI function with the
    kernel's signature (it checks its arguments: CPU tensors are refused) without compiling."""
    cli.prepare_dsl_env()
    if route == "DSL loader":
        monkeypatch.setattr(_disk_cache, "_c_compiler", lambda: None)
    spec = registry.get("g1")
    fn = _compile.get_gemm(spec, BF16, "row", "col")
    (entry,) = entries(cache_dir)
    assert len(list(cache_dir.glob(entry.stem + "-*.so"))) == (route == "shared library")
    new_process(monkeypatch)
    monkeypatch.setattr(_compile, "_build_gemm", lambda *a, **k: pytest.fail("compiled instead of loading"))
    loaded = _compile.get_gemm(spec, BF16, "row", "col")
    assert loaded is not fn and type(loaded).__name__ == "Function"
    a = torch.zeros(128, 64, dtype=BF16)
    with pytest.raises(Exception, match="cuda"):
        loaded(a, a.t(), torch.zeros(128, 128, dtype=BF16), 132, torch.zeros(1), torch.zeros(1, dtype=torch.int32), 1,
               torch.ones(1), torch.ones(1))
    if route == "shared library":  # and a fresh interpreter loads it without importing cutlass
        code = ("import sys, torch; from fa3 import registry; from fa3.compile import builders as _compile; "
                "fn = _compile.get_gemm(registry.get('g1'), torch.bfloat16, 'row', 'col'); "
                "print(type(fn).__name__, 'cutlass' in sys.modules)")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.stdout.split() == ["Function", "False"], proc.stdout + proc.stderr


def test_cli_warm_cache(cache_dir, capsys):
    args = ["compile", "--warm-cache", "--kernel", "k1", "--head-dim", "64"]
    assert cli.main(args) == 0
    assert "compiled in" in capsys.readouterr().out
    (entry,) = entries(cache_dir)
    assert cli.main(args) == 0
    assert "already cached" in capsys.readouterr().out
    # the entry is the one a call to fa3.attention(kernel="k1") with head_dim 64 looks for
    key = _compile.attention_key(registry.get("k1"), BF16, 64, False)
    assert _disk_cache.has(key) == entry


def test_cli_compile_needs_out_or_warm_cache(capsys):
    assert cli.main(["compile", "--kernel", "k1"]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("fp8", [False, True])
def test_warm_cache_configs_fit_every_family(fp8):
    """Every static configuration --warm-cache asks for is one the family's key and builder take
    (the KV-cache rung once got the GEMM's operand layouts), without compiling."""
    import inspect

    for name in registry.available_kernels():
        spec = registry.get(name)
        head_dim = 128 if 128 in spec.head_dims or not spec.head_dims else spec.head_dims[0]
        dtype = torch.float8_e4m3fn if fp8 and spec.family in (registry.GEMM, registry.KVCACHE) else BF16
        # (d96 on k5.5: also its tiles for short query sequences)
        for d in (head_dim, 96) if 96 in spec.head_dims else (head_dim,):
            configs = cli.cache_configs(spec, d, True, fp8, BF16)
            assert configs, name
            if (name, d) == ("k5.5", 96):
                assert len(configs) == 2
            if spec.family == registry.KVCACHE:  # an FP8 cache is warmed for FP8 q and for bf16 q
                assert any(c.get("query_dtype") == BF16 for c in configs) == fp8
            for static in configs:
                _compile.KEYS[spec.family](spec, dtype, **static)
                inspect.signature(_compile.BUILDERS[spec.family]).bind(spec, dtype, **static)


def test_cli_warm_cache_kvcache_rung(cache_dir, capsys):
    """The KV-cache rung warms dense, paged and gathered kernels, with and without packed queries,
    each alone and with the split-KV combine (one compiled call), and what a cache call launches
    beside them: the entries' sort, and K5 over the cache (dense, whole-block pages, pages of 16
    and 64 rows)."""
    assert cli.main(["compile", "--warm-cache", "--kernel", "s1", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("compiled in") == 12 + 5 and "FAILED" not in out
    assert "entry order" in out and out.count("K5 over the cache") == 4 and out.count("with its combine") == 6
    long_queries = registry.get("s1").config.base.long_queries
    for key in (_compile_kvcache.entry_order_key(),
                _compile_kvcache.kvcache_key(registry.get("s1"), BF16, 64, False, paged=True, with_combine=True),
                _compile_kvcache.cache_prefill_key(registry.get("k5.5"), BF16, 64, False, True, 16,
                                                   long_queries)):
        assert _disk_cache.has(key) is not None, key  # the entries the calls look for
