"""Warp-stall samples per SASS opcode, from Nsight Compute's source page exported as CSV.

    ncu ... --section WarpStateStats --section SourceCounters -o prof python benchmarks/profile_kernels.py ...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python benchmarks/sass_stalls.py prof.csv [--top 25]
    python benchmarks/sass_stalls.py prof.csv --opcode WARPGROUP [--context 4]

Where an instruction count explains a kernel's time, the opcodes with the most issued instructions
are the suspects; where it does not, the samples say where warps wait (a barrier, a TMA wait, a
long scoreboard). For each table in the export (one per profiled kernel), this sums every numeric
column whose name mentions "Sampling" or "Executed" over the instructions of each opcode (the
first word of the SASS text, without its predicate and modifiers: `@!P0 STS.64 [R2], R4` counts
as STS), and prints the opcodes with the most samples, with their share of the kernel's samples.
The export's exact columns differ between Nsight Compute versions; the parser only assumes a header
row with a "Source" column and numbers in the columns it sums.

--opcode OP lists OP's instructions one by one instead, most samples first, each with the
`--context` instructions before it: which of a kernel's `WARPGROUP.DEPBAR` (warpgroup.wait) or
`SYNCS` (mbarrier) waits the warps sit in, and after which GEMM or barrier.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

SUMMED = ("Sampling", "Executed")


def opcode(sass: str) -> str:
    """`@!P0 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], ...` -> HGMMA."""
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return re.split(r"[.\s]", words[0])[0] if words else ""


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def tables(rows):
    """(title, header, body rows) for each table: a header is a row with a "Source" column; the
    title is the last non-empty row before it that is not part of a table (a kernel's name)."""
    title, header, body = "", None, []
    for row in rows:
        if not any(cell.strip() for cell in row):
            continue
        if "Source" in row:
            if header is not None:
                yield title, header, body
            header, body = row, []
            continue
        if header is not None and len(row) == len(header):
            body.append(row)
        else:
            if header is not None:
                yield title, header, body
                header, body = None, []
            title = " ".join(cell for cell in row if cell.strip())
    if header is not None:
        yield title, header, body


def summarize(header, body):
    """{opcode: {column: sum}} over the columns to sum, and those columns."""
    source = header.index("Source")
    columns = [i for i, name in enumerate(header) if any(word in name for word in SUMMED)]
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in body:
        op = opcode(row[source])
        for i in columns:
            value = number(row[i])
            if value is not None:
                totals[op][header[i]] += value
    return totals, [header[i] for i in columns]


def instances(header, body, op: str, context: int):
    """([(samples, SASS text, the `context` SASS lines before it)] of opcode `op`, most samples
    first; the kernel's samples in all): samples are the first column that mentions "Sampling"."""
    source = header.index("Source")
    key = next(i for i, name in enumerate(header) if "Sampling" in name)
    found = [(number(row[key]) or 0.0, row[source].strip(),
              [body[j][source].strip() for j in range(max(0, i - context), i)])
             for i, row in enumerate(body) if opcode(row[source]) == op]
    return sorted(found, key=lambda item: -item[0]), sum(number(row[key]) or 0.0 for row in body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--opcode", help="list this opcode's instructions one by one (e.g. WARPGROUP)")
    ap.add_argument("--context", type=int, default=4, help="with --opcode: instructions shown before each")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        found = list(tables(csv.reader(f)))
    if not found:
        print(f"{args.csv}: no table with a 'Source' column (export with --page source --csv)")
        return 1
    for title, header, body in found:
        if args.opcode:
            if not any("Sampling" in name for name in header):
                print(f"{title or '(untitled)'}: no sampling column; columns: {header}")
                continue
            listed, grand = instances(header, body, args.opcode, args.context)
            grand = grand or 1.0
            print(f"\n{title or '(untitled)'}: {len(listed)} {args.opcode} instructions, most samples first")
            for samples, text, before in listed[:args.top]:
                print(f"{samples:10.0f} {samples / grand:6.1%}  {text}")
                for line in before:
                    print(f"{'':19}    after: {line}")
            continue
        totals, columns = summarize(header, body)
        if not columns:
            print(f"{title or '(untitled)'}: no column mentions {' or '.join(SUMMED)}; columns: {header}")
            continue
        key = next((c for c in columns if "Sampling" in c), columns[0])
        grand = sum(t[key] for t in totals.values()) or 1.0
        print(f"\n{title or '(untitled)'}: {len(body)} instructions, sorted by {key!r}")
        print("  ".join(["opcode".ljust(10)] + [c[:28].rjust(28) for c in columns] + ["share".rjust(6)]))
        ranked = sorted(totals.items(), key=lambda item: -item[1][key])
        for op, sums in ranked[:args.top]:
            cells = [f"{sums[c]:28.0f}" for c in columns]
            print("  ".join([op.ljust(10)] + cells + [f"{sums[key] / grand:6.1%}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
