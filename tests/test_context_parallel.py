"""Context parallelism (fa3.ring, fa3.context_parallel): the ring, the zig-zag bookkeeping, the LSE
merge and the travelling dK/dV, against single-process attention.

CPU: ranks are processes spawned with torch.multiprocessing on the gloo backend, the local
attention a float64 reference (fa3.reference) standing in for the kernels: every rank's out and
grads, gathered, must equal the single-process float64 attention of the whole sequence (causal and
not, GQA, a 3-rank ring and a 2-rank subgroup). GPU (2+ Hopper GPUs): 2 ranks on NCCL running fa3's
kernels, against single-GPU fa3.attention on the whole sequence, within 2x its error against
float64. One GPU: the ranks as threads of one process (ThreadRing) running fa3's kernels on every
step's slices.
"""

import queue
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fa3
from fa3 import context_parallel, ring
from fa3.reference import attention_backward_reference, attention_reference

from conftest import HAS_HOPPER, raises_with, rel_err

# (tokens per zig-zag chunk: the sequence is 2 * world_size chunks, heads_q, heads_kv, head_dim)
CPU_CASES = [(3, 2, 2, 8), (5, 4, 2, 8)]


def _entries(offsets):
    """(query rows, key rows) of each entry of a packed step's (cu_seqlens_q, cu_seqlens_k)."""
    cu_q, cu_k = (o.tolist() for o in offsets)
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]


def _reference_local(scale):
    """The float64 reference as the ring's local attention (the kernels' stand-in); a packed step
    (offsets) entry by entry, rows of an entry without keys 0 with LSE -inf."""

    def forward(q, k, v, causal, offsets=None):
        if offsets is None:
            out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=torch.float64)
            return out.contiguous(), lse
        out = torch.zeros_like(q)
        lse = torch.full((1, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64)
        for rows, keys in _entries(offsets):
            if rows.stop > rows.start and keys.stop > keys.start:
                out[:, rows], lse[:, :, rows] = attention_reference(
                    q[:, rows], k[:, keys], v[:, keys], causal=causal, softmax_scale=scale, dtype=torch.float64)
        return out, lse

    def backward(dout, q, k, v, out, lse, causal, offsets=None):
        if offsets is None:
            return attention_backward_reference(dout, q, k, v, out, lse, causal, scale)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for rows, keys in _entries(offsets):
            if rows.stop > rows.start and keys.stop > keys.start:
                dq, dk, dv = attention_backward_reference(dout[:, rows], q[:, rows], k[:, keys], v[:, keys],
                                                          out[:, rows], lse[:, :, rows], causal, scale)
                grads[0][:, rows] += dq
                grads[1][:, keys] += dk
                grads[2][:, keys] += dv
        return tuple(grads)

    return ring.LocalAttention(forward, backward)


def _documents_reference(q, k, v, cu_seqlens, causal, scale):
    """Attention within each document of a packed batch-1 sequence, differentiable: (out, lse)."""
    outs, lses = [], []
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        if b > a:
            out, lse = attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal, softmax_scale=scale,
                                           dtype=q.dtype if q.dtype == torch.float64 else torch.float32)
            outs.append(out)
            lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _documents(seqlen: int, seed: int) -> list[int]:
    """Random document offsets over `seqlen` tokens, with an empty document and a one-token one."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, seqlen, (4,), generator=g).tolist())
    return [0, cuts[0], cuts[0], cuts[0] + 1] + [c for c in cuts[1:] if c > cuts[0] + 1] + [seqlen]


def _global_inputs(seqlen, heads_q, heads_kv, head_dim, seed, device="cpu", dtype=torch.float64):
    """The same q, k, v, dout on every rank (one seed)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(heads):
        return torch.randn(2, seqlen, heads, head_dim, generator=g, device=device, dtype=dtype)

    return randn(heads_q), randn(heads_kv), randn(heads_kv), randn(heads_q)


