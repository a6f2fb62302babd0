"""compute-sanitizer over the forward, KV-cache and GEMM kernels (GPU; skipped without the tool).

racecheck: no shared-memory hazard, on shapes where persistent CTAs take several tiles, so that
k5.5's next-tile hand-off (producer warp -> consumer warpgroups, common/scheduler.py) runs many
times per CTA: causal fixed-shape calls (the dynamic schedule; d128 with two consumer warpgroups,
d64 with three), non-causal ones (the static schedule), packed batches both ways, the KV-cache
kernel (dense and paged, split and not, with an append; pages of 16 through the cp.async row
gathers, decodes and packed queries), every GEMM rung, and the FP8 forward (fixed and packed, with
its V^T kernels) and FP8 GEMM.

memcheck: index values no host check saw (as inside a CUDA-graph capture: the check is switched
off) never make a kernel touch memory outside its tensors (the packed batches' backward included):
offsets past the packed rows, negative
or decreasing ones, cache lengths past the capacity, page indices outside the pool. Torch's caching
allocator is off in that process, so that every tensor is its own allocation and memcheck sees an
access even a few bytes past one.

Each case runs in its own process (conftest.run_script). Also, without the tool: k5.5's dynamic
schedule gives what k5.4's static one gives (the same tiles, the same math) where CTAs take many
tiles, so no tile index is lost or misread in the hand-off.
"""

import json

import pytest
import torch

import fa3

from conftest import INDEX_PROBLEMS, MEMCHECK, RACECHECK, compute_sanitizer, racecheck_clean, rel_err, run_script

pytestmark = pytest.mark.gpu


