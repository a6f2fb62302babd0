"""Flex attention's forward: fa3.flex_attention against fa3's own kernels and its peers (issue 64).

bf16, batch x seqlen = 32k tokens, hidden size 2048 (heads = 2048 // head_dim), q, k, v from
torch.randn, seqlen_q = seqlen_k. One row per (case, head dim, seqlen), printed as it is done:

    causal     fa3.flex_attention with a causal BlockMask (create_block_mask: its empty blocks
               skipped) against fa3.attention(causal=True), fa3's built-in causal
    documents  N packed documents of random lengths per sequence, flex attention's document mask
               as mask_mod with its BlockMask, against fa3.attention(mask_mod=...) (the same mask
               applied to every tile, no block skipped) and fa3.attention_varlen over the same
               documents packed (cu_seqlens: each document one entry)
    causal-documents  the same documents trained causally (pretraining's mask: fa3.flex's
               causal_document), against fa3.attention_varlen(causal=True) over them
    alibi      an ALiBi score mod (no mask) against fa3.attention with no mod

Peers in the same run: torch's flex_attention compiled (torch.compile(flex_attention)) with the
same mods and BlockMask, and flash-attn 4's CuTe kernel (flash_attn.cute.flash_attn_func with its
score_mod / mask_mod and block_sparse_tensors) when it is importable (else its column is skipped
with the reason printed; so is a case it refuses).

--backward times the training step instead: the forward and torch.autograd.grad of its output
with respect to q, k and v (each column from its own leaf tensors), counted as 3.5 times the
forward's FLOPs (the backward's five GEMMs to the forward's two).

TFLOP/s count only the work the mask leaves: 4 x head_dim x (visible (query, key) pairs) per head
and batch entry (x 3.5 with --backward) over the median CUDA-event time (causal: s (s + 1) / 2 pairs; documents: the sum of
each document's length squared, n (n + 1) / 2 each causally; alibi: s^2), the same count for every column, so the numbers
compare across columns. A "max diff" column gives the largest |fa3 flex - torch flex| of the row's
outputs (bf16), a check that the two computed the same thing.

    python benchmarks/bench_flex.py [--head-dims 64,128] [--seqlens 8192,16384,32768] [--short]
        [--cases causal,documents,causal-documents,alibi] [--documents 4,16,64] [--peers torch,fa4] [--backward]
        [--json FILE]

--short runs seqlens 1024 and 2048 (a quick look). --kernels RUNG,... adds an "fa3 flex RUNG" column
per K5 rung named (the flex path on that rung: kernel=RUNG), and --variant NAME=BASE:key=value,...
defines an experiment rung for it (benchmarks/variants.py), e.g. the block-sparse forward with a
static schedule beside the default's dynamic one:

    python benchmarks/bench_flex.py --cases causal,documents --kernels k55s --variant k55s=k5.5:dynamic_schedule=0

Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import sys

from timing import MAX_CALL_S, TooSlow, format_table, measure, progress, write_json

import torch

import fa3
import variants
from fa3 import flex

TOTAL_TOKENS = 32768
HIDDEN = 2048
CASES = ("causal", "documents", "causal-documents", "alibi")
PEERS = ("torch", "fa4")
DEFAULT_SEQLENS = (8192, 16384, 32768)
SHORT_SEQLENS = (1024, 2048)


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        variants.register_from_argv(argv)  # before --kernels names them
    except ValueError as exc:
        raise SystemExit(f"bench_flex: {exc}") from None
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", type=_csv(int), default=[64, 128])
    p.add_argument("--seqlens", type=_csv(int), default=list(DEFAULT_SEQLENS))
    p.add_argument("--short", action="store_true", help=f"seqlens {','.join(map(str, SHORT_SEQLENS))}")
    p.add_argument("--cases", type=_csv(str), default=list(CASES), help="comma list of " + ",".join(CASES))
    p.add_argument("--documents", type=_csv(int), default=[4, 16, 64],
                   help="documents per sequence for the documents case (one row each)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ",".join(PEERS) + " ('none')")
    p.add_argument("--backward", action="store_true", help="time forward + backward (a training step)")
    p.add_argument("--json", metavar="FILE", help="also write every measurement here")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--max-call-s", type=float, default=MAX_CALL_S)
    p.add_argument("--kernels", type=_csv(str), default=[],
                   help="K5 rungs (or --variant names) for more 'fa3 flex RUNG' columns")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                   help="an experiment rung for --kernels (benchmarks/variants.py)")
    args = p.parse_args(argv)
    if args.short:
        args.seqlens = list(SHORT_SEQLENS)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        p.error(f"--cases: unknown {', '.join(bad)}; choose from {', '.join(CASES)}")
    args.peers = [] if args.peers == "none" else _csv(str)(args.peers)
    bad = [n for n in args.peers if n not in PEERS]
    if bad:
        p.error(f"--peers: unknown {', '.join(bad)}; choose from {', '.join(PEERS)}")
    if any(d < 1 or HIDDEN % d for d in args.head_dims):
        p.error(f"--head-dims must divide the hidden size {HIDDEN}")
    return args


# ----------------------------------------------------------------------------- a row's problem
class Problem:
    """One row's inputs: q, k, v (batch, seqlen, heads, d) contiguous, their (batch, heads, seqlen,
    d) views (flex attention's layout, as fa3.flex_attention takes them), contiguous copies of those
    for torch (its compiled kernel's own layout), the mods (torch / fa3 signature), the BlockMask,
    and the visible (query, key) pairs per (batch, head). `backward`: q, k, v and torch's copies
    are leaves that require grad."""

    def __init__(self, case: str, head_dim: int, seqlen: int, documents: int | None, device="cuda",
                 backward: bool = False):
        self.case, self.head_dim, self.seqlen, self.documents = case, head_dim, seqlen, documents
        self.batch, self.heads = max(1, TOTAL_TOKENS // seqlen), HIDDEN // head_dim
        self.backward = backward
        torch.manual_seed(0)
        shape = (self.batch, seqlen, self.heads, head_dim)
        self.q, self.k, self.v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=backward)
                                  for _ in range(3))
        self.qt, self.kt, self.vt = (t.transpose(1, 2) for t in (self.q, self.k, self.v))
        self.torch_qkv = tuple(t.detach().contiguous().requires_grad_(backward) for t in (self.qt, self.kt, self.vt))
        self.score_mod = self.mask_mod = self.block_mask = self.doc_ids = self.slopes = None
        from torch.nn.attention.flex_attention import create_block_mask

        if case == "causal":
            self.mask_mod = flex.causal
            self.pairs = seqlen * (seqlen + 1) // 2
        elif case in ("documents", "causal-documents"):
            self.doc_ids, lengths = random_documents(self.batch, seqlen, documents, device)
            causal = case == "causal-documents"
            self.mask_mod = (flex.causal_document if causal else flex.document)(self.doc_ids)
            per_document = [n * (n + 1) // 2 if causal else n * n for n in lengths]
            self.pairs = sum(int(n.sum()) for n in per_document) / self.batch  # mean over the batch
            # every document one entry of a packed batch (attention_varlen's view of the same work)
            every = torch.cat(lengths)
            self.cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), every.cumsum(0)]).to(torch.int32).to(device)
            self.max_length = int(every.max())
        else:
            self.slopes = flex.alibi_slopes(self.heads, device)
            self.score_mod = flex.alibi(self.slopes)
            self.pairs = seqlen * seqlen
        if self.mask_mod is not None:
            per_batch = self.batch if self.doc_ids is not None else None
            # (compiled on the GPU: the dense mask of one sequence of 32k is 1 G booleans)
            self.block_mask = create_block_mask(self.mask_mod, per_batch, None, seqlen, seqlen, device=device,
                                                _compile=device == "cuda")

    @property
    def label(self) -> str:
        return self.case + (f" x{self.documents}" if self.documents else "")

    @property
    def flops(self) -> float:
        return (3.5 if self.backward else 1.0) * 4.0 * self.batch * self.heads * self.head_dim * self.pairs

    def leaves(self, name: str) -> tuple:
        """The tensors column `name` differentiates: torch's copies for torch, else q, k, v."""
        return self.torch_qkv if name.startswith("torch") else (self.q, self.k, self.v)


def random_documents(batch: int, seqlen: int, count: int, device="cuda"):
    """(batch, seqlen) int32 document ids on `device`, `count` documents of random lengths per
    sequence, and each sequence's lengths."""
    g = torch.Generator().manual_seed(1)
    ids, lengths = [], []
    for _ in range(batch):
        cuts = torch.sort(torch.randperm(seqlen - 1, generator=g)[:count - 1] + 1).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seqlen])])
        lengths.append(bounds[1:] - bounds[:-1])
        ids.append(torch.bucketize(torch.arange(seqlen), cuts, right=True))
    return torch.stack(ids).to(torch.int32).to(device), lengths


