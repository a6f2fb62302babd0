"""The host path of a call: no host sync in the steady state of any entry point, prepared launches
of repeated plain calls that compute what the full path computes, and the causal rungs' tile
counter, one a stream, which every kernel leaves at 0.

GPU: every entry point, after a warm-up call, runs under torch.cuda.set_sync_debug_mode("error")
with fresh index tensors (so that their deferred checks copy them again); a repeated plain
fa3.attention / fa3.gemm call (its prepared launch) against the first call's result; more causal
calls on two streams, fixed-length and packed, each stream's counter at 0 after them.
"""

import pytest
import torch

import fa3
from fa3 import _launch

from conftest import rel_err

BF16 = torch.bfloat16


def _rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _entry_points():
    """(name, call) for each entry point; a call makes its index tensors afresh (a new step: device
    copies of index tensors made here, since a tensor from host values is itself a host copy)."""
    cu_q, cu_k, cu_cache = _i32(0, 200, 500), _i32(0, 300, 500), _i32(0, 2, 5)
    lengths, cache_lengths = _i32(100, 250), _i32(10, 300)
    q, k, v = (_rand(2, 300, 8, 128) for _ in range(3))
    kv_grad = [t.clone().requires_grad_() for t in (q, k, v)]
    qd = _rand(1, 1, 32, 128)
    kd, vd = _rand(1, 16384, 8, 128), _rand(1, 16384, 8, 128)  # 64 MiB: the decode route (S1)
    qp, kp, vp = _rand(500, 8, 128), _rand(500, 2, 128), _rand(500, 2, 128)
    k_cache, v_cache = _rand(2, 512, 2, 128), _rand(2, 512, 2, 128)
    pages_k, pages_v = _rand(32, 16, 2, 128), _rand(32, 16, 2, 128)
    table = torch.arange(32, dtype=torch.int32, device="cuda").view(2, 16)
    new = _rand(2, 1, 2, 128)
    a, b = _rand(256, 1024), _rand(1024, 512)
    q8, k8, v8 = (fa3.quantize_fp8(t)[0] for t in (q, k, v))
    (qd8, qd_descale), (pk8, k_descale), (pv8, v_descale) = (fa3.quantize_fp8(t) for t in (qd[:, :, :8], pages_k,
                                                                                        pages_v))

    def backward():
        out = fa3.attention(*kv_grad, causal=True)
        out.backward(torch.ones_like(out))

    return [
        ("attention", lambda: fa3.attention(q, k, v)),
        ("attention causal", lambda: fa3.attention(q, k, v, causal=True)),
        ("attention window softcap", lambda: fa3.attention(q, k, v, window_size=(64, 0), softcap=20.0)),
        ("attention decode route", lambda: fa3.attention(qd, kd, vd, causal=True)),
        ("attention backward", backward),
        ("attention fp8", lambda: fa3.attention(q8, k8, v8, causal=True)),
        ("attention_varlen", lambda: fa3.attention_varlen(qp, kp, vp, cu_q.clone(), cu_k.clone(),
                                                          causal=True)),
        ("attention_varlen over a paged cache", lambda: fa3.attention_varlen(
            qp[:5], pages_k, pages_v, cu_cache.clone(), None, 3, 256, causal=True, block_table=table.clone(),
            seqused_k=lengths.clone())),
        ("attention_with_kvcache dense, append", lambda: fa3.attention_with_kvcache(
            qd[:, :, :8].expand(2, 1, 8, 128).contiguous(), k_cache, v_cache, new, new,
            cache_seqlens=cache_lengths.clone(), causal=True)),
        ("attention_with_kvcache paged", lambda: fa3.attention_with_kvcache(
            _rand(2, 1, 8, 128), pages_k, pages_v, cache_seqlens=lengths.clone(), block_table=table.clone(),
            causal=True)),
        ("attention_with_kvcache FP8 paged, FP8 q", lambda: fa3.attention_with_kvcache(
            qd8, pk8, pv8, cache_seqlens=lengths[:1].clone(), block_table=table[:1].clone(), causal=True,
            q_descale=qd_descale, k_descale=k_descale, v_descale=v_descale)),
        ("attention_with_kvcache FP8 paged, bf16 q, (batch, heads_kv) descales", lambda: fa3.attention_with_kvcache(
            _rand(2, 1, 8, 128), pk8, pv8, cache_seqlens=lengths.clone(), block_table=table.clone(), causal=True,
            k_descale=k_descale.expand(2, 2).contiguous(), v_descale=v_descale.expand(2, 2).contiguous())),
        ("flash_attn_func", lambda: fa3.flash_attn_func(q, k, v, causal=True)),
        ("flash_attn_varlen_func", lambda: fa3.flash_attn_varlen_func(
            qp, kp, vp, cu_q.clone(), cu_k.clone(), 300, 300, causal=True)),
        ("flash_attn_with_kvcache", lambda: fa3.flash_attn_with_kvcache(
            _rand(2, 1, 8, 128), pages_k, pages_v, cache_seqlens=lengths.clone(), block_table=table.clone(),
            causal=True)),
        ("gemm", lambda: fa3.gemm(a, b)),
        ("gemm split-K", lambda: fa3.gemm(a[:64], _rand(1024, 256))),
    ]


