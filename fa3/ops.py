"""fa3's kernels as torch custom ops: `torch.ops.fa3.attention` and `torch.ops.fa3.gemm`.

    torch.ops.fa3.attention(q, k, v, causal, softmax_scale, kernel) -> (out, lse)
    torch.ops.fa3.gemm(a, b, kernel) -> out

Both are functional (they allocate their outputs; nothing is mutated), so torch.compile and
torch.export trace them as single graph nodes, and their fake implementations give output shapes
from symbolic input shapes without touching a GPU or compiling a kernel. `kernel` is a rung name
(fa3.available_kernels()); fa3.attention and fa3.gemm resolve their `kernel=None` before calling.

The public functions validate and, in plain eager calls, run the same implementation without the
dispatcher (interface.direct_call_ok). When the ops do run (compiled graphs, dispatch modes,
autograd, or direct calls to torch.ops.fa3.*) they validate their arguments again on real tensors,
which is also where the GPU and pointer-alignment checks that tracing skips take place.
"""

from __future__ import annotations

import torch

from . import interface

_ATTENTION_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, str kernel)"
                     " -> (Tensor, Tensor)")


@torch.library.custom_op("fa3::attention", mutates_args=(), schema=_ATTENTION_SCHEMA)
def attention(q, k, v, causal, softmax_scale, kernel):
    """(out, lse) of rung `kernel`: out shaped like q (contiguous), lse (batch, heads_q, seqlen_q) fp32."""
    spec = interface._check_attention(q, k, v, kernel)
    return interface.launch_attention(spec, q, k, v, causal, softmax_scale)


@attention.register_fake
def _attention_fake(q, k, v, causal, softmax_scale, kernel):
    batch, seqlen_q, heads_q, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


@torch.library.custom_op("fa3::gemm", mutates_args=(), schema="(Tensor a, Tensor b, str kernel) -> Tensor")
def gemm(a, b, kernel):
    """a @ b with rung `kernel`: a new contiguous (M, N) tensor in a's dtype."""
    spec, a, a_layout, b, b_layout = interface._check_gemm(a, b, None, kernel)
    return interface.launch_gemm(spec, a, a_layout, b, b_layout)


@gemm.register_fake
def _gemm_fake(a, b, kernel):
    return a.new_empty((a.shape[0], b.shape[1]))
