"""The records ``status()`` returns: what the shim did in this process, for people and for JSON.

Records only, importing nothing of the package's, so the code that fills them
(``fsdp_shim.activation.status``, ``fsdp_shim.integration``) and the code that reads them depend on
this module and never on each other."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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
