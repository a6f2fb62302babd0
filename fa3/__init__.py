"""fa3: FlashAttention-3-style attention and GEMM kernels for NVIDIA Hopper, in the CuTe DSL.

    fa3.attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  return_lse=False, kernel=None, out=None, deterministic=False,
                  backward_kernel=None, sinks=None)   differentiable in q, k, v (and sinks)
    fa3.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                         causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         return_lse=False, kernel=None, deterministic=False,
                         backward_kernel=None, block_table=None, seqused_k=None, out=None,
                         num_splits=0, scheduler_metadata=None, sinks=None, q_descale=None,
                         k_descale=None, v_descale=None)
                                packed variable-length batches (differentiable; FP8 with
                                descales), or packed queries over a (paged) KV cache
                                (block_table/seqused_k)
    fa3.attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=..,
                               block_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                               causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                               num_splits=0, return_lse=False, sinks=None)
                                decode against a (paged) KV cache
    fa3.get_scheduler_metadata(...)     the split plan of a cache call ahead of time
    fa3.attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, ...)
                                            (dq, dk, dv[, dsinks]) for a given forward result
    fa3.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...)
                                            the same for a packed batch
    fa3.context_parallel_attention(q, k, v, group=None, causal=True, softmax_scale=None,
                                   deterministic=False, return_lse=False, cu_seqlens=None,
                                   zigzag=True)
                                            ring attention over a torch.distributed group, each
                                            rank holding a shard (fa3.context_parallel.shard),
                                            optionally of packed documents (cu_seqlens)
    fa3.flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                       enable_gqa=False, return_lse=False)
                                            torch's flex attention ((batch, heads, seqlen, d)) on
                                            the K5 forward, mods compiled in (fa3.flex: the
                                            library; fa3.attention takes score_mod= / mask_mod=);
                                            a BlockMask's empty blocks skipped (d64-d128);
                                            forward only
    fa3.gemm(a, b, out=None, kernel=None)              any 2-D pair a @ b takes; differentiable
    fa3.gemm(a8, b8, scale_a=, scale_b=, out_dtype=)   FP8 e4m3, as torch._scaled_mm (per tensor
                                                        or row-wise scales; forward only)
    fa3.flash_attn_func, fa3.flash_attn_varlen_func, fa3.flash_attn_with_kvcache
                                            flash-attn's names and signatures (fa3.flash_compat)
    fa3.available_kernels(family=None, head_dim=None)   "attention", "attention_fp8", "backward",
                                                        "kvcache" or "gemm"
    fa3.quantize_fp8(x, granularity="tensor"|"head"|"block", hadamard=False) -> (x_fp8, descale)
    fa3.dequantize_fp8(x_fp8, descale), fa3.hadamard_rotate(x, seed=0)   FP8 helpers (fa3.quantize)
    fa3.set_index_checks("deferred"|"strict"|"off"), fa3.check_index_values()
                                            when bad index values (cu_seqlens, cache_seqlens,
                                            block_table) raise (fa3.index_checks)

head_dim 64, 96, 128, 192 or 256 (q, k and v alike; FP8: 64, 128 or 256); sinks: gpt-oss's
attention sinks, one float32 logit per query head (16-bit inputs).
"""

import os as _os

# In a source checkout the kernels live in the top-level kernels/ folder; installed, they are the
# fa3.kernels package. Let the source tree resolve `fa3.kernels` to that folder too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # noqa: F821  (package __path__)

from .interface import attention  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .cache.split_plan import get_scheduler_metadata  # noqa: E402
from .matmul import gemm  # noqa: E402
from .flash_compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from .varlen import attention_varlen  # noqa: E402
from .backward import attention_backward, attention_varlen_backward  # noqa: E402
from .context_parallel import context_parallel_attention  # noqa: E402
from .flex import flex_attention  # noqa: E402
from . import ops  # noqa: E402,F401  (registers torch.ops.fa3.attention and torch.ops.fa3.gemm)
from .registry import available_kernels  # noqa: E402
from .quantize import dequantize_fp8, hadamard_rotate, quantize_fp8  # noqa: E402
from .index_checks import check_index_values, set_index_checks  # noqa: E402

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "get_scheduler_metadata", "gemm", "available_kernels",
           "attention_backward", "attention_varlen_backward", "context_parallel_attention", "flex_attention",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "quantize_fp8",
           "dequantize_fp8", "hadamard_rotate", "set_index_checks", "check_index_values", "__version__"]
