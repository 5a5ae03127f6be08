"""Names of the environment variables fsdp-shim reads.

Constants only, so that code running at interpreter start-up can import this module for free.
"""

FSDP_SHIM = "FSDP_SHIM"
"""Master switch. Unset, ``1``, ``true`` or ``on`` enable the shim; ``0``, ``false`` or ``off`` disable it.

It is read when the shim is activated and again whenever a Lightning package is imported, so a job
launched under ``fsdp-shim run`` can still be switched off by setting it before Lightning is imported.
"""

FSDP_SHIM_STRICT = "FSDP_SHIM_STRICT"
"""When true, a patch target that is missing or changed raises :class:`fsdp_shim.FSDPShimError`
instead of warning and leaving Lightning untouched. Same values as :data:`FSDP_SHIM`; default off."""
