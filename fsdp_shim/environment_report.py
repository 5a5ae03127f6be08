"""``fsdp-shim status``: what this environment holds and whether the pieces agree.

Without ``--python-check`` nothing is imported: Lightning versions come from package metadata and
the verdict from the version gate alone. ``--python-check`` starts a fresh interpreter that imports
Lightning the way a training script would (without importing fsdp_shim itself), so it shows what the
start-up file or ``fsdp-shim run`` actually achieve, including the class-level gates.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _fsdp_shim_startup import LIGHTNING_PACKAGES, switch_state, valid_values
from fsdp_shim import __version__, startup_files
from fsdp_shim.backport import is_affected_release
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT
from fsdp_shim.lightning_install import describe_import_failure, distribution_of, namespaces_of
from fsdp_shim.runner import BOOTSTRAP_DIRECTORY, bootstrap_on_pythonpath

PYTHON_CHECK = Path(__file__).resolve().parent / "_children" / "python_check.py"
"""The ``--python-check`` child, run by its path: it imports Lightning as a training script does and
writes what the shim did to a file of its own (see the script)."""


@dataclass
class EnvironmentReport:
    shim_version: str = __version__
    python: str = sys.executable
    toggles: dict[str, str | None] = field(default_factory=dict)
    startup_files: list[dict[str, Any]] = field(default_factory=list)
    bootstrap_on_pythonpath: list[str] = field(default_factory=list)
    lightning: list[dict[str, Any]] = field(default_factory=list)
    child: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "consistent": self.consistent}


def _switched_off() -> str | None:
    """``FSDP_SHIM='0'`` (as written) when the variable switches the shim off, else ``None``."""
    raw = os.environ.get(FSDP_SHIM)
    return f"{FSDP_SHIM}={raw!r}" if switch_state(raw) in ("off", "invalid") else None


def _installed_lightning() -> list[dict[str, Any]]:
    off = _switched_off()
    rows = []
    for module in LIGHTNING_PACKAGES:
        found = distribution_of(module)
        if found is None:
            continue
        distribution, version = found
        for namespace in namespaces_of(module):
            affected = is_affected_release(version)
            rows.append(
                {
                    "namespace": namespace,
                    "distribution": distribution,
                    "version": version,
                    "affected": affected,
                    "verdict": (
                        f"not patched: {off} switches the shim off"
                        if affected and off
                        else "would be patched (release lacks the fix)"
                        if affected
                        else "left untouched (fixed upstream, or no 'true' precisions)"
                    ),
                }
            )
    return sorted(rows, key=lambda row: row["namespace"])


def _check_toggles(report: EnvironmentReport) -> None:
    for name in (FSDP_SHIM, FSDP_SHIM_STRICT):
        raw = os.environ.get(name)
        report.toggles[name] = raw
        if switch_state(raw) == "invalid":
            meaning = "the shim is OFF" if name == FSDP_SHIM else "strict mode is ON"
            report.problems.append(f"{name}={raw!r} is not a valid value ({valid_values()}); {meaning}")


def _check_activations(report: EnvironmentReport) -> None:
    for found in startup_files.find():
        report.startup_files.append({"path": str(found.path), "current": found.current})
        if not found.current:
            report.problems.append(f"{found.path} was written by another fsdp-shim version; run `fsdp-shim install`")
        elif found.path.name == startup_files.PTH_NAME:
            instead = startup_files.copy_imported_instead(found.path.parent)
            if instead is not None and not instead.exists():
                report.problems.append(
                    f"{found.path} imports {startup_files.COPY_MODULE}, which is missing ({instead}), so it "
                    "arms nothing and every interpreter start prints an error: run `fsdp-shim install` again"
                )
            elif instead is not None:
                report.problems.append(
                    f"{found.path} imports {startup_files.COPY_MODULE} by name and finds {instead}, not this "
                    "version's copy, so it arms nothing: remove that file, or run `fsdp-shim install` where it is"
                )
    if report.startup_files and importlib.util.find_spec("_fsdp_shim_startup") is None:
        report.problems.append("a start-up file is installed but its module _fsdp_shim_startup cannot be imported")
    for entry in bootstrap_on_pythonpath(os.environ):
        report.bootstrap_on_pythonpath.append(entry)
        if not os.path.isdir(entry):
            report.problems.append(f"PYTHONPATH holds an fsdp-shim bootstrap folder that does not exist: {entry}")
        elif os.path.realpath(entry) != BOOTSTRAP_DIRECTORY:
            report.problems.append(
                f"PYTHONPATH holds another fsdp-shim's bootstrap ({entry}), not this one's ({BOOTSTRAP_DIRECTORY})"
            )


class NoTemporaryFolder(Exception):
    """``--python-check`` needs a temporary folder for its child's report, and has none."""


