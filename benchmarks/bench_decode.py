"""Serving: decode against a KV cache (fa3.attention_with_kvcache) and packed variable-length
prefill (fa3.attention_varlen), beside cuDNN, SDPA flash and flash-attn-4.

    python benchmarks/bench_decode.py [--json FILE] [--only decode|varlen|host] [--peers ...]

(`--only host`: the eager index checks' host cost, host_cost_rows; not part of the default run.)

fa3 is timed both eager and replayed from a CUDA graph (what engines do; the difference is host
overhead). The eager host checks of the index values copy cache_seqlens and block_table once and
skip calls that pass the same unmodified tensors (a model's layers in one step): the "fa3" row; the
"index values rewritten" row marks them modified before each call (every call copies and checks,
as the first layer of a step does), and "no index checks" leaves the checks out; "FP8 cache" rows
run the same call on q, k and v quantized to e4m3 per tensor, with descales (bf16 out; its "rel
err" is the quantization's, against fa3's bf16), and "FP8 cache, bf16 q" on the same cache with the
bf16 queries as they are (k and v descales only). Cases (bf16, d128, GQA 32 query / 8 KV heads, one
new query per sequence): batch 16 x 8k keys,
batch 1 x 32k, batch 64 x 4k, and a serving step's decodes, batch 126 of 512-3512 keys in a
shuffled order ("b126 x 512-3512", where the order of the CTAs matters), each dense and paged
(pages of 16, 64 and 256, permuted; 16 is vLLM's default and is read by row gathers, 64 and 256 by
TMA). In the other cases every sequence holds the full number of keys. Each row prints the GPU
time per call (CUDA events, median), the K/V bytes read per microsecond, and that rate's share of
the device-to-device copy bandwidth measured in the same run (bytes read + written per second by a
large copy).
SDPA peers see the cache as dense (batch, heads, keys, d) tensors with enable_gqa (uniform cases
only: they take no per-sequence lengths), eager and replayed from a CUDA graph; flash-attn-4 runs
its varlen entry with seqused_k (and page_table for the paged rows).

Varlen prefill (causal, same heads): 32 prompts of 100-4000 tokens (seeded), packed, against the
same prompts padded to the longest (fa3.attention and cuDNN on the padded batch: what a user without
varlen runs), flash-attn-4's varlen, and fa3.attention on a fixed-length batch with the same total
tokens ("dense, equal tokens"), and fa3's FP8 varlen on the same prompts quantized per tensor (its
"rel err" column: the FP8 error against fa3's bf16). Each row gives TFLOP/s of the real (unpadded)
causal work, except the equal-tokens row, which counts its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from timing import attention_flops, format_table, measure, tflops

import fa3

HEADS_Q, HEADS_KV, D = 32, 8, 128
CASES = [(16, 8192), (1, 32768), (64, 4096), (126, 3584)]  # (batch, keys: the longest)
# the last case's lengths: a serving step's decodes, 512-3512 keys in a shuffled order (s1 takes them
# longest first: kernels/entry_order.py); the others hold `keys` each
RAGGED = {126: [512 + 24 * i for i in range(126)]}


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (GB/s)."""
    src = torch.randn(256 * 1024 * 1024, device="cuda")
    dst = torch.empty_like(src)
    ms = measure(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def case_lengths(batch, keys) -> list[int]:
    """Each sequence's keys: `keys`, or the ragged case's lengths in a fixed shuffled order."""
    if batch not in RAGGED:
        return [keys] * batch
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(0)).tolist()
    return [RAGGED[batch][i] for i in order]


