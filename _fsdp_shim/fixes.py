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
only once `prove_recompute` has seen each path recompute in its forward's dtype on the torch in hand.

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
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from _fsdp_shim import failures, rank_check, wrappers
from _fsdp_shim.config import CAST, NAMESPACES, RANK_CHECK, RECOMPUTE, Fix, Release, base_release
from _fsdp_shim.wrappers import Args, GlueError, Kwargs, Plan, Target

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


CHECKPOINT_MODULE = "torch.utils.checkpoint"
COMPOSABLE_MODULE = "torch.distributed._composable.checkpoint_activation"
GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")
"""The non-reentrant generator's names, newest first: torch 2.14 calls the first and keeps the second
as an alias that calls it; torch 2.1-2.13 have the second only."""


def recompute_targets(namespace: str, version: str) -> tuple[Target, ...]:
    """What the running torch's checkpoints call (see above), shared by every namespace: the reentrant
    ``CheckpointFunction.forward``, the newest generator torch defines, and the composable checkpoint's
    own reference to it, where torch has one."""
    import torch.utils.checkpoint  # imported already by Lightning

    generator = next((name for name in GENERATORS if hasattr(torch.utils.checkpoint, name)), GENERATORS[-1])
    targets = [
        Target(CHECKPOINT_MODULE, "CheckpointFunction", "forward", False, reentrant_in_forward_dtype, True),
        Target(CHECKPOINT_MODULE, "", generator, False, non_reentrant_in_forward_dtype, True),
    ]
    composable = _composable_checkpoint_module()
    if composable is not None and generator in vars(composable):
        targets.append(Target(COMPOSABLE_MODULE, "", generator, False, non_reentrant_in_forward_dtype, True))
    return tuple(targets)


def _composable_checkpoint_module() -> ModuleType | None:
    """The composable checkpoint's module, where this torch has one (``torch.distributed.fsdp``, which
    Lightning imports, imports it already)."""
    import torch

    if not torch.distributed.is_available():
        return None
    try:
        return importlib.import_module(COMPOSABLE_MODULE)
    except ImportError:
        return None


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
    """The confirmation line where the cast is the first fix to act (before the first forward); it says
    whether the recompute is in effect too, which acts only later, in the first checkpointed backward."""
    version = getattr(sys.modules.get(namespace), "__version__", "?")
    recompute = wrappers.status(namespace, RECOMPUTE)
    also = "in effect for activation-checkpointed blocks" if recompute.patched else f"off ({recompute.reason})"
    _confirm(
        f"cast acted ({namespace} {version}: the model cast to {_name(dtype)} before FSDP wraps it); recompute {also}"
    )


_confirmed = False
"""Whether this process has said its confirmation line (read first on every pin: the line costs nothing after)."""


def _confirm(what: str) -> None:
    """One line on rank zero, once per process, the first time a fix changes something (docs/configuration.md,
    "Logging"): what the job's own log shows of the shim. A run where nothing applies (float32) says nothing."""
    global _confirmed
    from _fsdp_shim._version import __version__

    _confirmed = True
    failures.announce_once_on_rank_zero("active", "fsdp-shim %s: active; %s", __version__, what)


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


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
@dataclass
class _Pin:
    thread: int
    dtype: torch.dtype
    before: torch.dtype
    """The default dtype when it started: what its end puts back (handed to the pin above it if that is
    still running when this one ends)."""


class _Pins:
    """Pinned calls running now, for the whole process: torch's default dtype is one global, and two
    threads' backwards (autograd's per-device threads, two models trained in two threads) can recompute
    at once. A call whose dtype is already the default while nothing is pinned runs untouched (a forward,
    a run whose dtype never changes). Otherwise each pin notes the dtype it replaced, and the newest's
    end puts that back, unless other code changed the dtype meanwhile (then it leaves theirs); a pin that
    ends under a newer one hands its note up, so the dtype the first one replaced is the one restored,
    whatever order they end in. Two threads' pins that overlap in different dtypes cannot both have
    theirs: said once (``FSDPShimWarning``) instead of passing silently."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the list and every change of the dtype it makes
        self._running: list[_Pin] = []

    def reset(self) -> None:
        """In a forked child: the parent's other threads and their pins are not there."""
        self.__init__()  # type: ignore[misc]

    def call(self, dtype: torch.dtype, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pin = self._enter(dtype)
        try:
            if pin is not None and not _confirmed and pin.before != dtype and not _checking.get():
                _confirm(
                    f"recompute acted (a checkpointed block recomputed in {_name(dtype)}, its forward's dtype, "
                    f"not {_name(pin.before)})"
                )
            return function(*args, **kwargs)
        finally:
            if pin is not None:
                self._leave(pin)

    def _enter(self, dtype: torch.dtype) -> _Pin | None:
        import torch

        with self._lock:
            current = torch.get_default_dtype()
            if current == dtype and not self._running:
                return None
            pin = _Pin(threading.get_ident(), dtype, current)
            clash = any(other.dtype != dtype and other.thread != pin.thread for other in self._running)
            self._running.append(pin)
            if current != dtype:
                torch.set_default_dtype(dtype)
        if clash:
            failures.warn_once(
                "fsdp-shim: two activation-checkpointed recomputes ran at once in different default dtypes "
                "(two threads' backwards); torch's default dtype is one for the whole process, so one of them "
                "ran in the other's dtype. The default dtype is put back when both end. See docs/how-it-works.md "
                "('Threads').",
                key="recompute:threads",
            )
        return pin

    def _leave(self, pin: _Pin) -> None:
        import torch

        with self._lock:
            index = next(i for i, other in enumerate(self._running) if other is pin)
            del self._running[index]
            if index < len(self._running):  # a newer pin runs on: it puts back what this one replaced
                self._running[index].before = pin.before
            elif torch.get_default_dtype() == pin.dtype and pin.before != pin.dtype:
                torch.set_default_dtype(pin.before)


_pins = _Pins()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pins.reset)
_checking: ContextVar[bool] = ContextVar("fsdp_shim_checking_recompute", default=False)
"""True while ``prove_recompute`` runs: its recomputes are the shim's own, not the job's."""