@pytest.mark.gpu
def test_no_host_sync_in_any_entry_point():
    """After a warm-up call (compiles, first allocations), no call synchronizes the host: the
    index checks are deferred (their copies run behind the kernels) and nothing else waits."""
    assert fa3.set_index_checks("deferred") == "deferred"  # (the default: nothing set it otherwise)
    calls = _entry_points()
    for _, call in calls:
        call()
    torch.cuda.synchronize()
    fa3.check_index_values()
    failed = []
    for name, call in calls:
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            call()
        except RuntimeError as exc:
            failed.append(f"{name}: {str(exc).splitlines()[0]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    fa3.check_index_values()  # and the good values passed their deferred checks
    assert not failed, "\n".join(failed)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_prepared_attention_launch_computes_the_same(causal):
    """The second plain call of a shape runs its prepared launch: the same result as the first
    (the forward is deterministic), also for new tensors of that shape and for packed-qkv views."""
    q, k, v = (_rand(2, 333, 8, 128) for _ in range(3))
    first = fa3.attention(q, k, v, causal=causal)
    assert torch.equal(fa3.attention(q, k, v, causal=causal), first)
    qkv = torch.stack([q, k, v], dim=2)  # (2, 333, 3, 8, 128): strided views, aligned
    views = qkv.unbind(2)
    assert torch.equal(fa3.attention(*views, causal=causal), first)
    assert torch.equal(fa3.attention(*views, causal=causal), first)
    q2 = _rand(2, 333, 8, 128)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q2, k, v)), is_causal=causal).transpose(1, 2)
    out, lse = fa3.attention(q2, k, v, causal=causal, return_lse=True)
    assert rel_err(out, ref) < 1e-2 and lse.shape == (2, 8, 333)
    with torch.no_grad():  # tensors that require grad, under no_grad: detached views
        assert torch.equal(fa3.attention(q.requires_grad_(), k, v, causal=causal), first)


@pytest.mark.gpu
def test_prepared_gemm_launch_computes_the_same():
    for m, n, k in ((128, 1024, 1024), (1024, 4096, 1024), (64, 256, 4096)):
        a, b = _rand(m, k), _rand(k, n)
        first = fa3.gemm(a, b)
        assert torch.equal(fa3.gemm(a, b), first)
        assert rel_err(fa3.gemm(a, b), a.float() @ b.float()) < 1e-2
        a2 = _rand(m, k)
        assert rel_err(fa3.gemm(a2, b), a2.float() @ b.float()) < 1e-2


@pytest.mark.gpu
def test_causal_kernels_leave_the_streams_counter_at_zero():
    """Each stream's one tile counter is zeroed once; every causal kernel (fixed length, and packed
    with fewer tiles than the grid the host sized) leaves it at 0, so repeated calls on the default
    stream and a side stream all equal the first (a counter left above 0 would skip tiles)."""
    q, k, v = (_rand(1, 1000, 4, 128) for _ in range(3))
    first = fa3.attention(q, k, v, causal=True)
    packed = q[0, :300], k[0, :300], v[0, :300]
    cu = _i32(0, 5, 17, 300)
    first_packed = fa3.attention_varlen(*packed, cu, cu, causal=True)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            outs = [(fa3.attention(q, k, v, causal=True), fa3.attention_varlen(*packed, cu, cu, causal=True))
                    for _ in range(4)]
            counter = _launch.stream_counter(q.device)
        torch.cuda.synchronize()
        assert counter.item() == 0
        assert all(torch.equal(o, first) and torch.equal(p, first_packed) for o, p in outs)


