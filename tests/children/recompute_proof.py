"""The recompute fix on the torch in hand: what it wraps, what it shows, and what it says when torch's
checkpoint no longer calls what it wrapped (``hide_checkpoint_internals``: a torch whose internals moved)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

from children.classes import GENERATORS

HIDE_VARIABLE = "FSDP_SHIM_TEST_HIDE_CHECKPOINT_INTERNALS"
"""Set to 1, ``tests/scenarios/fsdp_train.py`` hides them on that rank before the shim is imported."""


def checkpointed_forward(
    checkpoint: Callable[..., Any], function: Callable[..., Any], dtype: Any, reentrant: bool, size: int = 1
) -> tuple[Any, Any]:
    """``function`` checkpointed on ones of ``dtype``, its forward under that default dtype as a "true"
    precision runs it, float32 put back after: the input, and the output to run the backward from."""
    import torch

    x = torch.ones(size, dtype=dtype, requires_grad=True)
    torch.set_default_dtype(dtype)
    try:
        return x, checkpoint(function, x, use_reentrant=reentrant)
    finally:
        torch.set_default_dtype(torch.float32)


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


def _check() -> dict[str, Any]:
    """The recompute check run again on every path, as found: ``[shown, why, holds]`` per path."""
    from _fsdp_shim import recompute_check

    return {path: [f.shown, f.why, f.holds] for path, f in recompute_check.prove(frozenset()).items()}


def wrapped_and_shown(package: str) -> dict[str, Any]:
    """Activate, import Lightning: what is wrapped, the status, and the check itself run again with the
    shim on and after ``deactivate()`` (so the check is seen to fail where the fix is off)."""
    import fsdp_shim

    importlib.import_module(package)
    composable = "torch.distributed._composable.checkpoint_activation"
    result = {
        "status": _recompute_status(),
        "checkpoint": _held("torch.utils.checkpoint"),
        "composable": _held(composable),
        "generators": [name for name in GENERATORS if hasattr(sys.modules["torch.utils.checkpoint"], name)],
        "check_on": _check(),
    }
    fsdp_shim.deactivate()
    result["check_off"] = _check()
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
    from _fsdp_shim.pins import pins as _pins

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
    pin: list[Any] = []
    _pins._enter(torch.bfloat16, pin)
    torch.set_default_dtype(torch.float16)  # other code, e.g. another thread's forward context
    _pins._leave(pin[0])
    seen["after_other_code_changed_it"] = str(torch.get_default_dtype())
    torch.set_default_dtype(torch.float32)
    first: list[Any] = []
    second: list[Any] = []
    _pins._enter(torch.bfloat16, first)
    _pins._enter(torch.float64, second)
    _pins._leave(first[0])
    seen["the_first_ended"] = str(torch.get_default_dtype())
    _pins._leave(second[0])
    seen["both_ended"] = str(torch.get_default_dtype())
    return seen


def _lightning_dtype_context(package: str) -> Any:
    """Lightning's own forward context (``precision.forward_context()`` of the true precisions)."""
    fabric = "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"
    return importlib.import_module(f"{fabric}.plugins.precision.utils")._DtypeContextManager


CONTEXTS = ("checkpoint debug mode", "the importing thread's state")
"""Module-wide (the check sees it too), and thread-local: saved-tensor hooks disabled, no_grad and a mode of the
user's that rejects float64, all at once (the check runs in a thread of its own)."""


