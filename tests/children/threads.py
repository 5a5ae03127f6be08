"""Imports in threads, the way a hang was once found. Each function prints its result and ends the
process with ``os._exit``: a thread stuck in an import would also hang interpreter shutdown."""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

LIGHTNING_NAMES = [
    "lightning",
    "lightning.pytorch",
    "pytorch_lightning",
    "lightning.fabric.plugins.precision.fsdp",
    "lightning_fabric",
    "lightning.fabric",
    "pytorch_lightning.strategies.fsdp",
    "lightning.pytorch.plugins.precision.fsdp",
    "lightning_fabric.plugins.precision.fsdp",
    "lightning.pytorch.strategies",
]
WATCHED = "slowparent.child"

CALLS: list[list[Any]] = []
"""What the shim's finder handed over here (``_fsdp_shim.HAND_OVER`` points at this module)."""


def namespace_executed(module: Any, noticed_at: str | None = None) -> None:
    """Stands in for ``_fsdp_shim.activation.namespace_executed`` (the finder resolves it by name)."""
    CALLS.append([module.__name__, noticed_at, getattr(module, "VALUE", None)])


def _finish(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)
    os._exit(0)


def _run_threads(targets: list[tuple[float, str]], timeout: float) -> tuple[bool, list[list[str]]]:
    errors: list[list[str]] = []

    def work(delay: float, name: str) -> None:
        time.sleep(delay)
        try:
            importlib.import_module(name)
        except Exception as error:
            errors.append([name, type(error).__name__])

    threads = [threading.Thread(target=work, args=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads), errors


def parent_and_child_at_once(folder: str, hook: str, timeout: float) -> None:
    """Thread A imports a package whose ``__init__`` is slow and then imports its child; thread B
    imports that child meanwhile, with an import hook watching it. A finder that imports the parent
    while the import system holds its global lock deadlocks here.

    ``hook="fsdp-shim"``: the shim's real finder, told to watch the child as if it were a Lightning
    namespace and to hand it over to this module; ``hook="wrapt"``: wrapt's post-import hook."""
    package = Path(folder) / "slowparent"
    package.mkdir()
    (package / "__init__.py").write_text("import time\ntime.sleep(1.0)\nfrom slowparent import child\n")
    (package / "child.py").write_text("VALUE = 1\n")
    sys.path.insert(0, folder)
    wrapt_calls: list[list[Any]] = []
    if hook == "fsdp-shim":
        import _fsdp_shim

        _fsdp_shim.NAMESPACES[WATCHED] = "trainer"
        _fsdp_shim.HAND_OVER = __name__
        _fsdp_shim.arm("test")
    else:
        import wrapt

        wrapt.register_post_import_hook(lambda module: wrapt_calls.append([module.__name__]), WATCHED)
    finished, errors = _run_threads([(0.0, "slowparent"), (0.3, WATCHED)], timeout)
    _finish({"finished": finished, "errors": errors, "hook_calls": CALLS + wrapt_calls})


def lightning_in_threads(shim: str, timeout: float) -> None:
    """Ten threads importing a mix of Lightning names at once."""
    if shim == "import":
        import fsdp_shim  # noqa: F401
    elif shim == "arm":
        import _fsdp_shim

        _fsdp_shim.arm("fsdp-shim run")
    start = time.monotonic()
    finished, errors = _run_threads([(0.0, name) for name in LIGHTNING_NAMES], timeout)
    result: dict[str, Any] = {"finished": finished, "seconds": round(time.monotonic() - start, 1), "errors": errors}
    import _fsdp_shim  # the start-up module: activates nothing

    result["executed"] = [  # the namespaces that finished executing (the others failed in a thread)
        name
        for name in _fsdp_shim.NAMESPACES
        if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", True) is False
    ]
    activation = sys.modules.get("_fsdp_shim.activation")
    result["shim_loaded"] = activation is not None
    if activation is not None:
        result["status"] = {s.namespace: s.as_dict() for s in activation.status().namespaces}
    _finish(result)
