"""Issue 17: the ``fsdp-shim`` command's children run no code from the current folder, use their own
channel for results, and every failure is one line with the documented exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

FSDP_SHIM = str(Path(sys.executable).with_name("fsdp-shim"))  # the console script, as users run it

PLANTED = """\
import importlib, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "RAN-" + __name__), "a") as marker:
    marker.write(f"{os.getpid()} {sys.argv}\\n")
# Then step aside for the real module, so whatever imported it still works.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)
"""


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FSDP_SHIM, *args], capture_output=True, text=True, cwd=cwd, env=env or clean_env(), timeout=900
    )


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A folder holding a ``yaml.py`` and a ``packaging.py`` that record every process importing them."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("yaml", "packaging"):
        (folder / f"{name}.py").write_text(PLANTED)
    control = subprocess.run([sys.executable, "-c", "import yaml"], cwd=folder, env=clean_env(), timeout=60)
    assert control.returncode == 0 and (folder / "RAN-yaml").exists(), "the planted module must work"
    (folder / "RAN-yaml").unlink()
    return folder


def markers(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.glob("RAN-*")}


@pytest.mark.release_independent
def test_status_python_check_runs_no_code_from_the_current_folder(planted: Path) -> None:
    proc = cli("status", "--python-check", "--json", cwd=planted)
    assert markers(planted) == {}
    report = json.loads(proc.stdout)
    assert report["child"]["imported"], report  # the child did import Lightning
    assert proc.returncode in (0, 1), proc.stderr


def test_verify_probes_run_no_code_from_the_current_folder(planted: Path) -> None:
    proc = cli("verify", "--steps", "1", "--json", cwd=planted)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert markers(planted) == {}
    assert json.loads(proc.stdout)["verdict"] in ("fixed", "not needed")
