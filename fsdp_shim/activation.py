"""``activate`` / ``deactivate`` / ``status``: switching the shim on and off in this process.

Activation registers one hook per Lightning namespace with the start-up module's import watcher
(``_fsdp_shim_startup.when_imported``): it runs at once for a namespace already imported, and
otherwise right after the namespace's ``__init__`` has executed (its strategies and plugins are then
imported). The patching code itself (wrapt, ``packaging``, ``logging``) loads only when a hook runs.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

import _fsdp_shim_startup as startup
from fsdp_shim.errors import FSDPShimError
from fsdp_shim.toggles import shim_enabled

if TYPE_CHECKING:
    from types import ModuleType

    from fsdp_shim.report import NamespaceStatus, ShimStatus

_NAMESPACE_NAMES = tuple(name for name, _ in startup.LIGHTNING_NAMESPACES)

_lock = threading.Lock()  # guards the three globals below; never held while patching or importing
_active = False
_hooks_registered = False
_imported_before_activation: set[str] = set()


def activate() -> bool:
    """Switch the shim on; returns whether it is on.

    Idempotent. Namespaces already imported are patched at once (the methods live on the classes,
    so existing instances are covered); the others are patched when they are imported. Does nothing
    and returns ``False`` while ``FSDP_SHIM`` says off (or cannot be read): the variable is the
    operator's kill switch and outranks code.
    """
    global _active, _hooks_registered
    if _in_the_fsdp_shim_command() and startup.switch_state(os.environ.get(startup.SHIM_VARIABLE)) == "invalid":
        return False  # the command imports no Lightning; `fsdp-shim status` reports the value as a PROBLEM line
    if not shim_enabled():
        return False
    with _lock:
        _active = True
        _imported_before_activation.update(name for name in _NAMESPACE_NAMES if startup.is_imported(name))
        first = not _hooks_registered
        _hooks_registered = True
    for name in _NAMESPACE_NAMES:
        if first:
            startup.whenever_executed(name, _on_import)  # a copy imported again gets new classes
            startup.when_imported(name, _on_import)
        elif name in sys.modules:
            _patch_namespace(name)
    startup.fire_pending()
    return True


def _in_the_fsdp_shim_command() -> bool:
    """Whether this process is the ``fsdp-shim`` command (console script or ``python -m fsdp_shim``),
    where a Python warning about an unreadable ``FSDP_SHIM`` would point into the console script."""
    main = sys.modules.get("__main__")
    if os.path.basename(getattr(main, "__file__", None) or "") in ("fsdp-shim", "fsdp-shim.exe", "fsdp-shim-script.py"):
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any((a == "-m" and b == "fsdp_shim") or a == "-mfsdp_shim" for a, b in zip(argv, [*argv[1:], ""]))


def deactivate() -> None:
    """Switch the shim off and put back the exact objects that were on Lightning's classes.

    A wrapper of the shim's that another library has wrapped since is switched off in place instead
    (a warning says so), so that library's patch stays intact.
    """
    global _active
    with _lock:
        _active = False
    integration = sys.modules.get("fsdp_shim.integration")
    if integration is not None:
        from fsdp_shim.backport import NAMESPACES

        for namespace in NAMESPACES:
            integration.unpatch(namespace)


def is_active() -> bool:
    return _active


def status() -> ShimStatus:
    """Per namespace: version, affected or not, patched or not, and why."""
    from fsdp_shim.report import collect_status

    return collect_status()


def _report_loaded_past_the_watcher(name: str, who: str, status: NamespaceStatus) -> None:
    """A finder in front of the shim's watcher loaded ``name`` itself (an instrumenting import hook):
    say so, naming it, whether or not the late patch worked; a failed one is an error in strict mode."""
    from fsdp_shim import failures

    remedy = "import fsdp_shim (or install that hook) so fsdp-shim's watcher comes first on sys.meta_path"
    if status.patched:
        failures.warn_once(
            f"fsdp-shim: {who} loaded {name} without fsdp-shim's import watcher seeing it, so it was patched "
            f"only then; a model FSDP wrapped before that keeps its dtype. To patch it at its import, {remedy}",
            key=f"missed:{name}",
        )
    else:
        failures.report(
            f"fsdp-shim: {who} loaded {name} without fsdp-shim's import watcher seeing it, and it could not be "
            f"patched then ({status.reason})",
            f"Lightning was left unchanged, so FSDP 'true' precisions keep the memory bug; {remedy}",
            key=f"missed:{name}",
        )


def _on_import(module: ModuleType) -> None:
    _patch_namespace(module.__name__)


def _patch_namespace(name: str) -> None:
    """Patch one namespace. Nothing escapes to the user's import except what they asked for: a
    strict-mode error, or a warning they turned into an error."""
    from fsdp_shim import failures

    try:
        if not _active or not shim_enabled():
            return
        from fsdp_shim import integration
        from fsdp_shim.backport import namespace_named

        status = integration.patch(namespace_named(name), activated_after_import=name in _imported_before_activation)
        who = startup.missed.get(name)
        if who is not None and status.affected:
            _report_loaded_past_the_watcher(name, who, status)
    except (FSDPShimError, Warning):
        raise
    except ImportError as error:  # the shim's own dependencies (wrapt, packaging) are missing
        failures.report(
            f"fsdp-shim: cannot patch {name}: {type(error).__name__}: {error}",
            "Lightning was left unchanged, so FSDP 'true' precisions keep the memory bug",
            key=f"import:{name}",
            cause=error,
        )
    except Exception as error:
        failures.report(
            f"fsdp-shim: internal error while patching {name} ({type(error).__name__}: {error})",
            "see fsdp_shim.status() for what is in effect",
            key=f"internal:{name}",
            cause=error,
        )
