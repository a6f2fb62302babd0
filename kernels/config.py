"""What every kernel is compiled with: one typed configuration per family, chosen by one function per
family from what a call fixes at compile time (head dims, causal, the variants, a cache's layout).

    family                          configuration   chosen by
    forward: K5.1-K5.5              ForwardConfig   forward_config
    forward: the lessons K1-K4      LessonConfig    forward_config (K2-K4 take its fields as arguments)
    FP8 forward: F1, F2             ForwardConfig   fp8_forward_config
    K5 over a KV cache              ForwardConfig   cache_prefill_config (k5.5's table)
    backward: B1, b2-b9             BackwardConfig  backward_config
    KV cache: S1                    DecodeConfig    decode_config (with its SMEM plan)
    MLA decode: M1                  MlaConfig       mla_config (with its SMEM plan)
    GEMM: G1-G4                     GemmConfig      gemm_config

A rung's table is a `RungConfig` (RUNGS, by the registry's row names): its base configuration, the
fields that differ per head dim (tiles and stages that fit SMEM and registers), and, for the
forward, other tiles for short query sequences. The choosing functions read the table, then apply
the rules that depend on the call's variants (a sliding window, a packed batch, FP8, a cache's small
pages) and the register split of the warp-specialized forward. The kernels' constructors take the
chosen configuration; the compile keys hold it (`key`), so two configurations never share a
compiled kernel.

Plain Python, no DSL: the host imports it to size buffers and plan splits without cutlass. Each
choice's reason is a comment here; what was measured to make it is in the worklog (k5.md, fp8.md,
coverage.md, backward.md, serving.md, gemm.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Generic, Mapping, TypeVar


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ForwardConfig:
    """The warp-specialized forward (kernels/common/warp_specialized_forward.py): K5, the FP8
    forward and K5 over a KV cache. One consumer warpgroup per 64 rows of the Q tile."""
    tile_m: int = 128  # Q rows of a tile: 128 (two consumer warpgroups) or 192 (three)
    tile_n: int = 128  # keys of a K/V tile
    kv_stages: int = 2  # depth of the K and V rings
    q_stages: int = 1  # Q buffers
    pingpong: bool = True  # the consumer warpgroups take turns issuing GEMMs (common/pingpong.py)
    intra_wg_overlap: bool = True  # softmax of S_j while P_{j-1} V_{j-1} runs (k5_mainloop.py)
    dynamic_schedule: bool = False  # causal tiles handed out from a GMEM counter (common/scheduler.py)
    rescale_vote: bool = True  # O's rescale skipped when no row's max moved (k5_mainloop.rescale_o)
    # F2 (kernels/k5_fp8_vt.py): the depth of V's TMA ring, which the producer warpgroup's warps 1-3
    # transpose into the kv_stages-deep V^T ring, and the key groups a transposing warp has in
    # flight; 0: no ring of V's own (P V reads what TMA lands)
    value_load_stages: int = 0
    transpose_unroll: int = 1
    # registers a thread (setmaxnreg): the producer warpgroup gives them away, the consumers take
    # them; 128 x (producer + consumer warpgroups x consumer) <= 64K. Chosen, not tabled: REGISTER_SPLITS
    producer_regs: int = 24
    consumer_regs: int = 240

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def transposes_v(self) -> bool:
        """Whether the producer warpgroup transposes V in SMEM (F2)."""
        return self.value_load_stages > 0


@dataclass(frozen=True)
class LessonConfig:
    """The teaching rungs' tiles: K2-K4 take the fields that are set as constructor arguments (a
    lesson reads as `TmaRingAttention(dtype, d, causal, tile_m=64, tile_n=64, kv_stages=2)`); K1
    takes none."""
    tile_m: int | None = None
    tile_n: int | None = None
    kv_stages: int | None = None  # K3, K4: the TMA ring's depth
    pv_on_wgmma: bool | None = None  # K4: P V on WGMMA (K4.2) or on CUDA cores (K4.1)

    def kwargs(self) -> dict:
        """The constructor arguments: the fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class BackwardConfig:
    """The backward (B1: kernels/bwd.py, which reads the tiles and stages; b2-b9: the flags of
    kernels/bwd_ws.py's WarpSpecializedBackward, whose module docstring says what each does)."""
    tile_m: int = 64  # Q rows of a tile
    tile_n: int = 128  # K/V rows of a CTA
    q_stages: int = 2  # the Q (and dO) ring
    do_stages: int = 0  # dO's own ring, one stage (0: on Q's)
    ordered_dq: bool = False  # dQ added in the deterministic order, for speed
    rotated_walk: bool = False  # ordered walks without a mask start at their own Q tiles
    # b2-b9's techniques (bwd_ws.py's docstring says each in full)
    scores_transposed: bool = False  # S^T = K Q^T, dP^T = V dO^T: P^T, dS^T stay in registers (b3 on)
    dq_transposed: bool = False  # dQ^T = K^T dS^T (b6, b7)
    dkv_transposed: bool = False  # dK^T, dV^T: the head dim on the WGMMA's M (b9)
    dq_per_warpgroup: bool = False  # each warpgroup hands its dQ share to the writer alone (b4, b7, b8)
    dq_buffers: int = 2  # ... through this many buffers, returned a tile late
    dq_mbarriers: bool = False  # ... through mbarriers (b9)
    shared_dq_buffer: bool = True  # ... one buffer the warpgroups share in turns (b9 at d256)
    ds_from_rounded_p: bool = False  # dS^T from the rounded P^T (b8)
    ds_in_pairs: bool = False  # ... multiplied in 16-bit pairs (b8)
    dv_under_dp: bool = False  # dV issued under dP^T, else after dS^T
    stats_in_smem: bool = False  # LSE * log2 e and D through SMEM with the Q/dO loads
    prefetch_stats: bool = False  # ... read a tile ahead, else where used
    stat_group: int = 0  # ... or this many columns together ahead of their exp2s (0: each its own)
    head_groups: bool = True  # causal and ordered launches in head groups
    head_group_ctas: int = 0  # ... capped at about this many CTAs a group (bwd_order.py)
    # b2-b9's register split (setmaxnreg): the loader and dQ-writer warpgroup, the two consumers
    producer_regs: int = 24
    consumer_regs: int = 240


