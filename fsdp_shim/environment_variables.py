"""Names of the environment variables fsdp-shim reads, and what each one does (docs/configuration.md).
The names are defined in ``_fsdp_shim.config``, the one place the package reads them from."""

from _fsdp_shim.config import (
    DISABLED_FIXES_VARIABLE,
    LOG_VARIABLE,
    RANK_CHECK_TIMEOUT_VARIABLE,
    SHIM_VARIABLE,
    STRICT_VARIABLE,
)

FSDP_SHIM = SHIM_VARIABLE
"""Master switch. Unset, ``1``, ``true``, ``on``, ``yes``, ``y``, ``enable`` or ``enabled`` leave the
shim on; ``0``, ``false``, ``off``, ``no``, ``n``, ``disable`` or ``disabled`` switch it off. Case and
surrounding spaces are ignored. Any other value switches the shim **off** and warns once: a kill
switch that cannot be read fails closed. Set (to an "on" value), it also arms the shim at start-up in
every Python process of an environment where fsdp-shim is pip-installed.

It is read when the shim is activated and again whenever a Lightning namespace is imported, so a job
launched under ``fsdp-shim run`` can still be switched off by setting it before Lightning is imported.
"""

FSDP_SHIM_DISABLED_FIXES = DISABLED_FIXES_VARIABLE
"""The fixes to leave out, comma-separated: ``cast``, ``recompute``, or ``*`` for both (in the style of
OpenTelemetry's ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``). Case and spaces are ignored; a name that is
no fix is ignored with one warning. Unset, every fix applies where the release lacks it. Read when a
Lightning namespace is patched."""

FSDP_SHIM_STRICT = STRICT_VARIABLE
"""When on, every problem that would otherwise be an ``FSDPShimWarning`` and an untouched Lightning
(a patch target missing or changed, a shim that cannot be loaded, a call that had to fall back) raises
``fsdp_shim.FSDPShimError`` instead. Same values as ``FSDP_SHIM``; default off. Any other value
turns strict mode **on** and warns once: strict is for wanting failures loud."""

FSDP_SHIM_RANK_CHECK_TIMEOUT = RANK_CHECK_TIMEOUT_VARIABLE
"""Seconds each rank with the shim waits for every rank's report in a distributed job before it raises
``FSDPShimError`` naming the ranks that did not report. Unset, it waits as long as the process group's
own timeout (Lightning's default: 1,800 s), so the shim never stops a job torch would let run. ``0``
turns the check off; ``inf`` or a huge value waits as long as the store allows (a year); a negative or
unreadable value keeps the default and warns."""

FSDP_SHIM_LOG = LOG_VARIABLE
"""How much the shim prints. Unset or an "on" value: the confirmation lines, on rank zero only (the line
that names the fixes that acted, once per process, the first time one changes something; the rank
check's line in a distributed FSDP job). An "off" value: none of them (warnings still show). ``debug``:
every record of the ``fsdp_shim`` logger, DEBUG and up, on stderr where logging is not configured to
show them. Any other value keeps the default and warns once."""
