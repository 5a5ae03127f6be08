"""Lightning removed from ``sys.modules`` and imported again, as test frameworks and reloaders do:
the new classes must be patched, and ``status()`` must describe them, not the old ones."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from children.classes import (
    PACKAGES,
    converted_dtype,
    import_all,
    precision_class,
    recompute_dtypes,
    snapshot,
    statuses,
    wrappers,
)


def forget(prefix: str) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            del sys.modules[name]


def _torch_objects() -> dict[str, Any]:
    return {key: obj for key, obj in snapshot().items() if key.startswith("torch.")}


def _facts(namespace: str, torch_before: dict[str, Any]) -> dict[str, Any]:
    """What a bf16-true plugin of the classes in ``sys.modules`` now does, what a checkpoint recomputes
    in, which attributes hold the shim's wrappers, whether torch's are the very objects they were, and
    what status says."""
    return {
        "convert_dtype": converted_dtype(precision_class(namespace)),
        "recompute_dtypes": recompute_dtypes(),
        "wrappers": wrappers(),
        "same_torch_wrappers": all(obj is torch_before[key] for key, obj in _torch_objects().items()),
        "status": statuses()[namespace],
    }


def import_again(namespace: str) -> dict[str, Any]:
    """Every Lightning package imported, forgotten and imported again (new classes); then only the
    module that holds the FSDP precision class, then the one that holds the FSDP strategy too: the
    namespace does not execute again, so nothing patches those new classes until ``activate()``, and
    ``status()`` must say so meanwhile, per fix (torch is never imported again: its wrappers stay)."""
    import fsdp_shim

    import_all()
    first = precision_class(namespace)
    first_wrappers = wrappers()
    torch_before = _torch_objects()
    for package in PACKAGES:
        forget(package)
    import_all()
    out: dict[str, Any] = {
        "new_class": precision_class(namespace) is not first,
        "first_wrappers": first_wrappers,
        **_facts(namespace, torch_before),
    }
    forget(f"{namespace}.plugins.precision.fsdp")
    importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    out["one_module"] = {"new_class": precision_class(namespace) is not first, **_facts(namespace, torch_before)}
    strategy = importlib.import_module(f"{namespace}.strategies.fsdp").FSDPStrategy
    forget(f"{namespace}.strategies.fsdp")
    importlib.import_module(f"{namespace}.strategies.fsdp")
    out["two_modules"] = {
        "new_class": importlib.import_module(f"{namespace}.strategies.fsdp").FSDPStrategy is not strategy,
        **_facts(namespace, torch_before),
    }
    fsdp_shim.activate()
    out["after_activate"] = _facts(namespace, torch_before)
    return out
