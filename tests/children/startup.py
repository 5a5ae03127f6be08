"""What a process started under a start-up activation ended up with."""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from typing import Any


def probe() -> dict[str, Any]:
    """Import Lightning the way a training script does (not fsdp_shim) and report the shim's state."""
    from children.classes import import_all

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import_all()
    shim = sys.modules.get("fsdp_shim")
    out: dict[str, Any] = {
        "loaded": shim is not None,
        "shim_warnings": [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"],
    }
    if shim is not None:
        from fsdp_shim.patching import is_shim_wrapper, wrapper_chain

        status = shim.status()
        out.update(
            active=status.active,
            sources=list(status.sources),
            patched={s.namespace: s.patched for s in status.namespaces if s.imported},
            reasons={s.namespace: s.reason for s in status.namespaces if s.imported},
        )
        fsdp = sys.modules.get("lightning.pytorch.plugins.precision.fsdp")
        wrapper = fsdp.FSDPPrecision.__dict__.get("convert_module") if fsdp else None
        out["shim_layers"] = sum(is_shim_wrapper(layer) for layer in wrapper_chain(wrapper)) if wrapper else 0
    return out


def import_shim_then_probe() -> dict[str, Any]:
    import fsdp_shim  # noqa: F401

    return probe()


def switch_off_in_script_then_probe() -> dict[str, Any]:
    os.environ["FSDP_SHIM"] = "0"
    return probe()


def modules_and_finders() -> list[Any]:
    return [sorted(sys.modules), [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]]


def interpreter_state(module: str | None = None) -> dict[str, Any]:
    """sys.path, which ``sitecustomize`` ``import sitecustomize`` gives, and whether ``module`` imports."""
    sitecustomize = sys.modules.get("sitecustomize")
    out: dict[str, Any] = {
        "sys_path": sys.path,
        "sitecustomize_file": getattr(sitecustomize, "__file__", None),
        "sitecustomize_marker": getattr(sitecustomize, "USER_MARKER", None),
        "shim_sources": list(getattr(sys.modules.get("_fsdp_shim_startup"), "sources", [])),
    }
    if module is not None:
        try:
            out["imported"] = importlib.import_module(module).__name__
        except ImportError as error:
            out["import_error"] = str(error)
    return out


def import_lightning_package(package: str) -> dict[str, Any]:
    """Import one Lightning package, letting an error escape (strict mode), and report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(package)
    shim = sys.modules.get("fsdp_shim")
    return {
        "loaded": shim is not None,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "fsdp-shim" in str(w.message)],
        "status": json.loads(json.dumps(shim.status().as_dict())) if shim is not None else None,
    }


def arm_after_lightning() -> dict[str, Any]:
    import lightning  # noqa: F401

    import _fsdp_shim_startup

    _fsdp_shim_startup.arm("fsdp-shim run")
    return probe()
