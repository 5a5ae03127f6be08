"""Installing, switching off and removing the shim's wrappers, next to other code that patches the
same methods (tracers, profilers, a team's own hot-fix).

Three rules, each because breaking it is silently wrong:

* The shim knows its own wrappers by ``type(obj)``. A wrapt proxy answers ``getattr`` for the object
  it wraps, so a marker *attribute* makes another library's wrapper on top of the shim's look like
  the shim's.
* It never removes an object that is not its own. A wrapper that has since been wrapped by other code
  is switched off in place (it passes every call through) instead of being torn out from under it.
* Removal restores the very object that was there before (Lightning's function, another library's
  wrapper, or nothing where the method was inherited), not something merely equal to it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import wrapt

from fsdp_shim import failures
from fsdp_shim.backport import GlueError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    Conversion = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

_MISSING: Any = object()
_CHAIN_LIMIT = 32  # layers of __wrapped__ followed before giving up (a cycle, or an odd proxy)

Placement = Literal["on top", "under another wrapper", "gone"]


class TargetChanged(Exception):
    """A Lightning class no longer has the shape the shim was written against."""


@dataclass
class WrapperState:
    """What one wrapper does when called: the conversion, unless switched off or after a fallback."""

    label: str
    conversion: Conversion
    enabled: bool = True
    fallback: str | None = None
    """Why a call fell back to Lightning's own method; ``status()`` then stops saying "patched"."""

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not self.enabled:
            return wrapped(*args, **kwargs)
        try:
            return self.conversion(wrapped, instance, args, kwargs)
        except GlueError as error:
            self.fallback = str(error)
            failures.report(
                f"fsdp-shim: {self.label} could not read what it needs ({error})",
                "Lightning's own method was used for this call, so this model was not converted",
                key=f"glue:{self.label}",
                cause=error,
            )
            return wrapped(*args, **kwargs)


class ShimWrapper(wrapt.FunctionWrapper):
    """The only kind of wrapper fsdp-shim puts on a Lightning class."""

    def __init__(self, wrapped: Any, state: WrapperState) -> None:
        super().__init__(wrapped, state)
        self._self_state = state

    @property
    def shim_state(self) -> WrapperState:
        state: WrapperState = self._self_state
        return state


def is_shim_wrapper(obj: object) -> bool:
    """Whether ``obj`` itself (not what it wraps) is a wrapper of fsdp-shim's, from this copy of the
    package or an earlier one (a reloaded module defines a new class with the same name)."""
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


def inherited_function(owner: type, attribute: str) -> Any:
    """The raw object ``owner`` would inherit for ``attribute`` (no descriptor binding)."""
    for base in owner.__mro__[1:]:
        if attribute in base.__dict__:
            return base.__dict__[attribute]
    return _MISSING


@dataclass
class Installed:
    """One shim wrapper on one class, and what to put back when it is removed."""

    owner: type
    attribute: str
    original: Any
    """What the class dict held before: Lightning's function, another library's wrapper, or _MISSING."""
    wrapper: ShimWrapper
    label: str
    composed_with: str | None = None
    """Set when ``original`` was another library's object on a class where Lightning ships none."""

    @property
    def state(self) -> WrapperState:
        return self.wrapper.shim_state

    def placement(self) -> Placement:
        current = self.owner.__dict__.get(self.attribute, _MISSING)
        if current is self.wrapper:
            return "on top"
        if any(layer is self.wrapper for layer in wrapper_chain(current)):
            return "under another wrapper"
        return "gone"

    def found_on_top(self) -> str:
        """What sits on the class now, for messages."""
        return describe(self.owner.__dict__.get(self.attribute, None))

    def remove(self) -> Placement:
        """Restore the class if the shim's wrapper is still what the class holds; if it has been
        wrapped since, switch it off in place; if it is gone, there is nothing to do."""
        placement = self.placement()
        if placement == "on top":
            if self.original is _MISSING:
                delattr(self.owner, self.attribute)
            else:
                setattr(self.owner, self.attribute, self.original)
        elif placement == "under another wrapper":
            self.state.enabled = False
        return placement


def function_to_wrap(owner: type, attribute: str, inherited: bool, label: str) -> tuple[Any, str | None]:
    """What the wrapper must wrap, and whether that is someone else's object.

    Lightning ships ``attribute`` either inherited (``inherited=True``) or defined on ``owner``. If the
    class holds an object where Lightning ships none, another library patched it: the shim wraps that
    object, so both its code and the conversion run, and says so. Raises ``TargetChanged`` with
    a reason a user can act on when there is nothing callable to wrap.
    """
    own = owner.__dict__.get(attribute, _MISSING)
    composed_with = None
    if own is not _MISSING:
        function = own
        if inherited:
            composed_with = describe(own)
    elif inherited:
        function = inherited_function(owner, attribute)
    else:
        raise TargetChanged(f"{label} is not defined on the class itself")
    if function is _MISSING:
        raise TargetChanged(f"{label} does not exist")
    if not inspect.isfunction(function):  # a wrapt proxy of a function passes: it reports the function's class
        raise TargetChanged(f"{label} is a {type(function).__name__}, expected a function")
    return function, composed_with


def install(
    owner: type, attribute: str, function: Any, conversion: Conversion, label: str, composed_with: str | None
) -> Installed:
    """Put a ``ShimWrapper`` of ``function`` on ``owner.attribute``."""
    original = owner.__dict__.get(attribute, _MISSING)
    wrapper = ShimWrapper(function, WrapperState(label, conversion))
    setattr(owner, attribute, wrapper)
    return Installed(owner, attribute, original, wrapper, label, composed_with)


def find_own_wrapper(owner: type, attribute: str) -> ShimWrapper | None:
    """A shim wrapper on ``owner.attribute``, on top or under other wrappers, that this process's
    bookkeeping does not know (it was installed by an earlier copy of these modules: a reload)."""
    for layer in wrapper_chain(owner.__dict__.get(attribute, _MISSING)):
        if is_shim_wrapper(layer):
            return layer  # type: ignore[return-value]
    return None


def adopt(owner: type, attribute: str, inherited: bool, wrapper: ShimWrapper, label: str) -> Installed:
    """Rebuild the removal record for a wrapper the shim installed earlier in this process."""
    wrapped = wrapper.__wrapped__
    original = _MISSING if inherited and wrapped is inherited_function(owner, attribute) else wrapped
    return Installed(owner, attribute, original, wrapper, label)
