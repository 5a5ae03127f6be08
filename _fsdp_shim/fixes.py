"""THE FIXES: what each one wraps, per Lightning release, and the code that runs in the wrappers.

**The cast** (Lightning 2.1.0-2.4.x). Those releases never cast the model to the dtype of
`precision="bf16-true"` / `"16-true"` before FSDP wraps it: their `FSDPPrecision` inherits
`Precision.convert_module`, the identity. Lightning PR #20323 ("Add convert_module to FSDP", first in
2.5.0rc0) gave it a body: every `*-true` precision casts the module with
`module.to(dtype=self._desired_input_dtype)` (so `"32-true"` also turns float64 parameters into
float32), `*-mixed` returns it as it is. The shim adds that body to the releases that lack it.

**The recompute** (every release from 2.1.0; no release has a fix). The "true" precisions set the
default dtype (`torch.set_default_dtype`, Lightning's `_DtypeContextManager`) only around the forward
(`forward_context`). Activation checkpointing recomputes checkpointed blocks during the backward, where
the default dtype is float32 again, so a block that makes a tensor without an explicit dtype (a causal
mask from `torch.full`, `torch.ones`, `torch.tensor(0.25)`) makes it in bfloat16 in the forward and in
float32 in the recompute: torch's checkpoint raises `CheckpointError` (or a dtype mismatch), and
reentrant checkpointing, which checks nothing, trains on different gradients. The shim runs the
precision plugin's `backward` inside the plugin's own `forward_context()`, for `"bf16-true"` and
`"16-true"` only: the backward is where every recompute happens, whoever checkpointed the block
(Lightning's `activation_checkpointing_policy`, or `torch.utils.checkpoint` in the user's module,
reentrant or not), so one wrapper covers them all; torch keeps the default dtype process-wide, so the
autograd engine's threads see it too. A `context_fn` for the checkpoint wrapper would reach only
Lightning's policy, and only non-reentrant checkpointing. `*-mixed` (autocast, which torch's checkpoint
restores itself) and `"32-true"` are left as they are. The same wrapper goes on `HalfPrecision`, the
"true"-precision plugin of one device, DDP and the other strategies, which has the same gap: no new
mechanism, the same body. Trainer's `manual_backward` already runs inside `training_step`'s forward
context; it gets the same wrapper, which then changes nothing.

What the shim wraps, per release, in the Trainer's namespaces (`lightning.pytorch`, `pytorch_lightning`)
and Fabric's (`lightning.fabric`, `lightning_fabric`), each gated and patched on its own, fix by fix:

| Lightning | cast, Trainer | cast, Fabric | recompute, both |
|---|---|---|---|
| 2.0.x | nothing | nothing | nothing |
| 2.1.0 | `convert_module`; `FSDPStrategy.connect`, `.setup` | `convert_module` | `backward`, FSDP and half |
| 2.1.1-2.1.4 | `convert_module`; `FSDPStrategy.connect`, `.setup` | `convert_module` | `backward`, FSDP and half |
| 2.2.0-2.4.x | `convert_module` | `convert_module` | `backward`, FSDP and half |
| 2.5.0 and on | nothing: fixed upstream | nothing | `backward`, FSDP and half |

(`convert_module` is the FSDP precision class's; "FSDP and half" the FSDP and the half precision classes.)

(The Trainer's precision classes are `FSDPPrecisionPlugin` and `HalfPrecisionPlugin` on 2.1.0,
`FSDPPrecision` and `HalfPrecision` from 2.1.1; Fabric's are always the latter. Fabric's
`FSDPPrecision` defines `backward`; every other class inherits it.)

**Why 2.1.x needs more than the cast's method.** From 2.2.0 (PR #19061) the Trainer calls
`precision_plugin.convert_module(model)` in `FSDPStrategy.setup`, after `configure_model` and the
`setup()` hook have built every layer and just before the FSDP wrap; Fabric calls it in
`setup`/`setup_module` before the wrap in every release. 2.1.x calls it only in `Strategy.connect`,
*before* the `setup()` hook and `configure_model`. With the method alone, layers added in those hooks
stay float32, and worse: `connect` casts the `__init__` layers to bf16, `configure_model` then adds a
float32 layer, and FSDP refuses the model ("Must flatten tensors with uniform dtype"). So on 2.1.x the
shim also wraps `FSDPStrategy.connect` (inherited from `Strategy`; the wrapper sits on `FSDPStrategy`
only, so other strategies are untouched) to hold the conversion back there, and `FSDPStrategy.setup` to
convert just before its body runs, where 2.2.0+ converts.

**Why 2.1.0 has other class names.** 2.1.1 renamed the Trainer's `FSDPPrecisionPlugin` to
`FSDPPrecision` (and `HalfPrecisionPlugin` to `HalfPrecision`); from 2.2.0 the old names are deprecated
*subclasses*, and patching them would leave the classes the Trainer uses unfixed, so the old names are
used on 2.1.0 only.

Each wrapper body has wrapt's signature `(wrapped, instance, args, kwargs)`. `wrapped` is whatever the
class held or inherited: Lightning's method, or another library's wrapper of it, which therefore still
runs. When the shim's own glue fails (an attribute a future Lightning renamed), a body raises
`GlueError` *before* changing anything and the wrapper falls back to `wrapped`; errors from the user's
model, from `Module.to` or from the backward propagate exactly as they would without the shim.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from _fsdp_shim import failures, rank_check
from _fsdp_shim.config import CAST, NAMESPACES, RECOMPUTE, Fix, Release, base_release
from _fsdp_shim.wrappers import GlueError, Target

if TYPE_CHECKING:
    import torch

FIRST_CONVERTING_IN_SETUP: Release = (2, 2, 0)
"""Lightning PR #19061 moved the Trainer's ``convert_module`` call into ``FSDPStrategy.setup``."""
FIRST_WITH_NEW_CLASS_NAMES: Release = (2, 1, 1)
"""2.1.1 renamed the Trainer's ``FSDPPrecisionPlugin`` / ``HalfPrecisionPlugin`` (see above)."""
NUMERICS_PAGE = "docs/numerics.md ('16-true keeps weights in float16')"
HALF_PRECISIONS = ("bf16-true", "16-true")