RACE_SCRIPT = r'''
import sys
import torch
import fa3

case = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
i32 = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")
outs = []
if case.startswith("forward"):  # 1 x 4096 x 8 heads: 256 (d64, d96: 176) Q tiles on <= 132 CTAs
    causal, d = case.startswith("forward-causal"), int(case.rsplit("-d", 1)[1]) if "-d" in case else 128
    q, k, v = rand(1, 4096, 8, d), rand(1, 4096, 2, d), rand(1, 4096, 2, d)
    outs.append(fa3.attention(q, k, v, causal=causal, kernel="k5.5"))
elif case == "varlen":  # 35 Q tiles a head, 8 heads
    lens = [1000, 1, 2100, 64, 931]  # 4096 rows: the packed entries fill the tensors
    cu = i32([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v = rand(sum(lens), 8, 128), rand(sum(lens), 2, 128), rand(sum(lens), 2, 128)
    for causal in (True, False):
        outs.append(fa3.attention_varlen(q, k, v, cu, cu, causal=causal, kernel="k5.5"))
elif case == "kvcache":
    q = rand(4, 2, 16, 128)  # GQA 8: 16 packed rows a KV head
    lengths = i32([4000, 1, 300, 2047])
    dense = rand(4, 4096, 2, 128), rand(4, 4096, 2, 128)
    pages = rand(64, 256, 2, 128), rand(64, 256, 2, 128)  # 16 pages a sequence: capacity 4096
    table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    # one split (O written directly), the heuristic's (partials, combine), 40 (the combine's four
    # warps share a row's partials through SMEM)
    for splits in (1, 0, 40):
        outs.append(fa3.attention_with_kvcache(q, *dense, cache_seqlens=lengths, causal=True,
                                               num_splits=splits))
        outs.append(fa3.attention_with_kvcache(q, *pages, cache_seqlens=lengths, block_table=table,
                                               causal=True, num_splits=splits))
    new = rand(4, 3, 2, 128), rand(4, 3, 2, 128)
    outs.append(fa3.attention_with_kvcache(q, *pages, *new, cache_seqlens=lengths, block_table=table))
elif case == "kvcache-gather":  # pages of 16 (cp.async row gathers), decodes and packed queries
    lengths = i32([4000, 1, 300, 2047])
    pages = rand(1024, 16, 2, 128), rand(1024, 16, 2, 128)  # 256 pages a sequence: capacity 4096
    table = torch.randperm(1024, device="cuda").to(torch.int32).view(4, 256)
    for splits in (1, 0):
        outs.append(fa3.attention_with_kvcache(rand(4, 2, 16, 128), *pages, cache_seqlens=lengths,
                                               block_table=table, causal=True, num_splits=splits))
        cu = i32([0, 1, 65, 66, 100])  # a decode, a 64-token chunk, a decode, a 34-token chunk
        outs.append(fa3.attention_varlen(rand(100, 16, 128), *pages, cu, None, 64, 4000, causal=True,
                                         block_table=table, seqused_k=lengths, num_splits=splits))
elif case == "kvcache-chunks":  # prompt chunks on K5 over the cache beside decodes on S1, CTAs looping
    lengths = i32([3000, 1, 1300, 77, 2047])  # ragged: each chunk's first K/V block has rows past its keys
    cu = i32([0, 1000, 1001, 1500, 1501, 1630])  # chunks of 1000, 499, 129 queries; two decodes
    for page in (16, 64, None):
        if page is None:
            cache = rand(5, 4096, 2, 128), rand(5, 4096, 2, 128)
            table = None
        else:
            cache = rand(4096 // page * 5, page, 2, 128), rand(4096 // page * 5, page, 2, 128)
            table = torch.randperm(4096 // page * 5, device="cuda").to(torch.int32).view(5, -1)
        for causal in (True, False):  # the dynamic schedule, the static one
            outs.append(fa3.attention_varlen(rand(1630, 16, 128), *cache, cu, None, 1000, 3000, causal=causal,
                                             block_table=table, seqused_k=lengths))
elif case == "kvcache-fp8":  # an FP8 cache: pages of 64 (TMA) and of 16 (gathers), descales per head,
    f8 = lambda t: t.to(torch.float8_e4m3fn)  # FP8 queries and bf16 ones (dequantized in the kernel)
    lengths = i32([4000, 1, 300, 2047])
    scales = [torch.rand(4, 2, device="cuda", generator=g) + 0.5 for _ in range(3)]
    for page in (64, 16):
        pages = f8(rand(4096 // page * 4, page, 2, 128)), f8(rand(4096 // page * 4, page, 2, 128))
        table = torch.randperm(4096 // page * 4, device="cuda").to(torch.int32).view(4, -1)
        for splits in (1, 0):
            outs.append(fa3.attention_with_kvcache(f8(rand(4, 2, 16, 128)), *pages, cache_seqlens=lengths,
                                                   block_table=table, causal=True, num_splits=splits,
                                                   q_descale=scales[0], k_descale=scales[1], v_descale=scales[2]))
            outs.append(fa3.attention_with_kvcache(rand(4, 2, 16, 128), *pages, cache_seqlens=lengths,
                                                   block_table=table, causal=True, num_splits=splits,
                                                   k_descale=scales[1], v_descale=scales[2]))
elif case == "flex":  # K5 with a score mod (a captured table) and a mask mod (captured ids), causal and not
    from fa3 import flex
    q, k, v = rand(2, 8, 2100, 128), rand(2, 2, 2100, 128), rand(2, 2, 2100, 128)
    docs = (torch.arange(2100, device="cuda") // 700).to(torch.int32).expand(2, -1).contiguous()
    for score_mod, mask_mod in ((flex.alibi(flex.alibi_slopes(8, "cuda")), flex.document(docs)), (None, flex.causal)):
        outs.append(fa3.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  score_mod=score_mod, mask_mod=mask_mod))
elif case in ("flex-blocks", "flex-blocks-backward"):  # K5's (and the backward's) block-sparse walk: documents, Q tiles 5-7 with no block, GQA; d128 and
    # d64 (its 128-row tiles), with full-block lists and without; 2 x 8 x 17 tiles: CTAs take several
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    docs = (torch.arange(2100, device="cuda") // 700).to(torch.int32).expand(2, -1).contiguous()

    def gap_documents(ids):  # (a closure: the kernel takes the captured ids as an argument)
        def documents_with_a_gap(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & ((q_idx < 640) | (q_idx >= 1024))
        return documents_with_a_gap
    documents_with_a_gap = gap_documents(docs)
    full = create_block_mask(documents_with_a_gap, 2, None, 2100, 2100, device="cuda")
    listed = full.to_dense().to(torch.int8)
    partial_only = BlockMask.from_kv_blocks(listed.sum(-1).to(torch.int32),
                                            torch.argsort(listed, dim=-1, descending=True, stable=True).to(torch.int32),
                                            mask_mod=documents_with_a_gap, seq_lengths=(2100, 2100))
    for d in (128, 64):
        q, k, v = rand(2, 8, 2100, d), rand(2, 2, 2100, d), rand(2, 2, 2100, d)
        for block in (full, partial_only):
            if case == "flex-blocks":
                outs.append(fa3.flex_attention(q, k, v, block_mask=block, enable_gqa=True))
                continue
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = fa3.flex_attention(q, k, v, block_mask=block, enable_gqa=True)
            out.backward(torch.randn_like(out))
            outs += [out.detach(), q.grad, k.grad, v.grad]
elif case == "mla":  # M1 (qv): 16 and 128 query heads (one and two Q tiles a KV head), pages of 64,
    # ragged lengths, one split and planned splits (the combine at d512), one and two queries, causal
    lens = [4000, 1, 300, 2047]
    table = torch.randperm(256, device="cuda").to(torch.int32).view(4, 64)
    k_cache, v_cache = rand(256, 64, 1, 64), rand(256, 64, 1, 512)
    for heads, new in ((16, 1), (128, 2)):
        q, qv = rand(4, new, heads, 64), rand(4, new, heads, 512)
        for splits in (1, 0):
            outs.append(fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32(lens), block_table=table,
                                                   qv=qv, causal=True, num_splits=splits))
elif case == "mla-bad-indices":  # M1 under memcheck with values no host check saw: lengths past the
    # capacity and negative, pages past the pool and negative, one split and planned
    from fa3 import index_checks
    index_checks.values_checkable = lambda device: False
    table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    table[0, 3], table[2, 0] = 100000, -7
    k_cache, v_cache = rand(64, 64, 1, 64), rand(64, 64, 1, 512)
    q, qv = rand(4, 1, 16, 64), rand(4, 1, 16, 512)
    for splits in (1, 0):
        fa3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([100000, -5, 700, 1024]),
                                   block_table=table, qv=qv, causal=True, num_splits=splits)
elif case == "flex-backward":  # the backward with mods: ALiBi + documents (GQA 4) at d128, softcap at d64
    from fa3 import flex
    docs = (torch.arange(2100, device="cuda") // 700).to(torch.int32).expand(2, -1).contiguous()
    for d, score_mod, mask_mod in ((128, flex.alibi(flex.alibi_slopes(8, "cuda")), flex.document(docs)),
                                   (64, flex.softcap(30.0), flex.causal)):
        q, k, v = (t.requires_grad_() for t in (rand(2, 2100, 8, d), rand(2, 2100, 2, d), rand(2, 2100, 2, d)))
        out = fa3.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        out.backward(torch.randn_like(out))
        outs += [out.detach(), q.grad, k.grad, v.grad]
elif case == "gemm":  # 512 tiles of 128 x 256
    a, b = rand(4096, 256), rand(256, 4096)
    for kernel in fa3.available_kernels("gemm"):
        outs.append(fa3.gemm(a, b, kernel=kernel))
elif case == "fp8":  # every FP8 forward rung as "forward" and "varlen" (f1: both V^T kernels too)
    f8 = lambda t: t.to(torch.float8_e4m3fn)
    q, k, v = f8(rand(1, 4096, 8, 128)), f8(rand(1, 4096, 2, 128)), f8(rand(1, 4096, 2, 128))
    lens = [1000, 1, 2100, 64, 931]
    cu = i32([0] + torch.tensor(lens).cumsum(0).tolist())
    for kernel in fa3.available_kernels("attention_fp8"):
        for causal in (True, False):
            outs.append(fa3.attention(q, k, v, causal=causal, kernel=kernel))
            outs.append(fa3.attention_varlen(q[0], k[0], v[0], cu, cu, causal=causal, kernel=kernel))
elif case == "fp8-gemm":  # 512 tiles of 128 x 256, per-tensor scales
    a, b = rand(4096, 256).to(torch.float8_e4m3fn), rand(4096, 256).to(torch.float8_e4m3fn).t()
    scale = torch.full((1,), 0.5, device="cuda")
    for kernel in fa3.available_kernels("gemm"):
        outs.append(fa3.gemm(a, b, scale_a=scale, scale_b=scale, kernel=kernel))
else:
    raise SystemExit(f"FAIL: unknown case {case}")
torch.cuda.synchronize()
assert all(torch.isfinite(o).all() for o in outs), "FAIL: non-finite output"
print("done")
'''

