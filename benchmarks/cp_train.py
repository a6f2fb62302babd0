"""Context parallelism: attention forward + backward of a long sequence on 1 GPU and split over N.

    torchrun --nproc_per_node 2 benchmarks/cp_train.py [--seqlen 131072] [--heads 8] [--kv-heads 8]
        [--head-dim 128] [--batch 1] [--iters 3] [--no-causal] [--peers sdpa-flash,sdpa-cudnn]
        [--simulate-ranks N] [--documents N] [--json out.json]
    torchrun --nproc_per_node 2 benchmarks/cp_train.py --model [--seqlen 131072] [--layers 4]
        [--width 1024] [--mlp 2816] [--vocab 8192] [--steps 4] [--peers sdpa-cudnn]

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
--documents N packs N documents of random lengths into the sequence (batch 1): each attends only
within itself, fa3 1 GPU runs fa3.attention_varlen and the ring takes cu_seqlens (torch's CP has
no document masking: no peer rows).
Each time is the median of --iters CUDA-event times after one untimed call (it compiles), the
slowest rank's. Columns: forward ms, forward + backward ms, speedup over fa3 on 1 GPU, TFLOP/s per
GPU (forward + backward = 3.5 x the forward's FLOPs), and the rel. error of the output against
fa3 on 1 GPU (both ring and torch: on this rank's shard).

--model trains a Llama-shaped decoder instead (train_step.Llama: RMSNorm, rotary, SwiGLU; --layers,
--width, --mlp, --vocab; heads from --heads/--kv-heads), --steps AdamW steps on one sequence of
--seqlen tokens: on one GPU with fa3.attention; on every GPU with fa3's ring (each rank embeds its
zig-zag shard of the tokens, labels and rotary positions, the loss is the global mean, the
gradients are all-reduced before the optimizer step); and with torch's context_parallel over SDPA
(the same model and shards, its ring in place of fa3's). Rows: the median step ms (the slowest
rank's, after the first step), the speedup over one GPU, and each step's loss, which must equal
the one-GPU run's within bf16 noise.

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


def sdpa_backends() -> dict:
    """The SDPA backends torch's context parallel runs as peers, by their --peers names."""
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def torch_cp_rows(args, q, k, v, dout, reference_shard, mesh):
    """torch's context_parallel over SDPA, one row per backend that runs."""
    from torch.distributed.tensor.experimental import context_parallel as torch_cp
    from torch.distributed.tensor.experimental._context_parallel import _cp_options
    from torch.nn.attention import sdpa_kernel

    backends = sdpa_backends()
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


def grouped_sdpa(q, k, v, causal, backend):
    """SDPA with one backend, in fa3's (batch, seqlen, heads, head_dim) layout, GQA expanded (torch's
    ring takes equal heads)."""
    from torch.nn.attention import sdpa_kernel

    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


