"""The ``fsdp-shim`` command: status, help and run's launcher warnings. Its children run no code from
the current folder and use their own channel for results; every failure is one line with the
documented exit code. (``verify``'s own are in ``test_verify.py``.)"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FSDP_SHIM, ROOT, clean_env, run_command

from _fsdp_shim.run import environment_warnings


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_command([FSDP_SHIM, *args], cwd=cwd, env=env or clean_env(), timeout=900)


def markers(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.glob("RAN-*")}


@pytest.mark.usefixtures("lightning_installed")
def test_status_python_check_runs_no_code_from_the_current_folder(planted: Path) -> None:
    proc = cli("status", "--python-check", "--json", cwd=planted)
    assert markers(planted) == {}
    report = json.loads(proc.stdout)
    assert report["child"]["imported"], report  # the child did import Lightning
    assert proc.returncode in (0, 1), proc.stderr


# ----------------------------------------------------------------------------- crashes and messages
@pytest.mark.per_python
def test_status_python_check_survives_a_sitecustomize_that_prints_at_exit(tmp_path: Path) -> None:
    folder = tmp_path / "site-hooks"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import atexit\natexit.register(print, 'goodbye from sitecustomize')\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    proc = cli("status", "--python-check", env=env)
    assert "Traceback" not in proc.stderr and "JSONDecodeError" not in proc.stderr, proc.stderr
    assert "A fresh interpreter (imports Lightning, not fsdp_shim):" in proc.stdout
    assert proc.returncode == 0, proc.stdout


@pytest.mark.per_python
def test_an_ascii_terminal_gets_help_and_the_setuptools_hint_without_a_crash() -> None:
    from _fsdp_shim.distributions import describe_import_failure

    for args in (["--help"], ["verify", "--help"], ["status"]):
        proc = cli(*args, env=clean_env(PYTHONIOENCODING="ascii"))
        assert proc.returncode in (0, 1) and proc.stderr == "", (args, proc.stderr)
    hint = describe_import_failure(
        "lightning", ["ModuleNotFoundError", "No module named 'pkg_resources'", "pkg_resources"]
    )
    assert "needs setuptools<81" in hint and hint.isascii()


NO_TEMPORARY_FOLDER = (
    "import sys, tempfile\n"
    "tempfile.tempdir = sys.argv[1]  # what gettempdir() finds when no candidate folder is usable\n"
    "from _fsdp_shim.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


@pytest.mark.per_python
@pytest.mark.parametrize("command", [["verify"], ["status", "--python-check"]])
def test_no_usable_temporary_folder_is_one_line_and_exit_2(
    command: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if command == ["verify"]:
        request.getfixturevalue("lightning_installed")  # without Lightning, verify stops before it needs one
    missing = str(tmp_path / "no-such-folder")
    proc = subprocess.run(
        [sys.executable, "-c", NO_TEMPORARY_FOLDER, missing, *command],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable temporary folder" in lines[0] and missing in lines[0], proc.stderr


@pytest.mark.per_python
def test_a_reader_that_goes_away_ends_status_quietly() -> None:
    """``fsdp-shim status | head -1``: the pipe's reader is gone before the report is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [FSDP_SHIM, "status"], stdout=write, stderr=subprocess.PIPE, text=True, env=clean_env(), timeout=120
        )
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


BOOTSTRAP = ROOT / "_fsdp_shim" / "bootstrap" / "sitecustomize.py"
AN_OLD_PYTHON = """\
import importlib.util, json, sys
sys.version_info = (2, 7, 18, "final", 0)  # what `fsdp-shim run python2.7 ...` starts the bootstrap in
sys.path.insert(0, sys.argv[1])  # the environment's own sitecustomize, which the bootstrap shadows
spec = importlib.util.spec_from_file_location("sitecustomize", sys.argv[2])  # as `site` imports it
sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({"armed": "_fsdp_shim" in sys.modules, "chained": sys.modules["sitecustomize"].CHAINED}))
"""


