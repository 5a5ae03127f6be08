"""What each fix wraps, per Lightning release, and the code that runs in the wrappers.

**The cast** (2.1.0-2.4.x): those releases' `FSDPPrecision` inherits the identity `convert_module`, so
the model is never cast to the "true" precision's dtype before FSDP wraps it. The shim adds the body of
Lightning PR #20323 (2.5.0rc0): every `*-true` precision casts with `module.to(dtype=...)`, `*-mixed`
returns the module as it is.

**The recompute** (every release from 2.1.0): the "true" precisions set the default dtype only around
the forward, so activation checkpointing recomputes a block in float32 that its forward ran in bfloat16
(`CheckpointError`, a dtype mismatch, or with reentrant checkpointing other gradients). torch's
checkpoint restores autocast, RNG and device context for the recompute but not the default dtype: the
shim wraps what every checkpoint goes through, `CheckpointFunction.forward` (reentrant) and the
non-reentrant generator (`_checkpoint_without_reentrant_generator_impl` from torch 2.14,
`_checkpoint_without_reentrant_generator` before; the composable checkpoint of FSDP2 holds its own
reference, wrapped too), and pins the checkpointed function to the default dtype of its forward. That
covers every checkpoint (Lightning's policy, the user's own, a loss checkpointed outside the forward),
precision and backward call, and changes nothing where the dtype did not change. (Running the backward
in the forward's context, tried first, recomputed a loss checkpointed outside the forward in the wrong
dtype and changed backward hooks; a `context_fn` reaches only Lightning's policy, non-reentrant.)
These are private names, so a wrapper is a guess about torch's call path: the fix counts as in effect
for a path only once `recompute_check` has seen torch's recompute of it call the pinned function on the
torch in hand; a torch whose checkpoint restores the default dtype itself gets no wrapper for that path
(`recompute_check.restored_by_torch`, docs/upstream.md). The pin itself is `_fsdp_shim.pins`.

**The rank check** is no fix but is patched like one (`RANK_CHECK`) wherever the shim is active: at
the end of `FSDPStrategy.setup_environment`, every rank says which fixes it runs (`_fsdp_shim.rank_check`).

| Lightning | cast, Trainer | cast, Fabric | recompute | rank check |
|---|---|---|---|---|
| 2.0.x | nothing | nothing | nothing | nothing |
| 2.1.x | convert; `connect`, `setup`, `_setup_model` | convert; `setup_module` | checkpoint | `setup_environment` |
| 2.2.0-2.4.x | convert; `_setup_model` | convert; `setup_module` | checkpoint | `setup_environment` |
| 2.5.0 and on | nothing: fixed upstream | nothing | checkpoint | `setup_environment` |

("convert": the FSDP precision class's `convert_module`, `FSDPPrecisionPlugin` in 2.1.0's Trainer; the
other methods are `FSDPStrategy`'s; "checkpoint": torch's functions above.)

**2.1.x** calls `convert_module` only in `Strategy.connect`, before the `setup()` hook and
`configure_model` build their layers (2.2.0, PR #19061, moved it into `FSDPStrategy.setup`, just before
the wrap): the layers built later stay float32 and FSDP refuses the mix ("Must flatten tensors with
uniform dtype"). So the shim holds the conversion back in `FSDPStrategy.connect` (the wrapper sits on
`FSDPStrategy` only) and converts at the start of `FSDPStrategy.setup`. **2.1.0** names the Trainer's
class `FSDPPrecisionPlugin`; from 2.2.0 that name is a deprecated subclass, so it is used on 2.1.0 only.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from _fsdp_shim import failures, pins, rank_check, recompute_check, wrappers
from _fsdp_shim.config import CAST, NAMESPACES, RANK_CHECK, RECOMPUTE, Fix, Release, base_release
from _fsdp_shim.recompute_check import COMPOSABLE, NON_REENTRANT, REENTRANT
from _fsdp_shim.status import NOT_NEEDED_ON_TORCH
from _fsdp_shim.wrappers import Args, GlueError, Kwargs, NotNeeded, Plan, Proof, Target

if TYPE_CHECKING:
    import torch

FIRST_CONVERTING_IN_SETUP: Release = (2, 2, 0)  # PR #19061 (see above)
FIRST_WITH_NEW_CLASS_NAMES: Release = (2, 1, 1)  # FSDPPrecisionPlugin, HalfPrecisionPlugin renamed
NUMERICS_PAGE = "docs/numerics.md ('16-true keeps weights in float16')"


# ----------------------------------------------------------------------------- which methods
def converts_only_in_connect(version: str) -> bool:
    """Whether this release's Trainer converts in ``Strategy.connect`` (2.1.x, see above)."""
    release = base_release(version)
    return release is not None and CAST.first_affected <= release < FIRST_CONVERTING_IN_SETUP


