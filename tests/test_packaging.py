"""What an install of the wheel puts into an environment and what uninstalling takes out again, with pip and uv:
the packages, and the start-up files ``fsdp_shim_env.pth`` and ``fsdp_shim_env.start`` at the top of
site-packages, which arm the shim where ``FSDP_SHIM=1``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, make_venv, run_command

UV = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
STARTUP_FILES = ("fsdp_shim_env.pth", "fsdp_shim_env.start")
ARMED = "import sys; print([getattr(f, '__name__', '') for f in sys.meta_path].count('fsdp_shim_finder'))"
EVERY_MODULE = """\
import importlib, pkgutil, _fsdp_shim, fsdp_shim
for package in (_fsdp_shim, fsdp_shim):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith("__main__"):
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as error:  # those that import torch
                if error.name != "torch":
                    raise
"""
"""Imports every module of both packages, so that each ``__pycache__`` of theirs exists for an uninstaller to take."""


def files_in(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def fsdp_shims_files(site_packages: Path) -> list[Path]:
    return [path for path in site_packages.rglob("*") if "fsdp" in str(path.relative_to(site_packages))]


@pytest.mark.per_python
def test_the_wheel_ships_the_start_up_files_and_pip_and_uv_uninstall_remove_every_file(
    tmp_path: Path, wheel: Path
) -> None:
    """pip installs the packages, every file of the source's, and both start-up files as they are in the source,
    and ``FSDP_SHIM=1`` arms the shim; ``pip uninstall`` leaves site-packages as it was before. uv then installs the
    wheel into the same environment; every module is imported with bytecode writing on (``python -m fsdp_shim``,
    and ``fsdp-shim run``'s bootstrap as the ``sitecustomize`` it is); ``uv pip uninstall`` leaves no file of
    fsdp-shim's, compiled ones included."""
    dependencies = tmp_path / "dependencies"  # fsdp-shim's, without the fsdp-shim this environment has installed
    dependencies.mkdir()
    for name in ("wrapt", "packaging"):
        (dependencies / name).symlink_to(importlib.util.find_spec(name).submodule_search_locations[0])
    venv = make_venv(tmp_path / "venv", [str(dependencies)])
    site_packages, env = venv.site_packages, clean_env(PYTHONPATH=None, PYTHONDONTWRITEBYTECODE=None)
    before = files_in(site_packages)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", venv.python]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", str(wheel)], check=True, env=env)
    assert {name: (site_packages / name).read_text() for name in STARTUP_FILES} == {
        name: (ROOT / name).read_text() for name in STARTUP_FILES
    }
    for package in ("_fsdp_shim", "fsdp_shim"):  # children and the bootstrap are run by path
        source = {
            p.relative_to(ROOT) for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        }
        installed = {p.relative_to(site_packages) for p in (site_packages / package).rglob("*") if p.suffix != ".pyc"}
        assert source <= installed, source - installed
    armed = run_command([venv.python, "-c", ARMED], env={**env, "FSDP_SHIM": "1"}, cwd=tmp_path, check=True)
    assert armed.stdout == "1\n"
    subprocess.run([*pip, "uninstall", "-y", "fsdp-shim"], check=True, env=env)
    assert files_in(site_packages) == before and fsdp_shims_files(site_packages) == []

    if UV is None:
        pytest.skip("needs uv for uv pip install and uninstall (pip's: done)")
    uv_pip = [UV, "pip", "--quiet", "--no-cache"]
    subprocess.run([*uv_pip, "install", "--python", venv.python, "--no-deps", "--no-index", str(wheel)], check=True)
    on = {**env, "FSDP_SHIM": "1"}
    venv.run("-c", EVERY_MODULE, env=on, cwd=tmp_path)
    venv.run("-m", "fsdp_shim", "--version", env=on, cwd=tmp_path)
    run_command([str(Path(venv.python).parent / "fsdp-shim"), "run", venv.python, "-c", "pass"], env=on, check=True)
    compiled = [path for path in fsdp_shims_files(site_packages) if path.suffix == ".pyc"]
    assert {"sitecustomize", "__main__"} <= {path.name.partition(".")[0] for path in compiled}
    subprocess.run([*uv_pip, "uninstall", "--python", venv.python, "fsdp-shim"], check=True)
    assert files_in(site_packages) == before and fsdp_shims_files(site_packages) == []
