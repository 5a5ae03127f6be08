"""``fsdp-shim status``: what this environment holds, what arms the shim here, and whether the pieces agree.
Lightning is not imported (versions from metadata); ``--python-check`` has a fresh interpreter import it."""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import _fsdp_shim
from _fsdp_shim import config
from _fsdp_shim._version import __version__
from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, State, joined, switch_state
from _fsdp_shim.distributions import describe_import_failure, distribution_of, installed_packages

SHIM, STRICT, DISABLED = config.SHIM_VARIABLE, config.STRICT_VARIABLE, config.DISABLED_FIXES_VARIABLE
ENVIRONMENT_FILE = "fsdp_shim_env.pth"
OWN_ENVIRONMENT_FILE = Path(_fsdp_shim.__file__).resolve().parent.parent / ENVIRONMENT_FILE
MARK = "\n--- fsdp-shim status report ---\n"  # around the child's report: start-up code may print too
PYTHON_CHECK = f"""
import importlib, json, sys, warnings
if sys.path[:1] == [""]:  # the current folder, which -c puts first: not where a training script imports from
    del sys.path[0]
warnings.simplefilter("ignore")
report = {{"python": sys.executable, "imported": [], "failed": {{}}}}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        report["imported"].append(name)
    except Exception as error:  # as distributions.import_failure()
        report["failed"][name] = [type(error).__name__, str(error), getattr(error, "name", None)]
activation = sys.modules.get("_fsdp_shim.activation")  # imported by the start-up finder's hand-over
report["shim_loaded"], report["status"] = activation is not None, activation and activation.status().as_dict()
print({MARK!r} + json.dumps(report) + {MARK!r})
"""
NOTHING_TO_PATCH = (
    "NOTHING TO PATCH HERE: neither torch nor Lightning is installed beside this fsdp-shim ({python}): an "
    "isolated install (pipx, `uv tool`) cannot reach your training. Install fsdp-shim into the environment that "
    "runs the training instead (`pip install fsdp-shim` there), and run `fsdp-shim status` with its Python."
)
NOT_READ = f"this fsdp-shim, in {OWN_ENVIRONMENT_FILE.parent}, was not installed here by pip (a clone, --target)"
Report = dict[str, Any]


def _verdict(fix: config.Fix, version: str, off: str | None) -> str:
    if fix.built_in(version) or not fix.affects(version):
        return f"left untouched ({'fixed upstream' if fix.built_in(version) else 'nothing to fix'})"
    return f"not patched: {off} switches it off" if off else "would be patched"


def _lightning(off: str | None) -> list[dict[str, Any]]:
    """Per installed namespace, from metadata: its release, and what the shim would do to each fix there."""
    skipped, rows = config.disabled_fixes()[0], []
    for namespace in sorted(config.NAMESPACES):
        if found := distribution_of(namespace.partition(".")[0]):
            fixes = {f.name: _verdict(f, found[1], off or (DISABLED if f.name in skipped else None)) for f in FIXES}
            affected = any(fix.affects(found[1]) for fix in FIXES)
            rows.append(dict(namespace=namespace, distribution=found[0], version=found[1], affected=affected))
            rows[-1]["fixes"] = fixes
    return rows


