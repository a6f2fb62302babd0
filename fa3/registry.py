"""The ladder of kernels: one table, read by the API, the CLI, the tests, the benchmarks and the docs.

Each row names a rung, the class that implements it, its configurations (a table of
kernels/config.py, where each family's choosing function and every tile, stage and flag is), and
the PTX instructions it promises to emit: the CPU tests compile every row for sm_90a and check
those strings.

Substages are configurations, not copies: `k3.1`/`k3.2`/`k3.3` are one class with `kv_stages` 1/2/5.
Adding a rung is adding a row (and its configuration).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from .kernels.config import RUNGS, LessonConfig, RungConfig

ATTENTION = "attention"
ATTENTION_FP8 = "attention_fp8"  # the forward on float8_e4m3fn q, k, v (with descales)
GEMM = "gemm"
BACKWARD = "backward"  # attention's gradients
KVCACHE = "kvcache"  # attention against a (paged) KV cache: decode
MLA = "mla"  # multi-head latent attention against a latent KV cache (flash-attn 3's qv): decode
FAMILIES = (ATTENTION, ATTENTION_FP8, BACKWARD, KVCACHE, MLA, GEMM)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    family: str  # ATTENTION, ATTENTION_FP8, BACKWARD, KVCACHE or GEMM
    module: str  # relative to fa3.kernels
    cls: str
    summary: str
    # its configurations (kernels/config.py: the table its family's choosing function reads)
    config: RungConfig = field(default_factory=lambda: RungConfig(LessonConfig()))
    head_dims: tuple = (64, 128, 256)  # the scalar rungs; the WGMMA rungs that serve calls: HEAD_DIMS
    # (head_dim, head_dim_v) pairs with V's head dim different from Q's and K's
    value_head_dims: tuple = ()
    ptx_promises: tuple = ()  # substrings the sm_90a PTX must contain
    ptx_forbids: tuple = ()  # substrings it must not contain
    # Higher is faster; `kernel=None` picks the fastest rung that supports the call.
    speed_rank: int = 0
    # The head dims where kernel=None may pick this rung (None: all of head_dims); at the others a
    # lower rung measured faster.
    default_head_dims: tuple | None = None
    # Of those, the ones where kernel=None may pick it for deterministic=True (None: all); at the
    # others its ordered dQ adds are slower than a lower rung's.
    deterministic_head_dims: tuple | None = None
    # ... and there only for calls with a causal mask or a window (masking.masked): without one a
    # lower rung's ordered walk measured faster
    deterministic_masked_only: bool = False
    # Workspace for materialised scores (K1 only): the interface allocates it.
    needs_scores_workspace: bool = False
    # A persistent grid (one CTA per SM): the kernel takes the SM count as its last argument.
    persistent: bool = False
    # Static variants the class compiles on demand (of VARIANTS, "sinks"); a rung with any takes
    # their runtime arguments (cu_seqlens, window edges, softcap scale; an attention rung also the
    # sinks) after the persistent ones.
    variants: tuple = ()

    def load_class(self):
        return getattr(importlib.import_module(f"fa3.kernels.{self.module}"), self.cls)

    def takes_mods(self) -> bool:
        """Whether flex attention's mods and block masks run on this rung: K5's class (k5.1-k5.5),
        or an experiment's subclass of it (benchmarks/variants.py)."""
        if self.module == "k5":
            return True
        if self.family != ATTENTION:
            return False
        from .kernels.k5 import WarpSpecializedAttention

        return issubclass(self.load_class(), WarpSpecializedAttention)


# every head dim the default rungs serve (forward, backward, KV cache), each on tiles of its own
HEAD_DIMS = (64, 96, 128, 192, 256)
# (q/k head dim, v head dim) pairs the forward takes besides equal ones: DeepSeek-style MLA prefill
# (192, 128), and (128, 64)
VALUE_HEAD_DIMS = ((192, 128), (128, 64))
VARIANTS = ("varlen", "local", "softcap")  # packed batches, sliding window, capped scores
# forward rungs also fold attention sinks (one logit per query head in each row's denominator)
# into their softmax; the backward needs no variant for them (the LSE includes the sink)
SINKS = "sinks"
_SCALAR_PTX = ("ld.global", "ex2.approx")
# the warp-specialized backward rungs (b2 on): dQ never by scalar atomics; on fixed-length batches
# each warpgroup's FP32 share in fragment order (16-byte SMEM stores) and one 1-D bulk reduce-add
# (packed batches too, test_compile's variant rows)
_BWD_WS_PTX = ("wgmma.mma_async", "setmaxnreg", "stmatrix", "st.shared.v4.b32",
               "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")
