"""``fsdp-shim status``: what this environment holds, what would arm the shim here, and whether the pieces agree.
Lightning is not imported (versions from package metadata); ``--python-check`` has a fresh interpreter import it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _fsdp_shim
from _fsdp_shim._version import __version__
from _fsdp_shim.config import (
    CAST,
    DISABLED_FIXES_VARIABLE,
    FIXES,
    LIGHTNING_PACKAGES,
    NAMESPACES,
    RECOMPUTE,
    SHIM_VARIABLE,
    STRICT_VARIABLE,
    VARIABLES,
    Fix,
    State,
    disabled_fixes,
    joined,
    log_setting,
    rank_check_timeout,
    switch_state,
    valid_switch_values,
)
from _fsdp_shim.distributions import describe_import_failure, distribution_of, installed_packages
from _fsdp_shim.run import bootstrap_on_pythonpath

PYTHON_CHECK = Path(__file__).resolve().parent / "children" / "python_check.py"
ENVIRONMENT_FILE = "fsdp_shim_env.pth"
OWN_ENVIRONMENT_FILE = Path(_fsdp_shim.__file__).resolve().parent.parent / ENVIRONMENT_FILE
Report = dict[str, Any]
NOTHING_TO_PATCH = (
    "NOTHING TO PATCH HERE: neither torch nor Lightning is installed beside this fsdp-shim ({python}): an "
    "isolated install (pipx, `uv tool`) cannot reach your training. Install fsdp-shim into the environment that "
    "runs the training instead (`pip install fsdp-shim` there), and run `fsdp-shim status` with its Python."
)


class NoTemporaryFolder(Exception):
    """``--python-check`` needs a temporary folder for its child's report, and has none."""


def _shim() -> str:
    return switch_state(os.environ.get(SHIM_VARIABLE))


def _switched_off() -> str | None:
    """``FSDP_SHIM='0'`` (as written) where the variable switches the shim off."""
    return f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r}" if _shim() in ("off", "invalid") else None


def _installed_lightning() -> list[dict[str, Any]]:
    off, (skipped, _) = _switched_off(), disabled_fixes()
    rows = []
    for package in LIGHTNING_PACKAGES:
        found = distribution_of(package)
        if found is None:
            continue
        distribution, version = found
        verdicts = {}
        for fix in FIXES:
            if fix.built_in(version):
                verdicts[fix.name] = "left untouched (fixed upstream)"
            elif not fix.affects(version):
                verdicts[fix.name] = "left untouched (nothing to fix)"
            elif off or fix.name in skipped:
                verdicts[fix.name] = f"not patched: {off or DISABLED_FIXES_VARIABLE} switches it off"
            else:
                verdicts[fix.name] = "would be patched"
        facts = {"distribution": distribution, "version": version, "affected": any(f.affects(version) for f in FIXES)}
        namespaces = [name for name in NAMESPACES if name.partition(".")[0] == package]
        rows += [{"namespace": namespace, **facts, "fixes": verdicts} for namespace in namespaces]
    return sorted(rows, key=lambda row: row["namespace"])


def _releases(fix: Fix) -> str:
    if fix.fixed_in is None:
        return f"{fix.since} and later (no release has it yet)"
    return f"{fix.since} up to {fix.fixed_in} (exclusive)"