# ----------------------------------------------------------------------------- which methods
def converts_only_in_connect(version: str) -> bool:
    """Whether this release's Trainer converts in ``Strategy.connect`` (2.1.x, see above)."""
    release = base_release(version)
    return release is not None and CAST.first_affected <= release < FIRST_CONVERTING_IN_SETUP


def has_new_class_names(version: str) -> bool:
    """Whether the Trainer's precision classes are ``FSDPPrecision`` and ``HalfPrecision`` (2.1.1 on)."""
    release = base_release(version)
    return release is None or release >= FIRST_WITH_NEW_CLASS_NAMES


def precision_class(namespace: str, version: str, kind: str = "fsdp") -> str:
    """The name of the release's FSDP (``kind="fsdp"``) or half (``"half"``) precision class."""
    old = NAMESPACES[namespace] == "trainer" and not has_new_class_names(version)
    return {"fsdp": "FSDPPrecision", "half": "HalfPrecision"}[kind] + ("Plugin" if old else "")


def cast_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """2.5.0's ``FSDPPrecision.convert_module``; the strategy's FSDP wrap, which puts back the modules FSDP
    keeps in full precision; and on 2.1.x the Trainer's conversion moved to setup."""
    convert = Target(
        "plugins.precision.fsdp", precision_class(namespace, version), "convert_module", True, convert_module_as_in_2_5
    )
    if NAMESPACES[namespace] == "fabric":
        return (convert, Target("strategies.fsdp", "FSDPStrategy", "setup_module", False, keep_float32_where_fsdp_does))
    wrap = Target("strategies.fsdp", "FSDPStrategy", "_setup_model", False, keep_float32_where_fsdp_does)
    if converts_only_in_connect(version):
        connect = Target("strategies.fsdp", "FSDPStrategy", "connect", True, connect_without_early_conversion)
        setup = Target("strategies.fsdp", "FSDPStrategy", "setup", False, convert_before_setup)
        return (convert, wrap, connect, setup)
    return (convert, wrap)


def recompute_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """``backward`` of the FSDP and the half precision plugin (Fabric's FSDP plugin defines its own)."""
    fabric = NAMESPACES[namespace] == "fabric"
    return (
        Target(
            "plugins.precision.fsdp",
            precision_class(namespace, version),
            "backward",
            not fabric,
            backward_in_forward_dtype,
        ),
        Target(
            "plugins.precision.half",
            precision_class(namespace, version, "half"),
            "backward",
            True,
            backward_in_forward_dtype,
        ),
    )


