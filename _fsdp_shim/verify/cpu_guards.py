"""Let real FSDP run on CPU with gloo, in processes that exist only to measure.

Used by ``fsdp-shim verify``'s probe on a machine without CUDA, by the memory benchmark and by the
test scenarios; never by ``import fsdp_shim`` or anything a training process loads. It lifts exactly
two guards, and only for FSDP strategy instances:

* torch refuses CPU modules in ``FullyShardedDataParallel`` unless ``device_id`` is
  ``torch.device("cpu")``; Lightning passes ``root_device.index``, which is ``None`` on CPU.
* Lightning's Trainer and Fabric connectors raise in ``_check_strategy_and_fallback`` for FSDP without
  a GPU (2.1.x/2.2.x via ``isinstance``, so a subclass does not help). For a strategy passed as an
  instance the rest of that method does nothing, so it is skipped for FSDP instances.

The module is self-contained (torch and the named Lightning namespaces only): a test run with the
shim off loads it by file path, because importing it as ``fsdp_shim.verify.cpu_guards`` would run
the package's ``__init__`` and activate the shim. Lifting twice changes nothing.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

_LIFTED = "_fsdp_shim_cpu_guard_lifted"

# Lightning's names, per kind of namespace: (connector module, connector class, strategy module).
CONNECTORS = {
    "trainer": ("trainer.connectors.accelerator_connector", "_AcceleratorConnector", "strategies.fsdp"),
    "fabric": ("connector", "_Connector", "strategies.fsdp"),
}


def lift(*namespaces: str) -> None:
    """Lift both guards for the given Lightning namespaces (``lightning.pytorch``, ``lightning_fabric``...)."""
    _lift_fsdp_device_guard()
    for namespace in namespaces:
        kind = "trainer" if namespace in ("lightning.pytorch", "pytorch_lightning") else "fabric"
        connector_module, connector_class, strategy_module = CONNECTORS[kind]
        _lift_connector_guard(f"{namespace}.{connector_module}", connector_class, f"{namespace}.{strategy_module}")


def _lift_fsdp_device_guard() -> None:
    original = FullyShardedDataParallel.__init__
    if getattr(original, _LIFTED, False):
        return

    @functools.wraps(original)
    def __init__(self: FullyShardedDataParallel, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
        if device_id is None and not torch.cuda.is_available():
            device_id = torch.device("cpu")
        original(self, *args, device_id=device_id, **kwargs)

    setattr(__init__, _LIFTED, True)
    FullyShardedDataParallel.__init__ = __init__  # type: ignore[method-assign]


def _lift_connector_guard(connector_module: str, connector_class: str, strategy_module: str) -> None:
    connector = getattr(importlib.import_module(connector_module), connector_class)
    fsdp_strategy = importlib.import_module(strategy_module).FSDPStrategy
    original = connector._check_strategy_and_fallback
    if getattr(original, _LIFTED, False):
        return

    @functools.wraps(original)
    def _check_strategy_and_fallback(self: Any) -> None:
        if isinstance(self._strategy_flag, fsdp_strategy):
            return
        original(self)

    setattr(_check_strategy_and_fallback, _LIFTED, True)
    connector._check_strategy_and_fallback = _check_strategy_and_fallback