def _spawn(fn, world_size, *args):
    """Run fn(rank, world_size, init_method, *args) in `world_size` processes; a failure in any
    raises here with its traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world_size, f"file://{tmp}/init", *args), nprocs=world_size, join=True)


def _cpu_ranks(rank, world_size, init_method):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        # a ring of every rank, then one of global ranks 1 and 2 (group ranks 0 and 1)
        pair = dist.new_group([1, 2])
        for group, members in ((None, range(world_size)), (pair, (1, 2))):
            if rank not in members:
                continue
            for i, (chunk, heads_q, heads_kv, head_dim) in enumerate(CPU_CASES):
                for causal in (True, False):
                    _check_cpu_case(group, 2 * len(members) * chunk, heads_q, heads_kv, head_dim, causal,
                                    seed=10 * i + causal)
                    _check_cpu_documents(group, 2 * len(members) * chunk, heads_q, heads_kv, head_dim, causal,
                                         seed=10 * i + causal)
            _check_unshard(group, len(members))
    finally:
        dist.destroy_process_group()


def _check_cpu_case(group, seqlen, heads_q, heads_kv, head_dim, causal, seed):
    scale = 0.7 / head_dim ** 0.5
    q, k, v, dout = _global_inputs(seqlen, heads_q, heads_kv, head_dim, seed)
    zigzag = causal or seed % 2 == 0  # non-causal: contiguous shards as well
    local = [context_parallel.shard(t, group, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
    out, lse = ring.ring_attention(*local, _reference_local(scale), ring.Ring(group), causal)
    out.backward(context_parallel.shard(dout, group, zigzag=zigzag))
    got = [context_parallel.unshard(t, group, zigzag=zigzag) for t in (out, lse.transpose(1, 2))]
    got += [context_parallel.unshard(t.grad, group, zigzag=zigzag) for t in local]

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref_in, causal=causal, softmax_scale=scale, dtype=torch.float64)
    ref_out.backward(dout)
    expected = [ref_out, ref_lse.transpose(1, 2)] + [t.grad for t in ref_in]
    case = (f"{dist.get_world_size(group)} ranks, seqlen={seqlen} heads={heads_q}/{heads_kv} "
            f"causal={causal} zigzag={zigzag}")
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert a.shape == b.shape, f"{case}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"{case}: {name} has NaN/inf"
        assert rel_err(a, b) < 1e-12, f"{case}: {name} rel err {rel_err(a, b):.2e}"


def _check_cpu_documents(group, seqlen, heads_q, heads_kv, head_dim, causal, seed):
    """Packed documents through the ring (ring.Documents), against attention within each document."""
    scale = 0.6 / head_dim ** 0.5
    q, k, v, dout = (t[:1] for t in _global_inputs(seqlen, heads_q, heads_kv, head_dim, seed + 100))
    cu = _documents(seqlen, seed)
    zigzag = causal or seed % 2 == 0
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = [context_parallel.shard(t, group, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
    documents = ring.Documents(cu, rank, size, seqlen // size, causal, zigzag, "cpu")
    out, lse = ring.ring_attention(*local, _reference_local(scale), ring.Ring(group), causal, documents)
    out.backward(context_parallel.shard(dout, group, zigzag=zigzag))
    got = [context_parallel.unshard(t, group, zigzag=zigzag) for t in (out, lse.transpose(1, 2))]
    got += [context_parallel.unshard(t.grad, group, zigzag=zigzag) for t in local]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _documents_reference(*ref_in, cu, causal, scale)
    ref_out.backward(dout)
    expected = [ref_out, ref_lse.transpose(1, 2)] + [t.grad for t in ref_in]
    case = f"{size} ranks, documents {cu} heads={heads_q}/{heads_kv} causal={causal} zigzag={zigzag}"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(a).all(), f"{case}: {name} has NaN/inf"
        assert rel_err(a, b) < 1e-12, f"{case}: {name} rel err {rel_err(a, b):.2e}"


def _check_unshard(group, world_size):
    x = torch.arange(2 * 4 * world_size * 3, dtype=torch.float64).view(2, 4 * world_size, 3)
    for zigzag in (True, False):
        part = context_parallel.shard(x, group, zigzag=zigzag)
        expected = context_parallel.positions(x.shape[1], dist.get_rank(group), world_size, zigzag)
        assert torch.equal(part, x[:, expected])
        assert torch.equal(context_parallel.unshard(part, group, zigzag=zigzag), x)


def test_ring_matches_single_process():
    """3 gloo ranks, float64 local attention: out, lse, dq, dk, dv of a 3-rank ring and of a ring
    of global ranks 1 and 2 (a subgroup) equal single-process attention, also over packed
    documents (attention within each)."""
    _spawn(_cpu_ranks, 3)


@pytest.mark.parametrize("causal", [True, False])
def test_loopback_runs_the_same_schedule(causal):
    """The compute-only transport: a 1-rank ring is plain attention; a Loopback rank runs the
    schedule of its rank (shapes of every step) without a process group."""
    scale = 0.3
    q, k, v, dout = _global_inputs(12, 4, 2, 8, seed=3)
    local = _reference_local(scale)
    out, lse = ring.ring_forward(local, q, k, v, ring.Loopback(0, 1), causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale, dtype=torch.float64)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    for rank in range(3):
        grads = ring.ring_backward(local, dout, q, k, v, out, lse, ring.Loopback(rank, 3), causal)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_reference_backward_matches_autograd():
    """fa3.reference.attention_backward_reference against autograd of the reference forward, and
    its block additivity: with the whole row's out and lse, two key halves' grads sum to the whole."""
    scale = 0.5
    q, k, v, dout = _global_inputs(10, 4, 2, 8, seed=5)
    for causal in (True, False):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention_reference(*inputs, causal=causal, softmax_scale=scale, dtype=torch.float64)
        out.backward(dout)
        grads = attention_backward_reference(dout, q, k, v, out.detach(), lse.detach(), causal, scale)
        for g, t in zip(grads, inputs):
            assert rel_err(g, t.grad) < 1e-12
    out, lse = attention_reference(q, k, v, softmax_scale=scale, dtype=torch.float64)
    whole = attention_backward_reference(dout, q, k, v, out, lse, False, scale)
    first = attention_backward_reference(dout, q, k[:, :4], v[:, :4], out, lse, False, scale)
    second = attention_backward_reference(dout, q, k[:, 4:], v[:, 4:], out, lse, False, scale)
    assert rel_err(first[0] + second[0], whole[0]) < 1e-12
    assert rel_err(torch.cat([first[1], second[1]], 1), whole[1]) < 1e-12


def test_merge_is_exact_and_keeps_unseen_rows_zero():
    """Merging two key blocks' (out, lse) gives the attention over both; rows that saw no key in
    either block stay 0 with LSE -inf (no NaN)."""
    q, k, v, _ = _global_inputs(6, 2, 2, 4, seed=7)
    full_out, full_lse = attention_reference(q, k, v, dtype=torch.float64)
    out, lse = attention_reference(q, k[:, :2], v[:, :2], dtype=torch.float64)
    block_out, block_lse = attention_reference(q, k[:, 2:], v[:, 2:], dtype=torch.float64)
    out, lse = out.contiguous(), lse.clone()
    ring.merge(out, lse, block_out, block_lse)
    assert rel_err(out, full_out) < 1e-12 and rel_err(lse, full_lse) < 1e-12
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    ring.merge(empty_out, empty_lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert (empty_out == 0).all() and (empty_lse == float("-inf")).all()


def test_zigzag_positions_match_torch_head_tail_balancer():
    """fa3's zig-zag shards hold the tokens of torch's context_parallel load balancer, so buffers
    torch shards (labels, rotary tables) line up with fa3's."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel")
    for world_size in (2, 4):
        seqlen = 8 * world_size
        order = balancer._HeadTailLoadBalancer(seqlen, world_size, "cpu")._generate_indices()[0]
        for rank, theirs in enumerate(order.chunk(world_size)):
            assert torch.equal(context_parallel.positions(seqlen, rank, world_size), theirs)
        assert sorted(torch.cat([context_parallel.positions(seqlen, r, world_size, zigzag=False)
                                 for r in range(world_size)]).tolist()) == list(range(seqlen))


