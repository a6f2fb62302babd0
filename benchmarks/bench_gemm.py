"""GEMM throughput of fa3's rungs beside torch.matmul (cuBLAS), measured in the same run.

C = A B with A (M, K), B (K, N) row-major from torch.randn, bf16 by default, FP32 accumulation.
TFLOP/s = 2 M N K / t, t the median of CUDA-event times after warm-up of calls replayed from a CUDA
graph (the GPU's time: a small GEMM takes less than its host overhead, which eager timing would
measure instead; --eager times eager calls); both sides write into a preallocated output. Every
runner is timed --rounds times per shape in rotating order and its median round is reported
(single rounds of an 8192^3 GEMM varied by up to 10% on one H100). The table gives each rung's
ratio to cuBLAS per shape.

    python benchmarks/bench_gemm.py [--kernels all|g1,g2,g3] [--shapes 4096x4096x4096,...]
        [--dtype bf16|fp16|fp8] [--scales tensor|row] [--rounds 3] [--eager] [--json FILE]
    python benchmarks/bench_gemm.py --shapes models     the model shape set (MODEL_SHAPES)
    python benchmarks/bench_gemm.py --sweep [--shapes ...]

--dtype fp8: A and B quantized per tensor to e4m3 (fa3.quantize_fp8), B column-major (the
transpose of a row-major (N, K) weight, as torch._scaled_mm needs), C bf16 = scale_a * scale_b *
(A B); the peers are torch._scaled_mm with the same scales, as it defaults (scaled_mm) and with
use_fast_accum=True (scaled_mm_fast: no periodic promotion of the FP32 partial sums, as fa3's
kernel), and the ratios are taken to the faster of the two.

Shapes are M x N x K. --sweep times g3's kernel at every tile M x N x K-depth x stages of SWEEP
(stages 0: as many as fit) on each shape and prints one table: the SMEM each takes, µs per call,
and cuBLAS's time over it in the same run; it is the evidence behind the tile heuristic in fa3.matmul.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from timing import MAX_CALL_S, TooSlow, format_table, measure, measure_gpu, progress, tflops, write_json

import torch

import fa3
from fa3 import matmul, registry

DEFAULT_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (16384, 2048, 8192),
                  (1000, 3000, 520))
# --shapes models: the projections of Llama-3-8B/70B-shaped models (N, K) at decode to prefill M
MODEL_SHAPES = tuple((m, n, k) for m in (1, 16, 64, 128, 512, 2048, 8192, 16384)
                     for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
                                  (28672, 8192), (8192, 28672))) + ((4096, 4096, 4096), (8192, 8192, 8192))
CUBLAS = "cublas"
FP8 = torch.float8_e4m3fn
SCALED_MM, SCALED_MM_FAST = "scaled_mm", "scaled_mm_fast"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}


def peers(dtype) -> list[str]:
    """The cuBLAS runners of a dtype: the ratios are taken to the fastest of them per shape."""
    return [SCALED_MM, SCALED_MM_FAST] if dtype == FP8 else [CUBLAS]


def operands(m, n, k, dtype, row_scales=False):
    """(a, b, out, scales) from torch.randn: FP8 quantized per tensor (row_scales: per row of A
    and per column of B, torch._scaled_mm's row-wise form), B column-major, C bf16."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    if dtype != FP8:
        a = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
        b = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen)
        return a, b, torch.empty(m, n, device="cuda", dtype=dtype), (None, None)
    x, w = (torch.randn(rows, k, device="cuda", generator=gen) for rows in (m, n))
    if row_scales:
        scale_a, scale_b = (t.abs().amax(1, keepdim=True).clamp(min=1e-6) / 448 for t in (x, w))
        a, w = (x / scale_a).to(FP8), (w / scale_b).to(FP8)
        scale_b = scale_b.t()
    else:
        (a, scale_a), (w, scale_b) = fa3.quantize_fp8(x), fa3.quantize_fp8(w)
    return a, w.t(), torch.empty(m, n, device="cuda", dtype=torch.bfloat16), (scale_a, scale_b)


def rung_call(name):
    def make(a, b, out, scales):
        if scales[0] is None:
            return lambda: fa3.gemm(a, b, out=out, kernel=name)
        return lambda: fa3.gemm(a, b, out=out, kernel=name, scale_a=scales[0], scale_b=scales[1])
    return make


def cublas_call(a, b, out, scales):
    return lambda: torch.matmul(a, b, out=out)