def make_case(batch, keys, page_size, gen):
    q = torch.randn(batch, 1, HEADS_Q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, keys, HEADS_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    seqlens = torch.tensor(case_lengths(batch, keys), dtype=torch.int32, device="cuda")
    if page_size is None:
        return q, k, v, seqlens, None
    per_seq = keys // page_size
    perm = torch.randperm(batch * per_seq, device="cuda", generator=gen)
    pages_k = torch.empty(batch * per_seq, page_size, HEADS_KV, D, device="cuda", dtype=k.dtype)
    pages_v = torch.empty_like(pages_k)
    pages_k[perm] = k.view(-1, page_size, HEADS_KV, D)
    pages_v[perm] = v.view(-1, page_size, HEADS_KV, D)
    return q, pages_k, pages_v, seqlens, perm.view(batch, per_seq).to(torch.int32)


def graphed(fn):
    """fn captured in a CUDA graph (as serving engines run decode): replays cost no host work."""
    fn()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()

    def replay():
        graph.replay()
        return result
    return replay


def without_index_checks(fn):
    """fn with the eager host checks of cache_seqlens/block_table switched off (as under capture):
    the difference to the "fa3" row is what those checks cost an eager call."""
    def call():
        checkable = fa3.index_checks.values_checkable
        fa3.index_checks.values_checkable = lambda device: False
        try:
            return fn()
        finally:
            fa3.index_checks.values_checkable = checkable
    return call


def runners(q, k, v, seqlens, table, peers):
    call = lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
    def call_rewritten():  # as if a decode step had written the index tensors: they are checked again
        for t in (seqlens, table):
            if t is not None:
                torch.autograd.graph.increment_version(t)
        return call()
    out = {"fa3": call, "fa3 (index values rewritten)": call_rewritten,
           "fa3 (no index checks)": without_index_checks(call), "fa3 (graph)": graphed(call)}
    # an FP8 cache (q, k, v quantized per tensor): the same call with descales, bf16 out
    (q8, sq), (k8, sk), (v8, sv) = (fa3.quantize_fp8(x) for x in (q, k, v))
    call8 = lambda: fa3.attention_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, block_table=table,
                                               q_descale=sq, k_descale=sk, v_descale=sv)
    out.update({"fa3 FP8 cache": call8, "fa3 FP8 cache (graph)": graphed(call8)})
    # the same FP8 cache read by the bf16 queries as they are (no q_descale), out in bf16
    call8q = lambda: fa3.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, block_table=table,
                                                k_descale=sk, v_descale=sv)
    out.update({"fa3 FP8 cache, bf16 q": call8q, "fa3 FP8 cache, bf16 q (graph)": graphed(call8q)})
    # s1 named (kernel=None runs s2 on paged and FP8 caches: fa3/_dispatch.cache_rung), graph-replayed
    s1 = lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, kernel="s1")
    s1_fp8 = lambda: fa3.attention_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, block_table=table,
                                                q_descale=sq, k_descale=sk, v_descale=sv, kernel="s1")
    s1_fp8q = lambda: fa3.attention_with_kvcache(q, k8, v8, cache_seqlens=seqlens, block_table=table,
                                                 k_descale=sk, v_descale=sv, kernel="s1")
    out.update({"fa3 s1 (graph)": graphed(s1), "fa3 s1 FP8 cache (graph)": graphed(s1_fp8),
                "fa3 s1 FP8 cache, bf16 q (graph)": graphed(s1_fp8q)})
    if table is None and bool((seqlens == k.shape[1]).all()):  # SDPA attends to every key
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        for name, backend in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
            if name in peers:
                b = getattr(torch.nn.attention.SDPBackend, backend)

                def sdpa(b=b):  # (not `call`: call_rewritten reads that name when it runs)
                    with torch.nn.attention.sdpa_kernel([b]):
                        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                # replayed too: batch-1 decodes are host-bound eager, and cuDNN splits the keys as fa3 does
                out.update({name: sdpa, f"{name} (graph)": graphed(sdpa)})
    if "fa4" in peers:
        try:
            from flash_attn.cute import flash_attn_varlen_func

            out["fa4"] = lambda: flash_attn_varlen_func(q, k, v, seqused_k=seqlens, page_table=table,
                                                        num_splits=0)
        except Exception as exc:  # not installed here
            print(f"fa4 skipped: {exc}")
    return out