def _cache_reference(q, k_cache, v_cache, lengths, table=None):
    """Each sequence's one query over its first lengths[b] keys (pages in table order when paged)."""
    from fa3.reference import attention_reference

    outs = []
    for b, n in enumerate(lengths.tolist()):
        if table is None:
            keys, values = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        else:
            pages = table[b]
            keys = k_cache[pages].reshape(1, -1, *k_cache.shape[2:])[:, :n]
            values = v_cache[pages].reshape(1, -1, *v_cache.shape[2:])[:, :n]
        outs.append(attention_reference(q[b:b + 1], keys, values)[0])
    return torch.cat(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "paged", "packed"])
def test_prepared_cache_launch_computes_the_same(layout):
    """A repeated plain call against a cache runs the plan remembered from its first call: the
    first call's output for the same values, and the reference's for lengths rewritten in place
    and for new tensors of the same shapes (a later decode step); vLLM's packed call too."""
    batch, heads_q, heads_kv, d = 3, 16, 4, 128
    if layout == "dense":
        k_cache, v_cache, table = _rand(batch, 4096, heads_kv, d), _rand(batch, 4096, heads_kv, d), None
    else:  # pages of 16, permuted
        k_cache, v_cache = _rand(batch * 256, 16, heads_kv, d), _rand(batch * 256, 16, heads_kv, d)
        table = torch.randperm(batch * 256, device="cuda").view(batch, 256).to(torch.int32)
    lengths = _i32(4096, 1000, 77)

    def call(q, lengths):
        if layout == "packed":
            return fa3.attention_varlen(q.view(batch, heads_q, d), k_cache, v_cache,
                                        torch.arange(batch + 1, dtype=torch.int32, device="cuda"), None, 1, None,
                                        block_table=table, seqused_k=lengths).view(batch, 1, heads_q, d)
        return fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

    q = _rand(batch, 1, heads_q, d)
    first = call(q, lengths)
    assert torch.equal(call(q, lengths), first)
    assert rel_err(first, _cache_reference(q, k_cache, v_cache, lengths, table)) < 1e-2
    lengths.copy_(_i32(5, 4000, 2048))  # in place: the same tensor, new values
    q2 = _rand(batch, 1, heads_q, d)
    for q_step, lengths_step in ((q2, lengths), (q2, lengths.clone())):
        got = call(q_step, lengths_step)
        assert rel_err(got, _cache_reference(q_step, k_cache, v_cache, lengths_step, table)) < 1e-2
    fa3.check_index_values()


