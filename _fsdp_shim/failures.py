"""The one failure policy: strict mode, warnings once at the user's line, and the rank-zero log.

Every problem the shim survives goes through ``report``: with ``FSDP_SHIM_STRICT`` on it raises
``FSDPShimError`` (the message states the problem, nothing about falling
back, since nothing falls back); otherwise it warns once per problem and says what happened instead.
Everything said "once" (a warning, a log record) is said once per process and key, from one registry.

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

from _fsdp_shim import COPY_NAME, FSDPShimWarning
from _fsdp_shim.config import LIGHTNING_PACKAGES, STRICT_VARIABLE, switch_state, valid_switch_values

if TYPE_CHECKING:
    import logging
    from collections.abc import Mapping
    from types import FrameType


class FSDPShimError(RuntimeError):
    """Raised in strict mode (``FSDP_SHIM_STRICT``) where the shim could not apply a fix, and by the
    rank check in every mode: the message says what is missing or changed. Outside strict mode the
    same problem is one ``FSDPShimWarning`` and Lightning stays exactly as shipped."""


FSDPShimError.__module__ = "fsdp_shim.errors"  # where users import it from, and what tracebacks print

_said: set[str] = set()
_said_lock = threading.Lock()


def first_time(key: str) -> bool:
    """Whether ``key`` is said for the first time in this process (and from now on, it is not)."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def read_switch(name: str, environ: Mapping[str, str] | None, meaning: str) -> str:
    """``switch_state`` of the variable ``name``, warning once per unrecognised value (``meaning``
    says what that value does: both switches fail closed, in opposite directions)."""
    raw = (os.environ if environ is None else environ).get(name)
    state = switch_state(raw)
    if state == "invalid":
        warn_once(
            f"fsdp-shim: {name}={raw!r} is not a valid value and {meaning}. "
            f"Valid values (case-insensitive): {valid_switch_values()}.",
            key=f"toggle:{name}={raw}",
        )
    return state


def strict_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM_STRICT`` turns the shim's problems into errors. An unrecognised value is on."""
    return read_switch(STRICT_VARIABLE, environ, "turned strict mode ON (failures raise)") in ("on", "invalid")


_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PUBLIC_PACKAGE_DIRECTORY = os.path.join(os.path.dirname(_PACKAGE_DIRECTORY[:-1]), "fsdp_shim") + os.sep
_IMPORTLIB_DIRECTORY = os.path.dirname(os.path.abspath(warnings.__file__)) + os.sep + "importlib" + os.sep


def report(problem: str, consequence: str, *, key: str | None = None, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn once per ``key`` (default: the problem itself).

    ``problem`` says what went wrong; ``consequence`` what the shim did instead (only true, and
    so only said, outside strict mode).
    """
    if strict_mode():
        raise FSDPShimError(f"{problem} ({STRICT_VARIABLE} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key or problem)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, at the user's line."""
    if first_time(key):
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
        # Only a module with a file: linecache asks the globals' loader for the source otherwise, and
        # the loader of `python -c`'s __main__ raises ImportError instead of answering None.
        module_globals=module_globals if module_globals.get("__file__") else None,
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
    prefixes = [_PACKAGE_DIRECTORY, _PUBLIC_PACKAGE_DIRECTORY, _IMPORTLIB_DIRECTORY]
    for name in (COPY_NAME, "wrapt", *LIGHTNING_PACKAGES):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            path = os.path.abspath(path)
            is_package = os.path.basename(path) == "__init__.py"
            prefixes.append(os.path.dirname(path) + os.sep if is_package else path)
    return tuple(prefixes)


# ----------------------------------------------------------------------------- the rank-zero log
# ``logging`` costs milliseconds to import and the shim is imported by start-up code, so it is
# imported when the first record is written: by then Lightning, which imports it too, is loaded.

# The same variables, in the same order, that Lightning's ``rank_zero_only`` reads, so the shim's
# messages appear on exactly the process where Lightning prints its own rank-zero messages.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _logger() -> logging.Logger:
    import logging

    return logging.getLogger("fsdp_shim")


def process_rank() -> int:
    for variable in _RANK_VARIABLES:
        value = os.environ.get(variable)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


def info_on_rank_zero(message: str, *args: object) -> None:
    if process_rank() == 0:
        _logger().info(message, *args)


def announce(message: str, *args: object) -> None:
    """An INFO record that is seen even where nobody configured logging (Python drops INFO records
    then): a cluster operator confirms a job from this one line, so it must not depend on setup."""
    import logging

    logger = _logger()
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(message, *args)
    else:
        sys.stderr.write((message % args) + "\n")
        sys.stderr.flush()


def warn_once_on_rank_zero(key: str, message: str, *args: object) -> None:
    """A WARNING record, once per process and ``key``, on rank zero only. With no logging
    configured, Python prints WARNING records to stderr, so it is seen by default."""
    if first_time(f"log:{key}") and process_rank() == 0:
        _logger().warning(message, *args)


def debug(message: str, *args: object) -> None:
    _logger().debug(message, *args)
