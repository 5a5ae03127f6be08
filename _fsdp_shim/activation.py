"""``activate`` / ``deactivate`` / ``status`` in this process, and ``namespace_executed``, where the
start-up finder hands each executed Lightning namespace over. ``activate()`` (``import fsdp_shim``) arms
that finder (``_fsdp_shim.arm``) and patches what is imported already; a start-up file, ``fsdp-shim run``
or ``FSDP_SHIM=1`` arm it without importing this module, which the finder imports at the first Lightning
namespace it sees execute: the patching code (wrapt, packaging, logging) loads only then."""

from __future__ import annotations

import gc
import itertools
import os
import sys
import threading
from collections.abc import Mapping
from types import ModuleType

import _fsdp_shim as startup
from _fsdp_shim import NAMESPACES, SHIM_VARIABLE, STRICT_VARIABLE, config, failures
from _fsdp_shim._version import __version__
from _fsdp_shim.config import DISABLED_FIXES_VARIABLE, FIX_NAMES, FIXES, RANK_CHECK, RANK_CHECK_TIMEOUT_VARIABLE
from _fsdp_shim.status import FixStatus, NamespaceStatus, ShimStatus

_lock = threading.Lock()  # guards the globals below; never held while patching or importing
_active: bool | None = None
"""``None`` until the shim is activated (``activate()``, or the first hand-over) or deactivated."""
_imported_before_activation: set[str] = set()
_seen_executing: dict[str, ModuleType] = {}
"""Namespaces the finder saw execute while the shim was on (patched at their import, so never late),
with the module object: one imported again since is another matter."""
_missed: dict[str, str] = {}
"""Namespaces a finder in front of the shim's loaded: name -> who, and where the shim noticed it."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``FSDP_SHIM`` leaves the shim on. Read at activation and again at every Lightning
    namespace's import, so a value a script sets before importing Lightning takes effect. An
    unrecognised value is off: the operator's kill switch fails closed."""
    meaning = "switched the shim OFF (an unreadable kill switch fails closed)"
    return failures.read_switch(SHIM_VARIABLE, environ, meaning) in ("on", "unset")


def activate() -> bool:
    """Switch the shim on; returns whether it is on.

    Idempotent. Namespaces already imported are patched at once (the methods live on the classes,
    so existing instances are covered); the others when they are imported. Does nothing and returns
    ``False`` while ``FSDP_SHIM`` says off (or cannot be read): the variable is the operator's kill
    switch and outranks code.
    """
    global _active
    if not enabled():
        return False
    with _lock:
        _active = True
        _imported_before_activation.update(
            name for name in NAMESPACES if name in sys.modules and _seen_executing.get(name) is not sys.modules[name]
        )
    startup.arm("import fsdp_shim")  # hands over what is imported and not handed over yet
    for name in NAMESPACES:  # and what was handed over before a deactivate()
        if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", True) is False:
            _patch(name)
    _check_again()
    return True


def deactivate() -> None:
    """Switch the shim off and put back the exact objects that were on Lightning's classes.

    A wrapper of the shim's that another library has wrapped since is switched off in place instead
    (a warning says so), so that library's patch stays intact.
    """
    global _active
    with _lock:
        _active = False
    wrappers = sys.modules.get("_fsdp_shim.wrappers")
    if wrappers is None:
        return
    for name, fix in itertools.product(NAMESPACES, (*FIXES, RANK_CHECK)):
        for wrapper, where in wrappers.unpatch(name, fix):
            label, top = wrapper.shim_state.label, wrappers.found_on_top(wrapper)
            if where == "under another wrapper":
                failures.warn_once(
                    f"fsdp-shim: deactivated its wrapper on {label} in place, because other code ({top}) has "
                    "wrapped it since; it now passes every call through, and the other code's wrapper is left as it is",
                    key=f"buried:{label}",
                )
            elif where == "gone":
                failures.warn_once(
                    f"fsdp-shim: its wrapper on {label} had already been replaced by other code ({top}); nothing "
                    "of the shim's is left there to remove",
                    key=f"gone:{label}",
                )


def namespace_executed(module: ModuleType, noticed_at: str | None = None) -> None:
    """The start-up finder's hand-over (``_fsdp_shim.HAND_OVER``): a Lightning namespace has just
    executed, was imported before the finder was armed, or was loaded by a finder in front of it."""
    global _active
    name = module.__name__
    with _lock:
        if _active is None:
            _active = True  # armed at start-up: this is the activation
        if noticed_at is None and _active:
            _seen_executing[name] = module
        elif noticed_at == startup.ALREADY_IMPORTED:
            _imported_before_activation.add(name)
        elif noticed_at is not None:
            _missed.setdefault(name, f"{_finders_in_front(module)}; noticed at the import of {noticed_at}")
    _patch(name)