@pytest.mark.gpu
def test_prepared_cache_launch_with_left_padding():
    """A left-padded dense cache (transformers' padded generate: cache_leftpad) is remembered too: a
    repeated call gives the first call's output, new left pads in place and new tensors give the
    reference's (keys [leftpad[b], lengths[b]) of row b), and a bad pad is still found by name."""
    batch, heads_q, heads_kv, d = 3, 16, 4, 128
    k_cache, v_cache = _rand(batch, 2048, heads_kv, d), _rand(batch, 2048, heads_kv, d)
    lengths = _i32(2048, 2048, 2048)
    q = _rand(batch, 1, heads_q, d)
    call = lambda pad: fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=pad,
                                                  causal=True)

    def reference(pad):
        return torch.cat([_cache_reference(q[b:b + 1], k_cache[b:b + 1, p:], v_cache[b:b + 1, p:], _i32(2048 - p))
                          for b, p in enumerate(pad.tolist())])

    pad = _i32(0, 1000, 2047)
    first = call(pad)
    assert torch.equal(call(pad), first) and rel_err(first, reference(pad)) < 1e-2
    pad.copy_(_i32(5, 0, 1500))  # in place: checked again
    assert rel_err(call(pad), reference(pad)) < 1e-2
    fresh = _i32(100, 200, 300)
    assert rel_err(call(fresh), reference(fresh)) < 1e-2
    call(_i32(0, 2049, 0))  # past its sequence: the kernel clamps, the deferred check names it
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa3.check_index_values()


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_prepared_cache_launch_with_an_int_length(paged):
    """cache_seqlens as one int (flash-attn's form) is remembered too: each call's int is checked on
    the host and becomes the lengths the kernel reads, so a new value gives the reference's output
    and a bad one is refused by name, as on the first call."""
    batch, heads_q, heads_kv, d = 2, 16, 4, 128
    if paged:
        k_cache, v_cache = _rand(batch * 256, 16, heads_kv, d), _rand(batch * 256, 16, heads_kv, d)
        table = torch.randperm(batch * 256, device="cuda").view(batch, 256).to(torch.int32)
    else:
        k_cache, v_cache, table = _rand(batch, 4096, heads_kv, d), _rand(batch, 4096, heads_kv, d), None
    q = _rand(batch, 1, heads_q, d)
    call = lambda n: fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=n, block_table=table)
    first = call(3000)
    assert torch.equal(call(3000), first)
    for n in (3000, 17, 4096):
        got = call(n)
        assert rel_err(got, _cache_reference(q, k_cache, v_cache, _i32(n, n), table)) < 1e-2
    for n in (4097, -1):
        with pytest.raises(ValueError, match="cache_seqlens"):
            call(n)
    fa3.check_index_values()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (64, 0)])
def test_eager_gradients_match_the_op(window):
    """An eager call that needs gradients runs fa3's own autograd.Function; its output and
    gradients are bitwise the op's (torch.ops.fa3.attention's autograd registration), GQA and a
    deterministic backward, with and without a window, twice (the second from the remembered forward)."""
    q = _rand(2, 200, 8, 128).requires_grad_()
    k, v = (_rand(2, 300, 2, 128).requires_grad_() for _ in range(2))
    dout = _rand(2, 200, 8, 128)
    scale = 128 ** -0.5
    rung = fa3.registry.fastest(fa3.registry.ATTENTION, 128).name
    backward_rung = fa3.registry.fastest(fa3.registry.BACKWARD, 128, deterministic=True, masked=True).name
    via_op, _ = torch.ops.fa3.attention(q, k, v, True, scale, rung, True, backward_rung, *window)
    expected = (via_op, *torch.autograd.grad(via_op, (q, k, v), dout))
    for _ in range(2):
        out = fa3.attention(q, k, v, causal=True, window_size=window, deterministic=True)
        assert out.grad_fn is not None and "DifferentiableAttention" in type(out.grad_fn).__name__
        got = (out, *torch.autograd.grad(out, (q, k, v), dout))
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_eager_packed_gradients_match_the_op():
    """attention_varlen's eager calls that need gradients run the same Function (packed layout):
    output and gradients bitwise the op's (GQA, deterministic, causal, ragged sequences)."""
    lengths = [200, 1, 77, 300]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = _rand(total, 8, 128).requires_grad_()
    k, v = (_rand(total, 2, 128).requires_grad_() for _ in range(2))
    dout = _rand(total, 8, 128)
    scale = 128 ** -0.5
    rung = fa3.varlen.check_varlen(q, k, v, cu, cu, None, None, None).name
    backward_rung = fa3.registry.fastest(fa3.registry.BACKWARD, 128, deterministic=True, masked=True).name
    via_op, _ = torch.ops.fa3.attention_varlen(q, k, v, cu, cu, True, scale, -1, -1, 0.0, rung, True,
                                               backward_rung)
    expected = (via_op, *torch.autograd.grad(via_op, (q, k, v), dout))
    out = fa3.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, deterministic=True)
    assert "DifferentiableAttention" in type(out.grad_fn).__name__
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    fa3.check_index_values()


