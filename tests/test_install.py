"""``fsdp-shim install`` / ``uninstall``: refuse to write where it would change nothing, and fail in
one line, with nothing half-written, where it cannot write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import packaging
import pytest
from conftest import ROOT, child_json, clean_env, run_command

from fsdp_shim.startup_files import COPY_MODULE, FILES, PTH_TEXT, START_TEXT

pytestmark = pytest.mark.release_independent

# Root writes anywhere: without these capabilities, a folder's mode binds root as well.
WITHOUT_DAC_OVERRIDE = (
    "setpriv",
    "--bounding-set=-dac_override,-dac_read_search",
    "--inh-caps=-dac_override,-dac_read_search",
)


def shim(
    *args: str, env: dict[str, str] | None = None, python: str = sys.executable, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return run_command([*prefix, python, "-m", "fsdp_shim", *args], env=env or clean_env(), timeout=120)


def assert_one_line_failure(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def startup_files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_a_target_this_python_does_not_read_is_refused_and_not_created(tmp_path: Path) -> None:
    typo = tmp_path / "site-pakages"
    proc = shim("install", "--target", str(typo))
    assert_one_line_failure(proc, "refusing", str(typo), "does not read start-up files", "--force")
    assert not typo.exists()
    forced = shim("install", "--target", str(typo), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (typo / "fsdp_shim.pth").read_text() == PTH_TEXT
    assert (typo / "fsdp_shim.start").read_text() == START_TEXT
    assert shim("uninstall", "--target", str(typo)).returncode == 0
    assert startup_files_in(typo) == []


def test_user_site_inside_a_virtual_environment_is_refused(tmp_path: Path) -> None:
    assert sys.prefix != sys.base_prefix, "the test suite runs in a virtual environment"
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"))
    proc = shim("install", "--user", env=env)
    assert_one_line_failure(proc, "refusing", "does not read the user site-packages", "--force")
    assert not (tmp_path / "userbase").exists()
    forced = shim("install", "--user", "--force", env=env)
    assert forced.returncode == 0, forced.stderr
    assert len(list((tmp_path / "userbase").rglob("fsdp_shim.pth"))) == 1
    assert shim("uninstall", "--user", env=env).returncode == 0
    assert list((tmp_path / "userbase").rglob("fsdp_shim.*")) == []


def test_a_target_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("not a folder\n")
    proc = shim("install", "--target", str(target), "--force")
    assert_one_line_failure(proc, f"{target} is not a directory", "nothing was written")
    assert target.read_text() == "not a folder\n"


def test_an_unusable_home_for_the_user_site(tmp_path: Path) -> None:
    """Outside a virtual environment (the base interpreter, which reads the user site) with HOME
    pointing at a file: the user site cannot be created."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = clean_env(HOME=str(home), PYTHONUSERBASE=None, PYTHONPATH=str(ROOT))
    base_python = getattr(sys, "_base_executable", sys.executable)
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


def test_a_read_only_folder(readonly_folder: tuple[Path, tuple[str, ...]]) -> None:
    folder, prefix = readonly_folder
    proc = shim("install", "--target", str(folder), "--force", prefix=prefix)
    assert_one_line_failure(proc, f"cannot write to {folder}", "Permission denied", "nothing was written")
    assert startup_files_in(folder) == []  # no temporary file either


def test_a_read_only_site_packages(readonly_folder: tuple[Path, tuple[str, ...]], tmp_path: Path) -> None:
    """A virtual environment whose site-packages the user running the command cannot write."""
    _, prefix = readonly_folder
    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
    python = str(environment / "bin" / "python")
    site_packages = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site_packages / "aa_outer_environment.pth").write_text(f"{ROOT}\n")
    os.chmod(site_packages, 0o555)
    try:
        proc = shim("install", python=python, prefix=prefix)
    finally:
        os.chmod(site_packages, 0o755)
    assert_one_line_failure(proc, f"cannot write to {site_packages}", "nothing was written. Use --target DIR")
    assert startup_files_in(site_packages) == ["aa_outer_environment.pth"]


