"""``fsdp-shim run CMD``, as users run it: ``FSDP_SHIM=1`` unless set and the bootstrap ``sitecustomize`` first on
``PYTHONPATH``, the user's ``sitecustomize`` chained once, CMD exec'd (its exit code and signals its own), and a
bootstrap loud where it cannot arm, silent where the shim does not run at all (a Python older than 3.9)."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FSDP_SHIM, clean_env, code_json, make_venv, run_command

import _fsdp_shim

BOOTSTRAP = Path(_fsdp_shim.__file__).resolve().parent / "bootstrap"


@pytest.mark.per_python
def test_run_sets_the_switch_unless_set_puts_the_bootstrap_first_and_execs_the_command(tmp_path: Path) -> None:
    """The command gets ``FSDP_SHIM=1`` where it is unset (a value set stays, ``0`` too) and the bootstrap first
    on ``PYTHONPATH``, in the same process (exec): its exit code and signal are the command's (also after ``--``);
    a command that cannot start exits 127 or 126, as a shell's, and none at all is a usage error."""
    code = "import json, os; print(json.dumps([os.environ.get('FSDP_SHIM'), os.environ['PYTHONPATH'], os.getpid()]))"
    seen = {}
    for value in (None, "0", "on"):
        command = [FSDP_SHIM, "run", sys.executable, "-c", code]
        proc = subprocess.Popen(command, env=clean_env(FSDP_SHIM=value), stdout=subprocess.PIPE, text=True)
        switch, pythonpath, pid = json.loads(proc.communicate(timeout=120)[0])
        seen[value] = (switch, pythonpath.split(os.pathsep)[0], pid == proc.pid)
    assert seen == {value: (value or "1", str(BOOTSTRAP), True) for value in (None, "0", "on")}

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return run_command([FSDP_SHIM, "run", *command], cwd=tmp_path)

    assert run(sys.executable, "-c", "import sys; sys.exit(7)").returncode == 7
    assert run("--", sys.executable, "-c", "import sys; sys.exit(8)").returncode == 8  # `--` ends fsdp-shim's options
    killed = run(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert killed.returncode == -signal.SIGTERM
    not_executable = tmp_path / "job.sh"
    not_executable.write_text("#!/bin/sh\n")
    outcomes = [run(*command) for command in (["no-such-command-fsdp-shim"], [str(not_executable)], [])]
    assert [(proc.returncode, proc.stderr) for proc in outcomes] == [
        (127, "fsdp-shim run: command not found: no-such-command-fsdp-shim\n"),
        (126, f"fsdp-shim run: permission denied: {not_executable}\n"),
        (2, "fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]\n"),
    ]


USER_SITECUSTOMIZE = """\
import os, sys
with open({counter!r}, "a") as runs:  # one line per run: the pid, and the command line (the same pid after exec)
    runs.write(f"{{os.getpid()}} {{open('/proc/self/cmdline').read().split(chr(0))!r}}\\n")
sys.path.insert(0, {extra!r})
USER_MARKER = "the user's sitecustomize"
"""
A_PROCESS_UNDER_RUN = f"""\
import json, os, sys, sitecustomize, site_extra_module
print(json.dumps({{
    "sitecustomize": sitecustomize.USER_MARKER,
    "armed_by": sys.modules["_fsdp_shim"].ARMED_BY,
    "bootstrap_on_sys_path": [e for e in sys.path if os.path.realpath(e or ".") == {str(BOOTSTRAP)!r}],
    "module_in_cwd": __import__("module_in_cwd").__name__ if os.path.exists("module_in_cwd.py") else None,
}}))
"""


@pytest.mark.per_python
@pytest.mark.parametrize("form", ["module", "package"])
def test_run_chains_the_users_sitecustomize_once_keeping_its_sys_path_and_name(form: str, tmp_path: Path) -> None:
    """Under ``fsdp-shim run`` (a module, ``PYTHONPATH=:DIR``: the empty entry still the current folder) and ``fsdp-shim
    run fsdp-shim run`` (a package): the bootstrap arms, then the user's ``sitecustomize`` runs once per process, its
    ``sys.path`` entries stay, ``import sitecustomize`` gives it, and only the bootstrap folder leaves ``sys.path``."""
    counter, extra, user = tmp_path / "runs.txt", tmp_path / "site_extra", tmp_path / "user_site"
    extra.mkdir()
    (extra / "site_extra_module.py").write_text("")
    hook = user / ("sitecustomize.py" if form == "module" else "sitecustomize/__init__.py")
    hook.parent.mkdir(parents=True)
    hook.write_text(USER_SITECUSTOMIZE.format(counter=str(counter), extra=str(extra)))
    if form == "module":
        (tmp_path / "module_in_cwd.py").write_text("")
    env = clean_env()
    cwd_first = [""] if form == "module" else []  # an empty entry: the current folder
    env["PYTHONPATH"] = os.pathsep.join([*cwd_first, str(user), *filter(None, [env.get("PYTHONPATH")])])
    launcher = (FSDP_SHIM, "run") * (1 if form == "module" else 2)
    result = code_json(A_PROCESS_UNDER_RUN, env=env, launcher=launcher, cwd=tmp_path)
    assert result == {
        "sitecustomize": "the user's sitecustomize",
        "armed_by": ["FSDP_SHIM=1 (start-up file installed with the package)", "fsdp-shim run"],  # .pth first
        "bootstrap_on_sys_path": [],
        "module_in_cwd": "module_in_cwd" if form == "module" else None,
    }
    runs = counter.read_text().splitlines()
    command_lines = [ast.literal_eval(line.partition(" ")[2]) for line in runs]
    assert len(runs) == len(set(runs)) == len(launcher) // 2 + 1, runs  # every fsdp-shim, then the command: once
    assert [line[1].endswith("child.py") for line in command_lines] == [False] * (len(runs) - 1) + [True]


A_LIGHTNING_IMPORT = """\
import sys, wave, json
print("other imports pass", flush=True)
for name in ("lightning", "pytorch_lightning"):
    try:
        __import__(name)
    except ImportError as error:
        print(f"{type(error).__name__}: {error}")
"""


@pytest.mark.per_python
def test_run_into_an_interpreter_without_the_shim_is_loud_at_its_first_lightning_import(tmp_path: Path) -> None:
    """``fsdp-shim run`` starting another environment's Python, which lacks fsdp-shim (and Lightning): other imports
    pass, the first Lightning import says once on stderr that the bootstrap could not arm, or in strict mode fails
    with that message."""
    other = make_venv(tmp_path / "other", [])
    said = "fsdp-shim run: the shim could not be armed in " + other.python
    env = clean_env(PYTHONPATH=None)
    command = [FSDP_SHIM, "run", other.python, "-c", A_LIGHTNING_IMPORT]
    proc = run_command(command, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr.count("fsdp-shim run:") == 1 and said in proc.stderr, proc.stderr
    assert proc.stdout.splitlines() == [
        "other imports pass",
        "ModuleNotFoundError: No module named 'lightning'",
        "ModuleNotFoundError: No module named 'pytorch_lightning'",
    ]
    strict = run_command(command, env={**env, "FSDP_SHIM_STRICT": "1"}, cwd=tmp_path)
    assert strict.returncode == 0 and strict.stderr == "", strict.stderr
    first, second = strict.stdout.splitlines()[1:]
    assert first.startswith(f"ImportError: {said}") and first.endswith(
        "FSDP_SHIM_STRICT is on, so this import fails instead."
    )
    assert second == "ModuleNotFoundError: No module named 'pytorch_lightning'"


PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
OLD_PYTHONS = {
    v: max(map(str, PYENV_VERSIONS.glob(f"{v}.*/bin/python{v}")), default=None) for v in ("2.7", "3.6", "3.7", "3.8")
}
"""Each Python older than 3.9 this machine has (pyenv's too, active or not), by version."""


@pytest.mark.per_python
@pytest.mark.parametrize(("version", "python"), OLD_PYTHONS.items(), ids=list(OLD_PYTHONS))
def test_the_bootstrap_is_silent_and_chains_under_a_python_the_shim_does_not_support(
    version: str, python: str | None, tmp_path: Path
) -> None:
    """``fsdp-shim run`` starting Python 2.7 or 3.6-3.8: the bootstrap parses there, arms nothing, says nothing,
    and runs the ``sitecustomize`` it shadows."""
    if python is None:
        pytest.skip(f"no Python {version} here (pyenv install {version})")
    (tmp_path / "sitecustomize.py").write_text("CHAINED = True\n")
    code = "import sys, sitecustomize; sys.stdout.write(repr([sitecustomize.CHAINED, '_fsdp_shim' in sys.modules]))"
    pythonpath = os.pathsep.join([str(tmp_path), str(BOOTSTRAP.parent.parent)])  # the shim importable, not imported
    env = clean_env(PYTHONPATH=pythonpath, PYTHONDONTWRITEBYTECODE="1")  # 2.7 writes its .pyc beside the source
    proc = run_command([FSDP_SHIM, "run", python, "-c", code], env=env, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[True, False]", "")
