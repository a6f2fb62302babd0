"""GPU tests: fa3 inside PyTorch programs.

torch.compile(fullgraph=True) of a module calling fa3.gemm and fa3.attention runs new batch sizes
and seqlens without recompiling and matches eager; torch.export's program matches too; CUDA-graph
replay equals eager; kernels run on torch's current stream without synchronizing the host; the
ops pass torch.library.opcheck; the profiler sees them by name; a second process loads the kernels
the first one compiled from the disk cache.
"""

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import fa3
from conftest import rel_err
from fa3 import registry
from test_torch_ops import Block

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from gpt_block import capture  # noqa: E402
FIRST_CALL_BUDGET_S = 1.0  # a warm disk cache's first call should take well under this


def make_block():
    torch.manual_seed(0)
    block = Block(device="cuda")
    for p in block.parameters():
        p.data.normal_(0, block.w_qkv.shape[0] ** -0.5)
    return block


def test_compile_fullgraph_dynamic_no_recompile():
    torch._dynamo.reset()
    counters.clear()
    block = make_block()
    compiled = torch.compile(block, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch, seqlen in [(2, 128), (2, 200), (3, 77)]:
            x = torch.randn(batch, seqlen, 256, device="cuda", dtype=BF16)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            out, lse = compiled(x)
            ref_out, ref_lse = block(x)
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"batch {batch} seqlen {seqlen}"
    assert counters["stats"]["unique_graphs"] == 1


def test_export_matches_eager():
    block = make_block()
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seqlen", max=1 << 16)}
    program = torch.export.export(block, (torch.randn(2, 64, 256, device="cuda", dtype=BF16),),
                                  dynamic_shapes=(dims,))
    x = torch.randn(3, 150, 256, device="cuda", dtype=BF16)
    for got, want in zip(program.module()(x), block(x)):
        assert torch.equal(got, want)


def test_cuda_graph_replay_equals_eager():
    block = make_block()
    static_x = torch.randn(2, 256, 256, device="cuda", dtype=BF16)
    block(static_x)  # compiles (or loads) the kernels: nothing may compile during capture
    graph, (static_out, static_lse) = capture(block, static_x)
    for seed in (1, 2):
        x = torch.randn(static_x.shape, device="cuda", dtype=BF16, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(x)
        graph.replay()
        out, lse = block(x)
        assert torch.equal(static_out, out) and torch.equal(static_lse, lse)


def test_runs_on_the_current_stream_without_host_sync():
    """On a side stream that is still busy (a sleep, then the copy of new inputs), fa3 must queue
    behind them: launched on another stream it would read the old q. The host must not wait."""
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 4, 64, device="cuda", dtype=BF16, generator=gen) for _ in range(3))
    new_q = torch.randn(q.shape, device="cuda", dtype=BF16, generator=gen)
    a, b = q.view(-1, 256), torch.randn(256, 128, device="cuda", dtype=BF16, generator=gen)
    fa3.attention(q, k, v, causal=True)
    fa3.gemm(a, b)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
            q.copy_(new_q)
            out = fa3.attention(q, k, v, causal=True)
            c = fa3.gemm(a, b)  # a is a view of q: it must see new_q too
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not side.query(), "the host waited for the GPU"
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, fa3.attention(new_q, k, v, causal=True))
    assert torch.equal(c, fa3.gemm(new_q.view(-1, 256), b))