def _still_needed(lightning: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fix, whether this environment needs it (True, False, or None where it cannot tell) and why."""
    releases = [f"{row['namespace']} {row['version']}" for row in lightning]
    if not releases:
        return {fix.name: {"needed": None, "why": "no Lightning in this environment"} for fix in FIXES}
    lacking = {
        fix.name: [f"{r['namespace']} {r['version']}" for r in lightning if fix.affects(r["version"])] for fix in FIXES
    }
    answers = {}
    if lacking[CAST.name]:
        later = "it can go once every environment runs Lightning 2.5.0 or later"
        answers[CAST.name] = {"needed": True, "why": f"{joined(lacking[CAST.name])} lack it; {later}"}
    else:
        answers[CAST.name] = {
            "needed": False,
            "why": f"every Lightning here has it or needs none ({joined(releases)})",
        }
    if lacking[RECOMPUTE.name]:
        answers[RECOMPUTE.name] = _recompute_needed()
    else:
        answers[RECOMPUTE.name] = {"needed": False, "why": "no Lightning here has 'true' precisions for FSDP"}
    return answers


def _recompute_needed() -> dict[str, Any]:
    """Whether this environment's torch restores the forward's default dtype in every recompute itself."""
    if importlib.util.find_spec("torch") is None:
        return {"needed": None, "why": "cannot tell: no torch in this environment"}
    try:
        import torch

        from _fsdp_shim import recompute_check

        left = [path for path in recompute_check.paths() if path not in recompute_check.restored_by_torch()]
    except Exception as error:
        return {
            "needed": None,
            "why": f"cannot tell: torch's checkpoint cannot be read ({type(error).__name__}: {error})",
        }
    if not left:
        return {"needed": False, "why": f"torch {torch.__version__}'s checkpoint restores the default dtype itself"}
    return {
        "needed": True,
        "why": f"with activation checkpointing: no Lightning release restores the default dtype for a recompute, nor "
        f"does torch {torch.__version__}'s checkpoint for {recompute_check.the_checkpoints(left)}; it can go once "
        "torch's does, or where you train without activation checkpointing",
    }


def _problems_of_the_variables() -> list[str]:
    problems = []
    for name, state, meaning in (
        (SHIM_VARIABLE, _shim(), "the shim is OFF"),
        (STRICT_VARIABLE, switch_state(os.environ.get(STRICT_VARIABLE)), "strict mode is ON"),
    ):
        if state == "invalid":
            problems.append(
                f"{name}={os.environ.get(name)!r} is not a valid value ({valid_switch_values()}); {meaning}"
            )
    unknown = disabled_fixes()[1]
    if unknown:
        names = ", ".join(fix.name for fix in FIXES)
        problems.append(
            f"{DISABLED_FIXES_VARIABLE} names {', '.join(map(repr, unknown))}, no fix of fsdp-shim ({names})"
        )
    problem = rank_check_timeout()[1]
    if problem is not None:
        problems.append(f"{problem}; the rank check waits as long as the process group's timeout")
    problem = log_setting()[1]
    return problems + ([problem] if problem is not None else [])


def _environment_file() -> dict[str, Any]:
    """Where ``fsdp_shim_env.pth`` is, and whether this interpreter reads it (never from PYTHONPATH or a clone)."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    read = [Path(d) / ENVIRONMENT_FILE for d in [*user, *site.getsitepackages()]]
    found = next((path for path in read if path.is_file()), None)
    return {"path": str(found or OWN_ENVIRONMENT_FILE), "read": found is not None}


def _why_not_read() -> str:
    if not (OWN_ENVIRONMENT_FILE.is_file() and any(OWN_ENVIRONMENT_FILE.parent.glob("fsdp_shim-*.dist-info"))):
        return "this fsdp-shim was not installed by pip (a clone on PYTHONPATH?)"
    return (
        f"this fsdp-shim's is in {OWN_ENVIRONMENT_FILE.parent}, which Python imports from but does not read "
        "start-up files from (pip install --target, PYTHONPATH)"
    )


def _check_child(report: Report) -> None:
    """A fresh interpreter imports Lightning as a training script does; what the shim did there."""
    try:
        folder = tempfile.mkdtemp(prefix="fsdp-shim-status-")
    except OSError as error:
        raise NoTemporaryFolder(f"no usable temporary folder ({type(error).__name__}: {error}); set TMPDIR") from None
    out = Path(folder, "report.json")
    try:
        proc = subprocess.run(
            [sys.executable, str(PYTHON_CHECK), str(out)], capture_output=True, text=True, timeout=600
        )
        try:
            child = json.loads(out.read_text())
        except (OSError, ValueError):
            child = None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0 or child is None:
        tail = proc.stderr.strip()[-500:] or f"exit {proc.returncode}, no report"
        report["problems"].append(f"a fresh interpreter failed to import Lightning: {tail}")
        return
    report["child"] = child
    report["problems"] += [
        describe_import_failure(package, failure) for package, failure in child.get("failed", {}).items()
    ]
    if _switched_off():
        return
    if report["armed"]["state"] == "armed" and child["imported"] and not child["shim_loaded"]:
        report["problems"].append("a start-up activation is present but a fresh interpreter did not load the shim")
    for namespace in (child.get("status") or {}).get("namespaces", []):
        for fix in namespace.get("fixes", []):
            if (
                namespace["imported"]
                and fix["affected"]
                and not fix["patched"]
                and fix["state"] != State.DISABLED.value
            ):
                report["problems"].append(
                    f"{namespace['namespace']} {namespace['version']} lacks the {fix['fix']} fix, and it was not "
                    f"applied: {fix['reason']}"
                )


def collect(python_check: bool = False) -> Report:
    """What ``status --json`` prints, in this key order; ``render`` writes it as text."""
    skipped = disabled_fixes()[0]
    environment_file, bootstraps = _environment_file(), bootstrap_on_pythonpath(os.environ)
    by = [f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r}"] if environment_file["read"] and _shim() == "on" else []
    by += ["fsdp-shim run"] if bootstraps else []
    lightning = _installed_lightning()
    report: Report = {
        "shim_version": __version__,
        "python": sys.executable,
        "toggles": {name: os.environ.get(name) for name in VARIABLES},
        "environment_file": environment_file,
        "bootstrap_on_pythonpath": bootstraps,
        "fixes": [
            {"name": fix.name, "releases": _releases(fix), "changes": fix.changes, "switched_off": fix.name in skipped}
            for fix in FIXES
        ],
        "lightning": lightning,
        "still_needed": _still_needed(lightning),
        "nothing_to_patch": not installed_packages() and importlib.util.find_spec("torch") is None,
        "armed": {"state": "off" if _switched_off() else "armed" if by else "not armed", "by": by},
        "child": None,
        "problems": _problems_of_the_variables(),
    }
    if not environment_file["read"] and _shim() == "on" and not bootstraps:
        report["problems"].append(
            f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r} arms nothing in this interpreter: no folder it reads "
            f"start-up files from holds {ENVIRONMENT_FILE} ({_why_not_read()}). Install fsdp-shim into this "
            "environment with pip, or use `fsdp-shim run`"
        )
    for entry in bootstraps:
        if not os.path.isdir(entry):
            report["problems"].append(f"PYTHONPATH holds an fsdp-shim bootstrap folder that does not exist: {entry}")
    if python_check:
        _check_child(report)
    report["consistent"] = not report["problems"]
    return report