VARLEN_PROMPTS, VARLEN_MIN, VARLEN_MAX = 32, 100, 4000


def causal_flops(lengths) -> float:
    return sum(attention_flops(1, HEADS_Q, n, n, D, True) for n in lengths)


def varlen_rows(peers, gen):
    """(rows, records) of the varlen prefill table."""
    lengths = torch.randint(VARLEN_MIN, VARLEN_MAX + 1, (VARLEN_PROMPTS,), generator=torch.Generator().manual_seed(0)).tolist()
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    mk = lambda n, h: torch.randn(n, h, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = mk(total, HEADS_Q), mk(total, HEADS_KV), mk(total, HEADS_KV)

    def padded(x):
        out = x.new_zeros(VARLEN_PROMPTS, longest, x.shape[1], D)
        for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
            out[b, :n] = x[start:start + n]
        return out
    qp, kp, vp = padded(q), padded(k), padded(v)
    mean = total // VARLEN_PROMPTS
    qe, ke, ve = (mk(total - total % VARLEN_PROMPTS, h).view(VARLEN_PROMPTS, mean, h, D)
                  for h in (HEADS_Q, HEADS_KV, HEADS_KV))
    work = causal_flops(lengths)
    (q8, sq), (k8, sk), (v8, sv) = (fa3.quantize_fp8(x) for x in (q, k, v))  # per tensor
    runs = {
        "fa3 varlen": (lambda: fa3.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True), work),
        "fa3 varlen FP8": (lambda: fa3.attention_varlen(q8, k8, v8, cu, cu, longest, longest, causal=True,
                                                        q_descale=sq, k_descale=sk, v_descale=sv), work),
        "fa3 padded": (lambda: fa3.attention(qp, kp, vp, causal=True), work),
        f"fa3 dense, equal tokens ({VARLEN_PROMPTS} x {mean})":
            (lambda: fa3.attention(qe, ke, ve, causal=True), causal_flops([mean] * VARLEN_PROMPTS)),
    }
    if "sdpa-cudnn" in peers:
        qt, kt, vt = qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)

        def cudnn():
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        runs["sdpa-cudnn padded"] = (cudnn, work)
    if "fa4" in peers:
        try:
            from flash_attn.cute import flash_attn_varlen_func

            runs["fa4 varlen"] = (lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                 max_seqlen_q=longest, max_seqlen_k=longest,
                                                                 causal=True), work)
        except Exception as exc:
            print(f"fa4 skipped: {exc}")
    ref = runs["fa3 varlen"][0]()
    rows, records = [], []
    for name, (fn, flops) in runs.items():
        try:
            got = fn()
            got = got[0] if isinstance(got, tuple) else got
            err = float("nan")
            if "varlen" in name:
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = measure(fn)
        except Exception as exc:
            print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        row = [name, f"{ms * 1e3:.0f}", f"{tflops(flops, ms):.0f}", f"{err:.1e}"]
        print("  ".join(row), flush=True)
        rows.append(row)
        records.append(dict(case="varlen prefill", runner=name, us=ms * 1e3, tflops=tflops(flops, ms),
                            prompts=VARLEN_PROMPTS, total_tokens=total, longest=longest, rel_err_vs_fa3=err))
    return rows, records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="sdpa-cudnn,sdpa-flash,fa4")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", choices=("decode", "varlen", "host"),
                    help="one table (host: the eager index checks' host cost, not in the default run)")
    args = ap.parse_args(argv)
    peers = args.peers.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    if args.only == "host":
        records += host_cost_rows(gen)
    # decode first: right after the varlen section one run measured b16 x 8k dense 17% slower (212.9
    # vs 180-181 us for the same code timed alone, old and new, four times each)
    if args.only in (None, "decode"):
        records += decode_rows(peers, gen)
    if args.only in (None, "varlen"):
        torch.cuda.empty_cache()
        print(f"varlen prefill: {VARLEN_PROMPTS} prompts of {VARLEN_MIN}-{VARLEN_MAX} tokens, causal", flush=True)
        vrows, vrecords = varlen_rows(peers, gen)
        records += vrecords
        print(format_table(["varlen prefill", "us", "TFLOP/s", "rel err vs fa3"], vrows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


HOST_CALLS, HOST_ROUNDS = 500, 7


def host_cost_rows(gen):
    """What the eager index checks cost a call, where it shows: b1 x 32k is host-bound (the host
    takes longer than the kernel), so wall time per call is host time. The per-call CUDA events of
    the decode table move by 15-45 us there between runs; here each mode runs HOST_CALLS calls per
    round, the modes take turns over HOST_ROUNDS rounds (rotating which goes first), and each
    mode's median round counts."""
    rows, records = [], []
    for batch, keys in ((1, 32768), (16, 8192)):
        for page_size in (None, 16, 64, 256):
            q, k, v, seqlens, table = make_case(batch, keys, page_size, gen)
            call = lambda: fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
            modes = {"checks": call, "no checks": without_index_checks(call), "graph": graphed(call)}
            for fn in modes.values():
                for _ in range(50):
                    fn()
            per_call = {m: [] for m in modes}
            for r in range(HOST_ROUNDS):
                for m in list(modes)[r % 3:] + list(modes)[:r % 3]:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(HOST_CALLS):
                        modes[m]()
                    torch.cuda.synchronize()
                    per_call[m].append((time.perf_counter() - start) / HOST_CALLS * 1e6)
            us = {m: statistics.median(t) for m, t in per_call.items()}
            case = f"b{batch} x {keys // 1024}k " + ("dense" if page_size is None else f"page {page_size}")
            row = [case] + [f"{us[m]:.1f}" for m in modes] + [f"{us['checks'] / us['no checks']:.3f}"]
            print("  ".join(row), flush=True)
            rows.append(row)
            records.append(dict(batch=batch, keys=keys, page_size=page_size, host_us=us))
    print(format_table(["case", "checks us", "no checks us", "graph us", "checks / no checks"], rows))
    return records


def decode_rows(peers, gen):
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows, records = [], []
    for batch, keys in CASES:
        for page_size in (None, 16, 64, 256):
            q, k, v, seqlens, table = make_case(batch, keys, page_size, gen)
            kv_bytes = 2 * int(seqlens.sum()) * HEADS_KV * D * 2
            ref = fa3.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table)
            for name, fn in runners(q, k, v, seqlens, table, peers).items():
                try:
                    got = fn()
                    got = got[0] if isinstance(got, tuple) else got
                    if name.startswith("sdpa"):
                        got = got.transpose(1, 2)
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    us = measure(fn) * 1e3
                except Exception as exc:  # a peer that cannot run this case: the reason goes into the JSON too
                    reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(f"  {name} failed: {reason}", flush=True)
                    records.append(dict(batch=batch, keys=keys, page_size=page_size, runner=name, error=reason))
                    continue
                gbs = kv_bytes // (2 if "FP8" in name else 1) / (us * 1e-6) / 1e9  # (1-byte elements)
                lengths = f"{min(RAGGED[batch])}-{max(RAGGED[batch])}" if batch in RAGGED else f"{keys // 1024}k"
                case = f"b{batch} x {lengths} " + ("dense" if page_size is None else f"page {page_size}")
                row = [case, name, f"{us:.1f}", f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}", f"{err:.1e}"]
                print("  ".join(row), flush=True)
                rows.append(row)
                records.append(dict(batch=batch, keys=keys, page_size=page_size, runner=name, us=us,
                                    gbs=gbs, copy_gbs=copy_gbs, rel_err_vs_fa3=err))
            del q, k, v
    print(format_table(["case", "runner", "us", "GB/s", "of copy", "rel err vs fa3"], rows))
    return records


if __name__ == "__main__":
    raise SystemExit(main())