def test_direct_calls_match_the_ops():
    gen = torch.Generator("cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=BF16, generator=gen) for _ in range(3))
    rung = registry.fastest(registry.ATTENTION, 64).name
    out, lse = fa3.attention(q, k, v, causal=True, return_lse=True)
    op_out, op_lse = torch.ops.fa3.attention(q, k, v, True, 64 ** -0.5, rung)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    a, b = q.view(-1, 256), torch.randn(256, 64, device="cuda", dtype=BF16, generator=gen).t().contiguous().t()
    assert torch.equal(fa3.gemm(a, b), torch.ops.fa3.gemm(a, b, registry.fastest(registry.GEMM).name))
    # inputs that need gradients go through the op, and its registered backward
    out = fa3.attention(q.requires_grad_(), k, v, causal=True)
    assert torch.equal(out.detach(), op_out)
    out.sum().backward()
    dq, _, _, _ = torch.ops.fa3.attention_backward(torch.ones_like(out), q.detach(), k, v, op_out, op_lse,
                                                True, 64 ** -0.5, registry.fastest(registry.BACKWARD, 64).name,
                                                True)
    assert torch.isfinite(q.grad).all() and rel_err(q.grad, dq) < 1e-5


def test_opcheck():
    gen = torch.Generator("cuda").manual_seed(4)
    q = torch.randn(2, 130, 4, 64, device="cuda", dtype=BF16, generator=gen)
    kv = torch.randn(2, 70, 2, 64, device="cuda", dtype=BF16, generator=gen)
    torch.library.opcheck(torch.ops.fa3.attention.default,
                          (q, kv, kv, True, 0.125, registry.fastest(registry.ATTENTION, 64).name))
    out, lse = torch.ops.fa3.attention(q, kv, kv, True, 0.125, registry.fastest(registry.ATTENTION, 64).name)
    torch.library.opcheck(torch.ops.fa3.attention_backward.default,
                          (torch.randn_like(out), q, kv, kv, out, lse, True, 0.125,
                           registry.fastest(registry.BACKWARD, 64).name, True))
    a = torch.randn(100, 256, device="cuda", dtype=BF16, generator=gen)
    torch.library.opcheck(torch.ops.fa3.gemm.default, (a, a.t()[:, :64].contiguous(), registry.fastest(registry.GEMM).name))


def test_profiler_sees_the_ops():
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=BF16)
    fa3.attention(q, q, q)
    with torch.profiler.profile() as prof:
        fa3.attention(q, q, q)
        fa3.gemm(q.view(-1, 64)[:, :64], torch.randn(64, 64, device="cuda", dtype=BF16))
    names = {e.key for e in prof.key_averages()}
    assert {"fa3::attention", "fa3::gemm"} <= names


def first_call(cache_dir, save):
    env = {**os.environ, "FA3_CACHE_DIR": str(cache_dir)}
    env.pop("FA3_DISK_CACHE", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "first_call.py"),
                           "--causal", "--save", str(save)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_loads_from_the_disk_cache(tmp_path):
    start = time.perf_counter()
    first = first_call(tmp_path / "cache", tmp_path / "first.pt")
    second = first_call(tmp_path / "cache", tmp_path / "second.pt")
    print(f"\n  first process:  import {first['import_s']:.2f} s, attention {first['attention_first_s']:.2f} s, "
          f"gemm {first['gemm_first_s']:.2f} s, compiled {first['compiled']}"
          f"\n  second process: import {second['import_s']:.2f} s, attention {second['attention_first_s']:.3f} s, "
          f"gemm {second['gemm_first_s']:.3f} s, compiled {second['compiled']} "
          f"({time.perf_counter() - start:.1f} s in all)")
    assert len(first["compiled"]) == 2 and second["compiled"] == []
    for name, tensor in torch.load(tmp_path / "first.pt").items():
        assert torch.equal(tensor, torch.load(tmp_path / "second.pt")[name]), name
    slow = {k: second[k] for k in ("attention_first_s", "gemm_first_s") if second[k] > FIRST_CALL_BUDGET_S}
    if slow:
        warnings.warn(f"first calls with a warm disk cache took {slow} (budget {FIRST_CALL_BUDGET_S} s)")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_gpu_other_than_the_current_one():
    """A model split across GPUs (transformers' device_map="auto") calls fa3 on tensors of cuda:1
    while cuda:0 is the current device: forward, backward, the decode route and the cache call give
    what the same calls give with cuda:1 current, and the current device is left as it was."""
    assert torch.cuda.current_device() == 0
    gen = torch.Generator(device="cuda:1").manual_seed(8)
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda:1", dtype=BF16, generator=gen, requires_grad=True)
               for _ in range(3))
    dq = torch.randn_like(q)
    qd = torch.randn(1, 1, 32, 128, device="cuda:1", dtype=BF16, generator=gen)
    kd, vd = (torch.randn(1, 16384, 8, 128, device="cuda:1", dtype=BF16, generator=gen) for _ in range(2))

    def calls():
        out = fa3.attention(q, k, v, causal=True, deterministic=True)  # (bitwise repeatable gradients)
        grads = torch.autograd.grad(out, (q, k, v), dq)
        decode = fa3.attention(qd, kd, vd, causal=True)  # K and V of 64 MiB: the KV-cache kernel
        lengths = torch.full((1,), 9000, dtype=torch.int32, device="cuda:1")  # checked on the host
        cached = fa3.attention_with_kvcache(qd, kd, vd, cache_seqlens=lengths, causal=True)
        return [out, *grads, decode, cached]

    got = calls()
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        want = calls()
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda:1") and torch.equal(a, b)
    # the host check waits for its copy on cuda:1's stream (queued behind this work), not cuda:0's
    busy = fa3.attention(q.detach(), k.detach(), v.detach(), causal=True)  # queue work ahead of the copy
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa3.attention_with_kvcache(qd, kd, vd, cache_seqlens=torch.full((1,), 20000, dtype=torch.int32,
                                                                        device="cuda:1"))
    assert torch.isfinite(busy).all()
