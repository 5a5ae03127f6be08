"""Read Lightning's and torch's classes directly, never the shim's bookkeeping, and the literal table of what
the shim must wrap per Lightning release. Importing this module imports neither Lightning nor fsdp_shim."""

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
TARGETS = (
    (
        "plugins.precision.fsdp",
        ("FSDPPrecision", "FSDPPrecisionPlugin", "FSDPMixedPrecisionPlugin"),
        ("convert_module",),
    ),
    ("strategies.fsdp", ("FSDPStrategy",), ("setup", "connect", "_setup_model", "setup_module", "setup_environment")),
    ("strategies.ddp", ("DDPStrategy",), ("setup_environment",)),
    ("strategies.model_parallel", ("ModelParallelStrategy",), ("setup_environment",)),
)
"""Every class attribute a fix could touch, on every class of that family (2.2+ keeps the old names as deprecated
subclasses: all are read, to show which is touched and which not)."""
COMPOSABLE_MODULE = "torch.distributed._composable.checkpoint_activation"
GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
TORCH_KEYS = (
    "torch.utils.checkpoint:CheckpointFunction.forward",
    "torch.utils.checkpoint:generator",
    f"{COMPOSABLE_MODULE}:generator",
)
"""torch's checkpoint entry points (``generator``: the non-reentrant generator the torch in hand calls), one
wrapper for every namespace that needs the recompute fix."""
RENDEZVOUS_KEY = "torch.distributed.distributed_c10d:rendezvous"
"""Where a rank says it has the shim (the rank check's), one wrapper for every namespace."""

# ----------------------------------------------------------------------------- what each release must get
CAST_2_1_TRAINER = ["FSDPStrategy._setup_model", "FSDPStrategy.connect", "FSDPStrategy.setup"]
CAST_WRAPS = {
    "2.1.0": {"trainer": ["FSDPPrecisionPlugin.convert_module", *CAST_2_1_TRAINER]},
    "2.1.4": {"trainer": ["FSDPPrecision.convert_module", *CAST_2_1_TRAINER]},
    "2.2.5": {"trainer": ["FSDPPrecision.convert_module", "FSDPStrategy._setup_model"]},
    "2.3.3": {"trainer": ["FSDPPrecision.convert_module", "FSDPStrategy._setup_model"]},
    "2.4.0": {"trainer": ["FSDPPrecision.convert_module", "FSDPStrategy._setup_model"]},
}
WITH_MODEL_PARALLEL = ("2.3.3", "2.4.0", "2.5.0", "2.6.6")  # ModelParallelStrategy: Lightning 2.3 on
RANK_CHECK_WRAPS = ["FSDPStrategy.setup_environment", "DDPStrategy.setup_environment"]
for _release in CAST_WRAPS.values():
    _release["fabric"] = ["FSDPPrecision.convert_module", "FSDPStrategy.setup_module"]
STATES = {  # release: (cast, recompute), as status says them
    "2.0.9": ("not affected", "not affected"),
    **{release: ("patched", "patched") for release in CAST_WRAPS},
    "2.5.0": ("built in", "patched"),
    "2.6.6": ("built in", "patched"),
}
"""The matrix's Lightning releases (noxfile.py): the cast on 2.1-2.4, the recompute on 2.1 and later."""


def release(version: str) -> str:
    if version not in STATES:
        raise AssertionError(f"Lightning {version} is not in the literal table of tests/children/classes.py")
    return version


def expected_wrappers(versions: dict[str, str], without: tuple[str, ...] = ()) -> list[str]:
    """The snapshot keys the shim wraps in a process that imported these namespaces (``without``: fixes off)."""
    keys: set[str] = set()
    for namespace, version in versions.items():
        if STATES[release(version)][0] == "patched" and "cast" not in without:
            keys.update(f"{namespace}:{key}" for key in CAST_WRAPS[version][NAMESPACE_KINDS[namespace]])
        if version != "2.0.9":  # the rank check, never switched off
            parallel = ["ModelParallelStrategy.setup_environment"] if version in WITH_MODEL_PARALLEL else []
            keys.update(f"{namespace}:{key}" for key in [*RANK_CHECK_WRAPS, *parallel])
            keys.add(RENDEZVOUS_KEY)
            keys.update(TORCH_KEYS if "recompute" not in without else ())
    return sorted(keys)


# ----------------------------------------------------------------------------- reading the classes
def import_all() -> list[str]:
    """Import every Lightning package this environment has."""
    imported = []
    for name in PACKAGES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
            imported.append(name)
    return imported


def versions() -> dict[str, str]:
    return {name: sys.modules[name].__version__ for name in NAMESPACES if name in sys.modules}


def checkpoint_generator() -> str:
    checkpoint = importlib.import_module("torch.utils.checkpoint")
    return next(name for name in GENERATORS if name in vars(checkpoint))


