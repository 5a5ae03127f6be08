"""Parsing of the on/off environment variables.

Read at activation and again in every import hook, so a value set in a script before Lightning is
imported takes effect. The start-up hook (:mod:`_fsdp_shim_startup`) makes only a quick "is it
off?" check with the same ``OFF_VALUES``; everything else, including the one warning for an
unrecognised value, happens here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from _fsdp_shim_startup import OFF_VALUES
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT

TRUE_VALUES = frozenset({"1", "true", "on"})
FALSE_VALUES = frozenset(OFF_VALUES)

# (variable, raw value) pairs already warned about: a bad value is read at activation and again at
# every hook, and the user should hear about it once, not once per Lightning package.
_warned: set[tuple[str, str]] = set()


def read_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Return the boolean an on/off variable asks for, or ``default`` when unset or invalid.

    Case and surrounding whitespace are ignored. An unrecognised value warns once, naming the
    valid values, and falls back to the default rather than guessing what the user meant.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value == "":
        return default
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        import warnings

        from fsdp_shim.errors import FSDPShimWarning

        valid = ", ".join(sorted(TRUE_VALUES | FALSE_VALUES))
        warnings.warn(
            f"fsdp-shim: ignoring {name}={raw!r}; valid values are {valid} (case-insensitive). "
            f"Using the default ({'on' if default else 'off'}).",
            FSDPShimWarning,
            stacklevel=2,
        )
    return default


def shim_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim switched on (the default)."""
    return read_flag(FSDP_SHIM, True, environ)


def strict_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM_STRICT`` turns patch failures into errors (default off)."""
    return read_flag(FSDP_SHIM_STRICT, False, environ)
