"""Activation at interpreter start, each in fresh interpreters: ``FSDP_SHIM=1`` through the
``fsdp_shim_env.pth`` that pip installs with the package, the files ``fsdp-shim install`` writes, and
``fsdp-shim run``; their combinations with ``import fsdp_shim``, a user's own ``sitecustomize``,
``FSDP_SHIM=0``, strict mode, odd ``PYTHONPATH``s and ``python -I/-E/-S``; what pip and uv install
and remove.

Start-up activation never imports the public ``fsdp_shim`` package: the start-up module
(``_fsdp_shim/__init__.py``, or ``install``'s copy of it) arms one finder, which hands each executed
Lightning namespace over to ``_fsdp_shim.activation``. So "the shim loaded" is
``"_fsdp_shim.activation" in sys.modules`` here (``tests/children/startup.py``).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    ROOT,
    SCENARIO,
    Layout,
    PipVenv,
    Venv,
    affected_layout,
    child_json,
    clean_env,
    free_port,
    installed_versions,
    last_json,
    make_venv,
    run_child,
    run_command,
    run_on_a_free_port,
    scenario_results,
    torchrun,
)

import _fsdp_shim as startup
from _fsdp_shim.config import FIXES, LIGHTNING_PACKAGES
from _fsdp_shim.run import BOOTSTRAP_DIRECTORY
from _fsdp_shim.startup_files import (
    COPY_FILE,
    ENVIRONMENT_FILE,
    MARKER,
    PTH_NAME,
    START_NAME,
    file_texts,
    site_directories,
)

CHILD = str(ROOT / "tests" / "child.py")
FINDER = "fsdp_shim_finder"
HAS_ENVIRONMENT_FILE = any((d / ENVIRONMENT_FILE).is_file() for d in site_directories())
RUN_SOURCES = [startup.ENVIRONMENT_SOURCE.format("1"), "fsdp-shim run"] if HAS_ENVIRONMENT_FILE else ["fsdp-shim run"]
"""How `fsdp-shim run` arms this interpreter: FSDP_SHIM=1 through the start-up file pip installed with
the package (read first, at site-packages time), then the bootstrap sitecustomize."""


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    """A new virtual environment that imports this checkout and this environment's packages but has
    no start-up file of fsdp-shim's: what arms the shim in it is only what a test puts there."""
    return make_venv(tmp_path / "venv")


def probe_in(
    venv: Venv,
    *python_args: str,
    env: dict[str, str] | None = None,
    target: str = "probe",
    arguments: dict[str, Any] | None = None,
    cwd: Path = ROOT,
) -> Any:
    return last_json(
        venv.run(*python_args, CHILD, f"children.startup:{target}", json.dumps(arguments or {}), env=env, cwd=cwd)
    )


def shim_cli(*args: str) -> list[str]:
    """``python -m fsdp_shim ARGS`` with this interpreter (the launcher shows up as such in argv)."""
    return [sys.executable, "-m", "fsdp_shim", *args]


def with_pythonpath(env: dict[str, str], first: Path) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(first), env.get("PYTHONPATH", "")]))
    return env


def pythonpath_entries() -> list[str]:
    return [p for p in clean_env().get("PYTHONPATH", "").split(os.pathsep) if p]


def every_namespace_patched(probe: dict[str, Any], layouts: dict[str, Layout]) -> None:
    """Every installed namespace was imported and handed over, and each one whose release lacks a fix
    has it in effect (the expectation comes from the fixes' release gates, not from the run)."""
    versions = installed_versions(layouts)
    assert probe["versions"] == versions
    expected = {name: any(fix.affects(version) for fix in FIXES) for name, version in versions.items()}
    assert any(expected.values())
    assert probe["patched"] == expected, probe["reasons"]


# ----------------------------------------------------------------------------- the start-up module
@pytest.mark.per_python
def test_the_startup_file_imports_a_verbatim_copy_of_the_startup_module() -> None:
    """What ``fsdp-shim install``'s ``.pth`` runs is ``_fsdp_shim/__init__.py`` as linted and tested:
    the copy it imports holds that module's source after comment lines that start with the marker,
    the ``.pth``'s one code line is a bare import of the copy (which arms itself because of the name it
    is imported under), and the PEP 829 file names the copy's ``arm``."""
    texts = file_texts()
    assert list(texts) == [COPY_FILE, PTH_NAME, START_NAME]
    source = Path(startup.__file__).read_text(encoding="utf-8")
    header, _, body = texts[COPY_FILE].partition('"""')
    assert '"""' + body == source
    assert header.startswith(MARKER) and all(line.startswith("#") for line in header.splitlines())
    assert all(text.startswith(MARKER) for text in texts.values())
    code_lines = [line for line in texts[PTH_NAME].splitlines() if not line.startswith("#")]
    assert code_lines == [f"import {startup.COPY_NAME}"]
    assert [line for line in texts[START_NAME].splitlines() if not line.startswith("#")] == [f"{startup.COPY_NAME}:arm"]


@pytest.mark.per_python
def test_the_copy_arms_itself_only_under_its_own_name(tmp_path: Path) -> None:
    """Imported as ``install``'s copy (or through its PEP 829 entry point), the start-up module puts its
    finder first on ``sys.meta_path`` and records the start-up file once; imported under any other name
    (as ``_fsdp_shim``, by ``fsdp_shim_env.pth`` where ``FSDP_SHIM`` is unset, by the CLI, by the shim) it
    arms nothing by itself."""
    copy = file_texts()[COPY_FILE]
    (tmp_path / COPY_FILE).write_text(copy, encoding="utf-8")
    (tmp_path / "_fsdp_shim").mkdir()
    (tmp_path / "_fsdp_shim" / "__init__.py").write_text(copy, encoding="utf-8")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = len(sys.meta_path); "
        "import importlib; module = importlib.import_module(sys.argv[2]); "
        "print(len(sys.meta_path) - before, sys.meta_path[0] is module.fsdp_shim_finder, module.ARMED_BY)"
    )
    probe_armed = f"print(sys.modules[{startup.COPY_NAME!r}].ARMED_BY)"
    outputs = {}
    for name in (startup.COPY_NAME, "_fsdp_shim"):
        command = [sys.executable, "-S", "-c", probe, str(tmp_path), name]
        outputs[name] = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split(None, 2)
    assert outputs == {startup.COPY_NAME: ["1", "True", "['startup file']\n"], "_fsdp_shim": ["0", "False", "[]\n"]}
    # Python 3.15+ runs install's PEP 829 entry point instead (site: pkgutil.resolve_name, then the call),
    # which imports the copy and calls its arm(): still the one start-up file on record, FSDP_SHIM unset.
    entry = f"{startup.COPY_NAME}:arm"
    run_entry = f"import pkgutil, sys; sys.path.insert(0, sys.argv[1]); pkgutil.resolve_name({entry!r})()"
    run_entry += f"; {probe_armed}"
    env = {key: value for key, value in os.environ.items() if key != startup.SHIM_VARIABLE}
    command = [sys.executable, "-S", "-c", run_entry, str(tmp_path)]
    assert subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout == "['startup file']\n"


