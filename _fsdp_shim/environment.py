"""``fsdp-shim status``: what this environment holds, what would arm the shim here, and whether the pieces agree.
Nothing is imported (versions from package metadata, verdicts from the fixes' release gates); ``--python-check``
has a fresh interpreter import Lightning as a training script does, to show what the activations achieve."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _fsdp_shim
from _fsdp_shim import recompute_check, startup_files
from _fsdp_shim._version import __version__
from _fsdp_shim.config import (
    CAST,
    DISABLED_FIXES_VARIABLE,
    FIXES,
    LIGHTNING_PACKAGES,
    LOG_VARIABLE,
    RANK_CHECK_TIMEOUT_VARIABLE,
    RECOMPUTE,
    SHIM_VARIABLE,
    STRICT_VARIABLE,
    disabled_fixes,
    log_setting,
    rank_check_timeout,
    shim_state,
    strict_state,
    valid_switch_values,
)
from _fsdp_shim.distributions import describe_import_failure, distribution_of, installed_packages, namespaces_of
from _fsdp_shim.run import BOOTSTRAP_DIRECTORY, bootstrap_on_pythonpath
from _fsdp_shim.wrappers import joined, the_checkpoints

PYTHON_CHECK = Path(__file__).resolve().parent / "children" / "python_check.py"  # run by its path
OWN_ENVIRONMENT_FILE = Path(_fsdp_shim.__file__).resolve().parent.parent / startup_files.ENVIRONMENT_FILE
Report = dict[str, Any]


def _switched_off() -> str | None:
    """``FSDP_SHIM='0'`` (as written) when the variable switches the shim off, else ``None``."""
    return f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r}" if shim_state() in ("off", "invalid") else None


def _installed_lightning() -> list[dict[str, Any]]:
    off = _switched_off()
    skipped, _ = disabled_fixes()
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
        affected = any(fix.affects(version) for fix in FIXES)
        verdict = "; ".join(f"{name}: {verdict}" for name, verdict in verdicts.items())
        facts = {"distribution": distribution, "version": version, "affected": affected, "fixes": verdicts}
        rows += [{"namespace": namespace, **facts, "verdict": verdict} for namespace in namespaces_of(package)]
    return sorted(rows, key=lambda row: row["namespace"])


def _torch() -> tuple[str, Path | None] | None:
    """This environment's torch version and its ``torch/utils/checkpoint.py``, found, not imported."""
    found = distribution_of("torch")
    if found is None:
        return None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = [Path(folder, "utils", "checkpoint.py") for folder in folders]
    return found[1], next((file for file in files if file.is_file()), None)


