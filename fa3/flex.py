"""fa3.flex_attention: torch's flex attention on fa3's K5 forward, and a library of mods.

    fa3.flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                       enable_gqa=False, return_lse=False)

takes torch.nn.attention.flex_attention's arguments and layout, (batch, heads, seqlen, head_dim),
and runs fa3.attention's K5 forward (which takes (batch, seqlen, heads, head_dim): the transposes
are views, whose strides TMA takes as they are) with the mods compiled in (fa3/mods.py says how a
Python function becomes device code and what it may capture).

block_mask (torch's BlockMask) skips empty blocks: per Q tile the kernel loads and visits only the
blocks its lists name, the partial ones (kv_indices) with the mask_mod applied, the full ones
(full_kv_indices) without it; a Q tile with no block gives O = 0, LSE = -inf
(kernels/common/kv_walk.py). Its blocks are the kernel's tiles, 128 x 128 (torch's default
BLOCK_SIZE): at head_dim 64, 96 and 128 (64 and 96 on the rung's 128-row short-query tiles);
another BLOCK_SIZE is refused there. At head_dim 192 and 256 (K/V tiles of 96 and 64 keys) the
BlockMask is taken as the source of its mask_mod only: applied to every score, no block skipped
(and a BlockMask without a mask_mod of its own, BlockMask.from_kv_blocks' default, is refused there,
since its blocks alone would say what is masked).

The library: each mod is a plain function with torch's signature (or a function that returns one,
for mods with parameters), which runs on torch tensors as well as in the kernel, so that a test can
compare the kernel with a float64 reference (`reference`) built from the very same function, and
torch's flex_attention can take them too:
    score mods: alibi(slopes), softcap(cap), relative_bias(table, max_distance)
    mask mods:  causal, sliding_window(window), document(doc_ids), causal_document(doc_ids),
                prefix_lm(prefix_length)
`causal` here is flex attention's, aligned to the top left (q_idx >= kv_idx), not fa3.attention's
bottom-right `causal=True`. Eager, 16-bit inputs.

Gradients: q, k and v that require grad are differentiated by the backward rungs' flex form (the
mods recomputed, fa3.mods: a score mod carries its derivative, `score_mod_grad`; the library's do;
captured tables get no gradient). With a block_mask the backward skips its empty blocks too: per
K/V block it walks the Q blocks its transposed lists name (q_num_blocks, q_indices, and
full_q_num_blocks, full_q_indices where it has full lists), the partial ones with the mask_mod,
the full ones without (kernels/common/q_walk.py); a K/V block no Q block sees gets dk = dv = 0.
It needs those lists (a BlockMask made with compute_q_blocks=False is refused), adds dq
unordered (deterministic=True is refused with a block_mask), and runs where the forward skips
blocks (head_dim 64/96/128); at d192/d256 both passes apply the mask_mod densely.
"""

from __future__ import annotations

import math

import torch

from . import interface, registry
from .kernels import config


# ----------------------------------------------------------------------------- helpers
# Each takes torch tensors or the kernel's DSL values (traced): what a mod needs beyond operators.

def tanh(x):
    if isinstance(x, torch.Tensor):
        return torch.tanh(x)
    from .compile import dsl

    _, cute = dsl.import_cute()
    return cute.math.tanh(x, fastmath=True)


def clamp(x, lo: int, hi: int):
    """min(max(x, lo), hi) of integer positions."""
    if isinstance(x, torch.Tensor):
        return torch.clamp(x, lo, hi)
    from .compile import dsl

    cutlass, _ = dsl.import_cute()
    return cutlass.min(cutlass.max(x, lo), hi)


