"""The project itself: the package's import graph, the compatibility table's generator, the tests'
hang protection, and the demo-Transformer benchmark at its CPU size."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, alive, run_command

SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import compat_table  # noqa: E402  (scripts/ is not a package)

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


def test_the_walk_sees_imports_inside_functions_parent_packages_and_skips_type_checking() -> None:
    """What hid the old cycles: imports inside functions, and a package __init__ that an import runs."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from _fsdp_shim import wrappers\n"
        "def f():\n    from _fsdp_shim import activation\n    import _fsdp_shim.fixes\n"
    )
    found = imports_in(source)
    assert {"_fsdp_shim", "_fsdp_shim.activation", "_fsdp_shim.fixes"} <= found
    assert "_fsdp_shim.wrappers" not in found


# ----------------------------------------------------------------------------- the compatibility table
def namespace(name: str, version: str, cast: tuple[str, ...] | bool = (), recompute: tuple[str, ...] = ()) -> dict:
    """One entry of a matrix record, as ``fsdp_shim.status().namespaces[i].as_dict()`` gives it;
    ``cast=True``: the release lacks the cast and the shim did not apply it."""
    fixes = [
        {
            "fix": fix,
            "affected": bool(targets),
            "patched": bool(targets) and targets is not True,
            "reason": "",
            "targets": []
            if targets is True
            else [t if t.startswith("torch.") else f"{name}.plugins.precision.fsdp.{t}" for t in targets],
        }
        for fix, targets in (("cast", cast), ("recompute", recompute))
    ]
    return {
        "namespace": name,
        "imported": True,
        "version": version,
        "affected": any(fix["affected"] for fix in fixes),
        "patched": any(fix["patched"] for fix in fixes),
        "reason": "",
        "targets": [target for fix in fixes for target in fix["targets"]],
        "activated_after_import": False,
        "fixes": fixes,
    }


def record(
    session: str,
    namespaces: list[dict],
    torch: str = "2.13.0+cpu",
    wrapt: str = "2.5.2",
    python: str = "3.11.7",
    **counts: int,
) -> dict:
    tally = {"tests": 10, "failures": 0, "errors": 0, "skipped": 2, **counts}
    tally["passed"] = tally["tests"] - tally["failures"] - tally["errors"] - tally["skipped"]
    return {
        "session": session,
        "python": python,
        "wrapt": wrapt,
        "torch": torch,
        "namespaces": namespaces,
        "counts": tally,
    }


