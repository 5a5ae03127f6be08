"""What this environment holds."""

from __future__ import annotations

import importlib


def layouts(namespaces: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per layout ("lightning", "standalone"): the Trainer and Fabric versions, if both import."""
    found = {}
    for package, (trainer, fabric) in namespaces.items():
        try:
            found[package] = [importlib.import_module(ns).__version__ for ns in (trainer, fabric)]
        except Exception:
            continue
    return found