def _patch(name: str) -> None:
    """Patch every fix in one namespace. Nothing escapes to the user's import except what they asked
    for: a strict-mode error, or a warning they turned into an error."""
    try:
        if not _active or not enabled():
            return
        from _fsdp_shim import fixes, wrappers

        skipped, unknown = config.disabled_fixes()
        if unknown:
            failures.warn_once(
                f"fsdp-shim: {DISABLED_FIXES_VARIABLE} names {', '.join(map(repr, unknown))}, which is no fix of "
                f"fsdp-shim (its fixes: {', '.join(FIX_NAMES)}); that name is ignored",
                key=f"disabled:{','.join(unknown)}",
            )
        _, log_problem = config.log_setting()
        if log_problem is not None:
            failures.warn_once(f"fsdp-shim: {log_problem}", key=log_problem)
        before = [wrappers.status(name, fix).patched for fix in FIXES]
        proofs = fixes.PROOFS
        after = [
            wrappers.patch(name, fix, fixes.plan_of(fix), disabled=fix.name in skipped, proof=proofs.get(fix.name))
            for fix in FIXES
        ]
        wrappers.patch(name, RANK_CHECK, fixes.plan_of(RANK_CHECK))  # says what this rank runs, whatever it is
        new = [status for was, status in zip(before, after) if status.patched and not was]
        version = getattr(sys.modules.get(name), "__version__", "")
        if new:
            patched = "; ".join(f"{status.fix} ({', '.join(status.targets)})" for status in new)
            failures.debug_on_rank_zero("fsdp-shim: patched %s %s: %s", name, version, patched)
            if name in _imported_before_activation and any(status.fix == "cast" for status in new):
                _warn_about_models_already_wrapped(name)
        for status in after:
            failures.debug("%s %s, %s fix: %s", name, version, status.fix, status.reason)
        if name in _missed and any(status.affected for status in after):
            _report_loaded_past_the_finder(name, after)
    except (failures.FSDPShimError, Warning):
        raise
    except ImportError as error:  # the shim's own dependencies (wrapt, packaging) are missing
        failures.report(
            f"fsdp-shim: cannot patch {name}: {type(error).__name__}: {error}",
            "Lightning was left unchanged, so no fix applies",
            key=f"import:{name}",
            cause=error,
        )
    except Exception as error:
        failures.report(
            f"fsdp-shim: internal error while patching {name} ({type(error).__name__}: {error})",
            "see fsdp_shim.status() for what is in effect",
            key=f"internal:{name}",
            cause=error,
        )


def _report_loaded_past_the_finder(name: str, statuses: list[FixStatus]) -> None:
    """A finder in front of the shim's loaded ``name`` itself (an instrumenting import hook): say so,
    naming it, whether or not the late patch worked; a failed one is an error in strict mode."""
    who = _missed[name]
    remedy = "import fsdp_shim (or install that hook) so fsdp-shim's import watcher comes first on sys.meta_path"
    failed = [status for status in statuses if status.affected and not status.patched]
    if not failed:
        failures.warn_once(
            f"fsdp-shim: {who} loaded {name} without fsdp-shim's import watcher seeing it, so it was patched "
            f"only then; a model FSDP wrapped before that keeps its dtype. To patch it at its import, {remedy}",
            key=f"missed:{name}",
        )
    else:
        failures.report(
            f"fsdp-shim: {who} loaded {name} without fsdp-shim's import watcher seeing it, and it could not be "
            f"patched then ({'; '.join(f'{status.fix}: {status.reason}' for status in failed)})",
            f"Lightning was left unchanged; {remedy}",
            key=f"missed:{name}",
        )


_STANDARD_FINDERS = ("_frozen_importlib", "_frozen_importlib_external", "importlib._bootstrap", "importlib.machinery")


def _finders_in_front(module: ModuleType) -> str:
    """The finders on ``sys.meta_path`` in front of the shim's: what loaded a module it did not see execute."""
    names = []
    for finder in sys.meta_path:
        if getattr(finder, "__name__", None) == "fsdp_shim_finder":
            break
        defined_in = (type(finder).__module__, getattr(finder, "__module__", ""))
        if all(where not in _STANDARD_FINDERS for where in defined_in):
            names.append(repr(finder))
    if names:
        return "the finder(s) in front of fsdp-shim's import watcher on sys.meta_path (" + ", ".join(names) + ")"
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return f"a finder that loaded it past fsdp-shim's import watcher (loader: {loader!r})"


def _warn_about_models_already_wrapped(name: str) -> None:
    """The methods live on the classes, so every strategy and plugin uses the fix from its next ``setup`` on;
    only parameters FSDP already flattened cannot change. Found by a garbage-collector walk, like gevent's
    check for stale references."""
    trainer = NAMESPACES[name] == "trainer"
    holder_module, holder_class = ("strategies.fsdp", "FSDPStrategy") if trainer else ("wrappers", "_FabricModule")
    holder = getattr(sys.modules.get(f"{name}.{holder_module}"), holder_class, None)
    attribute = "_model" if trainer else "_forward_module"
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if not isinstance(holder, type) or not isinstance(fsdp, type):
        return
    # type(), not isinstance(): isinstance reads __class__, which some module-level proxies (torch's
    # deprecated aliases) answer with a FutureWarning.
    holders = (obj for obj in gc.get_objects() if issubclass(type(obj), holder))
    count = sum(isinstance(getattr(obj, attribute, None), fsdp) for obj in holders)
    if count:
        failures.warn_once(
            f"fsdp-shim was activated after {name} had already set up {count} FSDP model(s); their parameters "
            "keep the dtype they were wrapped with. The fix applies from the next setup on. Import fsdp_shim "
            "before Lightning, or use `fsdp-shim run` or the start-up file.",
            key=f"late:{name}",
        )