def generate(tmp_path: Path, records: list[dict]) -> str:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    for rec in records:
        (results / f"{rec['session']}.json").write_text(json.dumps(rec))
    out = tmp_path / "compatibility.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "compat_table.py"), str(results), str(out), *(r["session"] for r in records)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of the main table's rows (the first table after the header line), the session's cell
    ``NAME (torch VERSION)`` as two: name and torch."""
    lines = markdown.split("| Session (torch) |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    return [[*row[0].removesuffix(")").split(" (torch ", 1), *row[1:]] for row in rows]


RECOMPUTE_TARGETS = (  # the recompute fix's targets, as status names them
    "torch.utils.checkpoint.CheckpointFunction.forward",
    "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
    "FSDPStrategy.setup_environment",
)
RECOMPUTE = "recompute: `torch.utils.checkpoint`, `FSDPStrategy.setup_environment`"
MIXED = record(
    "mixed-2.4.0",
    [
        namespace("lightning.fabric", "2.4.0", ("FSDPPrecision.convert_module",), RECOMPUTE_TARGETS),
        namespace("lightning.pytorch", "2.4.0", ("FSDPPrecision.convert_module",), RECOMPUTE_TARGETS),
        namespace("lightning_fabric", "2.6.6", recompute=RECOMPUTE_TARGETS),
        namespace("pytorch_lightning", "2.6.6", recompute=RECOMPUTE_TARGETS),
    ],
    tests=228,
    skipped=2,
)


def test_one_row_per_release_and_layout_with_its_torch_each_fix_and_python_and_wrapt_below(tmp_path: Path) -> None:
    records = [
        MIXED,
        record(
            "lightning-2.1.0",
            [
                namespace("lightning.fabric", "2.1.0", ("FSDPPrecision.convert_module",), RECOMPUTE_TARGETS),
                namespace(
                    "lightning.pytorch",
                    "2.1.0",
                    ("FSDPPrecisionPlugin.convert_module", "FSDPStrategy.connect", "FSDPStrategy.setup"),
                    RECOMPUTE_TARGETS,
                ),
            ],
            wrapt="1.17.3",
        ),
        record(
            "lightning-2.4.0-torch-2.4.1",
            [namespace("pytorch_lightning", "2.4.0", ("FSDPPrecision.convert_module",), RECOMPUTE_TARGETS)],
            torch="2.4.1",
        ),
        record(
            "mixed-2.4.0-torch-2.15.0",
            [namespace("lightning.pytorch", "2.4.0", ("FSDPPrecision.convert_module",), RECOMPUTE_TARGETS)],
            torch="2.15.0",
            python="3.12.1",
        ),
        record("lightning-2.0.9", [namespace("lightning.pytorch", "2.0.9"), namespace("lightning.fabric", "2.0.9")]),
        record("no-lightning", []),
    ]
    markdown = generate(tmp_path, records)
    cast = f"cast: `FSDPPrecision.convert_module`; {RECOMPUTE}"
    assert table_rows(markdown) == [
        ["mixed-2.4.0", "2.13.0+cpu", "`lightning` 2.4.0", cast, cast, "226 / 2 / 0: pass"],
        [
            "mixed-2.4.0",
            "2.13.0+cpu",
            "`pytorch_lightning`, `lightning_fabric` 2.6.6",
            RECOMPUTE,
            RECOMPUTE,
            "226 / 2 / 0: pass",
        ],
        [
            "lightning-2.1.0",
            "2.13.0+cpu",
            "`lightning` 2.1.0",
            f"cast: `FSDPPrecisionPlugin.convert_module`, `FSDPStrategy.connect`, `FSDPStrategy.setup`; {RECOMPUTE}",
            cast,
            "8 / 2 / 0: pass",
        ],
        # Only the Trainer namespace of that layout imported: the Fabric cell says so.
        [
            "lightning-2.4.0-torch-2.4.1",
            "2.4.1",
            "`pytorch_lightning`, `lightning_fabric` 2.4.0",
            cast,
            "not installed",
            "8 / 2 / 0: pass",
        ],
        ["mixed-2.4.0-torch-2.15.0", "2.15.0", "`lightning` 2.4.0", cast, "not installed", "8 / 2 / 0: pass"],
        ["lightning-2.0.9", "2.13.0+cpu", "`lightning` 2.0.9", "untouched", "untouched", "8 / 2 / 0: pass"],
        ["no-lightning", "2.13.0+cpu", "(no Lightning)", "-", "-", "8 / 2 / 0: pass"],
    ]
    header = markdown.split("| Session (torch) |", 1)[1].splitlines()[0]
    assert "wrapt" not in header
    assert (
        "**Versions.** Every session ran on Python 3.11.7 and wrapt 2.5.2, except `lightning-2.1.0`: wrapt 1.17.3; "
        "`mixed-2.4.0-torch-2.15.0`: Python 3.12.1." in markdown
    )


def test_failures_are_loud(tmp_path: Path) -> None:
    records = [
        record(
            "lightning-2.2.5",
            [namespace("lightning.pytorch", "2.2.5", cast=True, recompute=RECOMPUTE_TARGETS)],
            failures=1,
        ),
        {"session": "broken", "error": "Traceback ...", "counts": record("x", [])["counts"]},
    ]
    rows = table_rows(generate(tmp_path, records))
    assert rows == [
        [
            "lightning-2.2.5",
            "2.13.0+cpu",
            "`lightning` 2.2.5",
            f"cast: **affected, not patched**; {RECOMPUTE}",
            "not installed",
            "7 / 2 / 1: **FAIL**",
        ],
        ["broken", "?", "probe failed", "-", "-", "8 / 2 / 0: **FAIL**"],
    ]


def test_the_committed_table_has_the_generators_format() -> None:
    """docs/compatibility.md is written by the generator: its prose and footer are the generator's, and
    every row has the generator's six cells, so the next matrix run changes figures, not the layout."""
    committed = (ROOT / "docs" / "compatibility.md").read_text()
    assert committed.startswith(compat_table.HEADER)
    assert committed.endswith(compat_table.FOOTER)
    rows = table_rows(committed)
    assert rows and all(len(row) == 6 for row in rows)
    sessions = {row[0]: row[1] for row in rows}
    assert {"mixed-2.4.0", "no-lightning"} <= sessions.keys()
    # Every session of OTHER_TORCH is in the table, on the torch it names.
    others = {name: other.torch for name, other in noxfile().OTHER_TORCH.items()}
    assert {name: sessions.get(name, "").split("+")[0] for name in others} == others
    assert "**Versions.** Every session ran on Python " in committed