def test_validation_messages():
    q = torch.zeros(1, 6, 2, 64, dtype=torch.bfloat16)
    raises_with(context_parallel.positions, ValueError, "multiple of 8", seqlen=12, rank=0, world_size=4)
    raises_with(fa3.context_parallel_attention, ValueError, "even seqlen", "shard",
                q=q[:, :5], k=q[:, :5], v=q[:, :5])
    raises_with(fa3.context_parallel_attention, ValueError, "same even seqlen", q=q, k=q[:, :4], v=q[:, :4])
    raises_with(fa3.context_parallel_attention, TypeError, "q must be a torch.Tensor", q=None, k=q, v=q)
    raises_with(fa3.context_parallel_attention, ValueError, "v has head_dim 32", "one head_dim",
                q=q, k=q, v=q[..., :32])
    raises_with(fa3.context_parallel_attention, ValueError, "CUDA GPU", q=q, k=q, v=q)
    raises_with(context_parallel.shard, RuntimeError, "init_process_group", x=q)
    raises_with(fa3.context_parallel_attention, ValueError, "same seqlen per rank", "packed documents",
                q=q[0], k=q[0, :4], v=q[0, :4], causal=False, cu_seqlens=[0, 12])
    check = context_parallel.check_documents
    raises_with(check, ValueError, "from 0 to the whole sequence's 12 tokens", cu_seqlens=[0, 5, 10],
                tokens=12, causal=True, zigzag=True)
    raises_with(check, ValueError, "non-decreasing", "entry 2 is 3 after 5", cu_seqlens=[0, 5, 3, 12],
                tokens=12, causal=True, zigzag=True)
    raises_with(check, ValueError, "1-D integer tensor", cu_seqlens=torch.tensor([0.0, 12.0]), tokens=12,
                causal=True, zigzag=True)
    raises_with(check, ValueError, "zigzag=True", cu_seqlens=[0, 12], tokens=12, causal=True, zigzag=False)
    assert check(torch.tensor([0, 4, 12], dtype=torch.int32), 12, False, False) == [0, 4, 12]


