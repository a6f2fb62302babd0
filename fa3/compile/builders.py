"""Compile once per static configuration; keep batch, seqlens and heads dynamic.

Kernels are compiled against *fake* tensors whose batch, seqlen, heads and strides are symbolic
(`cute.sym_int64`; each family's list: fa3.compile.signatures), with the TVM-FFI calling convention: the
compiled object is then called with plain torch tensors, checks them in compiled code, and
launches on torch's current stream. A new shape never recompiles; a new dtype, head dim, causal
flag or rung does (it is in the key).

Without a GPU (CI), compiles target sm_90a: the DSL is imported through fa3.compile.dsl, which pins the
architecture first (nothing in fa3 imports cutlass at module import time).

This module holds the attention (forward, FP8, backward) and GEMM families and what spans every
family (compile reports, BUILDERS/KEYS, filling the disk cache); the KV-cache family is
compile/kvcache.py, the shared machinery (compile, the in-process caches) compile/core.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from dataclasses import dataclass

import torch

from . import core
from . import kvcache as kv
from . import mla
from . import disk_cache, dsl
from .. import registry
from . import signatures as sig
from ..kernels import config


def _key_dims(head_dim, head_dim_v):
    """A compile key's head dims: head_dim, or (head_dim, head_dim_v) where v's differs (so keys
    of calls with equal head dims stay as they were)."""
    return head_dim if head_dim_v in (None, head_dim) else (head_dim, head_dim_v)


def _attention_config(spec, head_dim, causal, varlen, local, head_dim_v, short):
    return config.forward_config(spec.config, head_dim, head_dim_v, causal=bool(causal), varlen=bool(varlen),
                                 local=bool(local), short=bool(short))


def attention_key(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                  sinks=False, head_dim_v=None, short=False, mods=None, block_lists=0) -> tuple:
    """`mods`: None, or the call's fa3.mods.Mods (its key: the mods' code and captured tensors'
    dtypes and ranks); `block_lists`: 0, or how many of a BlockMask's lists the kernel walks (2:
    partial blocks only, 4: full blocks too)."""
    cfg = _attention_config(spec, head_dim, causal, varlen, local, head_dim_v, short)
    variant = (bool(varlen), bool(local), bool(softcap), bool(sinks))
    return (spec.name, str(dtype), _key_dims(head_dim, head_dim_v), bool(causal), *((variant,) if any(variant) else ()),
            *(() if mods is None else (("mods", mods.key),)),
            *((("block_lists", block_lists),) if block_lists else ()),
            config.key(spec.config, cfg), dsl.TARGET_ARCH, dsl.version())


def _build_attention(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                     sinks=False, head_dim_v=None, short=False, extra_options="", mods=None, block_lists=0):
    cfg = _attention_config(spec, head_dim, causal, varlen, local, head_dim_v, short)
    static = dict(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal)
    if isinstance(cfg, config.LessonConfig):  # a lesson takes its tiles as arguments
        kernel = spec.load_class()(**static, **cfg.kwargs())
    else:
        variant = dict(varlen=varlen, local=local, softcap=softcap, sinks=sinks) if spec.variants else {}
        if head_dim_v not in (None, head_dim):
            variant["head_dim_v"] = head_dim_v
        if mods is not None:
            return _build_attention_mods(spec, dtype, head_dim, head_dim_v, static, cfg, variant, mods,
                                         extra_options, block_lists)
        kernel = spec.load_class()(**static, config=cfg, **variant)
    return core.compile_kernel(kernel, sig.attention_args(spec, dtype, head_dim, head_dim_v), extra_options)


def _build_attention_mods(spec, dtype, head_dim, head_dim_v, static, cfg, variant, mods, extra_options,
                          block_lists=0):
    """K5's flex form (kernels/k5.WarpSpecializedFlexAttention) with the call's mods compiled in,
    or with `block_lists` (2 or 4: a BlockMask's lists, fa3.flex) its block-sparse form
    (BlockSparseFlexAttention); a mod that cannot be traced is reported by name."""
    if not spec.takes_mods():
        raise ValueError(f"score_mod / mask_mod run on the K5 rungs only, not on {spec.name}")
    from ..kernels.k5 import BlockSparseFlexAttention, WarpSpecializedFlexAttention

    flex_class = BlockSparseFlexAttention if block_lists else WarpSpecializedFlexAttention
    kernel = flex_class(**static, config=cfg, **variant, score_mod=mods.score_mod, mask_mod=mods.mask_mod)
    args = sig.attention_args(spec, dtype, head_dim, head_dim_v) + [sig.aux_args(mods.aux_spec() or [(torch.int32, 1)])]
    if block_lists:  # (counts (B|1, H|1, q_blocks), indices (B|1, H|1, q_blocks, kv_blocks)) once or twice
        args.append(sig.aux_args([(torch.int32, 3), (torch.int32, 4)] * (block_lists // 2)))
    try:
        return core.compile_kernel(kernel, args, extra_options)
    except Exception as e:  # the DSL wraps what a mod raised while traced
        raise ValueError(mods.compile_error(e)) from e


# ----------------------------------------------------------------------------- FP8 forward (F1)
def _build_attention_fp8(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False,
                         extra_options=""):
    """`dtype`: the output's (q, k, v are e4m3)."""
    cfg = config.fp8_forward_config(spec.config, head_dim, causal=bool(causal), varlen=bool(varlen),
                                    local=bool(local))
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal, config=cfg,
                               varlen=varlen, local=local, softcap=softcap)
    return core.compile_kernel(kernel, sig.attention_fp8_args(spec, dtype, head_dim), extra_options)


