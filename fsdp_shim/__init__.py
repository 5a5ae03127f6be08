"""fsdp-shim: fixes for FSDP "true"-precision training in Lightning, without upgrading or forking it. Importing it
activates the shim, as ``import ddtrace.auto`` does (``FSDP_SHIM=0`` switches it off without changing code);
``python -m fsdp_shim`` is the ``fsdp-shim`` command, which activates nothing."""

from __future__ import annotations

import sys

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim._version import __version__
from _fsdp_shim.activation import activate, deactivate, status
from _fsdp_shim.failures import FSDPShimError

__all__ = ["FSDPShimError", "FSDPShimWarning", "__version__", "activate", "deactivate", "status"]


def _runs_the_command() -> bool:
    """Whether this is ``python -m fsdp_shim``, which imports this package first and must not activate: runpy's
    frame that is locating the module says which module ``-m`` runs."""
    frame = sys._getframe() if sys.argv[:1] == ["-m"] else None  # "-m" only while -m locates its module
    while frame is not None and not (frame.f_code.co_name == "_run_module_as_main" and "mod_name" in frame.f_locals):
        frame = frame.f_back
    return frame is not None and frame.f_locals["mod_name"] == __name__


if not _runs_the_command():
    activate()
