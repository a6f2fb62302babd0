"""Run one attention forward (or backward) per runner, bracketed for Nsight Compute, in
bench_attention's setting.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python benchmarks/profile_kernels.py --runners k5.3,k5.4,fa4 --head-dim 128 --seqlen 8192
    ncu --clock-control none --profile-from-start off --section WarpStateStats \
        --section SourceCounters --import-source no -o bwd \
        python benchmarks/profile_kernels.py --backward --runners b4,fa4 --causal
    ncu -i bwd.ncu-rep --page source --csv --print-source sass > bwd.csv
    python benchmarks/sass_stalls.py bwd.csv     # stall samples per opcode, per kernel

Ranking variants (a few percent apart): lock the SM clock, where one kernel's cycles repeat to
0.1-0.5% (the benchmark's sustained clocks move 4-5% between identical kernels), and rank by
sm__cycles_active.avg: with several sections a kernel is replayed pass by pass and a section's
duration comes from whatever clock its pass ran at (worklog/backward.md):

    ncu --clock-control base --profile-from-start off --csv \
        --metrics gpu__time_duration.sum,sm__cycles_active.avg \
        python benchmarks/profile_kernels.py --backward --causal --runners b8,h0,fa4 \
        --variant h0=b8:head_groups=0

--deterministic runs the fa3 backward rungs with deterministic=True; FP8 rungs (f1, ...) run on
the inputs quantized as bench_attention --fp8 does.

Each runner is warmed up (compiled) first, then called once between cudaProfilerStart/Stop, so
ncu sees exactly one forward launch per runner (and no compile or warm-up launches). --backward:
the runners are backward rungs (b1, ...) and peers, each timed call torch.autograd.grad of q, k, v
(bench_attention's as_backward): the profiled range holds the backward's kernels (preprocess,
main kernel, postprocess; filter with ncu's --kernel-name).
"""

from __future__ import annotations

import argparse

import torch

import variants
from bench_attention import (as_backward, backward_rung_runner, fp8_runner, make_inputs, paper_shape, peer_runners,
                             rung_runner)
from fa3 import registry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", default="k5.4,fa4", help="fa3 rungs and peers (sdpa-cudnn, fa4, ...)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="profile the backward (runners: b1, ..., peers)")
    ap.add_argument("--deterministic", action="store_true", help="the fa3 backward rungs with deterministic=True")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                    help="an experiment row usable in --runners (benchmarks/variants.py)")
    args = ap.parse_args(argv)
    for text in args.variant:
        variants.register(text)
    names = args.runners.split(",")
    peers, notes = peer_runners([n for n in names if n not in registry.KERNELS])
    if args.backward:
        runners = [as_backward(r) for r in [backward_rung_runner(n, args.deterministic) for n in names
                                               if n in registry.KERNELS] + peers]
    else:
        runners = [fp8_runner(n) if registry.get(n).family == registry.ATTENTION_FP8 else rung_runner(n)
                   for n in names if n in registry.KERNELS] + peers
    for note in notes:
        print(note)
    batch, heads = paper_shape(args.seqlen, args.head_dim)
    q, k, v = make_inputs(batch, args.seqlen, heads, args.head_dim)
    for runner in runners:
        with runner.context():
            call = runner.make(q, k, v, args.causal)
            call()  # compile and warm up outside the profiled range
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {runner.name}{' backward' if args.backward else ''}: d={args.head_dim} seqlen={args.seqlen} causal={args.causal} "
              f"batch={batch} heads={heads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
