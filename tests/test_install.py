"""``fsdp-shim install`` / ``uninstall``: refuse to write where it would change nothing, and fail in
one line, with nothing half-written, where it cannot write (issue 8, items 13 and 14)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

from fsdp_shim.startup_files import PTH_TEXT, START_TEXT

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
    return subprocess.run(
        [*prefix, python, "-m", "fsdp_shim", *args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        cwd=ROOT,
        timeout=120,
    )


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
