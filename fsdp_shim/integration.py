"""Patching one Lightning namespace: the ddtrace-style ``patch`` / ``unpatch`` / ``get_version``
contract, with the version and feature gates and the failure isolation around it.

Everything here runs inside import hooks, where an exception would make the user's
``import lightning`` fail. So every failure ends in one of two ways: a warning and an untouched
Lightning, or, in strict mode only, an :class:`~fsdp_shim.errors.FSDPShimError` naming the target
and the release.
"""

from __future__ import annotations

import gc
import importlib
import sys
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fsdp_shim import patching
from fsdp_shim.errors import FSDPShimError, FSDPShimWarning
from fsdp_shim.log import debug, info_on_rank_zero
from fsdp_shim.targets import NAMESPACES, PRECISION_CONVERT_MODULE, Namespace, PatchTarget, patch_plan
from fsdp_shim.toggles import strict_mode
from fsdp_shim.versions import FIRST_AFFECTED, base_release, is_affected_release

if TYPE_CHECKING:
    from collections.abc import Iterable


@dataclass(frozen=True)
class NamespaceStatus:
    """What the shim decided for one namespace, and why."""

    namespace: str
    imported: bool = False
    version: str | None = None
    affected: bool | None = None
    patched: bool = False
    reason: str = "not imported yet; it is checked when it is imported"
    targets: tuple[str, ...] = ()
    activated_after_import: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Record:
    status: NamespaceStatus
    installed: list[patching.InstalledWrapper] = field(default_factory=list)
    failed: bool = False
    """A target was missing or changed: warned once; later activations do not retry or warn again."""


_records: dict[str, _Record] = {ns.name: _Record(NamespaceStatus(ns.name)) for ns in NAMESPACES}


def namespace_named(name: str) -> Namespace:
    for namespace in NAMESPACES:
        if namespace.name == name:
            return namespace
    raise KeyError(name)


def get_version(namespace: Namespace) -> str | None:
    """The version of the *imported* namespace, read from the module rather than from package
    metadata, which can describe a different copy than the one on ``sys.path``."""
    module = sys.modules.get(namespace.name)
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) else None


def current_status(namespace: Namespace) -> NamespaceStatus:
    record = _records[namespace.name]
    if record.status.imported or namespace.name not in sys.modules:
        return record.status
    return replace(record.status, imported=True, version=get_version(namespace), reason="imported; not checked yet")


def _unaffected_reason(version: str) -> str:
    release = base_release(version)
    if release is None:
        return f"version {version!r} is not a PEP 440 version; left untouched"
    if release < FIRST_AFFECTED:
        return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"
    return f"Lightning {version} already contains the fix (Lightning #20323, 2.5.0); left untouched"


def _resolve_class(namespace: Namespace, target: PatchTarget) -> type:
    module = importlib.import_module(target.module_in(namespace))
    for class_name in target.class_names:
        owner = getattr(module, class_name, None)
        if isinstance(owner, type):
            return owner
    names = " or ".join(target.class_names)
    raise patching.TargetChanged(f"{target.module_in(namespace)} has no class {names}")


def _fail(namespace: Namespace, version: str, problem: str) -> NamespaceStatus:
    message = (
        f"fsdp-shim: cannot patch {namespace.name} {version}: {problem}. "
        "Lightning was left unchanged, so FSDP 'true' precisions keep the memory bug."
    )
    if strict_mode():
        raise FSDPShimError(message)
    warnings.warn(message, FSDPShimWarning, stacklevel=2)
    debug("%s", message)
    return NamespaceStatus(namespace.name, True, version, True, False, f"not patched: {problem}")


def patch(namespace: Namespace, *, activated_after_import: bool = False) -> NamespaceStatus:
    """Make an imported, affected namespace behave like Lightning 2.5.0; leave any other alone.

    Idempotent: a namespace already carrying the shim's wrappers is not wrapped a second time.
    """
    record = _records[namespace.name]
    if namespace.name not in sys.modules:
        return record.status
    if record.status.patched or record.failed:
        return record.status
    status = _patch(namespace)
    record.failed = status.affected is True and not status.patched
    if activated_after_import:
        status = replace(status, activated_after_import=True)
        if status.patched:
            _warn_about_models_already_wrapped(namespace)
    record.status = status
    return status


