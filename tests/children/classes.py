"""Read Lightning's classes directly, never the shim's bookkeeping: what is on them, and what changed."""

from __future__ import annotations

import importlib
import sys
from typing import Any

MISSING = "<missing>"
NAMESPACES = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
# 2.0.x's Trainer class is FSDPMixedPrecisionPlugin, and 2.2+ keeps FSDPPrecisionPlugin as a deprecated
# subclass: all of them are snapshotted, to prove which one is touched and which is not.
TARGETS = (
    (
        "plugins.precision.fsdp",
        ("FSDPPrecision", "FSDPPrecisionPlugin", "FSDPMixedPrecisionPlugin"),
        ("convert_module",),
    ),
    ("strategies.fsdp", ("FSDPStrategy",), ("setup", "connect")),
)


def import_all() -> list[str]:
    imported = []
    for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError:
            pass
    return imported


def snapshot() -> dict[str, Any]:
    """Every class attribute the shim could touch, as the objects themselves."""
    out = {}
    for namespace in NAMESPACES:
        if namespace not in sys.modules:
            continue
        for module_name, classes, attributes in TARGETS:
            module = importlib.import_module(f"{namespace}.{module_name}")
            seen: set[int] = set()  # 2.1.1-2.1.4 keep FSDPPrecisionPlugin as an alias: one class, one entry
            for class_name in classes:
                cls = getattr(module, class_name, None)
                if isinstance(cls, type) and id(cls) not in seen:
                    seen.add(id(cls))
                    for attribute in attributes:
                        out[f"{namespace}:{class_name}.{attribute}"] = cls.__dict__.get(attribute, MISSING)
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(key for key in set(before) | set(after) if before.get(key) is not after.get(key))


def wrappers() -> list[str]:
    """Keys whose class attribute is itself a shim wrapper."""
    from fsdp_shim.patching import is_shim_wrapper

    return sorted(key for key, obj in snapshot().items() if is_shim_wrapper(obj))


def statuses() -> dict[str, dict[str, Any]]:
    import fsdp_shim

    return {s.namespace: s.as_dict() for s in fsdp_shim.status().namespaces}


def precision_class(namespace: str) -> type:
    module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    return getattr(module, "FSDPPrecision", None) or module.FSDPPrecisionPlugin


def shim_warnings(caught: list[Any]) -> list[str]:
    return [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"]