@dataclass(frozen=True)
class DecodeConfig:
    """S1 (kernels/decode.py): a KV head's query heads packed into one tile on one warpgroup, the
    keys through a TMA (or cp.async gather) ring. The table holds the limits; decode_config
    chooses the ring's depth and the SMEM the kernel may use from them."""
    tile_m: int = 64  # query rows (seqlen_q x the query heads of a KV head)
    tile_n: int = 64  # keys a block
    max_kv_stages: int = 8  # a TMA ring: as deep as SMEM allows, up to this
    gather_kv_stages: int = 3  # row gathers
    fp8_kv_stages: int = 4  # an FP8 cache
    # S2: each warp multiplies its own 16 keys of every block on mma.sync (m16n8k16, tile_m = 16
    # query rows) and writes its own partial (the combine merges them with the splits')
    warp_split: bool = False
    # packed calls' entries of this many queries or more run on K5 over the cache (fa3/cache/prefill.py)
    long_queries: int = 128
    kv_stages: int = 0  # chosen: the ring's depth
    planned_smem_bytes: int = 0  # chosen: what the SharedStorage may use (the split plan counts on it)
    WARPS: ClassVar[int] = 4  # the CTA's warps: one warpgroup

    @property
    def partials_per_cta(self) -> int:
        """The FP32 partials a CTA writes for its split: one a warp with warp_split (S2), else one."""
        return self.WARPS if self.warp_split else 1


