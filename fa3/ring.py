"""Ring attention: the algorithm behind fa3.context_parallel_attention, free of any kernel.

Each of the W ranks of a process group holds a shard of the sequence: its queries Q_r and its
keys/values KV_r, every rank with the same shapes. In W steps every Q_r meets every KV_j:

    step s: rank r holds KV_(r - s) mod W; it sends that block on to rank r + 1 and receives
            KV_(r - s - 1) from rank r - 1 (torch.distributed batched isend/irecv) while it runs
            the local attention of Q_r against the block it holds: a partial (O_s, LSE_s)
    merge:  LSE = log(exp(LSE) + exp(LSE_s)),  O = O exp(LSE_old - LSE) + O_s exp(LSE_s - LSE)
            in FP32, per query row: exactly the softmax over the union of the key sets.

Backward: softmax attention's gradient splits over key blocks once the *global* O and LSE are known
(P_s = exp(S_s - LSE), D = rowsum(dO * O)), so each step runs the local backward of Q_r against
KV_(r - s) with the global O and LSE: dQ_r accumulates at home (FP32), while the FP32 dK/dV
accumulator of each block travels around the ring with it, picking up every rank's share; after W
steps it arrives back at the block's owner. K/V travel again (they are not kept from the forward).

Causal masking needs a load-balanced layout: the sequence cut in 2W chunks, rank r holding chunks
r and 2W - 1 - r ("zig-zag", Megatron's and ring-flash-attn's layout, torch's head-tail load
balancer). Then each step is one of three equal-cost calls (`plan`): the diagonal block (causal),
all queries against the first half of the block (the block came from a lower rank), or the second
half of the queries against the whole block (a higher rank). Without causal any layout works.

Packed documents (`Documents`): the sequence may hold several documents back to back (global
offsets cu_seqlens, as attention_varlen's), each attending only to itself. The shards are cut from
the packed sequence as before, so every step's query rows and key rows are runs of global positions
in increasing order, and each document's share of them is one contiguous run on each side: the
step becomes one packed (varlen) call whose entries are the documents, with their per-step
(cu_seqlens_q, cu_seqlens_k). The zig-zag plan keeps its meaning: off the diagonal every key of a
step precedes every query, so those entries are unmasked; on the diagonal each document's queries
and keys are the same run, so causal is causal within the document. A step that shares no
document with its block computes nothing (its messages still travel).

The local attention is a parameter (`LocalAttention`: forward -> (out, lse), backward with given
out and lse -> (dq, dk, dv)), and so is the transport (`Ring`, or `Loopback`: no communication, the
compute-only timing): the schedule, the merge and the gradient bookkeeping run on CPU with gloo
and a float64 reference just as on GPUs with NCCL and fa3's kernels.

Overlap: NCCL runs the transfers on its own stream; `Pending.wait()` makes the current stream
(not the host) wait for them, after the step's kernels are queued, so each transfer overlaps one
step of attention.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist


class LocalAttention(NamedTuple):
    """The attention of one block, in fa3's (batch, seqlen, heads, head_dim) layout, scale bound in.

    forward(q, k, v, causal, offsets) -> (out, lse (batch, heads_q, seqlen_q) FP32)
    backward(dout, q, k, v, out, lse, causal, offsets) -> (dq, dk, dv): the gradients of this
        block's share, given the *merged* out and lse of q's rows (dk, dv summed over each GQA group).
    offsets: None, or (cu_seqlens_q, cu_seqlens_k) int32 for batch 1 holding packed documents
        (`Documents`): attention within each entry only, causal per entry."""

    forward: Callable
    backward: Callable


class Pending:
    """A started exchange: wait() orders the current stream after it and returns the received
    tensor (the sent one is kept alive until then)."""

    def __init__(self, works, received: torch.Tensor, sent: torch.Tensor | None = None):
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self.sent = (), None
        return self.received


class Ring:
    """Sends to the next rank of `group` and receives from the previous one, both in one
    `dist.batch_isend_irecv` (one NCCL group call: no ordering deadlock)."""

    def __init__(self, group=None):
        group = group if group is not None else dist.group.WORLD
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def send_recv(self, tensor: torch.Tensor) -> Pending:
        """Start sending `tensor` (contiguous) to the next rank and receiving the previous rank's."""
        if self.size == 1:
            return Pending((), tensor)
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group)])
        return Pending(works, received, tensor)


class Loopback:
    """Rank `rank` of `size` without communication: every 'received' block is the sent one. The
    same kernels run with the same shapes as on a Ring (values are meaningless): the compute-only
    time that the ring's communication is measured against."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def send_recv(self, tensor: torch.Tensor) -> Pending:
        return Pending((), tensor)


ALL = slice(None)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results are summed in: FP32 (FP64 inputs, the CPU tests' reference, stay FP64)."""
    return torch.promote_types(dtype, torch.float32)


def plan(step: int, rank: int, causal: bool, half: int):
    """(query rows, key rows, causal) of step `step` on rank `rank`, zig-zag layout for causal:
    step 0 is the diagonal block; a block from a lower rank (step <= rank) is seen whole by all
    queries through its first half only; one from a higher rank is seen whole by the second half
    of the queries only."""
    if not causal:
        return ALL, ALL, False
    if step == 0:
        return ALL, ALL, True
    if step <= rank:
        return ALL, slice(None, half), False
    return slice(half, None), ALL, False


