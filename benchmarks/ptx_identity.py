"""The PTX identity check: SHA-256 of the sm_90a PTX of every kernel configuration the registry
serves, compiled on the CPU (no GPU), to show that a refactor left the generated code unchanged.

    python benchmarks/ptx_identity.py --save before.txt          # on the tree before the change
    python benchmarks/ptx_identity.py --compare before.txt       # after: lists what differs, exit 1
    python benchmarks/ptx_identity.py --only "^s1" [--list]      # a subset (regex on the labels)

Configurations (about 520): every attention, FP8 and backward rung x head dim x causal, the K5 rungs'
variants, v's other head dims and short-query tiles, K5 over a KV cache, S1 over 16-bit and FP8
caches (16-bit q too), S2 (16-bit and FP8 caches, pages of 16 a page a warp), M1 (MLA: dense,
paged, gathered, packed, with its combine or not), the split-KV combine, the GEMM rungs (bf16 and
FP8), each backward rung's static variants and postprocess, the backward preprocess. A kernel's entry name spells its module and class (cut at a
fixed length), so each entry symbol is replaced by ENTRYi before hashing: moving or renaming a class
keeps its hash. Run it from a tree nobody edits meanwhile (the DSL reads the kernels' sources as it
compiles); it works in a temporary folder of its own (--keep-ptx writes each kernel's PTX there).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import re
import sys
import tempfile

import torch

from fa3 import registry
from fa3.compile import builders, dsl, kvcache, mla

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def normalise(ptx: str) -> str:
    """The PTX with each entry symbol (and the symbols that spell fa3's kernel modules) renamed."""
    entries = []
    for name in re.findall(r"\.entry\s+(\w+)\s*\(", ptx):
        if name not in entries:
            entries.append(name)
    for i, name in enumerate(sorted(entries, key=len, reverse=True)):
        ptx = ptx.replace(name, f"ENTRY{i}")
    return re.sub(r"\w*fa3kernels\w*", "SYM", ptx)


def ptx_hash(build, args, kwargs) -> str:
    quiet = io.StringIO()
    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
        fn = build(*args, **kwargs, extra_options="--keep-ptx")
    return hashlib.sha256(normalise(fn.artifacts.PTX).encode()).hexdigest()[:16]


def forward_jobs():
    for name in registry.available_kernels(registry.ATTENTION):
        spec = registry.get(name)
        for d in spec.head_dims:
            for causal in (False, True):
                yield f"{name} d{d} causal={causal}", builders._build_attention, (spec, BF16, d, causal), {}
        variants = [dict(varlen=True), dict(local=True), dict(softcap=True)]
        variants += [dict(sinks=True)] if registry.SINKS in spec.variants else []
        for kw in variants if spec.variants else []:
            yield f"{name} d128 causal {kw}", builders._build_attention, (spec, BF16, 128, True), kw
        for d, dv in spec.value_head_dims:
            yield f"{name} d{d} dv{dv}", builders._build_attention, (spec, BF16, d, True), dict(head_dim_v=dv)
        for d in getattr(spec.config, "short_queries", {}) or {}:
            yield f"{name} d{d} short", builders._build_attention, (spec, BF16, d, True), dict(short=True)
    for name in registry.available_kernels(registry.ATTENTION_FP8):
        spec = registry.get(name)
        for d in spec.head_dims:
            for causal in (False, True):
                yield f"{name} d{d} causal={causal}", builders._build_attention_fp8, (spec, BF16, d, causal), {}
        yield f"{name} d128 varlen", builders._build_attention_fp8, (spec, BF16, 128, True), dict(varlen=True)
        yield (f"{name} d64 local softcap", builders._build_attention_fp8, (spec, BF16, 64, True),
               dict(local=True, softcap=True))


def cache_jobs():
    rung = registry.get("k5.5")
    for d, paged, rows in ((128, False, 0), (128, True, 16), (64, True, 0)):
        yield (f"cache_prefill d{d} paged={paged} rows={rows}", kvcache.build_cache_prefill,
               (rung, BF16, d, True, paged, rows, 128), {})
    yield ("cache_prefill d128 local softcap sinks", kvcache.build_cache_prefill,
           (rung, BF16, 128, True, True, 0, 128), dict(local=True, softcap=True, sinks=True))
    s1 = registry.get("s1")
    variants = (dict(paged=True), dict(paged=True, gather=True), dict(varlen=True, max_queries=128),
                dict(local=True, softcap=True, sinks=True), dict(leftpad=True))
    for d in registry.HEAD_DIMS:
        yield f"s1 d{d}", kvcache.build_kvcache, (s1, BF16, d, True), {}
        yield f"s1 fp8 d{d}", kvcache.build_kvcache, (s1, FP8, d, True), {}
        yield f"s1 fp8 bf16-q d{d}", kvcache.build_kvcache, (s1, FP8, d, True), dict(query_dtype=BF16)
    for kw in variants:
        yield f"s1 d128 {kw}", kvcache.build_kvcache, (s1, BF16, 128, True), kw
        yield f"s1 fp8 d128 {kw}", kvcache.build_kvcache, (s1, FP8, 128, True), kw
    yield ("s1 fp8 d128 out fp16", kvcache.build_kvcache, (s1, FP8, 128, True), dict(out_dtype=torch.float16))
    yield "s1 d128 with the combine", kvcache.build_kvcache, (s1, BF16, 128, True), dict(with_combine=True)
    for d in (*registry.HEAD_DIMS, 512):  # the split-KV combine alone (512: M1's latent rows)
        yield f"combine d{d}", kvcache.build_combine, (BF16, d), {}
    yield "combine d128 sinks", kvcache.build_combine, (BF16, 128), dict(sinks=True)
    yield "combine d128 max_queries", kvcache.build_combine, (BF16, 128), dict(max_queries=64)
    s2 = registry.get("s2")
    for d in s2.head_dims:
        for kw in (dict(), dict(paged=True), dict(paged=True, gather=True)):
            yield f"s2 d{d} {kw}", kvcache.build_kvcache, (s2, BF16, d, True), kw
            yield f"s2 fp8 d{d} {kw}", kvcache.build_kvcache, (s2, FP8, d, True), kw
        for q_dtype in (None, BF16):  # pages of 16: a page a warp
            yield (f"s2 fp8 d{d} warp_pages q={q_dtype}", kvcache.build_kvcache, (s2, FP8, d, True),
                   dict(paged=True, gather=kvcache.WARP_PAGE_ROWS, query_dtype=q_dtype))
    m1 = registry.get("m1")
    for paged, gather, varlen in ((False, False, False), (True, False, False), (True, True, False), (True, False, True)):
        for with_combine in (False, True):
            yield (f"m1 paged={paged} gather={gather} varlen={varlen} combine={with_combine}", mla.build_mla,
                   (m1, BF16, True, paged, gather, varlen, with_combine), {})


def gemm_jobs():
    for name in registry.available_kernels(registry.GEMM):
        spec = registry.get(name)
        for a, b in (("row", "row"), ("col", "col")):
            yield f"{name} bf16 {a}/{b}", builders._build_gemm, (spec, BF16, a, b), {}
        yield f"{name} fp8 row/col", builders._build_gemm, (spec, FP8, "row", "col"), dict(out_dtype=BF16)
        if name in ("g3", "g4"):
            yield (f"{name} fp8 row/col row_scales", builders._build_gemm, (spec, FP8, "row", "col"),
                   dict(out_dtype=BF16, row_scales=True))


# the backward's static variants, per rung and head dim ("causal" given: the call's mask)
BACKWARD_VARIANTS = [dict(deterministic=True), dict(deterministic=True, causal=False), dict(gqa=True),
                     dict(varlen=True), dict(local=True, softcap=True, causal=False),
                     dict(softcap=True, causal=False), dict(local=True), dict(deterministic=True, gqa=True, varlen=True),
                     dict(gqa=True, varlen=True, causal=False), dict(deterministic=True, local=True, causal=False)]


def backward_jobs():
    for name in registry.available_kernels(registry.BACKWARD):
        spec = registry.get(name)
        for d in spec.head_dims:
            for causal in (False, True):
                yield f"{name} d{d} causal={causal}", builders._build_backward, (spec, BF16, d, causal), {}
            for variant in BACKWARD_VARIANTS:
                kw = dict(variant)
                causal = kw.pop("causal", True)
                yield f"{name} d{d} causal={causal} {kw}", builders._build_backward, (spec, BF16, d, causal), kw
            if name != "b1":
                for varlen in (False, True):
                    yield (f"post {name} d{d} varlen={varlen}", builders._build_postprocess,
                           (spec, BF16, d, varlen), {})
        for d, dv in spec.value_head_dims:
            for kw in (dict(), dict(deterministic=True), dict(gqa=True), dict(gqa=True, varlen=True)):
                yield (f"{name} d{d} dv{dv} causal=True {kw}", builders._build_backward, (spec, BF16, d, True),
                       dict(head_dim_v=dv, **kw))
    for head_dim, head_dim_v, layout in [(64, None, ()), (96, None, ()), (128, None, ()), (256, None, ()),
                                         (192, 128, ()), (128, 64, ()), (64, None, (True, 128, True)),
                                         (256, None, (True, 64, True)), (128, None, (True, 64, False)),
                                         (128, None, (True, 64, True)), (192, None, (True, 64, True))]:
        yield (f"pre d{head_dim} dv{head_dim_v} {layout}", builders._build_preprocess,
               (BF16, head_dim, head_dim_v, *layout), {})


def jobs():
    yield from forward_jobs()
    yield from cache_jobs()
    yield from gemm_jobs()
    yield from backward_jobs()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="a regular expression: the configurations whose label matches")
    parser.add_argument("--list", action="store_true", help="print the labels only")
    parser.add_argument("--save", help="write `label | hash` lines here")
    parser.add_argument("--compare", help="compare against a file --save wrote; exit 1 if any differs")
    args = parser.parse_args(argv)
    selected = [job for job in jobs() if not args.only or re.search(args.only, job[0])]
    if args.list:
        print("\n".join(label for label, *_ in selected))
        return 0
    dsl.pin_target_arch()  # sm_90a unless CUTE_DSL_ARCH says otherwise (the builders bypass the caches)
    before = {}
    if args.compare:
        for line in open(args.compare):
            label, _, digest = line.rstrip("\n").rpartition(" | ")
            before[label] = digest
    lines, differ = [], 0
    here = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="fa3-ptx-"))
    try:
        for i, (label, build, build_args, kwargs) in enumerate(selected):
            try:
                digest = ptx_hash(build, build_args, kwargs)
            except Exception as exc:  # a configuration that no longer compiles is a difference too
                digest = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            lines.append(f"{label} | {digest}")
            mark = ""
            if args.compare:
                mark = "  (new)" if label not in before else "" if before[label] == digest else "  DIFFERS"
                differ += bool(mark)
            print(f"[{i + 1}/{len(selected)}] {label} | {digest}{mark}", flush=True)
    finally:
        os.chdir(here)
    if args.save:
        with open(args.save, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.compare:
        print(f"{len(selected) - differ} of {len(selected)} configurations identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
