"""Command line: `python -m fa3 compile` and `python -m fa3 demo`.

    python -m fa3 compile --kernel NAME|all [--head-dim 128] [--causal] [--dtype bf16|fp16] --out DIR
        Compiles rungs for sm_90a (no GPU needed), writes NAME.ptx and NAME.cubin into DIR and
        prints ptxas' registers and spills and which of the rung's promised PTX instructions appear.
        FP8 rungs (f1) take e4m3 q/k/v; --dtype is then their output's type.
    python -m fa3 compile --warm-cache --kernel NAME|all [--head-dim 128] [--causal] [--dtype bf16]
                          [--fp8]
        Compiles into the disk compile cache instead (FA3_CACHE_DIR, default ~/.cache/fa3; no GPU
        needed), skipping what is there, so that a deployment's first calls load in milliseconds.
        GEMM rungs are compiled for every operand layout (--fp8: the FP8 GEMM, C in --dtype); the
        KV-cache rung dense, paged and with row gathers, each also for packed queries (--fp8: on
        an FP8 cache, read by FP8 q with O in --dtype and by --dtype q), alone and with the
        split-KV combine, and what a cache call launches beside it: the entries' sort and K5 over
        the cache for prompt chunks
        (compile/kvcache.py kvcache_companions); the MLA decode rung paged and dense, alone and
        with its combine; FP8 attention also for packed batches (cache_configs).
    python -m fa3 demo
        On a Hopper GPU: fa3.attention (fastest rung) on batch 2, seqlen 4096, 16 heads, head_dim 128,
        bf16, causal and not; error against torch SDPA and TFLOP/s. Without one: compiles every
        attention rung for sm_90a and reports each.

Nothing here imports cutlass before the target architecture is pinned (fa3.compile.dsl does it).
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .compile import builders as _compile, kvcache as _compile_kvcache, disk_cache as _disk_cache, dsl as _dsl
from . import registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEMO_SHAPE = dict(batch=2, seqlen=4096, heads=16, head_dim=128)
DEMO_MAX_REL_ERR = 2e-2
_PTXAS_RESOURCE_LINE = re.compile(r"Used \d+ registers|bytes spill stores")


def prepare_dsl_env() -> None:
    """Call before anything imports cutlass (the DSL reads its environment once, at import).

    Without a GPU the DSL would target sm_100a: pin sm_90a. compile_report keeps the PTX and cubin,
    which the DSL also writes as files into its dump folder, by default the current directory:
    point it at a scratch folder that goes away at exit."""
    _dsl.pin_target_arch()
    if "CUTE_DSL_DUMP_DIR" not in os.environ:
        scratch = tempfile.mkdtemp(prefix="fa3-dsl-")
        os.environ["CUTE_DSL_DUMP_DIR"] = scratch
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)


HEAD_DIM_FAMILIES = (registry.ATTENTION, registry.ATTENTION_FP8, registry.BACKWARD, registry.KVCACHE)


def static_args(spec: registry.KernelSpec, head_dim: int, causal: bool) -> dict:
    """What the rung's family compiles against: attention and its backward take head_dim and
    causal, GEMM nothing."""
    if spec.family in HEAD_DIM_FAMILIES:
        return {"head_dim": head_dim, "causal": causal}
    return {}


def describe(spec: registry.KernelSpec, dtype: torch.dtype, head_dim: int, causal: bool,
             fp8: bool = False) -> str:
    dt = next(k for k, v in DTYPES.items() if v == dtype)
    if fp8 or spec.family == registry.ATTENTION_FP8:  # e4m3 inputs; dtype is the output's
        dt = f"e4m3->{dt}"
    if spec.family in HEAD_DIM_FAMILIES:
        return f"{spec.name} d{head_dim} {'causal' if causal else 'non-causal'} {dt}"
    return f"{spec.name} {spec.family} {dt}"


@dataclass
class RungCompile:
    spec: registry.KernelSpec
    label: str
    report: _compile.CompileReport

    @property
    def missing(self) -> list[str]:
        return [p for p in self.spec.ptx_promises if p not in self.report.ptx]

    @property
    def forbidden(self) -> list[str]:
        return [f for f in self.spec.ptx_forbids if f in self.report.ptx]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.forbidden

    def resources(self) -> str:
        regs = "/".join(str(r) for r in self.report.registers) or "?"
        serialized = ", WGMMAs serialized (C7512)" if self.report.serialized_wgmma else ""
        return f"registers {regs}, spills {self.report.spill_bytes} B{serialized}"

    def verdict(self) -> str:
        if self.ok:
            return f"PTX promises ok ({len(self.spec.ptx_promises)})"
        parts = [f"missing {', '.join(self.missing)}" if self.missing else "",
                 f"forbidden present {', '.join(self.forbidden)}" if self.forbidden else ""]
        return "PTX promises FAILED: " + "; ".join(p for p in parts if p)

    def line(self) -> str:
        return f"{self.label:<28} {self.resources():<32} {self.verdict()}"


def compile_rung(spec, dtype, head_dim: int, causal: bool) -> RungCompile:
    report = _compile.compile_report(spec, dtype, **static_args(spec, head_dim, causal))
    return RungCompile(spec, describe(spec, dtype, head_dim, causal), report)


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB"


def selected_rungs(args) -> list[registry.KernelSpec] | None:
    """The rungs --kernel names that support --head-dim (GEMM rungs always do). A single named
    rung that does not is an error (None, after saying so); with 'all' it is skipped with a note."""
    names = registry.available_kernels() if args.kernel == "all" else [args.kernel]
    specs = []
    for name in names:
        spec = registry.get(name)
        if spec.family in HEAD_DIM_FAMILIES and args.head_dim not in spec.head_dims:
            msg = f"{name}: head_dim {args.head_dim} is not supported (supported: {spec.head_dims})"
            if args.kernel != "all":
                print(msg, file=sys.stderr)
                return None
            print(msg + ", skipped", flush=True)
            continue
        specs.append(spec)
    return specs


def cmd_compile(args) -> int:
    if args.warm_cache:
        return cmd_warm_cache(args)
    if args.out is None:
        print("compile: --out DIR is required (or --warm-cache to fill the compile cache)", file=sys.stderr)
        return 2
    specs = selected_rungs(args)
    if specs is None:
        return 2
    os.makedirs(args.out, exist_ok=True)
    dtype = DTYPES[args.dtype]
    failures = 0
    for spec in specs:
        name = spec.name
        try:
            result = compile_rung(spec, dtype, args.head_dim, args.causal)
        except Exception as exc:  # report and go on to the next rung
            print(f"{describe(spec, dtype, args.head_dim, args.causal)}: compile FAILED: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            failures += 1
            continue
        ptx_path = os.path.join(args.out, f"{name}.ptx")
        cubin_path = os.path.join(args.out, f"{name}.cubin")
        with open(ptx_path, "w") as f:
            f.write(result.report.ptx)
        with open(cubin_path, "wb") as f:
            f.write(result.report.cubin)
        print(f"{result.label} ({_dsl.TARGET_ARCH}): {ptx_path} ({_kib(len(result.report.ptx))}), "
              f"{cubin_path} ({_kib(len(result.report.cubin))})")
        print(f"  {result.resources()}")
        for line in result.report.summary().splitlines():
            if _PTXAS_RESOURCE_LINE.search(line):
                print(f"  ptxas: {line.split('ptxas')[-1].strip(' .')}")
        for p in spec.ptx_promises:
            print(f"  promises {p!r}: {'present' if p in result.report.ptx else 'MISSING'}")
        for f_ in spec.ptx_forbids:
            print(f"  forbids  {f_!r}: {'PRESENT' if f_ in result.report.ptx else 'absent'}")
        print(f"  {result.verdict()}", flush=True)
        failures += not result.ok
    return 1 if failures else 0


def cache_configs(spec: registry.KernelSpec, head_dim: int, causal: bool, fp8: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The static configurations --warm-cache compiles for a rung: attention at --head-dim and
    --causal (FP8 also packed, the serving prefill; the backward also in its deterministic and GQA
    variants); the KV-cache rung dense and paged, with row gathers (pages of 16 or 1), each with
    (batch, seqlen_q) and packed queries, alone and with the split-KV combine (`fp8`: on an FP8 cache, for FP8 q with O in `dtype` and for
    `dtype` q); GEMM with every
    operand layout (row-major and transposed a and b), or (`fp8`) e4m3 K-major operands with C in
    `dtype`, per-tensor and row-wise scales."""
    if spec.family == registry.ATTENTION:  # (and the tiles for short query sequences, if any)
        return [{"head_dim": head_dim, "causal": causal, **({"short": True} if short else {})}
                for short in (False, True)[:1 + spec.config.is_short(head_dim, None, causal, 1)]]
    if spec.family == registry.ATTENTION_FP8:
        return [{"head_dim": head_dim, "causal": causal, "varlen": varlen} for varlen in (False, True)]
    if spec.family == registry.BACKWARD:
        return [{"head_dim": head_dim, "causal": causal, "deterministic": det, "gqa": gqa}
                for det in (False, True) for gqa in (False, True)]
    if spec.family == registry.KVCACHE:  # an FP8 cache: read by FP8 q (O in dtype) and by dtype's q
        reads = ({"out_dtype": dtype}, {"query_dtype": dtype}) if fp8 else ({},)
        return [{"head_dim": head_dim, "causal": causal, "paged": paged, "gather": gather, "varlen": varlen, **q,
                 **({"with_combine": True} if split else {})}
                for q in reads for paged, gather in ((False, False), (True, False), (True, True))
                for varlen in (False, True) for split in (False, True)]
    if spec.family == registry.MLA:  # MLA decode: its own head dims; pages (TMA boxes, row gathers) or dense
        return [{"causal": causal, "paged": paged, "gather": gather, "varlen": varlen,
                 **({"with_combine": True} if split else {})}
                for paged, gather in ((True, False), (True, True), (False, False)) for varlen in (False, True)
                for split in (False, True)]
    if fp8:
        return [{"a_layout": "row", "b_layout": "col", "out_dtype": dtype, "row_scales": rows}
                for rows in (False, True)]
    return [{"a_layout": a, "b_layout": b} for a in _compile.GEMM_LAYOUTS for b in _compile.GEMM_LAYOUTS]


