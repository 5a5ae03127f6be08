"""Names of the environment variables fsdp-shim reads.

Constants only. The names themselves live in the start-up module (``_fsdp_shim_startup``), which
reads them before the package is imported; they are documented here.
"""

from _fsdp_shim_startup import SHIM_VARIABLE, STRICT_VARIABLE

FSDP_SHIM = SHIM_VARIABLE
"""Master switch. Unset, ``1``, ``true``, ``on``, ``yes``, ``y``, ``enable`` or ``enabled`` leave the
shim on; ``0``, ``false``, ``off``, ``no``, ``n``, ``disable`` or ``disabled`` switch it off. Case and
surrounding spaces are ignored. Any other value switches the shim **off** and warns once: a kill
switch that cannot be read fails closed.

It is read when the shim is activated and again whenever a Lightning package is imported, so a job
launched under ``fsdp-shim run`` can still be switched off by setting it before Lightning is imported.
"""

FSDP_SHIM_STRICT = STRICT_VARIABLE
"""When on, every problem that would otherwise be an ``FSDPShimWarning`` and an untouched Lightning
(a patch target missing or changed, a shim that cannot be loaded, a call that had to fall back) raises
``fsdp_shim.FSDPShimError`` instead. Same values as ``FSDP_SHIM``; default off. Any other value
turns strict mode **on** and warns once: strict is for wanting failures loud."""