def _run_child_check() -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    try:
        folder = tempfile.mkdtemp(prefix="fsdp-shim-status-")
    except OSError as error:
        raise NoTemporaryFolder(f"no usable temporary folder ({type(error).__name__}: {error}); set TMPDIR") from None
    try:
        out = Path(folder, "report.json")
        command = [sys.executable, str(PYTHON_CHECK), str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        try:
            return proc, json.loads(out.read_text())
        except (OSError, ValueError):
            return proc, None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_child(report: EnvironmentReport) -> None:
    proc, child = _run_child_check()
    if proc.returncode != 0 or child is None:
        tail = proc.stderr.strip()[-500:] or f"exit {proc.returncode}, no report"
        report.problems.append(f"a fresh interpreter failed to import Lightning: {tail}")
        return
    report.child = child
    for package, failure in child.get("failed", {}).items():
        report.problems.append(describe_import_failure(package, failure))
    switched_off = switch_state(os.environ.get(FSDP_SHIM)) in ("off", "invalid")
    activation_present = bool(report.startup_files or report.bootstrap_on_pythonpath)
    if activation_present and not switched_off and not child["shim_loaded"]:
        report.problems.append("a start-up activation is present but a fresh interpreter did not load the shim")
    for namespace in (child.get("status") or {}).get("namespaces", []):
        if namespace["imported"] and namespace["affected"] and not namespace["patched"] and not switched_off:
            name, version, reason = namespace["namespace"], namespace["version"], namespace["reason"]
            report.problems.append(f"{name} {version} is affected but was not patched: {reason}")


def collect(python_check: bool = False) -> EnvironmentReport:
    report = EnvironmentReport()
    _check_toggles(report)
    _check_activations(report)
    report.lightning = _installed_lightning()
    if python_check:
        _check_child(report)
    return report


def render(report: EnvironmentReport) -> str:
    lines = [f"fsdp-shim {report.shim_version}  (python: {report.python})", ""]
    shim = report.toggles.get(FSDP_SHIM)
    off = switch_state(shim) in ("off", "invalid")
    if shim is None:
        lines.append(f"{FSDP_SHIM} unset (shim on)")
    else:
        lines.append(f"{FSDP_SHIM}={shim!r}" + (" (the shim is OFF: Lightning runs as shipped)" if off else ""))
    strict = report.toggles.get(FSDP_SHIM_STRICT)
    lines.append(f"{FSDP_SHIM_STRICT}={strict!r}" if strict is not None else f"{FSDP_SHIM_STRICT} unset (strict off)")
    lines += ["", "Activations:"]
    if report.startup_files:
        lines += [
            f"  start-up file  {f['path']}" + ("" if f["current"] else "  (outdated)") for f in report.startup_files
        ]
    else:
        lines.append("  start-up file  not installed (`fsdp-shim install`)")
    if report.bootstrap_on_pythonpath:
        lines += [f"  fsdp-shim run  bootstrap on PYTHONPATH: {entry}" for entry in report.bootstrap_on_pythonpath]
    else:
        lines.append("  fsdp-shim run  not active in this shell")
    lines += ["", "Lightning (from package metadata):"]
    if not report.lightning:
        lines.append("  none installed")
    for row in report.lightning:
        lines.append(f"  {row['namespace']:<18} {row['version']:<10} {row['verdict']}")
    if report.child is not None:
        lines += ["", "A fresh interpreter (imports Lightning, not fsdp_shim):"]
        if not report.child["shim_loaded"]:
            why = f"{FSDP_SHIM}={shim!r} switches it off" if off else "no start-up activation reached it"
            lines.append(f"  shim not loaded: {why}")
        for namespace in (report.child.get("status") or {}).get("namespaces", []):
            if namespace["imported"]:
                lines.append(f"  {namespace['namespace']:<18} {namespace['version'] or '-':<10} {namespace['reason']}")
    lines.append("")
    ok = f"OK: consistent; the shim is OFF ({FSDP_SHIM}={shim!r}), so nothing is patched" if off else "OK: consistent"
    lines += [f"PROBLEM: {p}" for p in report.problems] or [ok]
    return "\n".join(lines)