def imported_inside(package: str, context: str, strict: bool) -> dict[str, Any]:
    """Import Lightning inside a context that the check's own calls would trip over in the importing thread,
    then leave it: what status says inside and after, what torch holds, and a bfloat16 checkpointed backward
    run after (its block makes a default-dtype tensor, so it fails where the recompute is not pinned)."""
    import torch
    import torch.utils.checkpoint as checkpoint
    from torch.overrides import TorchFunctionMode

    seen_by_mode: list[str] = []

    class Rejecting(TorchFunctionMode):
        """A user's mode that rejects float64 and notes every op on a tensor that requires grad."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            values = [*args, *kwargs.values()]
            if torch.float64 in values or any(getattr(v, "dtype", None) == torch.float64 for v in values):
                raise RuntimeError("this user's mode rejects float64")
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
                seen_by_mode.append(getattr(func, "__name__", str(func)))
            return func(*args, **kwargs)

    if strict:
        os.environ["FSDP_SHIM_STRICT"] = "1"
    entered = contextlib.ExitStack()
    if context == "checkpoint debug mode":
        entered.enter_context(checkpoint.set_checkpoint_debug_enabled(True))
    else:
        entered.enter_context(torch.autograd.graph.disable_saved_tensors_hooks("the user's"))
        entered.enter_context(torch.no_grad())
        entered.enter_context(Rejecting())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with entered:
            import fsdp_shim

            module = importlib.import_module(package)
            from _fsdp_shim import wrappers
            from _fsdp_shim.config import RECOMPUTE

            inside = wrappers.status(module.__name__, RECOMPUTE).reason
    after = fsdp_shim.status().namespace(module.__name__).fix("recompute")

    def block(x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(4)

    outcomes = {}
    for reentrant in (False, True):
        x, out = checkpointed_forward(checkpoint.checkpoint, block, torch.bfloat16, reentrant, size=4)
        try:
            out.sum().backward()
            outcomes["reentrant" if reentrant else "non-reentrant"] = str(x.grad.dtype)
        except Exception as error:
            outcomes["reentrant" if reentrant else "non-reentrant"] = f"{type(error).__name__}: {error}"[:300]
    return {
        "inside": inside,
        "after": [after.patched, after.reason],
        "checkpoint": _held("torch.utils.checkpoint"),
        "backward": outcomes,
        "dtype": str(torch.get_default_dtype()),
        "warnings": [str(w.message) for w in caught if type(w.message).__name__ == "FSDPShimWarning"],
        "seen_by_mode": seen_by_mode,
    }


def import_watched(package: str) -> dict[str, Any]:
    """The first Lightning import with the shim, while another thread makes tensors all along: the dtypes it
    got, and every call of ``torch.set_default_dtype`` made during the import (the check makes none)."""
    import torch

    switches: list[str] = []
    original = torch.set_default_dtype

    def counted(dtype: torch.dtype) -> None:
        switches.append(f"{threading.current_thread().name}: {dtype}")
        original(dtype)

    torch.set_default_dtype = counted
    seen: dict[str, int] = {}
    done = threading.Event()

    def make_tensors() -> None:
        while not done.is_set():
            dtype = str(torch.zeros(1).dtype)
            seen[dtype] = seen.get(dtype, 0) + 1

    maker = threading.Thread(target=make_tensors, name="user thread")
    maker.start()
    try:
        import fsdp_shim

        module = importlib.import_module(package)
    finally:
        done.set()
        maker.join()
        torch.set_default_dtype = original
    return {"seen": seen, "switches": switches, "reason": fsdp_shim.status().namespace(module.__name__).reason}


def pins_left_by_errors(package: str) -> dict[str, Any]:
    """Recomputes ended by a warning turned into an error (two threads' pins in two dtypes, under
    ``simplefilter("error")``) and by ``KeyboardInterrupt`` inside a recompute: the default dtype and the pins
    still registered after each."""
    import torch
    import torch.utils.checkpoint as checkpoint

    import fsdp_shim  # noqa: F401

    importlib.import_module(package)
    from _fsdp_shim.pins import pins

    found: dict[str, Any] = {}
    inside, release = threading.Barrier(2), threading.Event()
    errors: list[str] = []

    def recompute(dtype: torch.dtype, wait: bool) -> None:
        def block(x: torch.Tensor) -> torch.Tensor:
            calls[dtype].append("recompute" if calls[dtype] else "forward")
            if wait and calls[dtype][-1] == "recompute":  # pinned: hold the pin while the other one starts
                inside.wait(30)
                release.wait(30)
            return x * torch.ones(1)

        calls[dtype] = []
        try:  # the forward of the second one clashes already: its pin is entered while the first one runs
            _, out = checkpointed_forward(checkpoint.checkpoint, block, dtype, reentrant=True)
            out.sum().backward()
        except BaseException as error:
            errors.append(type(error).__name__)

    calls: dict[torch.dtype, list[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = threading.Thread(target=recompute, args=(torch.bfloat16, True))
        first.start()
        inside.wait(30)  # the bfloat16 recompute is pinned and waits; now a float16 one clashes with it
        second = threading.Thread(target=recompute, args=(torch.float16, False))
        second.start()
        second.join(timeout=60)
        release.set()
        first.join(timeout=60)
    found["warning as error"] = {
        "errors": sorted(errors),
        "dtype": str(torch.get_default_dtype()),
        "pins": len(pins._running),
        "after": str(torch.zeros(1).dtype),
    }

    def interrupted(x: torch.Tensor) -> torch.Tensor:
        if torch.get_default_dtype() == torch.bfloat16 and torch.is_grad_enabled():  # the reentrant recompute
            raise KeyboardInterrupt
        return x * 2

    _, out = checkpointed_forward(checkpoint.checkpoint, interrupted, torch.bfloat16, reentrant=True)
    try:
        out.sum().backward()
        raised = "nothing"
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    found["KeyboardInterrupt"] = {"raised": raised, "dtype": str(torch.get_default_dtype()), "pins": len(pins._running)}

    # Ctrl-C while a torch operation runs in C++ is raised at the next call of a Python function. A profile
    # function raises it there, once, as the signal's handler would: as the pin's end starts (the recompute's
    # last operation was interrupted), inside the end as it calls torch.set_default_dtype to put the dtype
    # back, and as the pin's start switches the dtype.
    for where in ("_leave", "_leave:set_default_dtype", "_enter:set_default_dtype"):
        delivered: list[str] = []

        def deliver(frame: Any, event: str, arg: Any, where: str = where, delivered: list[str] = delivered) -> None:
            caller, _, name = where.rpartition(":")
            if event != "call" or frame.f_code.co_name != name or delivered:
                return
            if not caller or frame.f_back.f_code.co_name == caller:
                delivered.append(where)
                raise KeyboardInterrupt

        _, out = checkpointed_forward(checkpoint.checkpoint, lambda x: x * torch.ones(1), torch.bfloat16, True)
        sys.setprofile(deliver)
        try:
            out.sum().backward()
            raised = "nothing"
        except KeyboardInterrupt:
            raised = "KeyboardInterrupt"
        finally:
            sys.setprofile(None)
        found[f"KeyboardInterrupt at {where}"] = {
            "raised": raised if delivered else "not delivered",
            "dtype": str(torch.get_default_dtype()),
            "pins": len(pins._running),
        }
    return found


ORDERS = ("AePeAxPx", "AePePxAx", "PeAePxAx", "PeAeAxPx")
"""How a thread's Lightning forward context (A) and another thread's section (P) overlap: e(nter), (e)x(it)."""


def sections_overlapping(package: str, pairs: list[list[str]]) -> dict[str, dict[str, str]]:
    """``_sections_overlapping`` for every order, pair of dtypes, and P pinned or Lightning's, from float32."""
    import torch

    import fsdp_shim  # noqa: F401

    importlib.import_module(package)
    found: dict[str, dict[str, str]] = {}
    for order in ORDERS:
        for pair in pairs:
            for pin in (True, False):
                torch.set_default_dtype(torch.float32)
                after = _sections_overlapping(package, order, pair, pin)
                found.setdefault(f"{order} {'/'.join(pair)}", {})["pin" if pin else "lightning"] = after
    return found