def _armed_lines(report: Report) -> list[str]:
    """The first lines: armed or not, by what, and what would arm it."""
    armed, env = report["armed"], report["environment_file"]
    how = {"fsdp-shim run": "its bootstrap is first on PYTHONPATH"}
    sources = [(source, how.get(source, f"read by {env['path']}")) for source in armed["by"]]

    def table(rows: list[tuple[str, str]]) -> list[str]:
        width = max(len(name) for name, _ in rows)
        return [f"  {name:<{width}}  {what}" for name, what in rows]

    if armed["state"] == "off":
        lines = [f"Shim: OFF. {_switched_off()} switches off every activation: Lightning runs as shipped."]
        return lines + (["  Without it, this would arm the shim:", *table(sources)] if sources else [])
    if armed["state"] == "armed":
        return ["Shim: ARMED in every Python started from here, by:", *table(sources)]
    if report["nothing_to_patch"] and _shim() != "on":
        return ["Shim: NOT ARMED, and there is nothing to arm it for: no torch, no Lightning here (see below)."]
    ways = [(f"{SHIM_VARIABLE}=1 python train.py", "one command and every process it starts")] if env["read"] else []
    ways += [
        ("fsdp-shim run python train.py", "the same, also for interpreters of another environment"),
        ("import fsdp_shim", "in the training script: that script only (status cannot see it)"),
    ]
    value = os.environ.get(SHIM_VARIABLE)
    nothing = f"{SHIM_VARIABLE}={value!r} arms nothing here (see PROBLEM)" if _shim() == "on" else "nothing arms it"
    return [f"Shim: NOT ARMED in a Python started from here: {nothing}. Any one of these arms it:", *table(ways)]