class ThreadRing:
    """Rank `rank` of `size` threads of one process sharing one GPU stream: the n-th send_recv of a
    rank is received by the next rank's n-th (as NCCL matches posted operations in order). Stream
    order makes each copy visible to the kernels queued after the receiver's wait."""

    def __init__(self, rank: int, size: int, boxes: list, lock):
        self.rank, self.size, self.boxes, self.lock, self.posted = rank, size, boxes, lock, 0

    def _box(self, rank, seq):
        with self.lock:
            return self.boxes[rank].setdefault(seq, queue.Queue(1))

    def send_recv(self, tensor):
        seq, self.posted = self.posted, self.posted + 1
        self._box((self.rank + 1) % self.size, seq).put(tensor.clone())
        box = self._box(self.rank, seq)
        return _Waiting(box)


class _Waiting:
    def __init__(self, box):
        self.box = box

    def wait(self):
        return self.box.get(timeout=300)


def _thread_ranks(size, work):
    """work(rank, ring) on `size` threads; returns their results in rank order (re-raising)."""
    boxes, lock, results = [{} for _ in range(size)], threading.Lock(), [None] * size

    def run(rank):
        try:
            results[rank] = work(rank, ThreadRing(rank, size, boxes, lock))
        except BaseException as e:  # noqa: BLE001  (handed to the main thread)
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_thread_ring_matches_single_process():
    """ThreadRing (the one-GPU test's transport) against the reference on CPU: 4 ranks."""
    world, scale = 4, 0.4
    q, k, v, dout = _global_inputs(2 * world * 2, 4, 2, 8, seed=11)
    local = _reference_local(scale)

    def work(rank, r):
        pos = context_parallel.positions(q.shape[1], rank, world)
        shard = [t[:, pos] for t in (q, k, v, dout)]
        out, lse = ring.ring_forward(local, *shard[:3], r, True)
        return (out, *ring.ring_backward(local, shard[3], *shard[:3], out, lse, r, True))

    got = _thread_ranks(world, work)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_reference(*ref_in, causal=True, softmax_scale=scale, dtype=torch.float64)
    ref_out.backward(dout)
    order = torch.cat([context_parallel.positions(q.shape[1], r, world) for r in range(world)])
    for i, ref in enumerate([ref_out] + [t.grad for t in ref_in]):
        gathered = torch.cat([g[i] for g in got], 1)
        assert rel_err(gathered, ref[:, order]) < 1e-12


GPU_THREAD_CASES = [  # (ranks, tokens per chunk, heads_q, heads_kv, head_dim, causal)
    (2, 333, 4, 4, 128, True),
    (2, 333, 4, 2, 128, False),
    (3, 200, 8, 2, 64, True),
    (2, 256, 2, 1, 256, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("world, chunk, heads_q, heads_kv, head_dim, causal", GPU_THREAD_CASES)
def test_ring_with_fa3_kernels_on_one_gpu(world, chunk, heads_q, heads_kv, head_dim, causal):
    """The ring's schedule with fa3's kernels on every step's slices (halves of q, k, v, out, dout
    and lse as views), ranks as threads on one GPU: out and grads against single-GPU
    fa3.attention, within 2x its error against float64."""
    seqlen = 2 * world * chunk
    q, k, v, dout = _global_inputs(seqlen, heads_q, heads_kv, head_dim, 0, "cuda", torch.bfloat16)
    local = context_parallel.fa3_local(1.0 / head_dim ** 0.5)
    for c in (True, False):  # compile outside the threads
        out, lse = local.forward(q, k, v, c)
        local.backward(dout, q, k, v, out, lse, c)
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))  # poison what the results reuse

    def work(rank, r):
        pos = context_parallel.positions(seqlen, rank, world, zigzag=True).cuda()
        shard = [t[:, pos] for t in (q, k, v, dout)]
        out, lse = ring.ring_forward(local, *shard[:3], r, causal)
        return (out, *ring.ring_backward(local, shard[3], *shard[:3], out, lse, r, causal))

    got = _thread_ranks(world, work)
    order = torch.cat([context_parallel.positions(seqlen, r, world) for r in range(world)]).cuda()
    single_in = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out = fa3.attention(*single_in, causal=causal)
    single_out.backward(dout)
    exact_in = [t.double().requires_grad_() for t in (q, k, v)]
    exact_out, _ = attention_reference(*exact_in, causal=causal, dtype=torch.float64)
    exact_out.backward(dout.double())
    single = [single_out] + [t.grad for t in single_in]
    exact = [exact_out] + [t.grad for t in exact_in]
    _assert_near(f"{world} ranks, causal={causal}", ("out", "dq", "dk", "dv"),
                 [torch.cat([res[i] for res in got], 1) for i in range(4)],
                 [t[:, order] for t in single], [t[:, order] for t in exact])


