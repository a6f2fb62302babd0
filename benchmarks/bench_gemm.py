"""GEMM throughput of fa3's rungs beside torch.matmul (cuBLAS), measured in the same run.

C = A B with A (M, K), B (K, N) row-major from torch.randn, bf16 by default, FP32 accumulation.
TFLOP/s = 2 M N K / t, t the median of CUDA-event times after warm-up; both sides write into a
preallocated output. Every runner is timed --rounds times per shape in rotating order and its median
round is reported (single rounds of an 8192^3 GEMM varied by up to 10% on one H100). The table
gives each rung's ratio to cuBLAS per shape.

    python benchmarks/bench_gemm.py [--kernels all|g1,g2,g3] [--shapes 4096x4096x4096,...]
        [--dtype bf16|fp16] [--rounds 3] [--json FILE]

Shapes are M x N x K.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from timing import MAX_CALL_S, TooSlow, format_table, measure, progress, tflops, write_json

import torch

import fa3
from fa3 import registry

DEFAULT_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (16384, 2048, 8192),
                  (1000, 3000, 520))
CUBLAS = "cublas"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rung_call(name):
    def make(a, b, out):
        return lambda: fa3.gemm(a, b, out=out, kernel=name)
    return make


def cublas_call(a, b, out):
    return lambda: torch.matmul(a, b, out=out)


def runners(kernels):
    """name -> make(a, b, out), which returns the call to time."""
    return {**{name: rung_call(name) for name in kernels}, CUBLAS: cublas_call}


def sweep(shapes, kernels, dtype, *, rounds, warmup, repeats, max_call_s) -> list[dict]:
    """Each shape is timed `rounds` times for every runner, the runners' order rotating from round
    to round (so clock and thermal drift hit each alike); a runner's result is its median round."""
    rows = []
    for m, n, k in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
        b = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        flops, label = 2.0 * m * n * k, f"{m}x{n}x{k}"
        calls = runners(kernels)
        times = {name: [] for name in calls}
        skipped = {}
        for r in range(rounds):
            order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
            for name in order:
                if name in skipped:
                    continue
                try:
                    ms = measure(calls[name](a, b, out), warmup=warmup, repeats=repeats,
                                 max_call_s=max_call_s)
                except TooSlow as slow:
                    skipped[name] = f"one call took {slow.args[0] / 1e3:.1f} s"
                except Exception as exc:  # report and carry on with the other runners
                    skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                else:
                    times[name].append(ms)
                    progress(f"{label:<18} round {r + 1}  {name:<7} {ms:9.3f} ms {tflops(flops, ms):7.1f} TFLOP/s")
                    continue
                progress(f"{label:<18} {name:<7} skipped: {skipped[name]}")
        results = {}
        for name, t in times.items():
            ms = statistics.median(t) if t and name not in skipped else None
            results[name] = ({"ms": ms, "tflops": tflops(flops, ms), "rounds_ms": t} if ms
                             else {"skipped": skipped.get(name, "no timing")})
        rows.append({"m": m, "n": n, "k": k, "results": results})
        del a, b, out
    return rows


def table(rows, kernels) -> str:
    headers = ["M x N x K", *kernels, CUBLAS, *(f"{k}/cuBLAS" for k in kernels)]
    body = []
    for row in rows:
        rate = {name: row["results"].get(name, {}).get("tflops") for name in [*kernels, CUBLAS]}
        ratios = [f"{rate[k] / rate[CUBLAS]:.2f}" if rate[k] and rate[CUBLAS] else None for k in kernels]
        body.append([f"{row['m']}x{row['n']}x{row['k']}", *(rate[k] for k in kernels), rate[CUBLAS], *ratios])
    return format_table(headers, body)


def _shape(s: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in s.lower().split("x"))
    return m, n, k


def parse_args(argv=None):
    rungs = registry.available_kernels(registry.GEMM)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="all", help=f"'all' or a comma list of {','.join(rungs)}")
    p.add_argument("--shapes", type=lambda s: [_shape(x) for x in s.split(",") if x],
                   default=list(DEFAULT_SHAPES), help="comma list of MxNxK")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--json", metavar="FILE", help="also write every measurement here")
    p.add_argument("--rounds", type=int, default=3, help="timings per runner and shape, order rotated")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--max-call-s", type=float, default=MAX_CALL_S)
    args = p.parse_args(argv)
    args.kernels = rungs if args.kernels == "all" else [x for x in args.kernels.split(",") if x]
    unknown = [n for n in args.kernels if n not in rungs]
    if unknown:
        p.error(f"--kernels: {', '.join(unknown)} not GEMM rungs; choose from {', '.join(rungs)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU (a Hopper GPU for the fa3 rungs); none was found.")
        return 2
    progress(f"{torch.cuda.get_device_name()}; {args.dtype}; TFLOP/s = 2MNK / median CUDA-event time")
    rows = sweep(args.shapes, args.kernels, DTYPES[args.dtype], rounds=args.rounds, warmup=args.warmup,
                 repeats=args.repeats, max_call_s=args.max_call_s)
    print()
    print(table(rows, args.kernels))
    if args.json:
        write_json(args.json, {"setting": {"dtype": args.dtype, "layout": "row-major A and B"},
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
