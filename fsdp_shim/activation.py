"""``activate`` / ``deactivate`` / ``status`` and the ``FSDP_SHIM`` switch: the shim on and off in this
process.

Activation registers one hook per Lightning namespace with the start-up module's import watcher
(``_fsdp_shim_startup.when_imported``): it runs at once for a namespace already imported, and
otherwise right after the namespace's ``__init__`` has executed (its strategies and plugins are then
imported). The patching code itself (wrapt, ``packaging``, ``logging``) loads only when a hook runs.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import _fsdp_shim_startup as startup
from fsdp_shim import failures
from fsdp_shim._version import __version__
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT
from fsdp_shim.errors import FSDPShimError
from fsdp_shim.report import NOT_IMPORTED, NamespaceStatus, ShimStatus

if TYPE_CHECKING:
    from types import ModuleType

_NAMESPACE_NAMES = tuple(name for name, _ in startup.LIGHTNING_NAMESPACES)

_lock = threading.Lock()  # guards the three globals below; never held while patching or importing
_active = False
_hooks_registered = False
_imported_before_activation: set[str] = set()


def shim_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim on. Read at activation and again at every Lightning
    import, so a value a script sets before importing Lightning takes effect. An unrecognised value
    is off: the operator's kill switch fails closed."""
    meaning = "switched the shim OFF (an unreadable kill switch fails closed)"
    return failures.read_switch(FSDP_SHIM, environ, meaning) in ("on", "unset")


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
    enabled = shim_enabled()
    namespaces = []
    for record in _namespace_statuses():
        if not enabled and not record.patched and record.imported:
            record = replace(record, reason=f"switched off by {FSDP_SHIM}={os.environ.get(FSDP_SHIM, '')!r}")
        namespaces.append(record)
    return ShimStatus(
        shim_version=__version__,
        enabled=enabled,
        strict=failures.strict_mode(),
        active=is_active(),
        sources=tuple(startup.sources) or ("import fsdp_shim",),  # start-up hooks record themselves
        environment={name: os.environ.get(name) for name in (FSDP_SHIM, FSDP_SHIM_STRICT)},
        namespaces=tuple(namespaces),
    )


def _namespace_statuses() -> tuple[NamespaceStatus, ...]:
    try:
        from fsdp_shim import integration
        from fsdp_shim.backport import namespace_named
    except ImportError as error:  # its patching code cannot load (wrapt missing): nothing was patched
        reason = f"not patched: fsdp-shim's patching code cannot be imported ({error})"
        return tuple(
            NamespaceStatus(name, imported=name in sys.modules, reason=reason if name in sys.modules else NOT_IMPORTED)
            for name in _NAMESPACE_NAMES
        )
    return tuple(integration.current_status(namespace_named(name)) for name in _NAMESPACE_NAMES)


def _report_loaded_past_the_watcher(name: str, who: str, status: NamespaceStatus) -> None:
    """A finder in front of the shim's watcher loaded ``name`` itself (an instrumenting import hook):
    say so, naming it, whether or not the late patch worked; a failed one is an error in strict mode."""
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