@dataclass(frozen=True)
class MlaConfig:
    """M1 (kernels/mla_decode.py): MLA decode, scores q k^T + qv v^T over a latent cache, two
    warpgroups each holding half of O's columns. mla_config chooses the ring's depth."""
    tile_m: int = 64  # query rows (seqlen_q x the query heads of a KV head)
    tile_n: int = 64  # keys a block: pages of a multiple of 64 rows hold whole blocks (one TMA box)
    head_dim: int = 64  # q's and k's (the rotary part)
    head_dim_v: int = 512  # qv's and v's (the latent)
    max_kv_stages: int = 2
    kv_stages: int = 0  # chosen: the ring's depth
    planned_smem_bytes: int = 0  # chosen: what the SharedStorage may use


@dataclass(frozen=True)
class GemmConfig:
    """G1-G4 (kernels/gemm.py)."""
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 0  # 0: 128 bytes of a row (the 128-byte swizzle): 64 16-bit or 128 FP8 elements
    mma_warpgroups: int = 1  # one per 64 rows of the tile
    stages: int = 1  # the TMA ring (0: as many as fit beside the epilogue buffers)
    mmas_in_flight: int = 0  # K tiles of WGMMA left running while the next is issued
    group_m: int = 16  # G3, G4: output tiles grouped along M (L2 reuse)
    a_rows: int = 0  # M <= 32: TMA loads the top a_rows rows of each A tile (0: tile_m)
    producer_regs: int = 40  # G3, G4: registers a thread, producer warpgroup / MMA warpgroups
    mma_regs: int = 232


C = TypeVar("C")


@dataclass(frozen=True, eq=False)  # compared (and hashed: the choosers' memo) by identity
class RungConfig(Generic[C]):
    """A rung's configurations: `base`, and what differs per head dim."""
    base: C
    # head_dim, or (head_dim, head_dim_v) where V's head dim differs -> {field: value}
    per_head_dim: Mapping = field(default_factory=dict)
    # head_dim -> (rows, causal rows, {field: value}): a call whose longest query sequence has fewer
    # rows than that (non-causal, causal) takes these fields over per_head_dim's (its own compile)
    short_queries: Mapping = field(default_factory=dict)
    # (name, value) pairs an experiment row sets on its kernel class (benchmarks/variants.py): in
    # every compile key, so that a cached kernel of other settings is never reused
    class_attributes: tuple = ()

    def at(self, head_dim: int | None = None, head_dim_v: int | None = None, short: bool = False) -> C:
        """The table's configuration at head_dim (and V's head_dim_v; short: the short-query tiles)."""
        changes = {}
        if head_dim is not None:
            changes.update(self.per_head_dim.get(head_dim, {}))
            if head_dim_v not in (None, head_dim):
                changes.update(self.per_head_dim.get((head_dim, head_dim_v), {}))
            if short and head_dim_v in (None, head_dim) and head_dim in self.short_queries:
                changes.update(self.short_queries[head_dim][2])
        return replace(self.base, **changes) if changes else self.base

    def is_short(self, head_dim: int, head_dim_v: int | None, causal: bool, rows: int | None) -> bool:
        """Whether a call with `rows` query rows in its longest sequence (None: unknown, taken as
        long) takes the `short_queries` tiles."""
        rule = self.short_queries.get(head_dim)
        return (rule is not None and rows is not None and head_dim_v in (None, head_dim)
                and rows < rule[bool(causal)])

    def replaced(self, class_attributes: tuple = (), **values) -> RungConfig:
        """This table with `values` at every head dim (an experiment row's settings)."""
        return RungConfig(replace(self.base, **values),
                          {hd: {**over, **values} for hd, over in self.per_head_dim.items()},
                          self.short_queries, self.class_attributes + tuple(class_attributes))


def key(rung: RungConfig, chosen) -> tuple:
    """A compile key's configuration: the chosen configuration's (field, value) pairs, and the
    table's class attributes (plain values, whose repr the disk cache hashes)."""
    return tuple((f.name, getattr(chosen, f.name)) for f in fields(chosen)) + rung.class_attributes


