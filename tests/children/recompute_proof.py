"""The recompute fix on the torch in hand: what it wraps, what it shows, and what it says when torch's
checkpoint no longer calls what it wrapped (``hide_checkpoint_internals``: a torch whose internals moved)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import time
import types
import warnings
from typing import Any

from children.classes import GENERATORS

HIDE_VARIABLE = "FSDP_SHIM_TEST_HIDE_CHECKPOINT_INTERNALS"
"""Set to 1, ``tests/scenarios/fsdp_train.py`` hides them on that rank before the shim is imported."""


def hide_checkpoint_internals() -> None:
    """Make ``torch.utils.checkpoint.checkpoint`` call the module's functions through a private copy of its
    names, as a torch that moved its internals to new names would: the shim's wrappers on the module's
    names are then never called. ``noop_context_fn`` stays shared (checkpoint compares it by identity)."""
    import torch.utils.checkpoint as checkpoint

    names = dict(vars(checkpoint))
    for name, value in list(names.items()):
        function = inspect.unwrap(value) if callable(value) else value
        if isinstance(function, types.FunctionType) and function.__module__ == checkpoint.__name__:
            if name == "noop_context_fn":
                continue
            code, defaults, closure = function.__code__, function.__defaults__, function.__closure__
            copy = types.FunctionType(code, names, function.__name__, defaults, closure)
            copy.__kwdefaults__ = function.__kwdefaults__
            names[name] = copy
    checkpoint.checkpoint = names["checkpoint"]


def _recompute_status() -> dict[str, Any]:
    import fsdp_shim

    found = {}
    for namespace in fsdp_shim.status().namespaces:
        if namespace.imported:
            fix = namespace.fix("recompute")
            found[namespace.namespace] = {"patched": fix.patched, "reason": fix.reason, "targets": list(fix.targets)}
    return found


def _held(module_name: str) -> dict[str, str]:
    """What the module holds under each generator name and ``CheckpointFunction.forward``: the object's type."""
    module = sys.modules.get(module_name)
    held = {name: type(vars(module)[name]).__name__ for name in GENERATORS if module and name in vars(module)}
    if module_name == "torch.utils.checkpoint":
        held["CheckpointFunction.forward"] = type(vars(module.CheckpointFunction)["forward"]).__name__
    return held


def wrapped_and_shown(package: str) -> dict[str, Any]:
    """Activate, import Lightning: what is wrapped, the status, and the check itself run again with the
    shim on and after ``deactivate()`` (so the check is seen to fail where the fix is off)."""
    import fsdp_shim

    importlib.import_module(package)
    from _fsdp_shim import fixes

    composable = "torch.distributed._composable.checkpoint_activation"
    result = {
        "status": _recompute_status(),
        "checkpoint": _held("torch.utils.checkpoint"),
        "composable": _held(composable),
        "generators": [name for name in GENERATORS if hasattr(sys.modules["torch.utils.checkpoint"], name)],
        "check_on": fixes.prove_recompute(),
    }
    fsdp_shim.deactivate()
    result["check_off"] = fixes.prove_recompute()
    result["checkpoint_off"] = _held("torch.utils.checkpoint")
    result["composable_off"] = _held(composable)
    return result