def cmd_warm_cache(args) -> int:
    """Compile the selected rungs into the disk compile cache (no GPU needed), skipping entries
    that are already there, so that a deployment's first calls load instead of compiling."""
    root = _disk_cache.directory()
    if root is None:
        print("compile --warm-cache: the disk cache is off (FA3_DISK_CACHE=0)", file=sys.stderr)
        return 2
    specs = selected_rungs(args)
    if specs is None:
        return 2
    dtype = DTYPES[args.dtype]
    print(f"compile cache: {root} ({_dsl.TARGET_ARCH})", flush=True)
    failures = 0
    for spec in specs:
        fp8_inputs = args.fp8 and spec.family in (registry.GEMM, registry.KVCACHE)  # e4m3 in, dtype out
        in_dtype = torch.float8_e4m3fn if fp8_inputs else dtype
        entries = []  # (label, fill)
        for static in cache_configs(spec, args.head_dim, args.causal, args.fp8, dtype):
            label = describe(spec, dtype, args.head_dim, args.causal, fp8_inputs)
            if spec.family == registry.GEMM:
                label += f" a {static['a_layout']} b {static['b_layout']}"
                label += " row-wise" if static.get("row_scales") else ""
            else:
                label += "".join(f" {k}" for k in ("varlen", "paged", "gather", "short") if static.get(k))
                label += " with its combine" if static.get("with_combine") else ""
                label += f" {args.dtype} q" if static.get("query_dtype") else ""
            entries.append((label, lambda static=static: _compile.fill_disk_cache(spec, in_dtype, **static)))
        companions = []  # what a cache call launches beside the rung
        if spec.family == registry.KVCACHE:
            companions = _compile_kvcache.kvcache_companions(spec, in_dtype, args.head_dim, args.causal)
        for what, key, build in companions:
            label = f"{describe(spec, dtype, args.head_dim, args.causal, fp8_inputs)} {what}"
            entries.append((label, lambda key=key, build=build: _compile.fill_disk_cache_entry(key, build)))
        for label, fill in entries:
            start = time.perf_counter()
            try:
                path, compiled = fill()
            except Exception as exc:  # report and go on
                print(f"{label}: compile FAILED: {type(exc).__name__}: {exc}", flush=True)
                failures += 1
                continue
            if path is None:
                print(f"{label}: could not write the entry (see the warning above)", flush=True)
                failures += 1
            else:
                what = f"compiled in {time.perf_counter() - start:.1f} s" if compiled else "already cached"
                print(f"{label:<36} {what}: {path.name}", flush=True)
    return 1 if failures else 0


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _demo_compile_only(reason: str) -> int:
    d = DEMO_SHAPE["head_dim"]
    print(f"{reason}: compiling every attention rung for {_dsl.TARGET_ARCH} instead "
          f"(head_dim {d}, causal, bf16)", flush=True)
    failures = 0
    for name in registry.available_kernels(registry.ATTENTION):
        spec = registry.get(name)
        head_dim = d if d in spec.head_dims else spec.head_dims[0]
        try:
            result = compile_rung(spec, torch.bfloat16, head_dim, True)
        except Exception as exc:
            print(f"{name:<28} compile FAILED: {type(exc).__name__}: {exc}", flush=True)
            failures += 1
            continue
        print(result.line(), flush=True)
        failures += not result.ok
    print(f"{reason}, so nothing ran: the lines above are compile-only checks.")
    return 1 if failures else 0