def _sections_overlapping(package: str, order: str, dtypes: list[str], pin: bool) -> str:
    """Thread A runs Lightning's forward context in ``dtypes[0]``; thread P runs, in ``dtypes[1]``, a pinned
    recompute (``pin``) or Lightning's forward context too; each steps when ``order`` says. The default dtype
    after both: what the process is left with."""
    import torch

    from _fsdp_shim.pins import pins

    context = _lightning_dtype_context(package)
    steps = [order[i : i + 2] for i in range(0, len(order), 2)]
    turn = {step: threading.Event() for step in steps}
    done = {step: threading.Event() for step in steps}

    def step(name: str) -> None:
        turn[name].wait(30)

    def finish(name: str) -> None:
        done[name].set()

    def lightning(name: str, dtype: torch.dtype) -> None:
        step(f"{name}e")
        manager = context(dtype)
        manager.__enter__()
        finish(f"{name}e")
        step(f"{name}x")
        manager.__exit__(None, None, None)
        finish(f"{name}x")

    def pinned(dtype: torch.dtype) -> None:
        step("Pe")

        def recomputing() -> None:
            finish("Pe")
            step("Px")

        pins.call(dtype, recomputing)
        finish("Px")

    a = threading.Thread(target=lightning, args=("A", getattr(torch, dtypes[0])))
    p = threading.Thread(
        target=pinned if pin else lightning,
        args=(getattr(torch, dtypes[1]),) if pin else ("P", getattr(torch, dtypes[1])),
    )
    a.start()
    p.start()
    for name in steps:
        turn[name].set()
        done[name].wait(30)
    a.join(30)
    p.join(30)
    return str(torch.get_default_dtype())


