"""Host cost of a call for small problems, fa3 beside its peers; and a fresh process's first call.

    python benchmarks/bench_overhead.py [--calls 2000] [--no-first-call] [--json FILE]

Per-call (small attention problems, a forward and backward, one decode step over a dense cache,
small GEMMs): wall microseconds per call of back-to-back calls (perf_counter around --calls calls,
then one synchronize; best of three rounds), beside the GPU's own time per call (20 calls captured in a
CUDA graph and replayed: no host in the way). Where wall > GPU the host is the bottleneck, and the
wall time is what it spends: validation, allocation and launch. A breakdown of fa3.attention's
host path follows (validation, the direct-call check, allocation, the compiled kernel's own call), and
one of a decode step's (fa3.attention's route to the KV-cache kernel, the cache call's checks, its
four allocations, the S1 and combine calls alone). Runners: fa3.attention (eager, the default rung), the same into a
preallocated out=, torch.ops.fa3.attention (through the dispatcher, as compiled graphs call it),
SDPA forced to flash and to cuDNN, flash-attn-4 (flash_attn.cute.flash_attn_func) when it imports;
fa3.gemm beside torch.matmul.

First call: benchmarks/first_call.py in a fresh process with an empty disk cache (it compiles),
then again with the cache it filled (it loads), in a temporary FA3_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_attention import peer_runners
from timing import format_table, median_ms, progress, write_json

import torch

import fa3
from fa3 import _checks, _dispatch, _launch, interface, kvcache, masking, registry
from fa3.compile import builders as _compile, kvcache as _compile_kvcache
from fa3.cache import checks as kvcache_checks

# (batch, seqlen, heads, head_dim, causal): the first is the shape the overhead issue measured
ATTENTION_SHAPES = [(1, 128, 16, 128, False), (1, 128, 16, 128, True)]
GEMM_SHAPES = [(128, 1024, 1024), (1024, 4096, 1024)]  # M, N, K
# (batch, seqlen, heads, head_dim, causal): a forward and backward (torch.autograd.grad), whose
# host part is the backward's checks, allocations and launches on top of the forward's
TRAIN_SHAPES = [(1, 128, 16, 128, True)]
# (batch, keys, heads_q, heads_kv, head_dim): one decode step, dense cache
DECODE_SHAPES = [(1, 16384, 32, 8, 128)]  # K and V 64 MiB: fa3.attention takes the KV-cache kernel
HERE = os.path.dirname(os.path.abspath(__file__))


def wall_us(fn, calls: int, rounds: int = 3) -> float:
    """Best over `rounds` of the wall microseconds per call of `calls` back-to-back calls."""
    fn()
    for _ in range(min(100, calls // 10)):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def graph_us(fn, calls: int = 20) -> float | None:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph, replayed (None if the
    runner cannot be captured). Warmed up on the stream that captures, as torch's whole-network
    capture does: a training step's backward otherwise meets the leaves' gradient nodes, made on
    the default stream, and waits on that stream mid-capture, which fails the capture."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(calls):
                fn()
        return median_ms(graph.replay) * 1e3 / calls
    except Exception as exc:
        progress(f"    (no CUDA graph: {type(exc).__name__}: {str(exc)[:100]})")
        return None


def attention_runners(q, k, v, causal):
    """(name, context, call) for each runner of one attention problem."""
    rung = registry.fastest(registry.ATTENTION, q.shape[3]).name
    out = torch.empty_like(q)
    scale = q.shape[3] ** -0.5
    runners = [
        ("fa3.attention", None, lambda: fa3.attention(q, k, v, causal=causal)),
        ("fa3.attention out=", None, lambda: fa3.attention(q, k, v, causal=causal, out=out)),
        ("torch.ops.fa3.attention", None, lambda: torch.ops.fa3.attention(q, k, v, causal, scale, rung)),
    ]
    peers, notes = peer_runners(("sdpa-flash", "sdpa-cudnn", "fa4"))
    runners += [(p.name, p.context, p.make(q, k, v, causal)) for p in peers]
    return runners, notes


def train_runners(q, k, v, causal):
    """(name, context, call): one forward and backward of fa3.attention, and of SDPA's flash and
    cuDNN backends (gradients by torch.autograd.grad: nothing accumulates between calls). Each
    call takes fresh leaves (aliases of the same data): a leaf's gradient node is made on the stream
    of its first backward, and one made outside a CUDA graph's capture stream fails the capture."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dout = torch.randn_like(q)
    dout_t = dout.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def leaves():
        return tuple(t.detach().requires_grad_() for t in (q, k, v))

    def fa3_step():
        qg, kg, vg = leaves()
        return torch.autograd.grad(fa3.attention(qg, kg, vg, causal=causal), (qg, kg, vg), dout)

    def sdpa_step():
        qg, kg, vg = leaves()
        out = sdpa(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=causal)
        return torch.autograd.grad(out, (qg, kg, vg), dout_t)
    return [("fa3.attention + backward", None, fa3_step),
            ("sdpa-flash + backward", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION), sdpa_step),
            ("sdpa-cudnn + backward", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION), sdpa_step)]