def test_a_record_that_matrix_status_writes_here(tmp_path: Path) -> None:
    """The real probe of this environment, through the generator: one row per installed layout, with the
    versions and targets the shim reports."""
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuite tests="3" failures="0" errors="0" skipped="1"></testsuite>')
    results = tmp_path / "results"
    results.mkdir()
    subprocess.run(
        [sys.executable, str(SCRIPTS / "matrix_status.py"), "here", str(results / "here.json"), str(junit)], check=True
    )
    rec = json.loads((results / "here.json").read_text())
    assert "error" not in rec, rec.get("error")
    rows = table_rows(generate(tmp_path, [rec]))
    imported = [n for n in rec["namespaces"] if n["imported"]]
    if not imported:
        assert rows == [["here", rec["torch"], "(no Lightning)", "-", "-", "2 / 1 / 0: pass"]]
        return
    cells = " ".join(" ".join(row) for row in rows)
    for status in imported:
        assert status["version"] in cells
        for fix in status["fixes"]:
            for target in fix["targets"]:
                assert compat_table.short_name(target) in cells


# ----------------------------------------------------------------------------- the noxfile
@functools.cache
def noxfile() -> Any:
    """noxfile.py as a module, loaded once (it registers its sessions with nox; it needs nox: the
    environment that runs nox has it). Loading it may make a pyenv version active (``find_python``):
    this process's environment is put back as it was."""
    pytest.importorskip("nox")
    before = dict(os.environ)
    try:
        spec = importlib.util.spec_from_file_location("fsdp_shim_noxfile", ROOT / "noxfile.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # for its dataclass
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(before)
    return module


def test_every_release_of_the_default_session_runs_its_per_release_tests_in_another_session() -> None:
    """Every other-torch session is in the matrix run, on a pinned torch; the default session skips the
    per_release tests, so each of its Lightning releases is installed by another session of the run."""
    nox_module = noxfile()
    import nox

    for name, other in nox_module.OTHER_TORCH.items():
        assert name in nox_module.MATRIX and f"tests-{name}" in nox.options.sessions, name
        assert other.torch.count(".") == 2, other  # a release, pinned exactly

    def releases(specs: list[str]) -> set[str]:
        pairs = (spec.partition("==") for spec in specs)
        return {version for package, _, version in pairs if package in ("lightning", "pytorch-lightning")}

    default = nox_module.DEFAULT_SESSION
    others = [
        specs
        for name, specs in nox_module.MATRIX.items()
        if name != default and f"tests-{name}" in nox.options.sessions
    ]
    assert releases(nox_module.MATRIX[default]) <= set().union(*map(releases, others))


def test_the_docs_extra_names_the_versions_that_the_docs_lock_pins() -> None:
    """pyproject.toml's docs extra (what a reader installs to build the docs) pins each tool exactly, at
    the version of .ci/requirements-docs.txt (the lock CI installs): a version changed in one of them
    only would build and measure another site than CI does."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extra = [
        Requirement(spec)
        for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    ]
    lock = [
        Requirement(line)
        for line in (ROOT / ".ci" / "requirements-docs.txt").read_text().splitlines()
        if line[:1].isalnum()
    ]
    locked = {requirement.name: str(requirement.specifier) for requirement in lock}
    assert all(str(tool.specifier).startswith("==") for tool in extra), extra
    assert {tool.name: str(tool.specifier) for tool in extra} == {tool.name: locked.get(tool.name) for tool in extra}


FAKE_PYENV = """#!/bin/sh
case "$1" in
  versions) printf '3.11.7\\n3.99.2\\n3.99.10\\n3.99.3rc1\\n3.990.1\\n' ;;
  version-name) echo "${PYENV_VERSION:-3.11.7}" ;;
