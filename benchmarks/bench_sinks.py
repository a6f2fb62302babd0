"""What attention sinks cost: fa3.attention with and without `sinks`, forward and backward
(d sinks included), timed in alternating rounds so that neither side runs on a GPU the other has
warmed (in bench_attention.py the '+sinks' column runs right after its plain twin, and at s = 8k
the backward's second column ran 10-12% slower for both fa3 and flash-attn-4, sinks or not).

    python benchmarks/bench_sinks.py [--head-dims 64,96,128,192,256] [--seqlen 8192] [--causal]

bf16, batch x seqlen = 16k tokens, heads = 2048 / d, one random float32 sink per query head; each
round times both calls in turn (the order flips every round), and the median of the rounds is
reported with the overhead (issue goal: <= 3%).
"""

from __future__ import annotations

import argparse

import torch

import fa3


def _ms(fn, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def measure(head_dim: int, seqlen: int, causal: bool, rounds: int) -> dict:
    batch, heads = max(1, 16384 // seqlen), max(1, 2048 // head_dim)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    sinks = torch.randn(heads, device="cuda", requires_grad=True)
    calls = {}
    for name, s in (("plain", None), ("sinks", sinks)):
        out = fa3.attention(q, k, v, causal=causal, sinks=s)
        dout = torch.randn_like(out)
        inputs = (q, k, v) if s is None else (q, k, v, s)
        calls[name] = {
            "forward": lambda s=s: fa3.attention(q.detach(), k.detach(), v.detach(), causal=causal,
                                                 sinks=None if s is None else s.detach()),
            "backward": lambda out=out, dout=dout, inputs=inputs: torch.autograd.grad(out, inputs, dout,
                                                                                      retain_graph=True),
        }
    times = {(n, p): [] for n in calls for p in ("forward", "backward")}
    for r in range(rounds):
        for name in (("plain", "sinks") if r % 2 == 0 else ("sinks", "plain")):
            for part in ("forward", "backward"):
                times[(name, part)].append(_ms(calls[name][part]))
    med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    return dict(batch=batch, heads=heads, **{f"{n}_{p}_ms": m for (n, p), m in med.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,96,128,192,256")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    print(f"{'d':>4} {'shape':>14}  {'fwd ms':>7} {'+sinks':>7} {'cost':>6}  {'bwd ms':>7} {'+sinks':>7} {'cost':>6}")
    for d in (int(x) for x in args.head_dims.split(",")):
        r = measure(d, args.seqlen, args.causal, args.rounds)
        fwd = r["sinks_forward_ms"] / r["plain_forward_ms"] - 1
        bwd = r["sinks_backward_ms"] / r["plain_backward_ms"] - 1
        print(f"{d:>4} {'b%d s%d h%d' % (r['batch'], args.seqlen, r['heads']):>14}  "
              f"{r['plain_forward_ms']:7.3f} {r['sinks_forward_ms']:7.3f} {100 * fwd:+5.1f}%  "
              f"{r['plain_backward_ms']:7.3f} {r['sinks_backward_ms']:7.3f} {100 * bwd:+5.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