class Documents:
    """The packed documents of the sequence a ring splits, seen from one rank: for every step, the
    per-document (cu_seqlens_q, cu_seqlens_k) of the step's query rows and key rows (`plan`), all
    built on the host once per call and copied to the device in one transfer.

    cu_seqlens: the global offsets of the documents in the whole sequence (a list, or a tensor read
    once on the host), from 0 to size * seqlen; seqlen: the tokens of each shard; zigzag: the
    shards' layout (fa3.context_parallel.shard's)."""

    def __init__(self, cu_seqlens, rank: int, size: int, seqlen: int, causal: bool, zigzag: bool, device):
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
        parts = 2 * size if zigzag else size
        chunk = size * seqlen // parts

        def runs(owner: int, part: slice):  # global position runs of `owner`'s shard rows `part`
            chunks = (owner, parts - 1 - owner) if zigzag else (owner,)
            runs = [(c * chunk, (c + 1) * chunk) for c in chunks]
            return runs[len(runs) // 2:] if part.start else runs[:1] if part.stop else runs

        def lengths(ranges):  # each document's rows among the runs
            n = 0
            for a, b in ranges:
                clamped = cu.clamp(a, b)
                n = n + (clamped[1:] - clamped[:-1])
            return n

        steps, flat = [], []
        for step in range(size):
            rows, keys, _ = plan(step, rank, causal, seqlen // 2)
            len_q, len_k = lengths(runs(rank, rows)), lengths(runs((rank - step) % size, keys))
            if not bool(((len_q > 0) & (len_k > 0)).any()):
                steps.append(None)  # no document on both sides: nothing to attend
                continue
            kept = (len_q > 0) | (len_k > 0)  # the entries cover every row and key of the step
            zero = torch.zeros(1, dtype=torch.int64)
            offsets = [torch.cat((zero, n[kept].cumsum(0))) for n in (len_q, len_k)]
            steps.append((sum(len(o) for o in flat), len(offsets[0])))
            flat += offsets
        packed = torch.cat(flat).to(torch.int32).to(device) if flat else None
        self.offsets = [None if s is None else (packed[s[0]:s[0] + s[1]], packed[s[0] + s[1]:s[0] + 2 * s[1]])
                        for s in steps]

    def at(self, step: int):
        """(cu_seqlens_q, cu_seqlens_k) of step `step`, or None when it computes nothing."""
        return self.offsets[step]


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """In place: out (batch, seqlen, heads, d) and lse (batch, heads, seqlen), FP32, become the
    softmax over both key sets. Rows that no key has seen yet (LSE = -inf) stay 0."""
    new = torch.logaddexp(lse, block_lse)
    base = torch.where(new == float("-inf"), 0.0, new)  # -inf - -inf would be NaN
    old_w = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)
    block_w = torch.exp(block_lse - base).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_w).add_(block_out.to(out.dtype) * block_w)
    lse.copy_(new)


def ring_forward(local: LocalAttention, q, k, v, ring, causal: bool, documents: Documents | None = None):
    """(out in q's dtype, lse FP32) of this rank's queries against every rank's keys (within each
    document of `documents`, if given: then batch is 1)."""
    kv = torch.stack((k, v))  # one message per step
    half = q.shape[1] // 2
    out = lse = None
    for step in range(ring.size):
        pending = ring.send_recv(kv) if step + 1 < ring.size else None
        rows, keys, block_causal = plan(step, ring.rank, causal, half)
        offsets = documents.at(step) if documents is not None else None
        if documents is None or offsets is not None:
            block_out, block_lse = local.forward(q[:, rows], kv[0][:, keys], kv[1][:, keys], block_causal,
                                                 offsets)
            if out is None:  # step 0 (the rank's own block) covers every row
                out, lse = block_out.to(accumulator_dtype(q.dtype)), block_lse
            else:
                merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(local: LocalAttention, dout, q, k, v, out, lse, ring, causal: bool,
                  documents: Documents | None = None):
    """(dq, dk, dv) of this rank's shard: dq summed here, each block's dK/dV summed as it travels."""
    kv = torch.stack((k, v))
    half = q.shape[1] // 2
    acc = accumulator_dtype(q.dtype)
    dq = dkv = pending_dkv = None
    for step in range(ring.size):
        pending_kv = ring.send_recv(kv) if step + 1 < ring.size else None
        rows, keys, block_causal = plan(step, ring.rank, causal, half)
        offsets = documents.at(step) if documents is not None else None
        grads = None
        if documents is None or offsets is not None:
            grads = local.backward(dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys],
                                   out[:, rows], lse[:, :, rows], block_causal, offsets)
        if step == 0:  # the rank's own block covers every row and key: the sums start from it
            bdq, bdk, bdv = grads
            dq = bdq.to(acc)
            dkv = torch.empty(kv.shape, dtype=acc, device=q.device)
            dkv[0].copy_(bdk)
            dkv[1].copy_(bdv)
        else:  # this block's accumulator arrives from the previous rank
            dkv = pending_dkv.wait()
            if grads is not None:
                bdq, bdk, bdv = grads
                dq[:, rows] += bdq
                dkv[0][:, keys] += bdk
                dkv[1][:, keys] += bdv
        pending_dkv = ring.send_recv(dkv)
        if pending_kv is not None:
            kv = pending_kv.wait()
    dkv = pending_dkv.wait()  # this rank's own block, back from its trip
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """ring_forward / ring_backward as one differentiable call; lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, local, ring, causal, documents):
        out, lse = ring_forward(local, q, k, v, ring, causal, documents)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.local, ctx.ring, ctx.causal, ctx.documents = local, ring, causal, documents
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.local, dout, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.documents)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, local: LocalAttention, ring, causal: bool, documents: Documents | None = None):
    """(out, lse) of this rank's shard, differentiable in q, k, v (RingAttention)."""
    return RingAttention.apply(q, k, v, local, ring, causal, documents)
