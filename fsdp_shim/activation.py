"""``activate`` / ``deactivate`` / ``status``: arming the shim, cheaply.

Importing this module costs next to nothing (``sys``, ``_thread`` and the shim's own tiny modules),
because the start-up file imports it in every Python process. wrapt, ``logging``, ``packaging`` and
the patching code load only when a Lightning package is imported, or is already imported when the
shim is activated.
"""

# No `from __future__ import annotations`: it is a real import, and this module runs at every
# interpreter start. Annotations that need newer syntax are strings instead.

import _thread
import sys

from fsdp_shim.import_watch import FirstImportWatcher
from fsdp_shim.toggles import shim_enabled

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from fsdp_shim.report import ShimStatus

TOP_LEVEL_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")
"""Importing any Lightning namespace starts with one of these."""

NAMESPACE_NAMES = ("lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning")

_lock = _thread.RLock()
_active = False
_hooks_registered = False
_watcher: "FirstImportWatcher | None" = None
_imported_before_activation: set[str] = set()
_sources: list[str] = []


def record_source(source: str) -> None:
    """Note how the shim was switched on in this process (``status()`` reports it)."""
    if source not in _sources:
        _sources.append(source)


def activation_sources() -> tuple[str, ...]:
    return tuple(_sources)


def activate() -> bool:
    """Switch the shim on; returns whether it is on.

    Idempotent. Namespaces already imported are patched at once (the methods live on the classes,
    so existing instances are covered); the others are patched when they are imported. Does nothing
    and returns ``False`` while ``FSDP_SHIM`` says off: the variable is the operator's kill switch and
    outranks code.
    """
    global _active, _watcher
    with _lock:
        if not shim_enabled():
            return False
        _active = True
        _imported_before_activation.update(name for name in NAMESPACE_NAMES if name in sys.modules)
        if _hooks_registered or any(name in sys.modules for name in TOP_LEVEL_PACKAGES):
            _register_import_hooks()
        elif _watcher is None or not _watcher.armed:
            _watcher = FirstImportWatcher(TOP_LEVEL_PACKAGES, _register_import_hooks)
            _watcher.arm()
        return True


def deactivate() -> None:
    """Switch the shim off and put back the exact objects Lightning shipped on its classes."""
    global _active
    with _lock:
        _active = False
        if _watcher is not None:
            _watcher.disarm()
        integration = sys.modules.get("fsdp_shim.integration")
        if integration is not None:
            for namespace in integration.NAMESPACES:
                integration.unpatch(namespace)


def is_active() -> bool:
    return _active


def status() -> "ShimStatus":
    """Per namespace: version, affected or not, patched or not, and why."""
    from fsdp_shim.report import collect_status

    return collect_status()


def _register_import_hooks() -> None:
    """Hand over to wrapt's post-import hooks (runs wrapt's import, so only once Lightning is near).

    wrapt calls a hook at once for a namespace already imported and otherwise when its import
    finishes, i.e. after the namespace's ``__init__`` has imported its strategies and plugins.
    """
    global _hooks_registered
    with _lock:
        if _hooks_registered:
            for name in NAMESPACE_NAMES:
                if name in sys.modules:
                    _patch_namespace(name)
            return
        _hooks_registered = True
    try:
        import wrapt

        for name in NAMESPACE_NAMES:
            wrapt.register_post_import_hook(_hook_for(name), name)
    except Exception as error:
        _report_unexpected(error)


def _hook_for(name: str) -> "Callable[[ModuleType], None]":
    def on_import(module: "ModuleType") -> None:
        _patch_namespace(name)

    on_import.__qualname__ = f"fsdp_shim_on_import[{name}]"
    return on_import


def _patch_namespace(name: str) -> None:
    """Patch one namespace; nothing may escape to the user's import except a strict-mode error."""
    from fsdp_shim.errors import FSDPShimError

    try:
        with _lock:
            # Re-read here: FSDP_SHIM may have been set after activation but before this import.
            if not _active or not shim_enabled():
                return
            from fsdp_shim import integration

            integration.patch(
                integration.namespace_named(name),
                activated_after_import=name in _imported_before_activation,
            )
    except FSDPShimError:
        raise
    except Exception as error:
        _report_unexpected(error)


def _report_unexpected(error: Exception) -> None:
    """Last line of defence: a bug in the shim becomes a warning (or a strict-mode error)."""
    import warnings

    from fsdp_shim.errors import FSDPShimError, FSDPShimWarning
    from fsdp_shim.toggles import strict_mode

    message = f"fsdp-shim: internal error, Lightning left unpatched: {type(error).__name__}: {error}"
    if strict_mode():
        raise FSDPShimError(message) from error
    warnings.warn(message, FSDPShimWarning, stacklevel=2)
