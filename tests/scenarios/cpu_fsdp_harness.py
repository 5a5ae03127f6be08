"""Lift Lightning's "FSDP needs a GPU" guards so real FSDP runs on CPU with gloo. TESTS ONLY.

Nothing in ``fsdp_shim`` imports this module, and it must never run in a user's process: it changes
Lightning's and torch's behaviour in ways that are only right for a CPU test machine. It lifts
exactly two things:

* torch (2.13) refuses CPU modules in ``FullyShardedDataParallel`` unless ``device_id`` is
  ``torch.device("cpu")``; Lightning passes ``root_device.index``, which is ``None`` on CPU.
* Lightning's Trainer and Fabric connectors raise in ``_check_strategy_and_fallback`` for an FSDP
  strategy on a non-GPU accelerator (2.1.x/2.2.x via ``isinstance``, so a subclass does not help).
  When the strategy is passed as an instance, the rest of that method is a no-op, so skipping it
  for FSDP instances removes the raise and nothing else.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

_LIFTED = "_cpu_harness_lifted"


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
    FullyShardedDataParallel.__init__ = __init__


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


def lift_gpu_guards(trainer_namespace: str, fabric_namespace: str) -> None:
    """Apply both lifts for one pair of Lightning namespaces (e.g. ``lightning.pytorch`` and
    ``lightning.fabric``). Idempotent."""
    _lift_fsdp_device_guard()
    _lift_connector_guard(
        f"{trainer_namespace}.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector",
        f"{trainer_namespace}.strategies.fsdp",
    )
    _lift_connector_guard(f"{fabric_namespace}.connector", "_Connector", f"{fabric_namespace}.strategies.fsdp")
