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
Packed documents (cu_seqlens): the packed tokens are sharded as one sequence (`shard(x, dim=0)`),
and each step of the ring becomes a packed call over the documents it sees (fa3.ring.Documents).

torch.distributed.tensor.experimental.context_parallel itself takes no custom attention op: it
dispatches the aten SDPA ops of DTensors to its own ring. A model under torch's context parallel
calls fa3.context_parallel_attention on the local shards instead of SDPA (benchmarks/cp_train.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _checks, _dispatch, backward, interface, ring, varlen


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
    """fa3's forward and backward kernels as the ring's local attention: fa3.attention, or for a
    step of packed documents (offsets given; batch 1) the packed (varlen) kernels."""

    def forward(q, k, v, causal, offsets=None):
        if offsets is None:
            return interface.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                                       kernel=kernel)
        out, lse = varlen.packed_attention(q[0], k[0], v[0], *offsets, None, None, causal, scale, (-1, -1), 0.0,
                                           kernel, check_values=False)  # (the ring built the offsets)
        return out.unsqueeze(0), lse.unsqueeze(0)

    def backward_(dout, q, k, v, out, lse, causal, offsets=None):
        if offsets is None:
            return backward.attention_backward(dout, q, k, v, out, lse.contiguous(), causal=causal,
                                               softmax_scale=scale, deterministic=deterministic,
                                               backward_kernel=backward_kernel)
        grads = backward.attention_varlen_backward(dout[0], q[0], k[0], v[0], out[0], lse[0].contiguous(),
                                                   *offsets, causal=causal, softmax_scale=scale,
                                                   deterministic=deterministic, backward_kernel=backward_kernel)
        return tuple(g.unsqueeze(0) for g in grads)

    return ring.LocalAttention(forward, backward_)


def check_context_parallel(q, k, v, causal: bool, packed: bool = False) -> None:
    """What the ring needs beyond fa3.attention's checks: causal shards are zig-zag halves
    (`packed`: q, k, v of one shard of packed documents, (tokens, heads, head_dim))."""
    layout = "(tokens, heads_kv, head_dim)" if packed else _checks.KV_LAYOUT
    q_shape, k_shape = _checks.check_qkv(q, k, v, layout)
    if v.shape[-1] != q_shape[-1]:  # k and v travel the ring as one stacked message
        raise ValueError(f"v has head_dim {v.shape[-1]} but q and k have {q_shape[-1]}; context "
                         "parallelism needs one head_dim for q, k and v (pad v and slice the output)")
    seq = 0 if packed else 1
    if (causal or packed) and (q_shape[seq] != k_shape[seq] or (causal and q_shape[seq] % 2)):
        what = "causal context parallelism" if causal else "context parallelism over packed documents"
        raise ValueError(f"{what} takes shards of one sequence: q, k and v must have the same "
                         f"{'even ' if causal else ''}seqlen per rank, got q {q_shape[seq]} and k {k_shape[seq]}; "
                         "shard them with fa3.context_parallel.shard (the sequence a multiple of "
                         f"{'2 * ' if causal else ''}world_size)")


def check_documents(cu_seqlens, tokens: int, causal: bool, zigzag: bool) -> list[int]:
    """cu_seqlens of context_parallel_attention: the documents' offsets in the whole sequence (a
    list or an integer tensor, read on the host), 0 to `tokens`, non-decreasing."""
    if causal and not zigzag:
        raise ValueError("causal context parallelism needs zigzag=True (the layout of "
                         "fa3.context_parallel.shard's default)")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document offsets, got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()  # (a CPU tensor: no device sync)
    offsets = [int(c) for c in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the whole sequence's {tokens} tokens (world_size "
                         f"x the shard's), got {len(offsets)} offsets from {offsets[0] if offsets else None} "
                         f"to {offsets[-1] if offsets else None}")
    bad = next((i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing: entry {bad} is {offsets[bad]} after "
                         f"{offsets[bad - 1]}")
    return offsets


@torch.compiler.disable  # P2P calls are not traceable: compiled models call it as an opaque function
def context_parallel_attention(q, k, v, group=None, *, causal: bool = True,
                               softmax_scale: float | None = None, deterministic: bool = False,
                               return_lse: bool = False, kernel: str | None = None,
                               backward_kernel: str | None = None, cu_seqlens=None, zigzag: bool = True):
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
    cu_seqlens: packed documents (varlen inside the shards). The whole sequence holds documents back
        to back at these global offsets (a list or integer tensor, 0 to world_size * tokens, the
        same on every rank; read on the host once per call: a CPU tensor avoids a device sync), and
        each attends only within itself (causal: within itself, causally). q, k, v are then this
        rank's shard of the packed tokens, (tokens, heads, head_dim) as attention_varlen takes
        them, cut by fa3.context_parallel.shard(x, dim=0, zigzag=zigzag) (tokens even); lse is
        (heads_q, tokens). zigzag: the shards' layout (used with cu_seqlens; causal needs True).
    Returns this rank's out (shaped like q); the backward returns this rank's dq, dk, dv.

    Every rank of the group must call it, with the same arguments, in the same order. Under
    torch.compile it runs eagerly (a graph break: point-to-point calls are not traced).
    """
    packed = cu_seqlens is not None
    check_context_parallel(q, k, v, causal, packed)
    if packed:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    spec = interface.check_attention(q, k, v, kernel)
    if packed and kernel is not None:
        varlen.check_varlen_rung(spec, "kernel")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        bwd = _dispatch.memo_rung(_dispatch.backward_rung, backward_kernel, q.shape[3], bool(deterministic))
        if packed:
            varlen.check_varlen_rung(bwd, "backward_kernel")
        backward_kernel = bwd.name
    rank, size = _group_rank_size(group)
    documents = None
    if packed:
        offsets = check_documents(cu_seqlens, size * q.shape[1], bool(causal), bool(zigzag))
        documents = ring.Documents(offsets, rank, size, q.shape[1], bool(causal), bool(zigzag), q.device)
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    # a packed call leaves kernel=None to the fastest varlen rung
    local = fa3_local(scale, bool(deterministic), kernel if packed else spec.name, backward_kernel)
    out, lse = ring.ring_attention(q, k, v, local, ring.Ring(group), bool(causal), documents)
    if packed:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
