"""THE FIX: Lightning 2.5.0's FSDP "true"-precision conversion, for the releases that lack it.

Lightning 2.1.0-2.4.x never cast the model to the dtype of `precision="bf16-true"` / `"16-true"` before
FSDP wraps it: their `FSDPPrecision` inherits `Precision.convert_module`, the identity. Lightning
PR #20323 ("Add convert_module to FSDP", first in 2.5.0rc0) gave it a body: every `*-true` precision
casts the module with `module.to(dtype=self._desired_input_dtype)` (so `"32-true"` also turns float64
parameters into float32), `*-mixed` returns it as it is. This module is that body, which methods of
which release get it, and nothing else: putting a wrapper on a class and taking it off again is
`fsdp_shim.patching`; when that happens is `fsdp_shim.integration`. (This text is also the "what is
wrapped" section of docs/how-it-works.md.)

What the shim wraps, per release, in the Trainer's namespaces (`lightning.pytorch`, `pytorch_lightning`)
and Fabric's (`lightning.fabric`, `lightning_fabric`), each gated and patched on its own:

| Lightning | Trainer | Fabric |
|---|---|---|
| 2.0.x | nothing: FSDP accepts only the mixed precisions | nothing |
| 2.1.0 | `convert_module` on `FSDPPrecisionPlugin`; `connect`, `setup` on `FSDPStrategy` | `convert_module` |
| 2.1.1-2.1.4 | `convert_module` on `FSDPPrecision`; `connect`, `setup` on `FSDPStrategy` | `convert_module` |
| 2.2.0-2.4.x | `convert_module` on `FSDPPrecision` | `convert_module` |
| 2.5.0rc0 and on | nothing: fixed upstream | nothing |

(Fabric's is always `FSDPPrecision.convert_module`.)

**Why 2.1.x needs more than the method.** From 2.2.0 (PR #19061) the Trainer calls
`precision_plugin.convert_module(model)` in `FSDPStrategy.setup`, after `configure_model` and the
`setup()` hook have built every layer and just before the FSDP wrap; Fabric calls it in
`setup`/`setup_module` before the wrap in every release. So on 2.2.0-2.4.x the missing method is all
there is to add. 2.1.x calls it only in `Strategy.connect`, *before* the `setup()` hook and
`configure_model`. With the method alone, layers added in those hooks stay float32, and worse:
`connect` casts the `__init__` layers to bf16, `configure_model` then adds a float32 layer, and FSDP
refuses the model ("Must flatten tensors with uniform dtype"). So on 2.1.x the shim also wraps
`FSDPStrategy.connect` (inherited from `Strategy`; the wrapper sits on `FSDPStrategy` only, so other
strategies are untouched) to hold the conversion back there, and `FSDPStrategy.setup` to convert just
before its body runs, where 2.2.0+ converts.

**Why 2.1.0 has another class name.** 2.1.1 renamed the Trainer's `FSDPPrecisionPlugin` to
`FSDPPrecision`; from 2.2.0 the old name is a deprecated *subclass*, and patching it would leave the
class the Trainer uses unfixed, so the old name is used on 2.1.0 only.

Each wrapper body has wrapt's signature `(wrapped, instance, args, kwargs)`. `wrapped` is whatever the
class held or inherited: Lightning's method, or another library's wrapper of it, which therefore still
runs. When the shim's own glue fails (an attribute a future Lightning renamed), a body raises
`GlueError` *before* changing anything and the wrapper falls back to `wrapped`; errors from the user's
model or from `Module.to` propagate exactly as they would on 2.5.0.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from packaging.version import InvalidVersion, Version

from _fsdp_shim_startup import LIGHTNING_NAMESPACES
from fsdp_shim import failures, rank_check

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------- which releases
Release = tuple[int, int, int]

FIRST_AFFECTED: Release = (2, 1, 0)
"""2.1.0 added the "true" precisions to FSDP; 2.0.x rejects them, so there is nothing to fix."""

FIRST_FIXED: Release = (2, 5, 0)
"""Lightning PR #20323 first shipped in 2.5.0rc0."""

FIRST_CONVERTING_IN_SETUP: Release = (2, 2, 0)
"""Lightning PR #19061 moved the Trainer's ``convert_module`` call into ``FSDPStrategy.setup``."""

FIRST_WITH_FSDP_PRECISION: Release = (2, 1, 1)
"""2.1.1 renamed the Trainer's ``FSDPPrecisionPlugin`` to ``FSDPPrecision`` (see the module's docstring)."""


def base_release(version: str) -> Release | None:
    """``(major, minor, micro)`` of a version string, or ``None`` if it is not PEP 440.

    Releases are compared on their base version: ``2.5.0rc0``, ``2.5.0.dev1``, ``2.4.0.post1`` and
    ``2.4.0+cu121`` count as 2.5.0, 2.5.0, 2.4.0 and 2.4.0. A plain PEP 440 comparison would put
    ``2.5.0rc0`` before ``2.5.0`` and call it affected, though the fix is already in it.
    """
    try:
        release = Version(version).release
    except (InvalidVersion, TypeError):
        return None
    padded = (*release, 0, 0)[:3]
    return (padded[0], padded[1], padded[2])


def is_affected_release(version: str) -> bool:
    """Whether a Lightning version lacks the fix. Half of the decision to patch: the other half is
    what the classes hold (``fsdp_shim.integration``)."""
    release = base_release(version)
    return release is not None and FIRST_AFFECTED <= release < FIRST_FIXED


