"""Attention forward throughput of fa3's rungs and their peers, in the FlashAttention-3 paper's setting.

16k tokens in all (batch = 16384 // seqlen), hidden size 2048 (heads = 2048 // head_dim), bf16,
q, k, v from torch.randn, seqlen_q = seqlen_k. TFLOP/s = 4 * batch * heads * seqlen^2 * head_dim / t,
halved for causal; t is the median of CUDA-event times after warm-up.

Peers: torch SDPA forced to its flash backend (sdpa-flash) and to its cuDNN backend (sdpa-cudnn),
and flash-attn 4's CuTe-DSL kernel (fa4: flash_attn.cute.flash_attn_func) when it is importable.

    python benchmarks/bench_attention.py [--kernels all|k1,k2,...] [--head-dims 64,128,256]
        [--seqlens 512,1024,...] [--causal both|true|false] [--peers sdpa-flash,sdpa-cudnn,fa4]
        [--json FILE] [--plot FILE.png] [--backward [--deterministic]] [--sinks] [--fp8] [--gqa G]
    python benchmarks/bench_attention.py --plot-from FILE.json --plot FILE.png   (no GPU needed)

--plot draws TFLOP/s against seqlen, one panel per (head dim, causal) (matplotlib, optional).

--rounds N times every shape's runners N times in turn, the order reversed every other round, each
keeping its median: a column timed right after a long one runs on a hotter GPU (at s8k a backward
column read 10-12% slower than its twin, fa3 and flash-attn-4 alike), so ratios between columns
want --rounds 2 or more.

--backward times the backward instead (torch.autograd.grad of q, k, v from a forward run once,
for every runner alike): TFLOP/s = 2.5 x the forward's FLOPs / t (five GEMMs against the forward's
two), --kernels then names backward rungs (b1, ...), and --deterministic adds each rung with
deterministic=True as a column of its own ("b1+det").

--gqa G gives k and v heads / G heads (grouped-query attention, as Llama-style models train; SDPA
with enable_gqa): the FLOPs are the query heads', so the rates compare with the plain table's.

--kernels default (alone or beside rungs) times what a user's call runs: kernel=None (forward) or
backward_kernel=None (backward), so the dispatch picks the rung per head dim, mask and
`deterministic` ("default+det" is the deterministic call's dispatch).

--variant NAME=BASE:key=value,... adds an experiment row: rung BASE with a configuration value or a
class attribute changed, named NAME for --kernels (benchmarks/variants.py).

--sinks adds each fa3 rung that takes attention sinks (and fa4, as `learnable_sink`) called with
one random float32 sink per query head, as a column of its own ("k5.5+sinks"): what sinks cost
against the same call without them (forward, or with --backward the backward, d sinks included).

--fp8 adds the FP8 forward rungs (family attention_fp8, e.g. f1) as columns of their own: the same
randn inputs quantized to e4m3 per (batch, kv head) with fa3.quantize_fp8 (outside the timing), bf16
output; the timed call is fa3.attention with the descales, so it includes the host's V transpose
(fa3.fp8.transpose_v). The "fp8/fa3" column is the best FP8 rung over the best bf16 rung. The peers
stay bf16: flash-attn 4 has no FP8 kernel for SM90 (its FP8 forward is SM100-only), and SDPA's
cuDNN and flash backends do not take float8 inputs.

Rungs that materialise scores (K1) skip sizes whose fp32 score workspace exceeds 8 GB, and any
runner whose call would take more than --max-call-s (5 s) skips that size and the larger ones.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field
from typing import Callable

from timing import (MAX_CALL_S, SizeGuard, TooSlow, attention_flops, format_table, measure,
                    progress, tflops, write_json)

import torch
import torch.nn.functional as F

import fa3
import variants
from fa3 import registry

TOTAL_TOKENS = 16384
HIDDEN = 2048
SCORES_WORKSPACE_LIMIT = 8e9  # bytes
PEERS = ("sdpa-flash", "sdpa-cudnn", "fa4")
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def paper_shape(seqlen: int, head_dim: int) -> tuple[int, int]:
    """(batch, heads) for 16k tokens and hidden size 2048."""
    return max(1, TOTAL_TOKENS // seqlen), HIDDEN // head_dim


def make_inputs(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, seed=0, gqa=1):
    """q, k, v of torch.randn; k and v with heads / gqa heads (grouped-query attention)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=dtype, generator=gen)
                 for h in (heads, heads // gqa, heads // gqa))


@dataclass
class Runner:
    """One column of the table: make(q, k, v, causal) returns the call to time, run inside context()."""
    name: str
    is_fa3: bool
    make: Callable
    context: Callable = contextlib.nullcontext
    skip: Callable = field(default=lambda batch, seqlen, heads, head_dim: None)
    fp8: bool = False  # an FP8 rung: its own ratio column, not in "best fa3"


def unsupported_head_dim(spec, head_dim):
    """Why rung `spec` skips head_dim, or None."""
    if head_dim not in spec.head_dims:
        return f"head_dim {head_dim} not supported (supports {spec.head_dims})"
    return None


def _sinks(heads):
    return torch.randn(heads, device="cuda", dtype=torch.float32)


DEFAULT = "default"  # --kernels default: kernel=None, the rung the dispatch picks for each call


def _spec(name: str):
    """The rung `name`, or for DEFAULT a stand-in that serves every head dim the dispatch does."""
    if name == DEFAULT:
        return registry.KernelSpec(DEFAULT, "", "", "", "kernel=None", head_dims=registry.HEAD_DIMS)
    return registry.get(name)


def rung_runner(name: str, sinks: bool = False) -> Runner:
    spec = _spec(name)
    kernel = None if name == DEFAULT else name

    def skip(batch, seqlen, heads, head_dim):
        if head_dim not in spec.head_dims:
            return unsupported_head_dim(spec, head_dim)
        if spec.needs_scores_workspace:
            workspace = batch * heads * seqlen * seqlen * 4
            if workspace > SCORES_WORKSPACE_LIMIT:
                return f"fp32 score workspace {workspace / 1e9:.1f} GB > {SCORES_WORKSPACE_LIMIT / 1e9:g} GB"
        return None

    def make(q, k, v, causal):
        out = torch.empty_like(q)
        s = _sinks(q.shape[2]) if sinks else None
        return lambda: fa3.attention(q, k, v, causal=causal, kernel=kernel, out=out, sinks=s)

    return Runner(name + ("+sinks" if sinks else ""), True, make, skip=skip)


FP8_NOTE = ("fp8: peers stay bf16 (flash-attn 4 has no FP8 forward on SM90; SDPA's cuDNN and flash "
            "backends take no float8 inputs); FP8 times include the host's V transpose")


def fp8_runner(name: str) -> Runner:
    """FP8 rung `name` on the bf16 inputs quantized per (batch, kv head), outside the timing."""
    spec = registry.get(name)

    def make(q, k, v, causal):
        heads_kv = k.shape[2]
        (q8, sq), (k8, sk), (v8, sv) = (fa3.quantize_fp8(q, "head", num_heads_kv=heads_kv),
                                        fa3.quantize_fp8(k, "head"), fa3.quantize_fp8(v, "head"))
        out = torch.empty_like(q)
        return lambda: fa3.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv,
                                     causal=causal, kernel=name, out=out)

    return Runner(name, False, make, skip=lambda b, s, h, d: unsupported_head_dim(spec, d), fp8=True)


