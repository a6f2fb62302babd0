"""The plan of a call against a KV cache, decided from host integers alone (no device read, so
CUDA graphs replay it): how many CTAs share each sequence's keys, the SMEM plan of the KV-cache
kernel (kernels/decode.py) that it depends on (how deep the K/V ring is and how many CTAs share an
SM), and which entries of a packed call run on K5 as prompt chunks, on which tiles (launched by
fa3.cache.prefill). `get_scheduler_metadata` is flash-attn 3's name for computing it ahead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _checks, _dispatch, masking, registry
from .._memo import BoundedMemo
from ..kernels import config

MAX_SPLITS = 64
# MLA's cap: one M1 CTA an SM, so a lone sequence over few KV heads fills the SMs only with more
# splits (the combine's warps share a row past two chunks; worklog/mla.md)
MLA_MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed costs outweigh the keys it reads
# an FP8 cache read by TMA whose CTAs fill the SMs' slots this many times over (at least, below):
# two splits (measured at 1.0, 1.5, 1.9 and 2.9 waves: only about two waves gained; worklog/fp8.md)
FP8_TWO_SPLIT_WAVES = (1.75, 2.5)


def split_count(n) -> int:
    """n as a split count: any integer (numpy's too) as an int, -1 for anything else (a bool, a
    float, None), which split_request refuses."""
    if isinstance(n, bool):
        return -1
    try:
        return operator.index(n)
    except TypeError:
        return -1


def split_request(num_splits, max_splits=0) -> int:
    """A call's split request as one int, as the KV-cache op takes it: n > 0 exactly n CTAs per
    sequence's keys (num_splits), -n at most n (max_splits: flash-attn 3's num_splits, as vLLM
    passes 16 under full CUDA graphs), 0 planned from the shapes."""
    if type(num_splits) is int and type(max_splits) is int and num_splits >= 0 and max_splits >= 0 \
            and not (num_splits and max_splits):  # (plain ints, as nearly every call passes)
        return -max_splits if max_splits else num_splits
    counts = []
    for name, n in (("num_splits", num_splits), ("max_splits", max_splits)):
        count = split_count(n)
        if count < 0:
            raise ValueError(f"{name} must be an int >= 0 (0: planned from the shapes), got {n!r}")
        counts.append(count)
    num_splits, max_splits = counts
    if num_splits and max_splits:
        raise ValueError(f"num_splits={num_splits} (exactly) and max_splits={max_splits} (at most) both given: "
                         "pass one")
    return -max_splits if max_splits else num_splits


def num_splits_for(batch, heads_kv, q_tiles, capacity, sm_count, tile_n=64, ctas_per_sm=1, fp8=False) -> int:
    """Splits of the key range so that batch x heads_kv x q_tiles x splits CTAs fill the SMs'
    CTA slots (ctas_per_sm each: one for the TMA ring, which takes most of the SMEM), each split
    keeping at least MIN_BLOCKS_PER_SPLIT key blocks of the cache's capacity; an FP8 cache read by
    TMA (fp8) whose CTAs fill the slots about twice over (FP8_TWO_SPLIT_WAVES) is split in two.
    From shapes only: no host sync."""
    ctas, slots = batch * heads_kv * q_tiles, sm_count * ctas_per_sm
    blocks = -(-capacity // tile_n)
    if ctas >= 0.8 * slots:
        low, high = FP8_TWO_SPLIT_WAVES
        two = fp8 and low * slots <= ctas < high * slots and blocks >= 2 * MIN_BLOCKS_PER_SPLIT
        return 2 if two else 1
    # round down: one CTA past the slots would run alone in a second wave
    return max(1, min(MAX_SPLITS, slots // ctas, blocks // MIN_BLOCKS_PER_SPLIT))


SM_SMEM_BYTES = 233472  # shared memory of one sm_90 SM (228 KB); each resident CTA also reserves 1 KB


def reads_by_gather(spec, page_size: int) -> bool:
    """Pages that do not hold whole key blocks (tile_n rows) are read by cp.async row gathers
    (kernels/common/paged.py), the others by TMA, one box per block."""
    return page_size % spec.config.base.tile_n != 0


def ctas_per_sm(spec, head_dim: int, gather: bool, fp8: bool = False) -> int:
    """How many s1 CTAs share an SM: a bf16 TMA ring fills one SM's SMEM (1); a row gather's short
    ring, or an FP8 cache's, leaves room for more (2 at d128), so that one CTA's copies or
    conversions, issued by its only warpgroup, overlap another's math (kernels/config.decode_config
    plans the SMEM, which the kernel compiles)."""
    planned = config.decode_config(spec.config, head_dim, gather=gather, fp8=fp8).planned_smem_bytes
    return max(1, SM_SMEM_BYTES // (planned + 1024))


def plan_splits(spec, batch: int, max_seqlen_q: int, heads_q: int, heads_kv: int, keys: int, mask,
                sm_count: int, head_dim: int, gather: bool, fp8: bool = False) -> int:
    """How many CTAs share each sequence's keys (num_splits=0), from host integers only: the
    batch, the longest query run, the heads, the most keys a sequence holds (`keys`: the capacity,
    or max_seqlen_k where the caller knows it), the SM count and how many CTAs an SM holds (head_dim;
    gather: pages that are not a multiple of the key block; fp8: an FP8 cache). A window bounds the
    keys a query sees, whatever the cache holds. This is the whole split plan: a captured graph
    replays it."""
    tiles = spec.config.base
    q_tiles = -(-max(max_seqlen_q, 1) * (heads_q // heads_kv) // tiles.tile_m)
    if mask.local:
        keys = min(keys, mask.left + mask.right + max(max_seqlen_q, 1))
    return num_splits_for(batch, heads_kv, q_tiles, keys, sm_count, tiles.tile_n,
                          ctas_per_sm(spec, head_dim, gather, fp8), fp8 and not gather)


def s1_ctas(spec, batch: int, seqlen_q: int, heads_q: int, heads_kv: int, num_splits: int,
            total_q: int | None = None) -> int:
    """CTAs of s1's grid (kernels/decode.py): splits x KV heads x Q tiles, the packed grid's bound
    when total_q (packed queries) is given."""
    tile_m, group = spec.config.base.tile_m, heads_q // heads_kv
    tiles = batch * -(-max(seqlen_q, 1) * group // tile_m)
    if total_q is not None:
        tiles = max(1, min(tiles, -(-total_q * group // tile_m) + batch))
    return num_splits * heads_kv * tiles


def longest_first(batch: int, ctas: int, slots: int) -> bool:
    """Whether s1 takes the entries longest first (kernels/entry_order.py sorts them on the
    device): when its CTAs need more than one wave of the SMs' slots. Each CTA's time is its
    entry's key count and the GPU starts CTAs in grid order: a short entry launched last fills a
    gap, a long one launched last runs alone while the other SMs idle (worklog/serving.md)."""
    return batch > 1 and ctas > slots


# ----------------------------------------------------------------------------- prompt chunks on K5
PREFILL_RUNG = "k5.5"  # the attention rung whose tiles and schedule a packed call's prompt chunks run on


@dataclass(frozen=True)
class PrefillPlan:
    """K5's static configuration for one call's long entries."""
    min_queries: int  # entries of this many queries or more
    paged: bool
    page_rows: int  # 0: a page holds whole key blocks (or a dense cache); else one box per page


def prefill_config(head_dim: int, causal: bool, local: bool) -> config.ForwardConfig:
    """PREFILL_RUNG's configuration over a KV cache at head_dim (kernels/config.cache_prefill_config:
    a packed batch's tiles), so that the page layout is chosen for the tiles the kernel compiles."""
    return config.cache_prefill_config(registry.get(PREFILL_RUNG).config, head_dim, causal=bool(causal),
                                       local=bool(local))