# ----------------------------------------------------------------------------- forward
# consumer warpgroups -> (producer, consumer) registers a thread: 128 x (p + n c) <= 64K
REGISTER_SPLITS = {2: (24, 240), 3: (32, 160)}
# two consumer warpgroups beside a producer warpgroup with more to hold than one warp's copies (F2's
# transposing warps; a TMA box per small page): the producer's 24 spill
BUSY_PRODUCER_SPLIT = (32, 232)


def _forward(cfg: ForwardConfig, head_dim: int, head_dim_v: int | None, causal: bool, varlen: bool,
             local: bool, fp8: bool = False, busy_producer: bool = False) -> ForwardConfig:
    """The variants' tiles and the register split over a table's configuration."""
    tile_m, tile_n = cfg.tile_m, cfg.tile_n
    if local and tile_m == 192:
        # three 160-register warpgroups have no room for the window's state (it spills at d64): a
        # windowed kernel takes two warpgroups on 128-row tiles
        tile_m = 128
    if causal and head_dim == 96 and tile_m == 192:
        # causal d96: 96-wide K/V tiles, fewer masked columns on the diagonal than 112
        tile_n = min(tile_n, 96)
    if varlen and head_dim == 192 and head_dim_v in (None, 192) and tile_n > 80:
        # a packed batch's offsets and bounds beside 96-wide S tiles at d192 spill: 80-wide K/V tiles
        tile_n = 80
    if fp8 and local and head_dim == 256 and tile_n > 64:
        # the window's state beside 128-wide S tiles at d256 spills: K5's 64-wide tiles
        tile_n = 64
    warpgroups = tile_m // 64
    producer_regs, consumer_regs = BUSY_PRODUCER_SPLIT if busy_producer and warpgroups == 2 \
        else REGISTER_SPLITS[warpgroups]
    return replace(cfg, tile_m=tile_m, tile_n=tile_n, producer_regs=producer_regs,
                   consumer_regs=consumer_regs)


@functools.lru_cache(maxsize=1024)
def forward_config(rung: RungConfig, head_dim: int, head_dim_v: int | None = None, *, causal: bool = False,
                   varlen: bool = False, local: bool = False, short: bool = False):
    """The forward's configuration at head_dim (V's head_dim_v where it differs; short: the rung's
    short-query tiles), for this variant: a lesson's table as it is, K5's with the variants' tiles
    and its register split."""
    cfg = rung.at(head_dim, head_dim_v, short)
    if isinstance(cfg, LessonConfig):
        return cfg
    return _forward(cfg, head_dim, head_dim_v, causal, varlen, local)


# a block-sparse forward's tiles: torch's default BlockMask BLOCK_SIZE, whose blocks are its tiles
BLOCK_MASK_TILE = (128, 128)


def block_mask_backward_fits(cfg: BackwardConfig) -> bool:
    """Whether a backward configuration can walk a BlockMask's blocks (kernels/common/q_walk.py):
    its K/V tile is a block's keys, its Q tiles divide a block's rows (b4, b7: 64 x 128, two Q
    tiles a block), dQ unordered (a sparse walk skips the deterministic order's turns), the
    statistics through SMEM (its consumers read a visit's Q tile once the stage has landed)."""
    return (cfg.tile_n == BLOCK_MASK_TILE[1] and BLOCK_MASK_TILE[0] % cfg.tile_m == 0
            and not cfg.ordered_dq and cfg.stats_in_smem)


@functools.lru_cache(maxsize=256)
def block_mask_short(rung: RungConfig, head_dim: int) -> bool | None:
    """Which of the rung's forward configurations a block-sparse kernel takes at head_dim (its
    tiles BLOCK_MASK_TILE): False, the rung's own; True, its short-query tiles (K5.4 on at d64 and
    d96, whose own rows are 192); None, neither (d192's 96-wide and d256's 64-wide K/V tiles):
    no block-sparse kernel at that head dim."""
    for short in (False, True):
        cfg = forward_config(rung, head_dim, short=short)
        if not isinstance(cfg, LessonConfig) and (cfg.tile_m, cfg.tile_n) == BLOCK_MASK_TILE:
            return short
    return None


