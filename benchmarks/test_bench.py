"""bench_attention's measurements as pytest-benchmark tests, on a few representative shapes.

    pytest benchmarks/ --benchmark-only          (on a Hopper GPU; skipped without one)

Each round is one call followed by torch.cuda.synchronize(), so the host-side times that
pytest-benchmark reports include the launch; extra_info carries TFLOP/s from the median.
The CI command (`pytest` with testpaths = tests) does not collect this folder.
"""

import pytest
import torch

from bench_attention import fa4_runner, make_inputs, paper_shape, peer_runners, rung_runner
from timing import TooSlow, attention_flops, measure, tflops

from fa3 import registry

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")

# (head_dim, seqlen, causal), in the paper's setting (16k tokens, hidden 2048)
SHAPES = [(128, 1024, False), (128, 4096, False), (128, 4096, True), (64, 2048, True), (256, 8192, False)]
RUNNERS = registry.available_kernels(registry.ATTENTION) + ["sdpa-flash", "sdpa-cudnn", "fa4"]


def _runner(name):
    if name in registry.KERNELS:
        return rung_runner(name)
    if name == "fa4":
        try:
            return fa4_runner()
        except Exception as exc:
            pytest.skip(f"flash_attn.cute is not importable: {exc}")
    (runner,), _ = peer_runners([name])
    return runner


@pytest.mark.parametrize("name", RUNNERS)
@pytest.mark.parametrize("head_dim, seqlen, causal", SHAPES,
                         ids=[f"d{d}-s{s}{'-causal' if c else ''}" for d, s, c in SHAPES])
def test_attention(benchmark, name, head_dim, seqlen, causal):
    runner = _runner(name)
    batch, heads = paper_shape(seqlen, head_dim)
    reason = runner.skip(batch, seqlen, heads, head_dim)
    if reason:
        pytest.skip(reason)
    q, k, v = make_inputs(batch, seqlen, heads, head_dim)
    with runner.context():
        fn = runner.make(q, k, v, causal)
        try:  # compiles, and estimates one call's time
            measure(fn, warmup=0, repeats=1)
        except TooSlow as slow:
            pytest.skip(f"one call takes {slow.args[0] / 1e3:.1f} s")

        def call():
            fn()
            torch.cuda.synchronize()

        benchmark.group = f"d{head_dim} s{seqlen}{' causal' if causal else ''}"
        benchmark.pedantic(call, rounds=10, iterations=1, warmup_rounds=3)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    benchmark.extra_info.update(batch=batch, heads=heads,
                                tflops=tflops(flops, benchmark.stats.stats.median * 1e3))