def stepped_aside(packages: list[str]) -> dict[str, Any]:
    """On a torch whose checkpoint restores the default dtype itself: what status and the rank check say, what
    torch holds, what torch's file reads as, and every ``torch.set_default_dtype`` call the shim's own code
    makes during a bfloat16 checkpointed backward, reentrant and not (none: it wraps nothing)."""
    import torch
    import torch.utils.checkpoint as checkpoint

    import fsdp_shim

    for package in packages:
        importlib.import_module(package)
    from pathlib import Path

    from _fsdp_shim import rank_check, recompute_check

    by_shim: list[str] = []
    original = torch.set_default_dtype
    shim_code = str(Path(fsdp_shim.__file__).resolve().parent.parent / "_fsdp_shim")

    def watched(dtype: torch.dtype) -> None:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(shim_code):
            by_shim.append(f"{caller}: {dtype}")
        original(dtype)

    torch.set_default_dtype = watched
    grads = {}
    try:
        for reentrant in (False, True):
            x, out = checkpointed_forward(
                checkpoint.checkpoint, lambda t: t * torch.ones(4), torch.bfloat16, reentrant, size=4
            )
            out.sum().backward()
            grads["reentrant" if reentrant else "non-reentrant"] = str(x.grad.dtype)
    finally:
        torch.set_default_dtype = original
    status = fsdp_shim.status()
    imported = [ns for ns in status.namespaces if ns.imported]
    return {
        "recompute": {ns.namespace: [ns.fix("recompute").affected, ns.fix("recompute").reason] for ns in imported},
        "rank_check": {
            ns.namespace: rank_check._summary(rank_check._decision(ns.namespace, torch.bfloat16)) for ns in imported
        },
        "checkpoint": _held("torch.utils.checkpoint"),
        "composable": _held("torch.distributed._composable.checkpoint_activation"),
        "read_from_file": sorted(recompute_check.restored_in_file(Path(checkpoint.__file__))),
        "set_by_the_shim": by_shim,
        "grads": grads,
        "torch": torch.__version__,
    }


def forked_during_a_recompute(package: str) -> dict[str, Any]:
    """A process forked while another thread's recompute holds its pin (a DataLoader worker started beside an
    evaluation thread's backward): the child's default dtype and pins, and the parent's after the recompute."""
    import torch
    import torch.utils.checkpoint as checkpoint

    import fsdp_shim  # noqa: F401

    importlib.import_module(package)
    from _fsdp_shim.pins import pins

    pinned, done = threading.Event(), threading.Event()
    calls: list[str] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        calls.append("recompute" if calls else "forward")
        if calls[-1] == "recompute":  # pinned, in bfloat16: the fork happens now
            pinned.set()
            done.wait(30)
        return x * torch.ones(1)

    def backward() -> None:
        _, out = checkpointed_forward(checkpoint.checkpoint, block, torch.bfloat16, reentrant=True)
        out.sum().backward()

    thread = threading.Thread(target=backward)
    thread.start()
    pinned.wait(30)
    during = str(torch.get_default_dtype())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only this thread, none of the parent's pins
        os.write(write, f"{torch.get_default_dtype()} {len(pins._running)} {torch.zeros(1).dtype}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as child:
        dtype, count, made = child.read().split()
    os.waitpid(pid, 0)
    done.set()
    thread.join(60)
    return {
        "parent during": during,
        "child": {"dtype": dtype, "pins": int(count), "tensor": made},
        "parent after": {"dtype": str(torch.get_default_dtype()), "pins": len(pins._running)},
    }


def checkpoint_replaced_by_a_library(package: str) -> dict[str, Any]:
    """A library's own function put at ``torch.utils.checkpoint.checkpoint`` before Lightning's import (one that
    calls torch's through ``functools.wraps``, one that does not): the recompute's status while it is there,
    after torch's is put back, and a bfloat16 reentrant backward through torch's own function."""
    import functools

    import torch
    import torch.utils.checkpoint as checkpoint

    torchs = checkpoint.checkpoint

    @functools.wraps(torchs)
    def wrapping(*args: Any, **kwargs: Any) -> Any:
        return torchs(*args, **kwargs)

    def own(function: Any, *args: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
        return function(*args)  # no checkpointing at all: stands for a library's own implementation

    import fsdp_shim

    checkpoint.checkpoint = own
    importlib.import_module(package)

    def reason() -> str:
        return fsdp_shim.status().namespace(package).fix("recompute").reason

    found = {"replaced": reason()}
    checkpoint.checkpoint = wrapping
    found["wrapping torch's"] = reason()
    checkpoint.checkpoint = torchs
    found["put back"] = reason()
    x, out = checkpointed_forward(torchs, lambda h: h @ torch.ones(2, 2), torch.bfloat16, reentrant=True, size=2)
    out.sum().backward()
    found["backward"] = str(x.grad.dtype)
    return found
