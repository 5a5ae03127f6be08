"""What each fix wraps, per Lightning release (docs/how-it-works.md, "What is wrapped"), and its wrappers' code."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from _fsdp_shim import log, rank_check, recompute_check
from _fsdp_shim.config import CAST, NAMESPACES, RANK_CHECK, RECOMPUTE, base_release, rank_check_timeout
from _fsdp_shim.recompute_check import COMPOSABLE, NON_REENTRANT, REENTRANT
from _fsdp_shim.wrappers import Args, GlueError, Kwargs, NotNeeded, Plan, Target

if TYPE_CHECKING:
    import torch

FIRST_CONVERTING_IN_SETUP = (2, 2, 0)  # PR #19061: 2.1.x converts in Strategy.connect, before configure_model
FIRST_WITH_NEW_CLASS_NAMES = (2, 1, 1)  # 2.1.0's Trainer names it FSDPPrecisionPlugin
FIRST_WITH_MODEL_PARALLEL = (2, 3, 0)
TRUE_PRECISIONS = ("bf16-true", "16-true")


def cast_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """2.5.0's ``convert_module``, the FSDP wrap (float32 where FSDP keeps it) and on 2.1.x conversion in ``setup``."""
    release, trainer = base_release(version) or (0, 0, 0), NAMESPACES[namespace] == "trainer"
    plugin = "FSDPPrecisionPlugin" if trainer and release < FIRST_WITH_NEW_CLASS_NAMES else "FSDPPrecision"
    strategy = "strategies.fsdp"
    convert = Target("plugins.precision.fsdp", plugin, "convert_module", convert_module_as_in_2_5, inherited=True)
    if not trainer:
        return (convert, Target(strategy, "FSDPStrategy", "setup_module", keep_float32_where_fsdp_does))
    wrap = Target(strategy, "FSDPStrategy", "_setup_model", keep_float32_where_fsdp_does)
    if release >= FIRST_CONVERTING_IN_SETUP:
        return (convert, wrap)
    connect = Target(strategy, "FSDPStrategy", "connect", connect_without_early_conversion, inherited=True)
    return (convert, wrap, connect, Target(strategy, "FSDPStrategy", "setup", convert_before_setup))


def recompute_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """What torch's checkpoints call (shared by every namespace), less the paths whose dtype torch restores itself
    and those its call path was shown to pass by."""
    import torch.utils.checkpoint

    own = recompute_check.restored_by_torch()
    if own >= set(recompute_check.paths()):
        raise NotNeeded(f"torch {torch.__version__}'s checkpoint restores the forward's default dtype itself")
    generator = recompute_check.generator_name(torch.utils.checkpoint)
    checkpoint, composable = recompute_check.CHECKPOINT_MODULE, recompute_check.COMPOSABLE_MODULE
    targets = [
        Target(checkpoint, "CheckpointFunction", "forward", reentrant_in_forward_dtype, shared=True, path=REENTRANT),
        Target(checkpoint, "", generator, non_reentrant_in_forward_dtype, shared=True, path=NON_REENTRANT),
    ]
    module = recompute_check.composable_module()
    if module is not None and generator in vars(module):
        targets.append(Target(composable, "", generator, non_reentrant_in_forward_dtype, shared=True, path=COMPOSABLE))
    passed_by = recompute_check.found(shown=False, holds=True)  # taken off once shown: never wrapped again
    return tuple(target for target in targets if target.path not in own and target.path not in passed_by)


def rank_check_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """Each strategy's ``setup_environment``, which creates the process group (DeepSpeed's calls DDP's, which the
    spawn and fork variants are); torch's ``rendezvous``, where a rank says it has the shim before it may pause."""
    strategies = [("strategies.fsdp", "FSDPStrategy"), ("strategies.ddp", "DDPStrategy")]
    if (base_release(version) or (0, 0, 0)) >= FIRST_WITH_MODEL_PARALLEL:
        strategies.append(("strategies.model_parallel", "ModelParallelStrategy"))
    setups = [Target(module, name, "setup_environment", confirm_every_rank_after_setup) for module, name in strategies]
    rendezvous = Target("torch.distributed.distributed_c10d", "", "rendezvous", present_at_rendezvous, shared=True)
    return (*setups, rendezvous)


PLANS: dict[str, Plan] = {
    CAST.name: cast_targets,
    RECOMPUTE.name: recompute_targets,
    RANK_CHECK.name: rank_check_targets,
}


# ----------------------------------------------------------------------------- the cast
_was_float32: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # whose own parameters were float32 before the cast
_conversion_deferred: ContextVar[bool] = ContextVar("fsdp_shim_conversion_deferred", default=False)  # 2.1's connect


