"""What the shim decided in this session's interpreter, as one JSON line on stdout.

Run by ``scripts/matrix_status.py`` as ``python scripts/matrix_probe.py`` with the session's
``PYTHONPATH``, in a process of its own so that a Lightning that fails to import (or crashes the
interpreter) becomes an ``error`` record instead of ending the status script. The checkout's root
goes first on ``sys.path``, where ``python -c`` from the checkout put it, so the record is about this
checkout's shim; this script's own folder is taken off.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import warnings
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(HERE)


def probe() -> dict[str, Any]:
    """Import fsdp_shim, then every Lightning package; the versions and the shim's per-namespace status."""
    import fsdp_shim
    from _fsdp_shim.config import LIGHTNING_PACKAGES

    for name in LIGHTNING_PACKAGES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import wrapt

    return {
        "wrapt": wrapt.__version__,
        "torch": metadata.version("torch"),
        "namespaces": [s.as_dict() for s in fsdp_shim.status().namespaces],
    }


def main() -> None:
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != HERE]
    sys.path.insert(0, ROOT)
    warnings.simplefilter("ignore")
    print(json.dumps(probe()))


if __name__ == "__main__":
    main()