def attention_fp8_key(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False) -> tuple:
    cfg = config.fp8_forward_config(spec.config, head_dim, causal=bool(causal), varlen=bool(varlen),
                                    local=bool(local))
    variant = (bool(varlen), bool(local), bool(softcap), False)
    return (spec.name, str(dtype), head_dim, bool(causal), *((variant,) if any(variant) else ()),
            config.key(spec.config, cfg), dsl.TARGET_ARCH, dsl.version())


def get_attention_fp8(spec, out_dtype, head_dim, causal, varlen=False, local=False, softcap=False):
    """The compiled FP8 forward for this static configuration (`out_dtype`: O's)."""
    return core.compiled(("fp8", spec.name, out_dtype, head_dim, causal, varlen, local, softcap),
                         attention_fp8_key, _build_attention_fp8, spec, out_dtype, head_dim, causal, varlen, local,
                         softcap)


def get_attention(spec, dtype, head_dim, causal, varlen=False, local=False, softcap=False, sinks=False,
                  head_dim_v=None, short=False, mods=None, block_lists=0):
    """The compiled kernel for this static configuration (compiled on first use). The per-call
    path is one dict lookup; the full key (config, arch, DSL version) is built only on a miss.
    varlen/local/softcap/sinks: the variants of rungs that list them (registry `variants`);
    head_dim_v: V's head dim where it differs (registry `value_head_dims`); short: the rung's
    tiles for short query sequences (its configuration's `short_queries`: kernels/config.py);
    mods: None, or fa3.mods.Mods (K5's flex form; compiled per mod, in this process only: a mod's
    code may read globals no key can see); block_lists: 0, or 2 / 4 (with mods: the block-sparse
    flex form walking a BlockMask's partial lists / and its full lists)."""
    if mods is not None:
        key = attention_key(spec, dtype, head_dim, causal, varlen, local, softcap, sinks, head_dim_v, short, mods,
                            block_lists)
        return core.compiled_in_process(key, lambda: _build_attention(
            spec, dtype, head_dim, causal, varlen, local, softcap, sinks, head_dim_v, short, mods=mods,
            block_lists=block_lists))
    return core.compiled((spec.name, dtype, head_dim, causal, varlen, local, softcap, sinks, head_dim_v, short),
                         attention_key, _build_attention, spec, dtype, head_dim, causal, varlen, local, softcap,
                         sinks, head_dim_v, short)


