"""The failure policy: strict mode raises; otherwise one warning at the user's line. Loaded when a problem is."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Any

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim.config import (
    DISABLED_FIXES_VARIABLE,
    DOCS,
    FIX_NAMES,
    LIGHTNING_PACKAGES,
    RANK_CHECK,
    STRICT_VARIABLE,
    switch_state,
    valid_switch_values,
)
from _fsdp_shim.log import first_time


class FSDPShimError(RuntimeError):
    """A problem of the shim in strict mode (``FSDP_SHIM_STRICT``), or ranks of one job that run different fixes."""


FSDPShimError.__module__ = "fsdp_shim.errors"  # where users import it from


def read_switch(name: str, meaning: str) -> str:
    """``switch_state`` of the variable ``name``, warning once per unreadable value (``meaning``: what it does)."""
    raw = os.environ.get(name)
    state = switch_state(raw)
    if state == "invalid":
        warn_once(
            f"fsdp-shim: {name}={raw!r} is not a valid value and {meaning}. "
            f"Valid values (case-insensitive): {valid_switch_values()}.",
            key=f"toggle:{name}={raw}",
        )
    return state


def unreadable_settings(unknown: list[str], problem: str | None) -> None:
    """``FSDP_SHIM_DISABLED_FIXES`` names that are no fix, and an unreadable ``FSDP_SHIM_LOG``: a warning each."""
    if unknown:
        names = ", ".join(map(repr, unknown))
        warn_once(
            f"fsdp-shim: {DISABLED_FIXES_VARIABLE} names {names}, which is no fix of fsdp-shim (its fixes: "
            f"{', '.join(FIX_NAMES)}); that name is ignored",
            key=f"disabled:{','.join(unknown)}",
        )
    if problem is not None:
        warn_once(f"fsdp-shim: {problem}", key=problem)


def internal_error(error: Exception, *, doing: str, key: str, cannot: str | None = None) -> None:
    """The shim's own error while ``doing``; what it raises on purpose (strict mode, the rank check) goes on.
    ``cannot``: what a missing dependency of the shim (wrapt, packaging) stops."""
    if isinstance(error, (FSDPShimError, Warning)):
        raise error
    if isinstance(error, ImportError) and cannot is not None:
        consequence = "Lightning was left unchanged, so no fix applies"
        report(f"fsdp-shim: cannot {cannot}: {type(error).__name__}: {error}", consequence, key=key, cause=error)
        return
    problem = f"fsdp-shim: internal error while {doing} ({type(error).__name__}: {error})"
    report(problem, "see fsdp_shim.status() for what is in effect", key=key, cause=error)


def glue_failed(wrapper: Any, error: Exception) -> None:
    """A wrapper could not read what it needs: Lightning's or torch's own function ran for this call."""
    what = "rank check" if wrapper.fix == RANK_CHECK.name else f"{wrapper.fix} fix"
    report(
        f"fsdp-shim: {wrapper.label} could not read what it needs ({error})",
        f"{owners_own(wrapper)} was used for this call, so it runs without the {what}",
        key=f"glue:{wrapper.label}",
        cause=error,
    )


def owners_own(wrapper: Any) -> str:
    return "torch's own function" if wrapper.target.shared else "Lightning's own method"


def cannot_patch(namespace: str, fix: Any, record: Any) -> None:
    """A namespace that could not be patched, and why (``record.detail``): left unchanged."""
    which, without = (f" ({fix.name} fix)", f"it runs without the {fix.name} fix") if record.affected else ("", "")
    report(
        f"fsdp-shim: cannot patch {namespace} {record.version or '(unknown version)'}{which}: {record.detail}",
        f"Lightning was left unchanged, so {without or 'no fix applies'}",
        key=f"patch:{namespace}:{fix.name}:{record.detail}",
    )


def wrapper_left(label: str, top: str, gone: bool) -> None:
    """``deactivate()`` found another library's object on top of, or instead of, the shim's wrapper on ``label``."""
    if gone:
        message = f"its wrapper on {label} had already been replaced by other code ({top}); nothing of the shim's is "
        warn_once(f"fsdp-shim: {message}left there to remove", key=f"gone:{label}")
    else:
        warn_once(
            f"fsdp-shim: deactivated its wrapper on {label} in place, because other code ({top}) has wrapped it since; "
            "it now passes every call through, and the other code's wrapper is left as it is",
            key=f"buried:{label}",
        )


def threads_clashed() -> None:
    """Two recomputes in different default dtypes at once: torch's default dtype is one per process."""
    warn_once(
        "fsdp-shim: two activation-checkpointed recomputes ran at once in different default dtypes (two threads' "
        "backwards); torch's default dtype is one for the whole process, so one of them ran in the other's dtype. "
        f"The default dtype is put back when both end. See {DOCS}how-it-works.html#threads",
        key="recompute:threads",
    )


def recompute_passed_by(torch_version: str, checkpoints: str, why: str) -> None:
    """torch's call path passes the recompute fix's wrappers by (its check showed it): taken off there."""
    report(
        f"fsdp-shim: the recompute fix is not in effect on torch {torch_version} for {checkpoints} ({why})",
        "torch was left as it was there, so this fix is off for that checkpoint in this process",
        key=f"proof:{checkpoints}",
    )


def strict_mode() -> bool:
    return read_switch(STRICT_VARIABLE, "turned strict mode ON (failures raise)") in ("on", "invalid")


def report(problem: str, consequence: str, *, key: str, cause: BaseException | None = None) -> None:
    """Raise in strict mode; otherwise warn ``problem; consequence`` once per ``key``."""
    if strict_mode():
        raise FSDPShimError(f"{problem} ({STRICT_VARIABLE} is on)") from cause
    warn_once(f"{problem}; {consequence}", key=key)


def warn_once(message: str, *, key: str) -> None:
    """One ``FSDPShimWarning`` per ``key`` per process, pointing at the user's line."""
    if not first_time(key):
        return
    frame = user_frame()
    if frame is None:
        warnings.warn(message, FSDPShimWarning, stacklevel=1)
        return
    found = frame.f_globals
    registry = found.setdefault("__warningregistry__", {})
    source = found if found.get("__file__") else None  # `python -c`'s loader raises when asked for source
    warnings.warn_explicit(
        message, FSDPShimWarning, frame.f_code.co_filename, frame.f_lineno, found.get("__name__"), registry, source
    )


_OWN = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.abspath(warnings.__file__)), "importlib"),
)


def user_frame() -> FrameType | None:
    """The innermost frame outside fsdp-shim, the import machinery, wrapt and Lightning, where warnings point."""
    internal = ["<frozen importlib", *(os.path.join(path, "") for path in _OWN)]
    internal.append(os.path.join(os.path.dirname(_OWN[0]), "fsdp_shim", ""))
    for name in ("wrapt", *LIGHTNING_PACKAGES):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            internal.append(os.path.join(os.path.dirname(os.path.abspath(path)), ""))
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(tuple(internal)):
        frame = frame.f_back
    return frame
