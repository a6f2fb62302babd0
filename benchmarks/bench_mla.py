"""MLA decode (flash-attn 3's qv) on DeepSeek-V3's shapes: 128 and 16 query heads (the model's, and
a 16-head slice per GPU under tensor parallelism 8), one latent KV head (q/k 64 + qv/v 512 wide),
one query per sequence, causal, pages of 64 as vLLM holds them (one (pages, 64, 576) cache, k and
v views of it; --page-size 16 or 1: the kernel's row gathers), bf16.

    python benchmarks/bench_mla.py [--json FILE] [--heads 128,16] [--quick] [--page-size 64]

fa3 runs vLLM's call (flash_attn_varlen_func with q_v, seqused_k, block_table, cu_seqlens_q),
replayed from a CUDA graph (as engines run decode) and eager. Beside it SDPA on the same data
written out densely with the latent expanded to every head (q = [q_pe, q_nope], keys = [k_pe,
latent], values = the latent; enable_gqa where it has a kernel for it), skipped where the expanded
tensors would pass 8 GiB. Each row: GPU time per call (CUDA events, median), bytes read per second
(the cache rows the sequences hold, 576 x 2 bytes a key, plus q, qv and the output) and that rate's
share of the device-to-device copy bandwidth measured in the same run, and the error against a
float32 reference on the first (up to) 4 sequences. With 128 heads two 64-row Q tiles read each
key: the call is compute-bound there, and its TFLOP/s are printed too (the 2 x 64 x (576 + 512)
FLOPs a key a tile row).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench_decode import copy_bandwidth_gbs, graphed
from timing import format_table, measure

import fa3

D, DV = 64, 512
SCALE = 192 ** -0.5  # DeepSeek-V3's (qk_nope 128 + rope 64), without its YaRN factor
CASES = [(1, 32768), (16, 8192), (64, 4096), (128, 1024), (128, 4096)]  # (batch, keys a sequence)
SDPA_MAX_BYTES = 8 << 30


def make_case(batch, keys, heads, gen, page):
    """q_pe, q_nope (batch, heads, d) packed, vLLM's fused paged cache as (k, v) views, the lengths,
    the permuted block table, and the dense (k, v) rows for SDPA and the reference."""
    pages_per_seq = keys // page
    cache = torch.randn(batch * pages_per_seq, page, DV + D, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(batch * pages_per_seq, device="cuda", generator=gen)
    table = perm.view(batch, pages_per_seq).to(torch.int32)
    q = torch.randn(batch, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qv = torch.randn(batch, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    return q, qv, cache, table, seqlens


def dense_rows(cache, table):
    """(batch, keys, 576) rows of each sequence, in order."""
    return cache[table.long()].flatten(1, 2)


def reference(q, qv, rows, count):
    """float32 MLA of the first `count` sequences: (count, heads, 512)."""
    qf = torch.cat([q[:count], qv[:count]], -1).float()  # (b, h, 576)
    keys = torch.cat([rows[:count, :, DV:], rows[:count, :, :DV]], -1).float()  # (b, n, 576) as [k_pe, latent]
    p = torch.softmax(torch.einsum("bhd,bnd->bhn", qf, keys) * SCALE, -1)
    return torch.einsum("bhn,bnd->bhd", p, rows[:count, :, :DV].float())


def runners(q, qv, cache, table, seqlens, batch, keys, heads):
    k, v = cache[..., DV:].unsqueeze(-2), cache[..., :DV].unsqueeze(-2)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, heads, DV, device="cuda", dtype=torch.bfloat16)

    def call():
        return fa3.flash_attn_varlen_func(q=q, k=k, v=v, q_v=qv, cu_seqlens_q=cu, max_seqlen_q=1, max_seqlen_k=keys,
                                          seqused_k=seqlens, block_table=table, softmax_scale=SCALE, causal=True,
                                          out=out, fa_version=3)
    found = {"fa3 (graph)": graphed(call), "fa3 (eager)": call}
    expanded = batch * heads * keys * (D + 2 * DV) * 2
    if expanded <= SDPA_MAX_BYTES:
        rows = dense_rows(cache, table)  # (outside the timing: SDPA has no paged cache)
        qs = torch.cat([q, qv], -1)[:, :, None]  # (b, h, 1, 576)
        ks = torch.cat([rows[..., DV:], rows[..., :DV]], -1)[:, None]  # (b, 1, n, 576)
        vs = rows[..., :DV][:, None].contiguous()

        def sdpa():
            return F.scaled_dot_product_attention(qs, ks, vs, scale=SCALE, enable_gqa=True)[:, :, 0]
        found["sdpa (latent expanded)"] = sdpa
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--quick", action="store_true", help="two cases a head count")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--page-size", type=int, default=64, help="rows a page (not a multiple of 64: row gathers)")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write); {torch.cuda.get_device_name()}", flush=True)
    cases = CASES[::2] if args.quick else CASES
    rows, records = [], []
    for heads in (int(h) for h in args.heads.split(",")):
        for batch, keys in cases:
            q, qv, cache, table, seqlens = make_case(batch, keys, heads, gen, args.page_size)
            count = min(batch, 4)
            ref = reference(q, qv, dense_rows(cache, table[:count]), count)
            read = batch * keys * (D + DV) * 2 + batch * heads * (D + 2 * DV) * 2
            flops = 2 * batch * keys * 64 * -(-heads // 64) * (D + 2 * DV)  # padded 64-row tiles
            for name, fn in runners(q, qv, cache, table, seqlens, batch, keys, heads).items():
                try:
                    got = fn()
                    err = ((got[:count].float() - ref).norm() / ref.norm()).item()
                    us = measure(fn) * 1e3
                except Exception as exc:  # a peer without a kernel for this case: the reason goes into the JSON
                    reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(f"  h{heads} b{batch} x {keys // 1024}k {name} failed: {reason}", flush=True)
                    records.append(dict(heads=heads, batch=batch, keys=keys, runner=name, error=reason))
                    continue
                gbs = read / (us * 1e-6) / 1e9
                row = [f"h{heads} b{batch} x {keys // 1024}k", name, f"{us:.1f}", f"{gbs:.0f}",
                       f"{gbs / copy_gbs:.0%}", f"{flops / (us * 1e-6) / 1e12:.0f}", f"{err:.1e}"]
                print("  ".join(row), flush=True)
                rows.append(row)
                records.append(dict(heads=heads, batch=batch, keys=keys, page_size=args.page_size, runner=name, us=us,
                                    gbs=gbs,
                                    copy_gbs=copy_gbs, rel_err=err))
            del q, qv, cache
            torch.cuda.empty_cache()
    print(format_table([f"case (pages of {args.page_size})", "runner", "us", "GB/s", "of copy", "TFLOP/s", "rel err"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
