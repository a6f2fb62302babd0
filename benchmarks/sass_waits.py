"""Where ptxas put each overlapped step's wait for P V, read from the SASS (no GPU needed).

    python benchmarks/sass_waits.py --rung k5.5 --head-dim 128 [--causal] [--variant NAME=BASE:...]
    python benchmarks/sass_waits.py --sass kernel.sass        (nvdisasm's output, already made)

K5's overlapped step (kernels/k5_mainloop.py) waits twice: `warpgroup.wait_group(1)` (S_j has
landed, P_{j-1} V_{j-1} may still run) and `wait_group(0)` (P V done), with the softmax of S_j in
between in the source. ptxas moves instructions across the second wait: at d128 it once hoisted
it above every exp2 of the step, so the warps waited for P V with the whole softmax still to do
(worklog/k5.md, "The wait for P V"). In the SASS the two waits are `WARPGROUP.DEPBAR.LE gsb0, 0x1`
and the next `WARPGROUP.DEPBAR.LE gsb0, 0x0`. For each such pair this prints the instructions
between them and the FFMA (exp2 arguments) and MUFU.EX2 (exp2) counts before and after the second
wait (up to the next GEMM or wait). A kernel has one pair per compiled step: the masked loop's
first, then the steady loop's.

--rung compiles the rung for sm_90a on the CPU (CUTE_DSL_ARCH, as the compile tests do) and runs
nvdisasm on its cubin: nvdisasm from PATH or from the nvidia-cuda-nvdisasm wheel
(`pip install nvidia-cuda-nvdisasm`).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from sass_stalls import opcode

INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*$")


def instructions(sass: str) -> list[str]:
    """The instruction text of each SASS line (`/*0a30*/ FFMA R1, R2, R3, R4 ;`), in order."""
    out = []
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if m and m.group(1):
            out.append(m.group(1).rstrip(" ;"))
    return out


def is_exp2(sass: str) -> bool:
    return opcode(sass) == "MUFU" and "EX2" in sass


def overlapped_steps(ops: list[str]) -> list[dict]:
    """One record per `DEPBAR.LE gsb0, 0x1` followed by a `DEPBAR.LE gsb0, 0x0`."""
    steps = []
    for i, op in enumerate(ops):
        if "DEPBAR.LE gsb0, 0x1" not in op:
            continue
        j = next((k for k in range(i + 1, len(ops)) if "DEPBAR.LE gsb0, 0x0" in ops[k]), None)
        if j is None:
            continue
        end = next((k for k in range(j + 1, len(ops)) if opcode(ops[k]) == "HGMMA" or "DEPBAR" in ops[k]),
                   len(ops))
        steps.append({
            "at": i, "between": j - i,
            "ffma_before": sum(opcode(x) == "FFMA" for x in ops[i:j]),
            "exp2_before": sum(is_exp2(x) for x in ops[i:j]),
            "exp2_after": sum(is_exp2(x) for x in ops[j:end]),
        })
    return steps


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in sys.path:
        for path in glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm")):
            return path
    return None


def compiled_sass(rung: str, head_dim: int, causal: bool, variant_texts: list[str]) -> str:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import torch

    import variants
    from fa3.compile import builders as _compile
    from fa3 import registry

    for text in variant_texts:
        variants.register(text)
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise SystemExit("nvdisasm not found: put it on PATH or `pip install nvidia-cuda-nvdisasm`")
    report = _compile.compile_report(registry.get(rung), torch.bfloat16, head_dim=head_dim, causal=causal)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(bytes(report.cubin))
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rung", help="a forward rung of the registry (or a --variant)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...")
    ap.add_argument("--sass", help="read this nvdisasm output instead of compiling")
    args = ap.parse_args(argv)
    if args.sass:
        with open(args.sass) as f:
            sass = f.read()
    elif args.rung:
        sass = compiled_sass(args.rung, args.head_dim, args.causal, args.variant)
    else:
        ap.error("give --rung or --sass")
    steps = overlapped_steps(instructions(sass))
    if not steps:
        print("no overlapped step (no DEPBAR.LE gsb0, 0x1 followed by 0x0)")
        return 1
    for n, s in enumerate(steps):
        print(f"step {n} (instruction {s['at']}): wait for P V {s['between']} instructions after the wait "
              f"for S; before it {s['ffma_before']} FFMA and {s['exp2_before']} exp2, after it "
              f"{s['exp2_after']} exp2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
