"""The shim's own exception and warning classes, so callers can filter or catch exactly these."""


class FSDPShimError(RuntimeError):
    """Raised only in strict mode (``FSDP_SHIM_STRICT=1``), when a Lightning internal the shim
    needs is missing or no longer looks the way the shim expects."""


class FSDPShimWarning(RuntimeWarning):
    """Emitted instead of :class:`FSDPShimError` outside strict mode: the shim could not patch a
    namespace and left it exactly as Lightning shipped it."""