esac
"""


@pytest.mark.parametrize(
    ("shim_works", "pyenv_version"),
    [(True, None), (False, "3.11.7:3.99.10")],
    ids=["on-path", "pyenv-inactive"],
)
def test_find_python_uses_the_one_on_path_or_makes_pyenvs_newest_patch_active(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shim_works: bool, pyenv_version: str | None
) -> None:
    """A ``pythonX.Y`` that runs is nox's to find; a pyenv shim of an inactive version fails, and the
    newest installed patch release of that version is added to the active ones."""
    find_python = noxfile().find_python
    (tmp_path / "pyenv").write_text(FAKE_PYENV)
    (tmp_path / "python3.99").write_text(f"#!/bin/sh\nexit {0 if shim_works else 127}\n")
    for tool in tmp_path.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PYENV_VERSION", raising=False)
    assert find_python("3.99") == "3.99"
    assert os.environ.get("PYENV_VERSION") == pyenv_version
    monkeypatch.delenv("PYENV_VERSION", raising=False)
    assert find_python("3.98") == "3.98"  # pyenv has none: nox's uv backend downloads it
    assert "PYENV_VERSION" not in os.environ


# ----------------------------------------------------------------------------- .ci/run, interrupted
INTERRUPTED_COMMAND = """
import subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
(out / "child").write_text(str(child.pid))
try:
    (out / "started").write_text("")
    time.sleep(300)
finally:
    time.sleep(0.5)  # a cleanup that takes a moment, as stopping daemons does
    (out / "cleaned-up").write_text("")
