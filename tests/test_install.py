"""``fsdp-shim install`` / ``uninstall`` / ``status`` for the start-up files, and what ``pip`` and
``uv`` install and remove: refuse to write where it would change nothing, fail in one line with
nothing half-written where it cannot write, never write through a link, recognise fsdp-shim's files
(this version's, an earlier version's, an edited one) by their marker line, and remove all of them or
none, so that no interpreter is left printing an error at start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    NAMESPACES,
    ROOT,
    PipVenv,
    Venv,
    base_interpreter,
    child_json,
    clean_env,
    fsdp_shim,
    make_venv,
    run_command,
    site_packages_of,
)

import _fsdp_shim as startup
from _fsdp_shim import startup_files
from _fsdp_shim._version import __version__
from _fsdp_shim.startup_files import COPY_FILE, ENVIRONMENT_FILE, MARKER, PTH_NAME, START_NAME, file_texts

FILES = file_texts()
"""What this version writes, by name."""
FINDER = "fsdp_shim_finder"
EARLIER_FINDER = "fsdp_shim_watcher"
"""The name of the finder that earlier versions' start-up files armed."""
UV = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")

# Root writes anywhere: without these capabilities, a folder's mode binds root as well.
WITHOUT_DAC_OVERRIDE = (
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
)


def shim(
    *args: str, env: dict[str, str] | None = None, python: str = sys.executable, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``PYTHON -m fsdp_shim ARGS``: the command as the given interpreter runs it."""
    return fsdp_shim(*args, env=env, python=python, prefix=prefix, timeout=300)


def assert_one_line_failure(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def compiled_copies(directory: Path) -> list[Path]:
    return sorted((directory / "__pycache__").glob(f"{startup.COPY_NAME}.*.pyc"))


def finders(python: str, env: dict[str, str] | None = None) -> list[str]:
    """The finders a fresh interpreter of ``python`` has on ``sys.meta_path`` after start-up."""
    _, found = child_json("startup:modules_and_finders", python=python, env=env or clean_env())
    return found


@pytest.fixture
def venv(tmp_path: Path) -> Venv:
    """A new virtual environment (its site-packages is a folder it reads start-up files from) that
    imports this checkout and this environment's packages through a plain path file."""
    return make_venv(tmp_path / "venv")


def uv_venv(root: Path) -> Venv:
    """The same, made by uv (whose ``lib64`` is a link to ``lib``)."""
    if UV is None:
        pytest.skip("needs uv")
    subprocess.run([UV, "venv", "-q", "--no-cache", "--python", sys.executable, str(root)], check=True)
    assert (root / "lib64").is_symlink()
    purelib = site_packages_of(str(root / "bin" / "python"))
    paths_file = purelib / "aa_outer_environment.pth"
    paths_file.write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return Venv(root, purelib, paths_file)


# ----------------------------------------------------------------------------- where install refuses or fails
@pytest.mark.per_python
def test_a_target_this_python_does_not_read_is_refused_and_not_created(tmp_path: Path) -> None:
    typo = tmp_path / "site-pakages"
    proc = shim("install", "--target", str(typo))
    assert_one_line_failure(proc, "refusing", str(typo), "does not read start-up files", "--force")
    assert not typo.exists()
    forced = shim("install", "--target", str(typo), "--force")
    assert forced.returncode == 0, forced.stderr
    assert {name: (typo / name).read_text() for name in FILES} == FILES
    assert shim("uninstall", "--target", str(typo)).returncode == 0
    assert files_in(typo) == []  # the copy's .pyc and its __pycache__ went too


@pytest.mark.per_python
def test_user_site_inside_a_virtual_environment_is_refused(tmp_path: Path) -> None:
    assert sys.prefix != sys.base_prefix, "the test suite runs in a virtual environment"
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"))
    proc = shim("install", "--user", env=env)
    assert_one_line_failure(proc, "refusing", "does not read the user site-packages", "--force")
    assert not (tmp_path / "userbase").exists()
    forced = shim("install", "--user", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert len(list((tmp_path / "userbase").rglob(PTH_NAME))) == 1
    assert shim("uninstall", "--user", env=env).returncode == 0
    assert list((tmp_path / "userbase").rglob("*fsdp_shim*")) == []


@pytest.mark.per_python
def test_a_target_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("not a folder\n")
    proc = shim("install", "--target", str(target), "--force")
    assert_one_line_failure(proc, f"{target} is not a directory", "nothing was written")
    assert target.read_text() == "not a folder\n"


@pytest.mark.per_python
def test_an_unusable_home_for_the_user_site(tmp_path: Path) -> None:
    """Outside a virtual environment (the base interpreter, which reads the user site) with HOME
    pointing at a file: the user site cannot be created."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = clean_env(HOME=str(home), PYTHONUSERBASE=None, PYTHONPATH=str(ROOT))
    base_python = base_interpreter()
    proc = shim("install", "--user", env=env, python=base_python)
    assert_one_line_failure(
        proc, "cannot write to", str(home), "nothing was written", "this environment's site-packages"
    )


@pytest.fixture
def readonly_folder() -> Iterator[tuple[Path, tuple[str, ...]]]:
    """A folder the command cannot write to (mode 555), and the prefix that makes that hold for root."""
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        prefix = WITHOUT_DAC_OVERRIDE
    folder = Path(tempfile.mkdtemp(prefix="fsdp-shim-ro-"))
    os.chmod(folder, 0o555)
    try:
        yield folder, prefix
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(folder)


@pytest.mark.per_python
def test_a_read_only_folder(readonly_folder: tuple[Path, tuple[str, ...]]) -> None:
    folder, prefix = readonly_folder
    proc = shim("install", "--target", str(folder), "--force", prefix=prefix)
    assert_one_line_failure(proc, f"cannot write to {folder}", "Permission denied", "nothing was written")
    assert files_in(folder) == []  # no temporary file either


@pytest.mark.per_python
def test_a_read_only_site_packages(readonly_folder: tuple[Path, tuple[str, ...]], venv: Venv) -> None:
    """A virtual environment whose site-packages the user running the command cannot write."""
    _, prefix = readonly_folder
    before = files_in(venv.site_packages)
    os.chmod(venv.site_packages, 0o555)
    try:
        proc = shim("install", python=venv.python, prefix=prefix)
    finally:
        os.chmod(venv.site_packages, 0o755)
    assert_one_line_failure(proc, f"cannot write to {venv.site_packages}", "nothing was written. Use --target DIR")
    assert files_in(venv.site_packages) == before


@pytest.mark.per_python
def test_a_directory_at_one_of_the_names_writes_no_file(tmp_path: Path) -> None:
    """Every file or none, and no temporary file left behind."""
    folder = tmp_path / "site-packages"
    (folder / START_NAME).mkdir(parents=True)
    proc = shim("install", "--target", str(folder), "--force")
    assert_one_line_failure(proc, f"{START_NAME} exists and it is a directory", "nothing was written")
    assert files_in(folder) == [START_NAME]


@pytest.mark.per_python
def test_an_install_without_the_startup_modules_source_says_so_and_every_other_command_works(
    tmp_path: Path,
) -> None:
    """``install`` writes a copy of the start-up module's source; an install that holds only its
    ``.pyc`` cannot, and says so in one line instead of a traceback in every command."""
    import py_compile

    copy = tmp_path / "sourceless"
    for package in ("_fsdp_shim", "fsdp_shim"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "_fsdp_shim" / "__init__.py"
    py_compile.compile(str(init), cfile=str(init.with_suffix(".pyc")), doraise=True)  # a sourceless module
    init.unlink()
    env = clean_env(PYTHONPATH=str(copy))

    def command(*args: str) -> subprocess.CompletedProcess[str]:  # not from the checkout (-m puts cwd first)
        return run_command([sys.executable, "-m", "fsdp_shim", *args], env=env, cwd=tmp_path, timeout=300)

    loaded_from = [sys.executable, "-c", "import _fsdp_shim; print(_fsdp_shim.__file__)"]
    assert run_command(loaded_from, env=env, cwd=tmp_path).stdout.strip() == str(init.with_suffix(".pyc"))
    proc = command("install", "--target", str(tmp_path / "site"), "--force")
    assert_one_line_failure(proc, "no usable source for _fsdp_shim/__init__.py", "reinstall fsdp-shim")
    assert not (tmp_path / "site" / PTH_NAME).exists()
    assert command("--version").returncode == 0
    assert command("status").returncode in (0, 1)


# ----------------------------------------------------------------------------- links and files that are not ours
@pytest.mark.per_python
def test_a_link_planted_at_the_old_temporary_name_or_the_final_name_is_never_written_through(
    venv: Venv, tmp_path: Path
) -> None:
    """A symlink in a shared site-packages must not make install overwrite its target."""
    folder = venv.site_packages
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / ".fsdp_shim.pth.tmp").symlink_to(victim)  # the fixed temporary names 0.2.0 used
    (folder / ".fsdp_shim.start.tmp").symlink_to(victim)
    before = files_in(folder)
    proc = shim("install", python=venv.python)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "precious\n"
    for name, text in FILES.items():
        assert not (folder / name).is_symlink()
        assert (folder / name).read_text() == text
    assert files_in(folder) == sorted({*before, "__pycache__", *FILES})

    shim("uninstall", python=venv.python)
    (folder / PTH_NAME).symlink_to(victim)  # a link at the final name: refused, then replaced, not followed
    refused = shim("install", python=venv.python)
    assert_one_line_failure(refused, "refusing", PTH_NAME, "symbolic link", "nothing was written", "--force")
    assert (folder / PTH_NAME).is_symlink() and not (folder / START_NAME).exists() and not (folder / COPY_FILE).exists()
    forced = shim("install", "--force", python=venv.python)
    assert forced.returncode == 0, forced.stderr
    assert "replaced" in forced.stderr and "symbolic link" in forced.stderr
    assert victim.read_text() == "precious\n"
    assert not (folder / PTH_NAME).is_symlink() and (folder / PTH_NAME).read_text() == FILES[PTH_NAME]


@pytest.mark.per_python
@pytest.mark.parametrize("name", list(FILES))
def test_a_file_that_is_not_fsdp_shims_is_not_replaced_and_makes_uninstall_remove_nothing(
    name: str, venv: Venv
) -> None:
    """A file at one of the names without the marker line is someone else's: install does not replace
    it without ``--force``, and uninstall removes nothing at all (removing the copy and leaving a
    ``.pth`` that imports it would print a traceback at every interpreter start), exits 1 and names
    it (issue 26, item 4)."""
    folder = venv.site_packages
    foreign = f"# another tool's file that happens to be called {name}\n"
    (folder / name).write_text(foreign)
    refused = shim("install", python=venv.python)
    assert_one_line_failure(refused, "refusing", name, "fsdp-shim did not write it", "marker", "--force")
    assert [other for other in FILES if (folder / other).exists()] == [name]

    assert shim("install", "--force", python=venv.python).returncode == 0
    (folder / name).write_text(foreign)
    installed = {other: (folder / other).read_bytes() for other in FILES}
    pyc = compiled_copies(folder)
    proc = shim("uninstall", python=venv.python)
    assert proc.returncode == 1 and "removed" not in proc.stdout
    assert f"left {folder / name}: its first line is not fsdp-shim's marker" in proc.stderr
    assert {other: (folder / other).read_bytes() for other in FILES} == installed
    assert compiled_copies(folder) == pyc
    if name != COPY_FILE:  # the .pth still finds its copy: interpreters start as before
        quiet = venv.run("-c", "pass")
        assert quiet.stdout == "" and quiet.stderr == ""


@pytest.mark.per_python
def test_a_startup_file_saved_with_windows_line_endings_is_current(tmp_path: Path) -> None:
    """An editor that saves the files with CRLF line endings leaves files that still arm (site and the
    import system read them in universal-newline mode): they are this version's, not "edited"."""
    for name, text in dict(file_texts()).items():
        path = tmp_path / name
        path.write_bytes(text.replace("\n", "\r\n").encode())
        assert startup_files.inspect(path, text).kind == "current", name
        path.write_bytes(text.replace("\n", "\r\n").encode() + b"# edited\r\n")
        assert startup_files.inspect(path, text).kind == "ours", name


@pytest.mark.per_python
@pytest.mark.parametrize("kind", ["venv", "uv venv"])
def test_an_edited_startup_file_is_still_fsdp_shims_and_uninstall_removes_every_file(kind: str, tmp_path: Path) -> None:
    """Configuration management appends a comment to ``fsdp_shim.pth``. Its first line is still the
    marker: ``status`` calls it "not what this version writes", ``install`` rewrites it without
    ``--force``, and ``uninstall`` removes it with every other file of install's and the copy's
    ``.pyc``. The next ``python``, ``pip`` and ``fsdp-shim`` then print nothing of fsdp-shim's, and
    ``status`` and ``install`` agree with what uninstall did (issue 26, item 4). In a venv that uv made
    too (its ``lib64`` is a link to ``lib``); site reads a venv's start-up files twice in both."""
    venv = make_venv(tmp_path / "venv") if kind == "venv" else uv_venv(tmp_path / "uv")
    pth = venv.site_packages / PTH_NAME
    assert shim("install", python=venv.python).returncode == 0
    assert compiled_copies(venv.site_packages)
    edited = FILES[PTH_NAME] + "# managed by configuration management\n"
    pth.write_text(edited)

    status = shim("status", python=venv.python)
    assert status.returncode == 1
    assert f"PROBLEM: {pth} is fsdp-shim's but not what this version writes" in status.stdout
    reinstalled = shim("install", python=venv.python)
    assert reinstalled.returncode == 0, reinstalled.stderr
    assert reinstalled.stdout.splitlines() == [
        f"wrote {pth}",
        *(f"already installed: {venv.site_packages / name}" for name in FILES if name != PTH_NAME),
    ]
    assert pth.read_text() == FILES[PTH_NAME]
    assert finders(venv.python).count(FINDER) == 1

    pth.write_text(edited)
    removed = shim("uninstall", python=venv.python)
    assert removed.returncode == 0, removed.stderr
    assert sorted(removed.stdout.splitlines()) == sorted(f"removed {venv.site_packages / name}" for name in FILES)
    assert [name for name in FILES if (venv.site_packages / name).exists()] == []
    assert compiled_copies(venv.site_packages) == []
    # Each prints exactly its own output: nothing of a start-up file's. Compared whole, not searched for
    # "fsdp": pip's line names the folder it runs from, which a user's checkout or venv path may contain.
    pip_version = run_command([sys.executable, "-m", "pip", "--version"], env=clean_env(), check=True).stdout
    expected = {"pass": "", "pip": pip_version, "fsdp_shim": f"fsdp-shim {__version__}\n"}
    for command in (["-c", "pass"], ["-m", "pip", "--version"], ["-m", "fsdp_shim", "--version"]):
        proc = venv.run(*command, check=False)
        assert proc.returncode == 0 and proc.stderr == "", (command, proc.stderr)
        assert proc.stdout == expected[command[1]], (command, proc.stdout)
    assert FINDER not in finders(venv.python)

    report = shim("status", "--json", python=venv.python)
    assert report.returncode == 0, report.stdout
    assert '"startup_files": []' in report.stdout
    again = shim("install", python=venv.python)
    assert again.stdout.splitlines() == [f"wrote {venv.site_packages / name}" for name in FILES]


# ----------------------------------------------------------------------------- earlier versions' files
EARLIER_FILES = {
    "0.2.0": {PTH_NAME: "fsdp_shim-0.2.0-earlier.pth"},
    "unreleased, the .pth called arm()": {
        PTH_NAME: "fsdp_shim-unreleased-arm-call.pth",
        COPY_FILE: "_fsdp_shim_startup_file-unreleased.py.txt",
    },
    "5f37aee, a copy of _fsdp_shim_trampoline": {
        PTH_NAME: "fsdp_shim-5f37aee.pth",
        COPY_FILE: "_fsdp_shim_startup_file-5f37aee.py.txt",
        START_NAME: "fsdp_shim-5f37aee.start",
    },
}
"""Start-up files that earlier versions of fsdp-shim wrote, by the name each had in a site directory."""


def earlier_files(version: str) -> dict[str, str]:
    return {name: (ROOT / "tests" / "data" / data).read_text() for name, data in EARLIER_FILES[version].items()}


@pytest.mark.per_python
@pytest.mark.parametrize("version", list(EARLIER_FILES))
def test_a_file_from_an_earlier_version_is_upgraded_and_removed_without_force(version: str, venv: Venv) -> None:
    """Start-up files an earlier fsdp-shim wrote start with the marker line: they are ours to replace
    and remove, no ``--force``, and after the upgrade only this version's one finder is armed."""
    folder = venv.site_packages
    earlier = earlier_files(version)
    for name, text in earlier.items():
        assert text != FILES[name] and text.startswith(MARKER)
        (folder / name).write_text(text)
    assert EARLIER_FINDER in finders(venv.python), "the earlier files must arm their finder"
    proc = shim("install", python=venv.python)
    assert proc.returncode == 0 and "replaced" not in proc.stderr, proc.stderr
    assert {name: (folder / name).read_text() for name in FILES} == FILES
    armed = finders(venv.python)
    assert armed.count(FINDER) == 1 and EARLIER_FINDER not in armed
    for name, text in earlier.items():  # next to this version's files: a half-done upgrade
        (folder / name).write_text(text)
    assert shim("uninstall", python=venv.python).returncode == 0
    assert [name for name in FILES if (folder / name).exists()] == [] and compiled_copies(folder) == []


@pytest.mark.parametrize("entry", ["pth", "start"])
def test_the_files_of_0_2_0_still_patch_lightning_until_install_replaces_them(
    entry: str, layouts, tmp_path: Path
) -> None:
    """An upgrade with pip alone keeps 0.2.0's start-up files: its ``.pth``'s watcher imports
    ``_fsdp_shim_startup`` (and, where that is missing, let Lightning load unpatched without a word);
    its ``.start`` (Python 3.15+) calls ``_fsdp_shim_startup:arm_from_startup_file``. This release keeps
    both names: either arms it, every namespace is patched at its import, and status names the file."""
    if not layouts:
        pytest.skip("needs an installed Lightning")
    (tmp_path / PTH_NAME).write_text(earlier_files("0.2.0")[PTH_NAME])
    names = [name for layout in layouts.values() for name in NAMESPACES[layout.package]]
    start = (
        "site.addsitedir(sys.argv[1])"
        if entry == "pth"
        else "__import__('_fsdp_shim_startup').arm_from_startup_file()"  # what site does with the .start
    )
    code = (
        f"import importlib, json, site, sys; {start}; "
        "[importlib.import_module(name) for name in sys.argv[2:]]; "
        "from _fsdp_shim.activation import status; s = status(); "
        "print(json.dumps([s.sources, [(n.namespace, n.patched, n.activated_after_import) "
        "for n in s.namespaces if n.imported]]))"
    )
    proc = run_command([sys.executable, "-W", "ignore", "-c", code, str(tmp_path), *names], env=clean_env())
    assert proc.returncode == 0, proc.stderr
    sources, namespaces = json.loads(proc.stdout)
    assert sources == ["fsdp-shim 0.2.0's start-up file (`fsdp-shim install` replaces it)"]
    assert sorted(namespaces) == sorted([name, True, False] for name in names)


@pytest.mark.per_python
def test_status_names_a_module_the_startup_file_imports_in_place_of_its_copy(venv: Venv, tmp_path: Path) -> None:
    """``fsdp_shim.pth`` imports its copy by name: an earlier copy first on ``sys.path`` runs instead
    and arms nothing. No interpreter says so at start-up; ``fsdp-shim status`` names the file."""
    folder = venv.site_packages
    assert shim("install", python=venv.python).returncode == 0
    assert shim("status", python=venv.python).returncode == 0
    shadow = tmp_path / "on-pythonpath"
    shadow.mkdir()
    shadow_copy = shadow / COPY_FILE
    shadow_copy.write_text(earlier_files("unreleased, the .pth called arm()")[COPY_FILE])
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(shadow), clean_env().get("PYTHONPATH", "")])}
    assert FINDER not in finders(venv.python, env), "the shadowing copy must disarm the start-up file"
    proc = shim("status", python=venv.python, env=env)
    assert proc.returncode == 1
    assert f"{folder / PTH_NAME} imports {startup.COPY_NAME} by name and finds {shadow_copy}" in proc.stdout
    shadow_copy.write_text(FILES[COPY_FILE])  # a current copy there arms the shim just the same
    assert finders(venv.python, env).count(FINDER) == 1
    assert shim("status", python=venv.python, env=env).returncode == 0
    shadow_copy.unlink()
    (folder / COPY_FILE).unlink()
    proc = shim("status", python=venv.python, env=env)
    assert proc.returncode == 1
    assert f"imports {startup.COPY_NAME}, which is missing ({folder / COPY_FILE})" in proc.stdout


