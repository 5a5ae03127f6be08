"""``activate``, ``deactivate`` and ``status`` in this process, and ``namespace_executed``, where the start-up
finder hands each executed Lightning namespace over: the patching code loads only then."""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING

import _fsdp_shim as startup
from _fsdp_shim import NAMESPACES, SHIM_VARIABLE, switch_state
from _fsdp_shim.config import CAST, FIXES, RANK_CHECK, RECOMPUTE, State, disabled_fixes, log_setting

if TYPE_CHECKING:
    from _fsdp_shim.status import ShimStatus

_lock = threading.Lock()  # guards the globals below; never held while patching or importing
_active: bool | None = None  # None until activated (activate(), or the first hand-over) or deactivated
_late: set[str] = set()  # handed over late: imported before arming, or loaded past the finder
_seen_executing: dict[str, ModuleType] = {}  # patched at their import, so never late


def enabled() -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim on (read at every namespace's import); unreadable is off."""
    state = switch_state(os.environ.get(SHIM_VARIABLE))
    if state == "invalid":  # failures is imported only where there is something to say
        from _fsdp_shim import failures

        failures.read_switch(SHIM_VARIABLE, "switched the shim OFF (an unreadable kill switch fails closed)")
    return state in ("on", "unset")


def activate() -> bool:
    """Switch the shim on and patch what is imported already; ``False`` while ``FSDP_SHIM`` says off."""
    global _active
    if not enabled():
        return False
    with _lock:
        _active = True
        _late.update(
            name for name in NAMESPACES if name in sys.modules and _seen_executing.get(name) is not sys.modules[name]
        )
    startup.arm("import fsdp_shim")
    for name in NAMESPACES:  # and what was handed over before a deactivate()
        if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", True) is False:
            _patch(name)
    _check_again()
    return True


def deactivate() -> None:
    """Switch the shim off and put back the exact objects that were there (``wrappers.unpatch_all``)."""
    global _active
    with _lock:
        _active = False
    if (wrappers := sys.modules.get("_fsdp_shim.wrappers")) is not None:  # else nothing was patched
        wrappers.unpatch_all()


def namespace_executed(module: ModuleType, late: bool = False) -> None:
    """The finder's hand-over: a namespace just executed, or noticed ``late`` (imported before arming, or loaded by
    a finder in front of the shim's): then patched as by ``activate()``, warning about models already wrapped."""
    global _active
    name = module.__name__
    with _lock:
        if _active is None:
            _active = True  # armed at start-up: this is the activation
        if late:
            _late.add(name)
        elif _active:
            _seen_executing[name] = module
    _patch(name)


def _patch(name: str) -> None:
    """Patch every fix in one namespace; nothing escapes to the user's import but a strict-mode error."""
    try:
        if not _active or not enabled():
            return
        from _fsdp_shim import fixes, recompute_check, wrappers

        skipped, unknown = disabled_fixes()
        if unknown or log_setting()[1] is not None:
            from _fsdp_shim import failures

            failures.unreadable_settings()
        if skipped:
            wrappers.unpatch_disabled(name, skipped)
        cast_before = wrappers.state(name, CAST)  # a late patch of the cast warns about models wrapped before
        after = {fix: wrappers.patch(name, fix, fixes.PLANS[fix.name], disabled=fix.name in skipped) for fix in FIXES}
        if after[RECOMPUTE] is State.PATCHED and not recompute_check.ran:  # again: at activate() and status()
            recompute_check.check()  # a fix on torch's private names: shown before it counts
        wrappers.patch(name, RANK_CHECK, fixes.PLANS[RANK_CHECK.name])  # says what this rank runs, whatever it is
        if name in _late and after[CAST] is State.PATCHED and cast_before is not State.PATCHED:
            from _fsdp_shim import failures

            failures.warn_about_models_already_wrapped()
    except Exception as error:
        from _fsdp_shim import failures

        failures.internal_error(error, doing=f"patching {name}", key=f"internal:{name}", cannot=f"patch {name}")


def _check_again() -> None:
    """Check again a recompute path that could not be checked where it was first."""
    check = sys.modules.get("_fsdp_shim.recompute_check")
    if check is not None and check.unsettled():
        try:
            check.check()
        except Exception as error:
            from _fsdp_shim import failures

            failures.internal_error(error, doing="checking a fix again", key="internal:recheck")


def status() -> ShimStatus:
    """Per namespace and per fix: the release, the state and why (``_fsdp_shim.status``)."""
    from _fsdp_shim.status import collect

    _check_again()
    return collect(enabled(), bool(_active), set(_late))
