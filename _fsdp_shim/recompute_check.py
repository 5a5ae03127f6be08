"""Whether torch restores the forward's default dtype itself (read from its code), and the check, in a thread of
its own, that torch's recompute calls what the shim's wrapper handed it before the fix counts in effect."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from _fsdp_shim.config import RECOMPUTE

CHECKPOINT_MODULE = "torch.utils.checkpoint"
COMPOSABLE_MODULE = "torch.distributed._composable.checkpoint_activation"
GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
"""The non-reentrant generator's names, newest first: torch 2.14 calls the first; 2.1-2.13 have the second only."""
REENTRANT, NON_REENTRANT, COMPOSABLE = "reentrant", "non-reentrant", "composable"
TORCHS_OWN = "torch's own (its checkpoint restores the forward's default dtype itself)"
CHECK_SECONDS = 30.0  # how long the check's thread may take (milliseconds here): past it, nothing was shown


@dataclass(frozen=True)
class Finding:
    """What the check found for one path: shown, or not and why; ``holds``: true of every later check too."""

    shown: bool
    why: str = ""
    holds: bool = False


checking: ContextVar[bool] = ContextVar("fsdp_shim_checking_recompute", default=False)  # the check's own calls
through_wrapper: ContextVar[bool] = ContextVar("fsdp_shim_through_wrapper", default=False)  # set by ``marked``
findings: dict[str, Finding] = {}
ran = False  # whether the check has run once in this process
_lock = threading.Lock()  # one check at a time


def marked(function: Callable[..., Any]) -> Callable[..., Any]:
    """What a wrapper hands torch during the check in place of the pin: ``function``, marked as come through it."""

    def through_the_wrapper(*args: Any, **kwargs: Any) -> Any:
        token = through_wrapper.set(True)
        try:
            return function(*args, **kwargs)
        finally:
            through_wrapper.reset(token)

    return through_the_wrapper


def found(shown: bool, holds: bool = False) -> list[str]:
    """The paths shown (``shown``), or not shown where the finding ``holds`` or not (to check again)."""
    return [path for path, f in findings.items() if f.shown == shown and (shown or f.holds == holds)]


def unsettled() -> bool:
    """Whether a path is still to check."""
    return not ran or any(not f.shown and not f.holds for f in findings.values())


def check() -> None:
    """Check the paths not settled yet; take off and name those torch's calls pass by."""
    global ran
    with _lock:
        if unsettled():
            settled = frozenset(path for path, f in findings.items() if f.shown or f.holds)
            try:
                findings.update(prove(settled))
            except Exception as error:  # the check itself broke: nothing was shown
                why = f"its check failed ({type(error).__name__}: {error})"
                findings.update({path: Finding(False, why) for path in paths() if path not in settled})
            ran = True
    if failed := found(shown=False, holds=True):
        from _fsdp_shim import failures
        from _fsdp_shim.wrappers import take_off  # it needs wrapt, which reading torch's code here does not

        take_off(RECOMPUTE, failed)
        failures.recompute_passed_by(failed, findings)


def generator_name(checkpoint: ModuleType) -> str:
    """The newest generator name this torch defines (the one its ``checkpoint()`` calls)."""
    return next((name for name in GENERATORS if hasattr(checkpoint, name)), GENERATORS[-1])


def composable_module() -> ModuleType | None:
    """The composable checkpoint's module, where this torch has one (``torch.distributed.fsdp`` imported it)."""
    import torch

    with contextlib.suppress(ImportError):
        return importlib.import_module(COMPOSABLE_MODULE) if torch.distributed.is_available() else None
    return None


def paths() -> tuple[str, ...]:
    """The checkpoint paths this torch has."""
    return (REENTRANT, NON_REENTRANT) + ((COMPOSABLE,) if hasattr(composable_module(), "checkpoint") else ())


# ----------------------------------------------------------------------------- torch's own restore
def restored_by_torch() -> frozenset[str]:
    """The paths whose recompute torch itself puts in the forward's default dtype (read from its code)."""
    import torch.utils.checkpoint as checkpoint

    helpers = {  # the module's own functions, by name (a helper the recompute calls)
        name: code
        for name, value in vars(checkpoint).items()
        if (code := _code(value)) and getattr(inspect.unwrap(value), "__module__", None) == checkpoint.__name__
    }
    klass = vars(checkpoint).get("CheckpointFunction")
    methods = vars(klass) if isinstance(klass, type) else {}
    found = set()
    if restores(_code(getattr(checkpoint, generator_name(checkpoint), None)), None, helpers):
        found.add(NON_REENTRANT)
        composable = composable_module()
        held = vars(composable).get(generator_name(checkpoint)) if composable is not None else None
        if held is None or restores(_code(held), None, helpers):  # none of its own: it calls the module's
            found.add(COMPOSABLE)
    if restores(_code(methods.get("forward")), _code(methods.get("backward")), helpers):
        found.add(REENTRANT)
    return frozenset(found)