def decode_runners(batch, keys, heads_q, heads_kv, head_dim, gen):
    """One decode step over a dense cache: fa3.attention (a forward-only decode step goes to the
    KV-cache kernel), attention_with_kvcache with the lengths as a tensor (an eager call checks
    their values once per tensor object: the model's layers share them) and as an int (checked on
    the host), and SDPA (its default backend) beside."""
    q = torch.randn(batch, 1, heads_q, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, keys, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return [
        ("fa3.attention", None, lambda: fa3.attention(q, k, v, causal=True)),
        ("attention_with_kvcache", None, lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                            causal=True)),
        ("attention_with_kvcache int", None, lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=keys,
                                                                                causal=True)),
        ("sdpa", None, lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)),
    ]


def measure_row(label: str, runners, calls: int) -> list[dict]:
    rows = []
    for name, context, call in runners:
        try:
            with context() if context else contextlib.nullcontext():
                wall = wall_us(call, calls)
                gpu = graph_us(call)
        except Exception as exc:  # a peer that does not support this problem
            progress(f"  {label:<28} {name:<24} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        rows.append({"problem": label, "runner": name, "wall_us": wall, "gpu_us": gpu})
        progress(f"  {label:<28} {name:<24} {wall:8.1f} us wall   {gpu or float('nan'):8.1f} us GPU")
    return rows


def per_call(calls: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, seqlen, heads, head_dim, causal in ATTENTION_SHAPES:
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(3))
        runners, notes = attention_runners(q, k, v, causal)
        for note in notes:
            progress(f"  {note}")
        label = f"attn b{batch} s{seqlen} h{heads} d{head_dim}{' causal' if causal else ''}"
        rows += measure_row(label, runners, calls)
    for batch, seqlen, heads, head_dim, causal in TRAIN_SHAPES:
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(3))
        label = f"train b{batch} s{seqlen} h{heads} d{head_dim}{' causal' if causal else ''}"
        rows += measure_row(label, train_runners(q, k, v, causal), calls)
    for batch, keys, heads_q, heads_kv, head_dim in DECODE_SHAPES:
        rows += measure_row(f"decode b{batch} x {keys} {heads_q}/{heads_kv} d{head_dim}",
                            decode_runners(batch, keys, heads_q, heads_kv, head_dim, gen), calls)
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        runners = [("fa3.gemm", None, lambda: fa3.gemm(a, b)),
                   ("fa3.gemm out=", None, lambda: fa3.gemm(a, b, out=out)),
                   ("torch.matmul", None, lambda: torch.matmul(a, b))]
        rows += measure_row(f"gemm {m}x{n}x{k}", runners, calls)
    return rows


def breakdown(calls: int) -> list[dict]:
    """Where fa3.attention's host time goes, for the first attention problem: each piece timed
    alone, back to back (the kernel call with every argument prepared in advance)."""
    batch, seqlen, heads, head_dim, causal = ATTENTION_SHAPES[0]
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    spec = interface.check_attention(q, k, v, None)
    out, lse = interface.launch_attention(spec, q, k, v, causal, head_dim ** -0.5)
    fn = _compile.get_attention(spec, q.dtype, head_dim, causal)
    args = [q, k, v, out, lse, head_dim ** -0.5 * masking.LOG2E]
    if spec.persistent:
        args += [_checks.HOPPER_SMS[q.device], _launch.tile_counter(spec, causal, q.device)]
    if spec.variants:  # (_launch.run_attention's order) cu_seqlens stand-ins, window, softcap, sinks
        args += [_launch.stand_in(q.device)] * 2 + [0, 0, 1.0, _launch.stand_in(q.device, torch.float32)]
    pieces = [
        ("fa3.attention, all of it", lambda: fa3.attention(q, k, v, causal=causal)),
        ("validation (check_attention)", lambda: interface.check_attention(q, k, v, None)),
        ("direct_call_ok", lambda: _dispatch.direct_call_ok(q, k, v)),
        ("allocate out and lse", lambda: (torch.empty_like(q), torch.empty(batch, heads, seqlen, device="cuda"))),
        ("launch_attention (allocates lse)", lambda: interface.launch_attention(spec, q, k, v, causal, 0.1, out)),
        ("compiled kernel call alone", lambda: fn(*args)),
    ]
    return time_pieces(pieces, calls)


