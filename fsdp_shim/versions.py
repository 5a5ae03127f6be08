"""Which Lightning releases carry the bug.

Releases are compared on their *base* version: ``2.5.0rc0``, ``2.5.0.dev1``, ``2.4.0.post1`` and
``2.4.0+cu121`` count as 2.5.0, 2.5.0, 2.4.0 and 2.4.0. A plain PEP 440 comparison would put
``2.5.0rc0`` before ``2.5.0`` and call it affected, though the fix (#20323) is already in 2.5.0rc0.
The version gate is only half of the decision; the other half is whether the class defines
``convert_module`` itself (see :mod:`fsdp_shim.integration`).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

FIRST_AFFECTED = (2, 1, 0)
"""2.1.0 added the "true" precisions to FSDP; 2.0.x rejects them, so there is nothing to fix."""

FIRST_FIXED = (2, 5, 0)
"""Lightning PR #20323 ("Add convert_module to FSDP") first shipped in 2.5.0rc0."""

FIRST_CONVERTING_IN_SETUP = (2, 2, 0)
"""Lightning PR #19061 moved the Trainer's ``convert_module`` call from ``Strategy.connect`` into
``FSDPStrategy.setup`` in 2.2.0. Before it, the shim must supply that call site itself."""


def base_release(version: str) -> tuple[int, int, int] | None:
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


def converts_only_in_connect(version: str) -> bool:
    """Whether this release's Trainer converts the model in ``Strategy.connect`` (2.1.x), before
    ``configure_model`` and the ``setup()`` hook have built the layers that must be converted."""
    release = base_release(version)
    return release is not None and FIRST_AFFECTED <= release < FIRST_CONVERTING_IN_SETUP
