"""Another library patching the same method as the shim: a tracer, a profiler, a team's hot-fix."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from children.classes import precision_class, shim_warnings, statuses


def _convert(cls: type, precision: str = "bf16-true") -> str:
    import torch

    return str(cls(precision=precision).convert_module(torch.nn.Linear(2, 2)).weight.dtype)


def foreign_wrapper_first(namespace: str, kind: str) -> dict[str, Any]:
    """A wrapper on convert_module before the shim loads. The shim must not read it as
    Lightning's own fix: it wraps it, so both run, and deactivate() puts it back."""
    import wrapt

    importlib.import_module(namespace)
    cls = precision_class(namespace)
    calls: list[str] = []
    if kind == "plain":
        inherited = cls.convert_module

        def convert_module(self: Any, module: Any) -> Any:
            calls.append("theirs")
            return inherited(self, module)

        cls.convert_module = convert_module  # type: ignore[attr-defined]
    else:

        def tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            calls.append("theirs")
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(cls, "convert_module", tracer)
    theirs = cls.__dict__["convert_module"]
    import fsdp_shim

    dtype_on = _convert(cls)
    calls_on = len(calls)
    status_on = statuses()[namespace]
    fsdp_shim.deactivate()
    return {
        "dtype_on": dtype_on,
        "their_calls_on": calls_on,
        "status_on": status_on,
        "theirs_restored": cls.__dict__.get("convert_module") is theirs,
        "dtype_off": _convert(cls),
        "their_calls_off": len(calls) - calls_on,
    }


def foreign_wrapper_on_top(namespace: str) -> dict[str, Any]:
    """A wrapt wrapper put on top of the shim's. Through wrapt's proxy it answers every
    attribute of the shim's wrapper; the shim must look at the object itself."""
    import wrapt

    import fsdp_shim
    from fsdp_shim.patching import is_shim_wrapper, wrapper_chain

    importlib.import_module(namespace)
    cls = precision_class(namespace)
    calls: list[str] = []

    def tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        calls.append("theirs")
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(cls, "convert_module", tracer)
    foreign = cls.__dict__["convert_module"]
    out: dict[str, Any] = {
        "foreign_counts_as_shim_wrapper": is_shim_wrapper(foreign),
        "status_on": statuses()[namespace],
        "dtype_on": _convert(cls),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    out.update(
        deactivate_warnings=shim_warnings(caught),
        foreign_still_on_class=cls.__dict__["convert_module"] is foreign,
        dtype_off=_convert(cls),
        status_off=statuses()[namespace],
    )
    fsdp_shim.activate()
    out.update(
        foreign_still_on_class_after_activate=cls.__dict__["convert_module"] is foreign,
        shim_layers=sum(is_shim_wrapper(layer) for layer in wrapper_chain(cls.__dict__["convert_module"])),
        dtype_reactivated=_convert(cls),
        status_reactivated=statuses()[namespace],
    )
    fsdp_shim.deactivate()
    out.update(
        foreign_still_on_class_at_the_end=cls.__dict__["convert_module"] is foreign,
        dtype_at_the_end=_convert(cls),
        their_calls=len(calls),
    )
    return out


def shim_wrapper_replaced(namespace: str) -> dict[str, Any]:
    """Other code replaces (not wraps) the shim's wrapper: status must stop saying "patched", and
    deactivate() must not remove the replacement."""
    import fsdp_shim

    importlib.import_module(namespace)
    cls = precision_class(namespace)

    def replacement(self: Any, module: Any) -> Any:
        return module

    cls.convert_module = replacement  # type: ignore[attr-defined]
    status = statuses()[namespace]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_shim.deactivate()
    return {
        "status": status,
        "deactivate_warnings": shim_warnings(caught),
        "replacement_kept": cls.__dict__["convert_module"] is replacement,
    }
