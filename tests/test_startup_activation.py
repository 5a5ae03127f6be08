"""The ways to activate the shim without editing code, each in fresh interpreters: the
environment-wide start-up file, ``fsdp-shim run``, and their combinations with ``import fsdp_shim``,
a user's own ``sitecustomize``, ``FSDP_SHIM``, strict mode, odd ``PYTHONPATH``s and ``python -I/-E/-S``."""

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

import pytest
from conftest import (
    ROOT,
    SCENARIO,
    Layout,
    Venv,
    affected_layout,
    child_json,
    clean_env,
    free_port,
    make_venv,
    run_child,
    run_command,
)

import _fsdp_shim_startup as startup
from fsdp_shim.bootstrap import sitecustomize as bootstrap
from fsdp_shim.runner import BOOTSTRAP_DIRECTORY
from fsdp_shim.startup_files import COPY_MODULE, COPY_TEXT, ENVIRONMENT_FILE, PTH_TEXT, START_TEXT, site_directories

pytestmark = pytest.mark.release_independent

HAS_ENVIRONMENT_FILE = any((d / ENVIRONMENT_FILE).is_file() for d in site_directories())
RUN_SOURCES = [startup.ENVIRONMENT_SOURCE, "fsdp-shim run"] if HAS_ENVIRONMENT_FILE else ["fsdp-shim run"]
"""How `fsdp-shim run` arms this interpreter: FSDP_SHIM=1 through the start-up file pip installed with
the package (read first, at site-packages time), then the bootstrap sitecustomize."""


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    return make_venv(tmp_path / "venv", [str(ROOT), sysconfig.get_paths()["purelib"]])


def probe_in(venv: Venv, *python_args: str, env: dict[str, str] | None = None, target: str = "probe") -> dict:
    return json.loads(
        venv.run(*python_args, str(ROOT / "tests" / "child.py"), f"children.startup:{target}", env=env).stdout
    )


def shim_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fsdp_shim", *args]


def run(command: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_command(command, env=env or clean_env(), check=check)


def pythonpath_entries() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


# ----------------------------------------------------------------------------- one table
def test_every_copy_of_the_lightning_package_list_agrees() -> None:
    """The start-up files' finder watches the packages of the one table, and the run bootstrap's
    fallback list (it must work when that table cannot be imported) matches it."""
    import _fsdp_shim_trampoline
    from fsdp_shim.backport import NAMESPACES

    packages = tuple(dict.fromkeys(ns.name.partition(".")[0] for ns in NAMESPACES))
    assert packages == startup.LIGHTNING_PACKAGES
    assert tuple(_fsdp_shim_trampoline.WATCHED) == packages
    assert packages == bootstrap.LIGHTNING_PACKAGES


def test_the_startup_file_imports_a_verbatim_copy_of_the_trampoline_module() -> None:
    """What ``fsdp-shim install``'s ``.pth`` runs is ``_fsdp_shim_trampoline.py`` as linted and tested:
    the copy it imports holds that module's source after two comment lines, and its one code line is a
    bare import of the copy, which arms itself because of the name it is imported under."""
    import _fsdp_shim_trampoline

    source = Path(_fsdp_shim_trampoline.__file__).read_text(encoding="utf-8")
    header, _, body = COPY_TEXT.partition('"""')
    assert '"""' + body == source and all(line.startswith("#") for line in header.splitlines())
    code_lines = [line for line in PTH_TEXT.splitlines() if not line.startswith("#")]
    assert code_lines == [f"import {COPY_MODULE}"]
    assert COPY_MODULE == _fsdp_shim_trampoline.COPY_NAME


def test_the_copy_arms_itself_only_under_its_own_name(tmp_path: Path) -> None:
    """Imported as ``install``'s copy, the trampoline puts its finder first on ``sys.meta_path``;
    imported as ``_fsdp_shim_trampoline`` (by ``_fsdp_shim_startup``, or by ``fsdp_shim_env.pth`` where
    ``FSDP_SHIM`` is set), it arms nothing by itself."""
    (tmp_path / f"{COPY_MODULE}.py").write_text(COPY_TEXT, encoding="utf-8")
    (tmp_path / "_fsdp_shim_trampoline.py").write_text(COPY_TEXT, encoding="utf-8")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = len(sys.meta_path); "
        "import importlib; module = importlib.import_module(sys.argv[2]); "
        "print(len(sys.meta_path) - before, sys.meta_path[0] is module.fsdp_shim_watcher)"
    )
    outputs = {}
    for name in (COPY_MODULE, "_fsdp_shim_trampoline"):
        proc = subprocess.run(
            [sys.executable, "-S", "-c", probe, str(tmp_path), name], capture_output=True, text=True, check=True
        )
        outputs[name] = proc.stdout.split()
    assert outputs == {COPY_MODULE: ["1", "True"], "_fsdp_shim_trampoline": ["0", "False"]}