@pytest.mark.per_python
def test_concurrent_installs_into_one_folder_all_succeed(tmp_path: Path) -> None:
    """`srun fsdp-shim install` runs one install per task, all at once."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    script = (
        "import contextlib, pathlib, sys\n"
        "from _fsdp_shim.startup_files import write_files\n"
        "folder = pathlib.Path(sys.argv[1])\n"
        "for _ in range(30):\n"
        "    write_files(folder)\n"
        f"    for name in ({PTH_NAME!r}, {START_NAME!r}):\n"
        "        with contextlib.suppress(FileNotFoundError):\n"
        "            (folder / name).unlink()\n"
        "write_files(folder)\n"
    )
    command = [sys.executable, "-c", script, str(folder)]
    procs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=clean_env()) for _ in range(6)]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 6, errors
    assert files_in(folder) == sorted(["__pycache__", *FILES])
    assert {name: (folder / name).read_text() for name in FILES} == FILES


@pytest.mark.per_python
def test_a_user_site_install_is_not_read_under_python_s_or_i_as_the_docs_say(tmp_path: Path) -> None:
    """`install --user`, then `python -s`, PYTHONNOUSERSITE=1 or `python -I` (which implies -s): not
    armed, so the "cannot reach" table in docs/activation.md lists it, with what to do instead."""
    base_python = base_interpreter()
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"), PYTHONPATH=str(ROOT))
    installed = shim("install", "--user", env=env, python=base_python)
    if installed.returncode != 0:
        pytest.skip(f"this base interpreter does not read a user site: {installed.stderr}")
    armed = f"import sys; print([getattr(f, '__name__', '') for f in sys.meta_path].count({FINDER!r}))"
    runs = {
        "plain": ([base_python, "-c", armed], env),
        "-s": ([base_python, "-s", "-c", armed], env),
        "PYTHONNOUSERSITE": ([base_python, "-c", armed], {**env, "PYTHONNOUSERSITE": "1"}),
        "-I": ([base_python, "-I", "-c", armed], env),
    }
    seen = {name: run_command(cmd, env=e, check=True).stdout.strip() for name, (cmd, e) in runs.items()}
    assert seen == {"plain": "1", "-s": "0", "PYTHONNOUSERSITE": "0", "-I": "0"}
    rows = [
        line for line in (ROOT / "docs" / "activation.md").read_text().splitlines() if line.startswith("| `python -")
    ]
    no_user_site = next(row for row in rows if "PYTHONNOUSERSITE" in row)
    assert "`python -s`" in no_user_site and "not active if installed with" in no_user_site
    assert "`install --user`" in no_user_site
    isolated = next(row for row in rows if row.startswith("| `python -I`"))
    assert "not active if installed with" in isolated and "`install --user`" in isolated
    assert shim("uninstall", "--user", env=env, python=base_python).returncode == 0


# ----------------------------------------------------------------------------- what pip and uv install and remove
@pytest.mark.per_python
def test_the_wheel_ships_the_start_up_file_and_pip_uninstall_removes_everything(tmp_path: Path, wheel: Path) -> None:
    installed = PipVenv(tmp_path / "venv", wheel)
    text = (installed.site_packages / ENVIRONMENT_FILE).read_text()
    assert text == (ROOT / ENVIRONMENT_FILE).read_text()
    for child in ("verify_probe.py", "python_check.py"):  # children run these files by path
        assert (installed.site_packages / "_fsdp_shim" / "children" / child).is_file()
    assert (installed.site_packages / "_fsdp_shim" / "bootstrap" / "sitecustomize.py").is_file()
    assert (installed.site_packages / "_fsdp_shim_startup" / "__init__.py").is_file()  # for 0.2.0's file
    installed.pip("uninstall", "-y", "fsdp-shim")
    assert files_in(installed.site_packages) == installed.before


def test_uv_pip_uninstall_leaves_no_file_of_fsdp_shims(tmp_path: Path, wheel: Path) -> None:
    """uv installs the wheel and removes it again; in between, every module of both packages was
    imported with bytecode writing on (and ``python -m fsdp_shim``, and ``fsdp-shim run``'s bootstrap
    as the ``sitecustomize`` it is), so every ``__pycache__`` of theirs exists. uv removes what the
    wheel's record lists and the ``__pycache__`` folders of the packages it removes; it used to leave
    the top-level start-up modules' ``.pyc`` in site-packages' own ``__pycache__`` (issue 26, item 8)."""
    venv = uv_venv(tmp_path / "uv")
    venv.paths_file.write_text(f"{sysconfig.get_paths()['purelib']}\n")  # not the checkout: the wheel's files
    before = files_in(venv.site_packages)
    uv_pip = [UV, "pip", "--no-cache"]
    subprocess.run(
        [*uv_pip, "install", "-q", "--python", venv.python, "--no-deps", "--no-index", str(wheel)], check=True
    )
    env = clean_env(PYTHONDONTWRITEBYTECODE=None, FSDP_SHIM="1")
    every_module = (  # but those that need torch, where there is none (the sessions of another Python)
        "import importlib, importlib.util, pkgutil, _fsdp_shim, fsdp_shim\n"
        "for package in (_fsdp_shim, fsdp_shim):\n"
        "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not module.name.endswith('__main__'):\n"
        "            try:\n"
        "                importlib.import_module(module.name)\n"
        "            except ModuleNotFoundError as error:\n"
        "                if error.name != 'torch' or importlib.util.find_spec('torch'):\n"
        "                    raise\n"
    )
    venv.run("-c", every_module, env=env, cwd=tmp_path)
    venv.run("-m", "fsdp_shim", "--version", env=env, cwd=tmp_path)
    console_script = str(Path(venv.python).parent / "fsdp-shim")
    run_command([console_script, "run", venv.python, "-c", "pass"], env=env, cwd=tmp_path, check=True)
    compiled = [
        path for path in venv.site_packages.rglob("*.pyc") if "fsdp_shim" in str(path.relative_to(venv.site_packages))
    ]
    assert any(path.name.startswith("sitecustomize.") for path in compiled)
    assert any(path.name.startswith("__main__.") for path in compiled)
    assert any("children" in path.parts for path in compiled)
    subprocess.run([*uv_pip, "uninstall", "-q", "--python", venv.python, "fsdp-shim"], check=True)
    # Only the __pycache__ of a module that is not fsdp-shim's may be new (uv's _virtualenv.py on Python 3.9).
    assert set(files_in(venv.site_packages)) - set(before) <= {"__pycache__"}
    assert [path for path in venv.site_packages.rglob("*") if "fsdp" in path.name] == []


INSTALLED_STARTUP_FILES = ("fsdp_shim_env.pth", "fsdp_shim_env.start")


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout's files to install from (an editable install points into it; builds write in it)."""
    source = tmp_path_factory.mktemp("source") / "fsdp-shim"
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    in_git = subprocess.run(listing, cwd=ROOT, capture_output=True, text=True)
    names = in_git.stdout.splitlines() if in_git.returncode == 0 else []
    if (ROOT / "PKG-INFO").is_file() or not names:  # an unpacked sdist: every file is the project's
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for name in names:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    return source


