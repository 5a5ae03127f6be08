"""What the recompute tests' children share: a torch whose checkpoint calls other names than the ones the shim
wraps (``hide_checkpoint_internals``), what torch holds at those names, and a checkpointed forward run as a
"true" precision runs it. Importing it imports neither torch, Lightning nor fsdp_shim."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
COMPOSABLE = "torch.distributed._composable.checkpoint_activation"


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


def held(module_name: str = "torch.utils.checkpoint") -> dict[str, str]:
    """The type of what the module holds at each generator name (and at ``CheckpointFunction.forward``)."""
    module = sys.modules.get(module_name)
    found = {name: type(vars(module)[name]).__name__ for name in GENERATORS if module and name in vars(module)}
    if module_name == "torch.utils.checkpoint":
        found["CheckpointFunction.forward"] = type(vars(module.CheckpointFunction)["forward"]).__name__
    return found


def checkpointed_forward(function: Callable[..., Any], dtype: Any, reentrant: bool, size: int = 1) -> tuple[Any, Any]:
    """``function`` checkpointed on ones of ``dtype``, its forward under that default dtype as a "true"
    precision runs it, float32 put back after: the input, and the output to run the backward from."""
    import torch
    import torch.utils.checkpoint

    x = torch.ones(size, dtype=dtype, requires_grad=True)
    torch.set_default_dtype(dtype)
    try:
        return x, torch.utils.checkpoint.checkpoint(function, x, use_reentrant=reentrant)
    finally:
        torch.set_default_dtype(torch.float32)


def recompute_grads() -> dict[str, str]:
    """A checkpointed backward per kind (forward in bfloat16) whose block makes a tensor without a dtype: its
    gradient's dtype, or the error where the recompute ran in another dtype."""
    import torch

    found = {}
    for kind, reentrant in (("non-reentrant", False), ("reentrant", True)):
        x, out = checkpointed_forward(lambda t: t * torch.ones(4), torch.bfloat16, reentrant, size=4)
        try:
            out.sum().backward()
            found[kind] = str(x.grad.dtype)
        except Exception as error:
            found[kind] = f"{type(error).__name__}: {error}"[:300]
    return found