def test_the_module_every_interpreter_imports_runs_almost_nothing_at_import() -> None:
    """``_fsdp_shim_trampoline`` is imported at every start where a start-up file arms the shim: at
    import it imports only ``sys``, builds no class, and calls nothing but ``arm`` in the copy
    ``install`` writes (docs/benchmarks.md)."""
    tree = ast.parse(Path(ROOT / "_fsdp_shim_trampoline.py").read_text(encoding="utf-8"))
    *body, last = tree.body
    kinds = {type(node) for node in body}
    assert kinds <= {ast.Expr, ast.Import, ast.Assign, ast.FunctionDef}, kinds
    assert [alias.name for node in body if isinstance(node, ast.Import) for alias in node.names] == ["sys"]
    calls = [node for statement in body if not isinstance(statement, ast.FunctionDef) for node in ast.walk(statement)]
    assert not [node for node in calls if isinstance(node, ast.Call)]
    assert ast.unparse(last) == "if __name__ == COPY_NAME:\n    arm(SOURCE)"


@pytest.mark.parametrize("value", ["", "1", "on", "maybe", "0", "no", "DISABLED", " off "])
def test_the_bootstraps_fallback_reads_strict_like_the_package(value: str) -> None:
    import os as os_module

    saved = os_module.environ.get("FSDP_SHIM_STRICT")
    os_module.environ["FSDP_SHIM_STRICT"] = value
    try:
        finder = bootstrap._NotArmed(RuntimeError("simulated"))
        raised = False
        try:
            finder.find_spec("lightning")
        except ImportError:
            raised = True
    finally:
        if saved is None:
            del os_module.environ["FSDP_SHIM_STRICT"]
        else:
            os_module.environ["FSDP_SHIM_STRICT"] = saved
    assert raised is startup.strict_switched_on({"FSDP_SHIM_STRICT": value})


