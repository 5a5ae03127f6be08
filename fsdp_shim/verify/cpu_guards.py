"""Let real FSDP run on CPU with gloo, for ``fsdp-shim verify`` on a machine without CUDA.

Imported only by the verify child process (:mod:`fsdp_shim.verify.probe`), which exists to run this
check and exits; never by ``import fsdp_shim`` or anything a training process loads. It lifts
exactly two guards, and only for FSDP strategy instances:

* torch refuses CPU modules in ``FullyShardedDataParallel`` unless ``device_id`` is
  ``torch.device("cpu")``; Lightning passes ``root_device.index``, which is ``None`` on CPU.
* Lightning's Trainer connector raises in ``_check_strategy_and_fallback`` for FSDP without a GPU;
  for a strategy passed as an instance the rest of that method does nothing, so it is skipped.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel


def lift(trainer_namespace: str) -> None:
    original_init = FullyShardedDataParallel.__init__

    def fsdp_init(self: FullyShardedDataParallel, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
        original_init(self, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

    FullyShardedDataParallel.__init__ = fsdp_init

    connectors = importlib.import_module(f"{trainer_namespace}.trainer.connectors.accelerator_connector")
    fsdp_strategy = importlib.import_module(f"{trainer_namespace}.strategies").FSDPStrategy
    original_check = connectors._AcceleratorConnector._check_strategy_and_fallback

    def check(self: Any) -> None:
        if not isinstance(self._strategy_flag, fsdp_strategy):
            original_check(self)

    connectors._AcceleratorConnector._check_strategy_and_fallback = check
