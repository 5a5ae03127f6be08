"""Read Lightning's classes directly, never the shim's bookkeeping: what is on them, and what changed.

Importing this module imports neither Lightning nor fsdp_shim (``_fsdp_shim``, the start-up module,
activates nothing): each child decides its own import order.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from _fsdp_shim import NAMESPACES as NAMESPACE_KINDS

MISSING = "<missing>"
NAMESPACES = tuple(NAMESPACE_KINDS)
PACKAGES = tuple(dict.fromkeys(name.partition(".")[0] for name in NAMESPACES))
# Every class attribute either fix could touch, on every class of that family a release has: 2.0.x's
# Trainer class is FSDPMixedPrecisionPlugin, 2.1.0's FSDPPrecisionPlugin / HalfPrecisionPlugin, and 2.2+
# keeps those names as deprecated *subclasses*; all are snapshotted, to prove which is touched and which not.
TARGETS = (
    (
        "plugins.precision.fsdp",
        ("FSDPPrecision", "FSDPPrecisionPlugin", "FSDPMixedPrecisionPlugin"),
        ("convert_module", "backward"),
    ),
    ("plugins.precision.half", ("HalfPrecision", "HalfPrecisionPlugin"), ("backward",)),
    ("strategies.fsdp", ("FSDPStrategy",), ("setup", "connect", "_setup_model", "setup_module")),
)


def import_all() -> list[str]:
    """Import every Lightning package this environment has, in the table's order."""
    imported = []
    for name in PACKAGES:
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError:
            pass
    return imported


def snapshot() -> dict[str, Any]:
    """Every class attribute the shim could touch in the imported namespaces, as the objects themselves
    (``MISSING`` where the class inherits it), keyed ``namespace:Class.attribute``."""
    out = {}
    for namespace in NAMESPACES:
        if namespace not in sys.modules:
            continue
        for module_name, classes, attributes in TARGETS:
            try:
                module = importlib.import_module(f"{namespace}.{module_name}")
            except ImportError:  # 2.0.x has no half-precision module
                continue
            seen: set[int] = set()  # 2.1.1-2.1.4 keep FSDPPrecisionPlugin as an alias: one class, one entry
            for class_name in classes:
                cls = module.__dict__.get(class_name)
                if isinstance(cls, type) and id(cls) not in seen:
                    seen.add(id(cls))
                    for attribute in attributes:
                        out[f"{namespace}:{class_name}.{attribute}"] = cls.__dict__.get(attribute, MISSING)
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The keys whose object is not the very same one."""
    return sorted(key for key in set(before) | set(after) if before.get(key) is not after.get(key))


def as_shipped(objects: dict[str, Any]) -> dict[str, bool]:
    """Per key: is it what Lightning ships, i.e. inherited (nothing in the class dict) or a plain
    function of that namespace? A wrapt proxy of a function is neither."""
    return {
        key: obj is MISSING
        or (type(obj) is types.FunctionType and obj.__module__.startswith(key.partition(":")[0] + "."))
        for key, obj in objects.items()
    }


def wrappers() -> list[str]:
    """Keys whose class attribute is itself a wrapper of the shim's."""
    from _fsdp_shim.wrappers import is_shim_wrapper

    return sorted(key for key, obj in snapshot().items() if is_shim_wrapper(obj))


def layers() -> dict[str, int]:
    """Per key, how many wrappers of the shim's are stacked there (through ``__wrapped__``)."""
    from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain

    return {key: sum(is_shim_wrapper(layer) for layer in wrapper_chain(obj)) for key, obj in snapshot().items()}


def statuses() -> dict[str, dict[str, Any]]:
    """``fsdp_shim.status()`` per namespace, as dicts (``fixes`` a list of dicts, in the order of FIXES)."""
    from _fsdp_shim.activation import status

    return {s.namespace: s.as_dict() for s in status().namespaces}


def precision_class(namespace: str, kind: str = "fsdp") -> type:
    """The namespace's FSDP (``kind="fsdp"``) or half (``"half"``) "true"-precision class: the new name
    where the release has it (2.1.1 on), else 2.1.0's."""
    name = {"fsdp": "FSDPPrecision", "half": "HalfPrecision"}[kind]
    module = importlib.import_module(f"{namespace}.plugins.precision.{kind}")
    return module.__dict__.get(name) or module.__dict__[name + "Plugin"]


def shim_warnings(caught: list[Any]) -> list[str]:
    return [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"]


def converted_dtype(plugin_class: type, precision: str = "bf16-true") -> str:
    """The weight dtype ``convert_module`` of a new plugin gives a float32 layer."""
    import torch

    return str(plugin_class(precision=precision).convert_module(torch.nn.Linear(2, 2)).weight.dtype)


def backward_dtype(plugin: Any) -> str:
    """The default dtype the autograd engine sees while ``plugin.backward`` runs (what a checkpointed
    block that makes a tensor without an explicit dtype gets in its recompute)."""
    import torch

    seen: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
            return tensor.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(str(torch.get_default_dtype()))
            return grad

    loss = Probe.apply(torch.ones(2, requires_grad=True)).sum()
    namespace = next(  # of the Lightning class it is or derives from
        name for cls in type(plugin).__mro__ for name in NAMESPACES if cls.__module__.startswith(name + ".")
    )
    if NAMESPACE_KINDS[namespace] == "trainer":  # Trainer: backward(tensor, model, optimizer) -> model.backward
        plugin.backward(loss, importlib.import_module(namespace).LightningModule(), None)
    else:
        plugin.backward(loss, None)
    [dtype] = seen
    return dtype