@pytest.mark.per_python
def test_the_bootstrap_is_silent_and_chains_under_a_python_the_shim_does_not_support(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("CHAINED = True\n")
    proc = subprocess.run(
        [sys.executable, "-S", "-c", AN_OLD_PYTHON, str(tmp_path), str(BOOTSTRAP)],
        capture_output=True,
        text=True,
        env=clean_env(PYTHONPATH=None),
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout) == {"armed": False, "chained": True}


@pytest.mark.per_python
def test_the_bootstrap_parses_under_old_pythons() -> None:
    """No syntax newer than Python 2.7 / 3.0: an old interpreter must not print "'import sitecustomize' failed"."""
    import ast

    source = BOOTSTRAP.read_text()
    newer = (ast.JoinedStr, ast.AnnAssign, ast.NamedExpr, ast.Nonlocal, ast.AsyncFunctionDef, ast.YieldFrom)
    for node in ast.walk(ast.parse(source)):
        assert not isinstance(node, newer), ast.dump(node)[:200]
        if isinstance(node, ast.FunctionDef):
            assert node.returns is None and not node.args.kwonlyargs, node.name
        if isinstance(node, ast.arg):
            assert node.annotation is None, node.arg
    assert "from __future__ import annotations" not in source


@pytest.mark.parametrize("value", ["0", "off"])
def test_status_with_the_shim_switched_off_says_so(value: str) -> None:
    if json.loads(cli("status", "--json").stdout)["nothing_to_patch"]:
        pytest.skip("no torch and no Lightning here: status ends with that instead (the isolated-install test)")
    proc = cli("status", env=clean_env(FSDP_SHIM=value))
    assert proc.returncode == 0, proc.stdout
    assert f"FSDP_SHIM={value!r} (the shim is OFF: Lightning runs as shipped)" in proc.stdout
    assert proc.stdout.splitlines()[2] == (
        f"Shim: OFF. FSDP_SHIM={value!r} switches off every activation: Lightning runs as shipped."
    )
    assert "would be patched" not in proc.stdout and "ARMED" not in proc.stdout
    assert proc.stdout.rstrip().endswith(
        f"OK: no problem found; the shim is OFF (FSDP_SHIM={value!r}), so nothing is patched"
    )
    assert json.loads(cli("status", "--json", env=clean_env(FSDP_SHIM=value)).stdout)["armed"]["state"] == "off"


def test_status_says_whether_the_shim_is_armed_and_what_would_arm_it() -> None:
    """Unset, ``FSDP_SHIM`` neither arms nor switches off: ``status`` says first that nothing arms the
    shim here, and lists what would, rather than "shim on" above "OK" (a reader takes it as active).
    ``FSDP_SHIM=1`` arms it where this interpreter reads ``fsdp_shim_env.pth``."""
    if json.loads(cli("status", "--json").stdout)["nothing_to_patch"]:
        pytest.skip("no torch and no Lightning here: status says so instead (the isolated-install test)")
    unset = cli("status", env=clean_env())
    lines = unset.stdout.splitlines()
    assert lines[2] == "Shim: NOT ARMED in a Python started from here: nothing arms it. Any one of these arms it:"
    ways = [line.split()[0:2] for line in lines[3:7]]
    assert ["import", "fsdp_shim"] in ways and ["fsdp-shim", "install"] in ways and ["fsdp-shim", "run"] in ways
    assert "FSDP_SHIM unset (1 arms the shim, 0 switches it off)" in lines
    assert "shim on" not in unset.stdout and "OK: consistent" not in unset.stdout
    report = json.loads(cli("status", "--json", env=clean_env()).stdout)
    assert report["armed"] == {"state": "not armed", "by": []}

    on = cli("status", env=clean_env(FSDP_SHIM="1"))
    on_report = json.loads(cli("status", "--json", env=clean_env(FSDP_SHIM="1")).stdout)
    if on_report["environment_file"]["read"]:  # pip put fsdp_shim_env.pth where this interpreter reads it
        assert on_report["armed"] == {"state": "armed", "by": ["FSDP_SHIM='1'"]}
        assert on.stdout.splitlines()[2:5] == [
            "Shim: ARMED in every Python started from here, by:",
            f"  FSDP_SHIM='1'  read by {on_report['environment_file']['path']}",
            "",
        ]
    else:
        assert on_report["armed"] == {"state": "not armed", "by": []}
        assert on.stdout.splitlines()[2].startswith(
            "Shim: NOT ARMED in a Python started from here: FSDP_SHIM='1' arms nothing here (see PROBLEM)."
        )


@pytest.mark.per_python
@pytest.mark.parametrize("launcher", [[FSDP_SHIM], [sys.executable, "-m", "fsdp_shim"]], ids=["script", "module"])
def test_status_with_an_unreadable_switch_prints_no_python_warning(launcher: list[str]) -> None:
    proc = subprocess.run(
        [*launcher, "status"], capture_output=True, text=True, env=clean_env(FSDP_SHIM="maybe"), cwd=ROOT, timeout=120
    )
    assert proc.returncode == 1
    assert proc.stderr == ""  # was: ".../bin/fsdp-shim:4: FSDPShimWarning: ..." and the console script's line
    assert "PROBLEM: FSDP_SHIM='maybe' is not a valid value" in proc.stdout


# ----------------------------------------------------------------------------- the command's help
@pytest.mark.per_python
def test_a_bare_command_lists_the_commands_and_exits_0() -> None:
    proc = cli()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    for command in ("run", "install", "uninstall", "status", "verify"):
        assert f"\n    {command}" in proc.stdout, command


@pytest.mark.per_python
@pytest.mark.parametrize("command", ["run", "install", "uninstall", "status", "verify"])
def test_every_command_help_has_a_description_its_defaults_and_an_example(command: str) -> None:
    from _fsdp_shim.cli import DESCRIPTIONS

    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    description, example = DESCRIPTIONS[command]
    assert description.splitlines()[0] in proc.stdout
    assert f"example:\n  {example}\n" in proc.stdout
    if command in ("install", "uninstall"):
        assert "(default: this environment's)" in " ".join(proc.stdout.split())


# ----------------------------------------------------------------------------- fsdp-shim run's launcher warnings
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


@pytest.mark.per_python
@pytest.mark.parametrize(("launcher", "command", "environ"), WARNED, ids=[_id(c, e) for _, c, e in WARNED])
def test_a_launcher_that_loses_the_shim_is_named(launcher: str, command: list[str], environ: dict) -> None:
    warnings = environment_warnings(command, environ)
    assert len(warnings) == 1 and warnings[0].startswith(f"`{launcher}"), warnings


@pytest.mark.per_python
@pytest.mark.parametrize(("command", "environ"), QUIET, ids=[_id(c, e) for c, e in QUIET])
def test_a_chain_that_passes_the_shim_on_is_not_warned_about(command: list[str], environ: dict) -> None:
    assert environment_warnings(command, environ) == []


@pytest.mark.per_python
@pytest.mark.parametrize("command", [["sudo", "python"], ["sudo", "-E", "python"], ["sudo", "-uE", "python"]])
def test_sudo_advice_keeps_pythonpath_and_never_offers_bare_dash_e(command: list[str]) -> None:
    """sudo deletes PYTHONPATH even with -E, and finds a bare name on secure_path: `sudo -E` is no fix."""
    (warning,) = environment_warnings(command, {})
    assert "`sudo --preserve-env=PYTHONPATH,FSDP_SHIM ...`" in warning
    assert "Use `sudo -E`" not in warning and "`sudo -E ...`" not in warning


@pytest.mark.per_python
def test_the_slurm_export_variable_counts_like_the_option() -> None:
    assert len(environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "NONE"})) == 1
    assert environment_warnings(["srun", "python"], {"SLURM_EXPORT_ENV": "ALL"}) == []
    (warning,) = environment_warnings(["sbatch", "job.sh"], {"SBATCH_EXPORT": "NONE"})
    assert "SBATCH_EXPORT=NONE" in warning  # says where the setting came from