def has_new_class_names(version: str) -> bool:
    """Whether the Trainer's precision classes are ``FSDPPrecision`` and ``HalfPrecision`` (2.1.1 on)."""
    release = base_release(version)
    return release is None or release >= FIRST_WITH_NEW_CLASS_NAMES


def precision_class(namespace: str, version: str) -> str:
    """The name of the release's FSDP precision class (see above)."""
    old = NAMESPACES[namespace] == "trainer" and not has_new_class_names(version)
    return "FSDPPrecisionPlugin" if old else "FSDPPrecision"


def cast_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """2.5.0's ``FSDPPrecision.convert_module``; the strategy's FSDP wrap, which puts back the modules FSDP
    keeps in full precision; and on 2.1.x the Trainer's conversion moved to setup."""
    plugin = precision_class(namespace, version)
    convert = Target("plugins.precision.fsdp", plugin, "convert_module", True, convert_module_as_in_2_5)
    if NAMESPACES[namespace] == "fabric":
        return (convert, Target("strategies.fsdp", "FSDPStrategy", "setup_module", False, keep_float32_where_fsdp_does))
    wrap = Target("strategies.fsdp", "FSDPStrategy", "_setup_model", False, keep_float32_where_fsdp_does)
    if converts_only_in_connect(version):
        connect = Target("strategies.fsdp", "FSDPStrategy", "connect", True, connect_without_early_conversion)
        setup = Target("strategies.fsdp", "FSDPStrategy", "setup", False, convert_before_setup)
        return (convert, wrap, connect, setup)
    return (convert, wrap)


def recompute_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """What the running torch's checkpoints call (see above), shared by every namespace: the reentrant
    ``CheckpointFunction.forward``, the newest generator torch defines, and the composable checkpoint's
    own reference to it, where torch has one; none for a path whose recompute torch puts in the forward's
    dtype itself (``recompute_check.restored_by_torch``), and nothing at all where it does for every path."""
    import torch.utils.checkpoint  # imported already by Lightning

    own = recompute_check.restored_by_torch()
    if own >= set(recompute_check.paths()):
        raise NotNeeded(
            f"{NOT_NEEDED_ON_TORCH}{torch.__version__}: its checkpoint restores the forward's default dtype for "
            "every recompute itself; torch left untouched"
        )
    generator = recompute_check.generator_name(torch.utils.checkpoint)
    checkpoint, composable = recompute_check.CHECKPOINT_MODULE, recompute_check.COMPOSABLE_MODULE
    targets = []
    if REENTRANT not in own:
        targets.append(
            Target(checkpoint, "CheckpointFunction", "forward", False, reentrant_in_forward_dtype, True, REENTRANT)
        )
    if NON_REENTRANT not in own:
        targets.append(Target(checkpoint, "", generator, False, non_reentrant_in_forward_dtype, True, NON_REENTRANT))
    module = recompute_check.composable_module()
    if COMPOSABLE not in own and module is not None and generator in vars(module):
        targets.append(Target(composable, "", generator, False, non_reentrant_in_forward_dtype, True, COMPOSABLE))
    return tuple(targets)


def rank_check_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """The strategy's ``setup_environment``, which creates the process group (``_fsdp_shim.rank_check``)."""
    return (Target("strategies.fsdp", "FSDPStrategy", "setup_environment", False, confirm_every_rank_after_setup),)


PLANS: dict[str, Plan] = {
    CAST.name: cast_targets,
    RECOMPUTE.name: recompute_targets,
    RANK_CHECK.name: rank_check_targets,
}
"""Each fix's targets, by fix name (``_fsdp_shim.config.FIXES`` lists the fixes), and the rank check's."""


def plan_of(fix: Fix) -> Plan:
    return PLANS[fix.name]


# ----------------------------------------------------------------------------- the cast
_was_float32: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Modules whose own floating-point parameters were float32 before the cast (see ``keep_float32_where_fsdp_does``)."""

_conversion_deferred: ContextVar[bool] = ContextVar("fsdp_shim_conversion_deferred", default=False)
"""True while 2.1.x's ``Strategy.connect`` runs for an FSDP strategy (see above)."""


def namespace_of(instance: Any) -> str:
    """The Lightning namespace (``lightning.pytorch``, ``lightning_fabric``, ...) of a plugin or strategy:
    that of the first class in its MRO that Lightning defines (a user's subclass is defined elsewhere)."""
    modules = [klass.__module__ for klass in type(instance).__mro__]
    found = (name for module in modules for name in NAMESPACES if module == name or module.startswith(name + "."))
    return next(found, type(instance).__module__)