def _patch(namespace: Namespace) -> NamespaceStatus:
    record = _records[namespace.name]
    version = get_version(namespace)
    if version is None:
        return _fail(namespace, "(unknown version)", f"{namespace.name}.__version__ is missing")
    if not is_affected_release(version):
        reason = _unaffected_reason(version)
        debug("%s: %s", namespace.name, reason)
        return NamespaceStatus(namespace.name, True, version, False, False, reason)

    plan = patch_plan(namespace, version)
    resolved: list[tuple[type, Any, PatchTarget, str]] = []
    labels: list[str] = []
    try:
        for target in plan:
            owner = _resolve_class(namespace, target)
            own = owner.__dict__.get(target.attribute)
            label = target.describe(namespace, owner)
            labels.append(label)
            if patching.is_shim_wrapper(own):
                # Installed by an earlier copy of the shim's modules (a reload): take it over rather
                # than wrap the wrapper, so one deactivate() still restores Lightning's own objects.
                record.installed.append(patching.adopt(owner, target.attribute, target.inherited, own))
                continue
            if target is PRECISION_CONVERT_MODULE and own is not None:
                reason = f"{owner.__qualname__} defines convert_module itself (fixed in this build); left untouched"
                debug("%s: %s", namespace.name, reason)
                return NamespaceStatus(namespace.name, True, version, False, False, reason)
            function = patching.function_to_wrap(owner, target.attribute, target.inherited, label)
            resolved.append((owner, function, target, label))
    except (ImportError, patching.TargetChanged) as error:
        return _fail(namespace, version, str(error))

    try:
        for owner, function, target, label in resolved:
            record.installed.append(patching.install(owner, target.attribute, function, target.wrapper, label))
    except Exception as error:  # setattr on a class can fail (slots, metaclasses); undo what was done
        _remove_installed(record)
        return _fail(namespace, version, f"installing a wrapper failed ({type(error).__name__}: {error})")

    info_on_rank_zero(
        "fsdp-shim: patched %s %s so FSDP 'true' precisions cast the model as Lightning 2.5.0 does (%s)",
        namespace.name,
        version,
        ", ".join(labels),
    )
    return NamespaceStatus(namespace.name, True, version, True, True, "patched", tuple(labels))


def _remove_installed(record: _Record) -> bool:
    """Remove wrappers newest first; ``False`` if any had been replaced by someone else."""
    all_removed = True
    while record.installed:
        all_removed = record.installed.pop().remove() and all_removed
    return all_removed


def unpatch(namespace: Namespace) -> NamespaceStatus:
    """Put back the exact objects Lightning shipped on this namespace's classes."""
    record = _records[namespace.name]
    if not record.installed:
        return record.status
    if not _remove_installed(record):
        warnings.warn(
            f"fsdp-shim: a wrapper on {namespace.name} was replaced by other code after the shim "
            "installed it; that attribute was left as it is.",
            FSDPShimWarning,
            stacklevel=2,
        )
    record.status = replace(record.status, patched=False, targets=(), reason="deactivated")
    return record.status


def _warn_about_models_already_wrapped(namespace: Namespace) -> None:
    """Tell the user if FSDP wrapped a model before the shim arrived: that model keeps its dtype.

    The methods live on the classes, so every strategy and plugin instance, old or new, uses the fix
    from its next ``setup`` on; only parameters FSDP already flattened cannot change.
    """
    count = sum(1 for obj in _instances_of(_wrapped_model_holders(namespace)) if _holds_fsdp_model(obj))
    if count:
        warnings.warn(
            f"fsdp-shim was activated after {namespace.name} had already set up {count} FSDP model(s); "
            "their parameters keep the dtype they were wrapped with. The fix applies from the next "
            "setup on. Import fsdp_shim before Lightning, or use `fsdp-shim run` or the start-up file.",
            FSDPShimWarning,
            stacklevel=3,
        )


def _wrapped_model_holders(namespace: Namespace) -> tuple[type, ...]:
    names = ("strategies.fsdp", "FSDPStrategy") if namespace.kind == "trainer" else ("wrappers", "_FabricModule")
    module = sys.modules.get(f"{namespace.name}.{names[0]}")
    holder = getattr(module, names[1], None)
    return (holder,) if isinstance(holder, type) else ()


def _instances_of(classes: tuple[type, ...]) -> Iterable[object]:
    if not classes:
        return ()
    # type(), not isinstance(): isinstance reads __class__, which some module-level proxies (torch's
    # deprecated aliases) answer with a FutureWarning.
    return (obj for obj in gc.get_objects() if issubclass(type(obj), classes))


def _holds_fsdp_model(holder: object) -> bool:
    model = getattr(holder, "_model", None)  # Trainer strategy
    if model is None:
        model = getattr(holder, "_forward_module", None)  # Fabric's module wrapper
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_class = getattr(fsdp, "FullyShardedDataParallel", None)
    return isinstance(fsdp_class, type) and isinstance(model, fsdp_class)