RACE_CASES = ["forward-causal", "forward-causal-d64", "forward-causal-d96", "forward-d96", "forward", "varlen",
              "kvcache", "kvcache-gather", "kvcache-chunks", "gemm", "fp8", "fp8-gemm", "kvcache-fp8", "flex",
              "flex-blocks", "mla", "flex-backward", "flex-blocks-backward"]


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_dynamic_schedule_matches_static(head_dim):
    """k5.5 (tiles from a counter, handed from the producer warp to the consumers) against k5.4
    (the same kernel and tiles on the static b, b + grid, ... order), fixed-shape and packed, where
    every CTA takes several tiles: the same tiles' math, so the same values (up to rounding, should
    the two compiles schedule differently); a tile lost in the hand-off leaves NaN rows."""
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = rand(1, 4096, 8, head_dim), rand(1, 4096, 2, head_dim), rand(1, 4096, 2, head_dim)
    ref = fa3.attention(q, k, v, causal=True, kernel="k5.4")
    for _ in range(3):  # the counter is zeroed per call: repeated calls too
        got = fa3.attention(q, k, v, causal=True, kernel="k5.5", out=torch.full_like(q, float("nan")))
        assert not got.isnan().any() and rel_err(got, ref) < 1e-3
    lens = [1000, 1, 2100, 64, 931]  # 4096 rows: the packed entries fill the tensors
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = q[0, :sum(lens)], k[0, :sum(lens)], v[0, :sum(lens)]
    ref = fa3.attention_varlen(q, k, v, cu, cu, causal=True, kernel="k5.4")
    got = fa3.attention_varlen(q, k, v, cu, cu, causal=True, kernel="k5.5")
    assert rel_err(got, ref) < 1e-3