# ----------------------------------------------------------------------------- backward
def backward_key(spec, dtype, head_dim, causal, deterministic=False, gqa=False, local=False,
                 softcap=False, varlen=False, head_dim_v=None, mods=None, block_lists=0) -> tuple:
    """`mods`: None, or the call's fa3.mods.Mods(..., backward=True) (the flex form); `block_lists`:
    0, or how many of a BlockMask's transposed lists the kernel walks (2: partial blocks only, 4:
    full blocks too)."""
    cfg = config.backward_config(spec.config, head_dim, head_dim_v)
    return (spec.name, str(dtype), _key_dims(head_dim, head_dim_v), bool(causal), bool(deterministic), bool(gqa),
            bool(local), bool(softcap), bool(varlen), *(() if mods is None else (("mods", mods.key),)),
            *((("block_lists", block_lists),) if block_lists else ()),
            config.key(spec.config, cfg), dsl.TARGET_ARCH, dsl.version())


def _build_backward(spec, dtype, head_dim, causal, deterministic=False, gqa=False, local=False,
                    softcap=False, varlen=False, head_dim_v=None, extra_options="", mods=None, block_lists=0):
    value = {"head_dim_v": head_dim_v} if head_dim_v not in (None, head_dim) else {}
    static = dict(dtype=sig.cute_dtype(dtype), head_dim=head_dim, causal=causal,
                  config=config.backward_config(spec.config, head_dim, head_dim_v), deterministic=deterministic,
                  local=local, softcap=softcap, varlen=varlen, **value)
    args = sig.backward_args(dtype, head_dim, gqa, deterministic, head_dim_v)
    if mods is None:
        return core.compile_kernel(spec.load_class()(**static), args, extra_options)
    return _build_backward_mods(spec, static, args, mods, extra_options, block_lists)


