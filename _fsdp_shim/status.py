"""``fsdp_shim.status()``: what the shim did in this process, read from the classes now, in words; and ``fsdp-shim
status``: what this environment holds (from package metadata) and whether the pieces agree. Loaded only when asked."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import site
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import _fsdp_shim as startup
from _fsdp_shim import NAMESPACES, config, failures
from _fsdp_shim._version import __version__
from _fsdp_shim.config import CAST, FIXES, LIGHTNING_PACKAGES, RECOMPUTE, SHIM_VARIABLE, Fix, State, switch_state
from _fsdp_shim.failures import joined, the_checkpoints, whys

_SAID = {  # the states whose value alone does not say it
    State.NOT_IMPORTED: "not imported yet; it is checked when it is imported",
    State.NOT_CHECKED: "imported; not checked yet",
    State.NOT_AFFECTED: "no 'true' precisions for FSDP in this release; nothing to fix",
    State.BUILT_IN: "left untouched: this release contains it",
    State.TORCH_HAS_IT: "not needed: torch left untouched",
    State.DISABLED: f"switched off by {config.DISABLED_FIXES_VARIABLE}",
    State.FAILED: "not patched",
}


@dataclass(frozen=True)
class FixStatus:
    """One fix in one namespace: its ``state``, the ``detail`` beside it, and the functions wrapped for it."""

    fix: str
    state: State = State.NOT_IMPORTED
    affected: bool | None = None  # whether the release lacks this fix; None where it cannot be told
    detail: str = ""
    targets: tuple[str, ...] = ()

    @property
    def patched(self) -> bool:
        return self.state is State.PATCHED

    @property
    def reason(self) -> str:
        """The state in words, with its detail."""
        said = _SAID.get(self.state, self.state.value)
        if not self.detail:
            return said
        return f"{said} ({self.detail})" if self.state in (State.PATCHED, State.BUILT_IN) else f"{said}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value, "patched": self.patched, "reason": self.reason}


@dataclass(frozen=True)
class NamespaceStatus:
    """One Lightning namespace: a ``FixStatus`` per fix, and whether every fix its release lacks is in effect."""

    namespace: str
    imported: bool = False
    version: str | None = None
    activated_after_import: bool = False  # models FSDP wrapped before keep their dtype
    fixes: tuple[FixStatus, ...] = ()

    @property
    def affected(self) -> bool | None:
        known = [f.affected for f in self.fixes if f.affected is not None]
        return any(known) if known else None

    @property
    def patched(self) -> bool:
        """Every fix the release lacks, but those switched off by name, in effect (and at least one)."""
        needed = [f for f in self.fixes if f.affected and f.state is not State.DISABLED]
        return bool(needed) and all(f.patched for f in needed)

    @property
    def reason(self) -> str:
        """``patched`` (with the fixes' notes), else what keeps each fix off."""
        if self.patched:
            notes = [f"{f.fix}: {f.detail}" for f in self.fixes if f.patched and f.detail]
            return "patched" + (f" ({'; '.join(notes)})" if notes else "")
        left = [f for f in self.fixes if not f.patched and f.affected is not False] or list(self.fixes)
        reasons = list(dict.fromkeys(f.reason for f in left))
        return reasons[0] if len(reasons) == 1 else "; ".join(f"{f.fix}: {f.reason}" for f in left)

    def fix(self, name: str) -> FixStatus:
        return {status.fix: status for status in self.fixes}[name]

    def as_dict(self) -> dict[str, Any]:
        fields = ("affected", "patched", "reason")
        return {**asdict(self), "fixes": [f.as_dict() for f in self.fixes], **{k: getattr(self, k) for k in fields}}


@dataclass(frozen=True)
class ShimStatus:
    """The shim in this process (``fsdp_shim.status()``)."""

    shim_version: str
    enabled: bool  # whether FSDP_SHIM leaves it on
    strict: bool
    active: bool  # activated in this process, and not deactivated
    sources: tuple[str, ...]  # how it was armed
    environment: dict[str, str | None]
    namespaces: tuple[NamespaceStatus, ...]
    disabled_fixes: tuple[str, ...] = ()

    def namespace(self, name: str) -> NamespaceStatus:
        return {status.namespace: status for status in self.namespaces}[name]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "namespaces": [n.as_dict() for n in self.namespaces]}

    def __str__(self) -> str:
        state = ("active" if self.active else "inactive") + (f" via {', '.join(self.sources)}" if self.sources else "")
        if not self.enabled:
            patched = any(f.patched for n in self.namespaces for f in n.fixes)
            kept = " (what it patched before stays patched; fsdp_shim.deactivate() removes it)" if patched else ""
            state = f"switched off by {SHIM_VARIABLE}{kept}"
        lines = [f"fsdp-shim {self.shim_version}: {state}" + (" (strict)" if self.strict else "")]
        for status in self.namespaces:
            lines.append(f"  {status.namespace:<18} {status.version or '-':<10} {status.reason}")
            lines += [f"    {fix.fix:<10} {fix.reason}" for fix in status.fixes] if status.imported else []
        return "\n".join(lines)