_BWD_WS_FORBIDS = ("red.global", "red.relaxed")
_BWD_SWAPPED_PTX = _BWD_WS_PTX + ("shfl.sync.idx",)  # S^T: each column's statistics by shuffles
# a K tile's WGMMAs left running while the next is issued (the PTX spells it with a tab)
_MMA_IN_FLIGHT = "wgmma.wait_group.sync.aligned \t1;"


FP8_PTX = ("wgmma.mma_async", ".e4m3.e4m3", "cvt.rn.satfinite.e4m3x2.f32", "setmaxnreg",
           "cp.async.bulk.tensor", "bar.arrive")
# no operand is read from SMEM into registers, and nothing is rounded to 16 bits but O
FP8_FORBIDS = ("cvt.f32.bf16", "ld.shared.u8", "ld.shared.b8", "ld.shared.u16", "ld.shared.b16")


# the production backward: one kernel class, each rung a configuration of its flags (b1, the
# lesson, is a class of its own)
_BWD_MODULE, _BWD_CLASS = "bwd_ws", "WarpSpecializedBackward"


def _swapped_backward(name: str, summary: str, *, head_dims: tuple, speed_rank: int,
                      value_head_dims: tuple = (), deterministic_head_dims: tuple = ()) -> KernelSpec:
    """A rung of the S^T backward line (b3 on, `scores_transposed`; kernels/config.py): dQ by bulk
    reduce-adds, each column's statistics by shuffles (or from SMEM). Deterministic calls without a
    mask go to b2 (`deterministic_masked_only`), which is level or ahead there; with one, b4 at d96
    and b7 at d128, whose writer passes counters on a step late (worklog/backward.md)."""
    return KernelSpec(name, BACKWARD, _BWD_MODULE, _BWD_CLASS, summary, config=RUNGS[name],
                      deterministic_head_dims=deterministic_head_dims, deterministic_masked_only=True,
                      head_dims=head_dims, value_head_dims=value_head_dims,
                      ptx_promises=_BWD_SWAPPED_PTX, ptx_forbids=_BWD_WS_FORBIDS,
                      speed_rank=speed_rank, variants=VARIANTS)