# ----------------------------------------------------------------------------- the columns
def fa3_columns(p: Problem, kernels=()) -> dict:
    """name -> a call, fa3's: its flex path (and on each rung of `kernels`), and the same work
    through fa3.attention."""
    cols = {"fa3 flex": lambda: fa3.flex_attention(p.qt, p.kt, p.vt, score_mod=p.score_mod,
                                                   block_mask=p.block_mask)}
    for rung in kernels:
        cols[f"fa3 flex {rung}"] = lambda rung=rung: fa3.flex_attention(p.qt, p.kt, p.vt, score_mod=p.score_mod,
                                                                        block_mask=p.block_mask, kernel=rung)
    if p.case == "causal":
        cols["fa3 causal"] = lambda: fa3.attention(p.q, p.k, p.v, causal=True)
    elif p.doc_ids is not None:
        if p.case == "documents":
            cols["fa3 mask_mod"] = lambda: fa3.attention(p.q, p.k, p.v, mask_mod=p.mask_mod)
        cols["fa3 varlen"] = lambda: fa3.attention_varlen(
            *(t.view(-1, *t.shape[2:]) for t in (p.q, p.k, p.v)), p.cu_seqlens, p.cu_seqlens, p.max_length,
            p.max_length, causal=p.case == "causal-documents").view(p.q.shape)
    else:
        cols["fa3 no mod"] = lambda: fa3.attention(p.q, p.k, p.v)
    return cols