# ----------------------------------------------------------------------------- start-up file
def test_install_is_idempotent_and_uninstall_leaves_a_clean_interpreter(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    first = venv.run("-m", "fsdp_shim", "install")
    assert (venv.site_packages / "fsdp_shim.pth").read_text() == PTH_TEXT
    assert (venv.site_packages / "fsdp_shim.start").read_text() == START_TEXT
    assert (venv.site_packages / f"{COPY_MODULE}.py").read_text() == COPY_TEXT
    assert list((venv.site_packages / "__pycache__").glob(f"{COPY_MODULE}.*.pyc"))  # compiled by install
    assert first.stdout.count("wrote ") == 3
    second = venv.run("-m", "fsdp_shim", "install")
    assert second.stdout.count("already installed") == 3

    quiet = venv.run("-c", "pass")
    assert quiet.stderr == "" and quiet.stdout == ""
    active = probe_in(venv)
    assert active["loaded"] and active["sources"] == ["startup file"]
    assert active["patched"]["lightning.pytorch"] is True
    assert active["shim_layers"] == 1

    venv.run("-m", "fsdp_shim", "uninstall")
    assert not (venv.site_packages / "fsdp_shim.pth").exists()
    assert not (venv.site_packages / "fsdp_shim.start").exists()
    assert not (venv.site_packages / f"{COPY_MODULE}.py").exists()
    assert not list((venv.site_packages / "__pycache__").glob(f"{COPY_MODULE}.*"))
    clean = venv.run("-c", "pass")
    assert clean.stderr == "" and clean.stdout == ""
    assert probe_in(venv)["loaded"] is False
    assert "nothing to remove" in venv.run("-m", "fsdp_shim", "uninstall").stdout


def test_a_startup_file_left_behind_by_a_removed_package_is_silent(
    venv: Venv, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    # What `pip uninstall fsdp-shim` leaves: the start-up file, and no importable shim (run outside
    # the checkout, whose folder would otherwise be importable as the current directory).
    venv.paths_file.write_text(f"{sysconfig.get_paths()['purelib']}\n")
    env = clean_env()
    proc = venv.run("-c", "pass", env=env, cwd=tmp_path)
    assert proc.stdout == "" and proc.stderr == ""
    code = "import lightning, sys; print('fsdp_shim' in sys.modules, '_fsdp_shim_startup' in sys.modules)"
    imported = venv.run("-W", "ignore", "-c", code, env=env, cwd=tmp_path)
    assert imported.stdout.strip() == "False False" and imported.stderr == ""


def test_the_startup_file_imports_one_small_module_and_puts_one_finder_first(venv: Venv) -> None:
    """What every interpreter pays for the start-up file: one module (the copy, from its ``.pyc``)
    and one finder in front of the others, even though site reads a venv's start-up files twice."""
    without, finders_without = probe_in(venv, target="modules_and_finders")
    venv.run("-m", "fsdp_shim", "install")
    with_file, finders_with = probe_in(venv, target="modules_and_finders")
    assert set(with_file) - set(without) == {COPY_MODULE}
    assert set(without) <= set(with_file)
    assert finders_with == ["fsdp_shim_watcher", *finders_without]


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
    # share a pid and differ in their command line; a process that ran it twice repeats a line.
    body = (
        "import os, sys\n"
        f"with open({str(counter)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {sys.orig_argv!r}\\n')\n"
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


def with_pythonpath(env: dict[str, str], first: Path) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(first), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("user_sitecustomize", ["module", "package"], indirect=True)
@pytest.mark.parametrize("nested", [False, True], ids=["run", "run-run"])
def test_run_activates_and_chains_the_users_sitecustomize_once(
    user_sitecustomize: tuple[Path, Path], nested: bool, layouts: dict[str, Layout]
) -> None:
    affected_layout(layouts, "lightning")
    folder, counter = user_sitecustomize
    prefix = shim_cli("run") + (shim_cli("run") if nested else [])
    result = child_json("startup:probe", launcher=tuple(prefix), env=with_pythonpath(clean_env(), folder))
    assert result["loaded"] and result["sources"] == RUN_SOURCES
    assert result["patched"]["lightning.pytorch"] is True
    assert result["shim_layers"] == 1
    assert_each_process_ran_it_once(counter, expected_processes=3 if nested else 2)


def assert_each_process_ran_it_once(counter: Path, expected_processes: int) -> None:
    """Every interpreter involved (each `fsdp-shim run` launcher, then the command) ran it once."""
    lines = counter.read_text().splitlines()
    assert len(lines) == len(set(lines)) == expected_processes, lines
    argvs = [ast.literal_eval(line.partition(" ")[2]) for line in lines]
    assert sum(argv[1:3] == ["-m", "fsdp_shim"] for argv in argvs) == expected_processes - 1
    assert sum(argv[1].endswith("child.py") for argv in argvs) == 1


@pytest.mark.parametrize("user_sitecustomize", ["module", "package"], indirect=True)
def test_under_run_the_users_sitecustomize_keeps_its_sys_path_and_its_name(
    user_sitecustomize: tuple[Path, Path], tmp_path: Path
) -> None:
    """Entries the chained sitecustomize adds stay; `import sitecustomize` gives the
    user's module; only the bootstrap folder leaves sys.path."""
    folder, _ = user_sitecustomize
    result = child_json(
        "startup:interpreter_state",
        {"module": "site_extra_module"},
        launcher=tuple(shim_cli("run")),
        env=with_pythonpath(clean_env(), folder),
    )
    assert result["imported"] == "site_extra_module"
    assert str(tmp_path / "site_extra") in result["sys_path"]
    assert result["sitecustomize_marker"] == "the user sitecustomize"
    assert result["shim_sources"] == RUN_SOURCES
    assert all(os.path.realpath(entry or ".") != BOOTSTRAP_DIRECTORY for entry in result["sys_path"])


def test_under_run_an_empty_pythonpath_entry_still_means_the_current_directory(tmp_path: Path) -> None:
    """`export PYTHONPATH=$PYTHONPATH:/x` with PYTHONPATH unset makes ':/x'."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "module_in_cwd.py").write_text("VALUE = 1\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep + env.get("PYTHONPATH", "")
    script = [sys.executable, str(ROOT / "tests" / "child.py"), "children.startup:interpreter_state"]
    arguments = json.dumps({"module": "module_in_cwd"})
    plain = subprocess.run([*script, arguments], capture_output=True, text=True, env=env, cwd=workdir, timeout=300)
    under_run = subprocess.run(
        [*shim_cli("run"), *script, arguments], capture_output=True, text=True, env=env, cwd=workdir, timeout=300
    )
    assert json.loads(plain.stdout)["imported"] == "module_in_cwd"
    assert json.loads(under_run.stdout)["imported"] == "module_in_cwd", under_run.stderr


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
)
def test_run_warns_before_starting_a_python_that_cannot_see_the_bootstrap(
    flags: tuple[str, ...], other_python: bool, warned: bool, venv: Venv
) -> None:
    """One line, before exec; the process itself then runs without the shim. Another environment's
    Python (no fsdp-shim of its own) depends on PYTHONPATH; this one's also reads FSDP_SHIM=1."""
    python = venv.python if other_python else sys.executable
    proc = run([*shim_cli("run"), python, *flags, "-c", "pass"])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fsdp-shim run: warning")]
    assert len(lines) == (1 if warned else 0), proc.stderr
    if warned:
        assert "cannot activate the shim in this Python process" in lines[0]


@pytest.mark.parametrize("user_sitecustomize", ["module"], indirect=True)
def test_run_with_import_and_startup_file_arms_once(
    venv: Venv, user_sitecustomize: tuple[Path, Path], layouts: dict[str, Layout]
) -> None:
    affected_layout(layouts, "lightning")
    folder, counter = user_sitecustomize
    venv.run("-m", "fsdp_shim", "install")
    command = [
        "-m",
        "fsdp_shim",
        "run",
        venv.python,
        str(ROOT / "tests" / "child.py"),
        "children.startup:import_shim_then_probe",
    ]
    result = json.loads(venv.run(*command, env=with_pythonpath(clean_env(), folder)).stdout)
    assert sorted(result["sources"]) == ["fsdp-shim run", "startup file"]
    assert result["patched"]["lightning.pytorch"] is True
    assert result["shim_layers"] == 1
    assert_each_process_ran_it_once(counter, expected_processes=2)


@pytest.mark.parametrize("mode", ["startup-file", "run", "run+startup-file", "run-then-set-in-script"])
@pytest.mark.parametrize("value", ["0", "no", "disabled"])
def test_fsdp_shim_off_switches_every_mode_off(mode: str, value: str, venv: Venv, layouts: dict[str, Layout]) -> None:
    """The start-up code reads the switch with the package's parser."""
    affected_layout(layouts, "lightning")
    if "startup-file" in mode:
        venv.run("-m", "fsdp_shim", "install")
    target = "switch_off_in_script_then_probe" if mode == "run-then-set-in-script" else "probe"
    env = clean_env() if mode == "run-then-set-in-script" else clean_env(FSDP_SHIM=value)
    launcher = ("-m", "fsdp_shim", "run", venv.python) if "run" in mode else ()
    result = json.loads(
        venv.run(*launcher, str(ROOT / "tests" / "child.py"), f"children.startup:{target}", env=env).stdout
    )
    assert result["loaded"] is False  # the start-up code did not even load the package
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
    """Documented: -S skips every start-up activation; -I (and -E) ignore PYTHONPATH, so `run` cannot
    reach them, while the start-up file in site-packages still does."""
    affected_layout(layouts, "lightning")
    isolated = run_child(
        "startup:probe", python_args=("-I",), sys_path=tuple(pythonpath_entries()), launcher=tuple(shim_cli("run"))
    )
    # -I ignores PYTHONPATH (the bootstrap), not FSDP_SHIM=1, which `run` sets for this interpreter's
    # start-up file from the package.
    assert json.loads(isolated.stdout.splitlines()[-1])["loaded"] is HAS_ENVIRONMENT_FILE
    assert ("fsdp-shim run: warning" in isolated.stderr) is not HAS_ENVIRONMENT_FILE
    venv.run("-m", "fsdp_shim", "install")
    entries = [item for path in pythonpath_entries() for item in ("--sys-path", path)]
    child_py = str(ROOT / "tests" / "child.py")
    assert json.loads(venv.run("-I", child_py, *entries, "children.startup:probe").stdout)["loaded"] is True
    no_site = [item for path in (str(ROOT), sysconfig.get_paths()["purelib"]) for item in ("--sys-path", path)]
    assert json.loads(venv.run("-S", child_py, *entries, *no_site, "children.startup:probe").stdout)["loaded"] is False


def test_run_passes_exit_codes_and_signals_through() -> None:
    assert run([*shim_cli("run"), sys.executable, "-c", "import sys; sys.exit(7)"], check=False).returncode == 7
    killed = run(
        [*shim_cli("run"), sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], check=False
    )
    assert killed.returncode == -signal.SIGTERM
    missing = run([*shim_cli("run"), "no-such-command-fsdp-shim"], check=False)
    assert missing.returncode == 127 and "command not found" in missing.stderr


# ----------------------------------------------------------------------------- strict mode at start-up
@pytest.fixture
def broken_shim(tmp_path: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import fsdp_shim` fail (a broken install)."""
    folder = tmp_path / "broken"
    (folder / "fsdp_shim").mkdir(parents=True)
    (folder / "fsdp_shim" / "__init__.py").write_text("raise ImportError('this fsdp_shim is broken for the test')\n")
    return folder


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_shim_that_cannot_load_under_the_startup_file_is_loud(
    strict: bool, venv: Venv, broken_shim: Path, layouts: dict[str, Layout]
) -> None:
    """Strict is louder than the default, never quieter."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    env = with_pythonpath(clean_env(**({"FSDP_SHIM_STRICT": "1"} if strict else {})), broken_shim)
    proc = venv.run(
        str(ROOT / "tests" / "child.py"),
        "children.startup:import_lightning_package",
        '{"package": "lightning"}',
        env=env,
        check=False,
    )
    if strict:
        assert proc.returncode != 0
        assert "ImportError: fsdp-shim: the shim could not be loaded" in proc.stderr
        assert "FSDP_SHIM_STRICT is on, so this import fails instead" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["loaded"] is False
        assert len(result["warnings"]) == 1
        assert result["warnings"][0].startswith("FSDPShimWarning: fsdp-shim: the shim could not be loaded")


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_run_into_an_interpreter_without_the_shim_is_loud(
    strict: bool, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """`fsdp-shim run` from one environment, exec'ing the Python of another one that has Lightning
    and torch but not fsdp-shim: the bootstrap cannot arm, and the first Lightning import says so."""
    affected_layout(layouts, "lightning")
    other = make_venv(tmp_path / "other", [sysconfig.get_paths()["purelib"]])  # no fsdp_shim here
    env = clean_env(**({"FSDP_SHIM_STRICT": "1"} if strict else {}))
    code = "import lightning, sys; print('lightning imported', 'fsdp_shim' in sys.modules)"
    proc = run([*shim_cli("run"), other.python, "-W", "ignore", "-c", code], env=env, check=False)
    assert "fsdp-shim run: the shim could not be armed in" in proc.stderr
    if strict:
        assert proc.returncode != 0 and "ImportError" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == "lightning imported False"


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
        result = json.loads(proc.stdout.splitlines()[-1])
        assert result["loaded"] is True
        assert any("cannot patch lightning.fabric: ImportError: wrapt is missing" in w for w in result["warnings"])
        namespaces = {n["namespace"]: n for n in result["status"]["namespaces"]}
        assert namespaces["lightning.pytorch"]["patched"] is False
        assert "patching code cannot be imported" in namespaces["lightning.pytorch"]["reason"]


# ----------------------------------------------------------------------------- status
def test_status_reports_and_exit_code(venv: Venv, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    report = json.loads(venv.run("-m", "fsdp_shim", "status", "--json", "--python-check").stdout)
    assert report["consistent"] is True, report["problems"]
    assert [Path(f["path"]).name for f in report["startup_files"]] == [
        f"{COPY_MODULE}.py",
        "fsdp_shim.pth",
        "fsdp_shim.start",
    ]
    assert report["child"]["shim_loaded"] is True
    by_namespace = {n["namespace"]: n for n in report["child"]["status"]["namespaces"]}
    assert by_namespace["lightning.pytorch"]["patched"] is True
    assert any(row["namespace"] == "lightning.pytorch" and row["affected"] for row in report["lightning"])

    bad_toggle = venv.run("-m", "fsdp_shim", "status", env=clean_env(FSDP_SHIM="perhaps"), check=False)
    assert bad_toggle.returncode == 1 and "FSDP_SHIM='perhaps'" in bad_toggle.stdout
    assert "the shim is OFF" in bad_toggle.stdout

    (venv.site_packages / "fsdp_shim.pth").write_text(PTH_TEXT + "# edited\n")
    outdated = venv.run("-m", "fsdp_shim", "status", check=False)
    assert outdated.returncode == 1 and "another fsdp-shim version" in outdated.stdout

    in_run = json.loads(run([*shim_cli("run"), *shim_cli("status", "--json")]).stdout)
    assert in_run["bootstrap_on_pythonpath"] and in_run["consistent"] is True

    stale_env = clean_env()
    stale_env["PYTHONPATH"] = os.pathsep.join(
        ["/nonexistent/site-packages/fsdp_shim/bootstrap", stale_env.get("PYTHONPATH", "")]
    )
    stale = run(shim_cli("status"), env=stale_env, check=False)
    assert stale.returncode == 1 and "bootstrap folder that does not exist" in stale.stdout


# ----------------------------------------------------------------------------- multi-process FSDP
def flat_dtypes(out: Path, ranks: int) -> list[list[str]]:
    results = []
    for rank in range(ranks):
        rows = {row["case"]: row for row in json.loads(Path(f"{out}.rank{rank}.json").read_text())}
        results.append(rows["init+pretrained:bf16-true"]["flat_param_dtypes"])
    return results


SCENARIO_ARGS = ["--api", "trainer", "--shim", "off", "--cases", "init+pretrained:bf16-true"]


def test_lightning_launcher_ranks_get_the_fix_from_the_startup_file_alone(
    venv: Venv, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    out = tmp_path / "launcher"
    venv.run(str(SCENARIO), *SCENARIO_ARGS, "--devices", "2", "--out", str(out), env=clean_env(PYTHONWARNINGS="ignore"))
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def torchrun() -> str:
    return shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"


def test_fsdp_shim_run_torchrun_two_ranks(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    out = tmp_path / "torchrun"
    command = [
        *shim_cli("run"),
        torchrun(),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(SCENARIO),
        *SCENARIO_ARGS,
        "--devices",
        "2",
        "--out",
        str(out),
    ]
    run(command, env=clean_env(PYTHONWARNINGS="ignore"))
    assert flat_dtypes(out, 2) == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_two_nodes_on_loopback_each_wrapped_with_run(tmp_path: Path, layouts: dict[str, Layout]) -> None:
    affected_layout(layouts, "lightning")
    out = tmp_path / "nodes"
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [
            *shim_cli("run"),
            torchrun(),
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "fsdp-shim-test",
            str(SCENARIO),
            *SCENARIO_ARGS,
            "--devices",
            "1",
            "--num-nodes",
            "2",
            "--out",
            str(out),
        ]
        nodes.append(
            subprocess.Popen(
                command,
                env=clean_env(PYTHONWARNINGS="ignore"),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
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


# ----------------------------------------------------------------------------- version skew
def test_a_startup_file_newer_than_the_startup_module_lets_lightning_import_and_says_so(
    venv: Venv, tmp_path: Path, layouts: dict[str, Layout]
) -> None:
    """The other way round (a downgraded package): the file calls a hand-over the module lacks."""
    affected_layout(layouts, "lightning")
    venv.run("-m", "fsdp_shim", "install")
    older = tmp_path / "older"
    older.mkdir()
    (older / "_fsdp_shim_startup.py").write_text("SOURCES = []  # a start-up module without hand_over\n")
    env = with_pythonpath(clean_env(), older)
    # Imports after Lightning's pass the start-up file's finder, which must go inert after its first
    # failed hand-over instead of warning again at each (-W always: where warnings are not collapsed
    # per location, as under many test runners). site reads a venv's start-up files twice, so the
    # count is compared with a run that imports nothing after Lightning.
    message = "this start-up file does not match the installed fsdp-shim"
    counts = []
    for extra in ("", "import wave, mailbox, netrc, plistlib; "):
        code = f"import lightning; {extra}import sys; print('fsdp_shim' in sys.modules)"
        proc = venv.run("-W", "always", "-W", "ignore::DeprecationWarning", "-c", code, env=env, cwd=tmp_path)
        assert proc.stdout.strip() == "False"
        counts.append(proc.stderr.count(message))
    assert counts[0] >= 1 and counts[1] == counts[0], counts