def _build_backward_mods(spec, static, args, mods, extra_options, block_lists=0):
    """The warp-specialized backward's flex form (kernels/bwd_ws.FlexBackward) with the call's mods
    and the score mod's derivative compiled in, or with `block_lists` (2 or 4: a BlockMask's
    transposed lists, fa3.flex) its block-sparse form (BlockSparseFlexBackward); a mod that cannot
    be traced is reported by name."""
    if spec.module != "bwd_ws":
        raise ValueError(f"score_mod / mask_mod backward runs on the warp-specialized backward rungs (b2 on), "
                         f"not on {spec.name}")
    from ..kernels.bwd_ws import BlockSparseFlexBackward, FlexBackward

    flex_class = BlockSparseFlexBackward if block_lists else FlexBackward
    kernel = flex_class(**static, score_mod=mods.score_mod, mask_mod=mods.mask_mod,
                        score_mod_grad=mods.score_mod_grad)
    args = args + [sig.aux_args(mods.aux_spec() or [(torch.int32, 1)])]
    if block_lists:  # (counts (B|1, H|1, kv_blocks), indices (B|1, H|1, kv_blocks, q_blocks)) once or twice
        args.append(sig.aux_args([(torch.int32, 3), (torch.int32, 4)] * (block_lists // 2)))
    try:
        return core.compile_kernel(kernel, args, extra_options)
    except Exception as e:  # the DSL wraps what a mod raised while traced
        raise ValueError(mods.compile_error(e)) from e


def get_backward(spec, dtype, head_dim, causal, deterministic, gqa, local=False, softcap=False,
                 varlen=False, head_dim_v=None, mods=None, block_lists=0):
    """The compiled backward main kernel for this static configuration (compiled on first use);
    head_dim_v: V's head dim where it differs (registry `value_head_dims`); mods: None, or
    fa3.mods.Mods(..., backward=True) (the flex form, compiled per mod in this process only, as the
    forward's); block_lists: 0, or 2 / 4 (with mods: the block-sparse flex form walking a
    BlockMask's transposed partial lists / and its full ones)."""
    if mods is not None:
        key = backward_key(spec, dtype, head_dim, causal, deterministic, gqa, local, softcap, varlen, head_dim_v,
                           mods, block_lists)
        return core.compiled_in_process(key, lambda: _build_backward(
            spec, dtype, head_dim, causal, deterministic, gqa, local, softcap, varlen, head_dim_v, mods=mods,
            block_lists=block_lists))
    return core.compiled(("bwd", spec.name, dtype, head_dim, causal, deterministic, gqa, local, softcap, varlen,
                          head_dim_v), backward_key, _build_backward, spec, dtype, head_dim, causal, deterministic,
                         gqa, local, softcap, varlen, head_dim_v)


def _build_preprocess(dtype, head_dim, head_dim_v=None, varlen=False, tile_m=64, dq_in_slots=False,
                      extra_options=""):
    cutlass, cute = dsl.import_cute()
    from ..kernels.bwd_pre import BackwardPreprocess

    dt = sig.cute_dtype(dtype)
    b, sq, h, rows = (cute.sym_int64() for _ in range(4))

    def tensor(elem, *shape):
        return sig.unit_last(cute, elem, *shape, align=4)

    dq_rows = cute.sym_int64()
    # O, dO and the dQ accumulator read and written in 16-byte vectors (_launch.tma_ready's rule)
    dv = head_dim_v or head_dim
    args = [sig.unit_last(cute, dt, b, sq, h, dv, tma=True),
            sig.unit_last(cute, dt, b, sq, h, dv, tma=True),
            tensor(cutlass.Float32, b, h, sq), tensor(cutlass.Float32, b, h, rows),
            tensor(cutlass.Float32, b, h, rows),
            sig.unit_last(cute, cutlass.Float32, b, dq_rows, h, head_dim, tma=True),
            # cu_seqlens_q: read only by the varlen variant (a 1-element stand-in otherwise)
            sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)]
    return core.compile_kernel(BackwardPreprocess(dt, head_dim, head_dim_v, varlen, tile_m, dq_in_slots), args,
                           extra_options)


def get_backward_preprocess(dtype, head_dim, head_dim_v=None, varlen=False, tile_m=64, dq_in_slots=False):
    """D = rowsum(dO * O) and LSE * log2(e), padded, and the dQ accumulator zeroed (kernels/bwd_pre.py);
    O and dO have head_dim_v columns where given. varlen: a packed batch, the statistics (and,
    dq_in_slots, the dQ accumulator) in slots of the main kernel's tile_m rows."""
    layout = (bool(varlen), tile_m if varlen else 0, bool(dq_in_slots and varlen))
    return core.compiled(("bwd_pre", dtype, head_dim, head_dim_v, *layout), preprocess_key, _build_preprocess,
                         dtype, head_dim, head_dim_v, *layout)


def preprocess_key(dtype, head_dim, head_dim_v, varlen, tile_m, dq_in_slots) -> tuple:
    return ("bwd_pre", str(dtype), _key_dims(head_dim, head_dim_v), (varlen, tile_m, dq_in_slots), dsl.TARGET_ARCH,
            dsl.version())


def _build_postprocess(spec, dtype, head_dim, varlen=False, extra_options=""):
    cutlass, cute = dsl.import_cute()
    from ..kernels.bwd_post import FragmentDqPostprocess

    dt = sig.cute_dtype(dtype)
    rung = spec.load_class()(dtype=dt, head_dim=head_dim, causal=False, varlen=varlen,
                             config=config.backward_config(spec.config, head_dim))
    b, rows, sq, h = (cute.sym_int64() for _ in range(4))
    args = [sig.unit_last(cute, cutlass.Float32, b, rows, h, head_dim, tma=True),
            sig.unit_last(cute, dt, b, sq, h, head_dim, tma=True), cutlass.Float32(1.0),
            # cu_seqlens_q: read only when packed (a 1-element stand-in otherwise)
            sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)]
    return core.compile_kernel(FragmentDqPostprocess(rung), args, extra_options)


def get_backward_postprocess(spec, dtype, head_dim, varlen=False):
    """dQ = scale * dQacc in the output dtype, from `spec`'s fragment-order accumulator
    (kernels/bwd_post.py); `varlen`: a packed batch's."""
    return core.compiled(("bwd_post", spec.name, dtype, head_dim, varlen), postprocess_key, _build_postprocess,
                         spec, dtype, head_dim, varlen)


def postprocess_key(spec, dtype, head_dim, varlen) -> tuple:
    return ("bwd_post", spec.name, str(dtype), head_dim, varlen,
            config.key(spec.config, config.backward_config(spec.config, head_dim)), dsl.TARGET_ARCH, dsl.version())


def _build_value_transpose(head_dim, packed=False, extra_options=""):
    cutlass, cute = dsl.import_cute()
    from ..kernels.fp8_transpose import ValueTranspose

    b, s, h = (cute.sym_int64() for _ in range(3))
    k4 = cute.sym_int64(divisibility=4)  # keys / 4: keys are a multiple of 16
    v = sig.unit_last(cute, cutlass.Int32, b, s, h, head_dim // 4, tma=True)  # tma_ready's strides
    vt = sig.fake_tensor(cute, cutlass.Int32, (b, h, head_dim, k4),
                      (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), k4, 1))
    cu = sig.fake_tensor(cute, cutlass.Int32, (cute.sym_int64(),), (1,), align=4)
    return core.compile_kernel(ValueTranspose(head_dim, packed), [v, vt, cu], extra_options)


def get_value_transpose(head_dim, packed=False):
    """The FP8 forward's V^T in the P operand's key order (kernels/fp8_transpose.py); `packed`: a
    packed batch's, each sequence in its own 16-aligned run of columns."""
    return core.compiled(("fp8_vt", head_dim, packed), value_transpose_key, _build_value_transpose, head_dim, packed)


def value_transpose_key(head_dim, packed) -> tuple:
    return ("fp8_vt", head_dim, *(("packed",) if packed else ()), dsl.TARGET_ARCH, dsl.version())


# GEMM operand layouts, as torch strides show them: "row" = unit stride along the last dimension
# (a contiguous tensor), "col" = unit stride along the first (a .t() view). Static in the kernel.
GEMM_LAYOUTS = ("row", "col")


def gemm_key(spec, dtype, a_layout, b_layout, out_dtype=None, row_scales=False, tiles: tuple = ()) -> tuple:
    dtypes = str(dtype) if out_dtype in (None, dtype) else (str(dtype), str(out_dtype))
    return (spec.name, dtypes, a_layout, b_layout, *(("row_scales",) if row_scales else ()),
            config.key(spec.config, config.gemm_config(spec.config, tiles)), dsl.TARGET_ARCH, dsl.version())


def _build_gemm(spec, dtype, a_layout="row", b_layout="row", out_dtype=None, row_scales=False,
                tiles: tuple = (), extra_options=""):
    """`dtype`: A's and B's (e4m3: the scaled FP8 GEMM, C in `out_dtype`, per-tensor scales or
    `row_scales`); `tiles`: gemm_config's overrides of the rung's tiles."""
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), config=config.gemm_config(spec.config, tiles),
                               out_dtype=sig.cute_dtype(out_dtype or dtype), row_scales=row_scales)
    return core.compile_kernel(kernel, sig.gemm_args(dtype, a_layout, b_layout, out_dtype), extra_options)


