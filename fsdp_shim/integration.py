"""Patching one Lightning namespace: the ddtrace-style ``patch`` / ``unpatch`` / ``get_version``
contract, with the version and class gates, and a status read from the classes themselves.

Everything here runs inside import hooks, where an exception would make the user's
``import lightning`` fail, so every problem goes through ``fsdp_shim.failures.report``: a warning
and an untouched Lightning, or in strict mode an error naming the target and the release.

Threads: imports happen without any lock held (another thread may be importing the same Lightning
modules, and a lock held across an import is how deadlocks start); the lock only guards the
bookkeeping and the few ``setattr`` calls on the classes.
"""

from __future__ import annotations

import importlib
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from _fsdp_shim_startup import finders_in_front, loaded_past_the_watcher
from _fsdp_shim_startup import pending as pending_imports
from fsdp_shim import failures, late_activation, patching
from fsdp_shim.backport import (
    NAMESPACES,
    Namespace,
    PatchTarget,
    base_release,
    is_affected_release,
    patch_plan,
    unaffected_reason,
)
from fsdp_shim.failures import debug, info_on_rank_zero
from fsdp_shim.report import NOT_IMPORTED, NamespaceStatus


@dataclass
class _Record:
    decision: NamespaceStatus | None = None
    """What the gates decided when the namespace was checked; ``None`` until then."""
    installed: list[patching.Installed] = field(default_factory=list)
    deactivated: bool = False
    activated_after_import: bool = False
    module: Any = None
    """The namespace's module object when it was checked: another one in ``sys.modules`` now means it
    was imported again (new classes), and this record describes a copy that is gone."""


@dataclass
class _Step:
    target: PatchTarget
    owner: type
    function: Any
    composed_with: str | None
    label: str


@dataclass
class _Plan:
    version: str
    steps: list[_Step]
    adopted: list[patching.Installed]


@dataclass
class _Refusal:
    """A namespace that must be left alone, and why (reported once through the failure policy)."""

    version: str | None
    affected: bool | None
    problem: str


_records: dict[str, _Record] = {ns.name: _Record() for ns in NAMESPACES}
_retired: dict[str, list[_Record]] = {ns.name: [] for ns in NAMESPACES}
"""Records of earlier copies of a namespace (imported again since): ``unpatch`` still restores them."""
_lock = threading.Lock()


def _replaced(record: _Record, namespace: Namespace) -> str | None:
    """Why ``record`` no longer describes the namespace in ``sys.modules``, or ``None`` if it does.

    Read from the modules themselves: a namespace module, or a module holding one of the patched
    classes, that was removed from ``sys.modules`` and imported again holds new, unpatched classes."""
    if record.decision is None:
        return None
    if record.module is not None and sys.modules.get(namespace.name) is not record.module:
        return f"{namespace.name} was imported again after fsdp-shim checked it"
    for item in record.installed:
        current = getattr(sys.modules.get(item.owner.__module__), item.owner.__name__, None)
        if current is not item.owner:
            return (
                f"{item.owner.__module__} was imported again after fsdp-shim patched it ({item.label} is a new class)"
            )
    return None


def _renew(namespace: Namespace) -> _Record:
    """The record for the namespace as imported now; a stale one is retired (call with ``_lock``)."""
    record = _records[namespace.name]
    if _replaced(record, namespace) is None:
        return record
    record.installed = [item for item in record.installed if not _still_current(item)]  # the rest: adopted
    _retired[namespace.name].append(record)
    fresh = _Record(activated_after_import=record.activated_after_import)
    _records[namespace.name] = fresh
    return fresh


def _still_current(item: patching.Installed) -> bool:
    return getattr(sys.modules.get(item.owner.__module__), item.owner.__name__, None) is item.owner


def get_version(namespace: Namespace) -> str | None:
    """The version of the *imported* namespace, read from the module rather than from package
    metadata, which can describe a different copy than the one on ``sys.path``."""
    version = getattr(sys.modules.get(namespace.name), "__version__", None)
    return version if isinstance(version, str) else None


