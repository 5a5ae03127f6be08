"""Let FSDP run on CPU with gloo in verify's (and the tests') processes only, lifting torch's and Lightning's guards."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from _fsdp_shim import NAMESPACES

CONNECTORS = {
    "trainer": ("trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
    "fabric": ("connector", "_Connector"),
}


def lift(*namespaces: str) -> None:
    """Lift both guards for the given Lightning namespaces (``lightning.pytorch``, ``lightning_fabric``...), once."""

    def device_cpu(original: Callable[..., None], self: Any, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
        cpu = device_id is None and not torch.cuda.is_available()
        original(self, *args, device_id=torch.device("cpu") if cpu else device_id, **kwargs)

    def not_for_fsdp(original: Callable[[Any], None], self: Any, fsdp: type) -> None:
        if not isinstance(self._strategy_flag, fsdp):  # it does nothing else for a strategy instance
            original(self)

    replace_once(FullyShardedDataParallel, "__init__", device_cpu)
    for namespace in namespaces:
        module, name = CONNECTORS[NAMESPACES[namespace]]
        fsdp = importlib.import_module(f"{namespace}.strategies.fsdp").FSDPStrategy
        connector = getattr(importlib.import_module(f"{namespace}.{module}"), name)
        replace_once(connector, "_check_strategy_and_fallback", functools.partial(not_for_fsdp, fsdp=fsdp))


def replace_once(owner: type, name: str, replacement: Callable[..., None]) -> None:
    original = getattr(owner, name)
    if not getattr(original, "_fsdp_shim_cpu_guard_lifted", False):
        lifted = functools.wraps(original)(lambda *args, **kwargs: replacement(original, *args, **kwargs))
        lifted._fsdp_shim_cpu_guard_lifted = True  # type: ignore[attr-defined]
        setattr(owner, name, lifted)