@pytest.mark.per_python
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


@pytest.mark.per_python
def test_status_names_each_fix_its_releases_what_it_changes_and_the_switch() -> None:
    """Issue 25, item 3: ``status`` (text and ``--json``) names every fix, from the package's own table."""
    from _fsdp_shim.config import FIXES

    env = clean_env(FSDP_SHIM_DISABLED_FIXES="cast")
    report = json.loads(cli("status", "--json", env=env).stdout)
    assert report["fixes"] == [
        {"name": fix.name, "releases": fix.releases(), "changes": fix.changes, "switched_off": fix.name == "cast"}
        for fix in FIXES
    ]
    text = cli("status", env=env).stdout
    assert "Fixes (switch one off with FSDP_SHIM_DISABLED_FIXES=NAME):" in text
    for fix in FIXES:
        assert f"{fix.name:<10} Lightning {fix.releases()}" in text and fix.changes in text
    assert text.count("[switched off]") == 1


def test_status_in_an_isolated_install_says_the_shim_must_go_into_the_training_environment(
    tmp_path: Path, wheel: Path
) -> None:
    """``uv tool install fsdp-shim`` (as pipx does) gives the command an environment of its own, with no torch
    and no Lightning: there ``status`` says that it patches nothing and where the shim must be installed
    instead, and neither calls that "OK" nor suggests ``FSDP_SHIM=1``, which would arm nothing in the training
    environment."""
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv")
    env = clean_env(PYTHONPATH=None, UV_TOOL_DIR=str(tmp_path / "tools"), UV_TOOL_BIN_DIR=str(tmp_path / "bin"))
    install = [uv, "tool", "install", "-q", "--python", sys.executable, str(wheel)]
    run_command(install, env=env, cwd=tmp_path, check=True)
    tool = str(tmp_path / "bin" / "fsdp-shim")
    for switch in (None, "1"):
        proc = run_command([tool, "status"], env={**env, **({"FSDP_SHIM": switch} if switch else {})}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        last = proc.stdout.splitlines()[-1]
        assert last.startswith("NOTHING TO PATCH HERE: neither torch nor Lightning is installed beside this fsdp-shim")
        assert "Install fsdp-shim into the environment that runs the training instead" in last
        assert "OK: no problem found" not in proc.stdout and "PROBLEM" not in proc.stdout
        assert "FSDP_SHIM=1 python" not in proc.stdout and "1 arms the shim" not in proc.stdout
    lines = run_command([tool, "status"], env=env, cwd=tmp_path).stdout.splitlines()
    assert lines[2] == "Shim: NOT ARMED, and there is nothing to arm it for: no torch, no Lightning here (see below)."
    report = json.loads(run_command([tool, "status", "--json"], env=env, cwd=tmp_path).stdout)
    assert report["nothing_to_patch"] is True and report["problems"] == []
    # The same command in this environment says so only where it has neither torch nor Lightning either.
    here = json.loads(cli("status", "--json").stdout)
    assert here["nothing_to_patch"] is (not here["lightning"] and importlib.util.find_spec("torch") is None)