PLANS: dict[str, Callable[[str, str], tuple[Target, ...]]] = {
    CAST.name: cast_targets,
    RECOMPUTE.name: recompute_targets,
}
"""Each fix's targets, by fix name (``_fsdp_shim.config.FIXES`` lists the fixes)."""


def plan_of(fix: Fix) -> Callable[[str, str], tuple[Target, ...]]:
    return PLANS[fix.name]


# ----------------------------------------------------------------------------- the cast
_was_float32: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Modules whose own floating-point parameters were float32 before the cast (see ``keep_float32_where_fsdp_does``)."""

_conversion_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_shim_conversion_deferred", default=False
)
"""True while 2.1.x's ``Strategy.connect`` runs for an FSDP strategy (see above)."""


def true_precision_dtype(precision_plugin: Any) -> torch.dtype | None:
    """The dtype 2.5.0 casts the module to, or ``None`` where 2.5.0 leaves it alone: every ``*-true``
    precision casts (``"32-true"`` included, which turns float64 parameters into float32);
    ``*-mixed`` does not."""
    if "true" in precision_plugin.precision:
        dtype: torch.dtype = precision_plugin._desired_input_dtype
        return dtype
    return None


def namespace_of(plugin: Any) -> str:
    """The Lightning namespace (``lightning.pytorch``, ``lightning_fabric``, ...) a plugin's class is from."""
    module = type(plugin).__module__
    return next((name for name in NAMESPACES if module == name or module.startswith(name + ".")), module)


def convert_module_as_in_2_5(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``FSDPPrecision.convert_module`` as Lightning 2.5.0 defines it, then the check that every rank
    of the job runs the same fixes (``_fsdp_shim.rank_check``).

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
    import torch  # imported already by Lightning; not at the top, so importing this module does not

    for submodule in module.modules():
        if {p.dtype for p in submodule.parameters(recurse=False) if p.is_floating_point()} == {torch.float32}:
            _was_float32.add(submodule)
    module = module.to(dtype=dtype)
    rank_check.confirm_every_rank(namespace_of(instance), dtype)
    return module


def keep_float32_where_fsdp_does(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The strategy's FSDP wrap, after putting back to float32 the modules FSDP runs in full precision.

    With an ``auto_wrap_policy``, FSDP wraps the classes its ``MixedPrecision`` ignores (``_BatchNorm``
    by default) into units of their own, with mixed precision off and hooks that cast their inputs to
    float32: their weights must be float32. Unpatched 2.1-2.4 kept them so; 2.5.0's cast makes them
    bfloat16 and the first forward fails ("mixed dtype (CPU): expect parameter to have scalar type of
    Float"; 2.5+ fails the same way). Without a policy they share the root's flat parameter and must
    have its dtype, so the cast cannot decide this: the wrap, which knows the policy, does, and only for
    modules that were float32 before the cast. A model that trained unpatched keeps training.
    """
    try:
        module = args[0] if args else next(iter(kwargs.values()))
        fsdp_kwargs = instance.kwargs if hasattr(instance, "kwargs") else instance._fsdp_kwargs
        ignored = tuple(getattr(instance.mixed_precision_config, "_module_classes_to_ignore", ()))
    except Exception as error:
        raise GlueError(error) from error
    if "auto_wrap_policy" in fsdp_kwargs and ignored:
        for submodule in module.modules():
            if isinstance(submodule, ignored) and submodule in _was_float32:
                submodule.float()
    return wrapped(*args, **kwargs)


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


# ----------------------------------------------------------------------------- the recompute
def backward_in_forward_dtype(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The precision plugin's ``backward`` inside its own ``forward_context()``, for "bf16-true" and
    "16-true": the backward is where activation checkpointing recomputes, and the forward context is
    the default dtype the forward ran in (see above). Before the first backward of a process group,
    the check that every rank runs the same fixes."""
    if instance is None:
        return wrapped(*args, **kwargs)
    try:
        half = instance.precision in HALF_PRECISIONS
        context = instance.forward_context() if half else None
        dtype = instance._desired_input_dtype if half else None
    except Exception as error:
        raise GlueError(error) from error
    if context is None:
        return wrapped(*args, **kwargs)
    rank_check.confirm_every_rank(namespace_of(instance), dtype)
    with context:
        return wrapped(*args, **kwargs)
