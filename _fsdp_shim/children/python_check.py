"""``python <this file> OUT.json``, ``status --python-check``'s child: imports Lightning as a training script does
and writes what the shim did to ``OUT.json``, not to stdout, where the environment's start-up code may print too."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import warnings
from typing import Any

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # holds _fsdp_shim: site-packages, or an uninstalled clone


def check() -> dict[str, Any]:
    borrowed = importlib.util.find_spec("_fsdp_shim") is None
    if borrowed:  # a clone run uninstalled: last on the path, and only for this import
        sys.path.append(ROOT)
    try:
        from _fsdp_shim import distributions  # activates nothing
    finally:
        if borrowed:
            sys.path.remove(ROOT)
    imported, failed = [], {}
    for name in distributions.installed_packages():
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as error:
            failed[name] = distributions.import_failure(error)
    activation = sys.modules.get("_fsdp_shim.activation")  # imported by the start-up finder's hand-over
    report: dict[str, Any] = {"python": sys.executable, "imported": imported, "failed": failed}
    report["shim_loaded"] = activation is not None
    if activation is not None:
        report["status"] = activation.status().as_dict()
    return report


if __name__ == "__main__":
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != HERE]
    warnings.simplefilter("ignore")
    report = check()
    with open(sys.argv[1], "w") as handle:
        json.dump(report, handle)