@pytest.mark.parametrize("case", RACE_CASES)
def test_racecheck(case, tmp_path):
    if compute_sanitizer() is None:
        pytest.skip("compute-sanitizer is not installed")
    report = run_script(tmp_path, RACE_SCRIPT, case, sanitizer=RACECHECK)
    assert "done" in report and "FAIL" not in report, report[-4000:]
    assert racecheck_clean(report), report[-4000:]


MEM_SCRIPT = r'''
import json, os, sys
os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # one allocation per tensor: memcheck sees all
import torch
import fa3
from fa3 import index_checks

index_checks.values_checkable = lambda device: False  # as under capture: no host check
''' + INDEX_PROBLEMS + r'''
entry, argument, index, value = json.loads(sys.argv[1])
index = tuple(index) if isinstance(index, list) else index
bf16_q = entry.startswith("bf16q")  # bf16 queries over an FP8 cache
entry = entry.removeprefix("bf16q")
fp8 = entry.startswith("fp8")  # the FP8 forward's packed batch (its V^T kernel included), an FP8 cache
(q, k, v), args = index_problem(entry.removeprefix("fp8"))
args[argument][index] = value
if fp8:
    q, k, v = (t if bf16_q and t is q else t.to(torch.float8_e4m3fn) for t in (q, k, v))
if entry in ("varlen", "fp8varlen"):
    for causal in (True, False):
        fa3.attention_varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], causal=causal,
                             kernel=None if fp8 else "k5.5")
    if not fp8:  # the packed backward too: dQ's tile slots, the postprocess's search, dK/dV rows
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        fa3.attention_varlen(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], causal=True).sum().backward()
elif entry in ("cachechunks", "cachemany"):  # the prompt chunk on K5, the decode on S1; decodes sorted
    for causal in (True, False):
        fa3.attention_varlen(q, k, v, args["cu_seqlens_q"], None, 200 if entry == "cachechunks" else 1, 512,
                             block_table=args["block_table"], seqused_k=args["seqused_k"], causal=causal)
else:
    for splits in (1, 0):
        fa3.attention_with_kvcache(q, k, v, cache_seqlens=args["cache_seqlens"],
                                   block_table=args["block_table"], causal=True, num_splits=splits)
torch.cuda.synchronize()
print("done")
'''