def scaled_mm_call(fast: bool):
    def make(a, b, out, scales):
        return lambda: torch._scaled_mm(a, b, scale_a=scales[0], scale_b=scales[1], out_dtype=out.dtype,
                                        use_fast_accum=fast, out=out)
    return make


def runners(kernels, dtype):
    """name -> make(a, b, out, scales), which returns the call to time."""
    cublas = {SCALED_MM: scaled_mm_call(False), SCALED_MM_FAST: scaled_mm_call(True)} if dtype == FP8 \
        else {CUBLAS: cublas_call}
    return {**{name: rung_call(name) for name in kernels}, **cublas}


def sweep(shapes, kernels, dtype, *, rounds, warmup, repeats, max_call_s, timer=measure_gpu,
          row_scales=False) -> list[dict]:
    """Each shape is timed `rounds` times for every runner, the runners' order rotating from round
    to round (so clock and thermal drift hit each alike); a runner's result is its median round."""
    rows = []
    for m, n, k in shapes:
        a, b, out, scales = operands(m, n, k, dtype, row_scales)
        flops, label = 2.0 * m * n * k, f"{m}x{n}x{k}"
        calls = runners(kernels, dtype)
        times = {name: [] for name in calls}
        skipped = {}
        for r in range(rounds):
            order = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
            for name in order:
                if name in skipped:
                    continue
                try:
                    ms = timer(calls[name](a, b, out, scales), warmup=warmup, repeats=repeats,
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


# (tile_m, tile_n, tile_k, stages): 64-row tiles run on one MMA warpgroup, 128-row on two
SWEEP = tuple((tm, tn, tk, st) for tm, tn in ((64, 32), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128), (128, 256))
              for tk, st in ((64, 0), (128, 0)) if not (tm == 128 and tn == 256 and tk == 128)) \
    + ((128, 256, 64, 2), (128, 256, 64, 3))
SWEEP_SHAPES = tuple((m, n, k) for m in (1, 64, 128, 512, 2048) for n, k in ((4096, 4096), (4096, 14336))) \
    + ((1, 14336, 4096), (16, 128256, 4096), (8192, 8192, 8192))


def tile_config(tile_m, tile_n, tile_k, stages) -> tuple:
    """g3 config overrides for one sweep point (fa3.compile.builders.get_gemm's `tiles`)."""
    return matmul.tile_overrides(tile_m, tile_n) + (("tile_k", tile_k), ("stages", stages))


def sweep_tiles(shapes, dtype, *, warmup, repeats, max_call_s) -> tuple[list, list]:
    """(headers, rows): one row per sweep point, TFLOP/s per shape, then the cuBLAS row."""
    from fa3.compile import builders as _compile, signatures as _signatures
    from fa3.kernels.config import gemm_config
    from fa3.kernels.gemm import PersistentGemm

    spec = registry.get("g3")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counters, no_workspace = matmul.SPLIT_BUFFERS.get(torch.device("cuda", 0), sms)  # no split-K here
    if dtype == FP8:
        raise SystemExit("--sweep times the 16-bit kernel: pass --dtype bf16 or fp16")
    inputs = [operands(m, n, k, dtype)[:3] for m, n, k in shapes]
    stand_in = torch.ones(1, device="cuda")
    cublas = [measure_gpu(cublas_call(a, b, c, None), warmup=warmup, repeats=repeats, max_call_s=max_call_s)
              for a, b, c in inputs]
    rows = []
    for point in SWEEP:
        tiles = tile_config(*point)
        model = PersistentGemm(_signatures.cute_dtype(dtype), gemm_config(spec.config, tiles))
        smem_kb = model.stages * (point[0] + point[1]) * point[2] * 2 / 1024
        fn = _compile.get_gemm(spec, dtype, "row", "row", tiles)
        rates = []
        for (m, n, k), (a, b, c), base in zip(shapes, inputs, cublas):
            ms = measure_gpu(lambda: fn(a, b, c, sms, no_workspace, counters, 1, stand_in, stand_in),
                             warmup=warmup, repeats=repeats, max_call_s=max_call_s)
            rates.append(f"{ms * 1e3:.1f} ({base / ms:.2f})")
        progress(f"{point}: {model.stages} stages, {smem_kb:.0f} KB ring: {'  '.join(rates)}")
        rows.append([f"{point[0]}x{point[1]}x{point[2]}", model.stages, f"{smem_kb:.0f}", *rates])
    rows.append(["cuBLAS", "-", "-", *(f"{ms * 1e3:.1f}" for ms in cublas)])
    headers = ["tile MxNxK", "stages", "ring KB", *(f"{m}x{n}x{k}" for m, n, k in shapes)]
    return headers, rows