# ---------------------------------------------------------------- links, foreign files, both or neither
@pytest.fixture
def site_packages(tmp_path: Path) -> tuple[str, Path]:
    """A new virtual environment's python and site-packages (a folder it reads start-up files from)."""
    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True)
    python = str(environment / "bin" / "python")
    folder = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (folder / "aa_outer_environment.pth").write_text(f"{ROOT}\n")
    return python, folder


def test_a_link_planted_at_the_old_temporary_name_or_the_final_name_is_never_written_through(
    site_packages: tuple[str, Path], tmp_path: Path
) -> None:
    """A symlink in a shared site-packages must not make install overwrite its target."""
    python, folder = site_packages
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / ".fsdp_shim.pth.tmp").symlink_to(victim)  # the fixed temporary name 0.2.0 used
    (folder / ".fsdp_shim.start.tmp").symlink_to(victim)
    proc = shim("install", python=python)
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "precious\n"
    for name, text in FILES.items():
        assert not (folder / name).is_symlink()
        assert (folder / name).read_text() == text
    assert startup_files_in(folder) == [
        ".fsdp_shim.pth.tmp",
        ".fsdp_shim.start.tmp",
        "__pycache__",
        f"{COPY_MODULE}.py",
        "aa_outer_environment.pth",
        "fsdp_shim.pth",
        "fsdp_shim.start",
    ]

    shim("uninstall", python=python)
    (folder / "fsdp_shim.pth").symlink_to(victim)  # a link at the final name: refused, then replaced, not followed
    refused = shim("install", python=python)
    assert_one_line_failure(refused, "refusing", "fsdp_shim.pth", "symbolic link", "nothing was written", "--force")
    assert (folder / "fsdp_shim.pth").is_symlink() and not (folder / "fsdp_shim.start").exists()
    forced = shim("install", "--force", python=python)
    assert forced.returncode == 0, forced.stderr
    assert "replaced" in forced.stderr and "symbolic link" in forced.stderr
    assert victim.read_text() == "precious\n"
    assert not (folder / "fsdp_shim.pth").is_symlink() and (folder / "fsdp_shim.pth").read_text() == PTH_TEXT


def test_a_foreign_startup_file_is_not_replaced_without_force_and_an_edited_one_not_removed(
    site_packages: tuple[str, Path],
) -> None:
    """Fsdp-shim replaces or removes only what it wrote, whole content compared."""
    python, folder = site_packages
    foreign = "# another tool's file that happens to be called fsdp_shim.pth\n"
    (folder / "fsdp_shim.pth").write_text(foreign)
    refused = shim("install", python=python)
    assert_one_line_failure(refused, "refusing", "fsdp_shim.pth", "not what fsdp-shim wrote", "--force")
    assert (folder / "fsdp_shim.pth").read_text() == foreign and not (folder / "fsdp_shim.start").exists()

    assert shim("uninstall", python=python).returncode == 1  # not ours: left, and said so
    assert (folder / "fsdp_shim.pth").read_text() == foreign

    (folder / "fsdp_shim.pth").unlink()
    assert shim("install", python=python).returncode == 0
    edited = PTH_TEXT + "# my own note\n"  # first line still fsdp-shim's marker
    (folder / "fsdp_shim.pth").write_text(edited)
    proc = shim("uninstall", python=python)
    assert proc.returncode == 1
    assert f"removed {folder / 'fsdp_shim.start'}" in proc.stdout
    assert f"left {folder / 'fsdp_shim.pth'}" in proc.stderr and "not what fsdp-shim wrote" in proc.stderr
    assert (folder / "fsdp_shim.pth").read_text() == edited


EARLIER_FILES = {
    "0.2.0": {"fsdp_shim.pth": "fsdp_shim-0.2.0-earlier.pth"},
    "unreleased, the .pth called arm()": {
        "fsdp_shim.pth": "fsdp_shim-unreleased-arm-call.pth",
        f"{COPY_MODULE}.py": "_fsdp_shim_startup_file-unreleased.py.txt",
    },
}
"""Start-up files that earlier versions of fsdp-shim wrote, by the name each had in a site directory."""