def backward_rung_runner(name: str, deterministic: bool = False, sinks: bool = False) -> Runner:
    spec = _spec(name)
    kernel = None if name == DEFAULT else name

    def skip(batch, seqlen, heads, head_dim):
        return unsupported_head_dim(spec, head_dim)

    def make(q, k, v, causal):
        s = _sinks(q.shape[2]).requires_grad_() if sinks else None
        return lambda: fa3.attention(q, k, v, causal=causal, backward_kernel=kernel,
                                     deterministic=deterministic, sinks=s)

    return Runner(name + ("+det" if deterministic else "") + ("+sinks" if sinks else ""), True, make,
                  skip=skip)


def as_backward(runner: Runner) -> Runner:
    """The same runner timing its backward: the forward runs once with q, k, v requiring grad,
    then each timed call is torch.autograd.grad of all three for a fixed random dO."""

    def make(q, k, v, causal):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = runner.make(q, k, v, causal)()
        if isinstance(out, tuple):  # (out, lse), as flash-attn returns
            out = out[0]
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return Runner(runner.name, runner.is_fa3, make, runner.context, runner.skip)


def sdpa_runner(name: str, backend) -> Runner:
    from torch.nn.attention import sdpa_kernel

    def make(q, k, v, causal):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (b, h, s, d) views of the same memory
        gqa = qt.shape[1] != kt.shape[1]
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

    return Runner(name, False, make, context=lambda: sdpa_kernel(backend))


