"""The failure policy (strict mode raises; otherwise one warning at the user's line) and the rank-zero log lines."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from types import FrameType

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim.config import LIGHTNING_PACKAGES, STRICT_VARIABLE, log_setting, switch_state, valid_switch_values


class FSDPShimError(RuntimeError):
    """A problem of the shim in strict mode (``FSDP_SHIM_STRICT``), or ranks of one job that run different fixes."""


FSDPShimError.__module__ = "fsdp_shim.errors"  # where users import it from

_said: set[str] = set()
_said_lock = threading.Lock()


def first_time(key: str) -> bool:
    """Whether ``key`` is said for the first time in this process (and from now on, it is not)."""
    with _said_lock:
        new = key not in _said
        _said.add(key)
        return new


def read_switch(name: str, meaning: str) -> str:
    """``switch_state`` of the variable ``name``, warning once per unreadable value (``meaning``: what it does)."""
    raw = os.environ.get(name)
    state = switch_state(raw)
    if state == "invalid":
        warn_once(
            f"fsdp-shim: {name}={raw!r} is not a valid value and {meaning}. "
            f"Valid values (case-insensitive): {valid_switch_values()}.",
            key=f"toggle:{name}={raw}",
        )
    return state


def strict_mode() -> bool:
    return read_switch(STRICT_VARIABLE, "turned strict mode ON (failures raise)") in ("on", "invalid")


def report(problem: str, consequence: str, *, key: str, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn ``problem; consequence`` once per ``key``."""
    if strict_mode():
        raise FSDPShimError(f"{problem} ({STRICT_VARIABLE} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, pointing at the user's line."""
    if not first_time(key):
        return
    frame = user_frame()
    if frame is None:
        warnings.warn(message, FSDPShimWarning, stacklevel=1)
        return
    found = frame.f_globals
    registry = found.setdefault("__warningregistry__", {})
    source = found if found.get("__file__") else None  # `python -c`'s loader raises when asked for source
    warnings.warn_explicit(
        message, FSDPShimWarning, frame.f_code.co_filename, frame.f_lineno, found.get("__name__"), registry, source
    )


_OWN = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.abspath(warnings.__file__)), "importlib"),
)


def user_frame() -> FrameType | None:
    """The innermost frame outside fsdp-shim, the import machinery, wrapt and Lightning, where warnings point."""
    internal = ["<frozen importlib", *(os.path.join(path, "") for path in _OWN)]
    internal.append(os.path.join(os.path.dirname(_OWN[0]), "fsdp_shim", ""))
    for name in ("wrapt", *LIGHTNING_PACKAGES):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            internal.append(os.path.join(os.path.dirname(os.path.abspath(path)), ""))
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(tuple(internal)):
        frame = frame.f_back
    return frame


INFO, DEBUG = 20, 10  # logging's levels, without importing logging at start-up


def process_rank() -> int:
    """The process group's rank where one exists, else what Lightning's ``rank_zero_only`` reads, in its order."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    for variable in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[variable])
    return 0


def log(level: int, message: str, *args: object, shown_anyway: bool = False) -> None:
    """A record of the ``fsdp_shim`` logger where logging shows it, else (``shown_anyway``) the line on stderr."""
    import logging

    logger = logging.getLogger("fsdp_shim")
    if logger.isEnabledFor(level) and logger.hasHandlers():
        logger.log(level, message, *args)
    elif shown_anyway:
        sys.stderr.write((message % args) + "\n")
        sys.stderr.flush()


def debug(message: str, *args: object) -> None:
    """A DEBUG record; on stderr too with ``FSDP_SHIM_LOG=debug``."""
    log(DEBUG, message, *args, shown_anyway=log_setting()[0] == "debug")


def announce(message: str, *args: object) -> None:
    """A confirmation line at INFO, shown where logging is not configured too; ``FSDP_SHIM_LOG=0`` drops it."""
    if log_setting()[0] != "off":
        log(INFO, message, *args, shown_anyway=True)


_confirmed = False


def confirm(what: str) -> None:
    """The one confirmation line, on rank zero, the first time a fix changes something; it never raises."""
    global _confirmed
    if _confirmed:
        return
    _confirmed = True
    if process_rank() == 0:
        from _fsdp_shim._version import __version__

        with contextlib.suppress(Exception):  # inside the user's backward: a log line must not end the run
            announce("fsdp-shim %s: active; %s", __version__, what)


def warn_once_on_rank_zero(key: str, message: str, *args: object) -> None:
    """A WARNING record once per key, on rank zero only."""
    if first_time(f"log:{key}") and process_rank() == 0:
        import logging

        logging.getLogger("fsdp_shim").warning(message, *args)
