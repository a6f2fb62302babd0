"""The house's rules, checked on the CPU: no import circle inside fa3/ (imports inside functions
included), the production forward kernels built from kernels/common/, not on teaching rungs, and
no rung's class built on another rung's (the production backward: one class, its rungs flags).
"""

import ast
import os

import pytest

from fa3.compile import dsl as _dsl
from fa3 import registry

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fa3")
TEACHING_FORWARD = ("k1", "k2", "k3.1", "k4.1", "k4.2")  # their classes: standalone lessons


def _fa3_imports() -> dict:
    """module -> the fa3 modules it imports (relative imports, at any depth of the file)."""
    modules = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != module:
                        graph[module].add(target)
    return graph


def _circles(graph) -> list:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_circle_in_fa3():
    graph = _fa3_imports()
    # the scan sees imports, the subpackages' too
    assert "fa3.interface" in graph and "fa3.compile.builders" in graph["fa3._launch"]
    assert _circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("family", [registry.ATTENTION, registry.ATTENTION_FP8, registry.KVCACHE,
                                    registry.MLA, registry.GEMM])
def test_forward_rows_stand_on_no_rows_class(family):
    """The forward's rungs (the lessons K1-K4 too), the FP8 forward, S1, K5 over a cache, M1 and the
    GEMMs compose kernels/common/ pieces (and their own file's): no other row's class, of any
    family, is among their bases, so a change to one rung (a lesson included) cannot change
    another. Rows that are configurations of one class share it."""
    _dsl.pin_target_arch()
    rows = {name: spec.load_class() for name, spec in registry.KERNELS.items()}
    from fa3.kernels.k5_cache import CacheAttention

    names = registry.available_kernels(family)
    assert names
    for cls in [rows[n] for n in names] + ([CacheAttention] if family == registry.KVCACHE else []):
        others = set(rows.values()) - {cls}
        assert not others & set(cls.__mro__), f"{cls.__name__} stands on {others & set(cls.__mro__)}"



TEACHING_BACKWARD = ("b1",)  # its class: a standalone lesson


def _row_classes() -> dict:
    """Every registry row's name -> its kernel class."""
    _dsl.pin_target_arch()
    return {name: spec.load_class() for name, spec in registry.KERNELS.items()}


def test_production_backward_is_one_class_of_flags():
    """b2-b9 are configurations (flags) of one kernel class, which has no rung's class among its
    bases: not b1's (the lesson: both compose the shared pieces), nor any other row's."""
    classes = _row_classes()
    production = {classes[n] for n in registry.available_kernels(registry.BACKWARD)
                  if n not in TEACHING_BACKWARD}
    assert len(production) == 1, f"the production backward is {len(production)} classes"
    (cls,) = production
    rungs = set(classes.values()) - {cls}
    assert not rungs & set(cls.__mro__), f"{cls.__name__} stands on {rungs & set(cls.__mro__)}"
    teaching = {classes[n] for n in TEACHING_BACKWARD}
    assert not teaching & set(cls.__mro__) and cls not in set().union(*(t.__mro__ for t in teaching))


def test_backward_rows_stand_on_no_rows_class():
    """The backward's rows, b1 included: no other row's class, of any family, is among their
    bases (test_forward_rows_stand_on_no_rows_class checks the other families the same way)."""
    classes = _row_classes()
    names = registry.available_kernels(registry.BACKWARD)
    assert names
    for name in names:
        cls = classes[name]
        others = set(classes.values()) - {cls}
        assert not others & set(cls.__mro__), f"{name}: {cls.__name__} stands on {others & set(cls.__mro__)}"