def prefill_plan(spec, head_dim: int, page_size: int | None, max_seqlen_q: int, causal: bool, local: bool,
                 packed: bool, fp8: bool, offsets: bool) -> PrefillPlan | None:
    """How the call's long entries run on K5, or None: the whole call on S1 (no packed queries, no
    entry that long, an FP8 cache, keys at offsets (a left-padded cache, tokens appended in the
    kernel's call), or pages no TMA box fits). page_size: None for a dense cache."""
    min_queries = spec.config.base.long_queries
    if not (packed and min_queries) or fp8 or offsets or max_seqlen_q < min_queries:
        return None
    tile_n = prefill_config(head_dim, causal, local).tile_n
    page_rows = 0
    if page_size is not None:
        if page_size % tile_n:
            if tile_n % page_size or page_size % 16:
                return None
            page_rows = page_size
    return PrefillPlan(min_queries, page_size is not None, page_rows)


def split_queries(p: PrefillPlan | None, max_seqlen_q: int) -> int:
    """The query run S1's split plan counts per entry: the longest, or 1 when the long entries go to
    K5. Then the entries S1 keeps are planned as decodes: a prompt chunk beside three decodes of 30k
    keys took 1.1 ms with the chunk's length counted (one CTA per decode and KV head, each reading
    30k keys); entries of up to long_queries - 1 queries over-split at worst (more, shorter CTAs)."""
    return max_seqlen_q if p is None else 1


