"""The one wrapper layer: ``patch``, ``unpatch`` and ``status`` for one namespace and one fix, next to
other code that patches the same functions (tracers, profilers, a team's own hot-fix).

Every ``Target`` (``_fsdp_shim.fixes``) of one fix in one namespace is resolved before anything changes,
then all are wrapped or none. Four rules, each because breaking it is silently wrong: a wrapper is known
by its type, never by an attribute (a wrapt proxy answers ``getattr`` for what it wraps); it carries what
removing it needs, so any copy of this module, a reloaded one too, reuses it instead of stacking another;
what is not the shim's is never removed (a wrapper other code wrapped since is switched off in place);
removal restores the very object that was there before. All of it can run inside an import hook: problems
go through ``failures.report``, and the lock guards only the records and ``setattr``, never an import.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import wrapt

from _fsdp_shim import failures
from _fsdp_shim.config import DISABLED_FIXES_VARIABLE, RANK_CHECK, Fix, base_release
from _fsdp_shim.status import NOT_IMPORTED, FixStatus

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Body = Callable[[Callable[..., Any], Any, Args, Kwargs], Any]
"""A wrapper body, with wrapt's signature ``(wrapped, instance, args, kwargs)``."""
Placement = Literal["on top", "under another wrapper", "gone"]
MISSING: Any = object()
_CHAIN_LIMIT = 32  # layers of __wrapped__ followed before giving up (a cycle, or an odd proxy)


class GlueError(Exception):
    """The shim's own glue failed inside a wrapper (a Lightning attribute it reads was renamed). A body
    raises it before changing anything, so the wrapper can call Lightning's method as it found it."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")


class TargetChanged(Exception):
    """A Lightning class no longer has the shape the fix was written against."""


@dataclass(frozen=True)
class Target:
    """A function a fix wraps: a method of a Lightning class, or (``shared``) a function of torch.
    ``inherited``: the class inherits it (removing the wrapper restores inheritance), else the class or
    module defines it (removal puts the function back)."""

    module: str
    """Relative to the namespace, e.g. ``plugins.precision.fsdp``; absolute where ``shared``."""
    class_name: str
    """Empty for a function of the module itself."""
    attribute: str
    inherited: bool
    body: Body
    shared: bool = False
    """Outside Lightning (torch): one wrapper for every namespace that needs the fix, removed with the last."""
    path: str = ""
    """Which of the fix's checked paths it serves (the recompute: a checkpoint kind); see ``Proof``."""

    def label(self, namespace: str) -> str:
        path = self.module if self.shared else f"{namespace}.{self.module}"
        return ".".join(part for part in (path, self.class_name, self.attribute) if part)


Plan = Callable[[str, str], tuple[Target, ...]]
"""``(namespace, version) -> targets``: what a fix wraps in one namespace of one release."""


class NotNeeded(Exception):
    """Raised by a plan where the environment has the fix itself (torch restores the default dtype): the
    message says so, and nothing is wrapped."""


@dataclass(frozen=True)
class Finding:
    """What a fix's check found for one path on the running torch."""

    shown: bool
    why: str = ""
    """What was found instead (or, where shown without a wrapper, whose fix it is)."""
    holds: bool = False
    """Not shown because torch's call path differs: true of every later check on this torch (kept, and the
    path's wrappers come off). Otherwise the check could not run here and is tried again later."""


Proof = Callable[[frozenset[str]], "dict[str, Finding]"]
"""Shows that a fix works once its wrappers are on: a ``Finding`` for every path of the running torch but
those it is given (settled already)."""