def converts_only_in_connect(version: str) -> bool:
    """Whether this release's Trainer converts in ``Strategy.connect`` (2.1.x, see the module's docstring)."""
    release = base_release(version)
    return release is not None and FIRST_AFFECTED <= release < FIRST_CONVERTING_IN_SETUP


def has_fsdp_precision_class(version: str) -> bool:
    """Whether the Trainer's FSDP precision class is called ``FSDPPrecision`` (2.1.1 on)."""
    release = base_release(version)
    return release is None or release >= FIRST_WITH_FSDP_PRECISION


def unaffected_reason(version: str) -> str:
    """Why a release that ``is_affected_release`` rejects needs nothing (``status()``, ``verify``)."""
    release = base_release(version)
    if release is not None and release < FIRST_AFFECTED:
        return f"Lightning {version} has no 'true' precisions for FSDP; nothing to fix"
    return f"Lightning {version} already contains the fix (Lightning #20323, 2.5.0); left untouched"


# ----------------------------------------------------------------------------- which methods
Kind = Literal["trainer", "fabric"]
Conversion = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Namespace:
    """One importable copy of Lightning's Trainer or Fabric code (``LIGHTNING_NAMESPACES``, which the
    start-up code reads without importing this package)."""

    name: str
    kind: Kind


NAMESPACES: tuple[Namespace, ...] = tuple(Namespace(name, kind) for name, kind in LIGHTNING_NAMESPACES)  # type: ignore[arg-type]


def namespace_named(name: str) -> Namespace:
    for namespace in NAMESPACES:
        if namespace.name == name:
            return namespace
    raise KeyError(name)


@dataclass(frozen=True)
class PatchTarget:
    """A method on a Lightning class that the shim wraps.

    ``inherited`` says how Lightning ships it: ``True``, the class inherits it (the shim puts a
    wrapper of the inherited function on the class, and removing it restores inheritance); ``False``,
    the class defines it (the shim replaces it with a wrapper of it, and puts it back on removal).
    """

    module: str
    class_name: str
    attribute: str
    inherited: bool
    conversion: Conversion

    def module_in(self, namespace: Namespace) -> str:
        return f"{namespace.name}.{self.module}"

    def label(self, namespace: Namespace) -> str:
        return f"{self.module_in(namespace)}.{self.class_name}.{self.attribute}"


def patch_plan(namespace: Namespace, version: str) -> tuple[PatchTarget, ...]:
    """The targets that make an affected release behave like 2.5.0 (the module docstring's table).

    Every target is resolved and checked before anything is changed (``fsdp_shim.integration``), so a
    Lightning that renamed one is left untouched, with a warning, instead of half-patched.
    """
    precision = precision_convert_module(namespace, version)
    if namespace.kind == "trainer" and converts_only_in_connect(version):
        connect = PatchTarget("strategies.fsdp", "FSDPStrategy", "connect", True, connect_without_early_conversion)
        setup = PatchTarget("strategies.fsdp", "FSDPStrategy", "setup", False, convert_before_setup)
        return (precision, connect, setup)
    return (precision,)


def precision_convert_module(namespace: Namespace, version: str) -> PatchTarget:
    """2.5.0's ``FSDPPrecision.convert_module``, on the class the release uses: 2.1.0's Trainer names
    it ``FSDPPrecisionPlugin``, and a release without ``FSDPPrecision`` fails loudly."""
    trainer_2_1_0 = namespace.kind == "trainer" and not has_fsdp_precision_class(version)
    return PatchTarget(
        module="plugins.precision.fsdp",
        class_name="FSDPPrecisionPlugin" if trainer_2_1_0 else "FSDPPrecision",
        attribute="convert_module",
        inherited=True,
        conversion=convert_module_as_in_2_5,
    )


# ----------------------------------------------------------------------------- the wrapper bodies
class GlueError(Exception):
    """The shim's own glue failed inside a wrapper (a Lightning attribute it reads was renamed).

    Raised before anything was changed, so the wrapper can fall back to calling Lightning's method as
    it was found.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")


NUMERICS_PAGE = "docs/numerics.md ('16-true keeps weights in float16')"

_conversion_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_shim_conversion_deferred", default=False
)
"""True while 2.1.x's ``Strategy.connect`` runs for an FSDP strategy (see the module's docstring)."""


def true_precision_dtype(precision_plugin: Any) -> torch.dtype | None:
    """The dtype 2.5.0 casts the module to, or ``None`` where 2.5.0 leaves it alone: every ``*-true``
    precision casts (``"32-true"`` included, which turns float64 parameters into float32);
    ``*-mixed`` does not."""
    if "true" in precision_plugin.precision:
        dtype: torch.dtype = precision_plugin._desired_input_dtype
        return dtype
    return None


def convert_module_as_in_2_5(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``FSDPPrecision.convert_module`` as Lightning 2.5.0 defines it, then the check that every rank
    of the job converted too (``fsdp_shim.rank_check``).

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
        failures.warn_once_on_rank_zero(
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
    """2.1.x's ``Strategy.connect`` for FSDP, with the injected conversion held back: 2.2.0's timing,
    for FSDP only (every other strategy's inherited ``connect`` is untouched)."""
    token = _conversion_deferred.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _conversion_deferred.reset(token)


def convert_before_setup(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """2.2.0's call site in 2.1.x's ``FSDPStrategy.setup``, before the FSDP wrap.

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