def snapshot() -> dict[str, Any]:
    """Every attribute the shim could touch in the imported namespaces and torch, the objects in the class or
    module dict themselves (``MISSING`` where inherited), keyed ``namespace:Class.attribute``."""
    out = {}
    if "torch" in sys.modules:
        checkpoint, generator = importlib.import_module("torch.utils.checkpoint"), checkpoint_generator()
        out[TORCH_KEYS[0]] = checkpoint.CheckpointFunction.__dict__["forward"]
        out[TORCH_KEYS[1]] = checkpoint.__dict__[generator]
        out[TORCH_KEYS[2]] = importlib.import_module(COMPOSABLE_MODULE).__dict__[generator]
        out[RENDEZVOUS_KEY] = importlib.import_module("torch.distributed.distributed_c10d").__dict__["rendezvous"]
    for namespace in NAMESPACES:
        if namespace not in sys.modules:
            continue
        for module_name, classes, attributes in TARGETS:
            try:
                module = importlib.import_module(f"{namespace}.{module_name}")
            except ModuleNotFoundError:  # ModelParallelStrategy before Lightning 2.3
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


def as_shipped(objects: dict[str, Any]) -> bool:
    """Whether every object is what Lightning or torch ships: inherited, or a plain function (or staticmethod
    of one) of that namespace or module; a wrapt proxy is neither."""

    def ships(key: str, obj: Any) -> bool:
        obj = obj.__func__ if type(obj) is staticmethod else obj
        home = key.partition(":")[0]
        home = "torch" if home.startswith("torch.") else home
        return obj is MISSING or (type(obj) is types.FunctionType and obj.__module__.startswith(home))

    return all(ships(key, obj) for key, obj in objects.items())


def wrappers() -> list[str]:
    """Keys whose attribute is itself a wrapper of the shim's."""
    from _fsdp_shim.wrappers import is_shim_wrapper

    return sorted(key for key, obj in snapshot().items() if is_shim_wrapper(obj))


def layers() -> dict[str, int]:
    """Per key, how many wrappers of the shim's are stacked there."""
    from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain

    return {key: sum(map(is_shim_wrapper, wrapper_chain(obj))) for key, obj in snapshot().items()}


def statuses() -> dict[str, dict[str, Any]]:
    """``fsdp_shim.status()`` per imported namespace: ``patched``, ``activated_after_import`` and per fix
    ``[state, detail]``."""
    from _fsdp_shim.activation import status

    return {
        s.namespace: {
            "patched": s.patched,
            "late": s.activated_after_import,
            **{f.fix: [f.state.value, f.detail] for f in s.fixes},
        }
        for s in status().namespaces
        if s.imported
    }


def precision_class(namespace: str) -> type:
    """The namespace's FSDP "true"-precision class: ``FSDPPrecision``, or 2.1.0's Trainer's old name."""
    module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    return module.__dict__.get("FSDPPrecision") or module.__dict__["FSDPPrecisionPlugin"]


def shim_warnings(caught: list[Any]) -> list[str]:
    return [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"]


def converted_dtype(plugin_class: type, precision: str = "bf16-true") -> str:
    """The weight dtype ``convert_module`` of a new plugin gives a float32 layer."""
    import torch

    return str(plugin_class(precision=precision).convert_module(torch.nn.Linear(2, 2)).weight.dtype)


def recompute_dtype(reentrant: bool, forward: str = "torch.bfloat16", backward: str = "torch.float32") -> str:
    """The default dtype a checkpointed block sees in its recompute, its forward run in ``forward`` and the
    backward in ``backward``: the forward's with the recompute fix, the backward's without it. The block records
    it first: a non-reentrant recompute stops once it recomputed what the backward needs."""
    import torch
    from torch.utils.checkpoint import checkpoint

    seen: list[torch.dtype] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_default_dtype())
        return torch.sin(x)

    x = torch.ones(2, requires_grad=True)
    with default_dtype(forward):
        out = checkpoint(block, x, use_reentrant=reentrant)
    with default_dtype(backward):
        out.sum().backward()
    assert str(seen[0]) == forward, seen
    return str(seen[1])


def recompute_dtypes(forward: str = "torch.bfloat16", backward: str = "torch.float32") -> list[str]:
    """``recompute_dtype`` of the reentrant and the non-reentrant checkpoint."""
    return [recompute_dtype(True, forward, backward), recompute_dtype(False, forward, backward)]


@contextlib.contextmanager
def default_dtype(name: str) -> Iterator[None]:
    """The default dtype ``name`` inside, as Lightning's ``_DtypeContextManager`` sets it."""
    import torch

    dtype, previous = getattr(torch, name.removeprefix("torch.")), torch.get_default_dtype()
    if dtype == previous:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
