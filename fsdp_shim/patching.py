"""Installing and removing wrapt wrappers on classes, with exact restoration.

A wrapper is put into the class ``__dict__``; what was there before (the function, or nothing when
the method was inherited) is remembered so that removal restores the very same object, or the
inheritance, rather than something merely equal to it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from fsdp_shim.targets import Wrapper

MARKER = "_self_fsdp_shim_target"
"""Attribute on every wrapper the shim installs (wrapt keeps ``_self_*`` names on the proxy itself).
It names the target, so ``status()`` and a second activation can recognise the shim's own work on
the class even after the ``fsdp_shim`` module objects were re-created."""

_MISSING: Any = object()


class TargetChanged(Exception):
    """A Lightning class no longer has the shape the shim was written against."""


def is_shim_wrapper(obj: object) -> bool:
    """Whether ``obj`` is a wrapper installed by fsdp-shim."""
    return isinstance(obj, wrapt.FunctionWrapper) and getattr(obj, MARKER, None) is not None


def inherited_function(owner: type, attribute: str) -> Any:
    """The raw function ``owner`` would inherit for ``attribute`` (no descriptor binding)."""
    for base in owner.__mro__[1:]:
        if attribute in base.__dict__:
            return base.__dict__[attribute]
    return _MISSING


@dataclass
class InstalledWrapper:
    """One wrapper on one class, and what to put back when it is removed."""

    owner: type
    attribute: str
    original: Any
    wrapper: wrapt.FunctionWrapper

    def remove(self) -> bool:
        """Restore the class; returns ``False`` (and changes nothing) if someone has since replaced
        the wrapper, since removing theirs would be worse than leaving ours."""
        if self.owner.__dict__.get(self.attribute) is not self.wrapper:
            return False
        if self.original is _MISSING:
            delattr(self.owner, self.attribute)
        else:
            setattr(self.owner, self.attribute, self.original)
        return True


def function_to_wrap(owner: type, attribute: str, inherited: bool, label: str) -> Any:
    """Check that ``owner.attribute`` has the expected shape and return the function to wrap.

    Raises :class:`TargetChanged` with a reason a user can act on.
    """
    own = owner.__dict__.get(attribute, _MISSING)
    if inherited:
        if own is not _MISSING:
            raise TargetChanged(f"{label} is defined on the class itself, expected it to be inherited")
        function = inherited_function(owner, attribute)
    else:
        if own is _MISSING:
            raise TargetChanged(f"{label} is not defined on the class itself")
        function = own
    if function is _MISSING:
        raise TargetChanged(f"{label} does not exist")
    if not inspect.isfunction(function):
        raise TargetChanged(f"{label} is a {type(function).__name__}, expected a plain function")
    return function


def install(owner: type, attribute: str, function: Any, wrapper: Wrapper, label: str) -> InstalledWrapper:
    """Put a wrapt ``FunctionWrapper`` of ``function`` on ``owner.attribute``."""
    original = owner.__dict__.get(attribute, _MISSING)
    function_wrapper = wrapt.FunctionWrapper(function, wrapper)
    setattr(function_wrapper, MARKER, label)
    setattr(owner, attribute, function_wrapper)
    return InstalledWrapper(owner, attribute, original, function_wrapper)


def adopt(owner: type, attribute: str, inherited: bool, function_wrapper: wrapt.FunctionWrapper) -> InstalledWrapper:
    """Rebuild the removal record for a wrapper the shim installed earlier in this process."""
    original = _MISSING if inherited else function_wrapper.__wrapped__
    return InstalledWrapper(owner, attribute, original, function_wrapper)