def render(report: Report) -> str:
    lines = [f"fsdp-shim {report['shim_version']}  (python: {report['python']})", "", *_armed_lines(report), ""]
    off = _switched_off()
    unset = {SHIM_VARIABLE: "1 arms the shim, 0 switches it off", STRICT_VARIABLE: "strict mode off"}
    if report["nothing_to_patch"]:
        unset[SHIM_VARIABLE] = "nothing to arm here"
    for name, value in report["toggles"].items():
        if value is not None:
            lines.append(
                f"{name}={value!r}"
                + (" (the shim is OFF: Lightning runs as shipped)" if off and name == SHIM_VARIABLE else "")
            )
        elif name in unset:
            lines.append(f"{name} unset ({unset[name]})")
    env = report["environment_file"]
    lines += ["", "Activations:"]
    if env["read"]:
        lines.append(f"  FSDP_SHIM=1    {env['path']}  (arms every interpreter where {SHIM_VARIABLE}=1)")
    else:
        lines.append(f"  FSDP_SHIM=1    arms nothing here: {_why_not_read()}")
    bootstraps = [f"  fsdp-shim run  bootstrap on PYTHONPATH: {entry}" for entry in report["bootstrap_on_pythonpath"]]
    lines += bootstraps or ["  fsdp-shim run  not active in this shell"]
    lines += ["", f"Fixes (switch one off with {DISABLED_FIXES_VARIABLE}=NAME):"]
    for fix in report["fixes"]:
        mark = "  [switched off]" if fix["switched_off"] else ""
        lines += [f"  {fix['name']:<10} Lightning {fix['releases']}{mark}", f"  {'':<10} {fix['changes']}"]
    lines += ["", "Lightning (from package metadata; what the shim does where it is armed):"]
    lines += [] if report["lightning"] else ["  none installed"]
    for row in report["lightning"]:
        lines.append(f"  {row['namespace']:<18} {row['version']}")
        lines += [f"    {name:<10} {verdict}" for name, verdict in row["fixes"].items()]
    lines += ["", "Still needed here? (https://fsdp-shim.github.io/fsdp-shim/removal.html)"]
    answer = {True: "needed", False: "not needed", None: "unknown"}
    lines += [f"  {name:<10} {answer[a['needed']]}: {a['why']}" for name, a in report["still_needed"].items()]
    child = report["child"]
    if child is not None:
        lines += ["", "A fresh interpreter (imports Lightning, not fsdp_shim):"]
        if not child["shim_loaded"]:
            lines.append(f"  shim not loaded: {f'{off} switches it off' if off else 'nothing armed it at start-up'}")
        else:
            sources = (child.get("status") or {}).get("sources") or []
            lines.append(f"  shim loaded, armed by: {'; '.join(sources) or 'unknown'}")
        for namespace in (child.get("status") or {}).get("namespaces", []):
            if namespace["imported"]:
                lines.append(f"  {namespace['namespace']:<18} {namespace['version'] or '-':<10} {namespace['reason']}")
    ok = "OK: no problem found" + (f"; the shim is OFF ({off}), so nothing is patched" if off else "")
    if report["nothing_to_patch"]:
        ok = NOTHING_TO_PATCH.format(python=report["python"])
    lines += ["", *([f"PROBLEM: {p}" for p in report["problems"]] or [ok])]
    return "\n".join(lines)
