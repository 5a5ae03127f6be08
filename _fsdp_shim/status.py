"""``fsdp_shim.status()``: what the shim did in this process, read from the classes now, and the sentences that
say it (``reason``, ``str()``). Loaded only when asked: a training process needs none of it."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import _fsdp_shim as startup
from _fsdp_shim import NAMESPACES, config, failures
from _fsdp_shim._version import __version__
from _fsdp_shim.config import FIXES, RECOMPUTE, SHIM_VARIABLE, Fix, State

_SAID = {
    State.NOT_IMPORTED: "not imported yet; it is checked when it is imported",
    State.NOT_CHECKED: "imported; not checked yet",
    State.PATCHED: "patched",
    State.NOT_SHOWN: "not shown yet",
    State.NOT_IN_EFFECT: "not in effect",
    State.NOT_AFFECTED: "no 'true' precisions for FSDP in this release; nothing to fix",
    State.BUILT_IN: "left untouched: this release contains it",
    State.TORCH_HAS_IT: "not needed: torch left untouched",
    State.DISABLED: f"switched off by {config.DISABLED_FIXES_VARIABLE}",
    State.SWITCHED_OFF: "switched off",
    State.DEACTIVATED: "deactivated",
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
        if self.detail and self.state in (State.PATCHED, State.BUILT_IN):
            return f"{_SAID[self.state]} ({self.detail})"
        return f"{_SAID[self.state]}: {self.detail}" if self.detail else _SAID[self.state]

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
    note: str = ""  # why it was not checked, where a finder in front of the shim's loaded it

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
    def targets(self) -> tuple[str, ...]:
        return tuple(target for f in self.fixes for target in f.targets)

    @property
    def reason(self) -> str:
        """``patched`` (with the fixes' notes), else what keeps each fix off."""
        if all(f.state is State.NOT_CHECKED for f in self.fixes):
            return _SAID[State.NOT_CHECKED] + (f": {self.note}" if self.note else "")
        if self.patched:
            notes = [f"{f.fix}: {f.detail}" for f in self.fixes if f.patched and f.detail]
            return "patched" + (f" ({'; '.join(notes)})" if notes else "")
        left = [f for f in self.fixes if not f.patched and f.affected is not False] or list(self.fixes)
        reasons = list(dict.fromkeys(f.reason for f in left))
        return reasons[0] if len(reasons) == 1 else "; ".join(f"{f.fix}: {f.reason}" for f in left)

    def fix(self, name: str) -> FixStatus:
        return {status.fix: status for status in self.fixes}[name]

    def as_dict(self) -> dict[str, Any]:
        fields = ("affected", "patched", "reason", "targets")
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
        state = "active" if self.active else "inactive"
        if not self.enabled:
            patched = any(f.patched for n in self.namespaces for f in n.fixes)
            kept = " (what it patched before stays patched; fsdp_shim.deactivate() removes it)" if patched else ""
            state = f"switched off by {SHIM_VARIABLE}{kept}"
        via = f" via {', '.join(self.sources)}" if self.sources and self.enabled else ""
        lines = [f"fsdp-shim {self.shim_version}: {state}{via}" + (" (strict)" if self.strict else "")]
        if self.disabled_fixes:
            lines.append(f"  fixes switched off: {', '.join(self.disabled_fixes)}")
        for status in self.namespaces:
            lines.append(f"  {status.namespace:<18} {status.version or '-':<10} {status.reason}")
            if status.imported:
                lines += [f"    {fix.fix:<10} {fix.reason}" for fix in status.fixes]
        return "\n".join(lines)


def collect(on: bool, active: bool, late: set[str]) -> ShimStatus:
    """The shim in this process: ``on`` by FSDP_SHIM, ``active`` here, ``late`` the namespaces imported before it."""
    skipped, environment = config.disabled_fixes()[0], {name: os.environ.get(name) for name in config.VARIABLES[:4]}
    namespaces = tuple(_namespace(name, on, name in late) for name in NAMESPACES)
    disabled = tuple(name for name in config.FIX_NAMES if name in skipped)
    strict, sources = failures.strict_mode(), tuple(startup.ARMED_BY)
    return ShimStatus(__version__, on, strict, active, sources, environment, namespaces, disabled)


def _namespace(name: str, on: bool, late: bool) -> NamespaceStatus:
    module = sys.modules.get(name)
    if module is None:
        return NamespaceStatus(name, fixes=tuple(FixStatus(fix.name) for fix in FIXES))
    version = module.__version__ if isinstance(getattr(module, "__version__", None), str) else None
    try:
        from _fsdp_shim import wrappers  # noqa: F401 - its patching code (wrapt) may be missing
    except ImportError as error:
        detail = f"fsdp-shim's patching code cannot be imported ({error})"
        fixes = tuple(FixStatus(f.name, State.FAILED, True, detail) for f in FIXES)
        return NamespaceStatus(name, True, version, late, fixes)
    fixes = tuple(reading(name, fix) for fix in FIXES)
    off = f"{SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE, '')!r}"
    if not on:  # what stays patched, or needs nothing, says so
        fixes = tuple(
            f if f.patched or f.affected is False else FixStatus(f.fix, State.SWITCHED_OFF, f.affected, off)
            for f in fixes
        )
    note = ""
    if name in startup.not_handed_over():
        from _fsdp_shim.late import finders_in_front

        note = f"{finders_in_front(module)} loaded it without fsdp-shim's import watcher seeing it "
        note += "(fsdp_shim.activate() checks it now)"
    return NamespaceStatus(name, True, version, late, fixes, note)


def reading(namespace: str, fix: Fix) -> FixStatus:
    """The fix in the namespace, read from the classes now: another library's wrapper, a fallback or a
    namespace imported again changes it."""
    from _fsdp_shim import recompute_check as check
    from _fsdp_shim import wrappers
    from _fsdp_shim.removal import describe, found_on_top

    module = sys.modules.get(namespace)
    record = None if module is None else wrappers.records.get((namespace, fix.name))
    if module is None or record is None:
        return FixStatus(fix.name, State.NOT_IMPORTED if module is None else State.NOT_CHECKED)
    again = wrappers.imported_again(record, namespace, module)
    if again is not None:
        return FixStatus(fix.name, State.FAILED, record.affected, f"{again}, and its new classes were not checked yet")
    if record.state not in (State.PATCHED, State.DEACTIVATED):
        return FixStatus(fix.name, record.state, record.affected, record.detail)
    targets = tuple(wrapper.shim_state.label for wrapper in record.wrappers)
    problems, notes = [], []
    for wrapper in record.wrappers:
        state, where, top = wrapper.shim_state, wrappers.placement(wrapper), found_on_top(wrapper)
        if where == wrappers.GONE:
            problems.append(f"other code replaced its wrapper on {state.label} (the class holds {top})")
        elif not state.on:
            problems.append(f"its wrapper on {state.label} stays under {top} and passes calls through")
        elif state.fallback is not None:
            problems.append(f"{state.label} fell back to {failures.owners_own(state)} at call time ({state.fallback})")
        else:
            notes += [f"its wrapper on {state.label} is under {top}"] if where == wrappers.UNDER else []
            if state.target.inherited and not state.inherited:  # another library's method, where Lightning has none
                notes.append(f"on {state.label} it wraps {describe(state.original)}, which was there before")
    if record.state is State.DEACTIVATED or problems:
        off = State.DEACTIVATED if record.state is State.DEACTIVATED else State.FAILED
        return FixStatus(fix.name, off, True, "; ".join(problems), targets)
    if fix is RECOMPUTE:
        where = f"on torch {wrappers.torch_version()}"
        if not check.ran:
            return FixStatus(fix.name, State.NOT_SHOWN, True, f"{where}: its check has not run", targets)
        failed, unchecked, shown = check.found(False, holds=True), check.found(False), check.found(True)
        also = f"; in effect for {check.the_checkpoints(shown)}" if shown else ""
        if failed:
            detail = f"{where} for {check.the_checkpoints(failed)} ({check.whys(failed)}){also}"
            return FixStatus(fix.name, State.NOT_IN_EFFECT, True, detail, targets)
        if unchecked:
            again = "checked again at a later checkpoint call, fsdp_shim.activate() or status()"
            detail = f"{where} for {check.the_checkpoints(unchecked)} ({check.whys(unchecked)}; {again}){also}"
            return FixStatus(fix.name, State.NOT_SHOWN, True, detail, targets)
        by_torch: dict[str, list[str]] = {}
        for path in shown:
            if check.findings[path].why:
                by_torch.setdefault(check.findings[path].why, []).append(path)
        notes += [f"{check.the_checkpoints(paths)}: {why}" for why, paths in by_torch.items()]
    return FixStatus(fix.name, State.PATCHED, True, "; ".join(notes), targets)