def moved_internals(packages: list[str], strict: bool = False) -> dict[str, Any]:
    """A torch whose checkpoint no longer calls the names the shim wraps: status, warnings, what torch holds."""
    hide_checkpoint_internals()
    if strict:
        os.environ["FSDP_SHIM_STRICT"] = "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import fsdp_shim

        try:
            for package in packages:
                importlib.import_module(package)
        except Exception as error:
            return {"raised": f"{type(error).__name__}: {error}"}
    import torch

    from _fsdp_shim import rank_check

    shim_warnings = [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"]
    namespaces = [name for name, fix in _recompute_status().items() if fix is not None]
    return {
        "status": _recompute_status(),
        "warnings": shim_warnings,
        "checkpoint": _held("torch.utils.checkpoint"),
        "rank_check": {name: rank_check._decision(name, torch.bfloat16)["fixes"] for name in namespaces},
        "active": fsdp_shim.status().active,
    }


def switched_off_in_process(package: str) -> dict[str, Any]:
    """``FSDP_SHIM_DISABLED_FIXES`` set in a running process, then ``activate()``: what torch and Lightning
    hold, and the status; then the variable unset and ``activate()`` again."""
    import fsdp_shim

    module = importlib.import_module(package)
    precision = sys.modules[f"{module.__name__}.plugins.precision.fsdp"].FSDPPrecision

    def held() -> dict[str, Any]:
        return {
            "checkpoint": _held("torch.utils.checkpoint"),
            "convert_module_on_class": "convert_module" in vars(precision),
            "status": {
                fix: fsdp_shim.status().namespace(module.__name__).fix(fix).reason for fix in ("cast", "recompute")
            },
        }

    before = held()
    os.environ["FSDP_SHIM_DISABLED_FIXES"] = "recompute,cast"
    fsdp_shim.activate()
    off = held()
    del os.environ["FSDP_SHIM_DISABLED_FIXES"]
    fsdp_shim.activate()
    return {"before": before, "off": off, "on_again": held()}


def backwards_in_threads(shim: bool, dtypes: list[str], rounds: int) -> dict[str, Any]:
    """Per round: one checkpointed forward per dtype (one after the other, each under its default dtype),
    then every backward at once in its own thread, each recompute sleeping so that they overlap. Records
    the default dtype each recompute saw and the process's default dtype after every round."""
    for name in ("fsdp_shim", "lightning") if shim else ():
        importlib.import_module(name)
    import torch
    import torch.utils.checkpoint as checkpoint

    seen: dict[str, list[str]] = {name: [] for name in dtypes}
    after: list[str] = []
    errors: list[str] = []

    def block(name: str, x: torch.Tensor) -> torch.Tensor:
        seen[name].append(str(torch.get_default_dtype()))
        time.sleep(0.005)
        return x * torch.ones(1)  # the default dtype's tensor: the recompute's dtype decides the product's

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(rounds):
            outputs = []
            for name in dtypes:
                dtype = getattr(torch, name)
                x = torch.ones(4, dtype=dtype, requires_grad=True)
                torch.set_default_dtype(dtype)
                try:
                    out = checkpoint.checkpoint(block, name, x, use_reentrant=False)
                finally:
                    torch.set_default_dtype(torch.float32)
                outputs.append(out)
            barrier = threading.Barrier(len(outputs))

            def backward(out: torch.Tensor, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    out.sum().backward()
                except Exception as error:
                    errors.append(f"{type(error).__name__}: {error}"[:200])

            threads = [threading.Thread(target=backward, args=(out,)) for out in outputs]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            after.append(str(torch.get_default_dtype()))
    shim_warnings = [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"]
    return {"seen": seen, "after": after, "errors": errors, "warnings": shim_warnings}


def imported_inside_contexts(package: str) -> dict[str, Any]:
    """Lightning imported (and the fix's check run) under ``inference_mode``, a meta default device and a
    bfloat16 default dtype: the check still sees each recompute, and leaves every one of them as it was."""
    import torch

    torch.set_default_dtype(torch.bfloat16)
    with torch.inference_mode(), torch.device("meta"):
        import fsdp_shim

        module = importlib.import_module(package)
        inside = {"inference_mode": torch.is_inference_mode_enabled(), "device": str(torch.empty(1).device)}
    return {
        "reason": fsdp_shim.status().namespace(module.__name__).fix("recompute").reason,
        "inside": inside,
        "dtype": str(torch.get_default_dtype()),
    }


def pins_in_one_thread(package: str) -> dict[str, str]:
    """The default dtype where the pin must not touch it: a reentrant checkpoint nested in a region that
    set its own dtype, a checkpointed function that sets the dtype, other code changing the dtype while
    a recompute runs, and two pins that end in the order they started."""
    import torch
    import torch.utils.checkpoint as checkpoint

    import fsdp_shim  # noqa: F401

    importlib.import_module(package)
    from _fsdp_shim.fixes import _pins

    seen: dict[str, str] = {}

    def outer(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float32)
        y = checkpoint.checkpoint(lambda t: t * 2, x, use_reentrant=True)
        seen["after_the_inner_checkpoint"] = str(torch.get_default_dtype())
        torch.set_default_dtype(torch.float64)
        return y

    torch.set_default_dtype(torch.float64)
    checkpoint.checkpoint(outer, torch.ones(2, dtype=torch.float64, requires_grad=True), use_reentrant=True)
    seen["after_the_outer_checkpoint"] = str(torch.get_default_dtype())
    torch.set_default_dtype(torch.float32)

    def setter(x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        return x * 2

    checkpoint.checkpoint(setter, torch.ones(2, requires_grad=True), use_reentrant=True)
    seen["after_a_function_that_sets_it"] = str(torch.get_default_dtype())
    torch.set_default_dtype(torch.float32)
    pin = _pins._enter(torch.bfloat16)
    torch.set_default_dtype(torch.float16)  # other code, e.g. another thread's forward context
    _pins._leave(pin)
    seen["after_other_code_changed_it"] = str(torch.get_default_dtype())
    torch.set_default_dtype(torch.float32)
    first, second = _pins._enter(torch.bfloat16), _pins._enter(torch.float64)
    _pins._leave(first)
    seen["the_first_ended"] = str(torch.get_default_dtype())
    _pins._leave(second)
    seen["both_ended"] = str(torch.get_default_dtype())
    return seen
