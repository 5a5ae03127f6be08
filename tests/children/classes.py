"""Read Lightning's classes directly, never the shim's bookkeeping: what is on them, and what changed.

Importing this module imports neither Lightning nor fsdp_shim (``_fsdp_shim``, the start-up module,
activates nothing): each child decides its own import order.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
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
    ("strategies.fsdp", ("FSDPStrategy",), ("setup", "connect", "_setup_model", "setup_module", "setup_environment")),
)
SHARED_MODULE = "torch.utils.checkpoint"
COMPOSABLE_MODULE = "torch.distributed._composable.checkpoint_activation"
GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


def checkpoint_generator() -> str:
    """The non-reentrant generator the torch in hand calls: the newest of its names that it defines."""
    checkpoint = importlib.import_module(SHARED_MODULE)
    return next(name for name in GENERATORS if name in vars(checkpoint))


def shared_targets() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """torch's checkpoint entry points the recompute fix wraps (one wrapper for every namespace), as
    ``(module, class, attributes)``, keyed ``module:Class.attribute`` or ``module:function``: the non-reentrant
    generator torch's ``checkpoint`` calls (the newest name it defines) in ``torch.utils.checkpoint`` and in the
    composable checkpoint's module, which imports it by name; the class's ``backward`` is there to prove it
    stays untouched."""
    generator = checkpoint_generator()
    return (
        (SHARED_MODULE, "CheckpointFunction", ("forward", "backward")),
        (SHARED_MODULE, "", (generator,)),
        (COMPOSABLE_MODULE, "", (generator,)),
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
    (``MISSING`` where the class inherits it), keyed ``namespace:Class.attribute``; once torch is
    imported, also torch's checkpoint entry points (``shared_targets``), the objects in the class or
    module dict (a staticmethod is the staticmethod object itself)."""
    out = {}
    if "torch" in sys.modules:
        for module_name, class_name, attributes in shared_targets():
            module = importlib.import_module(module_name)
            owner = module.__dict__[class_name] if class_name else module
            for attribute in attributes:
                name = ".".join(filter(None, (class_name, attribute)))
                out[f"{module_name}:{name}"] = owner.__dict__.get(attribute, MISSING)
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
    """Per key: is it what Lightning (or torch) ships, i.e. inherited (nothing in the class dict), or a
    plain function of that namespace or module, or a ``staticmethod`` of one? A wrapt proxy of either
    is neither."""

    def ships(key: str, obj: Any) -> bool:
        if obj is MISSING:
            return True
        if type(obj) is staticmethod:
            obj = obj.__func__
        home = key.partition(":")[0]
        home = "torch" if home.startswith("torch.") else home  # the composable module holds torch.utils.checkpoint's
        return type(obj) is types.FunctionType and (obj.__module__ == home or obj.__module__.startswith(home + "."))

    return {key: ships(key, obj) for key, obj in objects.items()}


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


def recompute_dtype(
    reentrant: bool, forward_dtype: str = "torch.bfloat16", backward_dtype: str = "torch.float32"
) -> str:
    """The default dtype a checkpointed block sees in its recompute, when its forward runs with the
    default dtype ``forward_dtype`` (what Lightning's "true" precisions set around the forward) and
    the backward with ``backward_dtype`` (what they leave outside it): the forward's with the recompute
    fix, the backward's without it. ``reentrant`` picks ``CheckpointFunction`` or the generator.

    The block records the dtype as its FIRST statement: a non-reentrant recompute stops as soon as it
    has recomputed every tensor the backward needs (``torch.sin`` saves its input), so a record after
    that would never be made."""
    import torch
    from torch.utils.checkpoint import checkpoint

    seen: list[torch.dtype] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_default_dtype())
        return torch.sin(x)

    x = torch.ones(2, dtype=torch.float32, requires_grad=True)
    with default_dtype(forward_dtype):
        out = checkpoint(block, x, use_reentrant=reentrant)
    with default_dtype(backward_dtype):
        out.sum().backward()
    forward, recompute = seen  # one forward, one recompute
    assert str(forward) == forward_dtype, (forward, forward_dtype)
    return str(recompute)


def recompute_dtypes(forward_dtype: str = "torch.bfloat16", backward_dtype: str = "torch.float32") -> dict[str, str]:
    """``recompute_dtype`` for both kinds of checkpoint: ``{"reentrant": ..., "non_reentrant": ...}``."""
    return {
        "reentrant": recompute_dtype(True, forward_dtype, backward_dtype),
        "non_reentrant": recompute_dtype(False, forward_dtype, backward_dtype),
    }


@contextlib.contextmanager
def default_dtype(name: str) -> Iterator[None]:
    """The default dtype ``name`` (``"torch.bfloat16"``) inside, as Lightning's ``_DtypeContextManager``
    sets it; nothing is called where it is the default dtype already."""
    import torch

    dtype = getattr(torch, name.removeprefix("torch."))
    previous = torch.get_default_dtype()
    if dtype == previous:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