def convert_module_as_in_2_5(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """``FSDPPrecision.convert_module`` as Lightning 2.5.0 defines it. The wrapped method is the identity
    every affected class inherits from ``Precision`` (calling it first changes nothing), or another
    library's wrapper of it, whose code runs too."""
    if instance is None or _conversion_deferred.get():
        return wrapped(*args, **kwargs)
    try:  # every "*-true" precision casts ("32-true" turns float64 parameters into float32), "*-mixed" not
        dtype = instance._desired_input_dtype if "true" in instance.precision else None
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
    changes = any(p.dtype != dtype for p in module.parameters() if p.is_floating_point())
    module = module.to(dtype=dtype)
    if changes:
        with contextlib.suppress(Exception):  # a log line: never the reason a cast that worked is undone
            _confirm_cast(namespace_of(instance), dtype)
    return module


def _confirm_cast(namespace: str, dtype: torch.dtype) -> None:
    """The confirmation line where the cast is the first fix to act (before the first forward). It names only
    what acted: the recompute acts later, and only in a run that checkpoints (``fsdp-shim status`` says
    whether it is in effect)."""
    version = getattr(sys.modules.get(namespace), "__version__", "?")
    name = str(dtype).removeprefix("torch.")
    failures.confirm(f"cast acted ({namespace} {version}: the model cast to {name} before FSDP wraps it)")


def keep_float32_where_fsdp_does(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The strategy's FSDP wrap, after putting back to float32 the modules FSDP runs in full precision.
    With an ``auto_wrap_policy``, FSDP wraps the classes its ``MixedPrecision`` ignores (``_BatchNorm`` by
    default) into units of their own, with mixed precision off and hooks that cast their inputs to float32:
    their weights must be float32. Unpatched 2.1-2.4 kept them so; 2.5.0's cast makes them bfloat16 and
    the first forward fails ("mixed dtype (CPU): expect parameter to have scalar type of Float"; 2.5+ fails
    the same way). Without a policy they share the root's flat parameter and must have its dtype, so the
    cast cannot decide this: the wrap, which knows the policy, does, and only for modules that were
    float32 before the cast. A model that trained unpatched keeps training."""
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


def connect_without_early_conversion(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """2.1.x's ``Strategy.connect`` for FSDP, with the injected conversion held back: 2.2.0's timing,
    for FSDP only (every other strategy's inherited ``connect`` is untouched)."""
    token = _conversion_deferred.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _conversion_deferred.reset(token)


def convert_before_setup(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """2.2.0's call site in 2.1.x's ``FSDPStrategy.setup``, before the FSDP wrap. 2.2.0+ converts after
    ``accelerator.setup`` and the SyncBatchNorm conversion; converting first is equivalent because neither
    touches parameter dtypes (the SyncBatchNorm conversion reuses the same parameter tensors)."""
    try:
        model = instance.model
        convert_module = instance.precision_plugin.convert_module
    except Exception as error:
        raise GlueError(error) from error
    if model is not None:
        instance.model = convert_module(model)
    return wrapped(*args, **kwargs)


# ----------------------------------------------------------------------------- the recompute
def reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """``CheckpointFunction.forward(ctx, run_function, preserve_rng_state, *args)`` with
    ``run_function`` pinned: its backward recomputes through ``ctx.run_function``, the pinned one."""
    if len(args) < 2 or not callable(args[1]):
        raise GlueError(TypeError(f"expected (ctx, run_function, ...), got {len(args)} positional arguments"))
    _check_again_if_due()
    return wrapped(args[0], pins.in_forward_dtype(args[1]), *args[2:], **kwargs)


def non_reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The non-reentrant generator (``fn`` first, in every release's signature) with ``fn`` pinned:
    ``checkpoint`` and the composable checkpoint run the forward themselves and hand ``fn`` to the
    generator only for the recompute."""
    if not args or not callable(args[0]):
        raise GlueError(TypeError("expected the checkpointed function as the first positional argument"))
    _check_again_if_due()
    return wrapped(pins.in_forward_dtype(args[0]), *args[1:], **kwargs)


def _check_again_if_due() -> None:
    """A checkpoint path whose check could not run before (a context it ran in) is checked again from a
    checkpoint call, in the check's own thread, at most every few seconds; never from the check itself or
    from code being traced."""
    if wrappers.has_unsettled_checks() and not pins.checking.get():
        import torch

        if not pins.tracing(torch):
            wrappers.recheck(force=False)


def confirm_every_rank_after_setup(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The FSDP strategy's ``setup_environment``, which creates the process group, then the check that
    every rank runs the same fixes, for "bf16-true" and "16-true" (where the fixes change anything). Whether
    the group was created here decides whether a joined rank's silence may end the wait early."""
    try:
        plugin = instance.precision_plugin if hasattr(instance, "precision_plugin") else instance.precision
        dtype = plugin._desired_input_dtype if plugin.precision in ("bf16-true", "16-true") else None
        namespace = namespace_of(instance)
        joined_before = rank_check.process_group_exists()
    except Exception as error:
        raise GlueError(error) from error
    result = wrapped(*args, **kwargs)
    if dtype is not None:
        rank_check.confirm_every_rank(namespace, dtype, joined_here=not joined_before)
    return result


PROOFS: dict[str, Proof] = {RECOMPUTE.name: recompute_check.prove}
"""The fixes that live on private names of torch, and how each shows it works (``wrappers.patch``)."""