@functools.lru_cache(maxsize=256)
def fp8_forward_config(rung: RungConfig, head_dim: int, *, causal: bool = False, varlen: bool = False,
                       local: bool = False) -> ForwardConfig:
    """The FP8 forward's configuration (F1, F2). F2's transposing warps hold their addresses in the
    producer warpgroup: 32 registers where two consumer warpgroups leave room (d <= 128; d256's
    consumers need their 240)."""
    cfg = rung.at(head_dim)
    return _forward(cfg, head_dim, None, causal, varlen, local, fp8=True,
                    busy_producer=cfg.transposes_v and head_dim <= 128)


@functools.lru_cache(maxsize=256)
def cache_prefill_config(rung: RungConfig, head_dim: int, *, causal: bool = False, local: bool = False,
                         page_rows: int = 0) -> ForwardConfig:
    """K5 over a KV cache (kernels/k5_cache.py) on `rung`'s tiles (k5.5's): a packed batch's. With
    a TMA box per page (page_rows), the producer warp's copies take 32 registers."""
    return _forward(rung.at(head_dim), head_dim, None, causal, True, local, busy_producer=page_rows > 0)


def _k5(level: int) -> RungConfig:
    """K5.1-K5.5: one class, the techniques flags (K5.4 changes tiles only)."""
    three = level >= 4  # three consumer warpgroups on 192-row tiles where registers allow
    return RungConfig(
        # one Q buffer: a second was no faster, and slower causal
        ForwardConfig(tile_m=128, tile_n=128, kv_stages=2, q_stages=1, pingpong=level >= 2,
                      intra_wg_overlap=level >= 3, dynamic_schedule=level >= 5),
        per_head_dim={
            # d64 is softmax-bound: a third K/V stage, and three 160-register warpgroups
            64: {"kv_stages": 3, **({"tile_m": 192} if three else {})},
            # d96: three warpgroups on 192 x 112 (192 x 128 spills; FA3 C++ runs 192 x 144 with P
            # through SMEM), 64-byte swizzle (smem.py)
            **({96: {"tile_m": 192, "tile_n": 112}} if three else {}),
            # d128 from K5.3 on: O rescaled on every tile, no warp vote
            **({128: {"rescale_vote": False}} if level >= 3 else {}),
            # d128-d256 need two warpgroups' 240 registers. d192: two stages of 128-wide K/V tiles
            # exceed 227 KB, 96-wide ones fit (FA3 C++ takes 96 for its paged/local d192 too);
            # d256: a 64-wide K/V tile fits and keeps S small beside the 128-register O
            192: {"tile_n": 96},
            256: {"tile_n": 64},
            # DeepSeek's MLA prefill: V's 128-wide rows leave room for 128-wide K/V tiles again
            (192, 128): {"tile_n": 128}},
        # short query sequences on 128-row tiles, where the 192-row ones waste rows: d64 causal
        # under 2k rows, d96 under 2k rows (4k causal) on 128 x 128
        short_queries={64: (0, 2048, {"tile_m": 128}),
                       96: (2048, 4096, {"tile_m": 128, "tile_n": 128})} if three else {})


# FP8: K5.5's configuration; FP8 K/V tiles hold half the bytes, so d256 keeps 128 keys beside its
# 256-wide rows; d64 as K5.4 on (three warpgroups on 192 rows, a third stage)
_FP8 = ForwardConfig(tile_m=128, tile_n=128, kv_stages=2, q_stages=1, pingpong=True, intra_wg_overlap=True,
                     dynamic_schedule=True)
_FP8_D64 = {"kv_stages": 3, "tile_m": 192}


# ----------------------------------------------------------------------------- backward
@functools.lru_cache(maxsize=256)
def backward_config(rung: RungConfig, head_dim: int, head_dim_v: int | None = None) -> BackwardConfig:
    """The backward's configuration at head_dim (V's head_dim_v where it differs)."""
    return rung.at(head_dim, head_dim_v)