KERNELS: dict[str, KernelSpec] = {
    s.name: s
    for s in [
        KernelSpec(
            "k1", ATTENTION, "k1", "NaiveAttention",
            "naive: S = QK^T in global memory, row softmax, O = PV (FP32 CUDA cores)",
            config=RUNGS["k1"],
            ptx_promises=("ld.global", "ex2.approx", "fma.rn.f32"),
            ptx_forbids=("wgmma", "cp.async.bulk.tensor"),
            speed_rank=1, needs_scores_workspace=True,
        ),
        KernelSpec(
            "k2", ATTENTION, "k2", "FusedTiledAttention",
            "fused FA2-style: Q tile in SMEM, K/V tiles through one SMEM buffer, online softmax",
            config=RUNGS["k2"],
            ptx_promises=_SCALAR_PTX + ("bar.sync", "shfl.sync.bfly"),
            ptx_forbids=("wgmma", "cp.async.bulk.tensor"),
            speed_rank=2,
        ),
        *[
            KernelSpec(
                f"k3.{i}", ATTENTION, "k3", "TmaRingAttention",
                f"K2's math fed by TMA through a {stages}-stage K/V ring (Q loaded once)",
                config=RUNGS[f"k3.{i}"],
                ptx_promises=("cp.async.bulk.tensor", "mbarrier.try_wait", "ex2.approx"),
                ptx_forbids=("wgmma",),
                speed_rank=2 + i,
            )
            for i, stages in ((1, 1), (2, 2), (3, 5))
        ],
        KernelSpec(
            "k4.1", ATTENTION, "k4", "WgmmaAttention",
            "K3 with S = QK^T on WGMMA from swizzled SMEM; softmax and PV still scalar",
            config=RUNGS["k4.1"],
            ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait"),
            speed_rank=6,
        ),
        KernelSpec(
            "k4.2", ATTENTION, "k4", "WgmmaAttention",
            "both GEMMs on WGMMA, softmax on the accumulator in registers, P as register A operand",
            config=RUNGS["k4.2"],
            ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "shfl.sync.bfly", "ex2.approx"),
            # no scalar GEMM left: nothing reads 16-bit operands from SMEM into FP32 registers
            ptx_forbids=("cvt.f32.bf16", "ld.shared"),
            speed_rank=7,
        ),
        *[
            KernelSpec(
                f"k5.{i}", ATTENTION, "k5", "WarpSpecializedAttention", summary, config=RUNGS[f"k5.{i}"],
                head_dims=HEAD_DIMS, value_head_dims=VALUE_HEAD_DIMS,
                ptx_promises=("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor", "bar.arrive"
                              if RUNGS[f"k5.{i}"].base.pingpong else "mbarrier.try_wait"),
                # no 16-bit operand is read from SMEM into registers; k5.5's consumers read the
                # next tile's index from SMEM (ld.shared.b32), so only 16-bit loads are forbidden there
                ptx_forbids=("cvt.f32.bf16", "ld.shared.u16", "ld.shared.b16", "ld.shared.v2.u16")
                if RUNGS[f"k5.{i}"].base.dynamic_schedule else ("cvt.f32.bf16", "ld.shared"),
                speed_rank=7 + i, persistent=True, variants=VARIANTS + (SINKS,),
            )
            for i, summary in (
                (1, "warp specialization: TMA producer warp, two consumer warpgroups, setmaxnreg"),
                (2, "+ ping-pong: the two consumer warpgroups take turns issuing GEMMs"),
                (3, "+ intra-warpgroup overlap: softmax of S_j while P_{j-1} V_{j-1} runs"),
                (4, "+ three consumer warpgroups taking turns on 192-row Q tiles where registers "
                    "allow (d64)"),
                (5, "+ causal tiles handed out longest-first from a GMEM counter (dynamic persistent "
                    "schedule)"),
            )
        ],
        KernelSpec(
            "f1", ATTENTION_FP8, "k5_fp8", "Fp8Attention",
            "k5.5 on FP8 e4m3 q/k/v: e4m3 WGMMA (k32) for both GEMMs, V^T from a transpose kernel, P rounded "
            "to e4m3 in registers in the A operand's order, descales folded into the scales",
            config=RUNGS["f1"], ptx_promises=FP8_PTX, ptx_forbids=FP8_FORBIDS,
            # the default at d128 and d256, where it led f2 (worklog/fp8.md); at d64 f2 serves, with no
            # V^T kernel nor its V-sized buffer
            default_head_dims=(128, 256),
            speed_rank=1, persistent=True, variants=VARIANTS,
        ),
        KernelSpec(
            "f2", ATTENTION_FP8, "k5_fp8_vt", "Fp8TransposingAttention",
            "f1 with V's rows loaded by TMA and transposed in SMEM by the producer warp (ldmatrix.trans, "
            "prmt, stmatrix) into a V^T ring for P V: no transpose kernel before the call",
            config=RUNGS["f2"],
            ptx_promises=FP8_PTX + ("ldmatrix.sync.aligned.m8n8.x4.trans", "stmatrix.sync.aligned.m8n8.x4"),
            ptx_forbids=FP8_FORBIDS, speed_rank=0, persistent=True, variants=VARIANTS,
        ),
        KernelSpec(
            "b1", BACKWARD, "bwd", "AttentionBackward",
            "backward: five WGMMAs per Q tile against one K/V tile, P and dS through SMEM, "
            "dQ by FP32 atomics, each GEMM waited for",
            config=RUNGS["b1"], head_dims=HEAD_DIMS,
            ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "global.add.f32", "stmatrix"),
            ptx_forbids=("setmaxnreg",),
            speed_rank=1, variants=VARIANTS,
        ),
        KernelSpec(
            "b2", BACKWARD, _BWD_MODULE, _BWD_CLASS,
            "+ warp specialization (loader warp, dQ-writer warp, two consumer warpgroups, "
            "setmaxnreg), S/dP and dQ/dV/dK in flight together, dQ by one bulk reduce-add per tile",
            config=RUNGS["b2"],
            # v's head dim on dO, V, dV and dV's MMA; Q, K, dQ and dK keep q's (d128's and d192's
            # tiles: the narrower V and dO only free SMEM and registers)
            head_dims=HEAD_DIMS, value_head_dims=VALUE_HEAD_DIMS,
            ptx_promises=_BWD_WS_PTX, ptx_forbids=_BWD_WS_FORBIDS,
            speed_rank=2, variants=VARIANTS,
        ),
        # d=64: 128-row Q tiles spill here (two 64 x 128 accumulators a thread; b8 makes them fit)
        # and 64-row ones lose to b2's 128-row tiles; d=192/256: dK and dV leave no registers. b2
        # serves them. d=96 as flash-attn-4 runs it (64 x 128, S^T): no spills.
        _swapped_backward(
            "b3",
            "+ S^T = K Q^T: P^T and dS^T stay in registers as the A operands of dV and dK, dS "
            "written once (for dQ) into one of two buffers, one consumer barrier per Q tile",
            head_dims=(96, 128), speed_rank=3),
        _swapped_backward(
            "b4",
            "+ the dQ share handed to the writer per warpgroup (each half its own reduce-add "
            "and barriers) through two buffers returned a tile late, in fragment order",
            # b3's head dims, and d64 for flex attention's backward (kernels/config.FLEX_BACKWARD)
            head_dims=(64, 96, 128), speed_rank=4, deterministic_head_dims=(96,)),
        _swapped_backward(
            "b6",
            "b3 + dQ computed transposed (dQ^T = K^T dS^T: the Q tile is no WGMMA's M), dV issued "
            "after dS^T",
            head_dims=(128,), speed_rank=5),
        _swapped_backward(
            "b7",
            "b6 + b4's dQ hand-off: each warpgroup's transposed dQ share through its own two "
            "buffers, met by the writer alone",
            # b6's head dims: dQ^T stacks d over the warpgroups in 64-row WGMMA atoms; v's head
            # dim 64 on dO, V and dV^T's MMA (P^T and dS^T stay 64 x 128 register fragments)
            head_dims=(128,), value_head_dims=((128, 64),), speed_rank=6, deterministic_head_dims=(128,)),
        _swapped_backward(
            "b8",
            "b4 on 128 x 128 S^T tiles at d64: dS^T from the rounded P^T (S^T's FP32 registers "
            "die before dP^T lands) multiplied in 16-bit pairs, one dQ buffer a warpgroup",
            # faster than b2 at d64, with dQ and dK errors above b2's (worklog/backward.md)
            head_dims=(64,), speed_rank=7),
        KernelSpec(
            "b9", BACKWARD, _BWD_MODULE, _BWD_CLASS,
            "b2 + dK and dV computed transposed (head dim on the WGMMA's M), one dO stage beside two "
            "Q stages: 96-key tiles and a dQ buffer per warpgroup at d192, 64-key tiles and one dQ "
            "buffer the warpgroups share in turns at d256",
            config=RUNGS["b9"],
            head_dims=(192, 256), value_head_dims=((192, 128),),
            # d256 too, ahead of cuDNN and flash-attn-4 there. Deterministic d256 stays on b2: b9's
            # ordered walk on the 64-key tiles was not faster (its ordered adds come in two halves,
            # one a warpgroup; worklog/backward.md)
            default_head_dims=(192, 256), deterministic_head_dims=(192,),
            ptx_promises=_BWD_WS_PTX + ("stmatrix.sync.aligned.m8n8.x4.trans",), ptx_forbids=_BWD_WS_FORBIDS,
            speed_rank=8, variants=VARIANTS,
        ),
        KernelSpec(
            "s1", KVCACHE, "decode", "SplitKVAttention",
            "KV-cache attention (dense or paged): query heads of a KV head packed into one 64-row "
            "tile, the key range split across CTAs, FP32 partials merged by a combine kernel",
            # Queries may be packed by cu_seqlens_q (varlen). Packed calls whose longest entry has
            # long_queries or more queries (a serving step's prompt chunks) run those entries on K5.5
            # in the same call (fa3/cache/prefill.py).
            config=RUNGS["s1"], head_dims=HEAD_DIMS,
            ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "ex2.approx"),
            speed_rank=1, variants=("local", "softcap", "varlen", SINKS),
        ),
        KernelSpec(
            "s2", KVCACHE, "decode", "SplitKVAttention",
            "s1 with the keys split across the warps: each warp multiplies its 16 keys of every block "
            "on mma.sync (16 query rows, not WGMMA's 64) and writes its own partial for the combine",
            config=RUNGS["s2"], head_dims=(64, 128),
            # kernel=None picks it by the call's shape (_dispatch.cache_rung), never by rank
            ptx_promises=("mma.sync.aligned.m16n8k16", "ldmatrix", "mbarrier.try_wait", "ex2.approx"),
            speed_rank=0, variants=("local", "softcap", "varlen", SINKS),
        ),
        KernelSpec(
            "m1", MLA, "mla_decode", "MlaDecode",
            "MLA decode (qv): scores q k^T + qv v^T over a latent cache, the query heads packed into "
            "64-row tiles, two warpgroups each holding half of O's 512 columns, P shared through SMEM, "
            "split-KV merged by the combine",
            # q/k the rotary part (64), qv/v the latent (512): DeepSeek-V2/V3's absorbed MLA
            config=RUNGS["m1"], head_dims=(64,), value_head_dims=((64, 512),),
            ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "ex2.approx",
                          "stmatrix", "mbarrier.arrive.shared", "cp.async.cg.shared.global"),
            # P's hand-off between the warpgroups is on mbarriers (racecheck follows those), not
            # named barriers' bar.arrive
            ptx_forbids=("bar.arrive",),
            speed_rank=1,
        ),
        *[
            KernelSpec(
                name, GEMM, "gemm", cls, summary, config=RUNGS[name], head_dims=(),
                ptx_promises=("wgmma.mma_async", "cp.async.bulk.tensor", "stmatrix") + promises,
                ptx_forbids=forbids, speed_rank=rank,
            )
            for name, cls, summary, promises, forbids, rank in (
                ("g1", "StagedGemm",
                 "TMA into one SMEM stage, one warpgroup, WGMMA from swizzled SMEM, wait every K tile",
                 (), (_MMA_IN_FLIGHT, "setmaxnreg"), 1),
                ("g2", "StagedGemm",
                 "multi-stage TMA ring (depth from the SMEM budget), one K tile of WGMMA in flight",
                 (_MMA_IN_FLIGHT,), ("setmaxnreg",), 2),
                ("g3", "PersistentGemm",
                 "warp-specialized (TMA producer warpgroup, 2 MMA warpgroups, setmaxnreg), persistent "
                 "grouped-raster tiles, TMA-store epilogue",
                 (_MMA_IN_FLIGHT, "setmaxnreg"), (), 3),
                ("g4", "ClusterGemm",
                 "+ 2-CTA clusters along M: each B tile loaded once per cluster and multicast into "
                 "both CTAs' SMEM",
                 (_MMA_IN_FLIGHT, "setmaxnreg", "multicast::cluster"), (), 2),
            )
        ],
    ]
}


