"""What every benchmark here shares: timing a call, skipping what would take too long, and
printing results as they come and as a table at the end.

    t = measure(fn)                    median CUDA-event milliseconds of fn() after warm-up
    guard = SizeGuard(max_call_s=5)    skips a runner's larger sizes once a call would take > 5 s
    print(format_table(headers, rows))

Run from the project root without installing fa3: the project root is put on sys.path.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

try:
    import fa3  # noqa: F401
except ImportError:  # a source checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fa3.timing import attention_flops, event_times_ms, median_ms, tflops  # noqa: E402,F401

MAX_CALL_S = 5.0
# Cap on the time spent timing one (runner, size): slow runners get fewer repeats.
MEASURE_BUDGET_S = 10.0
# Synchronized calls before timing, long enough for the GPU to reach its boost clock again.
WARM_S = 0.2


class TooSlow(Exception):
    pass


def measure(fn, *, warmup: int = 5, repeats: int = 20, max_call_s: float = MAX_CALL_S,
            warm_s: float = WARM_S) -> float:
    """Median milliseconds of fn() (CUDA events) after warm-up.

    The first call is untimed (it compiles and allocates); the second is timed alone as an
    estimate: above `max_call_s` this raises TooSlow(estimate_ms) instead of measuring. Then fn
    runs (synchronized) for at least `warm_s` seconds: the GPU's clock drops within a moment of
    idling (a compile, a host-side setup), and a few microsecond-long calls do not raise it again,
    so without this the first shapes after a pause time slow. Runners slower than
    MEASURE_BUDGET_S / repeats get fewer warm-up calls and repeats (at least 3)."""
    fn()
    torch.cuda.synchronize()
    estimate_ms = event_times_ms(fn, 1)[0]
    if estimate_ms > max_call_s * 1e3:
        raise TooSlow(estimate_ms)
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        fn()
        torch.cuda.synchronize()
    fit = max(3, int(MEASURE_BUDGET_S * 1e3 / max(estimate_ms, 1e-3)))
    return median_ms(fn, warmup=min(warmup, fit), repeats=min(repeats, fit))


def graphed(fn, calls: int):
    """A callable that replays `calls` back-to-back fn() calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # allocate and compile outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def measure_gpu(fn, *, replay_ms: float = 0.5, **kwargs) -> float:
    """Median GPU milliseconds per fn() call, the host's overhead excluded: enough calls to fill
    about `replay_ms` are captured in one CUDA graph, and the graph's replay is measured. For calls
    shorter than their host overhead (small GEMMs, decode), measure() times the host instead."""
    fn()
    torch.cuda.synchronize()
    estimate_ms = event_times_ms(fn, 1)[0]  # host-bound calls overestimate: fewer calls, still fine
    calls = max(1, min(64, math.ceil(replay_ms / max(estimate_ms, 1e-3))))
    return measure(graphed(fn, calls), **kwargs) / calls


class SizeGuard:
    """Remembers each runner's last time and skips sizes predicted (by FLOPs) to exceed max_call_s.

    Keys are whatever identifies a runner and its static configuration, e.g. (rung, head_dim,
    causal); sizes must come in increasing order for the prediction to be useful."""

    def __init__(self, max_call_s: float = MAX_CALL_S):
        self.max_call_s = max_call_s
        self._last: dict = {}  # key -> (flops, seconds)

    def skip_reason(self, key, flops: float) -> str | None:
        if key not in self._last:
            return None
        last_flops, last_s = self._last[key]
        predicted = last_s * flops / last_flops
        if predicted > self.max_call_s:
            return (f"predicted {predicted:.1f} s a call from {last_s:.2f} s at a smaller size "
                    f"(limit {self.max_call_s:g} s)")
        return None

    def record(self, key, flops: float, ms: float) -> None:
        self._last[key] = (flops, ms * 1e-3)


def progress(msg: str) -> None:
    print(msg, flush=True)


def format_table(headers: list[str], rows: list[list]) -> str:
    """Right-aligned text table; None prints as '-', floats with one decimal (two below 10)."""
    def cell(x):
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
        return str(x)

    cells = [[cell(x) for x in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def environment() -> dict:
    """Where the numbers come from, for the JSON output."""
    from fa3.compile import dsl as _dsl

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": _dsl.version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=1)
    progress(f"wrote {path}")
