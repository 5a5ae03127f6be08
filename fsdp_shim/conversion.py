"""The behaviour the shim injects: Lightning 2.5.0's FSDP precision conversion.

Each function here is a wrapt wrapper, ``(wrapped, instance, args, kwargs)``, installed on a
Lightning class by :mod:`fsdp_shim.patching`. Errors raised by ``Module.to`` propagate exactly as
they would on 2.5.0; only the shim's own glue (reading attributes that a future Lightning might
rename) is caught, reported once, and answered with Lightning's original behaviour.
"""

from __future__ import annotations

import contextvars
import warnings
from typing import TYPE_CHECKING, Any

from fsdp_shim.errors import FSDPShimError, FSDPShimWarning
from fsdp_shim.toggles import strict_mode

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

_reported_glue_failures: set[str] = set()


def _report_glue_failure(where: str, error: Exception) -> None:
    """Warn once per call site; in strict mode raise instead."""
    message = (
        f"fsdp-shim: {where} failed ({type(error).__name__}: {error}); "
        "falling back to Lightning's own behaviour for this call."
    )
    if strict_mode():
        raise FSDPShimError(message) from error
    if where not in _reported_glue_failures:
        _reported_glue_failures.add(where)
        warnings.warn(message, FSDPShimWarning, stacklevel=3)


def _module_argument(module: torch.nn.Module) -> torch.nn.Module:
    """Bind ``convert_module``'s single argument whether it came positionally or by keyword."""
    return module


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

    Installed over the identity method the affected classes inherit from ``Precision``.
    """
    if instance is None or _conversion_deferred.get():
        return wrapped(*args, **kwargs)
    try:
        module = _module_argument(*args, **kwargs)
        dtype = true_precision_dtype(instance)
    except Exception as error:  # a renamed Lightning attribute, not a user error
        _report_glue_failure(f"{type(instance).__name__}.convert_module", error)
        return wrapped(*args, **kwargs)
    if dtype is None:
        return module
    return module.to(dtype=dtype)


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
    model = getattr(instance, "model", None) if instance is not None else None
    if model is not None:
        instance.model = instance.precision_plugin.convert_module(model)
    return wrapped(*args, **kwargs)