def get(name: str) -> KernelSpec:
    try:
        return KERNELS[name]
    except KeyError:
        known = ", ".join(repr(n) for n in KERNELS)
        raise ValueError(f"kernel={name!r} is not a known kernel; choose one of {known} "
                         "(fa3.available_kernels() lists them)") from None


def available_kernels(family: str | None = None, head_dim: int | None = None) -> list[str]:
    """Names of every rung, slowest first (`family`: "attention", "attention_fp8", "backward",
    "kvcache" or "gemm" to filter; any other family is refused; `head_dim`: only the rungs that
    compile it, e.g. available_kernels("attention", head_dim=96))."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family={family!r} is not a kernel family; choose one of "
                         f"{', '.join(map(repr, FAMILIES))} (or None for every rung)")
    return [n for n, s in KERNELS.items() if (family is None or s.family == family)
            and (head_dim is None or head_dim in s.head_dims)]


# kernel=None's KV-cache rung where a KV head's query rows fit its 16-row tile and the cache is paged
# or FP8 (_dispatch.cache_rung): s2 (each warp its own keys on mma.sync) moves pages of 16 and FP8 slices at bandwidth where
# s1's one WGMMA chain, padded to 64 rows, is the bound; dense 16-bit caches stay on s1 (its TMA +
# WGMMA path reads them at the copy rate). Measured per cell in worklog/serving.md.
WARP_SPLIT_RUNG = "s2"


def fastest(family: str, head_dim: int | None = None, deterministic: bool = False,
            head_dim_v: int | None = None, masked: bool = False) -> KernelSpec:
    """The highest-ranked rung of `family` chosen for head_dim (`default_head_dims`; and,
    `deterministic`, for deterministic calls there: `deterministic_head_dims`, with a causal mask
    or window where `deterministic_masked_only`) that takes v's head_dim_v where it differs
    (`value_head_dims`)."""
    def serves(s):
        dims = s.head_dims if s.default_head_dims is None else s.default_head_dims
        if deterministic and s.deterministic_head_dims is not None:
            dims = tuple(d for d in dims if d in s.deterministic_head_dims)
        if deterministic and s.deterministic_masked_only and not masked:
            return False
        if head_dim_v not in (None, head_dim) and (head_dim, head_dim_v) not in s.value_head_dims:
            return False
        return head_dim is None or head_dim in dims

    candidates = [s for s in KERNELS.values() if s.family == family and serves(s)]
    return max(candidates, key=lambda s: s.speed_rank)
