"""``fsdp-shim status --python-check``'s child: ``python <this file> OUT.json``.

It imports every installed Lightning package the way a training script does, without importing
``fsdp_shim`` (that would activate the shim and hide what the start-up file or ``fsdp-shim run``
achieve), and writes what the shim did to ``OUT.json``: not to stdout, which start-up code of the
environment (an ``atexit`` print in a sitecustomize) may write to as well. Run by its path (see
``fsdp_shim/_children/__init__.py``), so nothing from the current folder runs in it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import warnings
from types import ModuleType
from typing import Any

HERE = os.path.dirname(os.path.realpath(__file__))
PACKAGE = os.path.dirname(HERE)
"""The ``fsdp_shim`` folder; its parent holds ``_fsdp_shim_startup``."""


def lightning_install() -> ModuleType:
    """``fsdp_shim/lightning_install.py``, loaded by its path under a private name: importing it as
    ``fsdp_shim.lightning_install`` would run the package's ``__init__``, which activates the shim.

    Its one import outside the standard library, ``_fsdp_shim_startup``, has no side effects. Where
    only the package's own folder holds it (a clone run uninstalled), it is borrowed from there and
    forgotten afterwards, so that Lightning's import finds exactly what it would without this child.
    """
    root = os.path.dirname(PACKAGE)
    borrowed = root not in sys.path and importlib.util.find_spec("_fsdp_shim_startup") is None
    if borrowed:
        sys.path.append(root)
    try:
        spec = importlib.util.spec_from_file_location(
            "_fsdp_shim_python_check_lightning_install", os.path.join(PACKAGE, "lightning_install.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if borrowed:
            sys.path.remove(root)
            sys.modules.pop("_fsdp_shim_startup", None)
    return module


def check() -> dict[str, Any]:
    """Import every installed Lightning package; what imported, what failed and what the shim did."""
    install = lightning_install()
    imported, failed = [], {}
    for name in install.installed_packages():
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as error:
            failed[name] = install.import_failure(error)
    shim = sys.modules.get("fsdp_shim")
    report: dict[str, Any] = {"python": sys.executable, "imported": imported, "failed": failed}
    report["shim_loaded"] = shim is not None
    if shim is not None:
        report["status"] = shim.status().as_dict()
    return report


def main(out: str) -> None:
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != HERE]
    warnings.simplefilter("ignore")
    report = check()
    with open(out, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
