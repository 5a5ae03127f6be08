"""``fsdp-shim status``: what this environment holds, what would arm the shim here, and whether the pieces agree.
Lightning is not imported (versions from package metadata); ``--python-check`` has a fresh interpreter import it."""

from __future__ import annotations

import contextlib
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
from _fsdp_shim import config
from _fsdp_shim._version import __version__
from _fsdp_shim.config import CAST, FIXES, RECOMPUTE, State, joined, switch_state
from _fsdp_shim.distributions import describe_import_failure, distribution_of, installed_packages

SHIM, STRICT, DISABLED = config.SHIM_VARIABLE, config.STRICT_VARIABLE, config.DISABLED_FIXES_VARIABLE
PYTHON_CHECK = Path(__file__).resolve().parent / "children" / "python_check.py"
ENVIRONMENT_FILE = "fsdp_shim_env.pth"
OWN_ENVIRONMENT_FILE = Path(_fsdp_shim.__file__).resolve().parent.parent / ENVIRONMENT_FILE
NOTHING_TO_PATCH = (
    "NOTHING TO PATCH HERE: neither torch nor Lightning is installed beside this fsdp-shim ({python}): an "
    "isolated install (pipx, `uv tool`) cannot reach your training. Install fsdp-shim into the environment that "
    "runs the training instead (`pip install fsdp-shim` there), and run `fsdp-shim status` with its Python."
)
Report = dict[str, Any]


class NoTemporaryFolder(Exception):
    """``--python-check`` needs a temporary folder for its child's report, and has none."""


def _shim() -> tuple[str, str, str | None]:
    """``FSDP_SHIM``'s state (on, off, invalid, unset), as shown (``FSDP_SHIM='0'``), and that where it is off."""
    state, shown = switch_state(os.environ.get(SHIM)), f"{SHIM}={os.environ.get(SHIM)!r}"
    return state, shown, shown if state in ("off", "invalid") else None


def _verdict(fix: config.Fix, version: str, off: str | None) -> str:
    if fix.built_in(version) or not fix.affects(version):
        return f"left untouched ({'fixed upstream' if fix.built_in(version) else 'nothing to fix'})"
    return f"not patched: {off} switches it off" if off else "would be patched"


def _lightning() -> list[dict[str, Any]]:
    """Per installed namespace, from metadata: its release, and what the shim would do to each fix there."""
    off, skipped, rows = _shim()[2], config.disabled_fixes()[0], []
    for namespace in sorted(config.NAMESPACES):
        found = distribution_of(namespace.partition(".")[0])
        if found is not None:
            (distribution, version), affected = found, any(fix.affects(found[1]) for fix in FIXES)
            fixes = {f.name: _verdict(f, version, off or (DISABLED if f.name in skipped else None)) for f in FIXES}
            rows.append(dict(namespace=namespace, distribution=distribution, version=version, affected=affected))
            rows[-1]["fixes"] = fixes
    return rows


