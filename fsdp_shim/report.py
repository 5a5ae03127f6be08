"""The ``status()`` report: what the shim did in this process, for people and for JSON."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

import _fsdp_shim_startup as startup
from fsdp_shim import __version__
from fsdp_shim.activation import is_active
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT
from fsdp_shim.toggles import shim_enabled, strict_mode

NOT_IMPORTED = "not imported yet; it is checked when it is imported"


@dataclass(frozen=True)
class NamespaceStatus:
    """What the shim decided for one Lightning namespace, and why."""

    namespace: str
    """``lightning.pytorch``, ``lightning.fabric``, ``pytorch_lightning`` or ``lightning_fabric``."""
    imported: bool = False
    """Whether this process has imported it (a namespace is checked when it is imported)."""
    version: str | None = None
    """Its ``__version__``, read from the imported module."""
    affected: bool | None = None
    """Whether the release lacks Lightning's fix (2.1.0–2.4.x); ``None`` when it cannot be told."""
    patched: bool = False
    """Whether the fix is in effect now, read from the classes: ``False`` after ``deactivate()``, when
    another library replaced the shim's wrapper, or when a call had to fall back."""
    reason: str = NOT_IMPORTED
    """The decision in words: ``patched`` (with notes about other wrappers), ``not patched: ...``,
    ``deactivated``, or why the release needs nothing."""
    targets: tuple[str, ...] = ()
    """The methods the shim wrapped, as ``module.Class.method``."""
    activated_after_import: bool = False
    """Whether the shim arrived after this namespace was imported (models already wrapped keep their dtype)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict, for logs and JSON."""
        return asdict(self)


@dataclass(frozen=True)
class ShimStatus:
    """Snapshot of the shim's state in this process (``fsdp_shim.status()``)."""

    shim_version: str
    """The installed fsdp-shim version."""
    enabled: bool
    """Whether ``FSDP_SHIM`` leaves the shim on."""
    strict: bool
    """Whether ``FSDP_SHIM_STRICT`` is on."""
    active: bool
    """Whether the shim is activated in this process (and not deactivated)."""
    sources: tuple[str, ...]
    """How it was armed: ``import fsdp_shim``, ``startup file``, ``fsdp-shim run``."""
    environment: dict[str, str | None]
    """The raw values of ``FSDP_SHIM`` and ``FSDP_SHIM_STRICT``."""
    namespaces: tuple[NamespaceStatus, ...]
    """One entry per Lightning namespace, imported or not."""

    def namespace(self, name: str) -> NamespaceStatus:
        """The entry for one namespace, e.g. ``status().namespace("lightning.pytorch")``."""
        for status in self.namespaces:
            if status.namespace == name:
                return status
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """The whole report as a dict, for logs and JSON."""
        return asdict(self)

    def __str__(self) -> str:
        state = "active" if self.active else ("switched off by FSDP_SHIM" if not self.enabled else "inactive")
        via = f" via {', '.join(self.sources)}" if self.sources else ""
        lines = [f"fsdp-shim {self.shim_version}: {state}{via}" + (" (strict)" if self.strict else "")]
        for status in self.namespaces:
            version = status.version or "-"
            lines.append(f"  {status.namespace:<18} {version:<10} {status.reason}")
        return "\n".join(lines)


def activation_sources() -> tuple[str, ...]:
    """How the shim was armed: the start-up hooks record themselves; anything else was a plain
    ``import fsdp_shim``."""
    return tuple(startup.sources) or ("import fsdp_shim",)


def namespace_statuses() -> tuple[NamespaceStatus, ...]:
    names = [name for name, _ in startup.LIGHTNING_NAMESPACES]
    try:
        from fsdp_shim import integration
        from fsdp_shim.backport import namespace_named
    except ImportError as error:  # its patching code cannot load (wrapt missing): nothing was patched
        reason = f"not patched: fsdp-shim's patching code cannot be imported ({error})"
        return tuple(
            NamespaceStatus(
                namespace=name, imported=name in sys.modules, reason=reason if name in sys.modules else NOT_IMPORTED
            )
            for name in names
        )
    return tuple(integration.current_status(namespace_named(name)) for name in names)


def collect_status() -> ShimStatus:
    enabled = shim_enabled()
    namespaces = []
    for status in namespace_statuses():
        if not enabled and not status.patched and status.imported:
            status = replace(status, reason=f"switched off by {FSDP_SHIM}={os.environ.get(FSDP_SHIM, '')!r}")
        namespaces.append(status)
    return ShimStatus(
        shim_version=__version__,
        enabled=enabled,
        strict=strict_mode(),
        active=is_active(),
        sources=activation_sources(),
        environment={name: os.environ.get(name) for name in (FSDP_SHIM, FSDP_SHIM_STRICT)},
        namespaces=tuple(namespaces),
    )
