"""Parsing of the on/off environment variables.

Kept free of imports beyond ``os`` (loaded by every interpreter before ``site`` runs) because the
start-up file calls it in every Python process of an environment; even ``warnings`` is imported
only when there is something to warn about.
"""

# No `from __future__ import annotations`: it is a real import, and this module runs at every
# interpreter start. Annotations that need newer syntax are strings instead.

import os

from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT

# ``typing`` costs milliseconds to import; type checkers understand this spelling of the flag.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

TRUE_VALUES = frozenset({"1", "true", "on"})
FALSE_VALUES = frozenset({"0", "false", "off"})

# (variable, raw value) pairs already warned about: a bad value is read at activation and again at
# every hook, and the user should hear about it once, not once per Lightning package.
_warned: set[tuple[str, str]] = set()


def read_flag(name: str, default: bool, environ: "Mapping[str, str] | None" = None) -> bool:
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


def shim_enabled(environ: "Mapping[str, str] | None" = None) -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim switched on (the default)."""
    return read_flag(FSDP_SHIM, True, environ)


def strict_mode(environ: "Mapping[str, str] | None" = None) -> bool:
    """Whether ``FSDP_SHIM_STRICT`` turns patch failures into errors (default off)."""
    return read_flag(FSDP_SHIM_STRICT, False, environ)
