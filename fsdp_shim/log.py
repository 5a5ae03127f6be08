"""The ``fsdp_shim`` logger, imported lazily.

``logging`` costs milliseconds to import, and the start-up path must stay within noise of a bare
interpreter, so only the code that runs once Lightning is imported touches it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("fsdp_shim")

# The same variables, in the same order, that Lightning's ``rank_zero_only`` reads, so the shim's
# messages appear on exactly the process where Lightning prints its own rank-zero messages.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")

_logged_once: set[str] = set()
_logged_once_lock = threading.Lock()


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
        logger.info(message, *args)


def announce(message: str, *args: object) -> None:
    """An INFO record that is seen even where nobody configured logging (Python drops INFO records
    then): a cluster operator confirms a job from this one line, so it must not depend on setup."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(message, *args)
    else:
        sys.stderr.write((message % args) + "\n")
        sys.stderr.flush()


def warn_once_on_rank_zero(key: str, message: str, *args: object) -> None:
    """A WARNING record, once per process and ``key``, on rank zero only. With no logging
    configured, Python prints WARNING records to stderr, so it is seen by default."""
    with _logged_once_lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    if process_rank() == 0:
        logger.warning(message, *args)


def debug(message: str, *args: object) -> None:
    logger.debug(message, *args)
