"""``FSDP_SHIM=1`` alone activates the shim, and ``fsdp-shim run`` says when a launcher drops it.

The start-up file ``fsdp_shim_env.pth`` ships in the wheel: these tests install a wheel built from
this checkout into fresh virtual environments, as users get it, and remove it with ``pip uninstall``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT, Layout, affected_layout, clean_env

import _fsdp_shim_startup as startup
from fsdp_shim.runner import environment_warnings
from fsdp_shim.startup_files import ENVIRONMENT_FILE

pytestmark = pytest.mark.release_independent

CHILD = str(ROOT / "tests" / "child.py")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built from a copy (a build writes build/ and *.egg-info where it runs)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        path = ROOT / os.fsdecode(name)
        if path.is_file():
            target = source / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work), str(source)], check=True)
    return next(work.glob("fsdp_shim-*.whl"))


class Installed:
    """A virtual environment with pip and the wheel installed; torch, wrapt and Lightning come from
    this environment through a plain path file (no start-up code of theirs runs)."""

    def __init__(self, root: Path, wheel: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        self.python = str(root / "bin" / "python")
        self.site_packages = Path(
            subprocess.check_output([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
            .decode()
            .strip()
        )
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        outer = [str(ROOT / p) for p in paths] + [sysconfig.get_paths()["purelib"]]
        (self.site_packages / "aa_outer_environment.pth").write_text("".join(f"{p}\n" for p in outer))
        self.before = sorted(p.name for p in self.site_packages.iterdir())
        self.pip("install", "--no-deps", "--no-index", str(wheel))

    def pip(self, *args: str) -> None:
        subprocess.run([self.python, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)

    def probe(self, *python_args: str, env: dict[str, str], cwd: Path) -> dict:
        """What Lightning's import left: the shim loaded or not, how it was armed, what is patched."""
        proc = subprocess.run(
            [self.python, *python_args, CHILD, "--sys-path", str(ROOT / "tests"), "children.startup:probe"],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture
def installed(tmp_path: Path, wheel: Path) -> Installed:
    return Installed(tmp_path / "venv", wheel)


def test_the_wheel_ships_the_start_up_file_and_pip_uninstall_removes_everything(installed: Installed) -> None:
    text = (installed.site_packages / ENVIRONMENT_FILE).read_text()
    assert text == (ROOT / ENVIRONMENT_FILE).read_text()
    for child in ("verify_probe.py", "python_check.py"):  # children run these files by path
        assert (installed.site_packages / "fsdp_shim" / "_children" / child).is_file()
    installed.pip("uninstall", "-y", "fsdp-shim")
    assert sorted(p.name for p in installed.site_packages.iterdir()) == installed.before


@pytest.mark.parametrize("python_args", [(), ("-I",)], ids=["plain", "isolated"])
def test_fsdp_shim_1_alone_arms_the_shim(
    installed: Installed, layouts: dict[str, Layout], tmp_path: Path, python_args: tuple[str, ...]
) -> None:
    """No import, no wrapper, no `fsdp-shim install`; `python -I` ignores PYTHON* variables but not it."""
    affected_layout(layouts, "lightning")
    on = installed.probe(*python_args, env=clean_env(FSDP_SHIM="1"), cwd=tmp_path)
    assert on["loaded"] and on["sources"] == [startup.ENVIRONMENT_SOURCE]
    assert on["patched"]["lightning.pytorch"] is True and on["shim_layers"] == 1
    assert installed.probe(*python_args, env=clean_env(), cwd=tmp_path)["loaded"] is False
    off = installed.probe(*python_args, env=clean_env(FSDP_SHIM="0"), cwd=tmp_path)
    assert off["loaded"] is False


def test_with_the_variable_unset_nothing_is_imported(installed: Installed, tmp_path: Path) -> None:
    code = "import sys; print(sorted(m for m in sys.modules if 'fsdp' in m))"
    proc = subprocess.run(
        [installed.python, "-c", code], capture_output=True, text=True, env=clean_env(), cwd=tmp_path, check=True
    )
    assert proc.stdout.strip() == "[]" and proc.stderr == ""


def test_an_unreadable_value_loads_the_shim_only_to_say_it_is_off(
    installed: Installed, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    affected_layout(layouts, "lightning")
    result = installed.probe(env=clean_env(FSDP_SHIM="maybe"), cwd=tmp_path)
    assert result["loaded"] and result["patched"]["lightning.pytorch"] is False
    assert any("FSDP_SHIM='maybe' is not a valid value" in w for w in result["shim_warnings"])


def test_run_reaches_a_job_script_that_overwrites_pythonpath(
    installed: Installed, layouts: dict[str, Layout], tmp_path: Path
) -> None:
    """`fsdp-shim run ./job.sh` where job.sh sets PYTHONPATH=... drops the bootstrap; FSDP_SHIM=1 stays."""
    affected_layout(layouts, "lightning")
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/sh\n"
        f"export PYTHONPATH={os.environ.get('PYTHONPATH', '')}\n"
        f"exec {installed.python} {CHILD} --sys-path {ROOT / 'tests'} children.startup:probe\n"
    )
    job.chmod(0o755)
    fsdp_shim = str(Path(installed.python).parent / "fsdp-shim")
    proc = subprocess.run(
        [fsdp_shim, "run", str(job)], capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["sources"] == [startup.ENVIRONMENT_SOURCE]
    assert result["patched"]["lightning.pytorch"] is True


WARNED = [
    ["srun", "--export=MASTER_ADDR,PATH", "python", "train.py"],
    ["srun", "-N", "2", "--export", "NONE", "python", "train.py"],
    ["sbatch", "--export=PATH", "job.sh"],
    ["env", "-i", "PATH=/usr/bin", "python", "train.py"],
    ["env", "-u", "HOME", "-i", "python"],
    ["sudo", "python", "train.py"],
    ["sudo", "-u", "bob", "python", "-E", "train.py"],
    ["torchrun", "--nproc-per-node", "2", "train.py", "&&", "srun", "--export=NONE", "x"],
]
QUIET = [
    ["srun", "python", "train.py"],
    ["srun", "--export=ALL", "python"],
    ["srun", "--export=ALL,MASTER_ADDR=127.0.0.1", "python"],
    ["srun", "--export=FSDP_SHIM=1,PATH", "python"],
    ["srun", "--export=PYTHONPATH,PATH", "python"],
    ["env", "FOO=1", "python", "-i"],
    ["env", "-i", "FSDP_SHIM=1", "python"],
    ["sudo", "-E", "python"],
    ["sudo", "--preserve-env", "python"],
    ["sudo", "--preserve-env=PYTHONPATH,HOME", "python"],
    ["torchrun", "--nproc-per-node", "2", "train.py"],
]


@pytest.mark.parametrize("command", WARNED, ids=" ".join)
def test_launchers_that_drop_the_environment_are_named(command: list[str]) -> None:
    warnings = environment_warnings(command, {})
    assert len(warnings) == 1
    launcher = os.path.basename(next(word for word in command if word in ("srun", "sbatch", "env", "sudo")))
    assert f"`{launcher}" in warnings[0]


@pytest.mark.parametrize("command", QUIET, ids=" ".join)
def test_launchers_that_keep_the_environment_are_not_warned_about(command: list[str]) -> None:
    assert environment_warnings(command, {}) == []


def test_the_slurm_export_variable_counts_like_the_option() -> None:
    assert len(environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "NONE"})) == 1
    assert environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "ALL"}) == []


def test_run_prints_the_warning_once_before_the_command_starts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_shim", "run", "env", "-i", sys.executable, "-c", "print('ran')"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fsdp-shim run: warning")]
    assert len(lines) == 1 and "`env -i` starts its command with an empty environment" in lines[0], proc.stderr


def test_run_sets_fsdp_shim_1_unless_it_is_set(tmp_path: Path) -> None:
    code = "import os; print(os.environ.get('FSDP_SHIM'))"
    for env, expected in ((clean_env(), "1"), (clean_env(FSDP_SHIM="0"), "0"), (clean_env(FSDP_SHIM="on"), "on")):
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp_shim", "run", sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.stdout.strip() == expected, proc.stderr
