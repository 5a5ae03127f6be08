"""The shim's exception and warning classes, so callers can filter or catch exactly these."""

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim.failures import FSDPShimError

__all__ = ["FSDPShimError", "FSDPShimWarning"]
