"""Lightning removed from ``sys.modules`` and imported again, as test frameworks and reloaders do:
the new classes must be patched, and ``status()`` must describe them, not the old ones."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from children.classes import import_all, precision_class, statuses, wrappers

PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


def converted_dtype(namespace: str) -> str:
    import torch

    plugin = precision_class(namespace)(precision="bf16-true")
    return str(plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype)


def forget(prefix: str) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            del sys.modules[name]


def import_again(namespace: str) -> dict[str, Any]:
    import fsdp_shim  # noqa: F401

    import_all()
    first = precision_class(namespace)
    for package in PACKAGES:
        forget(package)
    import_all()
    return {
        "new_class": precision_class(namespace) is not first,
        "dtype": converted_dtype(namespace),
        "wrappers": wrappers(),
        "status": statuses()[namespace],
    }


def import_one_module_again(namespace: str) -> dict[str, Any]:
    """Only the module holding the patched class is imported again: its namespace does not execute,
    so nothing patches the new class until ``activate()``; ``status()`` must say so meanwhile."""
    import fsdp_shim

    import_all()
    before = statuses()[namespace]
    forget(f"{namespace}.plugins.precision.fsdp")
    importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    stale = {"status": statuses()[namespace], "dtype": converted_dtype(namespace)}
    fsdp_shim.activate()
    return {
        "before": before,
        "stale": stale,
        "after": {"status": statuses()[namespace], "dtype": converted_dtype(namespace)},
    }