def collect(on: bool, active: bool, late: set[str]) -> ShimStatus:
    """The shim in this process: ``on`` by FSDP_SHIM, ``active`` here, ``late`` the namespaces it was handed late
    (imported before it was armed, or loaded past its finder)."""
    off, namespaces = f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE, '')!r}", []
    for name in NAMESPACES:
        fixes, module = tuple(reading(name, fix) for fix in FIXES), sys.modules.get(name)
        if module is not None and not on:  # what stays patched, or needs nothing, says so
            fixes = tuple(
                f if f.patched or f.affected is False else FixStatus(f.fix, State.SWITCHED_OFF, f.affected, off)
                for f in fixes
            )
        version = getattr(module, "__version__", None)
        imported, version = module is not None, version if isinstance(version, str) else None
        namespaces.append(NamespaceStatus(name, imported, version, imported and name in late, fixes))
    environment = {name: os.environ.get(name) for name in config.VARIABLES[:4]}
    disabled = tuple(name for name in config.FIX_NAMES if name in config.disabled_fixes()[0])
    strict, sources = failures.strict_mode(), tuple(startup.ARMED_BY)
    return ShimStatus(__version__, on, strict, active, sources, environment, tuple(namespaces), disabled)


def reading(namespace: str, fix: Fix) -> FixStatus:
    """The fix in the namespace, read from the classes now: another library's wrapper, a fallback or a
    namespace imported again changes it."""
    if (module := sys.modules.get(namespace)) is None:
        return FixStatus(fix.name)
    try:
        from _fsdp_shim import recompute_check as check
        from _fsdp_shim import wrappers
    except ImportError as error:  # its patching code (wrapt) may be missing: status() must still answer
        return FixStatus(fix.name, State.FAILED, True, f"fsdp-shim's patching code cannot be imported ({error})")
    if (record := wrappers.records.get((namespace, fix.name))) is None:
        return FixStatus(fix.name, State.NOT_CHECKED)
    if (again := wrappers.imported_again(record, namespace, module)) is not None:
        return FixStatus(fix.name, State.FAILED, record.affected, f"{again}, and its new classes were not checked yet")
    if record.state not in (State.PATCHED, State.DEACTIVATED):
        return FixStatus(fix.name, record.state, record.affected, record.detail)
    targets = tuple(wrapper.shim_state.label for wrapper in record.wrappers)
    problems, notes = [], list[str]()
    for wrapper in record.wrappers:
        state, where, top = wrapper.shim_state, wrappers.placement(wrapper), wrappers.found_on_top(wrapper)
        if where == wrappers.GONE:
            problems.append(f"other code replaced its wrapper on {state.label} (the class holds {top})")
        elif not state.on:
            problems.append(f"its wrapper on {state.label} stays under {top} and passes calls through")
        elif state.fallback is not None:
            problems.append(f"{state.label} fell back to {failures.owners_own(state)} at call time ({state.fallback})")
    if record.state is State.DEACTIVATED or problems:
        off = State.DEACTIVATED if record.state is State.DEACTIVATED else State.FAILED
        return FixStatus(fix.name, off, True, "; ".join(problems), targets)
    if fix is RECOMPUTE:
        where = f"on torch {failures.torch_version()}"
        if not check.ran:
            return FixStatus(fix.name, State.NOT_SHOWN, True, f"{where}: its check has not run", targets)
        shown, again = check.found(True), "; checked again at fsdp_shim.activate() or status()"
        also = f"; in effect for {the_checkpoints(shown)}" if shown else ""
        for decided, paths, later in (
            (State.NOT_IN_EFFECT, check.found(False, holds=True), ""),
            (State.NOT_SHOWN, check.found(False), again),
        ):
            if paths:
                detail = f"{where} for {the_checkpoints(paths)} ({whys(paths, check.findings)}{later}){also}"
                return FixStatus(fix.name, decided, True, detail, targets)
        by_torch = dict.fromkeys(check.findings[path].why for path in shown if check.findings[path].why)
        notes += [f"{the_checkpoints([p for p in shown if check.findings[p].why == why])}: {why}" for why in by_torch]
    return FixStatus(fix.name, State.PATCHED, True, "; ".join(notes), targets)


