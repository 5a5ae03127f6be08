"""``fsdp-shim status`` (text and ``--json``), and the command around it: whether the shim is armed here and by what,
the switches, the Lightning releases installed and whether this environment still needs each fix, the
problems and the exit code; where ``FSDP_SHIM=1`` arms nothing (a clone, a ``--target`` install) and where there is
no Lightning to patch (an isolated install); the command's help and its ends."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    FSDP_SHIM,
    ROOT,
    Layout,
    affected_layout,
    clean_env,
    code_json,
    installed_versions,
    make_venv,
    run_command,
)
from packaging.version import Version

import _fsdp_shim

SITE_PACKAGES = next((Path(d) for d in site.getsitepackages() if (Path(d) / "fsdp_shim_env.pth").is_file()), None)
BOOTSTRAP = str(Path(_fsdp_shim.__file__).resolve().parent / "bootstrap")


def status(
    *args: str, env: dict[str, str], launcher: tuple[str, ...] = (FSDP_SHIM,), cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return run_command([*launcher, "status", *args], env=env, cwd=cwd)


def test_status_says_whether_the_shim_is_armed_by_what_the_switches_the_fixes_and_what_is_still_needed(
    layouts: dict[str, Layout],
) -> None:
    """In this environment (fsdp-shim installed by pip or uv, an affected Lightning beside it): unset, nothing arms
    the shim and status lists what would; ``FSDP_SHIM=1`` arms it through the start-up file it names; ``0`` under
    ``fsdp-shim run`` is off and says what would arm it otherwise; unreadable values
    are problems (exit 1), with no Python warning; the releases installed, whether each lacks a fix, and per fix
    whether this environment still needs it."""
    affected_layout(layouts)
    assert SITE_PACKAGES is not None, "needs fsdp-shim installed here by pip or uv (pip install -e .)"
    pth = SITE_PACKAGES / "fsdp_shim_env.pth"
    unset = status(env=clean_env())
    lines = unset.stdout.splitlines()
    assert unset.returncode == 0 and lines[-1] == "OK: no problem found", unset.stdout
    assert lines[2:5] == [
        "Shim: NOT ARMED in a Python started from here: nothing arms it. Ways to arm it: FSDP_SHIM=1 (read by "
        f"{pth}); fsdp-shim run (also another environment's Python); import fsdp_shim in the script (that script only)",
        "",
        "Set: no FSDP_SHIM variable",
    ]

    gone = status(env=clean_env(PYTHONPATH="/nonexistent/_fsdp_shim/bootstrap")).stdout.splitlines()
    assert gone[2].startswith("Shim: NOT ARMED in a Python started from here: nothing arms it."), gone  # arms nothing

    armed = status(env=clean_env(FSDP_SHIM="1")).stdout.splitlines()
    assert armed[2] == f"Shim: ARMED in every Python started from here, by FSDP_SHIM='1' (read by {pth})."

    off = run_command([FSDP_SHIM, "run", FSDP_SHIM, "status"], env=clean_env(FSDP_SHIM="0"))
    lines = off.stdout.splitlines()
    assert off.returncode == 0 and lines[2] == (
        "Shim: OFF. FSDP_SHIM='0' switches off every activation: Lightning runs as shipped. Without it, fsdp-shim run "
        "(its bootstrap on PYTHONPATH) would arm it."
    )
    assert "Set: FSDP_SHIM='0'" in lines
    assert lines[-1] == "OK: no problem found; the shim is OFF (FSDP_SHIM='0'), so nothing is patched"

    valid = "1, true, on, yes, y, enable, enabled, 0, false, off, no, n, "
    env = clean_env(FSDP_SHIM="maybe", FSDP_SHIM_STRICT="perhaps", FSDP_SHIM_DISABLED_FIXES="cast,bogus")
    env.update(FSDP_SHIM_LOG="verbose", FSDP_SHIM_RANK_CHECK_TIMEOUT="abc")
    problems = status(env=env)
    assert problems.returncode == 1 and problems.stderr == ""
    assert [line for line in problems.stdout.splitlines() if line.startswith("PROBLEM: ")] == [
        f"PROBLEM: FSDP_SHIM='maybe' is not a valid value ({valid}disable, disabled); the shim is OFF",
        f"PROBLEM: FSDP_SHIM_STRICT='perhaps' is not a valid value ({valid}disable, disabled); strict mode is ON",
        "PROBLEM: FSDP_SHIM_DISABLED_FIXES names 'bogus', no fix of fsdp-shim (cast, recompute)",
        "PROBLEM: FSDP_SHIM_RANK_CHECK_TIMEOUT='abc' is not a number of seconds >= 0; the rank check waits as long as "
        "the process group's timeout",
        f"PROBLEM: FSDP_SHIM_LOG='verbose' is not a valid value ({valid}disable, disabled); the confirmation lines "
        "stay on",
    ]

    under_run = run_command(
        [FSDP_SHIM, "run", sys.executable, "-m", "fsdp_shim", "status", "--json"],
        env=clean_env(FSDP_SHIM_DISABLED_FIXES="cast"),
    )
    assert under_run.returncode == 0 and under_run.stderr == "", under_run.stderr
    report = json.loads(under_run.stdout)
    assert report["armed"] == {"state": "armed", "by": ["FSDP_SHIM='1'", "fsdp-shim run"]}
    assert report["bootstrap_on_pythonpath"] == [BOOTSTRAP] and report["problems"] == []
    assert report["environment_file"] == {"path": str(pth), "read": True}
    versions = installed_versions(layouts)
    lacking_the_cast = sorted(name for name, version in versions.items() if Version(version) < Version("2.5.0rc0"))
    assert {row["namespace"]: row["version"] for row in report["lightning"]} == versions
    affected = {name: Version(version) >= Version("2.1.0") for name, version in versions.items()}  # the recompute
    assert {row["namespace"]: row["affected"] for row in report["lightning"]} == affected
    text = status(env=clean_env()).stdout.splitlines()
    start = text.index("Lightning (from package metadata):") + 1
    assert text[start : start + len(versions)] == [f"  {name:<18} {versions[name]}" for name in sorted(versions)]
    cast, recompute = report["still_needed"]["cast"], report["still_needed"]["recompute"]
    assert cast["needed"] is True and all(f"{name} {versions[name]}" in cast["why"] for name in lacking_the_cast)
    assert recompute["needed"] is True and recompute["why"].startswith("with activation checkpointing:")


@pytest.mark.per_python
def test_fsdp_shim_1_arms_nothing_from_a_clone_or_a_target_install_and_an_isolated_install_says_where_to_go(
    tmp_path: Path, wheel: Path
) -> None:
    """In a Python whose environment lacks fsdp-shim, imported from a clone on ``PYTHONPATH`` or from a ``pip
    install --target`` folder, no ``site`` reads the start-up file: status says ``FSDP_SHIM=1`` arms nothing there
    and why (exit 1). Installed into an environment of its own,
    with neither torch nor Lightning (``pipx``, ``uv tool``), status says there is no Lightning there and where
    fsdp-shim must go instead."""
    other = make_venv(tmp_path / "venv", [])
    target = tmp_path / "target"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "--no-index"]
    subprocess.run([*pip, "--target", str(target), str(wheel)], check=True)
    python_m = (other.python, "-m", "fsdp_shim")  # run outside the checkout, which -m would import from

    clone = status(env=clean_env(FSDP_SHIM="1", PYTHONPATH=str(ROOT)), launcher=python_m, cwd=tmp_path)
    lines = clone.stdout.splitlines()
    assert clone.returncode == 1 and lines[2] == (
        "Shim: NOT ARMED in a Python started from here: FSDP_SHIM='1' arms nothing here (see PROBLEM). Ways to arm it: "
        "fsdp-shim run (also another environment's Python); import fsdp_shim in the script (that script only); "
        f"FSDP_SHIM=1 arms nothing here: this fsdp-shim, in {ROOT}, was not installed here by pip (a clone, --target)"
    )

    installed = status("--json", env=clean_env(FSDP_SHIM="1", PYTHONPATH=str(target)), launcher=python_m, cwd=tmp_path)
    report = json.loads(installed.stdout)
    assert installed.returncode == 1 and report["environment_file"] == {
        "path": str(target / "fsdp_shim_env.pth"),
        "read": False,
    }
    assert report["problems"] == [
        "FSDP_SHIM='1' arms nothing in this interpreter: no folder it reads start-up files from holds "
        f"fsdp_shim_env.pth (this fsdp-shim, in {target}, was not installed here by pip (a clone, --target)). Install "
        "fsdp-shim into this environment with pip, or use `fsdp-shim run`"
    ]

    shutil.copytree(target, other.site_packages, dirs_exist_ok=True)  # what pip installs, where site reads it
    isolated = {
        value: status(env=clean_env(FSDP_SHIM=value, PYTHONPATH=None), launcher=python_m, cwd=tmp_path)
        for value in (None, "1")
    }
    for proc in isolated.values():
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "OK: no problem found", proc.stdout
        for fix in ("cast", "recompute"):
            assert (
                f"  {fix:<10} unknown: no Lightning in this environment: install fsdp-shim where the training runs, "
                "and run its status there"
            ) in proc.stdout.splitlines()
    assert "Shim: ARMED in every Python started from here" in isolated["1"].stdout


@pytest.mark.per_python
def test_status_ends_quietly_when_its_reader_goes_away() -> None:
    """``fsdp-shim status | head -1``, the reader gone before the report is written: no traceback, exit 141 (the
    shell's code for SIGPIPE)."""
    read, write = os.pipe()
    os.close(read)
    try:
        gone = subprocess.run([FSDP_SHIM, "status"], stdout=write, stderr=subprocess.PIPE, env=clean_env(), timeout=300)
    finally:
        os.close(write)
    assert (gone.returncode, gone.stderr) == (141, b"")


@pytest.mark.per_python
def test_the_command_and_each_commands_help_on_an_ascii_terminal() -> None:
    """A bare ``fsdp-shim`` lists the commands and exits 0; each command's ``--help`` has its description, its
    options' defaults and an example; all of it, and ``status``, on a terminal that shows only ASCII."""
    from _fsdp_shim.status import describe_import_failure

    env = clean_env(PYTHONIOENCODING="ascii")
    bare = run_command([FSDP_SHIM], env=env)
    assert bare.returncode == 0 and bare.stderr == ""
    assert [c for c in ("run", "status", "verify") if f"\n    {c} " in bare.stdout] == ["run", "status", "verify"]
    for command, description, example in (
        ("run", "Run CMD with the shim active in every Python process it starts", "run torchrun --nproc-per-node 8"),
        ("status", "What is installed and active, and whether the pieces agree", "status --json"),
        ("verify", "Train a model for a few steps with FSDP, with the shim off and on", "verify --model my_project"),
    ):
        proc = run_command([FSDP_SHIM, command, "--help"], env=env)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert description in proc.stdout and f"example:\n  fsdp-shim {example}" in proc.stdout
    assert "(default: 3)" in run_command([FSDP_SHIM, "verify", "--help"], env=env).stdout
    proc = run_command([FSDP_SHIM, "status"], env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    hint = describe_import_failure("lightning", ["ModuleNotFoundError", "No module named 'x'", "pkg_resources"])
    assert "needs setuptools<81" in hint and hint.isascii()


def test_fsdp_shim_status_text_says_what_stays_patched_only_where_something_is() -> None:
    """``str(fsdp_shim.status())`` with the shim switched off: the note that what it patched stays patched, and how
    to remove it, appears only where a fix is patched (switched off from the start, nothing ever was)."""
    from _fsdp_shim.config import State
    from _fsdp_shim.status import FixStatus, NamespaceStatus, ShimStatus

    def shim(state: State) -> ShimStatus:
        off = "FSDP_SHIM='0'"
        fixes = (
            FixStatus("cast", state, True, "" if state is State.PATCHED else off),
            FixStatus("recompute", State.SWITCHED_OFF, True, off),
        )
        namespace = NamespaceStatus("lightning.pytorch", True, "2.4.0", fixes=fixes)
        return ShimStatus("0.3.0", False, False, True, (), {}, (namespace,))

    never = str(shim(State.SWITCHED_OFF)).splitlines()
    assert never[0] == "fsdp-shim 0.3.0: switched off by FSDP_SHIM"
    assert never[1:] == [
        "  lightning.pytorch  2.4.0      switched off: FSDP_SHIM='0'",
        "    cast       switched off: FSDP_SHIM='0'",
        "    recompute  switched off: FSDP_SHIM='0'",
    ]
    before = str(shim(State.PATCHED)).splitlines()[0]
    assert before == (
        "fsdp-shim 0.3.0: switched off by FSDP_SHIM (what it patched before stays patched; "
        "fsdp_shim.deactivate() removes it)"
    )


NOT_CHECKED_YET = """
import importlib.util, json
from _fsdp_shim.activation import status
name = next(n for n in ("lightning.pytorch", "pytorch_lightning") if importlib.util.find_spec(n.partition(".")[0]))
importlib.import_module(name)  # nothing armed the shim: its import watcher never saw this
namespace = status().namespace(name)
print(json.dumps([name, [fix.state.value for fix in namespace.fixes], namespace.reason, str(status())]))
"""


def test_a_namespace_imported_before_the_shim_is_not_checked_yet(lightning_installed: None) -> None:
    """Lightning imported where nothing armed the shim, ``status()`` read before anything activates it: each fix, and
    the namespace, is "not checked" and says so."""
    name, states, reason, text = code_json(NOT_CHECKED_YET, env=clean_env())
    assert (states, reason) == (["not checked", "not checked"], "imported; not checked yet")
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
    assert [line.endswith(reason) for line in lines[at : at + 3]] == [True] * 3, text  # the namespace and its fixes