# name -> (entry, argument, index, bad value)
MEM_CASES = {
    "varlen-cu-q-past-total": ("varlen", "cu_seqlens_q", 2, 400),  # O/LSE rows 300..399
    "varlen-cu-q-negative": ("varlen", "cu_seqlens_q", 1, -7),  # entry 1 from row -7
    "varlen-cu-q-first-past-total": ("varlen", "cu_seqlens_q", 0, 100000),
    "varlen-cu-q-huge": ("varlen", "cu_seqlens_q", 2, 2**31 - 1),
    "varlen-cu-k-past-total": ("varlen", "cu_seqlens_k", 2, 100000),
    "varlen-cu-k-negative": ("varlen", "cu_seqlens_k", 1, -100000),
    "fp8-varlen-cu-q-past-total": ("fp8varlen", "cu_seqlens_q", 2, 400),
    "fp8-varlen-cu-k-past-total": ("fp8varlen", "cu_seqlens_k", 2, 100000),
    "fp8-varlen-cu-k-negative": ("fp8varlen", "cu_seqlens_k", 1, -100000),
    "fp8-varlen-cu-k-decreasing": ("fp8varlen", "cu_seqlens_k", 2, 50),
    "dense-seqlens-past-capacity": ("dense", "cache_seqlens", 0, 100000),
    "dense-seqlens-negative": ("dense", "cache_seqlens", 1, -7),
    "paged-seqlens-past-capacity": ("paged", "cache_seqlens", 1, 100000),
    "paged-table-past-pool": ("paged", "block_table", [1, 0], 100000),
    "paged-table-negative": ("paged", "block_table", [1, 1], -7),
    "fp8-paged-seqlens-past-capacity": ("fp8paged", "cache_seqlens", 1, 100000),
    "fp8-paged-table-past-pool": ("fp8paged", "block_table", [1, 0], 100000),
    "fp8-paged16-table-negative": ("fp8paged16", "block_table", [1, 1], -7),
    "bf16q-fp8-paged-seqlens-past-capacity": ("bf16qfp8paged", "cache_seqlens", 1, 100000),
    "bf16q-fp8-paged16-table-past-pool": ("bf16qfp8paged16", "block_table", [1, 0], 100000),
    "chunks-seqused-past-capacity": ("cachechunks", "seqused_k", 0, 100000),
    "chunks-table-past-pool": ("cachechunks", "block_table", [0, 3], 100000),
    "chunks-table-negative": ("cachechunks", "block_table", [0, 0], -7),
    "chunks-cu-q-past-total": ("cachechunks", "cu_seqlens_q", 1, 400),
    "many-seqused-past-capacity": ("cachemany", "seqused_k", 5, 100000),  # the sort's lengths too
    "many-seqused-negative": ("cachemany", "seqused_k", 6, -7),
    "many-table-past-pool": ("cachemany", "block_table", [7, 1], 100000),
    "many-cu-q-negative": ("cachemany", "cu_seqlens_q", 40, -5),
}


def test_mla_unchecked_values_stay_in_bounds(tmp_path):
    """M1 (qv) clamps lengths and page indices as S1 does: memcheck finds no access outside."""
    if compute_sanitizer() is None:
        pytest.skip("compute-sanitizer is not installed")
    report = run_script(tmp_path, RACE_SCRIPT.replace('import sys\n', 'import os, sys\nos.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"\n', 1),
                        "mla-bad-indices", sanitizer=MEMCHECK)
    assert "done" in report and "FAIL" not in report, report[-4000:]
    assert "ERROR SUMMARY: 0 errors" in report, report[-4000:]


@pytest.mark.parametrize("case", list(MEM_CASES))
def test_unchecked_values_stay_in_bounds(case, tmp_path):
    if compute_sanitizer() is None:
        pytest.skip("compute-sanitizer is not installed")
    report = run_script(tmp_path, MEM_SCRIPT, json.dumps(MEM_CASES[case]), sanitizer=MEMCHECK)
    assert "done" in report, report[-4000:]
    assert "ERROR SUMMARY: 0 errors" in report, report[-4000:]