def time_pieces(pieces, calls: int) -> list[dict]:
    """Wall microseconds per call of each (name, call), back to back, printed as they come."""
    rows = []
    for name, call in pieces:
        us = wall_us(call, calls)
        rows.append({"piece": name, "wall_us": us})
        progress(f"  {name:<40} {us:8.2f} us")
    return rows


def recorded_launches(getters, call) -> dict:
    """{getter: (compiled kernel, its arguments)} of the kernels one `call` launches through
    _compile_kvcache.<getter> for each of `getters` (the arguments as that call prepared them)."""
    real, recorded = {g: getattr(_compile_kvcache, g) for g in getters}, {}

    def recording(getter):
        def get(*args, **kwargs):
            fn = real[getter](*args, **kwargs)
            return lambda *launch_args: (recorded.setdefault(getter, (fn, launch_args)), fn(*launch_args))
        return get

    for getter in getters:
        setattr(_compile_kvcache, getter, recording(getter))
    kvcache._CACHE_CALLS.clear()  # the call plans afresh (a remembered plan holds its kernels already)
    try:
        call()
    finally:
        for getter in getters:
            setattr(_compile_kvcache, getter, real[getter])
    return recorded


def decode_breakdown(calls: int) -> list[dict]:
    """Where a decode step's host time goes (the first decode problem, fa3.attention's route and the
    cache call with tensor lengths): each piece timed alone, back to back; the kernels' calls with
    their arguments as the call prepared them."""
    batch, keys, heads_q, heads_kv, head_dim = DECODE_SHAPES[0]
    q = torch.randn(batch, 1, heads_q, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, keys, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    step = lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)
    (s1, s1_args), = recorded_launches(("get_kvcache",), step).values()  # S1 and the combine: one call
    splits = s1_args[7].shape[0]
    pieces = [
        ("fa3.attention (routed to S1)", lambda: fa3.attention(q, k, v, causal=True)),
        ("validation (check_attention)", lambda: interface.check_attention(q, k, v, None)),
        ("decodes_over_keys", lambda: kvcache.decodes_over_keys(q, k, v)),
        ("attention_with_kvcache, all of it", step),
        ("check_kvcache", lambda: kvcache_checks.check_kvcache(q, k, v, None, None, lengths, None, None, (-1, -1),
                                                               0.0)),
        ("four allocations (out, lse, partials)", lambda: (
            torch.empty_like(q), torch.empty(batch, heads_q, 1, device="cuda"),
            torch.empty(splits, batch, 1, heads_q, head_dim, device="cuda"),
            torch.empty(splits, batch, heads_q, 1, device="cuda"))),
        (f"S1 and combine call alone ({len(s1_args)} arguments)", lambda: s1(*s1_args)),
    ]
    return time_pieces(pieces, calls)


def first_calls() -> list[dict]:
    """first_call.py in fresh processes: an empty disk cache, then the one it filled."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="fa3-bench-cache-") as cache:
        env = {**os.environ, "FA3_CACHE_DIR": cache}
        env.pop("FA3_DISK_CACHE", None)
        for label in ("empty disk cache", "warm disk cache"):
            proc = subprocess.run([sys.executable, os.path.join(HERE, "first_call.py"), "--head-dim", "128"],
                                  env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                progress(f"  first call, {label}: FAILED\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                break
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"cache": label, **report})
            progress(f"  first call, {label:<17} import {report['import_s']:.2f} s   attention "
                     f"{report['attention_first_s']:.3f} s (then {report['attention_second_s'] * 1e3:.2f} ms)"
                     f"   gemm {report['gemm_first_s']:.3f} s   compiled {report['compiled'] or 'nothing'}"
                     f"   cutlass imported: {report['cutlass_imported']}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--no-first-call", action="store_true", help="skip the fresh-process timings")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    progress(f"{torch.cuda.get_device_name()}: wall time per call of {args.calls} back-to-back calls")
    rows = per_call(args.calls)
    print(format_table(["problem", "runner", "wall us", "GPU us"],
                       [[r["problem"], r["runner"], r["wall_us"], r["gpu_us"]] for r in rows]))
    progress("fa3.attention's host path, piece by piece:")
    pieces = breakdown(args.calls)
    progress(f"a decode step's host path, piece by piece ({DECODE_SHAPES[0]}):")
    pieces += decode_breakdown(args.calls)
    cold = [] if args.no_first_call else first_calls()
    if cold:
        print(format_table(["first call with", "import s", "attention s", "gemm s", "compiled"],
                           [[r["cache"], r["import_s"], r["attention_first_s"], r["gemm_first_s"],
                             ",".join(r["compiled"]) or "-"] for r in cold]))
    if args.json:
        write_json(args.json, {"per_call": rows, "breakdown": pieces, "first_call": cold})
    return 0


if __name__ == "__main__":
    sys.exit(main())
