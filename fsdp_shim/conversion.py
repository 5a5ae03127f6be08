"""The behaviour the shim injects: Lightning 2.5.0's FSDP precision conversion.

Each function here is the body of a wrapt wrapper, ``(wrapped, instance, args, kwargs)``, run by
``fsdp_shim.patching.WrapperState``. ``wrapped`` is whatever the class held or inherited: Lightning's
method, or another library's wrapper of it, which therefore still runs. When the shim's own glue fails
(an attribute a future Lightning renamed), a function raises ``GlueError``
*before* changing anything, and the wrapper falls back to ``wrapped``; errors from the user's model or
from ``Module.to`` propagate exactly as they would on 2.5.0.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from _fsdp_shim_startup import LIGHTNING_NAMESPACES
from fsdp_shim import log, rank_check

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# True while Lightning 2.1.x's ``Strategy.connect`` runs for an FSDP strategy. 2.1.x converts there,
# before ``configure_model`` and the ``setup()`` hook have built every layer; 2.5.0 converts only in
# ``FSDPStrategy.setup``. Converting at connect too would cast the ``__init__`` layers early and make
# FSDP refuse a model to which ``configure_model`` then adds a float32 layer ("Must flatten tensors
# with uniform dtype"), so the injected conversion stays out of connect.
_conversion_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_shim_conversion_deferred", default=False
)


class GlueError(Exception):
    """The shim's own glue failed inside a wrapper (a Lightning attribute it reads was renamed).

    Raised before anything was changed, so the wrapper can fall back to calling Lightning's method as
    it was found.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")


NUMERICS_PAGE = "docs/numerics.md ('16-true keeps weights in float16')"


def true_precision_dtype(precision_plugin: Any) -> torch.dtype | None:
    """The dtype 2.5.0 casts the module to, or ``None`` where 2.5.0 leaves it alone.

    Mirrors ``FSDPPrecision.convert_module`` of Lightning 2.5.0: every ``*-true`` precision casts
    (``"32-true"`` included, which turns float64 parameters into float32); ``*-mixed`` does not.
    """
    if "true" in precision_plugin.precision:
        dtype: torch.dtype = precision_plugin._desired_input_dtype
        return dtype
    return None


def convert_module_as_in_2_5(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``FSDPPrecision.convert_module`` as Lightning 2.5.0 defines it.

    On Lightning the wrapped method is the identity every affected class inherits from ``Precision``,
    so calling it first changes nothing; where another library wrapped it, its code runs too.
    """
    if instance is None or _conversion_deferred.get():
        return wrapped(*args, **kwargs)
    try:
        dtype = true_precision_dtype(instance)
    except Exception as error:
        raise GlueError(error) from error
    module = wrapped(*args, **kwargs)
    if dtype is None:
        return module
    if str(dtype) == "torch.float16":
        log.warn_once_on_rank_zero(
            "float16",
            "fsdp-shim: precision='16-true' now keeps the model's weights and optimizer state in float16, "
            "as Lightning 2.5+ does (unpatched 2.1-2.4 kept them in float32). Optimizer settings below "
            "float16's range then break training: AdamW's default eps=1e-8 is 0 in float16 and gives NaN "
            "losses. Use precision='bf16-true', or eps >= 1e-4. See %s.",
            NUMERICS_PAGE,
        )
    module = module.to(dtype=dtype)
    rank_check.confirm_every_rank(dtype, _namespace_of(instance))
    return module


def _namespace_of(precision_plugin: Any) -> str:
    """The Lightning namespace (``lightning.pytorch``, ``lightning_fabric``, ...) whose plugin this is."""
    module = type(precision_plugin).__module__
    for name, _ in LIGHTNING_NAMESPACES:
        if module == name or module.startswith(name + "."):
            return name
    return module


def connect_without_early_conversion(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run 2.1.x's ``Strategy.connect`` for FSDP with the injected conversion held back.

    Lightning 2.2.0 (#19061) removed the conversion from ``connect``; this restores that timing for
    FSDP only, leaving every other strategy's inherited ``connect`` untouched.
    """
    token = _conversion_deferred.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _conversion_deferred.reset(token)


def convert_before_setup(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Give 2.1.x's ``FSDPStrategy.setup`` the conversion 2.2.0+ performs before the FSDP wrap.

    2.2.0+ converts after ``accelerator.setup`` and the SyncBatchNorm conversion; converting first is
    equivalent because neither touches parameter dtypes and the SyncBatchNorm conversion reuses the
    same parameter tensors.
    """
    try:
        model = instance.model
        convert_module = instance.precision_plugin.convert_module
    except Exception as error:
        raise GlueError(error) from error
    if model is not None:
        instance.model = convert_module(model)
    return wrapped(*args, **kwargs)
