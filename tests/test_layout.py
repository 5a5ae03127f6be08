"""The package's shape: no import cycles, function-level imports included, so that each module can be
read knowing only the modules below it."""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT

pytestmark = pytest.mark.release_independent

PACKAGE = ROOT / "fsdp_shim"
MODULES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for path in [*PACKAGE.rglob("*.py"), ROOT / "_fsdp_shim_startup.py", ROOT / "_fsdp_shim_trampoline.py"]
}


LOADER_EDGES = {("_fsdp_shim_trampoline", "_fsdp_shim_startup"), ("_fsdp_shim_startup", "fsdp_shim")}
"""Each layer that runs before the next loads it when Lightning is imported: the start-up files' finder
hands over to the start-up module (``hand_over``), which loads the package (``load_shim``). The only
imports that go up the layers, by design, like entry points being loaded."""


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return True
    return False


def imports_in(source: str) -> set[str]:
    """Every module ``source`` imports at run time, wherever in the file (not under TYPE_CHECKING);
    ``from package import name`` counts as importing ``package.name`` where that is a module here."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return found


def imports_of(name: str) -> set[str]:
    found = imports_in(MODULES[name].read_text())
    return {module for module in found if module in MODULES and module != name and (name, module) not in LOADER_EDGES}


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle of ``graph`` (module -> the modules it imports), as "a -> b -> a"."""
    cycles = set()

    def visit(name: str, path: list[str]) -> None:
        for imported in sorted(graph.get(name, ())):
            if imported in path:
                cycles.add(" -> ".join([*path[path.index(imported) :], imported]))
            else:
                visit(imported, [*path, imported])

    for name in sorted(graph):
        visit(name, [name])
    return sorted(cycles)


def test_the_package_has_no_import_cycle() -> None:
    graph = {name: imports_of(name) for name in MODULES}
    assert sum(len(edges) for edges in graph.values()) > 40  # the walk sees the package's imports at all
    assert not cycles_in(graph), "\n".join(cycles_in(graph))


def test_the_cycle_search_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles_in(graph) == ["a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"]
    assert cycles_in({"a": {"b"}, "b": set()}) == []


def test_the_package_uses_no_relative_imports() -> None:
    """The walk above reads absolute imports only; a relative one would hide an edge from it."""
    relative = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []


def test_the_walk_sees_imports_inside_functions_and_skips_type_checking() -> None:
    """What hid the old cycles: imports inside functions. Typing-only imports run never."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fsdp_shim import integration\n"
        "def f():\n    from fsdp_shim import activation\n    import fsdp_shim.backport\n"
    )
    found = imports_in(source)
    assert {"fsdp_shim.activation", "fsdp_shim.backport"} <= found
    assert "fsdp_shim.integration" not in found