def get_gemm(spec, dtype, a_layout, b_layout, tiles: tuple = (), out_dtype=None, row_scales=False):
    """The compiled GEMM for this rung, dtypes and operand layouts (compiled on first use); call it
    as fn(a, b, c, sm_count, workspace, counters, splits, scale_a, scale_b). `tiles`: ((field,
    value), ...) over the rung's configuration (the tile shape the GEMM heuristic picks per
    problem: kernels/config.gemm_config). Like get_attention, a hit is one dict lookup."""
    return core.compiled(("gemm", spec.name, dtype, a_layout, b_layout, tiles, out_dtype, row_scales), gemm_key,
                         _build_gemm, spec, dtype, a_layout, b_layout, out_dtype, row_scales, tiles)


@dataclass
class CompileReport:
    ptx: str
    cubin: bytes
    ptxas_log: str

    @property
    def registers(self) -> list[int]:
        return [int(r) for r in re.findall(r"Used (\d+) registers", self.ptxas_log)]

    @property
    def spill_bytes(self) -> int:
        return sum(int(a) + int(b) for a, b in
                   re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.ptxas_log))

    @property
    def serialized_wgmma(self) -> bool:
        """ptxas' C7512: it serialized the wgmma.mma_async instructions for lack of registers (each
        waits for the previous one: the asynchrony the kernel is built around is gone)."""
        return "C7512" in self.ptxas_log or "wgmma.mma_async instructions are serialized" in self.ptxas_log

    def summary(self) -> str:
        lines = [line.split("info    :")[-1].strip() for line in self.ptxas_log.splitlines()
                 if "registers" in line or "spill" in line]
        return "\n".join(lines)