@pytest.mark.gpu
def test_prepared_decode_route_computes_the_same():
    """fa3.attention's decode route (a forward-only step over 32 MiB or more of K and V) remembered:
    the same output again, and the reference's for new queries."""
    k, v = _rand(1, 16384, 8, 128), _rand(1, 16384, 8, 128)
    q = _rand(1, 1, 32, 128)
    first = fa3.attention(q, k, v, causal=True)
    assert torch.equal(fa3.attention(q, k, v, causal=True), first)
    q2 = _rand(1, 1, 32, 128)
    from fa3.reference import attention_reference

    assert rel_err(fa3.attention(q2, k, v, causal=True), attention_reference(q2, k, v)[0]) < 1e-2


@pytest.mark.gpu
def test_capture_right_after_an_eager_call_with_a_pending_check():
    """An eager call leaves its index check pending; a CUDA graph captured next must not touch it
    (an event query during capture would invalidate the capture), and the check settles after."""
    k_cache, v_cache = _rand(2, 512, 2, 128), _rand(2, 512, 2, 128)
    q, lengths = _rand(2, 1, 8, 128), _i32(10, 300)
    step = lambda: fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.clone(), causal=True)
    expected = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    fa3.check_index_values()


def test_compiled_entry_leaves_pending_checks_alone(monkeypatch):
    """torch.compile traces an entry point's first line while an eager call's check is still
    pending: the settling is skipped there (it asks whether the stream is captured, which a graph
    cannot hold), so fullgraph compiles."""
    from fa3 import index_checks

    class NeverDone:
        def done(self):
            raise AssertionError("settled while tracing")

    monkeypatch.setattr(index_checks._PER_THREAD, "pending",
                        [index_checks._Pending(NeverDone(), [], None, None)], raising=False)

    def entry(x):
        index_checks.raise_pending()
        return x * 2

    x = torch.randn(4)
    assert torch.equal(torch.compile(entry, fullgraph=True, backend="eager")(x), x * 2)
    with pytest.raises(AssertionError, match="settled while tracing"):
        entry(x)  # eagerly it does settle: the test can fail


def test_gradient_calls_remembered(monkeypatch, cpu_as_hopper):
    """A plain eager call with gradients that passed every check is remembered with its forward and
    backward (interface._GRAD_CALLS, keyed with deterministic and backward_kernel): the same call
    again skips the checks; another backward choice, no gradients or a profiler take the full path.
    The kernels are no-ops (CPU)."""
    from fa3 import interface
    from fa3.compile import builders

    for getter in ("get_attention", "get_backward", "get_backward_preprocess", "get_backward_postprocess"):
        monkeypatch.setattr(builders, getter, lambda *a, **k: (lambda *args: None))
    checked = []
    real_check = interface.check_attention
    monkeypatch.setattr(interface, "check_attention", lambda *a: checked.append(1) or real_check(*a))
    q, k, v = (torch.zeros(1, 128, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def call(**kwargs):
        checked.clear()
        out = fa3.attention(q, k, v, causal=True, **kwargs)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return len(checked)

    assert call() == 1 and call() == 0, "the second call takes the remembered forward and backward"
    assert call(deterministic=True) == 1 and call(deterministic=True) == 0 and call() == 0
    with torch.no_grad():
        checked.clear()
        fa3.attention(q, k, v, causal=True)
        assert len(checked) == 1  # (no gradients: the plain launch's memo, filled by this call)
    monkeypatch.setattr(fa3._dispatch, "profiling", lambda: True)
    assert call() == 1


def test_cache_launch_takes_the_streams_scratch(monkeypatch):
    """A planned cache launch (kvcache.CacheLaunch) hands its kernels the split partials from the
    stream's scratch (the same tensors call after call, one lookup for all), and a dropped LSE from
    it too, while a kept LSE is fresh each call; under capture everything is fresh. The kernels are
    replaced by recorders (CPU)."""
    from fa3 import kvcache, registry
    from fa3.compile import kvcache as compile_kvcache

    calls = []
    record = lambda name: (lambda *a, **k: (lambda *args: calls.append((name, args))))
    kernels = []
    monkeypatch.setattr(compile_kvcache, "get_kvcache", lambda *a: kernels.append(a) or record("s1")())
    monkeypatch.setattr(compile_kvcache, "get_entry_order", record("order"))
    cpu = torch.device("cpu")
    monkeypatch.setitem(fa3._checks.HOPPER_SMS, cpu, 132)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)  # (CPU builds lack it)
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16384, 8, 128, dtype=torch.bfloat16)
    lengths = torch.full((1,), 16384, dtype=torch.int32)
    launch = kvcache.CacheLaunch(registry.get("s1"), q, cache, False, 16384, 0, True, 0.1, 0, (-1, -1), 0.0,
                                 None, 0, -1, False, False, False, torch.bfloat16, True)
    assert launch.split, "b1 x 16k should be split"
    assert kernels[-1][-1] is True, "a split call's kernel launches the combine itself (get_kvcache's with_combine)"

    def run(keep_lse):
        calls.clear()
        out, lse = launch(q, cache, cache, lengths, None, keep_lse=keep_lse)
        ((s1, s1_args),) = calls  # one call: S1 and the combine
        assert s1 == "s1"
        o_partial, lse_partial = s1_args[7], s1_args[8]
        splits, planes, rows, heads, d = o_partial.shape
        assert lse_partial.shape == (splits, planes, heads, rows) and splits == launch.num_splits > 1
        assert s1_args[6] is lse and s1_args[5] is out and lse.shape == (1, 32, 1) and out.shape == q.shape
        return o_partial, lse

    first_partial, dropped = run(keep_lse=False)
    again_partial, dropped_again = run(keep_lse=False)
    assert again_partial is first_partial and dropped_again is dropped
    kept_partial, kept = run(keep_lse=True)  # (its own scratch set: the partials alone)
    kept_partial_again, kept_again = run(keep_lse=True)
    assert kept_partial_again is kept_partial and kept is not dropped and kept_again is not kept
    capturing[0] = True  # a graph owns what it captures
    captured_partial, captured = run(keep_lse=False)
    assert captured_partial is not first_partial and captured is not dropped


