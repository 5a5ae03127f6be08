"""``python python_check.py OUT.json PACKAGE...``, ``status --python-check``'s child: imports the installed Lightning
packages as a training script does and writes what the shim did to ``OUT.json`` (start-up code may print to stdout)."""

import importlib
import json
import os
import sys
import warnings
from typing import Any

if __name__ == "__main__":
    HERE = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != HERE]
    warnings.simplefilter("ignore")
    report: dict[str, Any] = {"python": sys.executable, "imported": [], "failed": {}}
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
            report["imported"].append(name)
        except Exception as error:  # as distributions.import_failure(); absent is no failure
            if not (isinstance(error, ModuleNotFoundError) and error.name == name):
                report["failed"][name] = [type(error).__name__, str(error), getattr(error, "name", None)]
    activation = sys.modules.get("_fsdp_shim.activation")  # imported by the start-up finder's hand-over
    report["shim_loaded"] = activation is not None
    if activation is not None:
        report["status"] = activation.status().as_dict()
    with open(sys.argv[1], "w") as handle:
        json.dump(report, handle)