def compile_report(spec, dtype=torch.bfloat16, **static) -> CompileReport:
    """Compile for sm_90a (no GPU needed) and return the PTX, the cubin and ptxas' resource report.

    `static` is what the family's builder takes (attention: head_dim, causal; GEMM: a_layout,
    b_layout, "row" by default)."""
    return build_report(BUILDERS[spec.family], spec, dtype, **static)


def build_report(build, *args, **kwargs) -> CompileReport:
    """Any builder of this module (a `_build_*`: main kernels and their helpers, the backward's
    pre/postprocess, the combine, ...) run for sm_90a with PTX and cubin kept, and ptxas' report."""
    buf = io.StringIO()
    # The DSL names its PTX and cubin files after the kernel's (truncated) function name, so two
    # processes compiling alike kernels into one folder read each other's files: each call its own.
    with tempfile.TemporaryDirectory(prefix="fa3-report-") as folder, \
            contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        fn = build(*args, **kwargs, extra_options=f"--keep-ptx --keep-cubin --dump-dir={folder} remarks{{ptx}}")
    return CompileReport(ptx=fn.artifacts.PTX, cubin=fn.artifacts.CUBIN, ptxas_log=buf.getvalue())


# family -> builder(spec, dtype, **static, extra_options) -> compiled function
BUILDERS = {registry.ATTENTION: _build_attention, registry.ATTENTION_FP8: _build_attention_fp8,
            registry.GEMM: _build_gemm,
            registry.BACKWARD: _build_backward, registry.KVCACHE: kv.build_kvcache, registry.MLA: mla.build_mla}
# family -> key(spec, dtype, **static): the compile-cache key, with the builder's static arguments
KEYS = {registry.ATTENTION: attention_key, registry.ATTENTION_FP8: attention_fp8_key,
        registry.GEMM: gemm_key, registry.BACKWARD: backward_key,
        registry.KVCACHE: kv.kvcache_key, registry.MLA: mla.mla_key}


def fill_disk_cache(spec, dtype=torch.bfloat16, **static):
    """Compile into the disk cache unless a valid entry is there (no GPU needed: for deployments).
    Returns (entry path or None if the cache is off or unwritable, whether it compiled)."""
    dsl.pin_target_arch()  # before anything imports cutlass
    return fill_disk_cache_entry(KEYS[spec.family](spec, dtype, **static),
                                 lambda: BUILDERS[spec.family](spec, dtype, **static))


def fill_disk_cache_entry(key, build):
    """fill_disk_cache for any key and its builder (a rung's companion kernels: kvcache_companions)."""
    dsl.pin_target_arch()  # before anything imports cutlass
    path = disk_cache.has(key)
    if path is not None:
        return path, False
    return disk_cache.save(key, build()), True
