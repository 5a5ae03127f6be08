"""``activate`` / ``deactivate`` / ``status``: switching the shim on and off in this process.

Activation hands the work to wrapt's post-import hooks: wrapt calls a hook at once for a Lightning
namespace already imported, and otherwise when its import finishes (after the namespace's
``__init__`` has imported its strategies and plugins). The patching code itself (``packaging``,
``logging``, the wrappers) loads only when a hook fires. Start-up cost in processes that never
import Lightning is the business of :mod:`_fsdp_shim_startup`, which does not import this package
until Lightning is imported.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from fsdp_shim.toggles import shim_enabled

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from fsdp_shim.report import ShimStatus


NAMESPACE_NAMES = ("lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning")

_lock = threading.RLock()
_active = False
_hooks_registered = False
_imported_before_activation: set[str] = set()


def activation_sources() -> tuple[str, ...]:
    """How the shim was armed in this process: the start-up hooks record themselves; anything
    else was a plain ``import fsdp_shim``."""
    startup = sys.modules.get("_fsdp_shim_startup")
    return tuple(getattr(startup, "sources", ())) or ("import fsdp_shim",)


def activate() -> bool:
    """Switch the shim on; returns whether it is on.

    Idempotent. Namespaces already imported are patched at once (the methods live on the classes,
    so existing instances are covered); the others are patched when they are imported. Does nothing
    and returns ``False`` while ``FSDP_SHIM`` says off: the variable is the operator's kill switch and
    outranks code.
    """
    global _active
    with _lock:
        if not shim_enabled():
            return False
        _active = True
        _imported_before_activation.update(name for name in NAMESPACE_NAMES if name in sys.modules)
        _register_import_hooks()
        return True


def deactivate() -> None:
    """Switch the shim off and put back the exact objects Lightning shipped on its classes."""
    global _active
    with _lock:
        _active = False
        integration = sys.modules.get("fsdp_shim.integration")
        if integration is not None:
            for namespace in integration.NAMESPACES:
                integration.unpatch(namespace)


def is_active() -> bool:
    return _active


def status() -> ShimStatus:
    """Per namespace: version, affected or not, patched or not, and why."""
    from fsdp_shim.report import collect_status

    return collect_status()


def _register_import_hooks() -> None:
    """Register wrapt's post-import hooks once; on later activations, patch what is imported."""
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


def _hook_for(name: str) -> Callable[[ModuleType], None]:
    def on_import(module: ModuleType) -> None:
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
