"""Lightning 2.5.0's own ``test_convert_module`` cases, run against the classes of each namespace."""

from __future__ import annotations

import importlib
from typing import Any


def convert_all(namespaces: list[str], precisions: list[str]) -> dict[str, dict[str, list[Any]]]:
    import torch

    import fsdp_shim  # noqa: F401

    out: dict[str, dict[str, list[Any]]] = {}
    for namespace in namespaces:
        module = importlib.import_module(f"{namespace}.plugins.precision.fsdp")
        plugin_class = getattr(module, "FSDPPrecision", None) or module.FSDPPrecisionPlugin
        out[namespace] = {}
        for precision in precisions:
            layer = torch.nn.Linear(2, 2)
            before = [str(layer.weight.dtype), str(layer.bias.dtype)]
            result = plugin_class(precision=precision).convert_module(layer)
            out[namespace][precision] = [*before, str(result.weight.dtype), str(result.bias.dtype), result is layer]
    return out