class CallPlan(NamedTuple):
    """What a call against a KV cache decides from host integers alone."""
    mask: masking.Masking
    gather: bool  # pages read by row gathers
    long: PrefillPlan | None  # the entries K5 takes
    s1_queries: int  # S1's longest query run: its grid's bound (K5's entries get no tiles there)
    num_splits: int
    longest_first: bool  # S1 takes the entries in the order the device sorts them


_PLANS = BoundedMemo()


def call_plan(spec, head_dim: int, batch: int, seqlen_q: int, total_q: int | None, heads_q: int, heads_kv: int,
              page_size: int | None, keys: int, causal: bool, window, softcap: float, scale: float, fp8: bool,
              offsets: bool, num_splits: int, sm_count: int) -> CallPlan:
    """The plan of a call against a KV cache: its masking, whether pages are gathered, which entries
    K5 takes (fa3/cache/prefill.py), the splits (num_splits as split_request encodes it: 0
    plan_splits, -n plan_splits capped at n) and whether S1 takes the entries longest first.
    total_q: packed queries' rows (None: (batch, seqlen_q) queries); page_size: None for a dense
    cache; keys: the most a sequence holds; offsets: keys start past position 0 (a left-padded
    cache, tokens appended in the call). Memoized by its arguments: a decode loop's calls repeat
    them, and the plan is tens of microseconds of Python."""
    key = (spec.name, head_dim, batch, seqlen_q, total_q, heads_q, heads_kv, page_size, keys, causal,
           tuple(window), softcap, scale, fp8, offsets, num_splits, sm_count)
    plan = _PLANS.get(key)
    if plan is None:
        mask = masking.masking(causal, tuple(window), softcap, scale)
        gather = page_size is not None and reads_by_gather(spec, page_size)
        long = prefill_plan(spec, head_dim, page_size, seqlen_q, mask.causal, mask.local, total_q is not None,
                                  fp8, offsets)
        s1_queries = seqlen_q if long is None else min(seqlen_q, long.min_queries - 1)
        if num_splits <= 0:  # planned (0), or planned and capped (-cap: split_request)
            planned = plan_splits(spec, batch, split_queries(long, seqlen_q), heads_q, heads_kv,
                                  keys, mask, sm_count, head_dim, gather, fp8)
            num_splits = planned if num_splits == 0 else min(planned, -num_splits)
        ctas = s1_ctas(spec, batch, s1_queries, heads_q, heads_kv, num_splits, total_q)
        sort = longest_first(batch, ctas, sm_count * ctas_per_sm(spec, head_dim, gather, fp8))
        plan = _PLANS.remember(key, CallPlan(mask, gather, long, s1_queries, num_splits, sort))
    return plan