def _releases(fix: config.Fix) -> str:
    return f"{fix.since} " + (
        f"up to {fix.fixed_in} (exclusive)" if fix.fixed_in else "and later (no release has it yet)"
    )


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
    out, problems, child = Path(folder, "report.json"), report["problems"], None
    try:
        proc = subprocess.run(
            [sys.executable, PYTHON_CHECK, out, *installed_packages()], capture_output=True, text=True, timeout=600
        )
        with contextlib.suppress(OSError, ValueError):
            child = json.loads(out.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if proc.returncode != 0 or child is None:
        tail = proc.stderr.strip()[-500:] or f"exit {proc.returncode}, no report"
        problems.append(f"a fresh interpreter failed to import Lightning: {tail}")
        return
    report["child"] = child
    problems += [describe_import_failure(package, failure) for package, failure in child.get("failed", {}).items()]
    if _shim()[2]:
        return
    if report["armed"]["state"] == "armed" and child["imported"] and not child["shim_loaded"]:
        problems.append("a start-up activation is present but a fresh interpreter did not load the shim")
    problems += [
        f"{ns['namespace']} {ns['version']} lacks the {fix['fix']} fix, and it was not applied: {fix['reason']}"
        for ns in (child.get("status") or {}).get("namespaces", [])
        for fix in ns.get("fixes", [])
        if ns["imported"] and fix["affected"] and not fix["patched"] and fix["state"] != State.DISABLED.value
    ]


def collect(python_check: bool = False) -> Report:
    """What ``status --json`` prints, in this key order; ``render`` writes it as text."""
    (state, shown, off), skipped = _shim(), config.disabled_fixes()[0]
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    found = next((p for d in [*user, *site.getsitepackages()] if (p := Path(d) / ENVIRONMENT_FILE).is_file()), None)
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)  # any fsdp-shim's bootstrap, existing or not
    bootstraps = [e for e in entries if e and Path(e).name == "bootstrap" and Path(e).parent.name == "_fsdp_shim"]
    by = [shown] if found and state == "on" else []
    by += ["fsdp-shim run"] if bootstraps else []
    lightning = _lightning()
    report: Report = {
        "shim_version": __version__,
        "python": sys.executable,
        "toggles": {name: os.environ.get(name) for name in config.VARIABLES},
        "environment_file": {"path": str(found or OWN_ENVIRONMENT_FILE), "read": found is not None},
        "bootstrap_on_pythonpath": bootstraps,
        "fixes": [
            dict(name=fix.name, releases=_releases(fix), changes=fix.changes, switched_off=fix.name in skipped)
            for fix in FIXES
        ],
        "lightning": lightning,
        "still_needed": _still_needed(lightning),
        "nothing_to_patch": not installed_packages() and importlib.util.find_spec("torch") is None,
        "armed": {"state": "off" if off else "armed" if by else "not armed", "by": by},
        "child": None,
        "problems": _problems_of_the_variables(),
    }
    if not found and state == "on" and not bootstraps:
        report["problems"].append(
            f"{shown} arms nothing in this interpreter: no folder it reads start-up files from holds "
            f"{ENVIRONMENT_FILE} ({_why_not_read()}). Install fsdp-shim into this environment with pip, or use "
            "`fsdp-shim run`"
        )
    missing = [entry for entry in bootstraps if not os.path.isdir(entry)]
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
    armed, env, (state, shown, _) = report["armed"], report["environment_file"], _shim()
    how = {"fsdp-shim run": "its bootstrap is first on PYTHONPATH"}
    sources = [(source, how.get(source, f"read by {env['path']}")) for source in armed["by"]]
    if armed["state"] == "off":
        lines = [f"Shim: OFF. {shown} switches off every activation: Lightning runs as shipped."]
        return lines + (["  Without it, this would arm the shim:", *_table(sources)] if sources else [])
    if armed["state"] == "armed":
        return ["Shim: ARMED in every Python started from here, by:", *_table(sources)]
    if report["nothing_to_patch"] and state != "on":
        return ["Shim: NOT ARMED, and there is nothing to arm it for: no torch, no Lightning here (see below)."]
    ways = [(f"{SHIM}=1 python train.py", "one command and every process it starts")] if env["read"] else []
    ways += [
        ("fsdp-shim run python train.py", "the same, also for interpreters of another environment"),
        ("import fsdp_shim", "in the training script: that script only (status cannot see it)"),
    ]
    nothing = f"{shown} arms nothing here (see PROBLEM)" if state == "on" else "nothing arms it"
    return [f"Shim: NOT ARMED in a Python started from here: {nothing}. Any one of these arms it:", *_table(ways)]


def render(report: Report) -> str:
    off, env, child = _shim()[2], report["environment_file"], report["child"]
    lines = [f"fsdp-shim {report['shim_version']}  (python: {report['python']})", "", *_armed_lines(report), ""]
    unset = {SHIM: "1 arms the shim, 0 switches it off", STRICT: "strict mode off"}
    unset[SHIM] = "nothing to arm here" if report["nothing_to_patch"] else unset[SHIM]
    for name, value in report["toggles"].items():
        is_off = " (the shim is OFF: Lightning runs as shipped)" if off and name == SHIM else ""
        if value is not None or name in unset:
            lines.append(f"{name}={value!r}{is_off}" if value is not None else f"{name} unset ({unset[name]})")
    lines += ["", "Activations:"]
    where = f"{env['path']}  (arms every interpreter where {SHIM}=1)" if env["read"] else ""
    lines.append(f"  FSDP_SHIM=1    {where or f'arms nothing here: {_why_not_read()}'}")
    bootstraps = [f"  fsdp-shim run  bootstrap on PYTHONPATH: {entry}" for entry in report["bootstrap_on_pythonpath"]]
    lines += bootstraps or ["  fsdp-shim run  not active in this shell"]
    lines += ["", f"Fixes (switch one off with {DISABLED}=NAME):"]
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
    if child is not None:
        status = child.get("status") or {}
        why = f"{off} switches it off" if off else "nothing armed it at start-up"
        loaded = f"shim loaded, armed by: {'; '.join(status.get('sources') or []) or 'unknown'}"
        lines += ["", "A fresh interpreter (imports Lightning, not fsdp_shim):"]
        lines.append(f"  {loaded if child['shim_loaded'] else f'shim not loaded: {why}'}")
        lines += [
            f"  {ns['namespace']:<18} {ns['version'] or '-':<10} {ns['reason']}"
            for ns in status.get("namespaces", [])
            if ns["imported"]
        ]
    ok = "OK: no problem found" + (f"; the shim is OFF ({off}), so nothing is patched" if off else "")
    ok = NOTHING_TO_PATCH.format(python=report["python"]) if report["nothing_to_patch"] else ok
    return "\n".join([*lines, "", *([f"PROBLEM: {p}" for p in report["problems"]] or [ok])])
