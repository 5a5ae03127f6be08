"""Everything fsdp-shim can be told or knows in advance: its environment variables, the Lightning
namespaces, and the fixes with the releases each one applies to. It says what a value means and what
is wrong with it, but warns about nothing (``_fsdp_shim.failures`` does). The switch parser and the
namespace table live in the start-up module, which must work before anything else is imported."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from _fsdp_shim import NAMESPACES, OFF_VALUES, ON_VALUES, SHIM_VARIABLE, STRICT_VARIABLE, switch_state

RANK_CHECK_TIMEOUT_VARIABLE = "FSDP_SHIM_RANK_CHECK_TIMEOUT"
DISABLED_FIXES_VARIABLE = "FSDP_SHIM_DISABLED_FIXES"
LOG_VARIABLE = "FSDP_SHIM_LOG"
TRAINER_NAMESPACES = tuple(name for name, kind in NAMESPACES.items() if kind == "trainer")
LIGHTNING_PACKAGES = tuple(dict.fromkeys(name.partition(".")[0] for name in NAMESPACES))
"""The top-level packages that hold the namespaces, in the order of the table."""

Release = tuple[int, int, int]


@dataclass(frozen=True)
class Fix:
    """One of the shim's fixes: which releases lack it, and what it changes."""

    name: str
    """What ``FSDP_SHIM_DISABLED_FIXES`` calls it."""
    changes: str
    """What it changes, in one sentence (status, docs)."""
    first_affected: Release
    first_fixed: Release | None
    """The first release that ships it; ``None`` while no release does."""
    upstream: str
    unfixed: str
    """What a namespace left without this fix keeps doing (for messages)."""

    def affects(self, version: str) -> bool:
        """Whether a Lightning version lacks this fix (the release half of the gate; the classes are the other)."""
        release = base_release(version)
        return release is not None and self.first_affected <= release and not self.built_in(version)

    def built_in(self, version: str) -> bool:
        """Whether the release ships this fix itself."""
        release = base_release(version)
        return release is not None and self.first_fixed is not None and release >= self.first_fixed

    def releases(self) -> str:
        first = ".".join(map(str, self.first_affected))
        if self.first_fixed is None:
            return f"{first} and later (no release has it yet)"
        return f"{first} up to {'.'.join(map(str, self.first_fixed))} (exclusive)"

    def unaffected_reason(self, version: str) -> str:
        """Why a release this fix does not apply to needs nothing."""
        if self.built_in(version):
            return f"Lightning {version} already contains it ({self.upstream}); left untouched"
        return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"


CAST = Fix(
    name="cast",
    changes="casts the model to the precision's dtype before FSDP wraps it, as Lightning 2.5.0 does",
    first_affected=(2, 1, 0),  # 2.1.0 added the "true" precisions to FSDP
    first_fixed=(2, 5, 0),  # Lightning PR #20323, first in 2.5.0rc0
    upstream="Lightning #20323, 2.5.0",
    unfixed="FSDP 'true' precisions keep the memory bug",
)
RECOMPUTE = Fix(
    name="recompute",
    changes="recomputes every activation-checkpointed block in the default dtype its forward had",
    first_affected=(2, 1, 0),
    first_fixed=None,  # no Lightning release has it; the newest release's session proves the bug
    upstream="not fixed in any Lightning release",
    unfixed="activation checkpointing recomputes blocks in float32 under 'true' precisions",
)
FIXES = (CAST, RECOMPUTE)
FIX_NAMES = tuple(fix.name for fix in FIXES)
RANK_CHECK = Fix(
    name="rank-check",
    changes="checks, before FSDP wraps a model, that every rank of the job runs the same fixes",
    first_affected=(2, 1, 0),
    first_fixed=None,
    upstream="not a Lightning fix: fsdp-shim's own check",
    unfixed="the ranks of an FSDP job are not checked for running the same fixes",
)
"""Not a fix (not in ``FIXES``, not switched off by name): ``_fsdp_shim.rank_check``'s hook, patched
like one wherever the shim is active, so that a rank whose fixes are all off or built in still reports."""


