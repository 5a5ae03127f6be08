"""Telling the user when the shim arrived after FSDP had already wrapped a model.

The methods the shim wraps live on the classes, so every strategy and plugin instance, old or new,
uses the fix from its next ``setup`` on; only parameters FSDP already flattened cannot change. This
module finds such models (a garbage-collector walk, like gevent's check for stale references) and
warns once. The only Lightning names it reads are in ``MODEL_HOLDERS``.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from fsdp_shim import failures
from fsdp_shim.backport import Kind, Namespace


@dataclass(frozen=True)
class ModelHolder:
    """Where an FSDP-wrapped model lives after setup."""

    module: str
    class_name: str
    attributes: tuple[str, ...]


MODEL_HOLDERS: dict[Kind, ModelHolder] = {
    "trainer": ModelHolder("strategies.fsdp", "FSDPStrategy", ("_model",)),
    "fabric": ModelHolder("wrappers", "_FabricModule", ("_forward_module",)),
}


def warn_about_models_already_wrapped(namespace: Namespace) -> None:
    count = sum(1 for obj in _instances_of(_holder_classes(namespace)) if _holds_fsdp_model(namespace, obj))
    if count:
        failures.warn_once(
            f"fsdp-shim was activated after {namespace.name} had already set up {count} FSDP model(s); "
            "their parameters keep the dtype they were wrapped with. The fix applies from the next "
            "setup on. Import fsdp_shim before Lightning, or use `fsdp-shim run` or the start-up file.",
            key=f"late:{namespace.name}",
        )


def _holder_classes(namespace: Namespace) -> tuple[type, ...]:
    holder = MODEL_HOLDERS[namespace.kind]
    module = sys.modules.get(f"{namespace.name}.{holder.module}")
    cls = getattr(module, holder.class_name, None)
    return (cls,) if isinstance(cls, type) else ()


def _instances_of(classes: tuple[type, ...]) -> Iterable[object]:
    if not classes:
        return ()
    # type(), not isinstance(): isinstance reads __class__, which some module-level proxies (torch's
    # deprecated aliases) answer with a FutureWarning.
    return (obj for obj in gc.get_objects() if issubclass(type(obj), classes))


def _holds_fsdp_model(namespace: Namespace, holder: object) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_class = getattr(fsdp, "FullyShardedDataParallel", None)
    if not isinstance(fsdp_class, type):
        return False
    return any(isinstance(getattr(holder, name, None), fsdp_class) for name in MODEL_HOLDERS[namespace.kind].attributes)