"""


@pytest.mark.parametrize(
    ("to", "signal_number", "status"),
    [("shell", signal.SIGTERM, 143), ("group", signal.SIGINT, 130), ("group", signal.SIGTERM, 143)],
    ids=["SIGTERM to the shell", "Ctrl-C", "SIGTERM to the group"],
)
def test_ci_run_interrupts_the_test_command_as_ctrl_c_does_and_waits_for_its_cleanup(
    tmp_path: Path, to: str, signal_number: int, status: int
) -> None:
    """``.ci/run`` runs the test command with ``run_interruptibly`` (.ci/interruptible.sh): SIGTERM to its shell,
    or Ctrl-C or SIGTERM to its process group (a terminal, a CI timeout), reaches the command as Ctrl-C does, so
    its ``finally`` runs (where nox's cluster session stops its SLURM daemons) and what it started ends; the
    shell returns 130 or 143 only after that. Started as a terminal starts it: SIGINT at its default."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_COMMAND)
    command = shlex.join([sys.executable, str(script), str(tmp_path)])
    shell = f". {shlex.quote(str(ROOT / '.ci' / 'interruptible.sh'))} && run_interruptibly {shlex.quote(command)}"
    proc = subprocess.Popen(
        ["bash", "-c", shell],
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stderr=subprocess.DEVNULL,  # the command's KeyboardInterrupt traceback
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "started").exists()
    (os.kill if to == "shell" else os.killpg)(proc.pid, signal_number)
    assert proc.wait(timeout=60) == status
    assert (tmp_path / "cleaned-up").exists()
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


# ----------------------------------------------------------------------------- hang protection
HANGING_TEST = """
import subprocess, sys, time
from pathlib import Path

def test_waits_for_a_peer_that_died(tmp_path):
    child = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[1], 'w').write(str(g.pid)); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, PIDS])
    proc.wait()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the cleanup reads /proc")
def test_a_hanging_test_fails_by_name_and_its_processes_are_killed(tmp_path: Path) -> None:
    pids = tmp_path / "grandchild.pid"
    (tmp_path / "test_hang.py").write_text(f"PIDS = {str(pids)!r}\n" + HANGING_TEST)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "process_cleanup", "--timeout", "5"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        timeout=120,
    )
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "FAILED test_hang.py::test_waits_for_a_peer_that_died" in proc.stdout
    assert "Timeout" in proc.stdout
    assert took < 60, took
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(grandchild), f"grandchild {grandchild} outlived the timed-out test"


# ----------------------------------------------------------------------------- the demo-Transformer benchmark
SCRIPT = ROOT / "benchmarks" / "demo_transformer.py"
FOLDERS = {"2.4": ROOT / ".matrix" / "mixed-2.4.0", "2.6": ROOT / ".matrix" / "lightning-2.6.6"}
BYTES = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
STEPS = 3


def lightning_folder(line: str) -> Path:
    folder = FOLDERS[line]
    if not list(folder.glob(f"lightning-{line}.*.dist-info")):
        pytest.skip(f"needs lightning {line}.x installed in {folder} (pip install --no-deps --target {folder} ...)")
    return folder


def test_demo_transformer_small(tmp_path: Path) -> None:
    folders = {line: lightning_folder(line) for line in FOLDERS}
    out = tmp_path / "demo.json"
    command = [sys.executable, str(SCRIPT), "--size", "small", "--steps", str(STEPS), "--json", str(out)]
    command += ["--lightning-2.4", str(folders["2.4"]), "--lightning-2.6", str(folders["2.6"])]
    run_command(command, check=True)
    runs = {key: run["ranks"][0] for key, run in json.loads(out.read_text())["runs"].items()}

    for suffix in ("", "-ckpt"):
        off, on, fixed = runs[f"2.4-off{suffix}"], runs[f"2.4-on{suffix}"], runs[f"2.6-off{suffix}"]
        assert off["lightning"].startswith("2.4.") and on["lightning"] == off["lightning"]
        assert fixed["lightning"].startswith("2.6.")
        # 2.4.0 without the shim keeps the float32 model: twice the bytes of the shim's run.
        assert off["flat_param_dtypes"] == ["torch.float32"]
        for key in BYTES:
            assert off[key] == 2 * on[key] > 0, key
        # The shim gives what Lightning's own fix gives.
        for key in ("flat_param_dtypes", "module_dtype", *BYTES):
            assert on[key] == fixed[key], key
        assert not off["shim"]["active"] and not fixed["shim"]["active"]
        assert on["shim"]["patched"]

    for run in ("2.4-off", "2.4-on", "2.6-off"):
        plain, checkpointed = runs[run], runs[f"{run}-ckpt"]
        assert checkpointed["checkpointed_layers"] > 0 == plain["checkpointed_layers"], run
        for key in ("flat_param_dtypes", "module_dtype", *BYTES, "losses"):
            assert checkpointed[key] == plain[key], (run, key)  # the demo's blocks give every tensor a dtype

    for key, result in runs.items():
        assert len(result["losses"]) == STEPS and all(math.isfinite(loss) for loss in result["losses"]), key


# ----------------------------------------------------------------------------- the version, from git
def test_a_tagged_commit_builds_its_version_and_the_next_commit_a_development_version(tmp_path: Path) -> None:
    """hatch-vcs: a clone whose commit is tagged ``v7.7.7`` builds 7.7.7 (the wheel's name and the
    ``_fsdp_shim._version`` that ``--version``, status and the confirmation line read); one commit later it
    builds a development version of the next release, which says so (``7.7.8.dev1+g<commit>``)."""
    import re
    import shutil
    import zipfile

    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None or not (ROOT / ".git").exists():
        pytest.skip("needs uv and this checkout's git history (an unpacked sdist has none)")
    head = run_command(["git", "rev-parse", "HEAD"], check=True).stdout.strip()
    clone = tmp_path / "clone"
    run_command(["git", "clone", "-q", "--no-checkout", str(ROOT), str(clone)], check=True)
    git = ["git", "-C", str(clone), "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    run_command([*git, "checkout", "-q", head], check=True)
    run_command([*git, "tag", "v7.7.7"], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETUPTOOLS_SCM_PRETEND_VERSION")}

    def built_version(out: Path) -> tuple[str, str]:
        run_command([uv, "build", "-q", "--wheel", "--out-dir", str(out), str(clone)], env=env, check=True)
        (wheel,) = out.glob("fsdp_shim-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            module = archive.read("_fsdp_shim/_version.py").decode()
        return wheel.name.split("-")[1], re.search(r'__version__ = "([^"]+)"', module).group(1)

    assert built_version(tmp_path / "tagged") == ("7.7.7", "7.7.7")
    run_command([*git, "commit", "-q", "--allow-empty", "-m", "one commit after the tag"], check=True)
    commit = run_command([*git, "rev-parse", "HEAD"], check=True).stdout.strip()
    name, module = built_version(tmp_path / "next")
    assert name == module and module.startswith("7.7.8.dev1+g"), (name, module)
    assert commit.startswith(module.split("+g", 1)[1]), (module, commit)  # the commit it was built from
