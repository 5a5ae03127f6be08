"""What a process started under a start-up activation ended up with.

Start-up activation never imports the public ``fsdp_shim`` package: the start-up finder hands each
executed Lightning namespace over to ``_fsdp_shim.activation``, so "the shim loaded" means that
module is in ``sys.modules``, and what it did comes from its ``status()``. Nothing here imports
``_fsdp_shim.activation`` itself before it reads whether the start-up code did.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import marshal
import os
import pkgutil
import sys
import warnings
from pathlib import Path
from typing import Any

ACTIVATION = "_fsdp_shim.activation"
STARTUP_MODULES = ("_fsdp_shim", "_fsdp_shim_startup_file")
"""The start-up module, and the copy of it that ``fsdp-shim install`` writes (each arms its own finder
when it arms first, and records its own sources)."""
FINDER = "fsdp_shim_finder"


def fsdp_modules() -> list[str]:
    return sorted(name for name in sys.modules if "fsdp" in name)


def finder_names() -> list[str]:
    return [getattr(finder, "__name__", type(finder).__name__) for finder in sys.meta_path]


def startup_sources() -> list[str]:
    """How the start-up modules were armed, read from them alone (no import of the shim)."""
    found: list[str] = []
    for name in STARTUP_MODULES:
        found += [source for source in getattr(sys.modules.get(name), "ARMED_BY", ()) if source not in found]
    return found


def probe(packages: list[str] | None = None) -> dict[str, Any]:
    """Import Lightning the way a training script does (not fsdp_shim) and report the shim's state.

    ``packages``: the top-level packages to import (default: every installed one)."""
    from children.classes import import_all

    at_start = {"fsdp_modules": fsdp_modules(), "finders": finder_names()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if packages is None:
            import_all()
        else:
            for package in packages:
                importlib.import_module(package)
    return {**at_start, **shim_state(caught)}


def shim_state(caught: list[Any] = ()) -> dict[str, Any]:
    activation = sys.modules.get(ACTIVATION)
    out: dict[str, Any] = {
        "loaded": activation is not None,
        "shim_warnings": [str(w.message) for w in caught if w.category.__name__ == "FSDPShimWarning"],
        "finder_count": finder_names().count(FINDER),
    }
    if activation is not None:
        from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain

        status = activation.status()
        out.update(
            active=status.active,
            sources=list(status.sources),
            versions={s.namespace: s.version for s in status.namespaces if s.imported},
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


def switch_off_in_script_then_probe(value: str = "0") -> dict[str, Any]:
    os.environ["FSDP_SHIM"] = value
    return probe()


def modules_and_finders() -> list[Any]:
    return [sorted(sys.modules), finder_names()]


def interpreter_state(module: str | None = None) -> dict[str, Any]:
    """sys.path, which ``sitecustomize`` ``import sitecustomize`` gives, how the start-up code armed,
    and whether ``module`` imports."""
    sitecustomize = sys.modules.get("sitecustomize")
    out: dict[str, Any] = {
        "sys_path": sys.path,
        "sitecustomize_file": getattr(sitecustomize, "__file__", None),
        "sitecustomize_marker": getattr(sitecustomize, "USER_MARKER", None),
        "shim_sources": startup_sources(),
        "fsdp_modules": fsdp_modules(),
        "finders": finder_names(),
    }
    if module is not None:
        try:
            out["imported"] = importlib.import_module(module).__name__
        except ImportError as error:
            out["import_error"] = str(error)
    return out


def import_lightning_package(package: str, then: list[str] | None = None) -> dict[str, Any]:
    """Import one Lightning package, letting an error escape (strict mode), then the modules ``then``,
    and report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(package)
        for name in then or ():
            importlib.import_module(name)
    activation = sys.modules.get(ACTIVATION)
    status = getattr(activation, "status", None)  # an earlier fsdp-shim's has none
    return {
        "loaded": activation is not None,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "fsdp-shim" in str(w.message)],
        "status": json.loads(json.dumps(status().as_dict())) if status is not None else None,
    }


def arm_after_lightning() -> dict[str, Any]:
    """What a start-up hook that runs after Lightning was imported does (``fsdp-shim run``'s bootstrap
    reached late): arm, nothing else."""
    import lightning  # noqa: F401

    import _fsdp_shim

    _fsdp_shim.arm("fsdp-shim run")
    return shim_state()


