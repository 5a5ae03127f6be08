"""The one failure policy: ``report`` raises ``FSDPShimError`` in strict mode (saying nothing about
falling back, since nothing does), else warns once and says what happened instead; and the rank-zero
log. Everything said "once" is said once per process and key."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import TYPE_CHECKING

from _fsdp_shim import COPY_NAME, FSDPShimWarning
from _fsdp_shim.config import LIGHTNING_PACKAGES, STRICT_VARIABLE, log_setting, switch_state, valid_switch_values

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
        new = key not in _said
        _said.add(key)
        return new


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


def report(problem: str, consequence: str, *, key: str | None = None, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn ``problem; consequence`` (what the shim did instead) once per ``key``."""
    if strict_mode():
        raise FSDPShimError(f"{problem} ({STRICT_VARIABLE} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key or problem)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, at the user's line."""
    if not first_time(key):
        return
    frame = user_frame()
    if frame is None:
        warnings.warn(message, FSDPShimWarning, stacklevel=1)  # no frame outside the shim: this line
        return
    found = frame.f_globals
    module, registry = found.get("__name__", "<unknown>"), found.setdefault("__warningregistry__", {})
    # The globals only of a module with a file: linecache asks their loader for the source otherwise, and
    # the loader of `python -c`'s __main__ raises ImportError instead of answering None.
    source = found if found.get("__file__") else None
    warnings.warn_explicit(message, FSDPShimWarning, frame.f_code.co_filename, frame.f_lineno, module, registry, source)


_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTERNAL_DIRECTORIES = (
    _PACKAGE_DIRECTORY,
    os.path.join(os.path.dirname(_PACKAGE_DIRECTORY[:-1]), "fsdp_shim") + os.sep,
    os.path.join(os.path.dirname(os.path.abspath(warnings.__file__)), "importlib") + os.sep,
)


def user_frame() -> FrameType | None:
    """The innermost frame outside fsdp-shim, the import machinery, wrapt and Lightning (the user's
    ``import lightning``, ``trainer.fit(...)`` or ``fsdp_shim.activate()``), where warnings point: no
    fixed ``stacklevel`` can, because the same code runs under imports of different depths."""
    internal = ["<frozen importlib", *_INTERNAL_DIRECTORIES]
    for name in (COPY_NAME, "wrapt", *LIGHTNING_PACKAGES):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            path = os.path.abspath(path)
            internal.append(os.path.dirname(path) + os.sep if os.path.basename(path) == "__init__.py" else path)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(tuple(internal)):
        frame = frame.f_back
    return frame


# ----------------------------------------------------------------------------- the rank-zero log
INFO, DEBUG = 20, 10
"""``logging``'s levels, without importing ``logging`` at start-up."""


def _logger() -> logging.Logger:
    """Imports ``logging`` at the first record, not at start-up (it costs milliseconds): by then Lightning has."""
    import logging

    return logging.getLogger("fsdp_shim")


def _emit(level: int, shown_anyway: bool, message: str, *args: object) -> None:
    """A record of the ``fsdp_shim`` logger where the logging configuration shows it; else, if ``shown_anyway``,
    the line on stderr (Python drops INFO and DEBUG records where nobody configured logging). Nothing is
    added to the configuration: no handler, no level."""
    logger = _logger()
    if logger.isEnabledFor(level) and logger.hasHandlers():
        logger.log(level, message, *args)
    elif shown_anyway:
        sys.stderr.write((message % args) + "\n")
        sys.stderr.flush()


def process_rank() -> int:
    """This process's global rank: the process group's where one exists (Lightning sets the rank in code, and
    under mpirun, or its own launcher across nodes, no variable holds it); else from the variables Lightning's
    ``rank_zero_only`` reads, in its order, so the shim's messages appear where Lightning prints its own."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    for variable in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[variable])
    return 0


def debug_on_rank_zero(message: str, *args: object) -> None:
    """A DEBUG record on rank zero only. DEBUG, not INFO: a logging setup at INFO (Ray Train's workers,
    ``logging.basicConfig(level=logging.INFO)``) would otherwise show these next to the one confirmation line."""
    if process_rank() == 0:
        _emit(DEBUG, log_setting()[0] == "debug", message, *args)


def announce(message: str, *args: object) -> None:
    """A confirmation line: INFO, seen even where nobody configured logging, since a cluster operator confirms
    a job from it; ``FSDP_SHIM_LOG=0`` drops it."""
    if log_setting()[0] != "off":
        _emit(INFO, True, message, *args)


def announce_once_on_rank_zero(key: str, message: str, *args: object) -> None:
    """``announce``, once per process and key, on rank zero only. It runs inside the user's training (a
    backward), so it never raises: a log that cannot be written must not end the run."""
    if process_rank() != 0 or not first_time(f"announce:{key}"):
        return
    with contextlib.suppress(Exception):
        announce(message, *args)


_confirmed = False
"""Whether this process has said its confirmation line (read first: a pin asks on every recompute)."""


def confirm(what: str) -> None:
    """The confirmation line (docs/configuration.md, "Logging"): one line on rank zero, once per process, the
    first time a fix changes something; what the job's own log shows of the shim. A run where nothing
    applies (float32) says nothing."""
    global _confirmed
    if _confirmed:
        return
    from _fsdp_shim._version import __version__

    _confirmed = True
    announce_once_on_rank_zero("active", "fsdp-shim %s: active; %s", __version__, what)


def warn_once_on_rank_zero(key: str, message: str, *args: object) -> None:
    """A WARNING record (on stderr even with no logging configured), once per key, on rank zero only."""
    if first_time(f"log:{key}") and process_rank() == 0:
        _logger().warning(message, *args)


def debug(message: str, *args: object) -> None:
    _emit(DEBUG, log_setting()[0] == "debug", message, *args)
