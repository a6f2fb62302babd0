"""GPU timing and FLOP counts shared by `python -m fa3 demo` and the benchmarks.

Times are CUDA-event times on torch's current stream, in milliseconds: the kernel's time, not the
host's launch overhead (as long as the GPU stays busy). The median of several calls after warm-up
is what is reported, since the first calls pay for compilation and clock ramp-up.
"""

from __future__ import annotations

import statistics

import torch


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs as the FlashAttention papers count them: two matmuls of 2*sq*sk*d each per
    (batch, head), halved for causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def event_times_ms(fn, repeats: int) -> list[float]:
    """Per-call times of `repeats` back-to-back calls of fn(), each bracketed by CUDA events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def median_ms(fn, warmup: int = 5, repeats: int = 20) -> float:
    """Median CUDA-event time of fn() over `repeats` calls after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_times_ms(fn, repeats))
