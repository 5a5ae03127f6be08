"""What the shim says where it arrived late: after FSDP wrapped a model, or past a finder in front of its own.
Loaded only then."""

from __future__ import annotations

import gc
import sys
from types import ModuleType

from _fsdp_shim import NAMESPACES, failures, wrappers
from _fsdp_shim.config import FIXES, State

_STANDARD_FINDERS = ("_frozen_importlib", "_frozen_importlib_external", "importlib._bootstrap", "importlib.machinery")


def finders_in_front(module: ModuleType) -> str:
    """The finders on ``sys.meta_path`` in front of the shim's: what loaded a module it did not see execute."""
    names = []
    for finder in sys.meta_path:
        if getattr(finder, "__name__", None) == "fsdp_shim_finder":
            break
        if all(
            where not in _STANDARD_FINDERS for where in (type(finder).__module__, getattr(finder, "__module__", ""))
        ):
            names.append(repr(finder))
    if names:
        return "the finder(s) in front of fsdp-shim's import watcher on sys.meta_path (" + ", ".join(names) + ")"
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return f"a finder that loaded it past fsdp-shim's import watcher (loader: {loader!r})"


def report_loaded_past_the_finder(name: str, who: str) -> None:
    """``who`` loaded ``name`` past the shim's finder, so it was patched late (a failed patch says so itself)."""
    if any(getattr(wrappers.records.get((name, fix.name)), "state", None) is State.PATCHED for fix in FIXES):
        failures.warn_once(
            f"fsdp-shim: {who} loaded {name} without fsdp-shim's import watcher seeing it, so it was patched only "
            "then; a model FSDP wrapped before that keeps its dtype. To patch it at its import, import fsdp_shim (or "
            "install that hook) so fsdp-shim's import watcher comes first on sys.meta_path",
            key=f"missed:{name}",
        )


def warn_about_models_already_wrapped(name: str) -> None:
    """Only parameters FSDP already flattened cannot change: found by a garbage-collector walk."""
    trainer = NAMESPACES[name] == "trainer"
    holder_module, holder_class = ("strategies.fsdp", "FSDPStrategy") if trainer else ("wrappers", "_FabricModule")
    holder = getattr(sys.modules.get(f"{name}.{holder_module}"), holder_class, None)
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if not isinstance(holder, type) or not isinstance(fsdp, type):
        return
    attribute = "_model" if trainer else "_forward_module"
    holders = (obj for obj in gc.get_objects() if issubclass(type(obj), holder))  # type(): proxies warn on __class__
    count = sum(isinstance(getattr(obj, attribute, None), fsdp) for obj in holders)
    if count:
        failures.warn_once(
            f"fsdp-shim was activated after {name} had already set up {count} FSDP model(s); their parameters "
            "keep the dtype they were wrapped with. The fix applies from the next setup on. Import fsdp_shim "
            "before Lightning, or use `fsdp-shim run` or the start-up file.",
            key=f"late:{name}",
        )
