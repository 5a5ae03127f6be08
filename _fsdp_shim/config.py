"""What fsdp-shim knows in advance: its environment variables, its fixes as data, and the states a fix can be in."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from _fsdp_shim import NAMESPACES, OFF_VALUES, ON_VALUES, SHIM_VARIABLE, STRICT_VARIABLE, switch_state

DISABLED_FIXES_VARIABLE = "FSDP_SHIM_DISABLED_FIXES"
LOG_VARIABLE = "FSDP_SHIM_LOG"
RANK_CHECK_TIMEOUT_VARIABLE = "FSDP_SHIM_RANK_CHECK_TIMEOUT"
VARIABLES = (SHIM_VARIABLE, STRICT_VARIABLE, DISABLED_FIXES_VARIABLE, RANK_CHECK_TIMEOUT_VARIABLE, LOG_VARIABLE)
TRAINER_NAMESPACES = tuple(name for name, kind in NAMESPACES.items() if kind == "trainer")
LIGHTNING_PACKAGES = tuple(dict.fromkeys(name.partition(".")[0] for name in NAMESPACES))
DOCS = "https://fsdp-shim.github.io/fsdp-shim/"
VALID_SWITCH_VALUES = ", ".join((*ON_VALUES, *OFF_VALUES))
MAX_RANK_CHECK_SECONDS = 365 * 24 * 3600.0  # what every store accepts (1e20 s overflowed it)


@dataclass(frozen=True)
class Fix:
    """One fix: from 2.1.0 up to the Lightning release that ships it (``fixed_in``, exclusive), and where from."""

    name: str
    fixed_in: str | None
    upstream: str

    def affects(self, version: str) -> bool:
        """Whether a Lightning version lacks this fix (``2.5.0rc0`` counts as 2.5.0)."""
        release = base_release(version)
        return release is not None and release >= (2, 1, 0) and not self.built_in(version)  # 2.1: "true" precisions

    def built_in(self, version: str) -> bool:
        """Whether the Lightning release ships this fix itself."""
        release, fixed_in = base_release(version), base_release(self.fixed_in or "")
        return release is not None and fixed_in is not None and release >= fixed_in


CAST = Fix(name="cast", fixed_in="2.5.0", upstream="Lightning #20323, 2.5.0")
RECOMPUTE = Fix(name="recompute", fixed_in=None, upstream="no Lightning release")
FIXES = (CAST, RECOMPUTE)
FIX_NAMES = tuple(fix.name for fix in FIXES)
RANK_CHECK = Fix(name="rank-check", fixed_in=None, upstream="fsdp-shim's own check")  # never switched off by name


class State(str, Enum):
    """Where one fix stands in one namespace; the sentence for people is made where it is shown."""

    NOT_IMPORTED = "not imported"
    NOT_CHECKED = "not checked"
    PATCHED = "patched"
    NOT_SHOWN = "not shown yet"  # wrapped and acting; its check could not run here yet
    NOT_IN_EFFECT = "not in effect"  # torch's call path passes its wrappers by, on some paths
    NOT_AFFECTED = "not affected"  # 2.0.x: no "true" precisions for FSDP
    BUILT_IN = "built in"  # the Lightning release has it
    TORCH_HAS_IT = "torch has it"  # torch's checkpoint restores the default dtype itself
    DISABLED = "disabled"  # FSDP_SHIM_DISABLED_FIXES
    SWITCHED_OFF = "switched off"  # FSDP_SHIM=0
    DEACTIVATED = "deactivated"
    FAILED = "failed"  # could not be patched, or other code or a fallback took it off; ``detail`` says how


def base_release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, micro)`` of a PEP 440 version (``2.5.0rc0`` and ``2.4.0+cu121`` alike), else ``None``."""
    from packaging.version import InvalidVersion, Version

    try:
        release = (*Version(version).release, 0, 0)
    except (InvalidVersion, TypeError):
        return None
    return release[0], release[1], release[2]


def disabled_fixes(environ: Mapping[str, str] = os.environ) -> tuple[frozenset[str], list[str]]:
    """The fixes ``FSDP_SHIM_DISABLED_FIXES`` names (``*`` or ``all``: every fix), and its names that are no fix."""
    names = [name.strip().lower() for name in environ.get(DISABLED_FIXES_VARIABLE, "").split(",") if name.strip()]
    every = "*" in names or "all" in names
    unknown = [name for name in names if name not in (*FIX_NAMES, "*", "all")]
    return frozenset(name for name in FIX_NAMES if every or name in names), unknown


def rank_check_timeout(environ: Mapping[str, str] = os.environ) -> tuple[float | None, str | None]:
    """``FSDP_SHIM_RANK_CHECK_TIMEOUT`` in seconds (``None``: unset or unreadable, the group's own), and its problem."""
    raw = environ.get(RANK_CHECK_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return None, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # unreadable, negative or NaN
        return None, f"{RANK_CHECK_TIMEOUT_VARIABLE}={raw!r} is not a number of seconds >= 0"
    return min(value, MAX_RANK_CHECK_SECONDS), None


def log_setting(environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """``FSDP_SHIM_LOG``: ``"on"`` (the default) or ``"off"``, and what is wrong with its value."""
    raw = environ.get(LOG_VARIABLE)
    if (state := switch_state(raw)) == "invalid":
        problem = f"{LOG_VARIABLE}={raw!r} is not a valid value ({VALID_SWITCH_VALUES}); the confirmation lines stay on"
        return "on", problem
    return ("off" if state == "off" else "on"), None