def earlier_files(version: str) -> dict[str, str]:
    return {name: (ROOT / "tests" / "data" / data).read_text() for name, data in EARLIER_FILES[version].items()}


def watchers_armed(python: str, env: dict[str, str]) -> int:
    """How many of the start-up file's finders a fresh interpreter has on ``sys.meta_path``."""
    _, finders = child_json("startup:modules_and_finders", python=python, env=env)
    return finders.count("fsdp_shim_watcher")


@pytest.mark.parametrize("version", list(EARLIER_FILES))
def test_a_file_from_an_earlier_version_is_upgraded_and_removed_without_force(
    version: str, site_packages: tuple[str, Path]
) -> None:
    """Start-up files an earlier fsdp-shim wrote are ours to replace and remove: no ``--force``."""
    python, folder = site_packages
    earlier = earlier_files(version)
    for name, text in earlier.items():
        assert text != FILES[name]
        (folder / name).write_text(text)
    assert watchers_armed(python, clean_env()) >= 1, "the earlier files must arm the shim"  # 0.2.0's: once a pass
    proc = shim("install", python=python)
    assert proc.returncode == 0 and "replaced" not in proc.stderr, proc.stderr
    assert {name: (folder / name).read_text() for name in FILES} == FILES
    assert watchers_armed(python, clean_env()) == 1
    for name, text in earlier.items():
        (folder / name).write_text(text)
    assert shim("uninstall", python=python).returncode == 0
    assert startup_files_in(folder) == ["aa_outer_environment.pth"]


def test_status_names_a_module_the_startup_file_imports_in_place_of_its_copy(
    site_packages: tuple[str, Path], tmp_path: Path
) -> None:
    """``fsdp_shim.pth`` imports its copy by name: an earlier copy first on ``sys.path`` runs instead
    and arms nothing. No interpreter says so at start-up; ``fsdp-shim status`` names the file."""
    python, folder = site_packages
    (folder / "zz_status_needs.pth").write_text(f"{Path(packaging.__file__).parent.parent}\n")  # packaging
    assert shim("install", python=python).returncode == 0
    assert shim("status", python=python).returncode == 0
    shadow = tmp_path / "on-pythonpath"
    shadow.mkdir()
    shadow_copy = shadow / f"{COPY_MODULE}.py"
    shadow_copy.write_text(earlier_files("unreleased, the .pth called arm()")[f"{COPY_MODULE}.py"])
    env = {**clean_env(), "PYTHONPATH": str(shadow)}
    assert watchers_armed(python, env) == 0, "the shadowing copy must disarm the start-up file"
    proc = shim("status", python=python, env=env)
    assert proc.returncode == 1
    assert f"{folder / 'fsdp_shim.pth'} imports {COPY_MODULE} by name and finds {shadow_copy}" in proc.stdout
    shadow_copy.write_text(FILES[f"{COPY_MODULE}.py"])  # a current copy there arms the shim just the same
    assert watchers_armed(python, env) == 1
    assert shim("status", python=python, env=env).returncode == 0
    shadow_copy.unlink()
    (folder / f"{COPY_MODULE}.py").unlink()
    proc = shim("status", python=python, env=env)
    assert proc.returncode == 1
    assert f"imports {COPY_MODULE}, which is missing ({folder / f'{COPY_MODULE}.py'})" in proc.stdout


def test_a_directory_at_one_of_the_names_writes_no_file(tmp_path: Path) -> None:
    """Every file or none, and no temporary file left behind."""
    folder = tmp_path / "site-packages"
    (folder / "fsdp_shim.start").mkdir(parents=True)
    proc = shim("install", "--target", str(folder), "--force")
    assert_one_line_failure(proc, "fsdp_shim.start exists and it is a directory", "nothing was written")
    assert startup_files_in(folder) == ["fsdp_shim.start"]