def _still_needed(lightning: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fix, whether this environment needs it (``needed``: True, False, or None where it cannot tell) and why:
    the cast from the Lightning releases installed, the recompute from them and from torch's checkpoint code."""
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
        answers[CAST.name] = {"needed": False, "why": f"every Lightning here has it or needs none ({joined(releases)})"}
    if lacking[RECOMPUTE.name]:
        answers[RECOMPUTE.name] = _recompute_needed()
    else:
        answers[RECOMPUTE.name] = {"needed": False, "why": "no Lightning here has 'true' precisions for FSDP"}
    return answers


def _recompute_needed() -> dict[str, Any]:
    """Whether torch's checkpoint here restores the forward's default dtype itself, path by path (docs/upstream.md)."""
    torch = _torch()
    version, file = torch if torch is not None else (None, None)
    if file is None:
        what = f"torch {version} has no torch/utils/checkpoint.py" if version else "no torch in this environment"
        return {"needed": None, "why": f"cannot tell: {what}"}
    try:
        own = recompute_check.restored_in_file(file)
    except (OSError, SyntaxError, ValueError) as error:
        return {"needed": None, "why": f"cannot tell: {file} cannot be read ({error})"}
    paths = (recompute_check.REENTRANT, recompute_check.NON_REENTRANT, recompute_check.COMPOSABLE)
    left = [path for path in paths if path not in own]
    if not left:
        return {"needed": False, "why": f"torch {version}'s checkpoint restores the default dtype itself (in {file})"}
    which = the_checkpoints(left)
    return {
        "needed": True,
        "why": f"with activation checkpointing: no Lightning release restores the default dtype for a recompute, nor "
        f"does torch {version}'s checkpoint for {which}; it can go once torch's does, or where you train without "
        "activation checkpointing",
    }


def _nothing_to_patch() -> bool:
    """Neither torch nor a Lightning package is importable beside this fsdp-shim: an isolated install (pipx,
    ``uv tool``), which no training process imports from. Looked up, not imported."""
    return not installed_packages() and importlib.util.find_spec("torch") is None


NOTHING_TO_PATCH = (
    "NOTHING TO PATCH HERE: neither torch nor Lightning is installed beside this fsdp-shim ({python}): an "
    "isolated install (pipx, `uv tool`) cannot reach your training. Install fsdp-shim into the environment that "
    "runs the training instead (`pip install fsdp-shim` there), and run `fsdp-shim status` with its Python."
)
"""status's last line where ``nothing_to_patch`` holds, in place of "OK": nothing disagrees, but nothing here is
what the shim is for (exit code 0, as PROBLEM lines alone set 1)."""


def _check_toggles(report: Report) -> None:
    for name in (SHIM_VARIABLE, STRICT_VARIABLE, DISABLED_FIXES_VARIABLE, RANK_CHECK_TIMEOUT_VARIABLE, LOG_VARIABLE):
        report["toggles"][name] = os.environ.get(name)
    states = {SHIM_VARIABLE: (shim_state(), "the shim is OFF"), STRICT_VARIABLE: (strict_state(), "strict mode is ON")}
    for name, (state, meaning) in states.items():
        if state == "invalid":
            raw = os.environ.get(name)
            report["problems"].append(f"{name}={raw!r} is not a valid value ({valid_switch_values()}); {meaning}")
    _, unknown = disabled_fixes()
    if unknown:
        names = ", ".join(fix.name for fix in FIXES)
        report["problems"].append(
            f"{DISABLED_FIXES_VARIABLE} names {', '.join(map(repr, unknown))}, no fix of fsdp-shim ({names})"
        )
    _, problem = rank_check_timeout()
    if problem is not None:
        report["problems"].append(f"{problem}; the rank check waits as long as the process group's timeout")
    _, problem = log_setting()
    if problem is not None:
        report["problems"].append(problem)


def _check_environment_file(report: Report) -> None:
    """``FSDP_SHIM=1`` arms only where ``site`` reads our start-up file: never in a PYTHONPATH folder or a clone."""
    read = [d / startup_files.ENVIRONMENT_FILE for d in startup_files.site_directories()]
    found = next((path for path in read if path.is_file()), None)
    report["environment_file"] = {
        "path": str(found or OWN_ENVIRONMENT_FILE),
        "exists": found is not None or _installed_by_pip(),
        "read": found is not None,
    }
    if found is None and shim_state() == "on" and not (report["startup_files"] or report["bootstrap_on_pythonpath"]):
        report["problems"].append(
            f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r} arms nothing in this interpreter: no folder it reads "
            f"start-up files from holds {startup_files.ENVIRONMENT_FILE} ({_why_not_read()}). Install fsdp-shim "
            "into this environment with pip, run `fsdp-shim install`, or use `fsdp-shim run`"
        )


def _installed_by_pip() -> bool:
    """Whether pip put ``fsdp_shim_env.pth`` next to the package (a clone's root holds it too, as mere source)."""
    return OWN_ENVIRONMENT_FILE.is_file() and any(OWN_ENVIRONMENT_FILE.parent.glob("fsdp_shim-*.dist-info"))


def _why_not_read() -> str:
    if not _installed_by_pip():
        return "this fsdp-shim was not installed by pip (a clone on PYTHONPATH?)"
    return (
        f"this fsdp-shim's is in {OWN_ENVIRONMENT_FILE.parent}, which Python imports from but does not read "
        "start-up files from (pip install --target, PYTHONPATH)"
    )


def _check_activations(report: Report) -> None:
    for found in startup_files.find():
        report["startup_files"].append({"path": str(found.path), "current": found.kind == "current"})
        if found.kind != "current":
            report["problems"].append(
                f"{found.path} is fsdp-shim's but not what this version writes (an earlier version's, or edited "
                "since): run `fsdp-shim install` to rewrite it"
            )
        elif found.path.name == startup_files.PTH_NAME:
            instead = startup_files.copy_imported_instead(found.path.parent)
            if instead is not None and not instead.exists():
                report["problems"].append(
                    f"{found.path} imports {_fsdp_shim.COPY_NAME}, which is missing ({instead}), so it arms "
                    "nothing and every interpreter start prints an error: run `fsdp-shim install` again"
                )
            elif instead is not None:
                report["problems"].append(
                    f"{found.path} imports {_fsdp_shim.COPY_NAME} by name and finds {instead}, not this "
                    "version's copy, so it arms nothing: remove that file, or run `fsdp-shim install` where it is"
                )
    for entry in bootstrap_on_pythonpath(os.environ):
        report["bootstrap_on_pythonpath"].append(entry)
        if not os.path.isdir(entry):
            report["problems"].append(f"PYTHONPATH holds an fsdp-shim bootstrap folder that does not exist: {entry}")
        elif os.path.realpath(entry) != BOOTSTRAP_DIRECTORY:
            report["problems"].append(
                f"PYTHONPATH holds another fsdp-shim's bootstrap ({entry}), not this one's ({BOOTSTRAP_DIRECTORY})"
            )


