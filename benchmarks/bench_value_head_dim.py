"""v's head dim other than q's and k's ((192, 128): DeepSeek-style MLA prefill; (128, 64)): forward and
backward TFLOP/s of fa3's default rungs, an explicit backward rung (--kernels), and the peers that
take the pair, in the FlashAttention-3 paper's setting (16k tokens, 2048 / d heads).

    python benchmarks/bench_value_head_dim.py --pairs 192:128,128:64 --seqlens 2048,8192 \
        --kernels b2 --peers sdpa-cudnn,fa4 --rounds 2

FLOPs are counted per GEMM: the forward 2 sq sk (d + dv) per head (Q K^T and P V), the backward
2 sq sk (3 d + 2 dv) (S again, dP, dV, dK, dQ), halved for causal. A peer that refuses the pair is
reported and skipped. --rounds N: bench_attention's alternating rounds (each runner's median), so
columns do not depend on their order.
"""

from __future__ import annotations

import argparse

import torch

import fa3
from bench_attention import Runner, alternating_rounds, as_backward, paper_shape, peer_runners
from fa3.timing import tflops
from timing import format_table, measure, progress


def pair_flops(batch, heads, seqlen, d, dv, causal, backward):
    per = 2.0 * (3 * d + 2 * dv if backward else d + dv)
    flops = per * batch * heads * seqlen * seqlen
    return flops / 2 if causal else flops


def fa3_runner(name: str, backward_kernel: str | None = None) -> Runner:
    def make(q, k, v, causal):
        return lambda: fa3.attention(q, k, v, causal=causal, backward_kernel=backward_kernel)

    return Runner(name, True, make)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="192:128,128:64", help="comma list of d:dv")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--kernels", default="", help="backward rungs timed beside the default (e.g. b2)")
    ap.add_argument("--peers", default="sdpa-cudnn,fa4")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    peers, notes = peer_runners([p for p in args.peers.split(",") if p and p != "none"])
    for note in notes:
        print(note)
    extra = [k for k in args.kernels.split(",") if k]
    print(f"{torch.cuda.get_device_name()}; 16384 tokens, hidden 2048, bf16; TFLOP/s (median of CUDA-event times)")
    rows = []
    for d, dv in pairs:
        for seqlen in seqlens:
            batch, heads = paper_shape(seqlen, d)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
            v = torch.randn(batch, seqlen, heads, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
            for causal in causals:
                for backward in (False, True):
                    runners = [fa3_runner("fa3")] + ([fa3_runner(f"fa3 {name}", name) for name in extra] if backward else [])
                    runners = [as_backward(r) if backward else r for r in runners + peers]
                    label = f"({d},{dv}) s{seqlen} {'causal' if causal else 'full'} {'bwd' if backward else 'fwd'}"
                    flops = pair_flops(batch, heads, seqlen, d, dv, causal, backward)

                    def time_one(r, rnd):
                        try:
                            with r.context():
                                ms = measure(r.make(q, k, v, causal))
                        except Exception as exc:  # a peer that refuses the pair
                            progress(f"{label} {r.name}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
                            return type(exc).__name__
                        progress(f"{label} {r.name:14s} {ms:8.3f} ms {tflops(flops, ms):7.1f} TFLOP/s  "
                                 f"(round {rnd + 1}/{args.rounds})")
                        return ms

                    medians, _ = alternating_rounds(runners, args.rounds, time_one)
                    for r in runners:
                        if r.name in medians:
                            rows.append([f"({d}, {dv})", seqlen, "causal" if causal else "full",
                                         "bwd" if backward else "fwd", r.name,
                                         f"{tflops(flops, medians[r.name]):.1f}"])
    print(format_table(["d, dv", "seqlen", "mask", "pass", "runner", "TFLOP/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