# The backward rung of a call with flex attention's mods (fa3.attention(score_mod=, mask_mod=)) where
# the default (registry.fastest) has no registers for the mods' index and table arithmetic: at d64,
# b8's 128 x 128 S^T tiles spill with a table-reading mod beside ALiBi or under GQA (up to 292 B),
# b4's 64-row Q tiles do not (the library's mods, GQA and causal: 0 B). Deterministic calls keep theirs.
FLEX_BACKWARD = {64: "b4"}


def _transposed_scores(tile_m: int = 64, **flags) -> RungConfig:
    """A rung of the S^T line (b3 on): 64-row Q tiles (b8: 128) against 128-row K/V tiles, two Q
    stages, causal head groups capped at about one wave of CTAs (132 SMs)."""
    return RungConfig(BackwardConfig(tile_m=tile_m, tile_n=128, q_stages=2, scores_transposed=True,
                                     head_group_ctas=132, **flags))


# ----------------------------------------------------------------------------- KV cache (S1)
CTA_SMEM_BYTES = 232448  # the most one CTA may use (227 KB; kernels/common/smem.py's SMEM_CAPACITY)


@functools.lru_cache(maxsize=256)
def decode_config(rung: RungConfig, head_dim: int, *, gather: bool = False,
                  fp8: bool = False, warp_pages: bool = False) -> DecodeConfig:
    """S1's configuration and SMEM plan at head_dim (gather: pages read by cp.async row gathers;
    fp8: an FP8 cache). The ring is as deep as SMEM allows beside the Q tile, 1 KB of barriers and
    (fp8) the two 16-bit tiles S1's GEMMs read (S2 counts them too: decode_smem), up to max_kv_stages (memory-bound: bytes in flight
    are what matter); a gather keeps gather_kv_stages, so that two or more CTAs share an SM at
    d <= 128 (one's copies, issued by its only warpgroup, under another's math), an FP8 cache
    fp8_kv_stages (two CTAs an SM up to d128). The kernel refuses a SharedStorage larger than
    planned_smem_bytes: fa3.cache.split_plan counts CTAs an SM by it. warp_pages (S2, an FP8 cache,
    pages of one warp's 16 keys: each warp gathers its own page, kernels/decode.py): the FP8
    cache's depth, not the gather's (half the bytes of a bf16 stage; still two CTAs an SM at d128,
    as the gather's plan counts)."""
    cfg = rung.at(head_dim)
    fixed, kv_bytes, stages = decode_smem(cfg, head_dim, gather and not warp_pages, fp8)
    return replace(cfg, kv_stages=stages, planned_smem_bytes=fixed + stages * kv_bytes)