def fa4_runner(sinks: bool = False) -> Runner:
    from flash_attn.cute import flash_attn_func

    def make(q, k, v, causal):
        if sinks:
            s = _sinks(q.shape[2]).to(q.dtype)
            return lambda: flash_attn_func(q, k, v, causal=causal, learnable_sink=s)
        return lambda: flash_attn_func(q, k, v, causal=causal)

    return Runner("fa4+sinks" if sinks else "fa4", False, make)


def peer_runners(names, sinks: bool = False) -> tuple[list[Runner], list[str]]:
    """The requested peers that can run here, and a note for each that cannot."""
    from torch.nn.attention import SDPBackend

    runners, notes = [], []
    for name in names:
        if name == "sdpa-flash":
            runners.append(sdpa_runner(name, SDPBackend.FLASH_ATTENTION))
        elif name == "sdpa-cudnn":
            runners.append(sdpa_runner(name, SDPBackend.CUDNN_ATTENTION))
        elif name == "fa4":
            try:
                runners.append(fa4_runner())
                if sinks:
                    runners.append(fa4_runner(sinks=True))
            except Exception as exc:  # not installed, or fails to import here
                notes.append(f"fa4 skipped: flash_attn.cute is not importable ({exc})")
    return runners, notes


def run_one(runner: Runner, q, k, v, causal, *, warmup, repeats, max_call_s) -> float:
    with runner.context():
        return measure(runner.make(q, k, v, causal), warmup=warmup, repeats=repeats,
                       max_call_s=max_call_s)


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def alternating_rounds(runners, rounds: int, time_one) -> tuple[dict, dict]:
    """Each runner timed `rounds` times in turn, the order reversed every other round (a runner
    timed right after a long one runs on a hotter, lower-clocked GPU, which in one run made a
    backward column 10-12% slower than its twin at s8k). time_one(runner, round) returns
    milliseconds, or a reason (str) to skip that runner from then on. Returns ({name: median ms,
    of two rounds the faster}, {name: skip reason})."""
    times, skipped = {}, {}
    for rnd in range(rounds):
        for r in (runners if rnd % 2 == 0 else runners[::-1]):
            if r.name in skipped:
                continue
            got = time_one(r, rnd)
            if isinstance(got, str):
                skipped[r.name] = got
                times.pop(r.name, None)
            else:
                times.setdefault(r.name, []).append(got)
    return {name: sorted(ts)[(len(ts) - 1) // 2] for name, ts in times.items()}, skipped


def sweep(runners, head_dims, causals, seqlens, *, warmup, repeats, max_call_s,
          flops_factor: float = 1.0, rounds: int = 1, gqa: int = 1) -> list[dict]:
    """Every runner at every shape; with rounds > 1 in `alternating_rounds`."""
    guard = SizeGuard(max_call_s)
    rows = []
    for head_dim in head_dims:
        for causal in causals:
            for seqlen in sorted(seqlens):
                batch, heads = paper_shape(seqlen, head_dim)
                flops = flops_factor * attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                label = (f"d{head_dim} {'causal' if causal else 'full  '} s{seqlen:<5} "
                         f"b{batch:<2} h{heads:<2}")
                q, k, v = make_inputs(batch, seqlen, heads, head_dim, gqa=gqa)

                def time_one(r, rnd):
                    key = (r.name, head_dim, causal)
                    reason = r.skip(batch, seqlen, heads, head_dim) or (
                        guard.skip_reason(key, flops) if rnd == 0 else None)
                    if reason is None:
                        try:
                            ms = run_one(r, q, k, v, causal, warmup=warmup, repeats=repeats,
                                         max_call_s=max_call_s)
                        except TooSlow as slow:
                            guard.record(key, flops, slow.args[0])
                            reason = f"one call took {slow.args[0] / 1e3:.1f} s > {max_call_s:g} s"
                        except Exception as exc:  # a peer without a kernel for this shape, OOM, ...
                            reason = _short(exc)
                            torch.cuda.empty_cache()
                        else:
                            guard.record(key, flops, ms)
                            progress(f"{label}  {r.name:<10} {ms:10.3f} ms {tflops(flops, ms):7.1f} TFLOP/s"
                                     + (f"  (round {rnd + 1}/{rounds})" if rounds > 1 else ""))
                            return ms
                    progress(f"{label}  {r.name:<10} skipped: {reason}")
                    return reason

                medians, skipped = alternating_rounds(runners, rounds, time_one)
                results = {name: {"skipped": reason} for name, reason in skipped.items()}
                results.update({name: {"ms": ms, "tflops": tflops(flops, ms)} for name, ms in medians.items()})
                rows.append(dict(head_dim=head_dim, causal=causal, seqlen=seqlen, batch=batch,
                                 heads=heads, results={r.name: results[r.name] for r in runners
                                                       if r.name in results}))
                q = k = v = None  # freed before the next shape's inputs
    return rows


def _ratio(a, b):
    return f"{a / b:.2f}" if a and b else None


def table(rows, runners) -> str:
    names = [r.name for r in runners]
    fa3_names = [r.name for r in runners if r.is_fa3]
    fp8_names = [r.name for r in runners if r.fp8]
    headers = ["d", "causal", "seqlen", *names, "best fa3", "fa3/fa4", "fa3/cudnn"]
    if fp8_names:
        headers.append("fp8/fa3")
    body = []
    for row in rows:
        rate = {n: row["results"].get(n, {}).get("tflops") for n in names}
        best = max((n for n in fa3_names if rate[n]), key=lambda n: rate[n], default=None)
        top = rate[best] if best else None
        line = [row["head_dim"], "yes" if row["causal"] else "no", row["seqlen"],
                *(rate[n] for n in names), best,
                _ratio(top, rate.get("fa4")), _ratio(top, rate.get("sdpa-cudnn"))]
        if fp8_names:
            line.append(_ratio(max((rate[n] for n in fp8_names if rate[n]), default=None), top))
        body.append(line)
    return format_table(headers, body)


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        variants.register_from_argv(argv)  # before --kernels is checked against the registry
    except ValueError as exc:
        raise SystemExit(f"bench_attention: {exc}") from None
    backward = "--backward" in argv
    rungs = registry.available_kernels(registry.BACKWARD if backward else registry.ATTENTION)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="all",
                   help=f"'all' or a comma list of {','.join(rungs)} and {DEFAULT} (kernel=None)")
    p.add_argument("--head-dims", type=_csv(int), default=list(DEFAULT_HEAD_DIMS))
    p.add_argument("--seqlens", type=_csv(int), default=list(DEFAULT_SEQLENS))
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ",".join(PEERS)
                   + " ('none' for none)")
    p.add_argument("--json", metavar="FILE", help="also write every measurement here")
    p.add_argument("--plot", metavar="FILE.png", help="also plot TFLOP/s against seqlen (matplotlib)")
    p.add_argument("--plot-from", metavar="FILE.json", help="only redraw --plot from a --json file")
    p.add_argument("--backward", action="store_true", help="time the backward (2.5x the FLOPs)")
    p.add_argument("--deterministic", action="store_true",
                   help="with --backward: also each rung with deterministic=True")
    p.add_argument("--sinks", action="store_true",
                   help="also each rung (and fa4) with attention sinks, as a column '+sinks'")
    p.add_argument("--fp8", action="store_true",
                   help="also the FP8 forward rungs (" + ",".join(registry.available_kernels(
                       registry.ATTENTION_FP8)) + ") on the inputs quantized to e4m3")
    p.add_argument("--gqa", type=int, default=1, metavar="G",
                   help="G query heads per KV head (grouped-query attention; the heads, 2048 / d, "
                        "must divide by G)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                   help="an experiment row: rung BASE with settings changed, named NAME (repeatable; "
                        "benchmarks/variants.py)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="time each shape's runners this many times in turn (order reversed every other "
                        "round) and keep each runner's median: columns compared within a run then do not "
                        "depend on their order")
    p.add_argument("--max-call-s", type=float, default=MAX_CALL_S,
                   help="skip a size (and larger ones) when one call takes longer (default 5)")
    args = p.parse_args(argv)
    args.kernels = rungs if args.kernels == "all" else _csv(str)(args.kernels)
    unknown = [n for n in args.kernels if n not in rungs and n != DEFAULT]
    if unknown:
        p.error(f"--kernels: {', '.join(unknown)} not {'backward' if backward else 'attention'} "
                f"rungs; choose from {', '.join(rungs)}")
    args.peers = [] if args.peers == "none" else _csv(str)(args.peers)
    bad = [n for n in args.peers if n not in PEERS]
    if bad:
        p.error(f"--peers: unknown {', '.join(bad)}; choose from {', '.join(PEERS)}")
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    odd = [d for d in args.head_dims if args.gqa < 1 or (HIDDEN // d) % args.gqa]
    if odd:
        p.error(f"--gqa {args.gqa}: the {', '.join(str(HIDDEN // d) for d in odd)} heads of head dim "
                f"{', '.join(map(str, odd))} do not divide into groups of {args.gqa}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        if not args.plot:
            print("--plot-from needs --plot FILE.png")
            return 2
        import json
        from plot import plot_rows
        data = json.load(open(args.plot_from))
        plot_rows(data["rows"], args.plot, _plot_title(data["setting"]))
        return 0
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (a Hopper GPU for the fa3 rungs); none was found.")
        return 2
    progress(f"{torch.cuda.get_device_name()}; {TOTAL_TOKENS} tokens, hidden {HIDDEN}, bf16"
             f"{f', {args.gqa} query heads per KV head' if args.gqa > 1 else ''}; "
             f"{'backward ' if args.backward else ''}TFLOP/s (median of CUDA-event times)")
    peers, notes = peer_runners(args.peers, args.sinks)
    for note in notes:
        progress(note)
    if args.backward and args.fp8:
        print("--fp8 times the forward only (FP8 attention has no backward)")
        return 2
    if args.backward:
        rungs = [backward_rung_runner(n) for n in args.kernels]
        if args.deterministic:
            rungs += [backward_rung_runner(n, deterministic=True) for n in args.kernels]
        if args.sinks:
            rungs += [backward_rung_runner(n, sinks=True) for n in args.kernels]
        runners = [as_backward(r) for r in rungs + peers]
    else:
        runners = [rung_runner(n) for n in args.kernels] + peers
        if args.sinks:
            runners += [rung_runner(n, sinks=True) for n in args.kernels
                        if n == DEFAULT or registry.SINKS in registry.get(n).variants]
        if args.fp8:
            runners += [fp8_runner(n) for n in registry.available_kernels(registry.ATTENTION_FP8)]
            notes.append(FP8_NOTE)
    rows = sweep(runners, args.head_dims, args.causals, args.seqlens, warmup=args.warmup,
                 repeats=args.repeats, max_call_s=args.max_call_s, rounds=args.rounds,
                 flops_factor=2.5 if args.backward else 1.0, gqa=args.gqa)
    print()
    print(table(rows, runners))
    for note in notes:
        print(note)
    setting = {"total_tokens": TOTAL_TOKENS, "hidden": HIDDEN, "dtype": "bf16", "gqa": args.gqa,
               "direction": "backward" if args.backward else "forward",
               **({"fp8": "e4m3 q/k/v, per (batch, kv head) scales"} if args.fp8 else {})}
    if args.json:
        write_json(args.json, {"setting": setting, "notes": notes, "rows": rows})
    if args.plot:
        from plot import plot_rows
        plot_rows(rows, args.plot, f"{torch.cuda.get_device_name()}: " + _plot_title(setting))
    return 0


def _plot_title(setting) -> str:
    dtype = setting["dtype"] + (f" (FP8 rungs: {setting['fp8']})" if setting.get("fp8") else "")
    return (f"attention {setting['direction']}, {dtype}, {setting['total_tokens']} tokens, "
            f"hidden {setting['hidden']}")


if __name__ == "__main__":
    sys.exit(main())
