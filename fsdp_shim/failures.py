"""The one failure policy, and warnings that point at the user's code.

Every problem the shim survives goes through ``report``: with ``FSDP_SHIM_STRICT`` on it raises
``FSDPShimError`` (the message states the problem, nothing about falling
back, since nothing falls back); otherwise it warns once per problem and says what happened instead.

Warnings are attributed to the first frame outside fsdp-shim, the import machinery, wrapt and
Lightning: the user's ``import lightning`` line, their ``trainer.fit(...)`` call, their
``fsdp_shim.activate()``. A fixed ``stacklevel`` cannot do that, because the same code runs under
imports of different depths.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING

from _fsdp_shim_startup import LIGHTNING_PACKAGES, FSDPShimWarning
from fsdp_shim.environment_variables import FSDP_SHIM_STRICT
from fsdp_shim.errors import FSDPShimError

if TYPE_CHECKING:
    from types import FrameType

_reported: set[str] = set()
_reported_lock = threading.Lock()

_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_IMPORTLIB_DIRECTORY = os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "importlib" + os.sep


def report(problem: str, consequence: str, *, key: str | None = None, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn once per ``key`` (default: the problem itself).

    ``problem`` says what went wrong; ``consequence`` what the shim did instead (only true, and
    so only said, outside strict mode).
    """
    from fsdp_shim.toggles import strict_mode

    if strict_mode():
        raise FSDPShimError(f"{problem} ({FSDP_SHIM_STRICT} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key or problem)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, at the user's line."""
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    warn(message)


def warn(message: str) -> None:
    frame = user_frame()
    if frame is None:
        warnings.warn(message, FSDPShimWarning, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        FSDPShimWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


def user_frame() -> FrameType | None:
    """The innermost frame that belongs to neither fsdp-shim nor the code it runs inside of."""
    internal = _internal_prefixes()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen importlib") or filename.startswith(internal)):
            return frame
        frame = frame.f_back
    return None


def _internal_prefixes() -> tuple[str, ...]:
    prefixes = [_PACKAGE_DIRECTORY, _IMPORTLIB_DIRECTORY]
    for name in ("_fsdp_shim_startup", "wrapt", *LIGHTNING_PACKAGES):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            path = os.path.abspath(path)
            is_package = os.path.basename(path) == "__init__.py"
            prefixes.append(os.path.dirname(path) + os.sep if is_package else path)
    return tuple(prefixes)