def _assert_near(case, names, got, single, exact):
    """Each result's error against float64 within 2x single-GPU fa3's (plus 1e-3), finite."""
    for name, g, s, e in zip(names, got, single, exact):
        assert g.shape == s.shape and g.dtype == s.dtype, f"{case}: {name} {g.shape} {g.dtype}"
        assert torch.isfinite(g).all(), f"{case}: {name} has NaN/inf"
        err, base = rel_err(g, e), rel_err(s, e)
        assert err <= 2 * base + 1e-3, f"{case}: {name} rel err {err:.2e}, single GPU {base:.2e}"


def _packed_single_and_exact(q, k, v, dout, cu, causal):
    """(out, dq, dk, dv) of single-GPU fa3.attention_varlen over documents `cu` of packed q, k, v
    (tokens, heads, d), and the same in float64."""
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    single_in = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out = fa3.attention_varlen(*single_in, cu_t, cu_t, causal=causal)
    single_out.backward(dout)
    exact_in = [t.double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
    exact_out, _ = _documents_reference(*exact_in, cu, causal, 1.0 / q.shape[-1] ** 0.5)
    exact_out.backward(dout.double().unsqueeze(0))
    return [single_out] + [t.grad for t in single_in], [exact_out[0]] + [t.grad[0] for t in exact_in]


@pytest.mark.gpu
@pytest.mark.parametrize("world, chunk, heads_q, heads_kv, head_dim, causal", GPU_THREAD_CASES[:3])
def test_ring_over_documents_with_fa3_kernels_on_one_gpu(world, chunk, heads_q, heads_kv, head_dim, causal):
    """Packed documents through the ring with fa3's varlen kernels on every step (ranks as threads
    on one GPU): against single-GPU fa3.attention_varlen over the same documents."""
    seqlen = 2 * world * chunk
    q, k, v, dout = (t[0] for t in _global_inputs(seqlen, heads_q, heads_kv, head_dim, 1, "cuda", torch.bfloat16))
    cu = _documents(seqlen, seed=world + chunk)
    single, exact = _packed_single_and_exact(q, k, v, dout, cu, causal)  # (compiles outside the threads)
    local = context_parallel.fa3_local(1.0 / head_dim ** 0.5)
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))

    def work(rank, r):
        pos = context_parallel.positions(seqlen, rank, world).cuda()
        shard = [t[pos].unsqueeze(0) for t in (q, k, v, dout)]
        documents = ring.Documents(cu, rank, world, seqlen // world, causal, True, q.device)
        out, lse = ring.ring_forward(local, *shard[:3], r, causal, documents)
        grads = ring.ring_backward(local, shard[3], *shard[:3], out, lse, r, causal, documents)
        return [t[0] for t in (out, *grads)]

    got = _thread_ranks(world, work)
    order = torch.cat([context_parallel.positions(seqlen, r, world) for r in range(world)]).cuda()
    _assert_near(f"{world} ranks, documents {cu}, causal={causal}", ("out", "dq", "dk", "dv"),
                 [torch.cat([res[i] for res in got]) for i in range(4)],
                 [t[order] for t in single], [t[order] for t in exact])


# ---------------------------------------------------------------------------------------------
# GPU: 2 ranks on NCCL with fa3's kernels against single-GPU fa3.attention

GPU_CASES = [  # (global seqlen, heads_q, heads_kv, head_dim, causal): chunks of 333 tokens (ragged tiles)
    (1332, 4, 4, 128, True),
    (1332, 4, 4, 128, False),
    (1332, 8, 2, 128, True),
    (1332, 4, 1, 64, False),
    (2048, 4, 2, 64, True),
]


def _gpu_ranks(rank, world_size, init_method, deterministic):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    try:
        for i, case in enumerate(GPU_CASES):
            _check_gpu_case(*case, seed=i, deterministic=deterministic)
        for i, (seqlen, heads_q, heads_kv, head_dim, causal) in enumerate(GPU_CASES[:4]):
            _check_gpu_documents(seqlen, heads_q, heads_kv, head_dim, causal, seed=i,
                                 deterministic=deterministic)
    finally:
        dist.destroy_process_group()


def _check_gpu_case(seqlen, heads_q, heads_kv, head_dim, causal, seed, deterministic):
    q, k, v, dout = _global_inputs(seqlen, heads_q, heads_kv, head_dim, seed, "cuda", torch.bfloat16)
    case = f"seqlen={seqlen} heads={heads_q}/{heads_kv} d={head_dim} causal={causal}"
    local = [context_parallel.shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = fa3.context_parallel_attention(*local, causal=causal, return_lse=True,
                                              deterministic=deterministic)
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))  # poison what the grads reuse
    out.backward(context_parallel.shard(dout))
    got = [context_parallel.unshard(t) for t in (out, lse.transpose(1, 2).contiguous())]
    got += [context_parallel.unshard(t.grad) for t in local]

    single_in = [t.clone().requires_grad_() for t in (q, k, v)]
    single_out, single_lse = fa3.attention(*single_in, causal=causal, return_lse=True)
    single_out.backward(dout)
    single = [single_out, single_lse.transpose(1, 2)] + [t.grad for t in single_in]
    exact_in = [t.double().requires_grad_() for t in (q, k, v)]
    exact_out, exact_lse = attention_reference(*exact_in, causal=causal, dtype=torch.float64)
    exact_out.backward(dout.double())
    exact = [exact_out, exact_lse.transpose(1, 2)] + [t.grad for t in exact_in]
    _assert_near(case, ("out", "lse", "dq", "dk", "dv"), got, single, exact)
    if deterministic:  # bitwise repeatable
        again = [t.detach().clone().requires_grad_() for t in local]
        fa3.context_parallel_attention(*again, causal=causal, deterministic=True).backward(
            context_parallel.shard(dout))
        for t, u in zip(local, again):
            assert torch.equal(t.grad, u.grad), f"{case}: deterministic grads differ between runs"


