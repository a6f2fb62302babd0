"""CPU tests: fa3.attention and fa3.gemm as torch custom ops.

The ops' fake implementations give the right shapes, dtypes and layouts (on meta tensors and
under FakeTensorMode), and torch.compile(fullgraph=True) and torch.export trace a module calling
both wrappers into one graph whose batch and seqlen stay symbolic: no graph break, no recompile.
Tracing runs on meta tensors with the Hopper check lifted (nothing here needs a GPU); the
`eager` backend runs the graph on the ops' meta kernels, so no kernel is compiled or launched.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa3
from fa3 import _dispatch, registry

BF16 = torch.bfloat16
ATTENTION = registry.fastest(registry.ATTENTION, 128).name
GEMM = registry.fastest(registry.GEMM).name
BACKWARD_64 = registry.fastest(registry.BACKWARD, 64).name


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 100, 8, 70, 2, 128), (1, 1, 4, 9, 4, 64), (3, 33, 6, 33, 1, 256)],
                         ids=["gqa-sq<sk", "sq=1", "mqa"])
def test_attention_fake_shapes(shape, dtype):
    batch, seqlen_q, heads_q, seqlen_k, heads_kv, head_dim = shape
    q = meta(batch, seqlen_q, heads_q, head_dim, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
    k = meta(batch, seqlen_k, heads_kv, head_dim, dtype=dtype)
    out, lse = torch.ops.fa3.attention(q, k, k, True, 0.1, ATTENTION)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()  # contiguous whatever q is
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_gemm_fake_shapes():
    out = torch.ops.fa3.gemm(meta(37, 64, dtype=torch.float16), meta(128, 64, dtype=torch.float16).t(), GEMM)
    assert out.shape == (37, 128) and out.dtype == torch.float16 and out.is_contiguous()


def test_fake_tensor_mode_keeps_the_cuda_device():
    """Under FakeTensorMode (what torch.compile and torch.export trace with) no GPU is touched."""
    with FakeTensorMode():
        q = torch.empty(2, 64, 4, 128, device="cuda", dtype=BF16)
        out, lse = torch.ops.fa3.attention(q, q, q, False, 0.1, ATTENTION)
        c = torch.ops.fa3.gemm(torch.empty(512, 64, device="cuda", dtype=BF16),
                               torch.empty(64, 32, device="cuda", dtype=BF16), GEMM)
    assert (out.device.type, lse.device.type, c.device.type) == ("cuda",) * 3
    assert c.shape == (512, 32)


class Block(torch.nn.Module):
    """Projections through fa3.gemm around fa3.attention, as a GPT block would (no norms)."""

    def __init__(self, heads=4, head_dim=64, device="meta"):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.w_qkv = torch.nn.Parameter(torch.empty(width, 3 * width, device=device, dtype=BF16), requires_grad=False)
        self.w_out = torch.nn.Parameter(torch.empty(width, width, device=device, dtype=BF16), requires_grad=False)

    def forward(self, x):
        batch, seqlen, width = x.shape
        qkv = fa3.gemm(x.reshape(batch * seqlen, width), self.w_qkv)
        q, k, v = qkv.view(batch, seqlen, 3, self.heads, self.head_dim).unbind(2)
        o, lse = fa3.attention(q, k, v, causal=True, return_lse=True)
        out = torch.empty_like(x)
        fa3.gemm(o.reshape(batch * seqlen, width), self.w_out, out=out.view(batch * seqlen, width))
        return out, lse


def test_compile_fullgraph_dynamic_batch_and_seqlen(no_device_check):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block = Block()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch, seqlen in [(2, 128), (2, 200), (3, 77)]:
            x = meta(batch, seqlen, 256)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            out, lse = compiled(x)
            assert out.shape == x.shape and lse.shape == (batch, 4, seqlen)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fa3.attention) == 1 and targets.count(torch.ops.fa3.gemm) == 2


def test_export_keeps_shapes_symbolic(no_device_check):
    batch, seqlen = torch.export.Dim("batch"), torch.export.Dim("seqlen", max=1 << 16)
    program = torch.export.export(Block(), (meta(2, 128, 256),), dynamic_shapes=({0: batch, 1: seqlen},))
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    attention = next(n for n in calls if n.target is torch.ops.fa3.attention.default)
    # causal, 1/sqrt(64), the rung resolved, deterministic backward off, the backward rung resolved
    assert attention.args[3:] == (True, 0.125, ATTENTION, False, BACKWARD_64)
    fake_out = attention.meta["val"][0]
    assert all(isinstance(s, torch.SymInt) for s in fake_out.shape[:2])
    assert sum(n.target is torch.ops.fa3.gemm.default for n in calls) == 2


def test_validation_runs_when_traced(no_device_check):
    """The wrapper's checks are traced too: a bad call fails to compile, naming the problem."""
    compiled = torch.compile(lambda q: fa3.attention(q, q, q), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="head_dim=100 is not supported"):
        compiled(meta(1, 8, 2, 100))


