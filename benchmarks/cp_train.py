"""Context parallelism: attention forward + backward of a long sequence on 1 GPU and split over N.

    torchrun --nproc_per_node 2 benchmarks/cp_train.py [--seqlen 131072] [--heads 8] [--kv-heads 8]
        [--head-dim 128] [--batch 1] [--iters 3] [--no-causal] [--peers sdpa-flash,sdpa-cudnn]
        [--simulate-ranks N] [--json out.json]

One attention layer (bf16, the whole sequence of --seqlen tokens), forward and backward, timed as:
  fa3 1 GPU           fa3.attention on the whole sequence, on every GPU at once (each alone)
  fa3 ring            fa3.context_parallel_attention on zig-zag shards (fa3.context_parallel.shard)
  fa3 compute only    the same ring with no communication (fa3.ring.Loopback): the same kernels on
                      the same shapes; ring / compute-only - 1 is the communication left exposed
  compute only, N ranks simulated   (--simulate-ranks N) each rank's compute-only schedule of an
                      N-rank ring, run in turn on this GPU: the slowest is what N GPUs can reach at
                      best. With torchrun --nproc_per_node 1 it predicts the scaling on one GPU.
  torch CP <backend>  torch's context_parallel (ring over SDPA's flash or cuDNN backend on DTensor
                      shards, its head-tail load balancing: the same tokens per rank as fa3's)
Each time is the median of --iters CUDA-event times after one untimed call (it compiles), the
slowest rank's. Columns: forward ms, forward + backward ms, speedup over fa3 on 1 GPU, TFLOP/s per
GPU (forward + backward = 3.5 x the forward's FLOPs), and the rel. error of the output against
fa3 on 1 GPU (both ring and torch: on this rank's shard).

torch's context_parallel takes no custom attention op (it routes the aten SDPA ops of DTensors to
its own ring): a model under it uses fa3 by calling fa3.context_parallel_attention on its local
shards in place of SDPA; the buffers torch shards (tokens, labels, rotary tables) hold the same
positions as fa3's zig-zag shards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

try:
    import fa3
except ImportError:  # a source checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fa3

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fa3 import context_parallel, ring
from fa3.timing import attention_flops


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def timed_ms(fn, iters: int) -> float:
    """Median CUDA-event ms of fn() after one untimed call, the slowest rank's (ranks start each
    call together)."""
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    worst = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def fwd_bwd_runner(attn, q, k, v, dout):
    """(forward -> out, forward + backward) callables of attn(q, k, v) on fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            return attn(*leaves)

    def forward_backward():
        for t in leaves:
            t.grad = None
        attn(*leaves).backward(dout)

    return forward, forward_backward


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def torch_cp_rows(args, q, k, v, dout, reference_shard, mesh):
    """torch's context_parallel over SDPA, one row per backend that runs."""
    from torch.distributed.tensor.experimental import context_parallel as torch_cp
    from torch.distributed.tensor.experimental._context_parallel import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
    group = args.heads // args.kv_heads
    rows = []
    for name in [p for p in args.peers.split(",") if p]:
        if name not in backends:
            say(f"  unknown peer {name!r}: skipped (known: {', '.join(backends)})")
            continue
        # torch's layout (batch, heads, seqlen, d); GQA expanded: its ring takes equal heads
        buffers = [t.transpose(1, 2).contiguous() for t in
                   (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2))]
        _cp_options.enable_load_balance = args.causal  # non-causal: contiguous shards, as fa3's
        dout_local = context_parallel.shard(dout, zigzag=args.causal).transpose(1, 2).contiguous()
        try:
            with torch_cp(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers)):
                def attn(q, k, v, backend=backends[name]):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

                say(f"  torch CP {name}: forward")
                fwd, fwd_bwd = fwd_bwd_runner(attn, *buffers, dout_local)
                fwd_ms = timed_ms(fwd, args.iters)
                say(f"  torch CP {name}: forward + backward")
                total_ms = timed_ms(fwd_bwd, args.iters)
                err = rel_err(fwd().transpose(1, 2), reference_shard)
            rows.append((f"torch CP {name}", dist.get_world_size(), fwd_ms, total_ms, err))
        except Exception as e:  # a backend this build or shape lacks: say so, keep going
            say(f"  torch CP {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return rows


def simulated_row(args, local, q, k, v, dout):
    """Each of --simulate-ranks ranks' compute-only schedule in turn on this GPU: the slowest rank's
    time is what that many GPUs can reach at best (a prediction, before any multi-GPU run)."""
    n, times = args.simulate_ranks, []
    for r in range(n):
        say(f"compute only, rank {r} of {n} simulated on this GPU")
        pos = context_parallel.positions(args.seqlen, r, n, zigzag=args.causal).cuda()
        loopback = ring.Loopback(r, n)
        compute = lambda q, k, v: ring.ring_attention(q, k, v, local, loopback, args.causal)[0]
        fwd, fwd_bwd = fwd_bwd_runner(compute, *(t[:, pos].contiguous() for t in (q, k, v, dout)))
        times.append((timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters)))
    return (f"compute only, {n} ranks simulated", n, max(t[0] for t in times), max(t[1] for t in times), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (GQA when fewer)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--peers", default="sdpa-flash,sdpa-cudnn", help="torch CP backends ('' for none)")
    ap.add_argument("--simulate-ranks", type=int, default=0,
                    help="also run each of N ranks' compute-only schedule on this GPU (predicts N GPUs)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    args.kv_heads = args.kv_heads or args.heads

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (world,))
    say(f"cp_train: {world} GPUs ({torch.cuda.get_device_name()}), batch {args.batch} x {args.seqlen} "
        f"tokens, heads {args.heads}/{args.kv_heads}, d{args.head_dim}, causal={args.causal}, "
        f"{args.iters} timed iterations")

    g = torch.Generator(device="cuda").manual_seed(0)  # the same sequence on every rank

    def randn(heads):
        return torch.randn(args.batch, args.seqlen, heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=g)

    q, k, v, dout = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)
    rows = []

    say("fa3 1 GPU: compile, then forward and forward + backward")
    single = lambda q, k, v: fa3.attention(q, k, v, causal=args.causal)
    fwd, fwd_bwd = fwd_bwd_runner(single, q, k, v, dout)
    rows.append(("fa3 1 GPU", 1, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters), 0.0))
    reference_shard = context_parallel.shard(fwd(), zigzag=args.causal)

    shards = [context_parallel.shard(t, zigzag=args.causal) for t in (q, k, v, dout)]
    say(f"fa3 ring on {world} GPUs: compile, then forward and forward + backward")
    ring_attn = lambda q, k, v: fa3.context_parallel_attention(q, k, v, causal=args.causal)
    fwd, fwd_bwd = fwd_bwd_runner(ring_attn, *shards)
    rows.append(("fa3 ring", world, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters),
                 rel_err(fwd(), reference_shard)))

    say("fa3 ring, compute only (no communication)")
    local = context_parallel.fa3_local(1.0 / math.sqrt(args.head_dim))
    loopback = ring.Loopback(dist.get_rank(), world)
    compute = lambda q, k, v: ring.ring_attention(q, k, v, local, loopback, args.causal)[0]
    fwd, fwd_bwd = fwd_bwd_runner(compute, *shards)
    rows.append(("fa3 compute only", world, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters), None))

    if args.simulate_ranks:
        rows.append(simulated_row(args, local, q, k, v, dout))

    if args.peers:
        say(f"torch context_parallel on {world} GPUs")
        rows += torch_cp_rows(args, q, k, v, dout, reference_shard, mesh)

    flops = 3.5 * attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim, args.causal)
    base = rows[0][3]
    table = [[name, gpus, fwd_ms, total_ms, base / total_ms, flops / (total_ms * 1e-3) / 1e12 / gpus,
              "-" if err is None else f"{err:.1e}"] for name, gpus, fwd_ms, total_ms, err in rows]
    headers = ["", "GPUs", "fwd ms", "fwd+bwd ms", "speedup", "TFLOP/s/GPU", "out rel err"]
    if dist.get_rank() == 0:
        widths = [max(len(h), *(len(f"{r[i]:.2f}" if isinstance(r[i], float) else str(r[i])) for r in table))
                  for i, h in enumerate(headers)]
        fmt = lambda r: "  ".join((f"{x:.2f}" if isinstance(x, float) else str(x)).rjust(w)
                                  for x, w in zip(r, widths))
        print("\n" + fmt(headers) + "\n" + "\n".join(fmt(r) for r in table))
        ring_row, compute_row = rows[1], rows[2]
        print(f"\ncommunication exposed (ring / compute only - 1): forward "
              f"{ring_row[2] / compute_row[2] - 1:+.1%}, forward + backward {ring_row[3] / compute_row[3] - 1:+.1%}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "headers": headers, "rows": table}, f, indent=1)
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