def patch(namespace: Namespace, *, activated_after_import: bool = False) -> NamespaceStatus:
    """Make an imported, affected namespace behave like Lightning 2.5.0; leave any other alone.

    Idempotent: a namespace is checked once; after ``deactivate()`` it is checked again, and a
    wrapper that had to stay under another library's wrapper is switched back on, not stacked.
    """
    if namespace.name not in sys.modules:
        return current_status(namespace)
    with _lock:
        record = _renew(namespace)
        if activated_after_import:
            record.activated_after_import = True
        if _switch_back_on(record) or (record.decision is not None and not record.deactivated):
            return current_status(namespace)
    outcome = _plan(namespace)
    problem = None
    with _lock:
        if record.installed or (record.decision is not None and not record.deactivated):
            return current_status(namespace)  # another thread got here first
        record.module = sys.modules.get(namespace.name)
        if isinstance(outcome, NamespaceStatus):
            record.decision = outcome
        elif isinstance(outcome, _Refusal):
            record.decision = _not_patched(namespace, outcome)
            problem = outcome.problem
        else:
            problem = _install(record, namespace, outcome)
        record.deactivated = False
    if problem is not None:
        failures.report(
            f"fsdp-shim: cannot patch {namespace.name} {get_version(namespace) or '(unknown version)'}: {problem}",
            "Lightning was left unchanged, so FSDP 'true' precisions keep the memory bug",
            key=f"patch:{namespace.name}",
        )
    elif record.installed:
        info_on_rank_zero(
            "fsdp-shim: patched %s %s so FSDP 'true' precisions cast the model as Lightning 2.5.0 does (%s)",
            namespace.name,
            get_version(namespace),
            ", ".join(item.label for item in record.installed),
        )
        if activated_after_import:
            late_activation.warn_about_models_already_wrapped(namespace)
    else:
        debug("%s: %s", namespace.name, current_status(namespace).reason)
    return current_status(namespace)


def _switch_back_on(record: _Record) -> bool:
    """Wrappers left switched off under another library's wrapper by ``unpatch`` are reused."""
    if not record.installed:
        return False
    for item in record.installed:
        item.state.enabled = True
    record.deactivated = False
    return True


def _plan(namespace: Namespace) -> NamespaceStatus | _Refusal | _Plan:
    """Gate the namespace and resolve every target; nothing is changed yet."""
    version = get_version(namespace)
    if version is None:
        return _Refusal(None, None, f"{namespace.name}.__version__ is missing")
    if base_release(version) is None:
        return _Refusal(version, None, f"its version {version!r} is not PEP 440, so the shim cannot tell its release")
    if not is_affected_release(version):
        return NamespaceStatus(
            namespace=namespace.name, imported=True, version=version, affected=False, reason=unaffected_reason(version)
        )
    steps: list[_Step] = []
    adopted: list[patching.Installed] = []
    try:
        for target in patch_plan(namespace, version):
            owner = _resolve_class(namespace, target)
            label = target.label(namespace)
            mine = patching.find_own_wrapper(owner, target.attribute)
            if mine is not None:  # installed by an earlier copy of these modules (a reload): take it over
                adopted.append(patching.adopt(owner, target.attribute, target.inherited, mine, label))
                continue
            function, composed_with = patching.function_to_wrap(owner, target.attribute, target.inherited, label)
            steps.append(_Step(target, owner, function, composed_with, label))
    except (ImportError, patching.TargetChanged) as error:
        return _Refusal(version, True, str(error))
    return _Plan(version, steps, adopted)


def _not_patched(namespace: Namespace, refusal: _Refusal) -> NamespaceStatus:
    return NamespaceStatus(
        namespace=namespace.name,
        imported=True,
        version=refusal.version,
        affected=refusal.affected,
        reason=f"not patched: {refusal.problem}",
    )


def _resolve_class(namespace: Namespace, target: PatchTarget) -> type:
    module = importlib.import_module(target.module_in(namespace))
    owner = getattr(module, target.class_name, None)
    if not isinstance(owner, type):
        raise patching.TargetChanged(f"{target.module_in(namespace)} has no class {target.class_name}")
    return owner


def _install(record: _Record, namespace: Namespace, plan: _Plan) -> str | None:
    """Install every wrapper or none; returns the problem when none could be."""
    installed = list(plan.adopted)
    try:
        for step in plan.steps:
            installed.append(
                patching.install(
                    step.owner,
                    step.target.attribute,
                    step.function,
                    step.target.conversion,
                    step.label,
                    step.composed_with,
                )
            )
    except Exception as error:  # setattr on a class can fail (slots, metaclasses): undo what was done
        for item in reversed(installed[len(plan.adopted) :]):
            item.remove()
        refusal = _Refusal(plan.version, True, f"installing a wrapper failed ({type(error).__name__}: {error})")
        record.decision = _not_patched(namespace, refusal)
        return refusal.problem
    record.installed = installed
    record.decision = NamespaceStatus(
        namespace=namespace.name,
        imported=True,
        version=plan.version,
        affected=True,
        patched=True,
        reason="patched",
        targets=tuple(item.label for item in installed),
    )
    return None


