"""The backward of a packed batch against the fixed-length backward on the same tokens.

    python benchmarks/bench_varlen_backward.py [--head-dims 64,128,256] [--tokens 16384]
        [--kernels b7,b7p --variant b7p=b7:prefetch_stats=1]

For each head dim and causal or not: `batch` sequences of `tokens / batch` tokens each, run once
through fa3.attention (batch, seqlen, heads, d) and once packed through fa3.attention_varlen
(cu_seqlens of equal steps): the same work, so the ratio of the two backward times is what the
packed path costs (issue goal: varlen >= 0.95x fixed). A third row packs sequences of random
lengths (same total) to show what ragged batches cost. Backward only is timed: the gradients
of a saved forward, with torch.autograd.grad and a fixed dO (bf16, 16 heads, torch.randn data).
"""

from __future__ import annotations

import argparse
import sys

import torch

import variants
from timing import attention_flops, format_table, measure, progress, tflops

import fa3

HEADS = 16


def backward_timer(forward, inputs):
    out = forward(*inputs)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def compare(d, causal, kernel, tokens, batch):
    """Rows (fixed, packed of equal lengths, packed ragged) for one head dim, mask and rung."""
    seqlen = tokens // batch
    total = seqlen * batch
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q4, k4, v4 = (make(batch, seqlen, HEADS, d) for _ in range(3))
    fixed = backward_timer(lambda q, k, v: fa3.attention(q, k, v, causal=causal, backward_kernel=kernel),
                           (q4, k4, v4))
    q3, k3, v3 = (make(total, HEADS, d) for _ in range(3))
    equal = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(d)
    cuts = torch.randperm(total - 1, generator=gen)[:batch - 1].add(1).sort().values
    ragged = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32).cuda()
    cases = [("fixed", fixed, [seqlen] * batch)]
    for name, cu in (("varlen, equal", equal), ("varlen, ragged", ragged)):
        lengths = cu.diff().tolist()
        longest = max(lengths)
        fwd = lambda q, k, v, cu=cu, longest=longest: fa3.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=causal, backward_kernel=kernel)
        cases.append((name, backward_timer(fwd, (q3, k3, v3)), lengths))
    rows, base = [], None
    for name, fn, lengths in cases:
        ms = measure(fn)
        flops = 2.5 * sum(attention_flops(1, HEADS, n, n, d, causal) for n in lengths)
        base = base or ms
        rows.append([f"d{d}", "causal" if causal else "full", kernel or "default", name,
                     f"{ms * 1e3:.0f}", f"{tflops(flops, ms):.0f}", f"{base / ms:.3f}"])
        progress("  ".join(rows[-1]))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    variants.register_from_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kernels", default="",
                   help="backward rungs to time, comma-separated (default: the head dim's default)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                   help="an experiment row for --kernels (benchmarks/variants.py)")
    args = p.parse_args(argv)
    rows = []
    kernels = [name or None for name in args.kernels.split(",")]
    for d in map(int, args.head_dims.split(",")):
        for causal in (False, True):
            for kernel in kernels:
                rows.extend(compare(d, causal, kernel, args.tokens, args.batch))
    print(format_table(["head dim", "mask", "rung", "batch", "us", "TFLOP/s", "fixed / this (time)"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
