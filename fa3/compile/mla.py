"""The MLA decode family's kernels (kernels/mla_decode.py, M1): key, builder and getter, and what
--warm-cache fills beside it (the split-KV combine at the latent's width). The shared compile
machinery is compile/core.py.
"""

from __future__ import annotations


from . import core
from . import dsl
from . import signatures as sig
from .kvcache import build_combine, combine_key
from ..kernels import config


def mla_key(spec, dtype, causal=True, paged=True, gather=False, varlen=False) -> tuple:
    layout = (bool(paged), bool(paged and gather), bool(varlen))  # pages (row gathers), packed queries
    return (spec.name, str(dtype), bool(causal), layout, config.key(spec.config, config.mla_config(spec.config)),
            dsl.TARGET_ARCH, dsl.version())


def build_mla(spec, dtype, causal=True, paged=True, gather=False, varlen=False, extra_options=""):
    cfg = config.mla_config(spec.config)
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), causal=causal, config=cfg, paged=paged, gather=gather,
                               varlen=varlen)
    return core.compile_kernel(kernel, sig.mla_args(dtype, cfg.head_dim, cfg.head_dim_v), extra_options)


def get_mla(spec, dtype, causal, paged, gather=False, varlen=False):
    """The compiled MLA decode kernel: a paged cache (pages of a multiple of the key block: TMA
    boxes; gather: pages of any other size, cp.async row gathers) or a dense one, causal or not,
    (batch, seqlen_q) queries or (varlen) packed ones of different lengths; q, qv and the cache in
    `dtype` (bf16 / fp16)."""
    static = (causal, paged, paged and gather, varlen)
    return core.compiled(("mla", spec.name, dtype, *static), mla_key, build_mla, spec, dtype, *static)


def mla_companions(spec, dtype) -> list[tuple[str, tuple, object]]:
    """(label, key, build) of the kernels an MLA call launches beside `spec`, for `python -m fa3
    compile --warm-cache`: the split-KV combine at d_v."""
    d_v = spec.config.base.head_dim_v
    return [("combine", combine_key(dtype, d_v), lambda: build_combine(dtype, d_v))]



