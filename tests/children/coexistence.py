"""Another library patching the same methods as the shim: a tracer, a profiler, a team's hot-fix.

Each function takes a list of targets, ``{"fix": "cast" | "recompute", "namespace": ...}``: the cast's
``convert_module`` or the recompute's ``backward`` on the namespace's FSDP precision class. They are
different class attributes, so one process checks several without one disturbing another. ``dtype``
is what the target does for a bf16-true plugin: the weight dtype ``convert_module`` gives, or the
default dtype the backward runs in (the forward's under the recompute fix, float32 without it).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from children.classes import backward_dtype, converted_dtype, precision_class, shim_warnings, statuses

ATTRIBUTE = {"cast": "convert_module", "recompute": "backward"}


class Target:
    def __init__(self, fix: str, namespace: str) -> None:
        importlib.import_module(namespace)
        self.fix, self.namespace = fix, namespace
        self.cls = precision_class(namespace)
        self.attribute = ATTRIBUTE[fix]
        self.calls: list[str] = []

    def dtype(self) -> str:
        if self.fix == "cast":
            return converted_dtype(self.cls)
        return backward_dtype(self.cls(precision="bf16-true"))

    def on_class(self) -> Any:
        return self.cls.__dict__.get(self.attribute)

    def status(self) -> dict[str, Any]:
        [fix] = [fix for fix in statuses()[self.namespace]["fixes"] if fix["fix"] == self.fix]
        return fix

    def tracer(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        self.calls.append("theirs")
        return wrapped(*args, **kwargs)

    def wrap_with_wrapt(self) -> None:
        import wrapt

        wrapt.wrap_function_wrapper(self.cls, self.attribute, self.tracer)

    def replace_with_plain_function(self) -> None:
        """What a hot-fix does: a function that calls what the class had (Lightning's own, inherited or not)."""
        previous = getattr(self.cls, self.attribute)
        calls = self.calls

        def theirs(plugin: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append("theirs")
            return previous(plugin, *args, **kwargs)

        setattr(self.cls, self.attribute, theirs)


def _targets(targets: list[dict[str, str]]) -> dict[str, Target]:
    return {f"{t['fix']}:{t['namespace']}": Target(t["fix"], t["namespace"]) for t in targets}


def foreign_wrapper_first(targets: list[dict[str, str]], kind: str) -> dict[str, Any]:
    """A wrapper put on each target before the shim loads (``kind``: a plain function, or wrapt's). The
    shim must not read it as Lightning's own fix: it wraps it, so both run, and ``deactivate()`` puts
    back their object itself."""
    found = _targets(targets)
    for target in found.values():
        if kind == "plain":
            target.replace_with_plain_function()
        else:
            target.wrap_with_wrapt()
    theirs = {key: target.on_class() for key, target in found.items()}
    import fsdp_shim

    out: dict[str, Any] = {}
    for key, target in found.items():
        out[key] = {"dtype_on": target.dtype(), "their_calls_on": len(target.calls), "status_on": target.status()}
    fsdp_shim.deactivate()
    for key, target in found.items():
        calls = len(target.calls)
        out[key].update(
            theirs_restored=target.on_class() is theirs[key],
            dtype_off=target.dtype(),
            their_calls_off=len(target.calls) - calls,
        )
    return out


def foreign_wrapper_on_top(targets: list[dict[str, str]]) -> dict[str, Any]:
    """A wrapt wrapper put on top of each of the shim's. Through wrapt's proxy it answers every
    attribute of the shim's wrapper; the shim must look at the object itself."""
    import fsdp_shim
    from _fsdp_shim.wrappers import is_shim_wrapper, wrapper_chain

    found = _targets(targets)
    out: dict[str, Any] = {}
    for key, target in found.items():
        target.wrap_with_wrapt()
        out[key] = {
            "foreign": target.on_class(),
            "foreign_counts_as_shim_wrapper": is_shim_wrapper(target.on_class()),
            "status_on": target.status(),
            "dtype_on": target.dtype(),
        }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    deactivate_warnings = shim_warnings(caught)
    for key, target in found.items():
        out[key].update(
            foreign_still_on_class=target.on_class() is out[key]["foreign"],
            dtype_off=target.dtype(),
            status_off=target.status(),
        )
    fsdp_shim.activate()
    for key, target in found.items():
        out[key].update(
            foreign_still_on_class_after_activate=target.on_class() is out[key]["foreign"],
            shim_layers=sum(is_shim_wrapper(layer) for layer in wrapper_chain(target.on_class())),
            dtype_reactivated=target.dtype(),
            status_reactivated=target.status(),
        )
    fsdp_shim.deactivate()
    for key, target in found.items():
        out[key].update(
            foreign_still_on_class_at_the_end=target.on_class() is out[key].pop("foreign"),
            dtype_at_the_end=target.dtype(),
            their_calls=len(target.calls),
        )
    return {"targets": out, "deactivate_warnings": deactivate_warnings}


def shim_wrapper_replaced(targets: list[dict[str, str]]) -> dict[str, Any]:
    """Other code replaces (not wraps) each of the shim's wrappers: status must stop saying "patched",
    and ``deactivate()`` must not remove the replacement."""
    import fsdp_shim

    found = _targets(targets)
    replacements = {}
    for key, target in found.items():

        def replacement(plugin: Any, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("never called")

        setattr(target.cls, target.attribute, replacement)
        replacements[key] = replacement
    out: dict[str, Any] = {key: {"status": target.status()} for key, target in found.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    for key, target in found.items():
        out[key]["replacement_kept"] = target.on_class() is replacements[key]
    return {"targets": out, "deactivate_warnings": shim_warnings(caught)}