def in_forward_dtype(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, to be run later in the default dtype current now (the checkpointed forward's, for its
    recompute). Where the dtype is the same then (the forward itself, or any run whose default dtype never
    changes), nothing changes the dtype. Code that ``torch.compile`` traces (dynamo, or a proxy-tracing
    mode such as compiled autograd's) is left as torch makes it: a dtype switch there would be traced."""
    import torch  # imported already by Lightning; not at the top, so importing this module does not

    dtype = torch.get_default_dtype()

    def run_in_forward_dtype(*args: Any, **kwargs: Any) -> Any:
        if _tracing(torch):
            return function(*args, **kwargs)
        return _pins.call(dtype, function, *args, **kwargs)

    return run_in_forward_dtype


def _tracing(torch: Any) -> bool:
    """Whether this thread's code is being traced: ``is_dynamo_compiling`` is true only inside code dynamo
    traces (``is_compiling`` is set for the whole process while any thread compiles), and a proxy dispatch
    mode is on while FX traces (compiled autograd). Where torch has neither, nothing is traced here."""
    dynamo = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)
    if dynamo is not None and dynamo():
        return True
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    return key is not None and get_mode is not None and get_mode(key) is not None


def reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """``CheckpointFunction.forward(ctx, run_function, preserve_rng_state, *args)`` with
    ``run_function`` pinned: its backward recomputes through ``ctx.run_function``, the pinned one."""
    if len(args) < 2 or not callable(args[1]):
        raise GlueError(TypeError(f"expected (ctx, run_function, ...), got {len(args)} positional arguments"))
    return wrapped(args[0], in_forward_dtype(args[1]), *args[2:], **kwargs)


def non_reentrant_in_forward_dtype(wrapped: Callable[..., Any], instance: Any, args: Args, kwargs: Kwargs) -> Any:
    """The non-reentrant generator (``fn`` first, in every release's signature) with ``fn`` pinned:
    ``checkpoint`` and the composable checkpoint run the forward themselves and hand ``fn`` to the
    generator only for the recompute."""
    if not args or not callable(args[0]):
        raise GlueError(TypeError("expected the checkpointed function as the first positional argument"))
    return wrapped(in_forward_dtype(args[0]), *args[1:], **kwargs)


class _StopRecompute(Exception):
    """Ends the reentrant check inside its recompute, before torch's backward would run the autograd engine."""


def prove_recompute() -> str | None:
    """Show, on the torch in hand, that each checkpoint path recomputes in its forward's dtype: ``None``,
    or what was found instead. Each path checkpoints ``x * x`` of a one-element tensor with the forward
    in one default dtype, then reads the recompute's default dtype in another (a millisecond or two).
    No backward runs: reading a saved tensor of the non-reentrant checkpoint recomputes it, and the
    reentrant backward is stopped inside its recompute, so the autograd engine never starts (an engine
    started before a fork breaks autograd in the forked children)."""
    import torch
    import torch.utils.checkpoint as checkpoint

    before = torch.get_default_dtype()
    forward = torch.float64 if before != torch.float64 else torch.float32
    seen: list[torch.dtype] = []
    reentrant = False  # the path being checked (read by the closures below)

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_default_dtype())
        if len(seen) > 1 and reentrant:
            raise _StopRecompute
        return x * x

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return block(x)

    def recompute(path: str) -> None:
        x = torch.ones(1, dtype=forward, device="cpu", requires_grad=True)
        if path == "composable":
            module = Block()
            _composable_checkpoint_module().checkpoint(module)  # type: ignore[union-attr]
            out = _pins.call(forward, module, x)
        else:
            out = _pins.call(
                forward, checkpoint.checkpoint, block, x, use_reentrant=reentrant, preserve_rng_state=False
            )
        if reentrant:
            with contextlib.suppress(_StopRecompute):
                out.grad_fn.apply(torch.ones_like(out))
        else:
            out.grad_fn._saved_self  # noqa: B018 (reading it recomputes)

    composable = _composable_checkpoint_module()
    paths = ["reentrant", "non-reentrant"] + (["composable"] if hasattr(composable, "checkpoint") else [])
    wrong = []
    for path in paths:
        reentrant = path == "reentrant"
        seen.clear()
        token = _checking.set(True)
        try:  # with autograd on, whatever context imported Lightning (no_grad, inference_mode)
            with torch.inference_mode(False), torch.enable_grad():
                recompute(path)
        except Exception as error:
            wrong.append(f"the {path} check raised {type(error).__name__}: {error}")
            continue
        finally:
            _checking.reset(token)
        if seen[1:] != [forward]:
            found = ", ".join(_name(dtype) for dtype in seen[1:]) or "no recompute"
            wrong.append(f"the {path} checkpoint recomputed in {found}, not its forward's {_name(forward)}")
    if not wrong:
        return None
    return f"not in effect on torch {torch.__version__} ({'; '.join(wrong)})"


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


PROOFS: dict[str, Callable[[], str | None]] = {RECOMPUTE.name: prove_recompute}
"""The fixes that live on private names of torch, and how each shows it works (``wrappers.patch``)."""