def decode_smem(cfg: DecodeConfig, head_dim: int, gather: bool, fp8: bool) -> tuple[int, int, int]:
    """(bytes beside the ring, K+V bytes a stage, stages) of S1's SMEM (decode_config's plan)."""
    tile = cfg.tile_n * head_dim
    # S2 (warp_split) converts an FP8 cache in registers and allocates no 16-bit tiles, but its
    # plan counts them as S1's does: the split plan then assumes as many CTAs an SM as S2's
    # registers allow (2 at d128, 4 at d64), where its SMEM alone would admit 3-8
    fixed = cfg.tile_m * head_dim * 2 + 1024 + (2 * tile * 2 if fp8 else 0)
    kv_bytes = 2 * tile * (1 if fp8 else 2)
    stages = min(cfg.max_kv_stages, (CTA_SMEM_BYTES - fixed) // kv_bytes)
    if gather:
        stages = min(stages, cfg.gather_kv_stages)
    if fp8:
        stages = min(stages, cfg.fp8_kv_stages)
    return fixed, kv_bytes, stages


# ----------------------------------------------------------------------------- MLA decode (M1)
@functools.lru_cache(maxsize=64)
def mla_config(rung: RungConfig) -> MlaConfig:
    """M1's configuration and SMEM plan: Q (q and qv) and P beside a ring as deep as the rest of
    one CTA's SMEM allows, up to max_kv_stages (at d64 / d512 and 64-key blocks: two 72 KB stages
    beside 72 KB of Q; one CTA an SM)."""
    cfg = rung.at()
    fixed, kv_bytes, stages = mla_smem(cfg)
    return replace(cfg, kv_stages=stages, planned_smem_bytes=fixed + stages * kv_bytes)


def mla_smem(cfg: MlaConfig) -> tuple[int, int, int]:
    """(bytes beside the ring, K+V bytes a stage, stages) of M1's SMEM: Q and qv, P (tile_m x
    tile_n, 16-bit), each row's rescale factor (FP32) and 1 KB for barriers and alignment."""
    fixed = cfg.tile_m * (cfg.head_dim + cfg.head_dim_v) * 2 + cfg.tile_m * cfg.tile_n * 2 + cfg.tile_m * 4 + 1024
    kv_bytes = cfg.tile_n * (cfg.head_dim + cfg.head_dim_v) * 2
    return fixed, kv_bytes, min(cfg.max_kv_stages, (CTA_SMEM_BYTES - fixed) // kv_bytes)


# ----------------------------------------------------------------------------- GEMM
@functools.lru_cache(maxsize=256)
def gemm_config(rung: RungConfig, tiles: tuple = ()) -> GemmConfig:
    """The GEMM's configuration: the table's, with `tiles` ((field, value), ...: the tile shape
    fa3.matmul picks per problem, the short A box of M <= 32) over it."""
    return replace(rung.at(), **dict(tiles)) if tiles else rung.at()


# ----------------------------------------------------------------------------- the rungs' tables
RUNGS: dict[str, RungConfig] = {
    "k1": RungConfig(LessonConfig()),
    "k2": RungConfig(LessonConfig(tile_m=64, tile_n=64)),
    "k3.1": RungConfig(LessonConfig(tile_m=64, tile_n=64, kv_stages=1)),
    "k3.2": RungConfig(LessonConfig(tile_m=64, tile_n=64, kv_stages=2)),
    # five 64-row stages of K and V at d256 exceed 227 KB: half the K/V tile there
    "k3.3": RungConfig(LessonConfig(tile_m=64, tile_n=64, kv_stages=5), per_head_dim={256: {"tile_n": 32}}),
    "k4.1": RungConfig(LessonConfig(tile_m=64, tile_n=64, kv_stages=2, pv_on_wgmma=False)),
    # d256: O alone takes 128 registers a thread; a 64-wide K/V tile keeps S small
    "k4.2": RungConfig(LessonConfig(tile_m=128, tile_n=128, kv_stages=2, pv_on_wgmma=True),
                       per_head_dim={256: {"tile_n": 64}}),
    **{f"k5.{level}": _k5(level) for level in range(1, 6)},
    "f1": RungConfig(_FP8, per_head_dim={64: _FP8_D64}),
    # F2: V's ring as deep as V^T's, but one stage at d256 (two of each beside 128-key tiles exceed
    # 227 KB); d64's transposing warps have two key groups in flight (registers allow it there)
    "f2": RungConfig(replace(_FP8, value_load_stages=2),
                     per_head_dim={64: {**_FP8_D64, "value_load_stages": 3, "transpose_unroll": 2},
                                   256: {"value_load_stages": 1}}),
    # d192/256: dK and dV alone take 96/128 registers a thread; a 64-row K/V tile halves them
    "b1": RungConfig(BackwardConfig(tile_m=64, tile_n=128, q_stages=2),
                     per_head_dim={192: {"tile_n": 64}, 256: {"tile_n": 64}}),
    # d64: 128-row Q tiles. d192: 64-row K/V tiles as d256 (dK, dV: 96 registers a thread; a
    # multiple of 64 rows: P and dS fill whole swizzle atoms), two Q/dO stages still fit; d256: the
    # FP32 dQ buffer leaves room for one Q/dO stage, and dQ in the deterministic order, faster there,
    # its ordered walks without a mask rotated (64 x 64 tiles take no late counter bump). d96 takes
    # d128's tiles.
    "b2": RungConfig(BackwardConfig(tile_m=64, tile_n=128, q_stages=2),
                     per_head_dim={64: {"tile_m": 128}, 192: {"tile_n": 64},
                                   256: {"tile_n": 64, "q_stages": 1, "ordered_dq": True,
                                         "rotated_walk": True}}),
    "b3": _transposed_scores(dv_under_dp=True),
    # the statistics through SMEM, each column's LSE read where used; dV after dS^T; causal CTAs
    # head after head (head groups were slower here)
    "b4": _transposed_scores(dq_per_warpgroup=True, stats_in_smem=True, head_groups=False),
    # 64-row Q tiles: 80 (FlashAttention-3's and flash-attn-4's non-causal d128 tile) was slower here
    "b6": _transposed_scores(dq_transposed=True),
    # b4's hand-off and SMEM statistics, head groups kept (faster here than b4's order)
    "b7": _transposed_scores(dq_transposed=True, dq_per_warpgroup=True, stats_in_smem=True),
    # one dQ buffer a warpgroup (two do not fit beside 128-row Q/dO stages); dS^T from the rounded
    # P^T in 16-bit pairs (S^T's FP32 registers die before dP^T lands); dV under dP^T; each column's
    # LSE read where used (32 columns a thread held ahead cost more than the wait)
    "b8": _transposed_scores(tile_m=128, dq_per_warpgroup=True, dq_buffers=1, stats_in_smem=True,
                             head_groups=False, ds_from_rounded_p=True, ds_in_pairs=True, dv_under_dp=True),
    # dQ through mbarriers. d256: 64-key tiles (cuDNN's width) fit beside two Q stages once dO has one
    # stage of its own; d192: one dO stage too, and with the SMEM it frees a dQ buffer per warpgroup
    # (no turns)
    "b9": RungConfig(BackwardConfig(tile_m=64, tile_n=96, q_stages=2, dkv_transposed=True,
                                    dq_per_warpgroup=True, dq_mbarriers=True),
                     per_head_dim={192: {"do_stages": 1, "shared_dq_buffer": False},
                                   256: {"tile_n": 64, "do_stages": 1}}),
    # 64-key blocks: pages of a multiple of 64 rows hold whole blocks (one TMA box each), other page
    # sizes are gathered row by row with cp.async; the ring's depth: decode_config
    "s1": RungConfig(DecodeConfig(tile_m=64, tile_n=64, max_kv_stages=8, gather_kv_stages=3, fp8_kv_stages=4,
                                  long_queries=128)),
    "s2": RungConfig(DecodeConfig(tile_m=16, tile_n=64, max_kv_stages=8, gather_kv_stages=3, fp8_kv_stages=4,
                                  long_queries=128, warp_split=True)),
    # MLA decode: 64-key blocks (pages of 64, vLLM's MLA default, are one TMA box each), two stages
    "m1": RungConfig(MlaConfig(tile_m=64, tile_n=64, head_dim=64, head_dim_v=512, max_kv_stages=2)),
    "g1": RungConfig(GemmConfig(tile_m=128, tile_n=128, mma_warpgroups=1, stages=1, mmas_in_flight=0)),
    "g2": RungConfig(GemmConfig(tile_m=128, tile_n=256, mma_warpgroups=2, stages=0, mmas_in_flight=1)),
    "g3": RungConfig(GemmConfig(tile_m=128, tile_n=256, mma_warpgroups=2, stages=0, mmas_in_flight=1,
                                group_m=16)),
    "g4": RungConfig(GemmConfig(tile_m=128, tile_n=256, mma_warpgroups=2, stages=0, mmas_in_flight=1,
                                group_m=16)),
}