def test_backward_takes_small_scratch_from_the_stream(monkeypatch):
    """The backward's statistics and dQ sums (written and read by its own kernels) are the stream's
    scratch where small (_launch.small_scratch: the same tensors call after call), allocated where
    large (SMALL_SCRATCH_BYTES) and under capture; the kernels are recorders (CPU)."""
    from fa3 import backward
    from fa3.compile import builders

    seen = []
    monkeypatch.setattr(builders, "get_backward_preprocess",
                        lambda *a: (lambda out, dout, lse, lse2, dsum, dq_acc, cu: seen.append((lse2, dsum, dq_acc))))
    monkeypatch.setattr(builders, "get_backward_postprocess", lambda *a: (lambda *args: None))
    monkeypatch.setattr(builders, "get_backward", lambda *a: (lambda *args: None))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    spec = fa3._dispatch.backward_rung(None, 128, masked=True)  # (the causal step's rung)

    def run(seqlen):
        q, k, v, dout, out = (torch.zeros(1, seqlen, 4, 128, dtype=torch.bfloat16) for _ in range(5))
        lse = torch.zeros(1, 4, seqlen)
        backward.launch_attention_backward(spec, dout, q, k, v, out, lse, True, 0.1, False)
        return seen[-1]

    same = lambda x, y: [a.data_ptr() == b.data_ptr() for a, b in zip(x, y)]  # (seen keeps them alive)
    first, again = run(128), run(128)
    assert all(same(first, again)), "small: the stream's scratch, call after call"
    assert first[2].dtype == torch.float32 and first[0].shape[:2] == (1, 4)
    big, big_again = run(8192), run(8192)  # dQ sums of 16 MiB: allocated each call
    assert not any(same(big, big_again))
    capturing[0] = True
    assert not any(same(run(128), first)), "a graph owns what it captures"


