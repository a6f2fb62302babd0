"""Run one attention forward per runner, bracketed for Nsight Compute, in bench_attention's setting.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python benchmarks/profile_forward.py --runners k5.3,k5.4,fa4 --head-dim 128 --seqlen 8192

Each runner is warmed up (compiled) first, then called once between cudaProfilerStart/Stop, so
ncu sees exactly one forward kernel launch per runner (and no compile or warm-up launches).
"""

from __future__ import annotations

import argparse

import torch

from bench_attention import make_inputs, paper_shape, peer_runners, rung_runner
from fa3 import registry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", default="k5.4,fa4", help="fa3 rungs and peers (sdpa-cudnn, fa4, ...)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    names = args.runners.split(",")
    peers, notes = peer_runners([n for n in names if n not in registry.KERNELS])
    runners = [rung_runner(n) for n in names if n in registry.KERNELS] + peers
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
        print(f"profiled {runner.name}: d={args.head_dim} seqlen={args.seqlen} causal={args.causal} "
              f"batch={batch} heads={heads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
