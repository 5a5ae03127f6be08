"""fsdp-shim: Lightning 2.5.0's FSDP "true"-precision conversion for Lightning 2.1–2.4.

With ``strategy="fsdp"`` and ``precision="bf16-true"`` or ``"16-true"``, Lightning 2.1.0–2.4.x never
casts the model before FSDP wraps it, so sharded parameters, gradients and optimizer state take twice
the memory they should. Importing this package (or activating it at interpreter start, see
``fsdp-shim install`` and ``fsdp-shim run``) wraps Lightning's own classes so an affected release
behaves like 2.5.0; a release that already has the fix is not touched.

Set ``FSDP_SHIM=0`` to switch it off without changing code.
"""

from fsdp_shim._version import __version__
from fsdp_shim.activation import activate, deactivate, status
from fsdp_shim.errors import FSDPShimError, FSDPShimWarning

__all__ = ["FSDPShimError", "FSDPShimWarning", "__version__", "activate", "deactivate", "status"]

activate()
