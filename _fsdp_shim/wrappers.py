"""Wrap one fix in one namespace, read its state back and take it off again, beside other code that patches the same
functions: a wrapper is known by its type, and taking it off puts back the very object that was there."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from _fsdp_shim.config import FIXES, NAMESPACES, RANK_CHECK, Fix, State, base_release

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
MISSING: Any = object()
ON_TOP, UNDER, GONE = "on top", "under another wrapper", "gone"


class GlueError(Exception):
    """The shim's own glue failed in a wrapper before changing anything: Lightning's method runs as it was."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")


class TargetChanged(Exception):
    """A Lightning or torch function no longer has the shape the fix was written against."""


class NotNeeded(Exception):
    """Raised by a plan where torch has the fix itself: nothing is wrapped."""


@dataclass(frozen=True)
class Target:
    """A function a fix wraps: a Lightning method (module relative to the namespace), or torch's (``shared``)."""

    module: str
    class_name: str  # empty for a function of the module itself
    attribute: str
    body: Callable[[Callable[..., Any], Any, Args, Kwargs], Any]  # wrapt's (wrapped, instance, args, kwargs)
    inherited: bool = False  # the class inherits it: removing the wrapper restores inheritance
    shared: bool = False  # torch's: one wrapper for every namespace, removed with the last
    path: str = ""  # which checked path it serves (the recompute: a checkpoint kind)

    def label(self, namespace: str) -> str:
        path = self.module if self.shared else f"{namespace}.{self.module}"
        return ".".join(part for part in (path, self.class_name, self.attribute) if part)


Plan = Callable[[str, str], "tuple[Target, ...]"]  # (namespace, version) -> what a fix wraps there