def test_direct_call_only_for_plain_eager_tensors():
    """Eager calls skip the dispatcher only when it would add nothing (see direct_call_ok)."""
    t = torch.empty(2, 2)
    assert _dispatch.direct_call_ok(t, t)
    with torch.no_grad():
        assert _dispatch.direct_call_ok(t, t.requires_grad_())
    assert not _dispatch.direct_call_ok(t, t)  # requires grad: the op's autograd error must fire
    t = torch.empty(2, 2)
    with FakeTensorMode() as mode:
        assert not _dispatch.direct_call_ok(mode.from_tensor(t))
        assert not _dispatch.direct_call_ok(t)  # a dispatch mode is active
    assert not _dispatch.direct_call_ok(torch.nn.Parameter(t))  # a subclass
    with torch.profiler.profile():  # the profiler sees direct calls by name (op_range)
        assert _dispatch.direct_call_ok(t)


def test_profiled_calls_run_direct_under_their_op_name(no_device_check, monkeypatch):
    """Under torch.profiler an eager call still runs its implementation directly, writing into out=
    (no functional op whose result is then copied), inside a range named as the op."""
    from fa3 import interface

    written = []
    monkeypatch.setattr(interface, "launch_attention",
                        lambda spec, q, k, v, causal, scale, out, *a: written.append(out) or (out, None))
    q = meta(1, 128, 4, 64)
    out = torch.empty_like(q)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert fa3.attention(q, q, q, out=out) is out
    assert written and written[0] is out
    assert "fa3::attention" in {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "mqa"])
def test_backward_on_meta_tensors(no_device_check, heads_kv):
    """fa3.attention(...).sum().backward() gives gradients of the inputs' shapes and dtypes (the
    backward op's fake implementation), and lse does not require grad."""
    q = meta(2, 64, 4, 128, dtype=torch.float16).requires_grad_()
    k = meta(2, 70, heads_kv, 128, dtype=torch.float16).requires_grad_()
    v = meta(2, 70, heads_kv, 128, dtype=torch.float16).requires_grad_()
    out, lse = fa3.attention(q, k, v, causal=True, return_lse=True, deterministic=True)
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == torch.float16


def test_backward_fake_shapes():
    q = meta(3, 33, 8, 64)
    k = meta(3, 17, 2, 64)
    out, lse = meta(3, 33, 8, 64), meta(3, 8, 33, dtype=torch.float32)
    dq, dk, dv, dsinks = torch.ops.fa3.attention_backward(out, q, k, k, out, lse, False, 0.1, BACKWARD_64, False)
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, k.shape, (0,))
    sinks = torch.empty(8, device="meta")
    *_, dsinks = torch.ops.fa3.attention_backward(out, q, k, k, out, lse, False, 0.1, BACKWARD_64, False,
                                                  sinks=sinks)
    assert dsinks.shape == (8,) and dsinks.dtype == torch.float32
    assert dq.is_contiguous() and dk.dtype == BF16


def test_compile_traces_the_backward(no_device_check):
    """torch.compile(fullgraph=True) of a training step: forward and backward each hold one fa3 op."""
    from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401  (aot_eager below)

    graphs = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func

        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def loss_fn(q, k, v):
        return fa3.attention(q, k, v, causal=True).float().square().sum()

    q = meta(2, 64, 4, 64).requires_grad_()
    k = meta(2, 64, 2, 64).requires_grad_()
    from torch._dynamo.backends.common import aot_autograd

    compiled = torch.compile(loss_fn, fullgraph=True, backend=aot_autograd(fw_compiler=backend, bw_compiler=backend))
    compiled(q, k, k).backward()
    assert len(graphs) == 2
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.fa3.attention.default in targets and torch.ops.fa3.attention_backward.default in targets
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_varlen_backward_on_meta_tensors(no_device_check):
    """fa3.attention_varlen is differentiable: the packed backward op's fake implementation gives
    gradients of the packed inputs' shapes (no kernel runs)."""
    q = meta(50, 4, 64).requires_grad_()
    k = meta(70, 2, 64).requires_grad_()
    cu_q = torch.tensor([0, 20, 50], dtype=torch.int32, device="meta")
    cu_k = torch.tensor([0, 35, 70], dtype=torch.int32, device="meta")
    out, lse = fa3.attention_varlen(q, k, k, cu_q, cu_k, causal=True, return_lse=True, deterministic=True)
    assert out.requires_grad and not lse.requires_grad and lse.shape == (4, 50)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and q.grad.dtype == BF16
    dq, dk, dv, _ = torch.ops.fa3.attention_varlen_backward(out.detach(), q, k, k, out.detach(), lse, cu_q, cu_k,
                                                         True, 0.125, BACKWARD_64, False, -1, -1, 0.0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