def test_concurrent_installs_into_one_folder_all_succeed(tmp_path: Path) -> None:
    """`srun fsdp-shim install` runs one install per task, all at once."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    script = (
        "import contextlib, pathlib, sys\n"
        "from fsdp_shim.startup_files import install\n"
        "folder = pathlib.Path(sys.argv[1])\n"
        "for _ in range(30):\n"
        "    install(folder)\n"
        "    for name in ('fsdp_shim.pth', 'fsdp_shim.start'):\n"
        "        with contextlib.suppress(FileNotFoundError):\n"
        "            (folder / name).unlink()\n"
        "install(folder)\n"
    )
    command = [sys.executable, "-c", script, str(folder)]
    procs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=clean_env()) for _ in range(6)]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 6, errors
    assert startup_files_in(folder) == ["__pycache__", f"{COPY_MODULE}.py", "fsdp_shim.pth", "fsdp_shim.start"]
    assert (folder / "fsdp_shim.pth").read_text() == PTH_TEXT


def test_a_user_site_install_is_not_read_under_python_s_as_the_docs_say(tmp_path: Path) -> None:
    """`install --user`, then `python -s` or PYTHONNOUSERSITE=1: not armed, so the
    "cannot reach" table in docs/activation.md lists it, with what to do instead."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    env = clean_env(PYTHONUSERBASE=str(tmp_path / "userbase"), PYTHONPATH=str(ROOT))
    installed = shim("install", "--user", env=env, python=base_python)
    if installed.returncode != 0:
        pytest.skip(f"this base interpreter does not read a user site: {installed.stderr}")
    armed = "import sys; print(any(getattr(f, '__name__', '') == 'fsdp_shim_watcher' for f in sys.meta_path))"
    runs = {
        "plain": ([base_python, "-c", armed], env),
        "-s": ([base_python, "-s", "-c", armed], env),
        "PYTHONNOUSERSITE": ([base_python, "-c", armed], {**env, "PYTHONNOUSERSITE": "1"}),
    }
    seen = {name: subprocess.check_output(cmd, env=e, text=True).strip() for name, (cmd, e) in runs.items()}
    assert seen == {"plain": "True", "-s": "False", "PYTHONNOUSERSITE": "False"}
    row = next(
        line for line in (ROOT / "docs" / "activation.md").read_text().splitlines() if "PYTHONNOUSERSITE" in line
    )
    assert "`python -s`" in row and "not active if installed with" in row and "`install --user`" in row
    assert shim("uninstall", "--user", env=env, python=base_python).returncode == 0


def test_an_install_without_the_trampolines_source_says_so_and_every_other_command_works(tmp_path: Path) -> None:
    """The start-up file imports a copy of ``_fsdp_shim_trampoline``'s source; an install holding only
    its ``.pyc`` cannot write the copy, and says so in one line instead of a traceback in every command."""
    import py_compile
    import shutil

    copy = tmp_path / "sourceless"
    shutil.copytree(ROOT / "fsdp_shim", copy / "fsdp_shim")
    shutil.copy(ROOT / "_fsdp_shim_startup.py", copy)
    py_compile.compile(str(ROOT / "_fsdp_shim_trampoline.py"), cfile=str(copy / "_fsdp_shim_trampoline.pyc"))
    env = clean_env(PYTHONPATH=str(copy))

    def command(*args: str) -> subprocess.CompletedProcess[str]:  # not from the checkout (-m puts cwd first)
        return run_command([sys.executable, "-m", "fsdp_shim", *args], env=env, cwd=tmp_path, timeout=120)

    proc = command("install", "--target", str(tmp_path / "site"), "--force")
    assert_one_line_failure(proc, "no usable source for _fsdp_shim_trampoline", "reinstall fsdp-shim")
    assert not (tmp_path / "site" / "fsdp_shim.pth").exists()
    assert command("--version").returncode == 0
    assert command("status").returncode in (0, 1)
