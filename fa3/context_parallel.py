"""Context parallelism: attention over a sequence split across the ranks of a torch.distributed group.

    out = fa3.context_parallel_attention(q, k, v, group=None, causal=True, softmax_scale=None,
                                         deterministic=False, return_lse=False, kernel=None,
                                         backward_kernel=None)           differentiable in q, k, v
    x_local = fa3.context_parallel.shard(x, group, dim=1)         this rank's part of a whole sequence
    x = fa3.context_parallel.unshard(x_local, group, dim=1)       the whole sequence, on every rank
    fa3.context_parallel.positions(seqlen, rank, world_size)      which tokens rank `rank` holds

Each rank passes its own shard of q, k and v (fa3's (batch, seqlen, heads, head_dim) layout, one
GPU per rank, the same shapes on every rank); K/V blocks travel around the ring while fa3's kernels
attend to the block at hand, and the partial results merge exactly through their LSEs (the
algorithm and the overlap: fa3.ring). Causal attention needs the zig-zag layout of `shard` (the
sequence in 2 * world_size chunks, rank r holding chunks r and 2 * world_size - 1 - r): the same
tokens per rank as torch's context_parallel with load balancing (its head-tail balancer), so
buffers sharded by torch (input ids, labels, rotary tables) line up with fa3's shards.
Non-causal attention works on any split (`shard(..., zigzag=False)`: contiguous chunks).

torch.distributed.tensor.experimental.context_parallel itself takes no custom attention op: it
dispatches the aten SDPA ops of DTensors to its own ring. A model under torch's context parallel
calls fa3.context_parallel_attention on the local shards instead of SDPA (benchmarks/cp_train.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _checks, _dispatch, backward, interface, ring


def _chunks(seqlen: int, rank: int, world_size: int, zigzag: bool):
    """(chunk length, the chunks rank `rank` holds, in its order)."""
    parts = 2 * world_size if zigzag else world_size
    if seqlen % parts:
        raise ValueError(f"seqlen={seqlen} must be a multiple of {parts} ({'2 * ' if zigzag else ''}"
                         f"world_size) to shard it{' in zig-zag order' if zigzag else ''}: pad the sequence")
    return seqlen // parts, ((rank, parts - 1 - rank) if zigzag else (rank,))


def positions(seqlen: int, rank: int, world_size: int, zigzag: bool = True) -> torch.Tensor:
    """The token positions rank `rank` holds, in its order: zig-zag chunks rank and
    2 * world_size - 1 - rank of seqlen / (2 * world_size) tokens, or the rank-th of world_size
    contiguous chunks."""
    chunk, chunks = _chunks(seqlen, rank, world_size, zigzag)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def _group_rank_size(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs a torch.distributed process group: call "
                           "torch.distributed.init_process_group (e.g. under torchrun) first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not in group {group}: pass a "
                         "group it belongs to (None: the default group)")
    return rank, dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, *, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """This rank's part of `x`, a whole sequence along `dim` (the same `x` on every rank): the
    layout fa3.context_parallel_attention takes (zig-zag for causal). A new contiguous tensor."""
    chunk, chunks = _chunks(x.shape[dim], *_group_rank_size(group), zigzag)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in chunks], dim)


def unshard(x: torch.Tensor, group=None, *, dim: int = 1, zigzag: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's `x` (its shard, in `shard`'s layout), on every rank
    (an all-gather). Not differentiable."""
    _, size = _group_rank_size(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if not zigzag:
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]  # rank r: (chunk r, chunk 2 * size - 1 - r)
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def fa3_local(scale: float, deterministic: bool = False, kernel: str | None = None,
              backward_kernel: str | None = None) -> ring.LocalAttention:
    """fa3's forward and backward kernels as the ring's local attention."""

    def forward(q, k, v, causal):
        return interface.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                                   kernel=kernel)

    def backward_(dout, q, k, v, out, lse, causal):
        return backward.attention_backward(dout, q, k, v, out, lse.contiguous(), causal=causal,
                                           softmax_scale=scale, deterministic=deterministic,
                                           backward_kernel=backward_kernel)

    return ring.LocalAttention(forward, backward_)


def check_context_parallel(q, k, v, causal: bool) -> None:
    """What the ring needs beyond fa3.attention's checks: causal shards are zig-zag halves."""
    q_shape, k_shape = _checks.check_qkv(q, k, v, "(batch, seqlen_k, heads_kv, head_dim)")
    if v.shape[3] != q_shape[3]:  # k and v travel the ring as one stacked message
        raise ValueError(f"v has head_dim {v.shape[3]} but q and k have {q_shape[3]}; context "
                         "parallelism needs one head_dim for q, k and v (pad v and slice the output)")
    if causal and (q_shape[1] != k_shape[1] or q_shape[1] % 2):
        raise ValueError(f"causal context parallelism takes zig-zag shards of one sequence: q, k and v "
                         f"must have the same even seqlen per rank, got q {q_shape[1]} and k {k_shape[1]}; "
                         "shard them with fa3.context_parallel.shard (the sequence a multiple of "
                         "2 * world_size)")


@torch.compiler.disable  # P2P calls are not traceable: compiled models call it as an opaque function
def context_parallel_attention(q, k, v, group=None, *, causal: bool = True,
                               softmax_scale: float | None = None, deterministic: bool = False,
                               return_lse: bool = False, kernel: str | None = None,
                               backward_kernel: str | None = None):
    """Attention of this rank's queries against the keys of every rank of `group` (ring attention).

    q: (batch, seqlen_q, heads_q, head_dim), k, v: (batch, seqlen_k, heads_kv, head_dim): this
    rank's shard, as fa3.attention takes them (bf16/fp16 on this rank's Hopper GPU; GQA/MQA), the
    same shapes on every rank. group: a torch.distributed process group (None: the default one),
    NCCL for GPUs; its ranks form the ring in rank order.
    causal: the mask of the whole sequence, with q, k and v in the zig-zag layout of
        fa3.context_parallel.shard (seqlen per rank even). Otherwise any split of the keys works.
    softmax_scale: defaults to 1/sqrt(head_dim). deterministic, kernel, backward_kernel: as in
        fa3.attention (the ring sums the blocks' gradients in a fixed order).
    return_lse: also return the FP32 log-sum-exp of this rank's rows over all keys,
        (batch, heads_q, seqlen_q), not differentiable.
    Returns this rank's out (shaped like q); the backward returns this rank's dq, dk, dv.

    Every rank of the group must call it, with the same arguments, in the same order. Under
    torch.compile it runs eagerly (a graph break: point-to-point calls are not traced).
    """
    check_context_parallel(q, k, v, causal)
    spec = interface.check_attention(q, k, v, kernel)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        backward_kernel = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[3]).name
    _group_rank_size(group)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    local = fa3_local(scale, bool(deterministic), spec.name, backward_kernel)
    out, lse = ring.ring_attention(q, k, v, local, ring.Ring(group), bool(causal))
    return (out, lse) if return_lse else out
