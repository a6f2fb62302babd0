"""Per batch entry: how many queries and keys there are (one home for sequence lengths).

Fixed-shape calls read them from the tensors' shapes; a KV cache holds `cache_seqlens[b]` valid
keys (plus the tokens appended this call) out of its capacity. The producer, the split-KV range,
masking and the epilogue all ask this one object instead of each computing their own.
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def from_cache(mCacheSeqlens: cute.Tensor, batch: Int32, seqlen_q: Int32, appended: Int32,
               capacity: Int32):
    """Entry `batch` of a KV cache: keys are the cache's first cache_seqlens[batch] rows plus the
    `appended` rows written this call, clamped to [0, capacity] so that no load leaves the cache."""
    seqlen_k = cutlass.max(cutlass.min(mCacheSeqlens[batch] + appended, capacity), 0)
    return SimpleNamespace(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