def base_release(version: str) -> Release | None:
    """``(major, minor, micro)`` of a version string, or ``None`` if it is not PEP 440: ``2.5.0rc0``
    counts as 2.5.0 (a PEP 440 comparison would put it before 2.5.0 and call it affected, though the
    fix is in it), ``2.4.0.post1`` and ``2.4.0+cu121`` as 2.4.0."""
    from packaging.version import InvalidVersion, Version  # here: `import fsdp_shim` alone loads no packaging

    try:
        release = Version(version).release
    except (InvalidVersion, TypeError):
        return None
    padded = (*release, 0, 0)[:3]
    return (padded[0], padded[1], padded[2])


def valid_switch_values() -> str:
    """The recognised values of ``FSDP_SHIM`` and ``FSDP_SHIM_STRICT``, for messages."""
    return ", ".join((*ON_VALUES, *OFF_VALUES))


def shim_state(environ: Mapping[str, str] = os.environ) -> str:
    """``switch_state`` of ``FSDP_SHIM``: "unset" and "on" leave the shim on; "invalid" is off."""
    return switch_state(environ.get(SHIM_VARIABLE))


def strict_state(environ: Mapping[str, str] = os.environ) -> str:
    """``switch_state`` of ``FSDP_SHIM_STRICT``: "on" and "invalid" are on."""
    return switch_state(environ.get(STRICT_VARIABLE))


def disabled_fixes(environ: Mapping[str, str] = os.environ) -> tuple[frozenset[str], list[str]]:
    """The fixes ``FSDP_SHIM_DISABLED_FIXES`` names (comma-separated, case and spaces ignored; ``*``
    or ``all`` names every fix), and the names it holds that are no fix (to warn about)."""
    raw = environ.get(DISABLED_FIXES_VARIABLE, "")
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    if any(name in ("*", "all") for name in names):
        return frozenset(FIX_NAMES), [name for name in names if name not in (*FIX_NAMES, "*", "all")]
    return frozenset(name for name in names if name in FIX_NAMES), [name for name in names if name not in FIX_NAMES]


MAX_RANK_CHECK_SECONDS = 365 * 24 * 3600.0
"""The longest wait the rank check asks the store for: larger values (``inf`` included) mean "as long
as it takes" and are clamped to this, which every store accepts (``1e20`` s overflowed it)."""


def rank_check_timeout(environ: Mapping[str, str] = os.environ) -> tuple[float | None, str | None]:
    """The rank check's wait in seconds from ``FSDP_SHIM_RANK_CHECK_TIMEOUT`` (``None``: unset, the
    process group's own timeout; ``0``: off), and what is wrong with the value. An unreadable or
    negative one keeps the default: a check against silent corruption must not be lost to a typo."""
    raw = environ.get(RANK_CHECK_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return None, None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value < 0:
        return None, f"{RANK_CHECK_TIMEOUT_VARIABLE}={raw!r} is not a number of seconds >= 0"
    return min(value, MAX_RANK_CHECK_SECONDS), None


def log_setting(environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """``FSDP_SHIM_LOG``: ``"on"`` (unset or an on value: the confirmation lines on rank zero), ``"off"``
    (an off value: none), ``"debug"`` (every record of the ``fsdp_shim`` logger, DEBUG and up); and what
    is wrong with the value. An unreadable one keeps the default: the lines say what a job runs."""
    raw = environ.get(LOG_VARIABLE)
    if raw is not None and raw.strip().lower() == "debug":
        return "debug", None
    state = switch_state(raw)
    if state == "invalid":
        valid = f"{valid_switch_values()}, debug"
        problem = f"{LOG_VARIABLE}={raw!r} is not a valid value (valid, case-insensitive: {valid})"
        return "on", f"{problem}; the confirmation lines stay on"
    return ("off" if state == "off" else "on"), None
