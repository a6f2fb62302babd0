"""The MLA decode family's kernels (kernels/mla_decode.py, M1): key, builder and getter, alone and
(a split call's) with the split-KV combine at the latent's width (kernels/combine.py). The shared
compile machinery is compile/core.py.
"""

from __future__ import annotations


from . import core
from . import dsl
from . import signatures as sig
from ..kernels import config


def mla_key(spec, dtype, causal=True, paged=True, gather=False, varlen=False, with_combine=False) -> tuple:
    layout = (bool(paged), bool(paged and gather), bool(varlen))  # pages (row gathers), packed queries
    return (spec.name, str(dtype), bool(causal), layout, *((("with_combine",),) if with_combine else ()),
            config.key(spec.config, config.mla_config(spec.config)), dsl.TARGET_ARCH, dsl.version())


def build_mla(spec, dtype, causal=True, paged=True, gather=False, varlen=False, with_combine=False,
              extra_options=""):
    cfg = config.mla_config(spec.config)
    kernel = spec.load_class()(dtype=sig.cute_dtype(dtype), causal=causal, config=cfg, paged=paged, gather=gather,
                               varlen=varlen)
    if with_combine:  # one host function launching M1 and then the combine of its partials
        from ..kernels.combine import MlaWithCombine, SplitKVCombine

        kernel = MlaWithCombine(kernel, SplitKVCombine(sig.cute_dtype(dtype), cfg.head_dim_v))
    return core.compile_kernel(kernel, sig.mla_args(dtype, cfg.head_dim, cfg.head_dim_v), extra_options)


def get_mla(spec, dtype, causal, paged, gather=False, varlen=False, with_combine=False):
    """The compiled MLA decode kernel: a paged cache (pages of a multiple of the key block: TMA
    boxes; gather: pages of any other size, cp.async row gathers) or a dense one, causal or not,
    (batch, seqlen_q) queries or (varlen) packed ones of different lengths; q, qv and the cache in
    `dtype` (bf16 / fp16). with_combine: M1 and the split-KV combine of its partials in one call
    (kernels/combine.MlaWithCombine)."""
    static = (causal, paged, paged and gather, varlen, with_combine)
    return core.compiled(("mla", spec.name, dtype, *static), mla_key, build_mla, spec, dtype, *static)