def bootstrap_fallback(values: list[str]) -> dict[str, Any]:
    """``fsdp-shim run``'s bootstrap where the shim cannot be armed: per ``FSDP_SHIM_STRICT`` value,
    whether its finder raises at a Lightning import (and whether the start-up module's parser calls
    the value on), and the Lightning packages it reads from the start-up module's source."""
    import _fsdp_shim
    from _fsdp_shim.bootstrap import sitecustomize as bootstrap

    startup = bootstrap._startup_module()  # the start-up module, loaded by path as the bootstrap does
    raised = {}
    for value in values:
        os.environ["FSDP_SHIM_STRICT"] = value
        finder = bootstrap._NotArmed(RuntimeError("simulated"), startup)
        try:
            finder.find_spec("lightning")
            raised[value] = False
        except ImportError:
            raised[value] = True
    return {
        "raised": raised,
        "strict": {value: _fsdp_shim.switch_state(value) in ("on", "invalid") for value in values},
        "packages_from_source": sorted(bootstrap._packages(startup)),
    }


# ----------------------------------------------------------------------------- specs and loaders
TOP_LEVEL = ("lightning", "pytorch_lightning", "lightning_fabric")
SUBMODULES = ("lightning.pytorch", "lightning.fabric")
RESOURCE = ("version.info",)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe_spec(spec: Any, name: str) -> dict[str, Any]:
    """Everything importlib and pkgutil read from a spec and its loader, as comparable values."""
    loader = spec.loader
    out: dict[str, Any] = {
        "name": spec.name,
        "origin": spec.origin,
        "submodule_search_locations": list(spec.submodule_search_locations or []),
        "cached": spec.cached,
        "has_location": spec.has_location,
        "parent": spec.parent,
        "loader_state": repr(spec.loader_state),
        "loader_type": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "get_filename": loader.get_filename(name),
        "is_package": loader.is_package(name),
        "get_code": _digest(marshal.dumps(loader.get_code(name))),
        "get_source": _digest(loader.get_source(name).encode()),
    }
    reader = loader.get_resource_reader(name)
    out["get_resource_reader"] = [f"{type(reader).__module__}.{type(reader).__qualname__}", str(reader.files())]
    return out


def _spec_before_import(name: str) -> Any:
    """The spec the import system would use for ``name`` now, without importing anything: a dotted
    name's parent is only found, not imported (``importlib.util.find_spec`` would import the parent,
    which executes these submodules); then ``sys.meta_path`` is asked in order, as the import system
    does."""
    if "." not in name:
        return importlib.util.find_spec(name)
    parent = importlib.util.find_spec(name.rpartition(".")[0])
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(name, parent.submodule_search_locations, None) if find_spec else None
        if spec is not None:
            return spec
    return None


def specs_and_loaders() -> dict[str, Any]:
    """Every Lightning package's and namespace's spec and loader before the import (``find_spec``),
    the data ``pkgutil.get_data`` reads through them (which imports the package, as a package that
    reads its own data does), their loaders after the import, and what the shim did."""
    names = [name for name in (*TOP_LEVEL, *SUBMODULES) if importlib.util.find_spec(name.partition(".")[0])]
    assert not [name for name in names if name in sys.modules], "imported before the check"
    at_start = {"fsdp_modules": fsdp_modules(), "finders": finder_names()}
    before = {name: describe_spec(_spec_before_import(name), name) for name in names}
    data = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for package in (name for name in names if "." not in name):
            file = Path(importlib.util.find_spec(package).origin).parent.joinpath(*RESOURCE)
            read = pkgutil.get_data(package, "/".join(RESOURCE))  # imports the package through its spec
            data[package] = {"file": _digest(file.read_bytes()), "pkgutil": _digest(read) if read is not None else None}
    after = {}
    for name in names:
        module = sys.modules[name]
        loader = module.__loader__
        after[name] = {
            "loader_is_spec_loader": loader is module.__spec__.loader,
            "exec_module_shadowed": "exec_module" in getattr(loader, "__dict__", {}),
            "spec": describe_spec(module.__spec__, name),
        }
    return {"before": before, "data": data, "after": after, "probe": {**at_start, **shim_state(caught)}}
