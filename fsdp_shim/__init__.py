"""fsdp-shim: fixes for FSDP "true"-precision training in Lightning, without upgrading or forking it. Importing it
activates the shim (``FSDP_SHIM=0`` switches it off); ``python -m fsdp_shim``, the command, activates nothing."""

from __future__ import annotations

import sys

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim._version import __version__
from _fsdp_shim.activation import activate, deactivate, status
from _fsdp_shim.failures import FSDPShimError

__all__ = ["FSDPShimError", "FSDPShimWarning", "__version__", "activate", "deactivate", "status"]


def _runs_the_command() -> bool:
    """Whether this is ``python -m fsdp_shim``, which imports this package first and must not activate."""
    frame = sys._getframe() if sys.argv[:1] == ["-m"] else None  # while -m locates its module
    while frame is not None:  # runpy's frame that is locating it
        if frame.f_code.co_name == "_run_module_as_main" and frame.f_globals.get("__name__") == "runpy":
            return frame.f_locals.get("mod_name") == __name__
        frame = frame.f_back
    return False


if not _runs_the_command():
    activate()