# ----------------------------------------------------------------------------- one wrapper
@dataclass
class WrapperState:
    """What one wrapper does (``run``) and what taking it off needs. It is wrapt's switch (``enabled=``),
    called before every call: ``False`` passes the call straight to the wrapped function."""

    fix: str
    label: str
    owner: type | ModuleType
    attribute: str
    body: Body
    original: Any
    """What the class dict held before (Lightning's function or another library's object), else ``None``."""
    inherited: bool
    shared: bool = False
    path: str = ""
    composed_with: str | None = None
    """Set when ``original`` is another library's object where Lightning ships none."""
    on: bool = True
    fallback: str | None = None
    """Why a call fell back to the wrapped function; status then stops saying "patched"."""

    def __call__(self) -> bool:
        return self.on

    def owners_own(self) -> str:
        return "torch's own function" if self.shared else "Lightning's own method"

    def run(self, wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
        """The wrapper: the fix's body, or where the shim's own glue fails, the wrapped function."""
        try:
            return self.body(wrapped, instance, args, kwargs)
        except GlueError as error:
            self.fallback = str(error)
            failures.report(
                f"fsdp-shim: {self.label} could not read what it needs ({error})",
                f"{self.owners_own()} was used for this call, so it runs without the "
                + ("rank check" if self.fix == RANK_CHECK.name else f"{self.fix} fix"),
                key=f"glue:{self.label}",
                cause=error,
            )
            return wrapped(*args, **kwargs)


class ShimWrapper(wrapt.FunctionWrapper):  # type: ignore[name-defined]  # wrapt's stubs: 3.10+
    """The only kind of wrapper fsdp-shim puts on a class: ``ShimWrapper(function, state.run, enabled=state)``."""

    @property
    def shim_state(self) -> WrapperState:
        state: WrapperState = self._self_enabled
        return state


def is_shim_wrapper(obj: object) -> bool:
    """Whether ``obj`` itself (not what it wraps) is a ``ShimWrapper`` of this module or of an earlier copy."""
    return any(k.__name__ == "ShimWrapper" and k.__module__ == __name__ for k in type(obj).__mro__)


def wrapper_chain(obj: object) -> Iterator[object]:
    """``obj`` and what it wraps, layer by layer through ``__wrapped__`` (wrapt and functools)."""
    seen: set[int] = set()
    for _ in range(_CHAIN_LIMIT):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        yield obj
        try:
            obj = obj.__wrapped__  # type: ignore[attr-defined]
        except Exception:  # no further layer (or a proxy that raises): the chain ends here
            return


def describe(obj: object) -> str:
    """A short name for an object found on a class, for messages. A proxy is named by its own type:
    its ``__qualname__`` would be that of the function it wraps."""
    if type(obj) is not getattr(obj, "__class__", type(obj)):
        return f"a {type(obj).__module__}.{type(obj).__qualname__}"
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def placement(wrapper: Any) -> Placement:
    state = wrapper.shim_state
    current = state.owner.__dict__.get(state.attribute, MISSING)
    if current is wrapper:
        return "on top"
    if any(layer is wrapper for layer in wrapper_chain(current)):
        return "under another wrapper"
    return "gone"


def found_on_top(wrapper: Any) -> str:
    state = wrapper.shim_state
    return describe(state.owner.__dict__.get(state.attribute, None))


def remove(wrapper: Any) -> Placement:
    """Restore the class if the shim's wrapper is still what it holds; switch the wrapper off in place
    if other code has wrapped it since; nothing to do if it is gone."""
    state = wrapper.shim_state
    where = placement(wrapper)
    if where == "on top":
        if state.inherited:  # a flag, not a sentinel: a reloaded copy of this module has a new sentinel
            delattr(state.owner, state.attribute)
        else:
            setattr(state.owner, state.attribute, state.original)
    elif where == "under another wrapper":
        state.on = False
    return where


def _resolve(namespace: str, target: Target, fix: str) -> tuple[Any, bool]:
    """``(wrapper, whether it is new)``: the shim's own wrapper already there (switched off by ``unpatch``,
    or left by a reloaded copy of this module), else a new one, not installed yet. Where the class holds
    an object and Lightning ships none, another library patched it: the shim wraps that object, so both
    run, and says so. Raises ``TargetChanged`` when there is nothing callable to wrap."""
    module_name = target.module if target.shared else f"{namespace}.{target.module}"
    holder = importlib.import_module(module_name)
    owner = getattr(holder, target.class_name, None) if target.class_name else holder
    if not isinstance(owner, (type, ModuleType)):
        raise TargetChanged(f"{module_name} has no class {target.class_name}")
    label, own = target.label(namespace), owner.__dict__.get(target.attribute, MISSING)
    for layer in wrapper_chain(own):
        if is_shim_wrapper(layer):
            return layer, False
    inherited = own is MISSING
    if not inherited:
        function = own
    elif target.inherited and isinstance(owner, type):
        found = [base.__dict__ for base in owner.__mro__[1:] if target.attribute in base.__dict__]
        function = found[0][target.attribute] if found else MISSING
    else:
        raise TargetChanged(f"{label} is not defined on the {'class' if isinstance(owner, type) else 'module'} itself")
    if function is MISSING:
        raise TargetChanged(f"{label} does not exist")
    # a wrapt proxy of a function passes: it reports the function's class
    if not inspect.isfunction(function.__func__ if isinstance(function, staticmethod) else function):
        raise TargetChanged(f"{label} is a {type(function).__name__}, expected a function")
    if inherited:
        function = _inherited_at_call_time(owner, target.attribute, function)  # type: ignore[arg-type]
    original = None if inherited else own
    state = WrapperState(
        fix, label, owner, target.attribute, target.body, original, inherited, target.shared, target.path
    )
    state.composed_with = describe(own) if target.inherited and not inherited else None
    return ShimWrapper(function, state.run, enabled=state), True


def _inherited_at_call_time(owner: type, attribute: str, found: Any) -> Callable[..., Any]:
    """What ``owner`` inherits, looked up at every call: another library that patches the base class
    after the shim (a tracer) still runs under the shim's wrapper, as it would without the shim."""

    def inherited(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(super(owner, self), attribute)(*args, **kwargs)

    functools.update_wrapper(inherited, found)  # its name and signature, for introspection
    return inherited


# ----------------------------------------------------------------------------- one namespace, one fix
@dataclass
class _Check:
    """One fix's check of one set of wrapped functions on the running torch, shared by every namespace's
    record that holds them: it runs once per torch, not once per namespace. A path whose check could not run
    (``Finding.holds`` false) is checked again: at the next ``recheck``, at most every ``backoff`` seconds
    from a checkpoint call (doubling up to ``MAX_BACKOFF``), at once from ``activate()`` and ``status()``."""

    fix: str
    proof: Proof
    findings: dict[str, Finding] = field(default_factory=dict)
    ran: bool = False
    retry_at: float = 0.0
    backoff: float = 1.0

    def settled(self) -> frozenset[str]:
        return frozenset(path for path, found in self.findings.items() if found.shown or found.holds)

    def unsettled(self) -> bool:
        return not self.ran or any(not found.shown and not found.holds for found in self.findings.values())


MAX_BACKOFF = 300.0


@dataclass
class _Record:
    module: Any
    """The namespace's module object when it was checked: another one in ``sys.modules`` now means it
    was imported again (new classes), and this record describes a copy that is gone."""
    version: str | None = None
    affected: bool | None = None
    reason: str = "patched"
    wrappers: list[Any] = field(default_factory=list)
    deactivated: bool = False
    disabled: bool = False
    """Whether ``FSDP_SHIM_DISABLED_FIXES`` named the fix when this was decided: a change is decided anew."""
    check: _Check | None = None


_records: dict[tuple[str, str], _Record] = {}
_checks: dict[tuple[tuple[Any, str, Any], ...], _Check] = {}
"""Per set of wrapped functions (the objects, not their ids, which are reused)."""
_unsettled: set[int] = set()
"""The ids of the checks with a path still to check: empty, a checkpoint call pays one lookup."""
_proof_lock = threading.Lock()  # one check at a time; never taken by the check's own calls
_retired: list[Any] = []
"""Wrappers on the classes of an earlier copy of a namespace (imported again since): ``unpatch``
still restores those classes, which old objects may still use."""
_lock = threading.Lock()
_Steps = list[tuple[Any, bool]]  # (wrapper, whether it is new) per target, from _resolve


def patch(namespace: str, fix: Fix, plan: Plan, *, disabled: bool = False, proof: Proof | None = None) -> FixStatus:
    """Apply ``fix`` to an imported namespace whose release lacks it; leave any other alone. Idempotent:
    a namespace is checked once per copy of its classes, and again after ``unpatch``. A fix switched
    off (``disabled``) after it was patched is taken off, as ``unpatch`` does. Where ``proof`` is given
    (a fix on private names of torch), each path's wrappers stay on only where it does not show that
    torch's call path passes them by, and the fix says "in effect" only for the paths it has shown."""
    module = sys.modules.get(namespace)
    if module is None:
        return status(namespace, fix)
    key = (namespace, fix.name)
    held = _records.get(key)
    if disabled and held is not None and not held.deactivated and held.wrappers:
        unpatch(namespace, fix)
    with _lock:
        if _current(_records.get(key), namespace, module, disabled):
            return status(namespace, fix)
    decided = _decide(namespace, fix, plan, module, disabled)
    with _lock:
        record = _records.get(key)
        if _current(record, namespace, module, disabled):
            return status(namespace, fix)  # another thread got here first
        if record is not None:
            _retired.extend(w for w in record.wrappers if placement(w) != "gone" and not w.shim_state.shared)
        if not isinstance(decided, _Record):
            decided = _install_all(module, *decided)
        decided.disabled = disabled
        _records[key] = decided
    if proof is not None and decided.reason == "patched":
        found = tuple((w.shim_state.owner, w.shim_state.attribute, w.__wrapped__) for w in decided.wrappers)
        with _lock:
            decided.check = _checks.setdefault(found, _Check(fix.name, proof))
        _run_check(decided.check, force=False)
    if decided.reason.startswith("not patched: "):
        version = decided.version or "(unknown version)"
        which = f" ({fix.name} fix)" if decided.affected else ""
        failures.report(
            f"fsdp-shim: cannot patch {namespace} {version}{which}: {decided.reason.removeprefix('not patched: ')}",
            f"Lightning was left unchanged, so {fix.unfixed if decided.affected else 'no fix applies'}",
            key=f"patch:{namespace}" + (f":{fix.name}" if decided.affected else ""),
        )
    return status(namespace, fix)


def has_unsettled_checks() -> bool:
    return bool(_unsettled)


def recheck(force: bool = True) -> None:
    """Check again every path that could not be checked before (``_Check``); ``force`` ignores the backoff.
    Called with ``force=False`` from inside the job's checkpoint calls: it never waits for another check."""
    if not _unsettled:
        return
    with _lock:
        live = {id(r.check): r.check for r in _records.values() if r.check is not None and not r.deactivated}
    for check in live.values():
        if check.unsettled():
            _run_check(check, force)


def _run_check(check: _Check, force: bool) -> None:
    """Run ``check`` for its unsettled paths (unless its backoff says not yet, or another check is running and
    this call must not wait), then take off what torch's call path passes by."""
    if _proof_lock.acquire(blocking=force or not check.ran):
        try:
            if check.unsettled() and (force or not check.ran or time.monotonic() >= check.retry_at):
                _run(check)
        finally:
            _proof_lock.release()
    _take_off_failed(check)


def _run(check: _Check) -> None:
    before = check.settled()
    try:
        check.findings.update(check.proof(before))
    except Exception as error:  # the check itself broke: nothing was shown (may pass later)
        paths = {w.shim_state.path for r in _records.values() if r.check is check for w in r.wrappers}
        why = f"its check failed ({type(error).__name__}: {error})"
        check.findings.update({path: Finding(False, why) for path in paths - before})
    check.ran = True
    if check.unsettled():
        check.retry_at, check.backoff = time.monotonic() + check.backoff, min(2 * check.backoff, MAX_BACKOFF)
        _unsettled.add(id(check))
    else:
        _unsettled.discard(id(check))


def _take_off_failed(check: _Check) -> None:
    """Take off the wrappers of every path torch's call path passes by, in every namespace that holds them
    (one patched later too), and say so once (an error in strict mode)."""
    failed = [path for path, found in check.findings.items() if found.holds]
    if not failed:
        return
    with _lock:
        for record in [r for r in _records.values() if r.check is check]:
            for wrapper in [w for w in reversed(record.wrappers) if w.shim_state.path in failed]:
                remove(wrapper)
                record.wrappers.remove(wrapper)
    failures.report(
        f"fsdp-shim: the {check.fix} fix is not in effect on torch {_torch_version()} for {the_checkpoints(failed)} "
        f"({_whys(failed, check.findings)})",
        "torch was left as it was there, so this fix is off for that checkpoint in this process",
        key=f"proof:{check.fix}:{','.join(failed)}",
    )


def acting(namespace: str, fix: Fix) -> bool:
    """Whether the fix's wrappers act in the namespace now (shown, or a path still to check): what the
    rank check compares, which must not depend on the context a check happened to run in."""
    record = _records.get((namespace, fix.name))
    if record is None or record.deactivated or record.reason != "patched":
        return False
    return any(w.shim_state.on and placement(w) != "gone" for w in record.wrappers)


def passed_by(namespace: str, fix: Fix) -> list[str]:
    """The paths of the fix's check that torch's call path passes by, in the namespace's record: the fix is
    off there however the other paths stand."""
    record = _records.get((namespace, fix.name))
    check = record.check if record is not None else None
    return [path for path, found in check.findings.items() if found.holds] if check is not None else []


def _torch_version() -> str:
    return str(getattr(sys.modules.get("torch"), "__version__", "?"))


def joined(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def the_checkpoints(paths: list[str]) -> str:
    """``the reentrant checkpoint``, ``the reentrant and composable checkpoints``."""
    return f"the {joined(paths)} checkpoint{'s' if len(paths) > 1 else ''}"


def _whys(paths: list[str], findings: dict[str, Finding]) -> str:
    """What the check found for ``paths``: one reason, or each path's."""
    if len({findings[path].why for path in paths}) == 1:
        return findings[paths[0]].why
    return "; ".join(f"the {path} checkpoint: {findings[path].why}" for path in paths)


def _held_elsewhere(key: tuple[str, str]) -> set[int]:
    """The ids of the wrappers another live record holds (torch's, shared): taking ``key``'s off leaves them
    (call with the lock held)."""
    return {id(w) for other, held in _records.items() if other != key and not held.deactivated for w in held.wrappers}


def _current(record: _Record | None, namespace: str, module: Any, disabled: bool) -> bool:
    """Whether ``record`` is in force for the namespace as imported now, with the fix switched off or not as now."""
    if record is None or record.deactivated or record.disabled != disabled:
        return False
    return _imported_again(record, namespace, module) is None


def _imported_again(record: _Record, namespace: str, module: Any) -> str | None:
    """What was imported again since ``record`` was made (its classes are gone), if anything."""
    if record.module is not module:
        return f"{namespace} was imported again after fsdp-shim checked it"
    for wrapper in record.wrappers:
        owner, label = wrapper.shim_state.owner, wrapper.shim_state.label
        if isinstance(owner, ModuleType):
            current = sys.modules.get(owner.__name__)
        else:
            current = getattr(sys.modules.get(owner.__module__), owner.__name__, None)
        if current is not owner:
            return f"{owner.__module__} was imported again after fsdp-shim patched it ({label} is a new class)"
    return None


def _decide(namespace: str, fix: Fix, plan: Plan, module: Any, disabled: bool) -> _Record | tuple[str, _Steps]:
    """Gate the namespace and resolve every target; nothing is changed yet."""
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        return _Record(module, None, None, f"not patched: {namespace}.__version__ is missing")
    if base_release(version) is None:
        return _Record(module, version, None, f"not patched: its version {version!r} is not PEP 440")
    if not fix.affects(version):
        return _Record(module, version, False, fix.unaffected_reason(version))
    if disabled:
        return _Record(module, version, True, f"switched off by {DISABLED_FIXES_VARIABLE}")
    try:
        steps = [_resolve(namespace, target, fix.name) for target in plan(namespace, version)]
    except NotNeeded as error:
        return _Record(module, version, False, str(error))
    except (ImportError, TargetChanged) as error:
        return _Record(module, version, True, f"not patched: {error}")
    return version, steps


def _install_all(module: Any, version: str, steps: _Steps) -> _Record:
    """Install every new wrapper and switch on every one already there, or none (call with the lock held)."""
    installed: list[Any] = []
    try:
        for wrapper, new in steps:
            if new:
                setattr(wrapper.shim_state.owner, wrapper.shim_state.attribute, wrapper)
                installed.append(wrapper)
            else:
                wrapper.shim_state.on = True
    except Exception as error:  # setattr on a class can fail (slots, metaclasses): undo what was done
        for wrapper in reversed(installed):
            remove(wrapper)
        why = f"not patched: installing a wrapper failed ({type(error).__name__}: {error})"
        return _Record(module, version, True, why)
    return _Record(module, version, True, "patched", [wrapper for wrapper, _ in steps])


def unpatch(namespace: str, fix: Fix) -> list[tuple[Any, Placement]]:
    """Put back the exact objects that were on the classes before the shim patched them; returns each
    wrapper with where it was found (``under another wrapper``: switched off in place)."""
    with _lock:
        for wrapper in [w for w in _retired if w.shim_state.fix == fix.name]:
            if placement(wrapper) == "on top":
                remove(wrapper)
            _retired.remove(wrapper)
        key = (namespace, fix.name)
        record = _records.get(key)
        if record is None:
            return []
        still_used = _held_elsewhere(key)  # shared: they stay
        results = [(wrapper, remove(wrapper)) for wrapper in reversed(record.wrappers) if id(wrapper) not in still_used]
        record.wrappers = [wrapper for wrapper, where in results if where == "under another wrapper"]
        record.deactivated = True
    return results


def status(namespace: str, fix: Fix) -> FixStatus:
    """The fix's state in the namespace, read from the classes: another library replacing or wrapping
    the shim's wrapper, a call that fell back, or a module imported again changes what this says."""
    module = sys.modules.get(namespace)
    if module is None:
        return FixStatus(fix.name, reason=NOT_IMPORTED)
    record = _records.get((namespace, fix.name))
    if record is None:
        return FixStatus(fix.name, reason="imported; not checked yet")
    why = _imported_again(record, namespace, module)
    if why is not None:
        reason = f"not patched: {why}, and its new classes were not checked yet (fsdp_shim.activate() checks them)"
        return FixStatus(fix.name, record.affected, False, reason)
    if record.reason != "patched":
        return FixStatus(fix.name, record.affected, False, record.reason)
    targets = tuple(wrapper.shim_state.label for wrapper in record.wrappers)
    problems, notes = [], []
    for wrapper in record.wrappers:
        state, where, top = wrapper.shim_state, placement(wrapper), found_on_top(wrapper)
        if where == "gone":
            problems.append(f"other code replaced its wrapper on {state.label} (the class holds {top})")
        elif not state.on:
            problems.append(f"its wrapper on {state.label} stays under {top} and passes calls through")
        elif state.fallback is not None:
            problems.append(f"{state.label} fell back to {state.owners_own()} at call time ({state.fallback})")
        else:
            if where == "under another wrapper":
                notes.append(f"its wrapper on {state.label} is under {top}")
            if state.composed_with is not None:
                notes.append(f"on {state.label} it wraps {state.composed_with}, which was there before")
    unshown, shown_by_others = _check_reasons(record.check)
    notes += shown_by_others
    if record.deactivated:
        return FixStatus(fix.name, True, False, "; ".join(["deactivated", *problems]), targets)
    if problems or unshown:
        return FixStatus(
            fix.name,
            True,
            False,
            "; ".join([*unshown, *(["not patched: " + "; ".join(problems)] if problems else [])]),
            targets,
        )
    return FixStatus(fix.name, True, True, "patched" + (f" ({'; '.join(notes)})" if notes else ""), targets)


def _check_reasons(check: _Check | None) -> tuple[list[str], list[str]]:
    """What keeps the fix from being in effect everywhere (paths torch's call path passes by, then paths not
    checked yet, each with the paths shown), and the notes for paths shown without a wrapper (torch's own)."""
    if check is None:
        return [], []
    found, where = check.findings, f"on torch {_torch_version()}"
    if not check.ran:
        return [f"not shown yet {where}: its check has not run"], []
    failed = [path for path, f in found.items() if not f.shown and f.holds]  # in the order the check gave them
    unchecked = [path for path, f in found.items() if not f.shown and not f.holds]
    shown = [path for path, f in found.items() if f.shown]
    by_others = {f.why: [p for p in shown if found[p].why == f.why] for f in found.values() if f.shown and f.why}
    notes = [f"{the_checkpoints(paths)}: {why}" for why, paths in by_others.items()]
    reasons = []
    if failed:
        reasons.append(f"not in effect {where} for {the_checkpoints(failed)} ({_whys(failed, found)})")
    if unchecked:
        again = "checked again at a later checkpoint call, fsdp_shim.activate() or status()"
        reasons.append(f"not shown yet {where} for {the_checkpoints(unchecked)} ({_whys(unchecked, found)}; {again})")
    if reasons and shown:
        reasons.append(f"in effect for {the_checkpoints(shown)}")
    return reasons, ([] if reasons else notes)
