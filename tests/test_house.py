"""The house's rules, checked on the CPU: no import circle inside fa3/ (imports inside functions
included), and the production forward kernels built from kernels/common/, not on teaching rungs.
"""

import ast
import os

import pytest

from fa3 import _dsl, registry

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
    assert "fa3.interface" in graph and "fa3._compile" in graph["fa3._launch"]  # the scan sees imports
    assert _circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("family", [registry.ATTENTION, registry.ATTENTION_FP8])
def test_production_forward_inherits_no_teaching_rung(family):
    """K5's rungs, the FP8 forward and K5 over a cache compose kernels/common/ pieces: none of the
    teaching rungs' classes is among their bases (a change to a lesson cannot change them)."""
    _dsl.pin_target_arch()
    teaching = {registry.get(name).load_class() for name in TEACHING_FORWARD}
    from fa3.kernels.k5_cache import CacheAttention

    classes = [registry.get(n).load_class() for n in registry.available_kernels(family)
               if n not in TEACHING_FORWARD and not n.startswith("k3")]
    assert classes
    for cls in classes + [CacheAttention]:
        assert not teaching & set(cls.__mro__), f"{cls.__name__} stands on {teaching & set(cls.__mro__)}"
