"""``fsdp-shim run`` warns about a launcher in its command that starts its own command without the shim.

Only the launcher chain at the start of the command counts (a launcher's options, then its command,
which may be a launcher again); the words after the first other program are that program's own, and
a ``&&`` among them is just a word (no shell runs between fsdp-shim run and its command). ``sudo -E``
with a bare command name warns: sudo deletes PYTHONPATH even then and finds the name on its
secure_path, so FSDP_SHIM alone may reach a Python without fsdp-shim (see ``_through_sudo``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

from _fsdp_shim.run import environment_warnings

pytestmark = pytest.mark.release_independent

# (the launcher the warning names, the command, the environment fsdp-shim run is started in)
WARNED = [
    ("srun", ["srun", "--export=MASTER_ADDR,PATH", "python", "train.py"], {}),
    ("srun", ["srun", "-N", "2", "--export", "NONE", "python", "train.py"], {}),
    ("srun", ["srun", "--ntasks-per-node", "8", "--export=NONE", "python"], {}),  # a long option's next word
    ("srun", ["srun", "--pty", "--export=NONE", "python"], {}),  # --pty takes no next word
    ("srun", ["srun", "--export=NONE,FSDP_SHIM=1", "python"], {}),  # NONE ends the list
    ("srun", ["srun", "--export=PYTHONPATH=/home/me/lib,PATH", "python"], {}),  # not fsdp-shim's PYTHONPATH
    ("srun", ["salloc", "-N", "2", "srun", "--export=NONE", "python"], {}),
    ("srun", ["srun", "--export=NONE", "env", "-i", "python"], {}),  # where it is lost first
    ("sbatch", ["sbatch", "--export=PATH", "job.sh"], {}),
    ("sbatch", ["sbatch", "-W", "--export=NONE", "job.sh"], {}),  # sbatch's -W takes no value
    ("env", ["env", "-i", "PATH=/usr/bin", "python", "train.py"], {}),
    ("env", ["env", "-u", "HOME", "-i", "python"], {}),
    ("env", ["env", "-", "python"], {}),
    ("env", ["env", "-i", "PYTHONPATH=/home/me/lib", "python"], {}),  # expanded before fsdp-shim run added its own
    ("env", ["srun", "--export=ALL", "env", "-i", "python"], {}),
    ("sudo", ["sudo", "python", "train.py"], {}),
    ("sudo", ["sudo", "-u", "bob", "python", "-E", "train.py"], {}),  # -E is python's
    ("sudo", ["sudo", "-uE", "python", "train.py"], {}),  # user "E", not -E
    ("sudo", ["sudo", "-gE", "python", "train.py"], {}),  # group "E"
    ("sudo", ["sudo", "--user", "bob", "python"], {}),
    ("sudo", ["sudo", "--preserve-env=HOME", "python"], {}),
    ("sudo", ["env", "-i", "FSDP_SHIM=1", "sudo", "python"], {}),
    # -E keeps FSDP_SHIM only: not enough for a bare name, which sudo looks up on its secure_path
    ("sudo", ["sudo", "-E", "python", "train.py"], {}),
    ("sudo", ["sudo", "--preserve-env", "python"], {}),
    ("sudo", ["sudo", "-Eu", "bob", "python"], {}),
    ("sudo", ["srun", "--export=PYTHONPATH", "sudo", "-E", "/opt/venv/bin/python"], {}),  # PYTHONPATH was all
    ("srun", ["srun", "python"], {"SLURM_EXPORT_ENV": "NONE"}),
    ("srun", ["srun", "python"], {"SLURM_EXPORT_ENV": "none"}),
    ("srun", ["srun", "python"], {"SLURM_EXPORT_ENV": "ALL", "SRUN_EXPORT_ENV": "NONE"}),  # SRUN_ overrides
    ("sbatch", ["sbatch", "job.sh"], {"SBATCH_EXPORT": "None"}),
]
# (the command, the environment fsdp-shim run is started in)
QUIET = [
    (["srun", "python", "train.py"], {}),
    (["srun", "--export=ALL", "python"], {}),
    (["srun", "--export=all", "python", "train.py"], {}),
    (["srun", "--export=All,FOO=1", "python", "train.py"], {}),
    (["srun", "--export=ALL,MASTER_ADDR=127.0.0.1", "python"], {}),
    (["srun", "--export=MASTER_ADDR,all", "python"], {}),  # ALL anywhere before a NONE
    (["srun", "--export=FSDP_SHIM=1,PATH", "python"], {}),
    (["srun", "--export=PYTHONPATH,PATH", "python"], {}),
    (["srun", "--export=NONE", "fsdp-shim", "run", "python", "train.py"], {}),
    (["srun", "-N", "2", "--ntasks-per-node", "8", "--export=NONE", "/opt/venv/bin/fsdp-shim", "run", "python"], {}),
    (["srun", "--export=NONE", "env", "FSDP_SHIM=1", "python", "train.py"], {}),
    (["srun", "--export=NONE", "env", "-i", "FSDP_SHIM=1", "python"], {}),
    (["salloc", "-N", "2", "srun", "python"], {}),
    (["salloc", "python"], {"SALLOC_EXPORT": "NONE"}),  # salloc has no --export and reads no such variable
    (["srun", "python"], {"SLURM_EXPORT_ENV": "ALL"}),
    (["srun", "python"], {"SLURM_EXPORT_ENV": "all"}),
    (["srun", "--export=ALL", "python"], {"SLURM_EXPORT_ENV": "NONE"}),  # the option wins
    (["sbatch", "job.sh"], {"SBATCH_EXPORT": "all"}),
    (["env", "FOO=1", "python", "-i"], {}),
    (["env", "-i", "FSDP_SHIM=1", "python"], {}),
    (["env", "-i", "FSDP_SHIM=0", "python"], {}),  # switched off on purpose
    (["env", "-i", "--", "FSDP_SHIM=1", "python"], {}),
    (["sudo", "FSDP_SHIM=1", "python", "train.py"], {}),
    (["sudo", "-u", "bob", "FSDP_SHIM=1", "-H", "python"], {}),  # sudo reads NAME=VALUE among its options
    (["sudo", "-E", "/opt/venv/bin/python", "train.py"], {}),
    (["sudo", "-Eu", "bob", "/opt/venv/bin/python"], {}),
    (["sudo", "-E", "fsdp-shim", "run", "python"], {}),
    (["sudo", "-E", "--preserve-env=PYTHONPATH", "python"], {}),
    (["sudo", "--preserve-env=PYTHONPATH,HOME", "python"], {}),
    (["sudo", "--preserve-env=PYTHONPATH,FSDP_SHIM", "python", "train.py"], {}),
    (["sudo", "--user", "bob", "--preserve-env=FSDP_SHIM", "python"], {}),
    (["srun", "--export=NONE", "env", "FSDP_SHIM=1", "sudo", "--preserve-env=FSDP_SHIM", "python"], {}),
    # words after the first program that is not a launcher are its own arguments
    (["python", "train.py", "--name", "sudo"], {}),
    (["python", "train.py", "env", "-i"], {}),
    (["./train.sh", "srun", "--export=NONE", "python"], {}),
    (["torchrun", "--nproc-per-node", "2", "train.py"], {}),
    (["torchrun", "--nproc-per-node", "2", "train.py", "&&", "srun", "--export=NONE", "x"], {}),  # no shell here
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py", "sudo", "x"], {}),
    (["mpirun", "-np", "2", "python", "train.py", "--launcher", "sudo"], {}),
]


def _id(command: list[str], environ: dict[str, str]) -> str:
    return " ".join([*(f"{name}={value}" for name, value in environ.items()), *command])


@pytest.mark.parametrize(("launcher", "command", "environ"), WARNED, ids=[_id(c, e) for _, c, e in WARNED])
def test_a_launcher_that_loses_the_shim_is_named(launcher: str, command: list[str], environ: dict) -> None:
    warnings = environment_warnings(command, environ)
    assert len(warnings) == 1 and warnings[0].startswith(f"`{launcher}"), warnings


@pytest.mark.parametrize(("command", "environ"), QUIET, ids=[_id(c, e) for c, e in QUIET])
def test_a_chain_that_passes_the_shim_on_is_not_warned_about(command: list[str], environ: dict) -> None:
    assert environment_warnings(command, environ) == []


@pytest.mark.parametrize("command", [["sudo", "python"], ["sudo", "-E", "python"], ["sudo", "-uE", "python"]])
def test_sudo_advice_keeps_pythonpath_and_never_offers_bare_dash_e(command: list[str]) -> None:
    """sudo deletes PYTHONPATH even with -E, and finds a bare name on secure_path: `sudo -E` is no fix."""
    (warning,) = environment_warnings(command, {})
    assert "`sudo --preserve-env=PYTHONPATH,FSDP_SHIM ...`" in warning
    assert "Use `sudo -E`" not in warning and "`sudo -E ...`" not in warning


def test_the_slurm_export_variable_counts_like_the_option() -> None:
    assert len(environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "NONE"})) == 1
    assert environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "ALL"}) == []
    (warning,) = environment_warnings(["sbatch", "job.sh"], {"SBATCH_EXPORT": "NONE"})
    assert "SBATCH_EXPORT=NONE" in warning  # says where the setting came from


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
    assert len(lines) == 1 and "`env -i` starts its command without FSDP_SHIM" in lines[0], proc.stderr