def train_model(args, mesh):
    """--model: (name, GPUs, median step ms, losses) rows of one GPU, fa3's ring and torch's CP."""
    from torch.distributed.tensor.experimental import context_parallel as torch_cp
    from torch.distributed.tensor.experimental._context_parallel import _cp_options

    from train_step import Llama

    world = dist.get_world_size()
    g = torch.Generator(device="cuda").manual_seed(0)  # the same sequence on every rank
    tokens = torch.randint(0, args.vocab, (1, args.seqlen + 1), device="cuda", generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(args.seqlen, device="cuda")

    def run(label, loss_fn, gpus):
        """--steps AdamW steps from the same weights; loss_fn(model) is this rank's share of the
        mean loss over the whole sequence (summed over ranks when gpus > 1, grads too)."""
        say(f"{label}: {args.steps} steps (the first compiles)")
        torch.manual_seed(0)
        model = Llama(args.vocab, args.width, args.layers, args.heads, args.kv_heads, args.mlp,
                      device="cuda", dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses, times = [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model)
            loss.backward()
            loss = loss.detach()
            if gpus > 1:  # data split over ranks, weights replicated: sum the shares
                grads = [p.grad for p in model.parameters()]
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat)
                for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    grad.copy_(synced)
                dist.all_reduce(loss)
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            losses.append(loss.item())
        del model, opt
        torch.cuda.empty_cache()
        worst = torch.tensor([statistics.median(times[1:] or times)], device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        say(f"  losses {' '.join(f'{x:.4f}' for x in losses)}")
        return label, gpus, worst.item(), losses

    def cross_entropy_share(logits, labels):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / args.seqlen

    rows = [run("fa3 1 GPU", lambda m: cross_entropy_share(
        m(inputs, lambda q, k, v: fa3.attention(q, k, v, causal=True)), labels), 1)]
    shards = [context_parallel.shard(t, dim=d) for t, d in ((inputs, 1), (labels, 1), (positions, 0))]
    rows.append(run(f"fa3 ring ({world} GPUs)", lambda m: cross_entropy_share(
        m(shards[0], lambda q, k, v: fa3.context_parallel_attention(q, k, v, causal=True), shards[2]),
        shards[1]), world))
    backends = sdpa_backends()
    for name in [p for p in args.peers.split(",") if p in backends]:
        buffers = [t.clone() for t in (inputs, labels, positions)]  # sharded in place by torch
        _cp_options.enable_load_balance = True
        try:
            with torch_cp(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
                attention = lambda q, k, v, b=backends[name]: grouped_sdpa(q, k, v, True, b)
                rows.append(run(f"torch CP {name} ({world} GPUs)", lambda m: cross_entropy_share(
                    m(buffers[0], attention, buffers[2]), buffers[1]), world))
        except Exception as e:  # a backend this build or shape lacks: say so, keep going
            say(f"  torch CP {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return rows


def print_model_rows(args, rows):
    base_ms, base_losses = rows[0][2], rows[0][3]
    say(f"\n{'':>26}  GPUs  step ms  speedup  largest loss diff vs 1 GPU  losses")
    for name, gpus, ms, losses in rows:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
        say(f"{name:>26}  {gpus:>4}  {ms:7.1f}  {base_ms / ms:7.2f}  {diff:26.1e}  "
            + " ".join(f"{x:.4f}" for x in losses))
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": [dict(name=r[0], gpus=r[1], step_ms=r[2], losses=r[3]) for r in rows]}, f, indent=1)
        say(f"wrote {args.json}")


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
    ap.add_argument("--documents", type=int, default=0, help="pack N documents of random lengths (batch 1)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--model", action="store_true", help="train a Llama-shaped model instead (causal)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024, help="--model: heads x head_dim")
    ap.add_argument("--mlp", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    args.batch = 1 if args.documents else args.batch

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (world,))
    if args.model:
        say(f"cp_train --model: {world} GPUs ({torch.cuda.get_device_name()}), {args.seqlen} tokens, "
            f"{args.layers} layers, width {args.width}, heads {args.heads}/{args.kv_heads}, mlp {args.mlp}, "
            f"vocab {args.vocab}, bf16, AdamW")
        print_model_rows(args, train_model(args, mesh))
        dist.barrier()
        dist.destroy_process_group()
        return
    say(f"cp_train: {world} GPUs ({torch.cuda.get_device_name()}), batch {args.batch} x {args.seqlen} "
        f"tokens, heads {args.heads}/{args.kv_heads}, d{args.head_dim}, causal={args.causal}, "
        f"{args.iters} timed iterations")

    g = torch.Generator(device="cuda").manual_seed(0)  # the same sequence on every rank

    def randn(heads):
        return torch.randn(args.batch, args.seqlen, heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=g)

    q, k, v, dout = randn(args.heads), randn(args.kv_heads), randn(args.kv_heads), randn(args.heads)
    rows = []

    single = lambda q, k, v: fa3.attention(q, k, v, causal=args.causal)
    ring_attn = lambda q, k, v: fa3.context_parallel_attention(q, k, v, causal=args.causal)
    documents, doc_lengths = None, [args.seqlen]
    if args.documents:  # batch 1: the packed calls see q[0], (tokens, heads, d)
        cuts = torch.randperm(args.seqlen - 1, generator=torch.Generator().manual_seed(1))[:args.documents - 1] + 1
        cu = [0] + sorted(cuts.tolist()) + [args.seqlen]
        doc_lengths = [b - a for a, b in zip(cu, cu[1:])]
        say(f"{args.documents} documents, {min(doc_lengths)} to {max(doc_lengths)} tokens")
        cu_gpu, cu_cpu = torch.tensor(cu, dtype=torch.int32, device="cuda"), torch.tensor(cu, dtype=torch.int32)
        single = lambda q, k, v: fa3.attention_varlen(q[0], k[0], v[0], cu_gpu, cu_gpu, causal=args.causal)[None]
        ring_attn = lambda q, k, v: fa3.context_parallel_attention(q[0], k[0], v[0], causal=args.causal,
                                                                   cu_seqlens=cu_cpu, zigzag=args.causal)[None]
        documents = ring.Documents(cu, dist.get_rank(), world, args.seqlen // world, args.causal, args.causal,
                                   "cuda")

    say("fa3 1 GPU: compile, then forward and forward + backward")
    fwd, fwd_bwd = fwd_bwd_runner(single, q, k, v, dout)
    rows.append(("fa3 1 GPU", 1, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters), 0.0))
    reference_shard = context_parallel.shard(fwd(), zigzag=args.causal)

    shards = [context_parallel.shard(t, zigzag=args.causal) for t in (q, k, v, dout)]
    say(f"fa3 ring on {world} GPUs: compile, then forward and forward + backward")
    fwd, fwd_bwd = fwd_bwd_runner(ring_attn, *shards)
    rows.append(("fa3 ring", world, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters),
                 rel_err(fwd(), reference_shard)))

    say("fa3 ring, compute only (no communication)")
    local = context_parallel.fa3_local(1.0 / math.sqrt(args.head_dim))
    loopback = ring.Loopback(dist.get_rank(), world)
    compute = lambda q, k, v: ring.ring_attention(q, k, v, local, loopback, args.causal, documents)[0]
    fwd, fwd_bwd = fwd_bwd_runner(compute, *shards)
    rows.append(("fa3 compute only", world, timed_ms(fwd, args.iters), timed_ms(fwd_bwd, args.iters), None))

    if args.documents and (args.simulate_ranks or args.peers):
        say("--documents: no simulated ranks and no torch CP rows (it has no document masking)")
        args.simulate_ranks, args.peers = 0, ""
    if args.simulate_ranks:
        rows.append(simulated_row(args, local, q, k, v, dout))

    if args.peers:
        say(f"torch context_parallel on {world} GPUs")
        rows += torch_cp_rows(args, q, k, v, dout, reference_shard, mesh)

    flops = 3.5 * sum(attention_flops(args.batch, args.heads, n, n, args.head_dim, args.causal) for n in doc_lengths)
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
