"""The ``fsdp-shim`` command's children run no code from the current folder, use their own
channel for results, and every failure is one line with the documented exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, run_command

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
    return run_command([FSDP_SHIM, *args], cwd=cwd, env=env or clean_env(), timeout=900)


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
@pytest.mark.usefixtures("lightning_installed")
def test_status_python_check_runs_no_code_from_the_current_folder(planted: Path) -> None:
    proc = cli("status", "--python-check", "--json", cwd=planted)
    assert markers(planted) == {}
    report = json.loads(proc.stdout)
    assert report["child"]["imported"], report  # the child did import Lightning
    assert proc.returncode in (0, 1), proc.stderr


@pytest.mark.release_independent
@pytest.mark.usefixtures("lightning_installed")
def test_verify_probes_run_no_code_from_the_current_folder(planted: Path) -> None:
    proc = cli("verify", "--steps", "1", "--json", cwd=planted)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert markers(planted) == {}
    assert json.loads(proc.stdout)["verdict"] in ("fixed", "not needed")


# ----------------------------------------------------------------------------- crashes and messages
@pytest.mark.release_independent
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


@pytest.mark.release_independent
def test_an_ascii_terminal_gets_help_and_the_setuptools_hint_without_a_crash() -> None:
    from fsdp_shim.lightning_install import describe_import_failure

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
    "from fsdp_shim.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


@pytest.mark.release_independent
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


@pytest.mark.release_independent
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


@pytest.mark.release_independent
def test_a_dotted_model_attribute_is_resolved_step_by_step() -> None:
    """``--model mod:Cls.factory``: the parser accepted it, so the probe resolves it too."""
    import json as json_module

    from fsdp_shim.verify import probe

    assert probe.resolve("json:JSONDecoder.decode") is json_module.JSONDecoder.decode
    with pytest.raises(probe.ProbeStop) as stop:
        probe.resolve("json:JSONDecoder.no_factory")
    assert stop.value.code == probe.USAGE_ERROR
    assert "json.JSONDecoder has no attribute 'no_factory' (from 'json:JSONDecoder.no_factory')" in str(stop.value)


BOOTSTRAP = ROOT / "fsdp_shim" / "bootstrap" / "sitecustomize.py"
AN_OLD_PYTHON = """\
import importlib.util, json, sys
sys.version_info = (2, 7, 18, "final", 0)  # what `fsdp-shim run python2.7 ...` starts the bootstrap in
sys.path.insert(0, sys.argv[1])  # the environment's own sitecustomize, which the bootstrap shadows
spec = importlib.util.spec_from_file_location("sitecustomize", sys.argv[2])  # as `site` imports it
sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({"armed": "_fsdp_shim_startup" in sys.modules, "chained": sys.modules["sitecustomize"].CHAINED}))
"""


@pytest.mark.release_independent
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


@pytest.mark.release_independent
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


@pytest.mark.release_independent
@pytest.mark.parametrize("value", ["0", "off"])
def test_status_with_the_shim_switched_off_says_so(value: str) -> None:
    proc = cli("status", env=clean_env(FSDP_SHIM=value))
    assert proc.returncode == 0, proc.stdout
    assert f"FSDP_SHIM={value!r} (the shim is OFF: Lightning runs as shipped)" in proc.stdout
    assert "would be patched" not in proc.stdout
    assert proc.stdout.rstrip().endswith(
        f"OK: consistent; the shim is OFF (FSDP_SHIM={value!r}), so nothing is patched"
    )


@pytest.mark.release_independent
@pytest.mark.parametrize("launcher", [[FSDP_SHIM], [sys.executable, "-m", "fsdp_shim"]], ids=["script", "module"])
def test_status_with_an_unreadable_switch_prints_no_python_warning(launcher: list[str]) -> None:
    proc = subprocess.run(
        [*launcher, "status"], capture_output=True, text=True, env=clean_env(FSDP_SHIM="maybe"), cwd=ROOT, timeout=120
    )
    assert proc.returncode == 1
    assert proc.stderr == ""  # was: ".../bin/fsdp-shim:4: FSDPShimWarning: ..." and the console script's line
    assert "PROBLEM: FSDP_SHIM='maybe' is not a valid value" in proc.stdout


# ----------------------------------------------------------------------------- probes that hang
MODELS = ROOT / "tests" / "verify_models"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def wait_for_pids(folder: Path, count: int, seconds: float = 120) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        pids = [int(p.stem) for p in folder.glob("*.pid")]
        if len(pids) >= count:
            return pids
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise AssertionError(f"the hanging probe did not start within {seconds} s")


@pytest.mark.release_independent
@pytest.mark.usefixtures("lightning_installed")
def test_a_probe_that_hangs_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    env = clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path))
    start = time.monotonic()
    proc = cli("verify", "--model", "hanging_models:Model", "--timeout", "20", cwd=MODELS, env=env)
    assert time.monotonic() - start < 120
    pids = wait_for_pids(tmp_path, 2, seconds=0)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "fsdp-shim verify: reading the installed Lightning did not finish within 20 s, so verify stopped it and "
        "every process it started; --timeout SECONDS allows longer"
    )
    assert "Traceback" not in proc.stderr
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.release_independent
@pytest.mark.usefixtures("lightning_installed")
def test_ctrl_c_stops_every_process_the_probe_started(tmp_path: Path) -> None:
    env = clean_env(FSDP_SHIM_TEST_PIDS=str(tmp_path))
    verify = subprocess.Popen(
        [FSDP_SHIM, "verify", "--model", "hanging_models:Model"],
        cwd=MODELS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = wait_for_pids(tmp_path, 2)
    verify.send_signal(signal.SIGINT)
    _, stderr = verify.communicate(timeout=60)
    assert verify.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (
        "fsdp-shim verify: interrupted while reading the installed Lightning; every process it started was stopped"
    )
    time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []


# ----------------------------------------------------------------------------- the command's help
@pytest.mark.release_independent
def test_a_bare_command_lists_the_commands_and_exits_0() -> None:
    proc = cli()
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    for command in ("run", "install", "uninstall", "status", "verify"):
        assert f"\n    {command}" in proc.stdout, command


@pytest.mark.release_independent
@pytest.mark.parametrize("command", ["run", "install", "uninstall", "status", "verify"])
def test_every_command_help_has_a_description_its_defaults_and_an_example(command: str) -> None:
    from fsdp_shim.cli import DESCRIPTIONS

    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    description, example = DESCRIPTIONS[command]
    assert description.splitlines()[0] in proc.stdout
    assert f"example:\n  {example}\n" in proc.stdout
    if command == "verify":
        for default in ("(default: bf16-true)", "(default: 1)", "(default: 3)", "(default: 1800)"):
            assert default in " ".join(proc.stdout.split()), default
        assert "the Lightning precision both runs use" in proc.stdout
    if command in ("install", "uninstall"):
        assert "(default: this environment's)" in " ".join(proc.stdout.split())