def get_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
                           num_heads_kv: int, headdim: int, cache_seqlens: torch.Tensor,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal: bool = False, window_size=(-1, -1), has_softcap: bool = False,
                           num_splits: int = 0, pack_gqa=None, sm_margin: int = 0) -> torch.Tensor:
    """The split plan of a call against a KV cache, ahead of the call (flash-attn 3's name and
    arguments, as vLLM calls it when it builds a step's metadata).

    fa3's plan is a function of host integers only (plan_splits: batch, longest query run, heads,
    most keys, window, SM count), so there is nothing to precompute on the device: a call with
    these shapes and num_splits=0 derives the same count on the host, in microseconds, with no
    device read, and a captured graph replays it. The plan is returned as an int32 tensor (1,) on
    cache_seqlens' device holding the split count (num_splits if > 0: flash-attn 3's cap, which the
    call itself applies to its own plan, as the flash-attn names pass num_splits on as max_splits),
    for code that keeps the metadata in a buffer and passes it back as attention_varlen(...,
    scheduler_metadata=...), which accepts and checks it. page_size (row gathers below 64) and
    qkv_dtype (float8_e4m3fn: an FP8 cache, whatever q's dtype) enter the plan, and so do
    cu_seqlens_q and cache_leftpad where they send long entries to K5 (fa3/cache/prefill.py: S1
    then plans for the short ones only); headdim_v other than headdim is MLA's (64 / 512: qv, the
    MLA kernel's plan, fa3.mla); cu_seqlens_k_new, max_seqlen_k_new and pack_gqa do not change it
    and are accepted for the signature. sm_margin is accepted too, and the plan counts every SM: the call runs on all of them
    (the flash names refuse sm_margin != 0), and a plan for fewer would not be the call's."""
    if num_heads_kv <= 0 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q={num_heads_q} must be a multiple of num_heads_kv={num_heads_kv}")
    if headdim_v not in (None, headdim):
        return _mla_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                                       headdim_v, cache_seqlens.device, num_splits)
    masking.check_window(window_size, 1.0 if has_softcap else 0.0)
    spec = _dispatch.memo_rung(_dispatch.cache_rung, None, headdim, max_seqlen_q * (num_heads_q // num_heads_kv),
                               page_size is not None, qkv_dtype == torch.float8_e4m3fn)  # the call's rung
    device = cache_seqlens.device
    if num_splits > 0:  # given: nothing to plan (nor an SM count to read)
        return torch.full((1,), num_splits, dtype=torch.int32, device=device)
    sms = _checks.sm_count(device.index if device.index is not None else 0)
    # as the call plans it: a packed call's long entries go to K5 (S1 then plans for the short ones);
    # total_q, unknown here, bounds S1's grid only, not the splits
    num_splits = call_plan(spec, headdim, batch_size, max_seqlen_q, None if cu_seqlens_q is None else max_seqlen_q,
                           num_heads_q, num_heads_kv, page_size, max_seqlen_k, bool(causal), window_size,
                           1.0 if has_softcap else 0.0, 1.0, qkv_dtype == torch.float8_e4m3fn,
                           cache_leftpad is not None, num_splits, sms).num_splits
    return torch.full((1,), num_splits, dtype=torch.int32, device=device)


def plan_mla_splits(spec, batch: int, seqlen_q: int, heads_q: int, heads_kv: int, keys: int, sm_count: int,
                    num_splits: int = 0) -> int:
    """How many CTAs share each sequence's keys in an MLA call (kernels/mla_decode.py), from host
    integers only (a captured graph replays it): num_splits as split_request encodes it (n > 0
    exactly n, 0 planned, -n planned and capped at n). Planned as num_splits_for (one M1 CTA an SM:
    its ring takes the SMEM), except that a split keeps at least a key block per 8 rows of its Q
    tile (and MIN_BLOCKS_PER_SPLIT): a split writes and the combine reads 2 KB of FP32 partials a
    row (512 wide) against 72 KB a key block, so a 64-row tile's split reads 8 blocks (partials of
    about a fifth of its bytes, mostly through L2; a guess between S1's 4 blocks and fewer, wider
    splits, to be measured). `keys`: the capacity, or max_seqlen_k."""
    if num_splits > 0:
        return min(num_splits, MLA_MAX_SPLITS)
    cfg = spec.config.base
    rows = max(seqlen_q, 1) * (heads_q // heads_kv)
    q_tiles = -(-rows // cfg.tile_m)
    ctas = batch * heads_kv * q_tiles
    planned = 1
    if ctas < 0.8 * sm_count:
        min_blocks = max(MIN_BLOCKS_PER_SPLIT, -(-min(rows, cfg.tile_m) // 8))
        planned = max(1, min(MLA_MAX_SPLITS, sm_count // ctas, -(-keys // cfg.tile_n) // min_blocks))
    return planned if num_splits == 0 else min(planned, -num_splits)


def _mla_scheduler_metadata(batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
                            num_heads_kv: int, headdim: int, headdim_v: int, device, num_splits: int) -> torch.Tensor:
    """get_scheduler_metadata for an MLA call (headdim_v: the latent's, qv's and v's; headdim: the
    rotary part's), as fa3.mla plans it."""
    spec = registry.fastest(registry.MLA)
    cfg = spec.config.base
    if (headdim, headdim_v) != (cfg.head_dim, cfg.head_dim_v):
        raise ValueError(f"headdim_v={headdim_v} != headdim={headdim}: fa3 needs the same head_dim for q, k, v, "
                         f"or MLA's headdim={cfg.head_dim} with headdim_v={cfg.head_dim_v} (qv)")
    if num_splits > 0:
        return torch.full((1,), num_splits, dtype=torch.int32, device=device)
    sms = _checks.sm_count(device.index if device.index is not None else 0)
    num_splits = plan_mla_splits(spec, batch_size, max_seqlen_q, num_heads_q, num_heads_kv, max(max_seqlen_k, 1), sms)
    return torch.full((1,), num_splits, dtype=torch.int32, device=device)


def check_scheduler_metadata(metadata, q) -> None:
    """What get_scheduler_metadata returns (or None): an int32 tensor on q's device."""
    if metadata is None:
        return
    if not isinstance(metadata, torch.Tensor) or metadata.dtype != torch.int32 or metadata.numel() < 1 \
            or metadata.device != getattr(q, "device", None):
        raise ValueError(f"scheduler_metadata must be the int32 tensor fa3.get_scheduler_metadata returns, on "
                         f"{q.device}, got {getattr(metadata, 'dtype', type(metadata).__name__)} "
                         f"{tuple(getattr(metadata, 'shape', ()))} (or pass None: fa3 plans from shapes)")