def _best_peer(row, cublas) -> float | None:
    rates = [row["results"].get(p, {}).get("tflops") for p in cublas]
    return max((r for r in rates if r), default=None)


def table(rows, kernels, cublas=(CUBLAS,)) -> str:
    headers = ["M x N x K", *kernels, *cublas, *(f"{k}/cuBLAS" for k in kernels)]
    body = []
    for row in rows:
        rate = {name: row["results"].get(name, {}).get("tflops") for name in [*kernels, *cublas]}
        best = _best_peer(row, cublas)
        ratios = [f"{rate[k] / best:.2f}" if rate[k] and best else None for k in kernels]
        body.append([f"{row['m']}x{row['n']}x{row['k']}", *(rate[k] for k in [*kernels, *cublas]), *ratios])
    return format_table(headers, body)


def summary(rows, kernels, cublas=(CUBLAS,)) -> str:
    """Each rung's geometric mean and minimum ratio to cuBLAS (the fastest of `cublas` per shape)
    over the shapes both ran."""
    lines = []
    for name in kernels:
        ratios = {f"{row['m']}x{row['n']}x{row['k']}": row["results"][name]["tflops"] / _best_peer(row, cublas)
                  for row in rows if "tflops" in row["results"].get(name, {}) and _best_peer(row, cublas)}
        if ratios:
            geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
            worst = min(ratios, key=ratios.get)
            lines.append(f"{name}/cuBLAS over {len(ratios)} shapes: geometric mean {geomean:.3f}, minimum "
                         f"{ratios[worst]:.2f} ({worst}), {sum(r < 0.9 for r in ratios.values())} below 0.9")
    return "\n".join(lines)


def _shape(s: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in s.lower().split("x"))
    return m, n, k


def parse_args(argv=None):
    rungs = registry.available_kernels(registry.GEMM)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="all", help=f"'all' or a comma list of {','.join(rungs)}")
    p.add_argument("--shapes", type=lambda s: list(MODEL_SHAPES) if s == "models" else
                   [_shape(x) for x in s.split(",") if x],
                   default=list(DEFAULT_SHAPES), help="comma list of MxNxK, or 'models' (MODEL_SHAPES)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--scales", choices=("tensor", "row"), default="tensor",
                   help="fp8: one scale per operand, or per row of A and column of B (row-wise)")
    p.add_argument("--json", metavar="FILE", help="also write every measurement here")
    p.add_argument("--rounds", type=int, default=3, help="timings per runner and shape, order rotated")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--max-call-s", type=float, default=MAX_CALL_S)
    p.add_argument("--eager", action="store_true",
                   help="time eager calls (host overhead included where it exceeds the GPU time)")
    p.add_argument("--sweep", action="store_true",
                   help="time g3 at every tile shape x K depth x stages of SWEEP (default shapes: SWEEP_SHAPES)")
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
    timing = "eager calls" if args.eager else "calls replayed from a CUDA graph (no host overhead)"
    progress(f"{torch.cuda.get_device_name()}; {args.dtype}; TFLOP/s = 2MNK / median CUDA-event time of {timing}")
    if args.sweep:
        shapes = args.shapes if args.shapes != list(DEFAULT_SHAPES) else list(SWEEP_SHAPES)
        progress("cells: µs per call (cuBLAS's time / this one, same run)")
        headers, rows = sweep_tiles(shapes, DTYPES[args.dtype], warmup=args.warmup, repeats=args.repeats,
                                    max_call_s=args.max_call_s)
        print()
        print(format_table(headers, rows))
        if args.json:
            write_json(args.json, {"setting": {"dtype": args.dtype, "sweep": True}, "headers": headers,
                                   "rows": rows})
        return 0
    rows = sweep(args.shapes, args.kernels, DTYPES[args.dtype], rounds=args.rounds, warmup=args.warmup,
                 repeats=args.repeats, max_call_s=args.max_call_s, timer=measure if args.eager else measure_gpu,
                 row_scales=args.scales == "row")
    print()
    print(table(rows, args.kernels, peers(DTYPES[args.dtype])))
    print(summary(rows, args.kernels, peers(DTYPES[args.dtype])))
    if args.json:
        layout = "row-major A, column-major B" if args.dtype == "fp8" else "row-major A and B"
        write_json(args.json, {"setting": {"dtype": args.dtype, "layout": layout, "scales": args.scales},
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