# ----------------------------------------------------------------------------- fsdp-shim status
def installed_packages() -> list[str]:
    """The Lightning top-level packages this interpreter can find, without importing them."""
    found = []
    for package in LIGHTNING_PACKAGES:
        with contextlib.suppress(ImportError, ValueError):  # a broken entry on sys.path: not importable either
            found += [package] if importlib.util.find_spec(package) is not None else []
    return found


def distribution_of(package: str) -> tuple[str, str] | None:
    """``(distribution, version)`` that provides ``package``, from metadata (so also where its import fails)."""
    packages_distributions = getattr(metadata, "packages_distributions", None)  # Python 3.10+
    names = packages_distributions().get(package, []) if packages_distributions else [package.replace("_", "-")]
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return name, metadata.version(name)
    return None


def import_failure(error: BaseException) -> list[str | None]:
    """An import error as ``[type name, message, missing module]``, as JSON reports carry it."""
    return [type(error).__name__, str(error), getattr(error, "name", None)]


def describe_import_failure(name: str, failure: list[str | None]) -> str:
    """One line naming the package or namespace ``name``, its release, the cause, and the fix where known."""
    kind, message, missing = failure
    found = distribution_of(name.partition(".")[0])
    installed = f" ({found[0]} {found[1]})" if found else ""
    hint = "; Lightning 2.1-2.3 needs setuptools<81 (pip install 'setuptools<81')" if missing == "pkg_resources" else ""
    return f"{name}{installed} is installed but fails to import ({kind}: {message}){hint}"


ENVIRONMENT_FILE = "fsdp_shim_env.pth"
OWN_ENVIRONMENT_FILE = Path(startup.__file__).resolve().parent.parent / ENVIRONMENT_FILE
NOT_READ = f"this fsdp-shim, in {OWN_ENVIRONMENT_FILE.parent}, was not installed here by pip (a clone, --target)"
Report = dict[str, Any]


def _lightning() -> list[Report]:
    """Per installed namespace, from metadata: its distribution and release, and whether it lacks a fix."""
    rows = []
    for namespace in sorted(NAMESPACES):
        if found := distribution_of(namespace.partition(".")[0]):
            affected = any(fix.affects(found[1]) for fix in FIXES)
            rows.append(dict(namespace=namespace, distribution=found[0], version=found[1], affected=affected))
    return rows


def _still_needed(lightning: list[Report]) -> dict[str, Report]:
    """Per fix, whether this environment needs it (True, False, or None where it cannot tell) and why."""
    if not lightning:
        why = "no Lightning in this environment: install fsdp-shim where the training runs, and run its status there"
        return {fix.name: {"needed": None, "why": why} for fix in FIXES}
    releases = {f"{row['namespace']} {row['version']}": row["version"] for row in lightning}
    lacking = [release for release, version in releases.items() if CAST.affects(version)]
    cast = (False, f"every Lightning here has it or needs none ({joined(list(releases))})")
    if lacking:
        cast = (True, f"{joined(lacking)} lack it; it can go once every environment runs Lightning 2.5.0 or later")
    recompute: tuple[bool | None, str] = (False, "no Lightning here has 'true' precisions for FSDP")
    if any(RECOMPUTE.affects(version) for version in releases.values()):
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
    except Exception as error:  # a checkpoint module it cannot read
        return None, f"cannot tell: torch's checkpoint cannot be read ({type(error).__name__}: {error})"
    if not left:
        return False, f"torch {torch.__version__}'s checkpoint restores the default dtype itself"
    return True, (
        "with activation checkpointing: no Lightning release restores the default dtype for a recompute, nor does "
        f"torch {torch.__version__}'s checkpoint for {the_checkpoints(left)}; it can go once torch's does, or "
        "where you train without activation checkpointing"
    )