# ----------------------------------------------------------------------------- one wrapper
@dataclass
class WrapperState:
    """What one wrapper runs and what taking it off needs; wrapt's switch (``enabled=``) reads ``on``."""

    fix: str
    label: str
    owner: type | ModuleType
    target: Target
    original: Any  # what the class or module dict held before, else None
    inherited: bool
    on: bool = True
    fallback: str | None = None  # why a call fell back to the wrapped function

    def __call__(self) -> bool:
        return self.on

    def run(self, wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
        try:
            return self.target.body(wrapped, instance, args, kwargs)
        except GlueError as error:
            from _fsdp_shim import failures  # loaded where something is said

            self.fallback = str(error)
            failures.glue_failed(self, error)
            return wrapped(*args, **kwargs)


class ShimWrapper(wrapt.FunctionWrapper):  # type: ignore[name-defined]
    """The only kind of wrapper fsdp-shim puts on a class or module."""

    @property
    def shim_state(self) -> WrapperState:
        return self._self_enabled


def is_shim_wrapper(obj: object) -> bool:
    """Whether ``obj`` itself is a ``ShimWrapper`` of this module or of an earlier copy of it."""
    return any(k.__name__ == "ShimWrapper" and k.__module__ == __name__ for k in type(obj).__mro__)


def wrapper_chain(obj: object) -> Iterator[object]:
    """``obj`` and what it wraps, layer by layer through ``__wrapped__``."""
    for _ in range(32):  # a cycle ends here too
        yield obj
        try:
            obj = obj.__wrapped__  # type: ignore[attr-defined]
        except Exception:
            return


def placement(wrapper: Any) -> str:
    state = wrapper.shim_state
    current = state.owner.__dict__.get(state.target.attribute, MISSING)
    if current is wrapper:
        return ON_TOP
    return UNDER if any(layer is wrapper for layer in wrapper_chain(current)) else GONE


def remove(wrapper: Any) -> str:
    """Restore the owner if the wrapper is on top; switch it off in place under another's wrapper."""
    state, where = wrapper.shim_state, placement(wrapper)
    if where == ON_TOP:
        if state.inherited:
            delattr(state.owner, state.target.attribute)
        else:
            setattr(state.owner, state.target.attribute, state.original)
    elif where == UNDER:
        state.on = False
    return where


def _resolve(namespace: str, target: Target, fix: str) -> tuple[Any, bool]:
    """``(wrapper, new)``: the shim's wrapper already there, else a new one (not installed yet)."""
    module_name = target.module if target.shared else f"{namespace}.{target.module}"
    holder = importlib.import_module(module_name)
    owner = getattr(holder, target.class_name, None) if target.class_name else holder
    if not isinstance(owner, (type, ModuleType)):
        raise TargetChanged(f"{module_name} has no class {target.class_name}")
    label, own = target.label(namespace), owner.__dict__.get(target.attribute, MISSING)
    for layer in wrapper_chain(own):
        if is_shim_wrapper(layer):
            return layer, False
    inherited, attribute = own is MISSING, target.attribute
    if inherited and not (target.inherited and isinstance(owner, type)):
        raise TargetChanged(f"{label} is not defined on the {'class' if isinstance(owner, type) else 'module'} itself")
    scopes = owner.__mro__[1:] if inherited else (owner,)
    function = next((scope.__dict__[attribute] for scope in scopes if attribute in scope.__dict__), MISSING)
    if function is MISSING:
        raise TargetChanged(f"{label} does not exist")
    if not inspect.isfunction(function.__func__ if isinstance(function, staticmethod) else function):
        raise TargetChanged(f"{label} is a {type(function).__name__}, expected a function")
    if inherited:  # looked up at each call: a library patching the base class later still runs

        def at_call_time(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(super(owner, self), attribute)(*args, **kwargs)

        function = functools.update_wrapper(at_call_time, function)
    state = WrapperState(fix, label, owner, target, original=None if inherited else own, inherited=inherited)
    return ShimWrapper(function, state.run, enabled=state), True


# ----------------------------------------------------------------------------- one namespace, one fix
@dataclass
class _Record:
    module: Any  # the namespace module checked: another one in sys.modules means it was imported again
    version: str | None
    state: State
    detail: str = ""
    affected: bool | None = None
    wrappers: list[Any] = field(default_factory=list)
    disabled: bool = False


records: dict[tuple[str, str], _Record] = {}
retired: list[Any] = []  # wrappers on the classes of a namespace imported again since: unpatch still restores them
lock = threading.Lock()  # guards the records and setattr, never an import


def patch(namespace: str, fix: Fix, plan: Plan, *, disabled: bool = False) -> State:
    """Apply ``fix`` where the namespace's release lacks it, all targets or none; idempotent."""
    module = sys.modules.get(namespace)
    if module is None:
        return state(namespace, fix)
    decided = _decide(namespace, fix, plan, module, disabled)  # outside the lock: it imports
    key = (namespace, fix.name)
    with lock:
        record = records.get(key)
        if _current(record, namespace, module, disabled):
            return state(namespace, fix)
        if record is not None:
            retired.extend(w for w in record.wrappers if placement(w) != GONE and not w.shim_state.target.shared)
        if not isinstance(decided, _Record):
            decided = _install_all(module, *decided)
        decided.disabled = disabled
        records[key] = decided
    if decided.state is State.FAILED:
        from _fsdp_shim import failures

        failures.cannot_patch(namespace, fix, decided)
    return state(namespace, fix)


def acting(namespace: str, fix: Fix) -> bool:
    """Whether the fix's wrappers act in the namespace now (shown, or still to check): what the rank check compares."""
    record = records.get((namespace, fix.name))
    wrappers = record.wrappers if record is not None and record.state is State.PATCHED else []
    return any(w.shim_state.on and placement(w) != GONE for w in wrappers)


def _current(record: _Record | None, namespace: str, module: Any, disabled: bool) -> bool:
    """Whether ``record`` is in force for the namespace as imported now, with the fix switched off or not as now."""
    if record is None or record.state is State.DEACTIVATED or record.disabled != disabled:
        return False
    return imported_again(record, namespace, module) is None


def imported_again(record: _Record, namespace: str, module: Any) -> str | None:
    if record.module is not module:
        return f"{namespace} was imported again after fsdp-shim checked it"
    for wrapper in record.wrappers:
        owner = wrapper.shim_state.owner
        name = owner.__name__ if isinstance(owner, ModuleType) else owner.__module__
        current = sys.modules.get(name)
        if not isinstance(owner, ModuleType):
            current = getattr(current, owner.__name__, None)
        if current is not owner:
            return f"{name} was imported again after fsdp-shim patched it ({wrapper.shim_state.label} is a new class)"
    return None


def _decide(namespace: str, fix: Fix, plan: Plan, module: Any, disabled: bool) -> _Record | tuple[str, list[Any]]:
    """Gate the namespace and resolve every target; nothing is changed yet."""
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        return _Record(module, None, State.FAILED, f"{namespace}.__version__ is missing")
    if base_release(version) is None:
        return _Record(module, version, State.FAILED, f"its version {version!r} is not PEP 440")
    if fix.built_in(version):
        return _Record(module, version, State.BUILT_IN, fix.upstream, affected=False)
    if not fix.affects(version):
        return _Record(module, version, State.NOT_AFFECTED, affected=False)
    if disabled:
        return _Record(module, version, State.DISABLED, affected=True)
    try:
        steps = [_resolve(namespace, target, fix.name) for target in plan(namespace, version)]
    except NotNeeded as error:
        return _Record(module, version, State.TORCH_HAS_IT, str(error), affected=False)
    except (ImportError, TargetChanged) as error:
        return _Record(module, version, State.FAILED, str(error), affected=True)
    return version, steps


def _install_all(module: Any, version: str, steps: list[tuple[Any, bool]]) -> _Record:
    """Install every new wrapper and switch on every one already there, or none (with the lock held)."""
    try:
        for wrapper, new in steps:
            if new:
                setattr(wrapper.shim_state.owner, wrapper.shim_state.target.attribute, wrapper)
            else:
                wrapper.shim_state.on = True
    except Exception as error:  # slots, metaclasses: undo what was done (a wrapper not installed is not on top)
        for wrapper in reversed([wrapper for wrapper, new in steps if new]):
            remove(wrapper)
        why = f"installing a wrapper failed ({type(error).__name__}: {error})"
        return _Record(module, version, State.FAILED, why, affected=True)
    return _Record(module, version, State.PATCHED, affected=True, wrappers=[wrapper for wrapper, _ in steps])


def state(namespace: str, fix: Fix) -> State:
    """The fix's decided state in the namespace (``_fsdp_shim.status`` reads what stands on the classes now)."""
    found = records.get((namespace, fix.name))
    if namespace not in sys.modules:
        return State.NOT_IMPORTED
    return State.NOT_CHECKED if found is None else found.state


# ----------------------------------------------------------------------------- taking them off
def describe(obj: object) -> str:
    """A short name for an object found on a class; a proxy by its own type, not the function it wraps."""
    if type(obj) is not getattr(obj, "__class__", type(obj)):
        return f"a {type(obj).__module__}.{type(obj).__qualname__}"
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def found_on_top(wrapper: Any) -> str:
    return describe(wrapper.shim_state.owner.__dict__.get(wrapper.shim_state.target.attribute))


def unpatch(namespace: str, fix: Fix) -> list[tuple[Any, str]]:
    """Take one fix off one namespace; each wrapper with where it was found (a shared one stays while in use)."""
    with lock:
        for wrapper in [w for w in retired if w.shim_state.fix == fix.name]:
            if placement(wrapper) == ON_TOP:
                remove(wrapper)
            retired.remove(wrapper)
        key = (namespace, fix.name)
        record = records.get(key)
        if record is None:
            return []
        others = [r for k, r in records.items() if k != key and r.state is not State.DEACTIVATED]
        held = {id(w) for r in others for w in r.wrappers}
        results = [(wrapper, remove(wrapper)) for wrapper in reversed(record.wrappers) if id(wrapper) not in held]
        record.wrappers = [wrapper for wrapper, where in results if where == UNDER]
        record.state = State.DEACTIVATED if record.state is State.PATCHED else record.state
    return results


def unpatch_disabled(namespace: str, names: frozenset[str]) -> None:
    """Take off the fixes ``FSDP_SHIM_DISABLED_FIXES`` names now, where their wrappers still act."""
    for fix in FIXES:
        held = records.get((namespace, fix.name))
        if fix.name in names and held is not None and held.state is not State.DEACTIVATED and held.wrappers:
            unpatch(namespace, fix)


def unpatch_all() -> None:
    """``deactivate()``: every fix off every namespace, saying where another library's wrapper was in the way."""
    for name in NAMESPACES:
        for fix in (*FIXES, RANK_CHECK):
            for wrapper, where in unpatch(name, fix):
                if where != ON_TOP:
                    from _fsdp_shim import failures  # loaded where something is said

                    failures.wrapper_left(wrapper.shim_state.label, found_on_top(wrapper), gone=where == GONE)


def take_off(fix: Fix, paths: list[str]) -> None:
    """Take off the fix's wrappers that serve ``paths``, in every namespace: torch's call path passes them by."""
    with lock:
        for held in [r for (_, name), r in records.items() if name == fix.name]:
            for wrapper in [w for w in reversed(held.wrappers) if w.shim_state.target.path in paths]:
                remove(wrapper)
                held.wrappers.remove(wrapper)
