"""Lightning removed from ``sys.modules`` and imported again, as test frameworks and reloaders do:
the new classes must be patched, and ``status()`` must describe them, not the old ones."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from children.classes import (
    PACKAGES,
    backward_dtype,
    converted_dtype,
    import_all,
    precision_class,
    statuses,
    wrappers,
)


def forget(prefix: str) -> None:
    for name in list(sys.modules):
        if name == prefix or name.startswith(prefix + "."):
            del sys.modules[name]


def _facts(namespace: str) -> dict[str, Any]:
    """What a bf16-true plugin of the classes in ``sys.modules`` now does, and what status says."""
    plugin_class = precision_class(namespace)
    return {
        "convert_dtype": converted_dtype(plugin_class),
        "backward_dtype": backward_dtype(plugin_class(precision="bf16-true")),
        "status": statuses()[namespace],
    }


def import_again(namespace: str) -> dict[str, Any]:
    """Every Lightning package imported, forgotten and imported again (new classes); then only the
    module that holds the FSDP precision class: its namespace does not execute again, so nothing
    patches the new class until ``activate()``, and ``status()`` must say so meanwhile."""
    import fsdp_shim

    import_all()
    first = precision_class(namespace)
    first_wrappers = wrappers()
    for package in PACKAGES:
        forget(package)
    import_all()
    out: dict[str, Any] = {
        "new_class": precision_class(namespace) is not first,
        "first_wrappers": first_wrappers,
        "wrappers": wrappers(),
        **_facts(namespace),
    }
    forget(f"{namespace}.plugins.precision.fsdp")
    importlib.import_module(f"{namespace}.plugins.precision.fsdp")
    out["one_module"] = {"new_class": precision_class(namespace) is not first, **_facts(namespace)}
    fsdp_shim.activate()
    out["after_activate"] = {"wrappers": wrappers(), **_facts(namespace)}
    return out