class NoTemporaryFolder(Exception):
    """``--python-check`` needs a temporary folder for its child's report, and has none."""


def _check_child(report: Report) -> None:
    try:
        folder = tempfile.mkdtemp(prefix="fsdp-shim-status-")
    except OSError as error:
        raise NoTemporaryFolder(f"no usable temporary folder ({type(error).__name__}: {error}); set TMPDIR") from None
    out = Path(folder, "report.json")
    try:
        proc = subprocess.run([sys.executable, PYTHON_CHECK, out], capture_output=True, text=True, timeout=600)
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
    for package, failure in child.get("failed", {}).items():
        report["problems"].append(describe_import_failure(package, failure))
    if _switched_off():
        return
    by_variable = report["environment_file"].get("read") and shim_state() == "on"
    armed_here = by_variable or report["startup_files"] or report["bootstrap_on_pythonpath"]
    if armed_here and child["imported"] and not child["shim_loaded"]:
        report["problems"].append("a start-up activation is present but a fresh interpreter did not load the shim")
    for namespace in (child.get("status") or {}).get("namespaces", []):
        for fix in namespace.get("fixes", []):
            switched_off = fix["reason"].startswith(f"switched off by {DISABLED_FIXES_VARIABLE}")
            if namespace["imported"] and fix["affected"] and not fix["patched"] and not switched_off:
                report["problems"].append(
                    f"{namespace['namespace']} {namespace['version']} lacks the {fix['fix']} fix, and it was not "
                    f"applied: {fix['reason']}"
                )


INSTALL = "fsdp-shim install"
RUN = "fsdp-shim run"


def _armed(report: Report) -> dict[str, Any]:
    """Whether a Python started from here (this environment, these variables) arms the shim at start-up,
    and by what: ``state`` is ``armed``, ``not armed`` or ``off`` (``FSDP_SHIM`` switches every activation
    off); ``by`` names what arms it (``FSDP_SHIM='1'``, ``fsdp-shim install``, ``fsdp-shim run``), or would
    once ``FSDP_SHIM`` no longer switches it off. A script's own ``import fsdp_shim`` arms that script's
    process only: no other process can see it (``fsdp_shim.status()`` in the script does)."""
    by = []
    if report["environment_file"].get("read") and shim_state() == "on":
        by.append(f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r}")
    if report["startup_files"]:
        by.append(INSTALL)
    if report["bootstrap_on_pythonpath"]:
        by.append(RUN)
    state = "off" if _switched_off() else "armed" if by else "not armed"
    return {"state": state, "by": by}


def _armed_lines(report: Report) -> list[str]:
    """The first lines of ``status``: armed or not, by what, and what would arm it."""
    by = report["armed"]["by"]
    env = report["environment_file"]
    pth = [f["path"] for f in report["startup_files"] if Path(f["path"]).name == startup_files.PTH_NAME]
    how = {
        INSTALL: f"its start-up file {pth[0] if pth else '(see Activations)'}",
        RUN: "its bootstrap is first on PYTHONPATH",
    }

    def table(rows: list[tuple[str, str]]) -> list[str]:
        width = max(len(name) for name, _ in rows)
        return [f"  {name:<{width}}  {what}" for name, what in rows]

    sources = [(source, how.get(source, f"read by {env.get('path')}")) for source in by]
    if report["armed"]["state"] == "off":
        lines = [f"Shim: OFF. {_switched_off()} switches off every activation: Lightning runs as shipped."]
        return lines + (["  Without it, this would arm the shim:", *table(sources)] if sources else [])
    if report["armed"]["state"] == "armed":
        scope = "every Python of this environment" if by == [INSTALL] else "every Python started from here"
        return [f"Shim: ARMED in {scope}, by:", *table(sources)]
    if report["nothing_to_patch"] and shim_state() != "on":
        return ["Shim: NOT ARMED, and there is nothing to arm it for: no torch, no Lightning here (see below)."]
    ways = [(f"{SHIM_VARIABLE}=1 python train.py", "one command and every process it starts")]
    if not env.get("read"):
        ways = []  # this interpreter reads no fsdp_shim_env.pth: the variable alone arms nothing
    ways += [
        (f"{RUN} python train.py", "the same, also for interpreters of another environment"),
        ("import fsdp_shim", "in the training script: that script only (status cannot see it)"),
        (INSTALL, "every Python of this environment, until `fsdp-shim uninstall`"),
    ]
    value = os.environ.get(SHIM_VARIABLE)
    nothing = (
        f"{SHIM_VARIABLE}={value!r} arms nothing here (see PROBLEM)" if shim_state() == "on" else "nothing arms it"
    )
    return [f"Shim: NOT ARMED in a Python started from here: {nothing}. Any one of these arms it:", *table(ways)]


