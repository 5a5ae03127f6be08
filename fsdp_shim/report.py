"""The ``status()`` report: what the shim did in this process, in a form for people and for JSON."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from fsdp_shim import __version__
from fsdp_shim.activation import activation_sources, is_active
from fsdp_shim.environment_variables import FSDP_SHIM, FSDP_SHIM_STRICT
from fsdp_shim.integration import NAMESPACES, NamespaceStatus, current_status
from fsdp_shim.toggles import shim_enabled, strict_mode


@dataclass(frozen=True)
class ShimStatus:
    """Snapshot of the shim's state in this process."""

    shim_version: str
    enabled: bool
    strict: bool
    active: bool
    sources: tuple[str, ...]
    environment: dict[str, str | None]
    namespaces: tuple[NamespaceStatus, ...]

    def namespace(self, name: str) -> NamespaceStatus:
        for status in self.namespaces:
            if status.namespace == name:
                return status
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        state = "active" if self.active else ("switched off by FSDP_SHIM" if not self.enabled else "inactive")
        via = f" via {', '.join(self.sources)}" if self.sources else ""
        lines = [f"fsdp-shim {self.shim_version}: {state}{via}" + (" (strict)" if self.strict else "")]
        for status in self.namespaces:
            version = status.version or "-"
            lines.append(f"  {status.namespace:<18} {version:<10} {status.reason}")
        return "\n".join(lines)


def collect_status() -> ShimStatus:
    enabled = shim_enabled()
    namespaces = []
    for namespace in NAMESPACES:
        status = current_status(namespace)
        if not enabled and not status.patched:
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
