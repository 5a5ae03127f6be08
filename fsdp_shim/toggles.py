"""The on/off switches, read when the shim activates and again at every Lightning import, so a value
set in a script before Lightning is imported takes effect.

The values are parsed by ``_fsdp_shim_startup.switch_state``, which the start-up code uses too;
this module adds the one warning per unrecognised value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from _fsdp_shim_startup import OFF_VALUES, ON_VALUES, switch_state
from fsdp_shim import failures
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT


def valid_values() -> str:
    return ", ".join((*ON_VALUES, *OFF_VALUES))


def shim_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim on. An unrecognised value is off (fails closed)."""
    state = _read(FSDP_SHIM, environ, "switched the shim OFF (an unreadable kill switch fails closed)")
    return state in ("on", "unset")


def strict_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM_STRICT`` turns the shim's problems into errors. An unrecognised value is on."""
    state = _read(FSDP_SHIM_STRICT, environ, "turned strict mode ON (failures raise)")
    return state in ("on", "invalid")


def _read(name: str, environ: Mapping[str, str] | None, meaning: str) -> str:
    env = os.environ if environ is None else environ
    raw = env.get(name)
    state = switch_state(raw)
    if state == "invalid":
        failures.warn_once(
            f"fsdp-shim: {name}={raw!r} is not a valid value and {meaning}. "
            f"Valid values (case-insensitive): {valid_values()}.",
            key=f"toggle:{name}={raw}",
        )
    return state