@pytest.mark.per_python
def test_the_module_every_interpreter_imports_runs_almost_nothing_at_import() -> None:
    """``_fsdp_shim/__init__.py`` is imported at every start where a start-up activation arms the
    shim: at import it imports only ``sys``, defines functions and no class (``FSDPShimWarning`` is
    made by the module's ``__getattr__`` at its first use: a class costs an armed start more than the
    rest of the module), calls nothing, and in ``install``'s copy arms itself (docs/benchmarks.md)."""
    tree = ast.parse(Path(startup.__file__).read_text(encoding="utf-8"))
    *body, last = tree.body
    assert {type(node) for node in body} <= {ast.Expr, ast.Import, ast.Assign, ast.FunctionDef}
    assert [alias.name for node in body if isinstance(node, ast.Import) for alias in node.names] == ["sys"]
    assert not [node for node in body if isinstance(node, ast.ImportFrom)]
    assert "__getattr__" in [node.name for node in body if isinstance(node, ast.FunctionDef)]
    assert startup.FSDPShimWarning is startup.FSDPShimWarning and issubclass(startup.FSDPShimWarning, RuntimeWarning)
    top_level = [node for node in body if not isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert not [node for statement in top_level for node in ast.walk(statement) if isinstance(node, ast.Call)]
    assert ast.unparse(last) == "if __name__ == COPY_NAME:\n    arm(INSTALLED_SOURCE)"


@pytest.mark.per_python
def test_the_bootstraps_fallback_reads_strict_like_the_startup_module_and_the_table_from_its_source() -> None:
    """Where ``fsdp-shim run``'s bootstrap cannot arm the shim, its finder raises at a Lightning import
    exactly where the start-up module's parser calls ``FSDP_SHIM_STRICT`` on (or unreadable), and it
    takes the Lightning packages from the start-up module's source, the one table, since it cannot
    import that module there."""
    values = ["", "1", "on", "maybe", "0", "no", "DISABLED", " off "]
    result = child_json("startup:bootstrap_fallback", {"values": values})
    assert result["raised"] == result["strict"]
    assert sorted(set(result["raised"].values())) == [False, True]
    assert result["packages_from_source"] == sorted(LIGHTNING_PACKAGES)


@pytest.mark.per_python
def test_python_m_fsdp_shim_never_arms_its_own_process_and_another_module_run_with_m_does(tmp_path: Path) -> None:
    """``python -m fsdp_shim`` imports the package before it runs the command, which must arm nothing, on every
    Python (3.9 has no ``sys.orig_argv``: there the check asks runpy). A module run with ``-m`` whose package
    imports fsdp_shim activates, also where that module's own arguments are ``-m fsdp_shim``."""
    hook = tmp_path / "hook"
    (hook / "trainer_package").mkdir(parents=True)
    (hook / "sitecustomize.py").write_text("from children.activation import report_at_exit\n\nreport_at_exit()\n")
    (hook / "trainer_package" / "__init__.py").write_text("import fsdp_shim  # noqa: F401\n")
    (hook / "trainer_package" / "__main__.py").write_text("")
    base = clean_env()
    paths = [str(hook), str(ROOT / "tests"), *filter(None, [base.get("PYTHONPATH")])]
    armed = {}
    for command in (
        ["-m", "fsdp_shim", "--version"],
        ["-mfsdp_shim", "--version"],
        ["-W", "ignore", "-m", "fsdp_shim", "status", "--json"],
        ["-m", "trainer_package", "-m", "fsdp_shim"],
        ["-c", "import fsdp_shim"],
    ):
        report = tmp_path / "report.json"
        env = {**base, "PYTHONPATH": os.pathsep.join(paths), "CHILD_REPORT_FILE": str(report)}
        run_command([sys.executable, *command], env=env, cwd=tmp_path, check=True)
        armed[" ".join(command)] = json.loads(report.read_text())["armed_by"]
    assert armed == {
        "-m fsdp_shim --version": [],
        "-mfsdp_shim --version": [],
        "-W ignore -m fsdp_shim status --json": [],
        "-m trainer_package -m fsdp_shim": ["import fsdp_shim"],
        "-c import fsdp_shim": ["import fsdp_shim"],
    }, sys.version


# ----------------------------------------------------------------------------- specs and loaders (issue 26, item 3)
@pytest.fixture(scope="module")
def specs_without_the_shim() -> dict[str, Any]:
    """Lightning's specs and loaders as this interpreter gives them with no shim armed."""
    result = child_json("startup:specs_and_loaders")
    assert result["probe"]["loaded"] is False and result["probe"]["finder_count"] == 0
    return result


@pytest.fixture(scope="module")
def pip_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> PipVenv:
    """A virtual environment with the wheel installed by pip, as users have it; tests only read it."""
    return PipVenv(tmp_path_factory.mktemp("pip") / "venv", wheel)


@pytest.mark.parametrize("activation", ["FSDP_SHIM=1", "fsdp-shim install", "fsdp-shim run"])
def test_find_spec_and_the_loaders_are_lightnings_own_under_every_startup_activation(
    activation: str,
    specs_without_the_shim: dict[str, Any],
    pip_venv: PipVenv,
    tmp_path: Path,
    layouts: dict[str, Layout],
) -> None:
    """Under each start-up activation, before Lightning is imported, ``find_spec`` for every package and
    namespace gives the spec and loader type it gives without the shim, and the loader answers
    ``get_filename``, ``is_package``, ``get_code``, ``get_source`` and ``get_resource_reader`` alike;
    ``pkgutil.get_data`` (which imports the package) reads the file's bytes; afterwards each module's
    ``__loader__`` is its spec's loader, Lightning's own, with nothing of the shim's left on it; and
    the shim patched every namespace all the same. (It used to wrap the loader in a function of its
    own, which pkgutil and every loader method saw.)"""
    affected_layout(layouts, "lightning")
    if activation == "FSDP_SHIM=1":  # through the fsdp_shim_env.pth pip installed
        python, launcher, env = pip_venv.python, [], clean_env(FSDP_SHIM="1")
        sources = [startup.ENVIRONMENT_SOURCE.format("1")]
    elif activation == "fsdp-shim install":
        venv = make_venv(tmp_path / "venv")
        venv.run("-m", "fsdp_shim", "install")
        python, launcher, env, sources = venv.python, [], clean_env(), ["startup file"]
    else:  # a Python without fsdp_shim_env.pth: only the bootstrap arms it
        python, launcher, env, sources = (
            make_venv(tmp_path / "venv").python,
            shim_cli("run"),
            clean_env(),
            ["fsdp-shim run"],
        )
    result = last_json(
        run_command([*launcher, python, CHILD, "children.startup:specs_and_loaders"], env=env, check=True)
    )
    assert result["probe"]["sources"] == sources
    assert result["probe"]["finder_count"] == 1 and result["probe"]["shim_warnings"] == []
    assert result["before"] == specs_without_the_shim["before"]
    assert set(installed_versions(layouts)) <= set(result["before"])
    assert result["data"] == specs_without_the_shim["data"]
    assert all(data["pkgutil"] == data["file"] for data in result["data"].values())
    assert result["after"] == specs_without_the_shim["after"]
    assert all(
        after["loader_is_spec_loader"] and not after["exec_module_shadowed"] for after in result["after"].values()
    )
    every_namespace_patched(result["probe"], layouts)
    assert result["probe"]["shim_layers"] == 1


# ----------------------------------------------------------------------------- fsdp-shim install's files
@pytest.mark.per_python
def test_install_is_idempotent_and_uninstall_leaves_a_clean_interpreter(venv: Venv) -> None:
    """Install writes its three files (and compiles the copy), a second install changes nothing and
    still leaves one finder; the start-up files print nothing; uninstall removes every file and the
    copy's ``.pyc``, and the next interpreter has exactly the modules and finders of one that never
    had them. (That the installed files hand Lightning to the shim: the specs-and-loaders test.)"""
    texts = file_texts()
    never = probe_in(venv, target="modules_and_finders")
    first = venv.run("-m", "fsdp_shim", "install")
    assert {name: (venv.site_packages / name).read_text() for name in texts} == texts
    assert list((venv.site_packages / "__pycache__").glob(f"{startup.COPY_NAME}.*.pyc"))  # compiled by install
    assert first.stdout.count("wrote ") == len(texts) == 3
    second = venv.run("-m", "fsdp_shim", "install")
    assert second.stdout.count("already installed") == 3 and "wrote" not in second.stdout
    quiet = venv.run("-c", "pass")
    assert quiet.stderr == "" and quiet.stdout == ""
    assert probe_in(venv, target="modules_and_finders")[1].count(FINDER) == 1

    removed = venv.run("-m", "fsdp_shim", "uninstall")
    assert removed.stdout.count("removed ") == 3
    assert not [name for name in texts if (venv.site_packages / name).exists()]
    assert not list((venv.site_packages / "__pycache__").glob(f"{startup.COPY_NAME}.*"))
    clean = venv.run("-c", "pass")
    assert clean.stderr == "" and clean.stdout == ""
    assert probe_in(venv, target="modules_and_finders") == never
    assert "nothing to remove" in venv.run("-m", "fsdp_shim", "uninstall").stdout


@pytest.mark.per_python
def test_the_startup_file_imports_one_small_module_and_puts_one_finder_first(venv: Venv) -> None:
    """What every interpreter pays for the start-up file: one module (the copy, from its ``.pyc``;
    it imports only ``sys``) and one finder in front of the others, even though site reads a venv's
    start-up files twice."""
    without, finders_without = probe_in(venv, target="modules_and_finders")
    venv.run("-m", "fsdp_shim", "install")
    with_file, finders_with = probe_in(venv, target="modules_and_finders")
    assert set(with_file) - set(without) == {startup.COPY_NAME}
    assert set(without) <= set(with_file)
    assert finders_with == [FINDER, *finders_without]


def test_a_startup_file_left_behind_by_a_removed_package_is_silent(
    venv: Venv, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """What ``pip uninstall fsdp-shim`` leaves: ``install``'s files, and no importable shim. The copy's
    finder finds nothing to hand Lightning to and says nothing: no output at start, none at Lightning's
    import (run outside the checkout, whose folder would otherwise be importable as the current one)."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    venv.paths_file.write_text(f"{sysconfig.get_paths()['purelib']}\n")
    proc = venv.run("-c", "pass", cwd=tmp_path)
    assert proc.stdout == "" and proc.stderr == ""
    code = (
        "import sys, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import lightning\n"
        "print(sorted(m for m in sys.modules if 'fsdp_shim' in m),\n"
        "      [str(w.message) for w in caught if 'fsdp' in str(w.message)])"
    )
    imported = venv.run("-c", code, cwd=tmp_path)
    assert imported.stdout.strip() == f"[{startup.COPY_NAME!r}] []", imported.stdout
    assert imported.stderr == "", imported.stderr  # whole: a path in a message may contain "fsdp"


# ----------------------------------------------------------------------------- fsdp-shim run
@pytest.fixture
def user_sitecustomize(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A user's own sitecustomize (module or package form) that counts its runs in a file, adds a
    folder to sys.path as HPC sites do, and marks itself."""
    folder = tmp_path / "user_site"
    counter = tmp_path / "count.txt"
    extra = tmp_path / "site_extra"
    extra.mkdir()
    (extra / "site_extra_module.py").write_text("VALUE = 1\n")
    # One line per run: (pid, command line). `fsdp-shim run` execs, so the launcher and the command
    # share a pid and differ in their command line; a process that ran it twice repeats a line. The
    # command line from /proc: Python 3.9 has no sys.orig_argv.
    body = (
        "import os, sys\n"
        f"with open({str(counter)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {open(\"/proc/self/cmdline\").read().split(chr(0))!r}\\n')\n"
        f"sys.path.insert(0, {str(extra)!r})\n"
        "USER_MARKER = 'the user sitecustomize'\n"
    )
    if getattr(request, "param", "module") == "package":
        (folder / "sitecustomize").mkdir(parents=True)
        (folder / "sitecustomize" / "__init__.py").write_text(body)
    else:
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(body)
    return folder, counter


def assert_each_process_ran_it_once(counter: Path, expected_processes: int) -> None:
    """Every interpreter involved (each `fsdp-shim run` launcher, then the command) ran it once."""
    lines = counter.read_text().splitlines()
    assert len(lines) == len(set(lines)) == expected_processes, lines
    argvs = [ast.literal_eval(line.partition(" ")[2]) for line in lines]
    assert sum(argv[1:3] == ["-m", "fsdp_shim"] for argv in argvs) == expected_processes - 1
    assert sum(argv[1].endswith("child.py") for argv in argvs) == 1


@pytest.mark.per_python
@pytest.mark.parametrize("user_sitecustomize", ["module", "package"], indirect=True)
@pytest.mark.parametrize("nested", [False, True], ids=["run", "run-run"])
def test_run_arms_and_chains_the_users_sitecustomize_once_keeping_its_sys_path_and_name(
    user_sitecustomize: tuple[Path, Path], nested: bool, tmp_path: Path
) -> None:
    """Under `fsdp-shim run` (nested too), the user's sitecustomize runs once per process, after the
    bootstrap armed the shim; entries it adds to sys.path stay, `import sitecustomize` gives the user's
    module, and only the bootstrap folder leaves sys.path."""
    folder, counter = user_sitecustomize
    prefix = shim_cli("run") + (shim_cli("run") if nested else [])
    result = child_json(
        "startup:interpreter_state",
        {"module": "site_extra_module"},
        launcher=tuple(prefix),
        env=with_pythonpath(clean_env(), folder),
    )
    assert result["shim_sources"] == RUN_SOURCES
    assert result["finders"].count(FINDER) == 1
    assert result["imported"] == "site_extra_module"
    assert str(tmp_path / "site_extra") in result["sys_path"]
    assert result["sitecustomize_marker"] == "the user sitecustomize"
    assert all(os.path.realpath(entry or ".") != BOOTSTRAP_DIRECTORY for entry in result["sys_path"])
    assert_each_process_ran_it_once(counter, expected_processes=3 if nested else 2)


@pytest.mark.parametrize("user_sitecustomize", ["package"], indirect=True)
def test_run_with_a_users_sitecustomize_patches_lightning_once(
    user_sitecustomize: tuple[Path, Path], layouts: dict[str, Layout]
) -> None:
    """Nested `fsdp-shim run` with a user's sitecustomize: Lightning is handed over and patched, with
    one layer of the shim's on each target."""
    affected_layout(layouts, "lightning")
    folder, counter = user_sitecustomize
    prefix = shim_cli("run") + shim_cli("run")
    result = child_json("startup:probe", launcher=tuple(prefix), env=with_pythonpath(clean_env(), folder))
    assert result["loaded"] and result["sources"] == RUN_SOURCES
    assert result["patched"]["lightning.pytorch"] is True
    assert result["shim_layers"] == 1
    assert_each_process_ran_it_once(counter, expected_processes=3)


@pytest.mark.per_python
def test_under_run_an_empty_pythonpath_entry_still_means_the_current_directory(tmp_path: Path) -> None:
    """`export PYTHONPATH=$PYTHONPATH:/x` with PYTHONPATH unset makes ':/x'."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "module_in_cwd.py").write_text("VALUE = 1\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep + env.get("PYTHONPATH", "")
    script = [sys.executable, CHILD, "children.startup:interpreter_state", json.dumps({"module": "module_in_cwd"})]
    plain = run_command(script, env=env, cwd=workdir, check=True)
    under_run = run_command([*shim_cli("run"), *script], env=env, cwd=workdir, check=True)
    assert last_json(plain)["imported"] == "module_in_cwd"
    assert last_json(under_run)["imported"] == "module_in_cwd", under_run.stderr
    assert last_json(under_run)["shim_sources"] == RUN_SOURCES


@pytest.mark.parametrize(
    ("flags", "other_python", "warned"),
    [
        (("-I",), True, True),
        (("-E",), True, True),
        (("-IB",), True, True),
        (("-S",), False, True),
        (("-I",), False, not HAS_ENVIRONMENT_FILE),  # FSDP_SHIM=1 reaches an interpreter that has fsdp-shim
        (("-B",), True, False),
        ((), False, False),
    ],
    ids=["-I other", "-E other", "-IB other", "-S this", "-I this", "-B other", "plain this"],
)
@pytest.mark.per_python
def test_run_warns_before_starting_a_python_that_cannot_see_the_bootstrap(
    flags: tuple[str, ...], other_python: bool, warned: bool, venv: Venv
) -> None:
    """One line, before exec; the process itself then runs without the shim. Another environment's
    Python (no fsdp-shim of its own) depends on PYTHONPATH; this one's also reads FSDP_SHIM=1."""
    python = venv.python if other_python else sys.executable
    proc = run_command([*shim_cli("run"), python, *flags, "-c", "pass"], check=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fsdp-shim run: warning")]
    assert len(lines) == (1 if warned else 0), proc.stderr
    if warned:
        assert "cannot activate the shim in this Python process" in lines[0]


@pytest.mark.parametrize("user_sitecustomize", ["module"], indirect=True)
def test_run_with_import_and_startup_file_arms_once(
    venv: Venv, user_sitecustomize: tuple[Path, Path], layouts: dict[str, Layout]
) -> None:
    """Three activations in one process (install's file, run's bootstrap, ``import fsdp_shim``): each
    is recorded as a source, one finder, one layer of the shim's on each target."""
    affected_layout(layouts, "lightning")
    folder, counter = user_sitecustomize
    venv.run("-m", "fsdp_shim", "install")
    command = ["-m", "fsdp_shim", "run", venv.python, CHILD, "children.startup:import_shim_then_probe"]
    result = last_json(venv.run(*command, env=with_pythonpath(clean_env(), folder)))
    assert sorted(result["sources"]) == ["fsdp-shim run", "import fsdp_shim", "startup file"]
    assert result["finder_count"] == 1
    assert result["patched"]["lightning.pytorch"] is True
    assert result["shim_layers"] == 1
    assert_each_process_ran_it_once(counter, expected_processes=2)


OFF_VALUES = ["0", "no", "disabled", " OFF "]


@pytest.mark.per_python
def test_every_off_value_is_off_for_the_startup_code() -> None:
    """The start-up code reads ``FSDP_SHIM`` with the one parser (``_fsdp_shim.switch_state``, which
    the finder's hand-over calls): every value the next test uses, and more, means off there."""
    assert {value: startup.switch_state(value) for value in OFF_VALUES} == dict.fromkeys(OFF_VALUES, "off")


@pytest.mark.parametrize(
    ("mode", "value"),
    list(zip(["startup-file", "run", "run+startup-file", "run-then-set-in-script"], OFF_VALUES)),
)
def test_fsdp_shim_off_switches_every_mode_off(mode: str, value: str, venv: Venv, layouts: dict[str, Layout]) -> None:
    """With ``FSDP_SHIM`` off (in the environment, or set by the script before it imports Lightning),
    no start-up activation loads the shim, and nothing is said. One off value per mode: the values
    all go through one parser (previous test)."""
    affected_layout(layouts, "lightning")
    if "startup-file" in mode:
        venv.run("-m", "fsdp_shim", "install")
    in_script = mode == "run-then-set-in-script"
    target = "switch_off_in_script_then_probe" if in_script else "probe"
    env = clean_env() if in_script else clean_env(FSDP_SHIM=value)
    arguments = json.dumps({"value": value} if in_script else {})
    launcher = ("-m", "fsdp_shim", "run", venv.python) if "run" in mode else ()
    result = last_json(venv.run(*launcher, CHILD, f"children.startup:{target}", arguments, env=env))
    assert result["finder_count"] == 1  # armed, and then it did not load the shim
    assert result["loaded"] is False
    assert result["shim_warnings"] == []


def test_an_unreadable_switch_loads_the_shim_only_to_say_it_is_off(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    result = probe_in(venv, env=clean_env(FSDP_SHIM="perhaps"))
    assert result["loaded"] is True
    assert result["patched"]["lightning.pytorch"] is False
    assert "switched off by FSDP_SHIM='perhaps'" in result["reasons"]["lightning.pytorch"]
    assert len(result["shim_warnings"]) == 1 and "switched the shim OFF" in result["shim_warnings"][0]


def test_isolated_and_no_site_modes(venv: Venv, layouts: dict[str, Layout]) -> None:
    """Documented: -S skips every start-up activation; -I (and -E) ignore PYTHONPATH, so `run`'s
    bootstrap cannot reach them, while a start-up file in site-packages still does."""
    affected_layout(layouts, "lightning")
    isolated = run_child(
        "startup:probe", python_args=("-I",), sys_path=tuple(pythonpath_entries()), launcher=tuple(shim_cli("run"))
    )
    # -I ignores PYTHONPATH (the bootstrap), not FSDP_SHIM=1, which `run` sets for this interpreter's
    # start-up file from the package.
    assert last_json(isolated)["loaded"] is HAS_ENVIRONMENT_FILE
    assert ("fsdp-shim run: warning" in isolated.stderr) is not HAS_ENVIRONMENT_FILE
    venv.run("-m", "fsdp_shim", "install")
    entries = [item for path in pythonpath_entries() for item in ("--sys-path", path)]
    under_i = last_json(venv.run("-I", CHILD, *entries, "children.startup:probe"))
    assert under_i["loaded"] is True and under_i["sources"] == ["startup file"]
    no_site = [item for path in (str(ROOT), sysconfig.get_paths()["purelib"]) for item in ("--sys-path", path)]
    # Without site nothing armed and nothing of the shim's was imported, so no Lightning import can
    # reach it (only `import fsdp_shim` could).
    under_s = last_json(venv.run("-S", CHILD, *entries, *no_site, "children.startup:interpreter_state"))
    assert under_s["fsdp_modules"] == [] and FINDER not in under_s["finders"]


@pytest.mark.per_python
def test_run_passes_exit_codes_and_signals_through() -> None:
    assert run_command([*shim_cli("run"), sys.executable, "-c", "import sys; sys.exit(7)"]).returncode == 7
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert run_command([*shim_cli("run"), sys.executable, "-c", kill]).returncode == -signal.SIGTERM
    missing = run_command([*shim_cli("run"), "no-such-command-fsdp-shim"])
    assert missing.returncode == 127 and "command not found" in missing.stderr


# ----------------------------------------------------------------------------- a shim that cannot load
@pytest.fixture
def broken_shim(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, holds a broken install: a copy of ``_fsdp_shim`` whose
    ``activation`` (what the finder hands Lightning to) raises ImportError."""
    folder = tmp_path / "broken"
    shutil.copytree(ROOT / "_fsdp_shim", folder / "_fsdp_shim", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "_fsdp_shim" / "activation.py").write_text(
        "raise ImportError('this _fsdp_shim is broken for the test')\n"
    )
    return folder


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_shim_that_cannot_load_under_the_startup_file_is_loud(
    strict: bool, venv: Venv, broken_shim: Path, layouts: dict[str, Layout]
) -> None:
    """Strict is louder than the default, never quieter; the default says it once."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    env = with_pythonpath(clean_env(**({"FSDP_SHIM_STRICT": "1"} if strict else {})), broken_shim)
    arguments = json.dumps({"package": "lightning", "then": ["pytorch_lightning", "lightning_fabric"]})
    proc = venv.run(CHILD, "children.startup:import_lightning_package", arguments, env=env, check=False)
    if strict:
        assert proc.returncode != 0
        assert "ImportError: fsdp-shim: the shim could not be loaded" in proc.stderr
        assert "this _fsdp_shim is broken for the test" in proc.stderr
        assert "FSDP_SHIM_STRICT is on, so this import fails instead" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        result = last_json(proc)
        assert result["loaded"] is False
        assert len(result["warnings"]) == 1, result["warnings"]
        assert result["warnings"][0].startswith("FSDPShimWarning: fsdp-shim: the shim could not be loaded")


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_run_into_an_interpreter_without_the_shim_is_loud(
    strict: bool, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """`fsdp-shim run` from one environment, exec'ing the Python of another one that has Lightning
    and torch but not fsdp-shim: the bootstrap cannot arm, and the first Lightning import says so,
    once. It knows which imports are Lightning's from the start-up module's source (it cannot import
    it there): imports before Lightning's pass even in strict mode."""
    affected_layout(layouts, "lightning")
    other = make_venv(tmp_path / "other", [sysconfig.get_paths()["purelib"]])  # no fsdp-shim here
    env = clean_env(**({"FSDP_SHIM_STRICT": "1"} if strict else {}))
    code = (
        "import sys, wave, json; print('other imports pass', flush=True); "
        "import lightning, pytorch_lightning; print('lightning imported', '_fsdp_shim' in sys.modules)"
    )
    proc = run_command([*shim_cli("run"), other.python, "-W", "ignore", "-c", code], env=env, cwd=tmp_path)
    assert proc.stderr.count("fsdp-shim run: the shim could not be armed in") == 1, proc.stderr
    assert proc.stdout.splitlines()[0] == "other imports pass"
    if strict:
        assert proc.returncode != 0 and "ImportError" in proc.stderr
        assert proc.stdout.strip() == "other imports pass"
    else:
        assert proc.returncode == 0 and proc.stdout.splitlines()[1] == "lightning imported False"


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_missing_wrapt_under_run_is_loud(strict: bool, tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    hidden = tmp_path / "no_wrapt"
    (hidden / "wrapt").mkdir(parents=True)
    (hidden / "wrapt" / "__init__.py").write_text("raise ImportError('wrapt is missing for this test', name='wrapt')\n")
    env = with_pythonpath(clean_env(**({"FSDP_SHIM_STRICT": "1"} if strict else {})), hidden)
    proc = run_child(
        "startup:import_lightning_package",
        {"package": "lightning"},
        env=env,
        launcher=tuple(shim_cli("run")),
        expect_ok=False,
    )
    if strict:
        assert proc.returncode != 0
        assert "FSDPShimError: fsdp-shim: cannot patch lightning.fabric: ImportError: wrapt is missing" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        result = last_json(proc)
        assert result["loaded"] is True
        assert any("cannot patch lightning.fabric: ImportError: wrapt is missing" in w for w in result["warnings"])
        namespaces = {n["namespace"]: n for n in result["status"]["namespaces"]}
        assert namespaces["lightning.pytorch"]["patched"] is False
        assert "patching code cannot be imported" in namespaces["lightning.pytorch"]["reason"]


def test_an_older_shim_package_warns_once_and_lets_lightning_import(
    venv: Venv, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """Version skew the other way round (a start-up file newer than the package it hands over to): an
    earlier ``_fsdp_shim`` first on PYTHONPATH has no ``activation.namespace_executed``. The finder
    warns once, then stays out of the way: every later import (Lightning's other namespaces and
    unrelated modules, with warnings shown every time) passes without another word."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    older = tmp_path / "older" / "_fsdp_shim"
    older.mkdir(parents=True)
    (older / "__init__.py").write_text('"""An earlier fsdp-shim."""\n')
    (older / "activation.py").write_text("def activate():\n    return True\n")
    env = with_pythonpath(clean_env(), older.parent)
    then = ["pytorch_lightning", "lightning_fabric", "wave", "mailbox", "netrc", "plistlib"]
    result = last_json(
        venv.run(
            CHILD,
            "children.startup:import_lightning_package",
            json.dumps({"package": "lightning", "then": then}),
            env=env,
        )
    )
    assert len(result["warnings"]) == 1, result["warnings"]
    assert result["warnings"][0].startswith("FSDPShimWarning: fsdp-shim: the shim could not be loaded (AttributeError")
    assert "namespace_executed" in result["warnings"][0]


# ----------------------------------------------------------------------------- status
def test_status_reports_and_exit_code(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    report = json.loads(venv.run("-m", "fsdp_shim", "status", "--json", "--python-check").stdout)
    assert report["consistent"] is True, report["problems"]
    assert [Path(f["path"]).name for f in report["startup_files"]] == [COPY_FILE, PTH_NAME, START_NAME]
    assert all(f["current"] for f in report["startup_files"])
    assert report["child"]["shim_loaded"] is True
    by_namespace = {n["namespace"]: n for n in report["child"]["status"]["namespaces"]}
    assert by_namespace["lightning.pytorch"]["patched"] is True
    assert any(row["namespace"] == "lightning.pytorch" and row["affected"] for row in report["lightning"])
    assert report["armed"] == {"state": "armed", "by": ["fsdp-shim install"]}
    text = venv.run("-m", "fsdp_shim", "status", "--python-check").stdout.splitlines()
    assert text[2:5] == [
        "Shim: ARMED in every Python of this environment, by:",
        f"  fsdp-shim install  its start-up file {venv.site_packages / PTH_NAME}",
        "",
    ]
    assert "  shim loaded, armed by: startup file" in text
    off = venv.run("-m", "fsdp_shim", "status", env=clean_env(FSDP_SHIM="0")).stdout.splitlines()
    assert off[2:6] == [
        "Shim: OFF. FSDP_SHIM='0' switches off every activation: Lightning runs as shipped.",
        "  Without it, this would arm the shim:",
        f"  fsdp-shim install  its start-up file {venv.site_packages / PTH_NAME}",
        "",
    ]

    bad_toggle = venv.run("-m", "fsdp_shim", "status", env=clean_env(FSDP_SHIM="perhaps"), check=False)
    assert bad_toggle.returncode == 1 and "FSDP_SHIM='perhaps'" in bad_toggle.stdout
    assert "the shim is OFF" in bad_toggle.stdout

    pth = venv.site_packages / PTH_NAME
    pth.write_text(pth.read_text() + "# edited\n")
    outdated = venv.run("-m", "fsdp_shim", "status", check=False)
    assert (
        outdated.returncode == 1
        and f"PROBLEM: {pth} is fsdp-shim's but not what this version writes" in outdated.stdout
    )

    in_run = json.loads(run_command([*shim_cli("run"), *shim_cli("status", "--json")], check=True).stdout)
    assert in_run["bootstrap_on_pythonpath"] and in_run["consistent"] is True
    assert in_run["armed"]["state"] == "armed" and in_run["armed"]["by"][-1] == "fsdp-shim run"
    in_run_text = run_command([*shim_cli("run"), *shim_cli("status")], check=True).stdout.splitlines()
    assert in_run_text[2] == "Shim: ARMED in every Python started from here, by:"
    assert "  fsdp-shim run  its bootstrap is first on PYTHONPATH" in in_run_text[3:5]

    stale_env = clean_env()
    stale_env["PYTHONPATH"] = os.pathsep.join(
        ["/nonexistent/site-packages/_fsdp_shim/bootstrap", stale_env.get("PYTHONPATH", "")]
    )
    stale = run_command(shim_cli("status"), env=stale_env)
    assert stale.returncode == 1 and "bootstrap folder that does not exist" in stale.stdout


# ----------------------------------------------------------------------------- multi-process FSDP
SCENARIO_ARGS = ["--api", "trainer", "--shim", "off", "--cases", "init+pretrained:bf16-true"]
CASE = "init+pretrained:bf16-true"


def flat_dtypes(out: Path, ranks: int) -> list[list[str]]:
    return [results[CASE]["flat_param_dtypes"] for results in scenario_results(out, ranks).values()]


def test_lightning_launcher_ranks_get_the_fix_from_the_startup_file_alone(
    venv: Venv, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """Lightning's launcher re-runs the script for rank 1: the start-up file arms that process too."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    out = tmp_path / "launcher"
    command = [venv.python, str(SCENARIO), *SCENARIO_ARGS, "--devices", "2", "--out", str(out)]
    proc, _ = run_on_a_free_port(lambda retry: (command, clean_env(PYTHONWARNINGS="ignore")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_fsdp_shim_run_torchrun_two_ranks(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    out = tmp_path / "torchrun"

    def attempt(retry: bool) -> tuple[list[str], dict[str, str]]:
        command = [*shim_cli("run"), *torchrun(2), str(SCENARIO), *SCENARIO_ARGS, "--devices", "2", "--out", str(out)]
        return command, clean_env(PYTHONWARNINGS="ignore")

    proc, _ = run_on_a_free_port(attempt)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_two_nodes_on_loopback_each_wrapped_with_run(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    out = tmp_path / "nodes"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [
            *shim_cli("run"),
            *torchrun(1, nodes=2, node_rank=node_rank, port=port),
            str(SCENARIO),
            *SCENARIO_ARGS,
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--out",
            str(out),
        ]
        env = clean_env(PYTHONWARNINGS="ignore")
        nodes.append(
            subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    for node in nodes:
        _, stderr = node.communicate(timeout=600)
        assert node.returncode == 0, stderr[-4000:]
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_arming_after_lightning_was_imported_patches_at_once(layouts: dict[str, Layout]) -> None:
    """A start-up hook that runs after something already imported Lightning patches it at once."""
    affected_layout(layouts, "lightning")
    result = child_json("startup:arm_after_lightning")
    assert result["sources"] == ["fsdp-shim run"]
    assert result["patched"]["lightning.pytorch"] is True


# ----------------------------------------------------------------------------- FSDP_SHIM=1 through what pip installs
def pip_probe(venv: PipVenv, *python_args: str, env: dict[str, str], cwd: Path, target: str = "probe") -> Any:
    """A child of the pip-installed environment, outside the checkout (nothing of it is importable)."""
    return last_json(
        venv.run(*python_args, CHILD, "--sys-path", str(ROOT / "tests"), f"children.startup:{target}", env=env, cwd=cwd)
    )


@pytest.mark.parametrize("python_args", [(), ("-I",)], ids=["plain", "isolated"])
def test_fsdp_shim_1_alone_arms_the_shim_and_nothing_else_does(
    pip_venv: PipVenv, layouts: dict[str, Layout], tmp_path: Path, python_args: tuple[str, ...]
) -> None:
    """No import, no wrapper, no `fsdp-shim install`; `python -I` ignores PYTHON* variables but not
    it. Unset, nothing of fsdp-shim's is imported at all, nor a finder armed; ``0``, the finder that
    ``fsdp_shim_env.pth`` arms (the variable is set) does not load the shim at Lightning's import.
    (Armed by FSDP_SHIM=1 without -I: the specs-and-loaders test.)"""
    affected_layout(layouts, "lightning")
    if python_args:
        on = pip_probe(pip_venv, *python_args, env=clean_env(FSDP_SHIM="1"), cwd=tmp_path)
        assert on["loaded"] and on["sources"] == [startup.ENVIRONMENT_SOURCE.format("1")]
        assert on["patched"]["lightning.pytorch"] is True and on["shim_layers"] == 1
    code = "import sys; print(sorted(m for m in sys.modules if 'fsdp' in m), [repr(f) for f in sys.meta_path])"
    unset = pip_venv.run(*python_args, "-c", code, env=clean_env(), cwd=tmp_path)
    assert unset.stdout.startswith("[] [") and FINDER not in unset.stdout and unset.stderr == ""
    off = pip_probe(pip_venv, *python_args, env=clean_env(FSDP_SHIM="0"), cwd=tmp_path)
    assert off["finder_count"] == 1 and off["loaded"] is False and off["shim_warnings"] == []


SWITCH_VALUES = {"unset": None, "blank": "", "spaces": "  ", "off": "0", "on": "1"}
"""``FSDP_SHIM`` as a job template may leave it (``FSDP_SHIM=${FSDP_SHIM:-}`` gives a blank one), by name."""
STARTUP_CODE = (
    "import json, sys; startup = sys.modules.get('_fsdp_shim'); "
    "print(json.dumps([[getattr(f, '__name__', '') for f in sys.meta_path].count('fsdp_shim_finder'), "
    "getattr(startup, 'ARMED_BY', None), '_fsdp_shim.activation' in sys.modules]))"
)
"""Prints what a start-up file left behind: fsdp-shim's finders, how the start-up module was armed (``None``: it
was not even imported), and whether the shim itself was loaded."""


@pytest.mark.per_python
def test_a_blank_switch_is_unset_for_the_pip_start_up_file_its_pep_829_companion_and_status(
    pip_venv: PipVenv, tmp_path: Path
) -> None:
    """What pip installs arms where ``FSDP_SHIM`` is set and not blank: ``fsdp_shim_env.pth`` as ``site`` reads
    it, and its PEP 829 companion ``fsdp_shim_env.start`` (Python 3.15+ runs it in place of the ``.pth``'s
    import line) as ``site`` runs it, each entry resolved with ``pkgutil.resolve_name`` and called, in a fresh
    interpreter that reads no start-up file (``-S``). Unset, blank or spaces: nothing armed, and the ``.pth``
    imports nothing of fsdp-shim's; ``0``: the finder is armed and hands nothing over (the switch is read
    again at Lightning's import); ``1``: armed. ``status`` reads a blank switch as unset too."""
    start_file = pip_venv.site_packages / "fsdp_shim_env.start"
    entries = [line.strip() for line in start_file.read_text().splitlines() if line.strip()[:1] not in ("", "#")]
    assert entries == ["_fsdp_shim:arm_if_switched_on"]
    pth_code = [line for line in (pip_venv.site_packages / ENVIRONMENT_FILE).read_text().splitlines()]
    assert [line for line in pth_code if line.startswith("import")] == [pth_code[-1]]
    run_start = (
        f"import pkgutil, sys; sys.path.append({str(pip_venv.site_packages)!r}); "
        f"[pkgutil.resolve_name(entry)() for entry in {entries!r}]; {STARTUP_CODE}"
    )
    seen = {}
    for name, value in SWITCH_VALUES.items():
        env = clean_env(FSDP_SHIM=value)
        by_pth = pip_venv.run("-c", STARTUP_CODE, env=env, cwd=tmp_path).stdout
        by_start = pip_venv.run("-S", "-c", run_start, env=env, cwd=tmp_path).stdout
        state = json.loads(pip_venv.run("-m", "fsdp_shim", "status", "--json", env=env, cwd=tmp_path).stdout)
        seen[name] = (json.loads(by_pth), json.loads(by_start), state["armed"]["state"])

    def armed(value: str) -> list[Any]:
        return [1, [startup.ENVIRONMENT_SOURCE.format(value)], False]

    assert seen == {
        "unset": ([0, None, False], [0, [], False], "not armed"),
        "blank": ([0, None, False], [0, [], False], "not armed"),
        "spaces": ([0, None, False], [0, [], False], "not armed"),
        "off": (armed("0"), armed("0"), "off"),
        "on": (armed("1"), armed("1"), "armed"),
    }


def test_an_unreadable_value_loads_the_shim_only_to_say_it_is_off(
    pip_venv: PipVenv, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    affected_layout(layouts, "lightning")
    result = pip_probe(pip_venv, env=clean_env(FSDP_SHIM="maybe"), cwd=tmp_path)
    assert result["loaded"] and result["patched"]["lightning.pytorch"] is False
    assert len(result["shim_warnings"]) == 1 and "FSDP_SHIM='maybe' is not a valid value" in result["shim_warnings"][0]


def test_run_reaches_a_job_script_that_overwrites_pythonpath(
    pip_venv: PipVenv, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """`fsdp-shim run ./job.sh` where job.sh sets PYTHONPATH=... drops the bootstrap; FSDP_SHIM=1 stays."""
    affected_layout(layouts, "lightning")
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/sh\n"
        f"export PYTHONPATH={clean_env().get('PYTHONPATH', '')}\n"
        f"exec {pip_venv.python} {CHILD} --sys-path {ROOT / 'tests'} children.startup:probe\n"
    )
    job.chmod(0o755)
    fsdp_shim = str(Path(pip_venv.python).parent / "fsdp-shim")
    proc = run_command([fsdp_shim, "run", str(job)], cwd=tmp_path, check=True)
    result = last_json(proc)
    assert result["sources"] == [startup.ENVIRONMENT_SOURCE.format("1")]
    assert result["patched"]["lightning.pytorch"] is True


@pytest.mark.per_python
def test_run_sets_fsdp_shim_1_unless_it_is_set(tmp_path: Path) -> None:
    code = "import os; print(os.environ.get('FSDP_SHIM'))"
    for env, expected in ((clean_env(), "1"), (clean_env(FSDP_SHIM="0"), "0"), (clean_env(FSDP_SHIM="on"), "on")):
        proc = run_command([*shim_cli("run"), sys.executable, "-c", code], env=env, cwd=tmp_path)
        assert proc.stdout.strip() == expected, proc.stderr


@pytest.mark.per_python
def test_status_names_the_environment_file_in_a_pip_install(pip_venv: PipVenv, tmp_path: Path) -> None:
    """Where pip installed fsdp-shim, ``status`` says that ``FSDP_SHIM=1`` arms every interpreter, and
    through which file (issue 26, item 5)."""
    fsdp_shim = str(Path(pip_venv.python).parent / "fsdp-shim")
    expected = pip_venv.site_packages / ENVIRONMENT_FILE
    text = run_command([fsdp_shim, "status"], cwd=tmp_path, check=True).stdout
    activations = text.split("Activations:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line for line in activations if ENVIRONMENT_FILE in line] == [
        f"  FSDP_SHIM=1    {expected}  (arms every interpreter where FSDP_SHIM=1)"
    ]
    report = json.loads(run_command([fsdp_shim, "status", "--json"], cwd=tmp_path, check=True).stdout)
    assert report["environment_file"] == {"path": str(expected), "exists": True, "read": True}


@pytest.mark.per_python
def test_status_says_fsdp_shim_1_arms_nothing_with_a_clone_on_the_path(venv: Venv) -> None:
    """A checkout imported through a path entry holds ``fsdp_shim_env.pth`` at its root as source, which
    no ``site`` reads: ``status`` says that ``FSDP_SHIM=1`` arms nothing, and that this fsdp-shim was not
    installed by pip, rather than calling the checkout a pip install."""
    env = clean_env(FSDP_SHIM="1")
    text = venv.run("-m", "fsdp_shim", "status", env=env, check=False)
    assert text.returncode == 1
    reason = "this fsdp-shim was not installed by pip (a clone on PYTHONPATH?)"
    assert f"  FSDP_SHIM=1    arms nothing here: {reason}" in text.stdout.splitlines()
    assert (
        f"PROBLEM: FSDP_SHIM='1' arms nothing in this interpreter: no folder it reads start-up files from holds "
        f"{ENVIRONMENT_FILE} ({reason})" in text.stdout
    )
    report = json.loads(venv.run("-m", "fsdp_shim", "status", "--json", env=env, check=False).stdout)
    assert report["environment_file"] == {"path": str(ROOT / ENVIRONMENT_FILE), "exists": False, "read": False}


@pytest.mark.per_python
def test_status_says_fsdp_shim_1_arms_nothing_in_a_target_install(tmp_path: Path, wheel: Path) -> None:
    """``pip install --target DIR`` and ``PYTHONPATH=DIR``: Python imports fsdp-shim from DIR but reads
    no start-up file there, so ``FSDP_SHIM=1`` arms nothing, and no interpreter would say so.
    ``status --python-check`` does, with why, and exits 1 (issue 26, item 5)."""
    target = tmp_path / "target"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], check=True)
    assert (target / ENVIRONMENT_FILE).is_file()
    other = make_venv(tmp_path / "venv", [sysconfig.get_paths()["purelib"]])  # torch, wrapt; no fsdp-shim
    env = with_pythonpath(clean_env(FSDP_SHIM="1"), target)
    proc = run_command([other.python, "-m", "fsdp_shim", "status", "--python-check"], env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = [line for line in proc.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert len(problems) == 1, proc.stdout
    assert problems[0].startswith(
        f"PROBLEM: FSDP_SHIM='1' arms nothing in this interpreter: no folder it reads start-up files from holds "
        f"{ENVIRONMENT_FILE} (this fsdp-shim's is in {target}, which Python imports from but does not read "
        "start-up files from"
    ), problems[0]
    assert "shim not loaded: nothing armed it at start-up" in proc.stdout
    assert proc.stdout.splitlines()[2].startswith(
        "Shim: NOT ARMED in a Python started from here: FSDP_SHIM='1' arms nothing here (see PROBLEM)."
    ), proc.stdout
