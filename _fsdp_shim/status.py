"""The records ``fsdp_shim.status()`` returns: what the shim did in this process, per Lightning
namespace and per fix, for people (``str()``) and for JSON (``as_dict()``). Records only: the code
that fills them and the code that reads them depend on this module, never on each other."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NOT_IMPORTED = "not imported yet; it is checked when it is imported"
NOT_NEEDED_ON_TORCH = "not needed on torch "
"""How a fix's reason starts where the running torch has the fix itself (``recompute_check.restored_by_torch``)."""


@dataclass(frozen=True)
class FixStatus:
    """What the shim decided for one fix in one namespace, and why."""

    fix: str
    """``cast`` or ``recompute`` (docs/configuration.md: ``FSDP_SHIM_DISABLED_FIXES``)."""
    affected: bool | None = None
    """Whether the release lacks this fix; ``None`` when it cannot be told (or not imported)."""
    patched: bool = False
    """Whether the shim's fix is in effect now, read from the classes."""
    reason: str = NOT_IMPORTED
    """``patched`` (with notes about other wrappers), ``not patched: ...``, ``deactivated``,
    ``switched off by ...``, or why the release needs nothing."""
    targets: tuple[str, ...] = ()
    """The functions the shim wrapped for it, as ``module.Class.method`` (or ``module.function``)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NamespaceStatus:
    """What the shim decided for one Lightning namespace, and why: one ``FixStatus`` per fix, and their summary."""

    namespace: str
    """``lightning.pytorch``, ``lightning.fabric``, ``pytorch_lightning`` or ``lightning_fabric``."""
    imported: bool = False
    """Whether this process has imported it (a namespace is checked when it is imported)."""
    version: str | None = None
    """Its ``__version__``, read from the imported module."""
    affected: bool | None = None
    """Whether the release lacks any of the shim's fixes; ``None`` when it cannot be told."""
    patched: bool = False
    """Whether every fix the release lacks, except those ``FSDP_SHIM_DISABLED_FIXES`` switches off, is
    in effect now (and at least one is), read from the classes: ``False`` after ``deactivate()``, when
    every fix the release lacks is switched off, when another library replaced the shim's wrapper, or
    when a call had to fall back."""
    reason: str = NOT_IMPORTED
    """The decision in words: ``patched`` or, per fix, what keeps it from being patched."""
    targets: tuple[str, ...] = ()
    """The methods the shim wrapped, as ``module.Class.method``."""
    activated_after_import: bool = False
    """Whether the shim arrived after this namespace was imported (models already wrapped keep their dtype)."""
    fixes: tuple[FixStatus, ...] = ()
    """One entry per fix, in the order of ``_fsdp_shim.config.FIXES``."""

    def fix(self, name: str) -> FixStatus:
        """The entry for one fix, e.g. ``status().namespace("lightning.pytorch").fix("recompute")``."""
        return {status.fix: status for status in self.fixes}[name]

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
    """How it was armed: ``import fsdp_shim``, ``startup file``, ``fsdp-shim run``, ``FSDP_SHIM=1 ...``."""
    environment: dict[str, str | None]
    """The raw values of the shim's environment variables."""
    namespaces: tuple[NamespaceStatus, ...]
    """One entry per Lightning namespace, imported or not."""
    disabled_fixes: tuple[str, ...] = ()
    """The fixes ``FSDP_SHIM_DISABLED_FIXES`` switches off."""

    def namespace(self, name: str) -> NamespaceStatus:
        """The entry for one namespace, e.g. ``status().namespace("lightning.pytorch")``."""
        return {status.namespace: status for status in self.namespaces}[name]

    def as_dict(self) -> dict[str, Any]:
        """The whole report as a dict, for logs and JSON."""
        return asdict(self)

    def __str__(self) -> str:
        state = "active" if self.active else "inactive"
        if not self.enabled:
            kept = " (what it patched before stays patched; fsdp_shim.deactivate() removes it)"
            state = "switched off by FSDP_SHIM" + (kept if self.active else "")
        via = f" via {', '.join(self.sources)}" if self.sources and self.enabled else ""
        lines = [f"fsdp-shim {self.shim_version}: {state}{via}" + (" (strict)" if self.strict else "")]
        if self.disabled_fixes:
            lines.append(f"  fixes switched off: {', '.join(self.disabled_fixes)}")
        for status in self.namespaces:
            lines.append(f"  {status.namespace:<18} {status.version or '-':<10} {status.reason}")
            if status.imported:
                lines += [f"    {fix.fix:<10} {fix.reason}" for fix in status.fixes]
        return "\n".join(lines)
