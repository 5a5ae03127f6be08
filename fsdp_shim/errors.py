"""The shim's own exception and warning classes, so callers can filter or catch exactly these.

``FSDPShimWarning`` is defined in the start-up module, so that a shim which fails to import can
still warn with it; this is the same class.
"""

from _fsdp_shim_startup import FSDPShimWarning


class FSDPShimError(RuntimeError):
    """Raised only in strict mode (``FSDP_SHIM_STRICT``): the shim could not apply its fix, and the
    message says what is missing or changed. Outside strict mode the same problem is one
    ``FSDPShimWarning`` and Lightning stays exactly as shipped."""


__all__ = ["FSDPShimError", "FSDPShimWarning"]
