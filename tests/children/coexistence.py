"""Another library patching the same functions as the shim: a tracer, a profiler, a team's hot-fix.

Each function takes a list of targets, ``{"fix": ..., "namespace": ..., "kind": ...}``, one per kind of
function the shim wraps: ``convert`` (the cast's ``convert_module`` on the namespace's FSDP precision
class, which inherits it), ``reentrant`` (the recompute's ``CheckpointFunction.forward``, a staticmethod
in torch's class dict) and ``non_reentrant`` (the recompute's ``_checkpoint_without_reentrant_generator``,
a function of the module ``torch.utils.checkpoint``). They are different attributes, so one process
checks several without one disturbing another. ``dtype`` is what the target does: the weight dtype
``convert_module`` gives a bf16-true plugin's model, or the default dtype a checkpointed block is
recomputed in when its forward ran in bfloat16 (the forward's under the recompute fix, float32 without).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from children.classes import (
    checkpoint_generator,
    converted_dtype,
    precision_class,
    recompute_dtype,
    shim_warnings,
    statuses,
)


class Target:
    def __init__(self, fix: str, namespace: str, kind: str) -> None:
        importlib.import_module(namespace)
        self.fix, self.namespace, self.kind = fix, namespace, kind
        checkpoint = importlib.import_module("torch.utils.checkpoint")
        self.owner: Any
        if kind == "convert":
            self.owner, self.attribute = precision_class(namespace), "convert_module"
        elif kind == "reentrant":
            self.owner, self.attribute = checkpoint.CheckpointFunction, "forward"
        else:
            self.owner, self.attribute = checkpoint, checkpoint_generator()
        self.calls: list[str] = []

    def dtype(self) -> str:
        if self.kind == "convert":
            return converted_dtype(self.owner)
        return recompute_dtype(reentrant=self.kind == "reentrant")

    def on_class(self) -> Any:
        """What the class (or module) dict holds: for a staticmethod, the object itself."""
        return self.owner.__dict__.get(self.attribute)

    def status(self) -> dict[str, Any]:
        [fix] = [fix for fix in statuses()[self.namespace]["fixes"] if fix["fix"] == self.fix]
        return fix

    def statuses_of_every_namespace(self) -> list[dict[str, Any]]:
        """The fix's status in every imported namespace (the recompute's torch wrappers are shared)."""
        found = [status for status in statuses().values() if status["imported"]]
        return [fix for status in found for fix in status["fixes"] if fix["fix"] == self.fix]

    def tracer(self, wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        self.calls.append("theirs")
        return wrapped(*args, **kwargs)

    def wrap_with_wrapt(self) -> None:
        import wrapt

        wrapt.wrap_function_wrapper(self.owner, self.attribute, self.tracer)

    def replace_with_plain_function(self) -> None:
        """What a hot-fix does: a function that calls what was there (Lightning's or torch's own,
        inherited or not), a staticmethod where that was one."""
        previous = getattr(self.owner, self.attribute)
        calls = self.calls

        def theirs(*args: Any, **kwargs: Any) -> Any:
            calls.append("theirs")
            return previous(*args, **kwargs)

        static = isinstance(self.owner.__dict__.get(self.attribute), staticmethod)
        setattr(self.owner, self.attribute, staticmethod(theirs) if static else theirs)


def _targets(targets: list[dict[str, str]]) -> dict[str, Target]:
    return {t["kind"]: Target(t["fix"], t["namespace"], t["kind"]) for t in targets}


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
        calls = len(target.calls)  # the recompute's check at activation ran through theirs too
        out[key] = {"dtype_on": target.dtype(), "their_calls_on": len(target.calls) - calls}
        out[key]["status_on"] = target.status()
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
            statuses_off=target.statuses_of_every_namespace(),
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

        def replacement(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("never called")

        static = target.kind == "reentrant"  # CheckpointFunction.forward: a staticmethod, replaced by one
        replacements[key] = staticmethod(replacement) if static else replacement
        setattr(target.owner, target.attribute, replacements[key])
    out: dict[str, Any] = {key: {"status": target.status()} for key, target in found.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    for key, target in found.items():
        out[key]["replacement_kept"] = target.on_class() is replacements[key]
    return {"targets": out, "deactivate_warnings": shim_warnings(caught)}


def base_class_wrapped_after(namespaces: list[str]) -> dict[str, Any]:
    """Review B2: after the shim patched a release whose FSDP precision class inherits ``convert_module``,
    another library wraps the BASE class's ``convert_module`` (the namespace's ``Precision``) with wrapt.
    The shim's wrapper looks the inherited method up at every call, so a bf16-true plugin's
    ``convert_module`` runs their wrapper and the shim's cast; ``deactivate()`` restores inheritance and
    leaves their wrapper on the base class."""
    import wrapt

    for namespace in namespaces:
        importlib.import_module(namespace)
    shipped = {ns: "convert_module" not in precision_class(ns).__dict__ for ns in namespaces}
    import fsdp_shim

    out: dict[str, Any] = {}
    calls: dict[str, list[str]] = {ns: [] for ns in namespaces}
    theirs = {}
    for namespace in namespaces:
        fsdp_class = precision_class(namespace)
        base = importlib.import_module(f"{namespace}.plugins.precision").Precision

        def tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any, seen: list[str] = calls[namespace]) -> Any:
            seen.append(type(instance).__name__)
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(base, "convert_module", tracer)
        theirs[namespace] = base.__dict__["convert_module"]
        out[namespace] = {
            "inherited_as_shipped": shipped[namespace],
            "derives_from_base": issubclass(fsdp_class, base) and fsdp_class is not base,
            "shim_on_the_class": "convert_module" in fsdp_class.__dict__,
            "dtype_on": converted_dtype(fsdp_class),
            "their_calls_on": list(calls[namespace]),
            "status_on": statuses()[namespace]["fixes"][0],
        }
    fsdp_shim.deactivate()
    for namespace in namespaces:
        fsdp_class = precision_class(namespace)
        base = importlib.import_module(f"{namespace}.plugins.precision").Precision
        calls[namespace].clear()
        out[namespace].update(
            inherited_again="convert_module" not in fsdp_class.__dict__,
            theirs_kept=base.__dict__.get("convert_module") is theirs[namespace],
            dtype_off=converted_dtype(fsdp_class),
            their_calls_off=list(calls[namespace]),
        )
    return out