def unpatch(namespace: Namespace) -> NamespaceStatus:
    """Put back the exact objects that were on the classes before the shim patched them.

    A wrapper of the shim's that other code has wrapped since is not torn out from under that code:
    it is switched off in place (it passes every call through), and a warning says so.
    """
    record = _records[namespace.name]
    with _lock:
        for old in _retired[namespace.name]:  # earlier copies' classes, which old objects may still use
            for item in reversed(old.installed):
                if item.placement() == "on top":
                    item.remove()
            old.installed = []
        results = [(item, item.remove()) for item in reversed(record.installed)]
        record.installed = [item for item, placement in results if placement == "under another wrapper"]
        if record.decision is not None:
            record.deactivated = True
    for item, placement in results:
        if placement == "under another wrapper":
            failures.warn_once(
                f"fsdp-shim: deactivated its wrapper on {item.label} in place, because other code "
                f"({item.found_on_top()}) has wrapped it since; it now passes every call through, and "
                "the other code's wrapper is left as it is",
                key=f"buried:{item.label}",
            )
        elif placement == "gone":
            failures.warn_once(
                f"fsdp-shim: its wrapper on {item.label} had already been replaced by other code "
                f"({item.found_on_top()}); nothing of the shim's is left there to remove",
                key=f"gone:{item.label}",
            )
    return current_status(namespace)


def current_status(namespace: Namespace) -> NamespaceStatus:
    """The namespace's state, read from the classes: another library replacing or wrapping the
    shim's wrapper, or a call that fell back, changes what this says."""
    record = _records[namespace.name]
    if namespace.name not in sys.modules:
        return NamespaceStatus(namespace=namespace.name, reason=NOT_IMPORTED)
    decision = record.decision
    if decision is None:
        reason = "imported; not checked yet"
        if namespace.name in loaded_past_the_watcher():
            module = sys.modules.get(namespace.name)
            reason = (
                f"imported; not checked yet: {finders_in_front(module)} loaded it without fsdp-shim's import "
                "watcher seeing it (fsdp_shim.activate() checks it now)"
            )
        elif namespace.name in pending_imports():
            reason += " (its import finished while fsdp-shim was being activated; call fsdp_shim.activate())"
        return NamespaceStatus(
            namespace=namespace.name,
            imported=True,
            version=get_version(namespace),
            reason=reason,
            activated_after_import=record.activated_after_import,
        )
    status = replace(decision, activated_after_import=record.activated_after_import)
    gone = _replaced(record, namespace)
    if gone is not None:
        return replace(
            status,
            version=get_version(namespace),
            patched=False,
            targets=(),
            reason=f"not patched: {gone}, and its new classes were not checked yet (fsdp_shim.activate() checks them)",
        )
    if not decision.patched:
        return status
    if record.deactivated and not record.installed:
        return replace(status, patched=False, reason="deactivated")
    problems, notes = _inspect(record.installed)
    if record.deactivated:
        return replace(status, patched=False, reason="deactivated; " + "; ".join(problems))
    if problems:
        return replace(status, patched=False, reason="not patched: " + "; ".join(problems))
    return replace(status, reason="patched" + (f" ({'; '.join(notes)})" if notes else ""))


def _inspect(installed: list[patching.Installed]) -> tuple[list[str], list[str]]:
    problems, notes = [], []
    for item in installed:
        placement = item.placement()
        if placement == "gone":
            problems.append(f"other code replaced its wrapper on {item.label} (the class holds {item.found_on_top()})")
        elif not item.state.enabled:
            problems.append(f"its wrapper on {item.label} stays under {item.found_on_top()} and passes calls through")
        elif item.state.fallback is not None:
            problems.append(f"{item.label} fell back to Lightning's own method at call time ({item.state.fallback})")
        else:
            if placement == "under another wrapper":
                notes.append(f"its wrapper on {item.label} is under {item.found_on_top()}")
            if item.composed_with is not None:
                notes.append(f"on {item.label} it wraps {item.composed_with}, which was there before")
    return problems, notes