def namespace_of(instance: Any) -> str:
    """The Lightning namespace of a plugin or strategy: that of the first Lightning class in its MRO."""
    modules = [klass.__module__ for klass in type(instance).__mro__]
    found = (name for module in modules for name in NAMESPACES if module == name or module.startswith(name + "."))
    return next(found, type(instance).__module__)


def convert_module_as_in_2_5(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """``FSDPPrecision.convert_module`` as Lightning 2.5.0 defines it, after the inherited identity (or a wrapper)."""
    if instance is None or _conversion_deferred.get():
        return wrapped(*args, **kwargs)
    try:
        dtype = instance._desired_input_dtype if "true" in instance.precision else None
    except Exception as error:
        raise GlueError(error) from error
    module = wrapped(*args, **kwargs)
    if dtype is None:
        return module
    import torch

    if dtype == torch.float16:
        from _fsdp_shim import failures  # loaded where something is said

        failures.float16_notice()
    for submodule in module.modules():
        if {p.dtype for p in submodule.parameters(recurse=False) if p.is_floating_point()} == {torch.float32}:
            _was_float32.add(submodule)
    changes = any(p.dtype != dtype for p in module.parameters() if p.is_floating_point())
    module = module.to(dtype=dtype)
    if changes:
        namespace, name = namespace_of(instance), str(dtype).removeprefix("torch.")
        version = getattr(sys.modules.get(namespace), "__version__", "?")
        log.confirm("cast", f"cast acted ({namespace} {version}: the model cast to {name} before FSDP wraps it)")
    return module


def keep_float32_where_fsdp_does(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The FSDP wrap, after putting back to float32 the modules FSDP's auto-wrap runs in full precision
    (``_BatchNorm`` by default) that were float32 before the cast: a model that trained unpatched keeps training."""
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
    """2.1.x's ``Strategy.connect`` for FSDP, its conversion held back to ``setup``, as 2.2.0 does it."""
    token = _conversion_deferred.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _conversion_deferred.reset(token)


def convert_before_setup(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """2.2.0's conversion in 2.1.x's ``FSDPStrategy.setup``, before the FSDP wrap."""
    try:
        model, convert_module = instance.model, instance.precision_plugin.convert_module
    except Exception as error:
        raise GlueError(error) from error
    if model is not None:
        instance.model = convert_module(model)
    return wrapped(*args, **kwargs)


# ----------------------------------------------------------------------------- the recompute
def reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """``CheckpointFunction.forward(ctx, run_function, ...)`` with ``run_function`` pinned for the backward."""
    if len(args) < 2 or not callable(args[1]):
        raise GlueError(TypeError(f"expected (ctx, run_function, ...), got {len(args)} positional arguments"))
    return wrapped(args[0], _pinned(args[1]), *args[2:], **kwargs)


def non_reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The non-reentrant generator with ``fn``, which it runs only for the recompute, pinned."""
    if not args or not callable(args[0]):
        raise GlueError(TypeError("expected the checkpointed function as the first positional argument"))
    return wrapped(_pinned(args[0]), *args[1:], **kwargs)


def _pinned(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` pinned to the default dtype now (``pins`` loads at the first checkpoint call), or in the check only
    marked."""
    if recompute_check.checking.get():
        return recompute_check.marked(function)
    try:
        from _fsdp_shim import pins
    except ImportError as error:
        raise GlueError(error) from error
    return pins.in_forward_dtype(function)


# ----------------------------------------------------------------------------- the rank check
def confirm_every_rank_after_setup(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The strategy's ``setup_environment``, then the check that every rank runs the same fixes (a "true" precision
    only); whether the group was created here decides whether a joined rank's silence ends the wait."""
    try:
        plugin = instance.precision_plugin if hasattr(instance, "precision_plugin") else instance.precision
        true = plugin.precision in TRUE_PRECISIONS
        dtype = (getattr(plugin, "_desired_input_dtype", None) or plugin._desired_dtype) if true else None
        namespace, joined_before = namespace_of(instance), rank_check.process_group_exists()
    except Exception as error:
        raise GlueError(error) from error
    checks = dtype is not None and not joined_before and rank_check_timeout()[0] != 0  # 0: this rank never reports
    token = rank_check.setting_up.set(checks)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        rank_check.setting_up.reset(token)
    if dtype is not None:
        rank_check.confirm_every_rank(namespace, dtype, joined_here=not joined_before)
    return result


def present_at_rendezvous(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """torch's ``rendezvous``; in a set-up the rank check follows, its store gets this rank's presence first."""
    found = wrapped(*args, **kwargs)
    return rank_check.say_present(found) if rank_check.setting_up.get() else found
