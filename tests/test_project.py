"""The project itself: the package's import graph, and its version from git."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_command

# ----------------------------------------------------------------------------- the import graph
PACKAGES = ("_fsdp_shim", "fsdp_shim")
MODULES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for package in PACKAGES
    for path in (ROOT / package).rglob("*.py")
}


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return True
    return False


def imports_in(source: str) -> set[str]:
    """Every module ``source`` imports at run time, wherever in the file (not under TYPE_CHECKING), and
    every package whose ``__init__`` such an import runs first: ``from a.b import c`` imports ``a``,
    ``a.b``, and ``a.b.c`` where that is a module here."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _under_type_checking(node, parents):
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            found.update(".".join(parts[:index]) for index in range(1, len(parts) + 1))
    return {name for name in found if name in MODULES}


def import_graph() -> dict[str, set[str]]:
    return {name: imports_in(path.read_text()) - {name} for name, path in MODULES.items()}


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
    """No whitelisted edge: the start-up module hands over to the package by name, at run time, so
    nothing it imports imports it back."""
    graph = import_graph()
    assert sum(len(edges) for edges in graph.values()) > 40  # the walk sees the package's imports at all
    assert graph["_fsdp_shim"] == set(), "the start-up module imports nothing of the package"
    assert not cycles_in(graph), "\n".join(cycles_in(graph))


def test_only_fsdp_shim_itself_activates() -> None:
    """Only the public package activates, and nothing in the implementation imports it but verify's
    probe, which exists to train with the shim: the CLI, the start-up module and every other module
    import without activating."""
    importers = [name for name, edges in import_graph().items() if "fsdp_shim" in edges]
    assert [name for name in importers if name.startswith("_fsdp_shim")] == ["_fsdp_shim.verify.probe"], importers


def loaded_with(names: set[str]) -> set[str]:
    """The package modules that importing ``names`` loads: their imports at module level, and theirs in turn."""
    todo, loaded = list(names), set()
    while todo:
        if (name := todo.pop()) not in loaded:
            loaded.add(name)
            tree = ast.parse(MODULES[name].read_text())
            body = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.ClassDef))]
            todo += imports_in(ast.unparse(ast.Module(body=body, type_ignores=[])))
    return loaded


def test_a_training_process_loads_neither_the_failure_policy_nor_status_or_the_pins() -> None:
    """What a patched training process imports (the hand-over's activation, the fixes, their wrappers, the recompute
    check, the rank check) leaves out what loads only when used: failures (something to say), status, the pins (the
    first checkpoint call). benchmarks/package_size.py measures the lines it loads."""
    training = {f"_fsdp_shim.{name}" for name in ("activation", "fixes", "wrappers", "recompute_check", "rank_check")}
    later = {f"_fsdp_shim.{name}" for name in ("failures", "status", "pins")}
    assert loaded_with(training) & later == set()
    assert loaded_with({"fsdp_shim"}) >= {"_fsdp_shim.activation", "_fsdp_shim.failures"}  # the walk follows imports


def test_the_cycle_search_finds_a_cycle_and_sees_imports_inside_functions() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles_in(graph) == ["a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"]
    assert cycles_in({"a": {"b"}, "b": set()}) == []
    source = "def f():\n    from _fsdp_shim import wrappers\nif TYPE_CHECKING:\n    import _fsdp_shim.status\n"
    assert imports_in(source) == {"_fsdp_shim", "_fsdp_shim.wrappers"}


def test_the_package_uses_no_relative_imports() -> None:
    """The walk above reads absolute imports only; a relative one would hide an edge from it."""
    relative = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []


# ----------------------------------------------------------------------------- the version, from the source
def test_every_way_the_source_arrives_builds_one_version_above_0_2_0(tmp_path: Path) -> None:
    """A clone without tags, a depth-1 clone and a `git archive` tree build the same version, the one the source
    says, above the never-uploaded 0.2.0; a source tree used without a build imports and says it too."""
    import re
    import shutil
    import tarfile
    import zipfile

    from packaging.version import Version

    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None or not (ROOT / ".git").exists():
        pytest.skip("needs uv and this checkout's git history (an unpacked sdist has none)")
    said = re.search(r'__version__ = "([^"]+)"', (ROOT / "_fsdp_shim" / "_version.py").read_text()).group(1)
    head = run_command(["git", "rev-parse", "HEAD"], check=True).stdout.strip()
    trees = {"clone": tmp_path / "clone", "shallow": tmp_path / "shallow", "archive": tmp_path / "archive"}
    run_command(["git", "clone", "-q", "--no-tags", str(ROOT), str(trees["clone"])], check=True)
    run_command(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(trees["shallow"])], check=True)
    archive = tmp_path / "source.tar"
    run_command(["git", "archive", "--format=tar", "-o", str(archive), head], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(trees["archive"], filter="data")
    built = {}
    for name, tree in trees.items():
        out = tmp_path / f"wheel-{name}"
        run_command([uv, "build", "-q", "--wheel", "--out-dir", str(out), str(tree)], check=True)
        (wheel,) = out.glob("fsdp_shim-*.whl")
        with zipfile.ZipFile(wheel) as files:
            module = re.search(r'__version__ = "([^"]+)"', files.read("_fsdp_shim/_version.py").decode()).group(1)
        built[name] = (wheel.name.split("-")[1], module)
    assert set(built.values()) == {(said, said)}, built
    assert Version(said) > Version("0.2.0")
    env = {**os.environ, "PYTHONPATH": str(trees["archive"]), "FSDP_SHIM": "0"}
    command = [sys.executable, "-c", "import fsdp_shim; print(fsdp_shim.__version__)"]
    assert run_command(command, env=env, cwd=tmp_path, check=True).stdout.strip() == said
    version = run_command([sys.executable, "-m", "fsdp_shim", "--version"], env=env, cwd=tmp_path, check=True)
    assert version.stdout.strip() == f"fsdp-shim {said}"


def test_no_message_names_a_file_a_pip_user_does_not_have() -> None:
    """What the package says names pages of the docs site, never ``docs/*.md`` of a clone (docstrings aside)."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        strings = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        for node in strings:
            if id(node) not in docstrings and "docs/" in node.value.replace("fsdp-shim.github.io/fsdp-shim/", ""):
                found.append(f"{name}:{node.lineno}: {node.value[:60]}")
    assert found == []


def test_the_readme_shows_how_to_install_and_activate_in_its_first_40_lines() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "pip install fsdp-shim" in first
    for way in ("FSDP_SHIM=1 ", "fsdp-shim run ", "import fsdp_shim"):
        assert way in first, way