def to_float(x):
    """An integer (index arithmetic) as a float score term."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32) if not x.is_floating_point() else x
    from .compile import dsl

    cutlass, _ = dsl.import_cute()
    return x.to(cutlass.Float32)


# ----------------------------------------------------------------------------- mask mods
def causal(b, h, q_idx, kv_idx):
    """Query q_idx sees keys kv_idx <= q_idx (top-left aligned, as torch's flex examples)."""
    return q_idx >= kv_idx


def sliding_window(window: int):
    """Causal, and at most `window` positions back: q_idx - window <= kv_idx <= q_idx."""
    window = int(window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return sliding_window_mask


def document(doc_ids: torch.Tensor):
    """Packed documents: a query sees the keys of its own document. doc_ids (batch, seqlen) int32,
    the document of each position (queries and keys share positions)."""
    def document_mask(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    return document_mask


def causal_document(doc_ids: torch.Tensor):
    """Packed documents trained causally (the pretraining mask): a query sees the keys of its own
    document up to its own position. doc_ids as document's."""
    def causal_document_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
    return causal_document_mask


def prefix_lm(prefix_length):
    """Prefix-LM: every query sees the first `prefix_length` keys (bidirectional prefix), and the
    keys before it causally. prefix_length: an int (compiled in) or a (batch,) int32 tensor."""
    if isinstance(prefix_length, torch.Tensor):
        prefix_lengths = prefix_length

        def prefix_lm_mask_per_batch(b, h, q_idx, kv_idx):
            return (kv_idx < prefix_lengths[b]) | (q_idx >= kv_idx)
        return prefix_lm_mask_per_batch
    prefix = int(prefix_length)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)
    return prefix_lm_mask


# ----------------------------------------------------------------------------- score mods
def alibi(slopes: torch.Tensor):
    """ALiBi: score + slopes[h] * (kv_idx - q_idx); slopes (heads_q,) float32 (alibi_slopes)."""
    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * to_float(kv_idx - q_idx)
    alibi_bias.score_mod_grad = 1.0  # a bias: d/d score = 1 (fa3/mods.py)
    return alibi_bias


def alibi_slopes(heads: int, device=None) -> torch.Tensor:
    """ALiBi's geometric slopes, 2^(-8 (h + 1) / heads) (heads a power of two), float32 on `device`."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32,
                        device=device)


def softcap(cap: float):
    """Gemma 2's capped scores: cap * tanh(score / cap)."""
    cap = float(cap)
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap's cap={cap!r} must be a finite float > 0")

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * tanh(score * (1.0 / cap))

    def softcap_grad(out, b, h, q_idx, kv_idx):  # d/d score of cap * tanh(score / cap), from its output
        t = out * (1.0 / cap)
        return 1.0 - t * t
    softcap_score.score_mod_grad = softcap_grad
    return softcap_score


def relative_bias(table: torch.Tensor, max_distance: int):
    """A learned relative position bias (T5-style, clipped): score + table[h, d + max_distance],
    d = kv_idx - q_idx clamped to [-max_distance, max_distance]; table (heads_q, 2 max_distance + 1)
    float32."""
    max_distance = int(max_distance)
    if table.dim() != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(f"relative_bias: table must be (heads, {2 * max_distance + 1}) for max_distance="
                         f"{max_distance}, got {tuple(table.shape)}")

    def relative_bias_score(score, b, h, q_idx, kv_idx):
        return score + table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance]
    relative_bias_score.score_mod_grad = 1.0  # a bias (the table gets no gradient)
    return relative_bias_score


# ----------------------------------------------------------------------------- the entry point
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel=None, deterministic=False):
    """torch.nn.attention.flex_attention's forward on fa3's K5 kernel (this module's docstring).

    query (batch, heads_q, seqlen_q, head_dim), key/value (batch, heads_kv, seqlen_kv, head_dim),
    bf16 or fp16 on a Hopper GPU; heads_q != heads_kv only with enable_gqa=True (heads_q a multiple).
    score_mod(score, b, h, q_idx, kv_idx): on softmax_scale * q k^T; block_mask: a BlockMask (its
    (batch, heads) 1 or the call's), its empty blocks skipped where the kernel's tiles are its
    blocks (head_dim 64/96/128, BLOCK_SIZE 128; d192/d256: its mask_mod applied everywhere, this
    module's docstring); scale: default 1/sqrt(head_dim). Returns out (batch, heads_q, seqlen_q,
    head_dim_v), and with return_lse the float32 natural-log LSE (batch, heads_q, seqlen_q); rows
    that see no key give 0 and -inf. Differentiable in query, key and value (the module
    docstring); deterministic: as fa3.attention's (the backward's dq in a fixed order), not with a
    block_mask that skips blocks."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key has {key.shape[1]}: pass "
                         f"enable_gqa=True for grouped-query attention")
    mask_mod, block_lists, q_block_lists = None, None, None
    if block_mask is not None:
        mask_mod, block_lists = block_mask_plan(block_mask, query, key, kernel)
        if block_lists is not None and torch.is_grad_enabled() and \
                any(t.requires_grad for t in (query, key, value)):
            q_block_lists = block_mask_q_lists(block_mask, query, key, len(block_lists))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse = interface.attention_with_mods(q, k, v, score_mod, mask_mod, softmax_scale=scale, kernel=kernel,
                                             block_lists=block_lists, q_block_lists=q_block_lists,
                                             deterministic=deterministic)
    out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def block_mask_plan(block_mask, query, key, kernel=None):
    """(mask_mod, block lists) of a call with `block_mask`: its lists as the block-sparse kernel
    takes them (int32 (kv_num_blocks, kv_indices[, full_kv_num_blocks, full_kv_indices]), checked
    against the call's shapes, tiles and device), and its mask_mod (None for a BlockMask without
    one: its partial blocks are then applied as they are); or, where the rung's tiles at this head
    dim are not 128 x 128 (d192, d256), (its mask_mod, None): the dense path."""
    batch, heads, seqlen_q, head_dim = query.shape
    mod = block_mask_mod(block_mask, seqlen_q, key.shape[2], batch, heads)
    spec = registry.KERNELS.get(interface.MODS_RUNG if kernel is None else kernel)
    if spec is None or not spec.takes_mods() or head_dim not in spec.head_dims:
        return _own_mask_mod(mod), None  # (attention_with_mods names what is wrong)
    short = config.block_mask_short(spec.config, head_dim)
    if short is None:
        return _own_mask_mod(mod), None
    cfg = config.forward_config(spec.config, head_dim, short=short)
    tiles = (cfg.tile_m, cfg.tile_n)
    block_size = tuple(block_mask.BLOCK_SIZE)
    if block_size != tiles:
        fix = tiles[0] if tiles[0] == tiles[1] else tiles
        raise ValueError(f"block_mask has BLOCK_SIZE={block_size}, but {spec.name}'s kernel at head_dim={head_dim} "
                         f"runs {tiles[0]} x {tiles[1]} tiles, which its blocks must be: create it with "
                         f"create_block_mask(..., BLOCK_SIZE={fix})")
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    lists = [getattr(block_mask, name, None) for name in names]
    if lists[2] is None or lists[3] is None:
        lists = lists[:2]
    _check_lists_device_and_dtype(names, lists, query)
    for counts, indices in zip(lists[::2], lists[1::2]):
        if indices.dim() != 4 or tuple(indices.shape[:3]) != tuple(counts.shape):
            raise ValueError(f"block_mask's block counts {tuple(counts.shape)} and indices {tuple(indices.shape)} "
                             f"do not match (counts (B, H, q_blocks), indices (B, H, q_blocks, kv_blocks))")
    return (None if _is_noop(mod) else mod), tuple(t.contiguous() for t in lists)


def block_mask_q_lists(block_mask, query, key, count: int):
    """The transposed lists the block-sparse backward walks (kernels/common/q_walk.py): int32
    (q_num_blocks, q_indices[, full_q_num_blocks, full_q_indices]), `count` of them (the forward's
    block_mask_plan took as many), checked against the call's shapes and device: counts (B|1,
    H|1, kv_blocks), indices (B|1, H|1, kv_blocks, q_blocks), B and H the forward lists'."""
    names = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")[:count]
    lists = [getattr(block_mask, name, None) for name in names]
    missing = [name for name, t in zip(names, lists) if t is None]
    if missing:
        raise ValueError(f"block_mask has no {' / '.join(missing)} (made with compute_q_blocks=False?): with "
                         f"gradients the backward walks these transposed lists (the Q blocks of each K/V block); "
                         f"create it with create_block_mask(...) or BlockMask.from_kv_blocks(..., "
                         f"compute_q_blocks=True)")
    block_q, block_kv = block_mask.BLOCK_SIZE
    mask_b, mask_h, q_blocks = block_mask.kv_num_blocks.shape
    kv_blocks = -(-key.shape[2] // block_kv)
    _check_lists_device_and_dtype(names, lists, query)
    for counts, indices in zip(lists[::2], lists[1::2]):
        if tuple(counts.shape) != (mask_b, mask_h, kv_blocks) or \
                tuple(indices.shape) != (mask_b, mask_h, kv_blocks, q_blocks):
            raise ValueError(f"block_mask's transposed lists (q_num_blocks {tuple(counts.shape)}, q_indices "
                             f"{tuple(indices.shape)}) do not fit the call: the backward needs counts "
                             f"{(mask_b, mask_h, kv_blocks)} and indices {(mask_b, mask_h, kv_blocks, q_blocks)} "
                             f"({kv_blocks} K/V blocks of {block_kv} keys, {q_blocks} Q blocks)")
    return tuple(t.contiguous() for t in lists)


def _check_lists_device_and_dtype(names, lists, query):
    """A BlockMask's lists `names` on query's device, in int32 (what the kernels read)."""
    for name, t in zip(names, lists):
        if t.device != query.device:
            raise ValueError(f"block_mask's {name} is on {t.device}, but query is on {query.device}: "
                             f"create it with device={str(query.device)!r} or move it (block_mask.to(device))")
        if t.dtype != torch.int32:
            raise ValueError(f"block_mask's {name} is {t.dtype}; the kernel reads int32 block lists")


def _is_noop(mod) -> bool:
    return mod is None or getattr(mod, "__name__", "") == "noop_mask"


def _own_mask_mod(mod):
    """The mask_mod of a BlockMask applied densely: refused where it has none of its own."""
    if _is_noop(mod):
        raise ValueError("block_mask has no mask_mod of its own (BlockMask.from_kv_blocks' default): at this head dim "
                         "fa3 applies a block mask through its mask_mod, and does not read its block lists alone; "
                         "build it with create_block_mask(mask_mod, ...)")
    return mod


def block_mask_mod(block_mask, seqlen_q: int, seqlen_kv: int, batch: int, heads: int):
    """The mask_mod a BlockMask stands for (None or torch's noop_mask where it has none), checked
    against the call's shapes."""
    if not all(hasattr(block_mask, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "mask_mod")):
        raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    lengths = tuple(getattr(block_mask, "seq_lengths", ()))
    if lengths and lengths != (seqlen_q, seqlen_kv):
        raise ValueError(f"block_mask was made for (seqlen_q, seqlen_kv) = {lengths}, but query and key have "
                         f"({seqlen_q}, {seqlen_kv}): create it with Q_LEN={seqlen_q}, KV_LEN={seqlen_kv}")
    mask_b, mask_h, q_blocks = block_mask.kv_num_blocks.shape
    block_q, block_kv = block_mask.BLOCK_SIZE
    if mask_b not in (1, batch) or mask_h not in (1, heads):
        raise ValueError(f"block_mask has (batch, heads) = ({mask_b}, {mask_h}); the call has ({batch}, {heads}) "
                         f"(1 broadcasts)")
    if q_blocks != -(-seqlen_q // block_q):
        raise ValueError(f"block_mask has {q_blocks} query blocks of {block_q} rows; seqlen_q={seqlen_q} needs "
                         f"{-(-seqlen_q // block_q)}")
    return block_mask.mask_mod


def reference(query, key, value, score_mod=None, mask_mod=None, scale=None, dtype=torch.float64):
    """(out, lse) of flex attention in `dtype` (float64: the exact values; the inputs' dtype: what
    rounding alone costs) over materialized scores, the mods applied to broadcast index tensors on
    query's device: what the GPU tests compare fa3 with, differentiable (torch.autograd) in query,
    key and value. Layout and GQA as flex_attention; rows that see no key give 0 and -inf."""
    batch, heads, seqlen_q, d = query.shape
    seqlen_kv = key.shape[2]
    group = heads // key.shape[1]
    k = key.to(dtype).repeat_interleave(group, dim=1)
    v = value.to(dtype).repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", query.to(dtype), k) * scale
    dev = query.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    q_idx = torch.arange(seqlen_q, device=dev).view(1, 1, -1, 1)
    kv_idx = torch.arange(seqlen_kv, device=dev).view(1, 1, 1, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx).to(dtype).expand_as(scores)
    if mask_mod is not None:
        keep = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx), device=dev).expand_as(scores)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).where(torch.isfinite(lse.unsqueeze(-1)), 0.0))
    probs = probs.masked_fill(~torch.isfinite(lse).unsqueeze(-1), 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v), lse
