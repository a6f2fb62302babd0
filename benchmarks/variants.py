"""Experiment rows: a registered rung with some of its settings changed, under a new name, for the
benchmark process that asks for it (nothing is added to the package's registry on disk).

    python benchmarks/bench_attention.py --backward --kernels b7,b7p --variant b7p=b7:prefetch_stats=1
    python benchmarks/bench_attention.py --backward --kernels b2,b2u --variant b2u=b2:ordered_dq=0

A variant is NAME=BASE:key=value[,key=value...]. A field of the rung's configuration
(kernels/config.py: tile_m, tile_n, q_stages, ordered_dq, prefetch_stats, ...) overrides BASE's at
every head dim; any other key must be a class attribute of BASE's kernel class (dkv_bulk_add, ...)
and is set on a subclass made for the variant; `head_dims` (slash-separated, e.g. head_dims=64)
replaces the head dims BASE serves. Values: integers, floats, true/false (1/0).

    --variant b8=b4:tile_m=128,dq_buffers=1,ds_from_rounded_p=1,dv_under_dp=0,head_dims=64

The variant joins `fa3.registry.KERNELS` with speed rank 0 (never picked by kernel=None), its class
in a module made for the process (`fa3.kernels.variant_rows`: the registry loads rungs by module
and class name). The class attributes also enter the variant's configuration table
(`class_attributes`), which is part of every compile-cache key, so a disk-cached kernel of an
earlier variant of the same name with other settings is never reused.
"""

from __future__ import annotations

import dataclasses
import sys
import types

from fa3 import registry

MODULE = "variant_rows"


def _value(text: str):
    low = text.strip().lower()
    if "/" in low:  # head_dims=64/96
        return tuple(int(x) for x in low.split("/"))
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(low)
    except ValueError:
        return float(low)


def parse(text: str) -> tuple[str, str, dict]:
    """(name, base, {key: value}) of NAME=BASE:key=value,..."""
    try:
        name, rest = text.split("=", 1)
        base, _, settings = rest.partition(":")
        pairs = [item.split("=", 1) for item in settings.split(",") if item]
        values = {key.strip(): _value(value) for key, value in pairs}
    except ValueError:
        raise ValueError(f"--variant {text!r}: expected NAME=BASE:key=value[,key=value...]") from None
    if not name.strip() or not base.strip() or not values:
        raise ValueError(f"--variant {text!r}: expected NAME=BASE:key=value[,key=value...]")
    return name.strip(), base.strip(), values


def register(text: str) -> registry.KernelSpec:
    """Parse one variant and add it to the registry (see the module docstring); returns its spec."""
    name, base_name, values = parse(text)
    if name in registry.KERNELS:
        raise ValueError(f"--variant {text!r}: {name!r} is already a rung; choose another name")
    base = registry.get(base_name)
    head_dims = values.pop("head_dims", base.head_dims)
    head_dims = head_dims if isinstance(head_dims, tuple) else (head_dims,)
    cls = base.load_class()
    takes = {f.name for f in dataclasses.fields(base.config.base)}
    config = {k: v for k, v in values.items() if k in takes}
    attrs = {k: v for k, v in values.items() if k not in takes}
    unknown = [k for k in attrs if not hasattr(cls, k)]
    if unknown:
        raise ValueError(f"--variant {text!r}: {cls.__name__} has no setting {', '.join(unknown)} "
                         f"(configuration fields: {', '.join(sorted(takes))})")
    variant = type(f"{cls.__name__}_{name.replace('.', '_')}", (cls,), attrs)
    module = sys.modules.setdefault(f"fa3.kernels.{MODULE}", types.ModuleType(f"fa3.kernels.{MODULE}"))
    setattr(module, variant.__name__, variant)
    spec = dataclasses.replace(
        base, name=name, module=MODULE, cls=variant.__name__, speed_rank=0, head_dims=head_dims,
        summary=f"{base_name} with {', '.join(f'{k}={v}' for k, v in values.items())}",
        config=base.config.replaced(tuple(attrs.items()), **config))
    registry.KERNELS[name] = spec
    return spec


def register_from_argv(argv: list[str]) -> list[str]:
    """Register every `--variant TEXT` (or --variant=TEXT) of argv before the rest is parsed, so
    that --kernels may name them; returns their names."""
    names = []
    for i, arg in enumerate(argv):
        if arg == "--variant" and i + 1 < len(argv):
            names.append(register(argv[i + 1]).name)
        elif arg.startswith("--variant="):
            names.append(register(arg.split("=", 1)[1]).name)
    return names
