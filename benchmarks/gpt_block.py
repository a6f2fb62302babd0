"""A small GPT-style block on fa3, run eagerly, under torch.compile and as a CUDA-graph replay.

    python benchmarks/gpt_block.py [--batch 2] [--seqlens 256,1024] [--width 1024] [--heads 8]

Pre-norm block, bf16, inference: x + proj(attention(qkv(ln1(x)))), then x + mlp(ln2(x)), with
every projection a fa3.gemm (weights stored (in, out)) and causal fa3.attention. For each seqlen:

- eager: the block as written;
- compiled: torch.compile(block, fullgraph=True) with the batch and seqlen marked dynamic: one graph
  serves every seqlen (a recompile is an error here);
- graph: the eager block captured in a CUDA graph and replayed on new input (after a first eager
  call compiled the kernels);
- reference: the same block on torch.matmul and SDPA.

Checks: graph replay == eager exactly (the same kernels on the same data), compiled ~ eager and
eager ~ reference within bf16 rounding (inductor fuses the norms and the GELU differently).
Prints milliseconds per block call (CUDA events) for each.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import fa3
except ImportError:  # a source checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fa3

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fa3.timing import median_ms

MAX_REL_ERR = 2e-2


def sdpa_attention(q, k, v, causal):
    """torch's SDPA in fa3's (batch, seqlen, heads, head_dim) layout."""
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    return out.transpose(1, 2)


class GPTBlock(torch.nn.Module):
    def __init__(self, width=1024, heads=8, mlp_ratio=4, device="cuda", dtype=torch.bfloat16):
        super().__init__()
        self.heads = heads
        kw = dict(device=device, dtype=dtype)
        self.ln1 = torch.nn.LayerNorm(width, **kw)
        self.ln2 = torch.nn.LayerNorm(width, **kw)

        def weight(fan_in, fan_out):
            return torch.nn.Parameter(torch.randn(fan_in, fan_out, **kw) * fan_in ** -0.5)

        self.w_qkv = weight(width, 3 * width)
        self.w_proj = weight(width, width)
        self.w_fc = weight(width, mlp_ratio * width)
        self.w_out = weight(mlp_ratio * width, width)

    def forward(self, x, matmul=fa3.gemm, attention=fa3.attention):
        batch, seqlen, width = x.shape
        tokens = batch * seqlen
        qkv = matmul(self.ln1(x).view(tokens, width), self.w_qkv)
        q, k, v = qkv.view(batch, seqlen, 3, self.heads, width // self.heads).unbind(2)
        o = attention(q, k, v, causal=True)
        x = x + matmul(o.reshape(tokens, width), self.w_proj).view(batch, seqlen, width)
        h = F.gelu(matmul(self.ln2(x).view(tokens, width), self.w_fc), approximate="tanh")
        return x + matmul(h, self.w_out).view(batch, seqlen, width)

    def reference(self, x):
        return self.forward(x, matmul=torch.matmul, attention=lambda q, k, v, causal: sdpa_attention(q, k, v, causal))


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def capture(fn, *static_args):
    """(CUDA graph of fn(*static_args), its output), warmed up on a side stream first as torch
    recommends. A replay reads the tensors in static_args and rewrites the output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static_args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static_args)
    return graph, static_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlens", default="256,1024")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    block = GPTBlock(args.width, args.heads).requires_grad_(False)
    compiled = torch.compile(block, fullgraph=True)
    counters.clear()
    failures = 0
    print(f"{torch.cuda.get_device_name()}: GPT block, width {args.width}, {args.heads} heads "
          f"(head_dim {args.width // args.heads}), batch {args.batch}, bf16", flush=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            x = torch.randn(args.batch, seqlen, args.width, device="cuda", dtype=torch.bfloat16)
            eager = block(x)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            from_compiled = compiled(x)
            reference = block.reference(x)
            static_x = x.clone()
            graph, static_out = capture(block, static_x)
            new_x = torch.randn_like(x)
            static_x.copy_(new_x)  # a replay reads its input from the captured tensor
            graph.replay()
            replay_equal = torch.equal(static_out, block(new_x))
            errs = {"compiled vs eager": rel_err(from_compiled, eager),
                    "eager vs reference": rel_err(eager, reference)}
            ok = replay_equal and all(e < MAX_REL_ERR for e in errs.values())
            failures += not ok
            times = {"eager": median_ms(lambda: block(x)), "compiled": median_ms(lambda: compiled(x)),
                     "graph replay": median_ms(graph.replay), "reference": median_ms(lambda: block.reference(x))}
            print(f"  seqlen {seqlen:<5} " + "   ".join(f"{k} {v:.3f} ms" for k, v in times.items()), flush=True)
            print(f"  {'':12}graph replay == eager: {replay_equal}   "
                  + "   ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f"   {'ok' if ok else 'FAILED'}",
                  flush=True)
    graphs = counters["stats"]["unique_graphs"]
    print(f"torch.compile: {graphs} graph(s) for {len(args.seqlens.split(','))} seqlens, fullgraph, "
          "no recompilation", flush=True)
    failures += graphs != 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