def test_prepared_causal_launch_takes_lse_and_counter_in_one_lookup(monkeypatch, cpu_as_hopper):
    """A remembered causal call that drops its LSE takes it and its tile counter from one stream
    scratch lookup: the same tensors call after call on a stream, the counter a zeroed int32; a
    kept LSE is allocated and the counter is the stream's own; fresh ones under capture (the
    kernel is a recorder, CPU)."""
    from fa3 import interface
    from fa3.compile import builders

    seen = []
    monkeypatch.setattr(builders, "get_attention", lambda *a, **k: (lambda *args: seen.append(args)))
    spec = fa3.registry.get("k5.5")
    q, k, v = (torch.zeros(1, 300, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    launch = interface.prepare_plain(spec, q, k, v, True, 0.1)
    counter_at = 5 + 2  # (q, k, v, out, lse, scale_log2, SM count, then the counter)
    lookups = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: lookups.append(index) or 7,
                        raising=False)
    calls = [(launch(q, k, v, keep_lse=False), seen[-1]) for _ in range(2)]
    assert len(lookups) == 2, "one stream lookup a call"
    (_, lse_a), args_a = calls[0]
    (_, lse_b), args_b = calls[1]
    assert lse_a is lse_b and args_a[counter_at] is args_b[counter_at]
    counter = args_a[counter_at]
    assert counter.dtype == torch.int32 and counter.shape == (1,) and int(counter) == 0
    _, kept = launch(q, k, v, keep_lse=True)
    assert kept is not lse_a and seen[-1][counter_at] is fa3._launch.stream_counter(q.device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    launch(q, k, v, keep_lse=False)
    assert seen[-1][counter_at] is not counter and seen[-1][4] is not lse_a


def test_split_gemm_takes_the_streams_scratch(monkeypatch):
    """A planned split-K GEMM (matmul.prepare_plain_gemm) hands its kernel the partial tiles' workspace
    from the stream's scratch: the same tensor call after call, fresh under capture (the kernel
    replaced by a recorder, CPU)."""
    from fa3 import matmul, registry
    from fa3.compile import builders

    calls = []
    monkeypatch.setattr(builders, "get_gemm", lambda *a, **k: (lambda *args: calls.append(args)))
    monkeypatch.setitem(fa3._checks.HOPPER_SMS, torch.device("cpu"), 132)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)  # (CPU builds lack it)
    a, b = torch.zeros(64, 4096, dtype=torch.bfloat16), torch.zeros(4096, 256, dtype=torch.bfloat16)
    launch = matmul.prepare_plain_gemm(registry.fastest(registry.GEMM), a, b)
    assert launch is not None
    workspaces = []
    for capture in (False, False, True):
        capturing[0] = capture
        calls.clear()
        launch(a, b)
        (args,) = calls
        assert args[6] > 1, "64 x 256 output tiles over K = 4096 should split"
        workspaces.append(args[4])
    assert workspaces[1] is workspaces[0] and workspaces[2] is not workspaces[0]
    assert workspaces[0].dtype == torch.float32 and workspaces[0].numel() > 1


@pytest.mark.gpu
def test_prepared_launches_write_into_out():
    """out= takes the prepared launches too (attention, its decode route, gemm): the result lands in
    the given tensor, equal to an allocating call's; a second out of the same shape is written as
    well (the key holds out's shape, not its address); an out that shares memory with an input is
    refused on the prepared path as on the first call; a non-contiguous one is refused by name."""
    q, k, v = (_rand(2, 333, 8, 128) for _ in range(3))
    qd, kd, vd = _rand(1, 1, 32, 128), _rand(1, 16384, 8, 128), _rand(1, 16384, 8, 128)
    a, b = _rand(128, 1024), _rand(1024, 1024)
    for call, shape in ((lambda out: fa3.attention(q, k, v, causal=True, out=out), q.shape),
                        (lambda out: fa3.attention(qd, kd, vd, causal=True, out=out), qd.shape),
                        (lambda out: fa3.gemm(a, b, out=out), (128, 1024))):
        want = call(None)
        for _ in range(3):  # the first call plans, the later ones run the prepared launch
            out = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            assert call(out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="out shares memory with q"):
        fa3.attention(q, k, v, causal=True, out=q)
    with pytest.raises(ValueError, match="out shares memory with a"):
        fa3.gemm(a, b, out=a)
    with pytest.raises(ValueError, match="contiguous"):
        fa3.attention(q, k, v, causal=True, out=torch.empty(2, 8, 333, 128, device="cuda",
                                                             dtype=torch.bfloat16).transpose(1, 2))