def _still_needed(lightning: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fix, whether this environment needs it (True, False, or None where it cannot tell) and why."""
    if not lightning:
        return {fix.name: {"needed": None, "why": "no Lightning in this environment"} for fix in FIXES}
    releases = [f"{row['namespace']} {row['version']}" for row in lightning]
    lacking = [release for release, row in zip(releases, lightning) if CAST.affects(row["version"])]
    cast = (False, f"every Lightning here has it or needs none ({joined(releases)})")
    if lacking:
        cast = (True, f"{joined(lacking)} lack it; it can go once every environment runs Lightning 2.5.0 or later")
    recompute: tuple[bool | None, str] = (False, "no Lightning here has 'true' precisions for FSDP")
    if any(RECOMPUTE.affects(row["version"]) for row in lightning):
        recompute = _recompute_needed()
    return {fix.name: {"needed": needed, "why": why} for fix, (needed, why) in zip(FIXES, (cast, recompute))}


def _recompute_needed() -> tuple[bool | None, str]:
    """Whether this environment's torch restores the forward's default dtype in every recompute itself."""
    if importlib.util.find_spec("torch") is None:
        return None, "cannot tell: no torch in this environment"
    try:
        import torch

        from _fsdp_shim import recompute_check as check

        left = [path for path in check.paths() if path not in check.restored_by_torch()]
    except Exception as error:
        return None, f"cannot tell: torch's checkpoint cannot be read ({type(error).__name__}: {error})"
    if not left:
        return False, f"torch {torch.__version__}'s checkpoint restores the default dtype itself"
    return True, (
        "with activation checkpointing: no Lightning release restores the default dtype for a recompute, nor does "
        f"torch {torch.__version__}'s checkpoint for {check.the_checkpoints(left)}; it can go once torch's does, or "
        "where you train without activation checkpointing"
    )


def _problems_of_the_variables() -> list[str]:
    problems = [
        f"{name}={os.environ.get(name)!r} is not a valid value ({config.valid_switch_values()}); {meaning}"
        for name, meaning in ((SHIM, "the shim is OFF"), (STRICT, "strict mode is ON"))
        if switch_state(os.environ.get(name)) == "invalid"
    ]
    unknown = ", ".join(map(repr, config.disabled_fixes()[1]))
    problems += [f"{DISABLED} names {unknown}, no fix of fsdp-shim ({', '.join(config.FIX_NAMES)})"] if unknown else []
    timeout, log = config.rank_check_timeout()[1], config.log_setting()[1]
    problems += [f"{timeout}; the rank check waits as long as the process group's timeout"] if timeout else []
    return problems + ([log] if log else [])


def _sources(report: Report, on: bool) -> list[tuple[str, str]]:
    """What arms the shim in a Python started from here, with ``FSDP_SHIM`` taken as on where ``on``, and how."""
    env, shown = report["environment_file"], f"{SHIM}={report['toggles'][SHIM]!r}"
    found = [(shown, f"read by {env['path']}")] if on and env["read"] else []
    run = [("fsdp-shim run", "its bootstrap is first on PYTHONPATH")]
    return found + (run if report["bootstrap_on_pythonpath"] else [])


def _check_child(report: Report) -> None:
    """A fresh interpreter imports Lightning as a training script does; what the shim did there."""
    command = [sys.executable, "-c", PYTHON_CHECK, *installed_packages()]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    parts, problems = proc.stdout.split(MARK), report["problems"]
    if proc.returncode != 0 or len(parts) != 3:
        problems.append(f"a fresh interpreter failed to import Lightning: {proc.stderr.strip()[-500:] or 'no report'}")
        return
    child = report["child"] = json.loads(parts[1])
    problems += [describe_import_failure(package, failure) for package, failure in child["failed"].items()]
    if report["armed"]["state"] == "off":
        return
    if report["armed"]["state"] == "armed" and child["imported"] and not child["shim_loaded"]:
        problems.append("a start-up activation is present but a fresh interpreter did not load the shim")
    problems += [
        f"{ns['namespace']} {ns['version']} lacks the {fix['fix']} fix, and it was not applied: {fix['reason']}"
        for ns in (child["status"] or {}).get("namespaces", [])
        for fix in ns["fixes"]
        if ns["imported"] and fix["affected"] and not fix["patched"] and fix["state"] != State.DISABLED.value
    ]


def collect(python_check: bool = False) -> Report:
    """What ``status --json`` prints, in this key order; ``render`` writes it as text."""
    state, shown = switch_state(os.environ.get(SHIM)), f"{SHIM}={os.environ.get(SHIM)!r}"
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    found = next((p for d in [*user, *site.getsitepackages()] if (p := Path(d) / ENVIRONMENT_FILE).is_file()), None)
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)  # any fsdp-shim's bootstrap, existing or not
    off = shown if state in ("off", "invalid") else None
    lightning = _lightning(off)
    report: Report = {
        "shim_version": __version__,
        "python": sys.executable,
        "toggles": {name: os.environ.get(name) for name in config.VARIABLES},
        "environment_file": {"path": str(found or OWN_ENVIRONMENT_FILE), "read": found is not None},
        "bootstrap_on_pythonpath": [e for e in entries if e and Path(e).parts[-2:] == ("_fsdp_shim", "bootstrap")],
        "lightning": lightning,
        "still_needed": _still_needed(lightning),
        "nothing_to_patch": not installed_packages() and importlib.util.find_spec("torch") is None,
    }
    by = [source for source, _ in _sources(report, state == "on")]
    report |= {"armed": {"state": "off" if off else "armed" if by else "not armed", "by": by}, "child": None}
    report["problems"] = _problems_of_the_variables()
    if not found and state == "on" and not report["bootstrap_on_pythonpath"]:
        report["problems"].append(
            f"{shown} arms nothing in this interpreter: no folder it reads start-up files from holds "
            f"{ENVIRONMENT_FILE} ({NOT_READ}). Install fsdp-shim into this environment with pip, or use "
            "`fsdp-shim run`"
        )
    missing = [entry for entry in report["bootstrap_on_pythonpath"] if not os.path.isdir(entry)]
    report["problems"] += [f"PYTHONPATH holds an fsdp-shim bootstrap folder that does not exist: {e}" for e in missing]
    if python_check:
        _check_child(report)
    report["consistent"] = not report["problems"]
    return report


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {what}" for name, what in rows]


def _armed_lines(report: Report) -> list[str]:
    """The first lines: armed or not, by what, and what would arm it."""
    state, shown = report["armed"]["state"], f"{SHIM}={report['toggles'][SHIM]!r}"
    on = switch_state(report["toggles"][SHIM]) == "on"
    if state == "off":
        sources = _sources(report, False)
        lines = [f"Shim: OFF. {shown} switches off every activation: Lightning runs as shipped."]
        return lines + (["  Without it, this would arm the shim:", *_table(sources)] if sources else [])
    if state == "armed":
        return ["Shim: ARMED in every Python started from here, by:", *_table(_sources(report, on))]
    if report["nothing_to_patch"] and not on:
        return ["Shim: NOT ARMED, and there is nothing to arm it for: no torch, no Lightning here (see below)."]
    env = report["environment_file"]
    read = f"one command and every process it starts (by {env['path']})" if env["read"] else None
    ways = [
        (f"{SHIM}=1 python train.py", read or f"arms nothing here: {NOT_READ}"),
        ("fsdp-shim run python train.py", "the same, also for interpreters of another environment"),
        ("import fsdp_shim", "in the training script: that script only (status cannot see it)"),
    ]
    nothing = f"{shown} arms nothing here (see PROBLEM)" if on else "nothing arms it"
    return [f"Shim: NOT ARMED in a Python started from here: {nothing}. Ways to arm it:", *_table(ways)]


def render(report: Report) -> str:
    """``report`` as the text ``fsdp-shim status`` prints."""
    shown, off = f"{SHIM}={report['toggles'][SHIM]!r}", report["armed"]["state"] == "off"
    lines = [f"fsdp-shim {report['shim_version']}  (python: {report['python']})", "", *_armed_lines(report), ""]
    toggles = [f"{name}={value!r}" for name, value in report["toggles"].items() if value is not None]
    lines += [
        f"Set: {', '.join(toggles) or 'no FSDP_SHIM variable'}",
        "",
        "Lightning (from package metadata; what the shim does where it is armed):",
    ]
    lines += [] if report["lightning"] else ["  none installed"]
    for row in report["lightning"]:
        lines.append(f"  {row['namespace']:<18} {row['version']}")
        lines += [f"    {name:<10} {verdict}" for name, verdict in row["fixes"].items()]
    lines += ["", f"Still needed here? ({config.DOCS}removal.html)"]
    answer = {True: "needed", False: "not needed", None: "unknown"}
    lines += [f"  {name:<10} {answer[a['needed']]}: {a['why']}" for name, a in report["still_needed"].items()]
    if (child := report["child"]) is not None:
        status = child["status"] or {}
        loaded = f"shim loaded, armed by: {'; '.join(status.get('sources') or []) or 'unknown'}"
        why = f"{shown} switches it off" if off else "nothing armed it at start-up"
        lines += ["", "A fresh interpreter (imports Lightning, not fsdp_shim):"]
        lines.append(f"  {loaded if child['shim_loaded'] else f'shim not loaded: {why}'}")
        lines += [
            f"  {ns['namespace']:<18} {ns['version'] or '-':<10} {ns['reason']}"
            for ns in status.get("namespaces", [])
            if ns["imported"]
        ]
    ok = "OK: no problem found" + (f"; the shim is OFF ({shown}), so nothing is patched" if off else "")
    ok = NOTHING_TO_PATCH.format(python=report["python"]) if report["nothing_to_patch"] else ok
    return "\n".join([*lines, "", *([f"PROBLEM: {p}" for p in report["problems"]] or [ok])])


def main(as_json: bool, python_check: bool) -> int:
    """Print the report; 1 where the pieces disagree."""
    report = collect(python_check)
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0 if report["consistent"] else 1
