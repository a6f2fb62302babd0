"""A small continuous-batching loop over a paged KV cache: what a serving engine asks of attention.

    python benchmarks/serve.py [--short] [--page-size 16] [--peers fa4] [--json FILE]

Requests arrive over time (seeded: prompts of 100-3000 tokens, 16-256 output tokens). Each step
the scheduler fills a token budget the way vLLM's does: every running request that finished its
prompt decodes one token, and the rest of the budget goes to prompts in chunks (chunked prefill),
oldest first; a request is admitted only while the page pool has room for its next tokens, pages
are allocated as sequences grow and freed when they finish. One step is then, per layer:

    write the step's new k/v into the paged cache (slot mapping, as reshape_and_cache)
    out = attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, causal)

with every request of the step in one packed call: decodes are one-token entries, prompt chunks
longer ones, causal aligned to the end of each sequence's keys. There is no model: q and the new
k/v are random (bf16, GQA 32/8, d128), so what is timed is attention and the cache writes.

The same request trace runs for fa3 (`fa3.attention_varlen(..., block_table=, seqused_k=)`, the
vLLM-style call) and for flash-attn-4 (`flash_attn.cute.flash_attn_varlen_func(..., page_table=,
seqused_k=)`) in the same process, their outputs compared on every step's first layer. Reported
per runner: tokens per second of the whole loop (host scheduling included; fa3's eager calls also
check the index values on the host, one sync each), and of attention alone (CUDA-event time of the
attention calls), plus a one-call-versus-two comparison on a mixed step: the step's decodes and
prompt chunks in one call, against decodes and chunks in two calls. Each runner runs the trace
twice and reports the second pass: the first compiles what the runner compiles for the trace's
shapes (fa3 nothing: its shapes are dynamic; flash-attn-4 recompiles for new shapes), and its wall
time is the "first pass s" column.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field

import torch

from timing import format_table

import fa3

HEADS_Q, HEADS_KV, D = 32, 8, 128
COMPARED_ROWS = 256  # of each step's first layer: fa4's output against fa3's


@dataclass
class Request:
    prompt: int  # prompt tokens
    output: int  # tokens to generate
    arrival: int  # step at which it arrives
    done: int = 0  # tokens whose k/v are in the cache
    pages: list = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.prompt + self.output

    def finished(self) -> bool:
        return self.done >= self.total


def trace(n: int, seed: int, steps_between: float):
    """n requests with seeded lengths and arrival steps (exponential gaps)."""
    rng = random.Random(seed)
    out, step = [], 0.0
    for _ in range(n):
        out.append(Request(rng.randint(100, 3000), rng.randint(16, 256), int(step)))
        step += rng.expovariate(1.0 / steps_between)
    return out


class PagePool:
    """A free list of cache pages."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages))

    def grow(self, req: Request, tokens: int, page_size: int) -> bool:
        """Give `req` pages for `tokens` tokens in all; False (nothing taken) if the pool is short."""
        need = -(-tokens // page_size) - len(req.pages)
        if need > len(self.free):
            return False
        for _ in range(need):
            req.pages.append(self.free.pop())
        return True

    def release(self, req: Request):
        self.free.extend(req.pages)
        req.pages = []

    def can_admit(self, req: Request, running, page_size: int) -> bool:
        """Whether the pool holds `req` whole beside what the running requests will still take
        (no preemption: an admitted request always gets its pages)."""
        pages = lambda r: -(-r.total // page_size)
        owed = sum(pages(r) - len(r.pages) for r in running)
        return len(self.free) - owed >= pages(req)


def schedule(waiting, running, pool, budget: int, page_size: int, max_seqs: int):
    """This step's (request, new tokens) list: decodes first, then prompt chunks, oldest first."""
    plan = []
    for req in running:
        if req.done >= req.prompt and pool.grow(req, req.done + 1, page_size):
            plan.append((req, 1))
            budget -= 1
    for req in running + waiting:
        if budget <= 0 or len(plan) >= max_seqs:
            break
        if req.done < req.prompt:
            chunk = min(budget, req.prompt - req.done)
            admitting = req in waiting
            if admitting and not pool.can_admit(req, running, page_size):
                break  # oldest first: later arrivals wait too
            if not pool.grow(req, req.done + chunk, page_size):
                continue
            if admitting:
                waiting.remove(req)
                running.append(req)
            plan.append((req, chunk))
            budget -= chunk
    return plan


def fa3_attention(q, k_cache, v_cache, cu_q, seqused_k, table, max_q, max_k):
    return fa3.attention_varlen(q, k_cache, v_cache, cu_q, None, max_q, max_k, block_table=table,
                                seqused_k=seqused_k, causal=True)


def fa4_runner():
    from flash_attn.cute import flash_attn_varlen_func

    def fa4_attention(q, k_cache, v_cache, cu_q, seqused_k, table, max_q, max_k):
        out = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                                     seqused_k=seqused_k, max_seqlen_k=max_k, page_table=table, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return fa4_attention


def step_tensors(plan, page_size, device):
    """cu_seqlens_q, seqused_k, block_table, the slot of each new token (on the device), the
    step's tokens and longest query and key runs (host ints)."""
    lens = [n for _, n in plan]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    used = [req.done + n for req, n in plan]
    width = max(len(req.pages) for req, _ in plan)
    table = torch.full((len(plan), width), -1, dtype=torch.int32)  # stale entries: never read
    slots = []
    for b, (req, n) in enumerate(plan):
        table[b, :len(req.pages)] = torch.tensor(req.pages, dtype=torch.int32)
        for pos in range(req.done, req.done + n):
            slots.append(req.pages[pos // page_size] * page_size + pos % page_size)
    as_dev = lambda t: t.to(device, non_blocking=True)
    return (as_dev(cu), as_dev(torch.tensor(used, dtype=torch.int32)), as_dev(table),
            as_dev(torch.tensor(slots, dtype=torch.int64)), sum(lens), max(lens), max(used))


def run(name, attention, requests, args, caches, gen_seed, compare=None):
    """The whole loop for one runner; returns its numbers (and the first layer's outputs per step
    when `compare` is None, else the worst relative difference against them)."""
    device = caches[0][0].device
    pool = PagePool(caches[0][0].shape[0])
    pending = [Request(r.prompt, r.output, r.arrival) for r in requests]  # fresh state per runner
    waiting, running = [], []
    gen = torch.Generator(device=device).manual_seed(gen_seed)
    outputs, worst = [], 0.0
    tokens = prefill_tokens = 0
    events = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = 0
    while pending or waiting or running:
        waiting += [r for r in pending if r.arrival <= step]
        pending = [r for r in pending if r.arrival > step]
        plan = schedule(waiting, running, pool, args.budget, args.page_size, args.max_seqs)
        step += 1
        if not plan:
            continue
        cu, seqused, table, slots, total, max_q, max_k = step_tensors(plan, args.page_size, device)
        for layer, (k_cache, v_cache) in enumerate(caches):
            q = torch.randn(total, HEADS_Q, D, device=device, dtype=torch.bfloat16, generator=gen)
            k_new, v_new = (torch.randn(total, HEADS_KV, D, device=device, dtype=torch.bfloat16, generator=gen)
                            for _ in range(2))
            k_cache.view(-1, HEADS_KV, D)[slots] = k_new
            v_cache.view(-1, HEADS_KV, D)[slots] = v_new
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = attention(q, k_cache, v_cache, cu, seqused, table, max_q, max_k)
            end.record()
            events.append((begin, end))
            if layer == 0:
                if compare is None:
                    outputs.append(out[:COMPARED_ROWS].clone())
                else:
                    ref = compare[len(outputs)].float()
                    outputs.append(None)
                    diff = (out[:COMPARED_ROWS].float() - ref).norm() / ref.norm().clamp_min(1e-30)
                    worst = max(worst, diff.item())
        tokens += total
        prefill_tokens += sum(n for req, n in plan if req.done < req.prompt)
        for req, n in plan:
            req.done += n
            if req.finished():
                running.remove(req)
                pool.release(req)
        if step % args.progress == 0:
            print(f"  {name}: step {step}, {len(running)} running, {len(waiting) + len(pending)} waiting, "
                  f"{len(plan)} in the step ({total} tokens), {pool_pages(pool, caches)} pages in use",
                  flush=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    attention_ms = sum(b.elapsed_time(e) for b, e in events)
    return dict(runner=name, steps=step, tokens=tokens, prefill_tokens=prefill_tokens, wall_s=wall,
                attention_ms=attention_ms, tokens_per_s=tokens / wall,
                attention_tokens_per_s=tokens / (attention_ms * 1e-3), worst_rel_diff=worst), outputs


def pool_pages(pool, caches):
    return caches[0][0].shape[0] - len(pool.free)


def mixed_step(attention, args, caches, device):
    """GPU time (us) of one mixed step in one call, and of its decodes and its chunks in two calls."""
    from timing import measure

    gen = torch.Generator(device="cpu").manual_seed(1)
    decodes = [Request(512 + 24 * i, 10, 0, done=512 + 24 * i) for i in range(args.max_seqs - 2)]
    chunks = [Request(3000, 10, 0, done=1000), Request(1500, 10, 0, done=0)]
    pool = PagePool(caches[0][0].shape[0])
    plan = [(req, 1) for req in decodes] + list(zip(chunks, (1024, 512)))
    for req, n in plan:
        assert pool.grow(req, req.done + n, args.page_size), "the pool is too small for the mixed step"
    k_cache, v_cache = caches[0]

    def call(part):
        cu, seqused, table, _, total, max_q, max_k = step_tensors(part, args.page_size, device)
        q = torch.randn(total, HEADS_Q, D, generator=gen).to(device, torch.bfloat16)
        return lambda: attention(q, k_cache, v_cache, cu, seqused, table, max_q, max_k)
    one = call(plan)
    two = (call(plan[:len(decodes)]), call(plan[len(decodes):]))
    return measure(one) * 1e3, sum(measure(f) for f in two) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="a short trace (a minute or so)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step")
    ap.add_argument("--max-seqs", type=int, default=128, help="requests per step")
    ap.add_argument("--pool-tokens", type=int, default=400_000, help="cache capacity in tokens, per layer")
    ap.add_argument("--peers", default="fa4")
    ap.add_argument("--progress", type=int, default=50, help="print every this many steps")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.short:
        args.requests, args.layers, args.progress = 48, 2, 25
    device = torch.device("cuda")
    requests = trace(args.requests, seed=0, steps_between=2.0)
    num_pages = args.pool_tokens // args.page_size
    caches = [tuple(torch.zeros(num_pages, args.page_size, HEADS_KV, D, device=device, dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(args.layers)]
    print(f"{args.requests} requests, pages of {args.page_size} tokens ({num_pages} per layer), "
          f"{args.layers} layers, {args.budget} tokens per step", flush=True)
    runners = {"fa3": fa3_attention}
    if "fa4" in args.peers.split(","):
        try:
            runners["fa4"] = fa4_runner()
        except Exception as exc:  # not installed here
            print(f"fa4 skipped: {exc}")
    results, reference = [], None
    for name, attention in runners.items():
        try:
            # the first pass compiles whatever the runner compiles for the trace's shapes (fa3:
            # nothing new, its shapes are dynamic; flash-attn-4: a kernel per new shape): timed
            # apart, so that the second pass measures the steady state an engine runs in
            first_s = None
            for timed in (False, True):
                for k_cache, v_cache in caches:
                    k_cache.zero_()
                    v_cache.zero_()
                print(f"  {name}: {'timed pass' if timed else 'first pass (compiles)'}", flush=True)
                result, outputs = run(name, attention, requests, args, caches, gen_seed=0, compare=reference)
                first_s = result["wall_s"] if first_s is None else first_s
        except Exception as exc:
            print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        result["first_pass_s"] = first_s
        reference = reference or outputs
        result["mixed_one_call_us"], result["mixed_two_calls_us"] = mixed_step(attention, args, caches, device)
        results.append(result)
        print(f"  {name}: {result['tokens_per_s']:.0f} tokens/s, attention alone "
              f"{result['attention_tokens_per_s']:.0f} tokens/s", flush=True)
    rows = [[r["runner"], str(r["steps"]), str(r["tokens"]), f"{r['tokens_per_s']:.0f}",
             f"{r['attention_tokens_per_s']:.0f}", f"{r['mixed_one_call_us']:.0f}",
             f"{r['mixed_two_calls_us']:.0f}", f"{r['worst_rel_diff']:.1e}", f"{r['first_pass_s']:.1f}"]
            for r in results]
    print(format_table(["runner", "steps", "tokens", "tokens/s", "attention tokens/s", "mixed step: 1 call us",
                        "2 calls us", "max rel diff vs fa3", "first pass s"], rows))
    if len(results) == 2:
        a, b = results
        print(f"fa3 / fa4: tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.2f}, attention alone "
              f"{a['attention_tokens_per_s'] / b['attention_tokens_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
