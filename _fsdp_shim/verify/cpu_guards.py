"""Let real FSDP run on CPU with gloo, in verify's (and the tests') processes only, never in training: torch wants
``device_id=torch.device("cpu")`` (Lightning passes ``None``), and Lightning's connector refuses FSDP without a GPU."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from _fsdp_shim import NAMESPACES

_LIFTED = "_fsdp_shim_cpu_guard_lifted"
CONNECTORS = {  # per kind of namespace (``_fsdp_shim.NAMESPACES``): its connector's module and class
    "trainer": ("trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
    "fabric": ("connector", "_Connector"),
}


def lift(*namespaces: str) -> None:
    """Lift both guards for the given Lightning namespaces (``lightning.pytorch``, ``lightning_fabric``...)."""

    def device_cpu(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: FullyShardedDataParallel, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            if device_id is None and not torch.cuda.is_available():
                device_id = torch.device("cpu")
            original(self, *args, device_id=device_id, **kwargs)

        return __init__

    _replace_once(FullyShardedDataParallel, "__init__", device_cpu)
    for namespace in namespaces:
        module, name = CONNECTORS[NAMESPACES[namespace]]
        fsdp_strategy = importlib.import_module(f"{namespace}.strategies.fsdp").FSDPStrategy

        def not_for_fsdp(original: Callable[[Any], None], fsdp: type = fsdp_strategy) -> Callable[[Any], None]:
            def _check_strategy_and_fallback(self: Any) -> None:
                if not isinstance(self._strategy_flag, fsdp):  # it does nothing else for a strategy instance
                    original(self)

            return _check_strategy_and_fallback

        connector = getattr(importlib.import_module(f"{namespace}.{module}"), name)
        _replace_once(connector, "_check_strategy_and_fallback", not_for_fsdp)


def _replace_once(owner: type, name: str, replacement: Callable[[Any], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if not getattr(original, _LIFTED, False):
        lifted = functools.wraps(original)(replacement(original))
        setattr(lifted, _LIFTED, True)
        setattr(owner, name, lifted)
