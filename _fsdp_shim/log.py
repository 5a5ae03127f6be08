"""The lines the shim prints on rank zero: the confirmation lines."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from _fsdp_shim._version import __version__
from _fsdp_shim.config import log_setting

_said: set[str] = set()
_said_lock = threading.Lock()
named: list[str] = []  # the fixes said to have acted (read first: a pin asks at every recompute)
INFO = 20  # logging's level, without importing logging at start-up


def first_time(key: str) -> bool:
    """Whether ``key`` is said for the first time in this process (and from now on, it is not)."""
    with _said_lock:
        new = key not in _said
        _said.add(key)
        return new


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


def announce(message: str, *args: object) -> None:
    """A confirmation line: an INFO record where logging shows it, else on stderr; ``FSDP_SHIM_LOG=0`` drops it."""
    if log_setting()[0] == "off":
        return
    import logging

    logger = logging.getLogger("fsdp_shim")
    if logger.isEnabledFor(INFO) and logger.hasHandlers():
        logger.info(message, *args)
    else:
        print(message % args, file=sys.stderr, flush=True)


def confirm(fix: str, what: str) -> None:
    """On rank zero, the first time a fix changes something: the first in the confirmation line, each later one in a
    line of its own. It never raises."""
    if fix in named or not first_time(f"acted:{fix}"):
        return
    named.append(fix)
    if process_rank() == 0:
        line = "fsdp-shim %s: active; %s" if named == [fix] else "fsdp-shim %s: %s"
        with contextlib.suppress(Exception):  # inside the user's backward: a log line must not end the run
            announce(line, __version__, what)