def _demo_gpu() -> int:
    import torch.nn.functional as F

    import fa3
    from fa3.timing import attention_flops, median_ms, tflops

    b, s, h, d = (DEMO_SHAPE[k] for k in ("batch", "seqlen", "heads", "head_dim"))
    print(f"{torch.cuda.get_device_name()}: fa3.attention, batch {b}, seqlen {s}, {h} heads, "
          f"head_dim {d}, bf16", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    failures = 0
    for causal in (False, True):
        rung = registry.fastest(registry.ATTENTION, d).name
        out = fa3.attention(q, k, v, causal=causal)
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=causal).transpose(1, 2)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        ms = median_ms(lambda: fa3.attention(q, k, v, causal=causal, out=out))
        rate = tflops(attention_flops(b, h, s, s, d, causal), ms)
        ok = err < DEMO_MAX_REL_ERR
        failures += not ok
        print(f"  {'causal' if causal else 'non-causal':<11} rung {rung:<6} rel. error vs SDPA "
              f"{err:.2e} ({'ok' if ok else 'TOO LARGE'})   {ms:8.3f} ms   {rate:6.1f} TFLOP/s",
              flush=True)
    return 1 if failures else 0


def cmd_demo(args) -> int:
    if _hopper_available():
        return _demo_gpu()
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return _demo_compile_only(f"GPU {name} is not a Hopper GPU (sm_90)")
    return _demo_compile_only("No GPU found")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fa3", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help=f"compile rungs for {_dsl.TARGET_ARCH}; write PTX and cubin")
    comp.add_argument("--kernel", required=True, choices=registry.available_kernels() + ["all"],
                      metavar="NAME", help="a rung (" + ", ".join(registry.available_kernels())
                      + ") or 'all'")
    comp.add_argument("--head-dim", type=int, default=128,
                      help=f"attention, backward and KV-cache rungs (default 128; the default rungs take "
                           f"{', '.join(map(str, registry.HEAD_DIMS))})")
    comp.add_argument("--causal", action="store_true", help="attention rungs: causal mask")
    comp.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    comp.add_argument("--fp8", action="store_true",
                      help="with --warm-cache, GEMM rungs: the FP8 GEMM (e4m3 operands, C in --dtype)")
    comp.add_argument("--out", help="folder for NAME.ptx and NAME.cubin")
    comp.add_argument("--warm-cache", action="store_true",
                      help="compile into the disk compile cache (FA3_CACHE_DIR, default ~/.cache/fa3) "
                      "instead of writing PTX and cubin: later processes load these kernels")
    comp.set_defaults(func=cmd_compile)
    demo = sub.add_parser("demo", help="run (or, without a Hopper GPU, compile) the attention demo")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    prepare_dsl_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
