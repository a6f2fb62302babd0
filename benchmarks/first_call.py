"""A fresh process's first fa3 calls: how long they take and what they had to compile.

    python benchmarks/first_call.py [--head-dim 64] [--causal] [--save FILE.pt]

Prints one JSON line: import_s (importing torch and fa3), attention_first_s / gemm_first_s (the
first call of each, synchronized: compile or disk-cache load, plus the run), *_second_s (the same
call again), compiled (the rungs this process compiled: empty when the disk cache had them all),
cutlass_imported (loading from the cache does not need it) and cache_dir. --save writes both outputs, to compare processes. The disk cache is wherever
FA3_CACHE_DIR says; bench_overhead.py runs this with an empty and then a warm one, and
tests/test_torch_integration.py checks that a second process compiles nothing.
"""

from __future__ import annotations

import time

_start = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a source checkout
import fa3  # noqa: E402
from fa3.compile import disk_cache as _disk_cache  # noqa: E402

IMPORT_S = time.perf_counter() - _start
compiled: list[str] = []


def _counting(save):
    """Wrap fa3.compile.disk_cache.save, which every compile ends in (loads from the cache do not), so that
    compiles are recorded: the first field of a compile key is the rung's name."""
    def wrapper(key, *args, **kwargs):
        compiled.append(key[0])
        return save(key, *args, **kwargs)
    return wrapper


_disk_cache.save = _counting(_disk_cache.save)


def timed(call) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--save", help="torch.save the outputs here")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 300, 4, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    report = {"import_s": IMPORT_S}
    outputs = {}
    for name, call in (("attention", lambda: fa3.attention(q, q, q, causal=args.causal)),
                       ("gemm", lambda: fa3.gemm(a, b))):
        report[f"{name}_first_s"], outputs[name] = timed(call)
        report[f"{name}_second_s"], _ = timed(call)
    report["compiled"] = compiled
    report["cutlass_imported"] = "cutlass" in sys.modules  # a disk-cache hit loads without it
    report["cache_dir"] = str(_disk_cache.directory())
    if args.save:
        torch.save({k: v.cpu() for k, v in outputs.items()}, args.save)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