def collect(python_check: bool = False) -> Report:
    """What ``status --json`` prints, in this key order; ``render`` writes it as text."""
    skipped, _ = disabled_fixes()
    report: Report = {
        "shim_version": __version__,
        "python": sys.executable,
        "toggles": {},
        "environment_file": {},  # where fsdp_shim_env.pth is, and whether this interpreter reads it
        "startup_files": [],
        "bootstrap_on_pythonpath": [],
        "fixes": [
            {"name": fix.name, "releases": fix.releases(), "changes": fix.changes, "switched_off": fix.name in skipped}
            for fix in FIXES
        ],
        "lightning": _installed_lightning(),
        "still_needed": {},  # per fix: whether this environment needs it, and why
        "nothing_to_patch": _nothing_to_patch(),  # an isolated install (pipx, `uv tool`): NOTHING_TO_PATCH
        "armed": {},  # whether a Python started from this shell arms the shim, and by what
        "child": None,
        "problems": [],
    }
    _check_toggles(report)
    _check_activations(report)
    _check_environment_file(report)
    report["armed"] = _armed(report)
    report["still_needed"] = _still_needed(report["lightning"])
    if python_check:
        _check_child(report)
    report["consistent"] = not report["problems"]
    return report


def render(report: Report) -> str:
    lines = [f"fsdp-shim {report['shim_version']}  (python: {report['python']})", ""]
    lines += [*_armed_lines(report), ""]
    off = _switched_off()
    unset = {SHIM_VARIABLE: "1 arms the shim, 0 switches it off", STRICT_VARIABLE: "strict mode off"}
    if report["nothing_to_patch"]:
        unset[SHIM_VARIABLE] = "nothing to arm here"
    shipped = {SHIM_VARIABLE: " (the shim is OFF: Lightning runs as shipped)"} if off else {}
    for name, value in report["toggles"].items():
        if value is not None:
            lines.append(f"{name}={value!r}{shipped.get(name, '')}")
        elif name in unset:
            lines.append(f"{name} unset ({unset[name]})")
    lines += ["", "Activations:"]
    env = report["environment_file"]
    if env.get("read"):
        lines.append(f"  FSDP_SHIM=1    {env['path']}  (arms every interpreter where {SHIM_VARIABLE}=1)")
    else:
        lines.append(f"  FSDP_SHIM=1    arms nothing here: {_why_not_read()}")
    lines += [
        f"  start-up file  {f['path']}" + ("" if f["current"] else "  (not this version's)")
        for f in report["startup_files"]
    ] or ["  start-up file  not installed (`fsdp-shim install`)"]
    bootstraps = [f"  fsdp-shim run  bootstrap on PYTHONPATH: {entry}" for entry in report["bootstrap_on_pythonpath"]]
    lines += bootstraps or ["  fsdp-shim run  not active in this shell"]
    lines += ["", f"Fixes (switch one off with {DISABLED_FIXES_VARIABLE}=NAME):"]
    for fix in report["fixes"]:
        mark = "  [switched off]" if fix["switched_off"] else ""
        lines += [f"  {fix['name']:<10} Lightning {fix['releases']}{mark}", f"  {'':<10} {fix['changes']}"]
    lines += ["", "Lightning (from package metadata; what the shim does where it is armed):"]
    if not report["lightning"]:
        lines.append("  none installed")
    for row in report["lightning"]:
        lines.append(f"  {row['namespace']:<18} {row['version']}")
        lines += [f"    {name:<10} {verdict}" for name, verdict in row["fixes"].items()]
    lines += ["", "Still needed here? (docs/removal.md)"]
    answer = {True: "needed", False: "not needed", None: "unknown"}
    lines += [f"  {name:<10} {answer[a['needed']]}: {a['why']}" for name, a in report["still_needed"].items()]
    if report["child"] is not None:
        lines += ["", "A fresh interpreter (imports Lightning, not fsdp_shim):"]
        if not report["child"]["shim_loaded"]:
            why = f"{off} switches it off" if off else "nothing armed it at start-up"
            lines.append(f"  shim not loaded: {why}")
        else:
            sources = (report["child"].get("status") or {}).get("sources") or []
            lines.append(f"  shim loaded, armed by: {'; '.join(sources) or 'unknown'}")
        for namespace in (report["child"].get("status") or {}).get("namespaces", []):
            if namespace["imported"]:
                lines.append(f"  {namespace['namespace']:<18} {namespace['version'] or '-':<10} {namespace['reason']}")
    lines.append("")
    ok = "OK: no problem found" + (f"; the shim is OFF ({off}), so nothing is patched" if off else "")
    if report["nothing_to_patch"]:
        ok = NOTHING_TO_PATCH.format(python=report["python"])
    lines += [f"PROBLEM: {p}" for p in report["problems"]] or [ok]
    return "\n".join(lines)