_TORCH_FLEX = None


def torch_column(p: Problem):
    global _TORCH_FLEX
    if _TORCH_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _TORCH_FLEX = torch.compile(flex_attention)
    q, k, v = p.torch_qkv
    return lambda: _TORCH_FLEX(q, k, v, score_mod=p.score_mod, block_mask=p.block_mask)


def fa4_column(p: Problem):
    """flash-attn 4's call for the row, with its own mod signatures: mask_mod(b, h, q_idx, kv_idx,
    seqlen_info, aux_tensors) and score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors) on
    TensorSSA values, tables as aux_tensors; the BlockMask's lists as its block_sparse_tensors."""
    import cutlass
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute import utils as fa4_utils
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    kwargs, aux = {}, None
    if p.case == "causal":
        def fa4_causal(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return q_idx >= kv_idx
        kwargs["mask_mod"] = fa4_causal
    elif p.case == "documents":
        def fa4_document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            doc = aux_tensors[0]
            same = doc[b[0], q_idx[0]] == doc[b[0], kv_idx[0]]
            return fa4_utils.scalar_to_ssa(same, cutlass.Boolean)
        kwargs["mask_mod"] = fa4_document
        aux = [p.doc_ids]
    elif p.case == "causal-documents":
        def fa4_causal_document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            doc = aux_tensors[0]
            same = doc[b[0], q_idx[0]] == doc[b[0], kv_idx[0]]
            return fa4_utils.scalar_to_ssa(same & (q_idx[0] >= kv_idx[0]), cutlass.Boolean)
        kwargs["mask_mod"] = fa4_causal_document
        aux = [p.doc_ids]
    else:
        def fa4_alibi(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            slope = fa4_utils.scalar_to_ssa(aux_tensors[0][h[0]], cutlass.Float32)
            return score + slope * (kv_idx - q_idx).to(cutlass.Float32)
        kwargs["score_mod"] = fa4_alibi
        aux = [p.slopes]
    if p.block_mask is not None:
        bm = p.block_mask
        kwargs["block_sparse_tensors"] = BlockSparseTensorsTorch(
            mask_block_cnt=bm.kv_num_blocks, mask_block_idx=bm.kv_indices, full_block_cnt=bm.full_kv_num_blocks,
            full_block_idx=bm.full_kv_indices, block_size=tuple(bm.BLOCK_SIZE))
    if aux is not None:
        kwargs["aux_tensors"] = aux
    return lambda: flash_attn_func(p.q, p.k, p.v, **kwargs)


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


def _output(result):
    return result[0] if isinstance(result, tuple) else result  # (out, lse) where a peer returns both


def training_step(fn, leaves):
    """fn's forward and the gradients of its output (against a fixed random dout) with respect to
    `leaves`; returns the output, as fn does."""
    dout = torch.randn_like(_output(fn()))

    def step():
        out = _output(fn())
        torch.autograd.grad(out, leaves, dout)
        return out
    return step


# ----------------------------------------------------------------------------- the run
def run_row(p: Problem, peers: list[str], args, skipped: dict) -> dict:
    columns = dict(fa3_columns(p, args.kernels))
    if "torch" in peers and "torch" not in skipped:
        columns["torch flex"] = torch_column(p)
    if "fa4" in peers and "fa4" not in skipped:
        try:
            columns["fa4 flex"] = fa4_column(p)
        except Exception as exc:  # not installed, or its interface differs here
            skipped["fa4"] = f"flash_attn.cute is not usable here ({_short(exc)})"
            progress(f"fa4 skipped: {skipped['fa4']}")
    rates, notes, outputs = {}, {}, {}
    for name, fn in columns.items():
        try:
            if p.backward:
                fn = training_step(fn, p.leaves(name))
            outputs[name] = _output(fn()).detach()
            ms = measure(fn, warmup=args.warmup, repeats=args.repeats, max_call_s=args.max_call_s)
            rates[name] = p.flops / (ms * 1e-3) / 1e12
        except TooSlow as exc:
            notes[name] = f"skipped: a call takes {exc.args[0] / 1e3:.1f} s"
        except Exception as exc:
            notes[name] = _short(exc)
    diff = None
    if "fa3 flex" in outputs and "torch flex" in outputs:
        diff = (outputs["fa3 flex"].float() - outputs["torch flex"].float()).abs().max().item()
    return dict(case=p.label, head_dim=p.head_dim, seqlen=p.seqlen, batch=p.batch, heads=p.heads,
                visible=p.pairs / (p.seqlen * p.seqlen), tflops=rates, notes=notes, max_diff=diff)


def problems(args):
    for case in args.cases:
        for d in args.head_dims:
            for s in args.seqlens:
                for documents in (args.documents if case.endswith("documents") else [None]):
                    yield case, d, s, documents


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flex needs a CUDA GPU (a Hopper GPU for fa3); none was found.")
        return 2
    progress(f"{torch.cuda.get_device_name()}; {TOTAL_TOKENS} tokens, hidden {HIDDEN}, bf16; "
             f"{'forward + backward' if args.backward else 'forward'} TFLOP/s "
             f"of the unmasked work (median of CUDA-event times)")
    rows, skipped = [], {}
    for case, d, s, documents in problems(args):
        p = Problem(case, d, s, documents, backward=args.backward)
        row = run_row(p, args.peers, args, skipped)
        rows.append(row)
        rates = "  ".join(f"{n} {r:.1f}" for n, r in row["tflops"].items())
        diff = "" if row["max_diff"] is None else f"  max diff {row['max_diff']:.3g}"
        progress(f"{row['case']} d{d} s{s} (b{p.batch} h{p.heads}, {100 * row['visible']:.1f}% visible): "
                 f"{rates}{diff}")
        for name, note in row["notes"].items():
            progress(f"  {name}: {note}")
        del p
        torch.cuda.empty_cache()
    names = []
    for row in rows:
        names += [n for n in row["tflops"] if n not in names]
    headers = ["case", "d", "seqlen", "visible %", *names, "max diff"]
    table = [[r["case"], r["head_dim"], r["seqlen"], 100 * r["visible"], *(r["tflops"].get(n) for n in names),
              r["max_diff"]] for r in rows]
    print()
    print(format_table(headers, table))
    for peer, reason in skipped.items():
        print(f"{peer}: {reason}")
    if args.json:
        write_json(args.json, {"setting": dict(tokens=TOTAL_TOKENS, hidden=HIDDEN, dtype="bf16"), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