def test_every_way_of_installing_places_the_start_up_files_and_uninstalling_removes_them(
    tmp_path: Path, source_tree: Path, wheel: Path
) -> None:
    """The build backend ships ``fsdp_shim_env.pth`` and ``.start`` in every wheel it builds (pyproject.toml:
    hatchling's force-include), so every installer puts them into site-packages with the package, records them,
    and removes them with it: pip from the sdist, pip's editable install in hatchling's two modes (a path file;
    ``dev-mode-exact``, an import hook), ``pip install --user``, ``uv pip install -e``. (The wheel with pip and
    with uv: the two tests above.) In each, ``FSDP_SHIM=1`` arms the shim in a fresh interpreter."""
    from _fsdp_shim._version import __version__

    build_env = clean_env(PYTHONPATH=None, SETUPTOOLS_SCM_PRETEND_VERSION=__version__)  # the copy has no git
    texts = {name: (ROOT / name).read_text() for name in INSTALLED_STARTUP_FILES}
    exact = tmp_path / "exact"
    shutil.copytree(source_tree, exact)
    table = "[tool.hatch.build.targets.wheel]\n"  # hatchling's other editable mode: an import hook, no path file
    pyproject = (exact / "pyproject.toml").read_text()
    assert pyproject.count(table) == 1
    (exact / "pyproject.toml").write_text(pyproject.replace(table, f"{table}dev-mode-exact = true\n"))
    if UV is None:
        pytest.skip("needs uv (it builds the sdist, and is one of the installers)")
    sdists = tmp_path / "sdist"
    build_sdist = [UV, "build", "-q", "--sdist", "--out-dir", str(sdists), str(source_tree)]
    subprocess.run(build_sdist, env=build_env, check=True)

    def check(python: str, site_packages: Path, install: list[str], uninstall: list[str], env: dict[str, str]) -> None:
        before = files_in(site_packages)
        run_command(install, env=env, cwd=tmp_path, check=True)
        assert {name: (site_packages / name).read_text() for name in INSTALLED_STARTUP_FILES} == texts, install
        arming = "import sys; print([getattr(f, '__name__', '') for f in sys.meta_path].count('fsdp_shim_finder'))"
        armed = run_command([python, "-c", arming], env={**env, "FSDP_SHIM": "1"}, cwd=tmp_path, check=True)
        assert armed.stdout.strip() == "1", install
        run_command(uninstall, env=env, cwd=tmp_path, check=True)
        left = [path for path in site_packages.rglob("*") if "fsdp" in path.name]
        assert set(files_in(site_packages)) - set(before) <= {"__pycache__"} and left == [], (install, left)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    site_packages = site_packages_of(python)
    uninstall = [*pip, "uninstall", "-y", "fsdp-shim"]
    run_command([*pip, "install", "editables"], check=True)  # dev-mode-exact's hook, which its wheel requires
    for install in (
        [*pip, "install", "--no-deps", str(next(sdists.glob("*.tar.gz")))],
        [*pip, "install", "--no-deps", "-e", str(source_tree)],
        [*pip, "install", "--no-deps", "-e", str(exact)],
    ):
        check(python, site_packages, install, uninstall, build_env)

    base = base_interpreter()
    user_env = {**build_env, "PYTHONUSERBASE": str(tmp_path / "userbase")}
    user_pip = [base, "-m", "pip", "--disable-pip-version-check", "-q"]
    user_site = Path(run_command([base, "-m", "site", "--user-site"], env=user_env, check=True).stdout.strip())
    user_site.mkdir(parents=True)
    install = [*user_pip, "install", "--user", "--no-deps", "--no-index", "--ignore-installed", str(wheel)]
    check(base, user_site, install, [*user_pip, "uninstall", "-y", "fsdp-shim"], user_env)

    uv_venv_root = tmp_path / "uv"
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(uv_venv_root)], check=True)
    uv_python = str(uv_venv_root / "bin" / "python")
    uv_pip = [UV, "pip", "--quiet"]
    install = [*uv_pip, "install", "--python", uv_python, "--no-deps", "-e", str(source_tree)]
    uninstall = [*uv_pip, "uninstall", "--python", uv_python, "fsdp-shim"]
    check(uv_python, site_packages_of(uv_python), install, uninstall, build_env)