# ----------------------------------------------------------------------------- status
def _check_again() -> None:
    """Run again a check of a fix that could not run where it ran first (``wrappers.recheck``)."""
    wrappers = sys.modules.get("_fsdp_shim.wrappers")
    if wrappers is not None and wrappers.has_unsettled_checks():
        try:
            wrappers.recheck()
        except (failures.FSDPShimError, Warning):
            raise
        except Exception as error:
            failures.report(
                f"fsdp-shim: internal error while checking a fix again ({type(error).__name__}: {error})",
                "see fsdp_shim.status() for what is in effect",
                key="internal:recheck",
                cause=error,
            )


def status() -> ShimStatus:
    """Per namespace and per fix: version, affected or not, patched or not, and why."""
    _check_again()
    on = enabled()
    skipped, _ = config.disabled_fixes()
    variables = (SHIM_VARIABLE, STRICT_VARIABLE, DISABLED_FIXES_VARIABLE, RANK_CHECK_TIMEOUT_VARIABLE)
    return ShimStatus(  # by keyword: three of its fields are booleans
        shim_version=__version__,
        enabled=on,
        strict=failures.strict_mode(),
        active=bool(_active),
        sources=sources(),
        environment={name: os.environ.get(name) for name in variables},
        namespaces=tuple(_namespace_status(name, on) for name in NAMESPACES),
        disabled_fixes=tuple(name for name in FIX_NAMES if name in skipped),
    )


def sources() -> tuple[str, ...]:
    """How the shim was armed in this process, in order, from every copy of the start-up module."""
    found: list[str] = []
    for module in (startup, sys.modules.get(startup.COPY_NAME)):
        found += [source for source in getattr(module, "ARMED_BY", ()) if source not in found]
    return tuple(found)


def _namespace_status(name: str, on: bool) -> NamespaceStatus:
    module = sys.modules.get(name)
    if module is None:
        return NamespaceStatus(name, fixes=tuple(FixStatus(fix.name) for fix in FIXES))
    late = name in _imported_before_activation
    version = getattr(module, "__version__", None)
    version = version if isinstance(version, str) else None
    try:
        from _fsdp_shim import wrappers
    except ImportError as error:  # its patching code cannot load (wrapt missing): nothing was patched
        reason = f"not patched: fsdp-shim's patching code cannot be imported ({error})"
        fixes = tuple(FixStatus(fix.name, reason=reason) for fix in FIXES)
        return NamespaceStatus(name, True, version, None, False, reason, (), late, fixes)
    fixes = tuple(wrappers.status(name, fix) for fix in FIXES)
    if not on:
        off = f"switched off by {SHIM_VARIABLE}={os.environ.get(SHIM_VARIABLE, '')!r}"
        fixes = tuple(
            FixStatus(f.fix, f.affected, False, off) if not f.patched and f.affected is not False else f for f in fixes
        )
    affected = any(f.affected for f in fixes) if any(f.affected is not None for f in fixes) else None
    needed = [f for f in fixes if f.affected and not f.reason.startswith(f"switched off by {DISABLED_FIXES_VARIABLE}")]
    patched = bool(needed) and all(f.patched for f in needed)
    targets = tuple(target for f in fixes for target in f.targets)
    reason = _reason(name, module, fixes, patched)
    return NamespaceStatus(name, True, version, affected, patched, reason, targets, late, fixes)


def _reason(name: str, module: ModuleType, fixes: tuple[FixStatus, ...], patched: bool) -> str:
    """One line for the namespace: "patched" (with the fixes' notes), or what keeps each fix off."""
    if all(f.reason == "imported; not checked yet" for f in fixes):
        if name in startup.not_handed_over():
            return (
                f"imported; not checked yet: {_finders_in_front(module)} loaded it without fsdp-shim's import "
                "watcher seeing it (fsdp_shim.activate() checks it now)"
            )
        return "imported; not checked yet"
    if patched:
        notes = [f"{f.fix}: {f.reason[len('patched (') : -1]}" for f in fixes if f.reason.startswith("patched (")]
        return "patched" + (f" ({'; '.join(notes)})" if notes else "")
    left = [f for f in fixes if not f.patched and f.affected is not False] or list(fixes)
    reasons = list(dict.fromkeys(f.reason for f in left))
    return reasons[0] if len(reasons) == 1 else "; ".join(f"{f.fix}: {f.reason}" for f in left)