def _check_gpu_documents(seqlen, heads_q, heads_kv, head_dim, causal, seed, deterministic):
    """fa3.context_parallel_attention over packed documents (cu_seqlens, (tokens, heads, d) shards)
    against single-GPU fa3.attention_varlen."""
    q, k, v, dout = (t[0] for t in _global_inputs(seqlen, heads_q, heads_kv, head_dim, seed + 50, "cuda",
                                                   torch.bfloat16))
    cu = _documents(seqlen, seed)
    case = f"documents {cu} heads={heads_q}/{heads_kv} d={head_dim} causal={causal}"
    local = [context_parallel.shard(t, dim=0).requires_grad_() for t in (q, k, v)]
    cu_cpu = torch.tensor(cu, dtype=torch.int32)
    out = fa3.context_parallel_attention(*local, causal=causal, cu_seqlens=cu_cpu, deterministic=deterministic)
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))
    out.backward(context_parallel.shard(dout, dim=0))
    got = [context_parallel.unshard(t, dim=0) for t in (out, *(t.grad for t in local))]
    _assert_near(case, ("out", "dq", "dk", "dv"), got, *_packed_single_and_exact(q, k, v, dout, cu, causal))
    if deterministic:
        again = [t.detach().clone().requires_grad_() for t in local]
        fa3.context_parallel_attention(*again, causal=causal, cu_seqlens=cu_cpu, deterministic=True).backward(
            context_parallel.shard(dout, dim=0))
        for t, u in zip(local, again):
            assert torch.equal(t.grad, u.grad), f"{case}: deterministic grads differ between runs"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER or torch.cuda.device_count() < 2, reason="needs 2 Hopper GPUs")
@pytest.mark.parametrize("deterministic", [False, True])
def test_ring_on_two_gpus_matches_single_gpu(deterministic):
    _spawn(_gpu_ranks, 2, deterministic)