def restores(forward: CodeType | None, recompute: CodeType | None, helpers: dict[str, CodeType]) -> bool:
    """Whether ``forward`` reads the default dtype and the recompute (``recompute``, else the code ``forward``
    nests) sets it, directly or through the module's functions it names (``helpers``)."""
    if forward is None or "get_default_dtype" not in forward.co_names:
        return False
    nested = [const for const in forward.co_consts if isinstance(const, CodeType)]
    return any("set_default_dtype" in _names(code, helpers, set()) for code in ([recompute] if recompute else nested))


def _names(code: CodeType | None, helpers: dict[str, CodeType], seen: set[CodeType]) -> set[str]:
    """The names ``code`` uses, with those of the code it nests and of the module functions it names."""
    if code is None or code in seen:
        return set()
    seen.add(code)
    names = set(code.co_names)
    nested = [const for const in code.co_consts if isinstance(const, CodeType)]
    for inner in nested + [helpers.get(name) for name in code.co_names]:
        names |= _names(inner, helpers, seen)
    return names


def _code(value: Any) -> CodeType | None:
    """The code of a function, a static method or a decorated function (``contextmanager``), else ``None``."""
    function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    with contextlib.suppress(Exception):  # an object whose __wrapped__ chain misbehaves is no function here
        function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None


# ----------------------------------------------------------------------------- torch's call path
class _StopRecompute(Exception):
    """Ends the reentrant check inside its recompute, before torch's backward would run the autograd engine."""


def prove(settled: frozenset[str]) -> dict[str, Finding]:
    """The recompute fix's proof: per path of this torch but those ``settled``, torch's own or what its check saw."""
    import torch
    import torch.utils.checkpoint as checkpoint

    own, composable = restored_by_torch(), composable_module()
    todo = [path for path in paths() if path not in settled]
    findings: dict[str, Finding] = {path: Finding(True, TORCHS_OWN) for path in todo if path in own}

    def check_each() -> None:
        for path in (path for path in todo if path not in own):
            findings[path] = _check(path, torch, checkpoint, composable)

    thread = threading.Thread(target=check_each, name="fsdp-shim recompute check", daemon=True)
    thread.start()
    thread.join(CHECK_SECONDS)
    late = Finding(False, f"its check did not finish within {CHECK_SECONDS:g} s")
    return {path: findings.get(path, late) for path in todo}


def _check(path: str, torch: Any, checkpoint: ModuleType, composable: ModuleType | None) -> Finding:
    """Checkpoint ``x * x``, recompute it, and see whether the recompute came through the shim's wrapper."""
    reentrant = path == REENTRANT
    through: list[bool] = []

    def block(x: Any) -> Any:
        through.append(through_wrapper.get())
        if reentrant and len(through) > 1:
            raise _StopRecompute
        return x * x

    token = checking.set(True)
    try:
        x = torch.ones(1, dtype=torch.float32, device="cpu", requires_grad=True)
        if path == COMPOSABLE:
            out = _composable_forward(torch, composable, block, x)
        else:
            out = torchs_checkpoint(checkpoint)(block, x, use_reentrant=reentrant, preserve_rng_state=False)
        if reentrant:
            with contextlib.suppress(_StopRecompute):
                out.grad_fn.apply(torch.ones_like(out))
        else:
            out.grad_fn._saved_self  # noqa: B018 (reading it recomputes)
    except Exception as error:
        return Finding(False, f"its check could not run here ({type(error).__name__}: {error})")
    finally:
        checking.reset(token)
    if len(through) < 2:
        return Finding(False, "its check saw no recompute")
    if not through[-1]:
        why = "torch recomputed it without the shim's pinned function (its checkpoint calls other functions)"
        return Finding(False, why, holds=True)
    return Finding(True)


def torchs_checkpoint(checkpoint: ModuleType) -> Any:
    """torch's own ``checkpoint``, through ``__wrapped__``: checking a library's function there would blame torch."""
    found = inspect.unwrap(checkpoint.checkpoint, stop=lambda function: _defined_in(function, checkpoint))
    if not _defined_in(found, checkpoint):
        name = f"{getattr(found, '__module__', '?')}.{getattr(found, '__qualname__', repr(found))}"
        raise LookupError(f"torch.utils.checkpoint.checkpoint is {name}, not torch's own")
    return found


def _defined_in(function: Any, module: ModuleType) -> bool:
    """Whether ``function``'s code comes from ``module``'s file, ``.py`` or bytecode only (``.pyc``)."""
    code = getattr(function, "__code__", None)
    source, compiled = Path(getattr(code, "co_filename", "")), Path(module.__file__ or "")
    return code is not None and source.resolve().with_suffix("") == compiled.resolve().with_suffix("")


def _composable_forward(torch: Any, composable: Any, block: Any, x: Any) -> Any:
    class Block(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return block(x)

    try:  # no RNG state forked: the RNG is the whole process's (torch before 2.4 has no such option)
        module = composable.checkpoint(Block(), preserve_rng_state=False)
    except TypeError:  # a module it was applied to, even in vain, refuses a second time: a new one
        module = composable.checkpoint(Block())
    return module(x)
