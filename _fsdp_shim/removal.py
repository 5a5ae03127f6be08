"""Take the shim's wrappers off, putting back the very objects that were there; one that another library has
wrapped since is switched off in place instead. Reads ``wrappers``' records at each call: a reload renews them."""

from __future__ import annotations

from typing import Any

from _fsdp_shim import failures, wrappers
from _fsdp_shim.config import FIXES, NAMESPACES, RANK_CHECK, Fix, State
from _fsdp_shim.wrappers import GONE, ON_TOP, UNDER, placement, remove


def describe(obj: object) -> str:
    """A short name for an object found on a class; a proxy by its own type, not the function it wraps."""
    if type(obj) is not getattr(obj, "__class__", type(obj)):
        return f"a {type(obj).__module__}.{type(obj).__qualname__}"
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def found_on_top(wrapper: Any) -> str:
    return describe(wrapper.shim_state.owner.__dict__.get(wrapper.shim_state.target.attribute))


def unpatch(namespace: str, fix: Fix) -> list[tuple[Any, str]]:
    """Take one fix off one namespace; each wrapper with where it was found (a shared one stays while in use)."""
    with wrappers.lock:
        for wrapper in [w for w in wrappers.retired if w.shim_state.fix == fix.name]:
            if placement(wrapper) == ON_TOP:
                remove(wrapper)
            wrappers.retired.remove(wrapper)
        key = (namespace, fix.name)
        record = wrappers.records.get(key)
        if record is None:
            return []
        others = [r for k, r in wrappers.records.items() if k != key and r.state is not State.DEACTIVATED]
        held = {id(w) for r in others for w in r.wrappers}
        results = [(wrapper, remove(wrapper)) for wrapper in reversed(record.wrappers) if id(wrapper) not in held]
        record.wrappers = [wrapper for wrapper, where in results if where == UNDER]
        record.state = State.DEACTIVATED if record.state is State.PATCHED else record.state
    return results


def unpatch_disabled(namespace: str, names: frozenset[str]) -> None:
    """Take off the fixes ``FSDP_SHIM_DISABLED_FIXES`` names now, where their wrappers still act."""
    for fix in FIXES:
        held = wrappers.records.get((namespace, fix.name))
        if fix.name in names and held is not None and held.state is not State.DEACTIVATED and held.wrappers:
            unpatch(namespace, fix)


def unpatch_all() -> None:
    """``deactivate()``: every fix off every namespace, saying where another library's wrapper was in the way."""
    for name in NAMESPACES:
        for fix in (*FIXES, RANK_CHECK):
            for wrapper, where in unpatch(name, fix):
                if where != ON_TOP:
                    failures.wrapper_left(wrapper.shim_state.label, found_on_top(wrapper), gone=where == GONE)


def take_off(fix: Fix, paths: list[str]) -> None:
    """Take off the fix's wrappers that serve ``paths``, in every namespace: torch's call path passes them by."""
    with wrappers.lock:
        for held in [r for (_, name), r in wrappers.records.items() if name == fix.name]:
            for wrapper in [w for w in reversed(held.wrappers) if w.shim_state.target.path in paths]:
                remove(wrapper)
                held.wrappers.remove(wrapper)
