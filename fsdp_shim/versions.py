"""Which Lightning releases carry the bug, and what each kind of release is told.

Releases are compared on their *base* version: ``2.5.0rc0``, ``2.5.0.dev1``, ``2.4.0.post1`` and
``2.4.0+cu121`` count as 2.5.0, 2.5.0, 2.4.0 and 2.4.0. A plain PEP 440 comparison would put
``2.5.0rc0`` before ``2.5.0`` and call it affected, though the fix (#20323) is already in 2.5.0rc0.
The version gate is half of the decision; the other half is what the classes hold
(``fsdp_shim.integration``).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

Release = tuple[int, int, int]

FIRST_AFFECTED: Release = (2, 1, 0)
"""2.1.0 added the "true" precisions to FSDP; 2.0.x rejects them, so there is nothing to fix."""

FIRST_FIXED: Release = (2, 5, 0)
"""Lightning PR #20323 ("Add convert_module to FSDP") first shipped in 2.5.0rc0."""

FIRST_CONVERTING_IN_SETUP: Release = (2, 2, 0)
"""Lightning PR #19061 moved the Trainer's ``convert_module`` call from ``Strategy.connect`` into
``FSDPStrategy.setup`` in 2.2.0. Before it, the shim must supply that call site itself."""

FIRST_WITH_FSDP_PRECISION: Release = (2, 1, 1)
"""2.1.1 renamed the Trainer's ``FSDPPrecisionPlugin`` to ``FSDPPrecision``; from 2.2.0 the old name
is a deprecated *subclass*, so only 2.1.0 may be patched under it."""


def base_release(version: str) -> Release | None:
    """Return ``(major, minor, micro)`` of a version string, or ``None`` if it is not PEP 440."""
    try:
        release = Version(version).release
    except (InvalidVersion, TypeError):
        return None
    padded = (*release, 0, 0)[:3]
    return (padded[0], padded[1], padded[2])


def is_affected_release(version: str) -> bool:
    """Whether a Lightning version lies in the range that lacks the FSDP ``convert_module`` fix."""
    release = base_release(version)
    return release is not None and FIRST_AFFECTED <= release < FIRST_FIXED


def is_fixed_release(version: str) -> bool:
    release = base_release(version)
    return release is not None and release >= FIRST_FIXED


def converts_only_in_connect(version: str) -> bool:
    """Whether this release's Trainer converts the model in ``Strategy.connect`` (2.1.x), before
    ``configure_model`` and the ``setup()`` hook have built the layers that must be converted."""
    release = base_release(version)
    return release is not None and FIRST_AFFECTED <= release < FIRST_CONVERTING_IN_SETUP


def has_fsdp_precision_class(version: str) -> bool:
    """Whether the Trainer's FSDP precision class is called ``FSDPPrecision`` (2.1.1 on)."""
    release = base_release(version)
    return release is None or release >= FIRST_WITH_FSDP_PRECISION


def unaffected_reason(version: str) -> str:
    """Why a release that ``is_affected_release`` rejects needs nothing (``status()``, ``verify``)."""
    release = base_release(version)
    if release is not None and release < FIRST_AFFECTED:
        return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"
    return f"Lightning {version} already contains the fix (Lightning #20323, 2.5.0); left untouched"
