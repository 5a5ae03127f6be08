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

    def label(self, namespace: str) -> str:
        path = self.module if self.shared else f"{namespace}.{self.module}"
        return ".".join(part for part in (path, self.class_name, self.attribute) if part)


Plan = Callable[[str, str], tuple[Target, ...]]
"""``(namespace, version) -> targets``: what a fix wraps in one namespace of one release."""
Proof = Callable[[], "str | None"]
"""Shows that a fix works once its wrappers are on: ``None``, or what was found instead."""


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
    state = WrapperState(fix, label, owner, target.attribute, target.body, original, inherited, target.shared)
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


_records: dict[tuple[str, str], _Record] = {}
_proofs: dict[tuple[tuple[Any, str, Any], ...], str | None] = {}
"""What each proof found, per set of wrapped functions (the objects, not their ids, which are reused):
it runs once per torch, not once per namespace."""
_proof_lock = threading.Lock()
_retired: list[Any] = []
"""Wrappers on the classes of an earlier copy of a namespace (imported again since): ``unpatch``
still restores those classes, which old objects may still use."""
_lock = threading.Lock()
_Steps = list[tuple[Any, bool]]  # (wrapper, whether it is new) per target, from _resolve


def patch(namespace: str, fix: Fix, plan: Plan, *, disabled: bool = False, proof: Proof | None = None) -> FixStatus:
    """Apply ``fix`` to an imported namespace whose release lacks it; leave any other alone. Idempotent:
    a namespace is checked once per copy of its classes, and again after ``unpatch``. A fix switched
    off (``disabled``) after it was patched is taken off, as ``unpatch`` does. Where ``proof`` is given
    (a fix on private names of torch), the fix stays on only if it shows on this torch that it works."""
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
        _keep_if_proven(key, decided, proof)
    if decided.reason.startswith("not patched: "):
        version = decided.version or "(unknown version)"
        which = f" ({fix.name} fix)" if decided.affected else ""
        failures.report(
            f"fsdp-shim: cannot patch {namespace} {version}{which}: {decided.reason.removeprefix('not patched: ')}",
            f"Lightning was left unchanged, so {fix.unfixed if decided.affected else 'no fix applies'}",
            key=f"patch:{namespace}" + (f":{fix.name}" if decided.affected else ""),
        )
    return status(namespace, fix)


def _keep_if_proven(key: tuple[str, str], record: _Record, proof: Proof) -> None:
    """Run ``proof`` once per set of wrapped functions; where it fails, take the wrappers off again (those
    no other namespace's record holds), record why, and say it once for every namespace."""
    found = tuple((w.shim_state.owner, w.shim_state.attribute, w.__wrapped__) for w in record.wrappers)
    with _proof_lock:  # one check at a time: it switches the process's default dtype for its forwards
        why = _proofs.get(found)
        if found not in _proofs:
            try:
                why = _proofs[found] = proof()
            except Exception as error:  # the check itself broke: nothing was shown (not kept: may pass later)
                why = f"not in effect: its check failed ({type(error).__name__}: {error})"
    if why is None:
        return
    with _lock:
        still_used = _held_elsewhere(key)
        for wrapper in reversed(record.wrappers):
            if id(wrapper) not in still_used:
                remove(wrapper)
        record.wrappers, record.reason = [], why
    fix = key[1]
    failures.report(
        f"fsdp-shim: the {fix} fix is {why}",
        "torch was left as it was, so this fix is off in this process",
        key=f"proof:{fix}",
    )


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
    if record.deactivated:
        return FixStatus(fix.name, True, False, "; ".join(["deactivated", *problems]), targets)
    if problems:
        return FixStatus(fix.name, True, False, "not patched: " + "; ".join(problems), targets)
    return FixStatus(fix.name, True, True, "patched" + (f" ({'; '.join(notes)})" if notes else ""), targets)