def environment_report() -> Report:
    """What ``fsdp-shim status --json`` prints, in this key order (``render`` writes it as text). Problems: unreadable
    values, and ``FSDP_SHIM=1`` where nothing reads it."""
    switch, shown = switch_state(os.environ.get(SHIM_VARIABLE)), f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE)!r}"
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    found = next((p for d in [*user, *site.getsitepackages()] if (p := Path(d) / ENVIRONMENT_FILE).is_file()), None)
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)  # any fsdp-shim's bootstrap that exists
    bootstrap = [e for e in entries if e and Path(e).parts[-2:] == ("_fsdp_shim", "bootstrap") and os.path.isdir(e)]
    off = switch in ("off", "invalid")
    by = [shown] * (switch == "on" and found is not None) + ["fsdp-shim run"] * bool(bootstrap)
    problems = [
        f"{name}={os.environ.get(name)!r} is not a valid value ({config.VALID_SWITCH_VALUES}); {meaning}"
        for name, meaning in ((SHIM_VARIABLE, "the shim is OFF"), (config.STRICT_VARIABLE, "strict mode is ON"))
        if switch_state(os.environ.get(name)) == "invalid"
    ]
    if unknown := ", ".join(map(repr, config.disabled_fixes()[1])):
        names = ", ".join(config.FIX_NAMES)
        problems.append(f"{config.DISABLED_FIXES_VARIABLE} names {unknown}, no fix of fsdp-shim ({names})")
    if timeout := config.rank_check_timeout()[1]:
        problems.append(f"{timeout}; the rank check waits as long as the process group's timeout")
    problems += filter(None, [config.log_setting()[1]])
    if switch == "on" and not (found or bootstrap):
        problems.append(
            f"{shown} arms nothing in this interpreter: no folder it reads start-up files from holds "
            f"{ENVIRONMENT_FILE} ({NOT_READ}). Install fsdp-shim into this environment with pip, or use `fsdp-shim run`"
        )
    return {
        "shim_version": __version__,
        "python": sys.executable,
        "toggles": {name: os.environ.get(name) for name in config.VARIABLES},
        "environment_file": {"path": str(found or OWN_ENVIRONMENT_FILE), "read": found is not None},
        "bootstrap_on_pythonpath": bootstrap,
        "lightning": (lightning := _lightning()),
        "still_needed": _still_needed(lightning),
        "armed": {"state": "off" if off else "armed" if by else "not armed", "by": by},
        "problems": problems,
        "consistent": not problems,
    }


def _armed(report: Report, shown: str) -> str:
    """Armed or not, and by what (under ``FSDP_SHIM=0``: what would); where nothing arms it, the ways that would."""
    state, env = report["armed"]["state"], report["environment_file"]
    how = {shown: f"{shown} (read by {env['path']})", "fsdp-shim run": "fsdp-shim run (its bootstrap on PYTHONPATH)"}
    by = joined([how[name] for name in report["armed"]["by"]]) if report["armed"]["by"] else ""
    if state == "off":
        otherwise = f" Without it, {by} would arm it." if by else ""
        return f"Shim: OFF. {shown} switches off every activation: Lightning runs as shipped.{otherwise}"
    if state == "armed":
        return f"Shim: ARMED in every Python started from here, by {by}."
    ways = [f"{SHIM_VARIABLE}=1 (read by {env['path']})"] * env["read"]
    ways += ["fsdp-shim run (also another environment's Python)", "import fsdp_shim in the script (that script only)"]
    not_read = "" if env["read"] else f"; {SHIM_VARIABLE}=1 arms nothing here: {NOT_READ}"
    on = switch_state(report["toggles"][SHIM_VARIABLE]) == "on"
    nothing = f"{shown} arms nothing here (see PROBLEM)" if on else "nothing arms it"
    return f"Shim: NOT ARMED in a Python started from here: {nothing}. Ways to arm it: {'; '.join(ways)}{not_read}"


def render(report: Report) -> str:
    """``report`` as the text ``fsdp-shim status`` prints."""
    shown, off = f"{SHIM_VARIABLE}={report['toggles'][SHIM_VARIABLE]!r}", report["armed"]["state"] == "off"
    toggles = ", ".join(f"{name}={value!r}" for name, value in report["toggles"].items() if value is not None)
    lines = [f"fsdp-shim {report['shim_version']}  (python: {report['python']})", "", _armed(report, shown), ""]
    lines += [f"Set: {toggles or 'no FSDP_SHIM variable'}", "", "Lightning (from package metadata):"]
    lines += [f"  {row['namespace']:<18} {row['version']}" for row in report["lightning"]]
    answer = {True: "needed", False: "not needed", None: "unknown"}
    lines += ["", f"Still needed here? ({config.DOCS}removal.html)"]
    lines += [f"  {name:<10} {answer[a['needed']]}: {a['why']}" for name, a in report["still_needed"].items()]
    ok = "OK: no problem found" + (f"; the shim is OFF ({shown}), so nothing is patched" if off else "")
    return "\n".join([*lines, "", *([f"PROBLEM: {p}" for p in report["problems"]] or [ok])])


def main(as_json: bool) -> int:
    """Print ``fsdp-shim status``'s report; 1 where the pieces disagree."""
    report = environment_report()
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0 if report["consistent"] else 1
