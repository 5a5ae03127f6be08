"""The part of fsdp-shim that runs before the ``fsdp_shim`` package is imported.

It is a top-level module, not ``fsdp_shim.something``, because importing anything inside the
package runs the package's ``__init__``, which activates the shim. It imports only ``os`` and
``sys``, so start-up code and the package can share what must be written once:

* ``LIGHTNING_NAMESPACES``, the one table of Lightning namespaces the shim knows;
* ``switch_state``, the one parser for the values of ``FSDP_SHIM`` and ``FSDP_SHIM_STRICT`` (defined in
  ``_fsdp_shim_trampoline``, the only code start-up files run, and named here for everything else);
* an import watcher that runs callbacks right before and right after a module's code executes.

Why the shim has its own watcher instead of wrapt's post-import hooks: the import system calls every
``sys.meta_path`` finder while holding the global import lock (CPython's ``_find_spec``), and wrapt's
finder calls ``importlib.util.find_spec``, which imports the parent package. When another thread is
still importing that parent, each thread waits for the other forever: importlib's deadlock detection
sees module locks, not the global lock. Ten threads importing Lightning names at once hung that way.
The watcher here never imports in ``find_spec``: it asks the finders after it for the spec and wraps
the loader, and the callbacks run in ``exec_module``, where only the module's own lock is held.

The start-up files do not import this module: they import ``_fsdp_shim_trampoline`` (or the copy of it
that ``fsdp-shim install`` writes), a finder that wraps the loader of the first Lightning package
imported and calls ``hand_over`` from that loader, outside the lock.
"""

import _thread
import os
import sys

from _fsdp_shim_trampoline import ENVIRONMENT_SOURCE as ENVIRONMENT_SOURCE
from _fsdp_shim_trampoline import OFF_VALUES, ON_VALUES, SHIM_VARIABLE, switch_state

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    Callback = Callable[[ModuleType], None]

LIGHTNING_NAMESPACES = (
    ("lightning.fabric", "fabric"),
    ("lightning.pytorch", "trainer"),
    ("lightning_fabric", "fabric"),
    ("pytorch_lightning", "trainer"),
)
"""Every importable copy of Lightning's Trainer and Fabric code, as ``(module, kind)``.

The unified ``lightning`` package and the standalone ``pytorch_lightning`` / ``lightning_fabric``
packages are generated from one source but hold different class objects, and one environment can
hold an affected ``lightning`` next to a fixed ``pytorch_lightning``: each is gated and patched on
its own. Everything else that names these modules derives from this table."""

LIGHTNING_PACKAGES = tuple(dict.fromkeys(name.partition(".")[0] for name, _ in LIGHTNING_NAMESPACES))
"""The top-level packages that hold ``LIGHTNING_NAMESPACES``; importing any of them loads the shim."""

STRICT_VARIABLE = "FSDP_SHIM_STRICT"


def valid_values() -> str:
    """The recognised values, for messages."""
    return ", ".join((*ON_VALUES, *OFF_VALUES))


def strict_switched_on(environ: "dict[str, str] | None" = None) -> bool:
    """Whether ``FSDP_SHIM_STRICT`` asks for errors: a recognised "on" value or an unrecognised one."""
    env = os.environ if environ is None else environ
    return switch_state(env.get(STRICT_VARIABLE)) in ("on", "invalid")


class FSDPShimWarning(RuntimeWarning):
    """The shim could not do something it should have, said so, and left Lightning as shipped.

    Defined here so that even a shim that fails to import can warn with its own category;
    ``fsdp_shim.FSDPShimWarning`` is this class."""


FSDPShimWarning.__module__ = "fsdp_shim"

# ----------------------------------------------------------------------------- the import watcher
_before: "dict[str, list[Callback]]" = {}
_after: "dict[str, list[Callback]]" = {}
_every: "dict[str, list[Callback]]" = {}
"""Callbacks for every execution of a module, not just the first: test frameworks and reloaders
remove Lightning from ``sys.modules`` and import it again, which makes new classes."""
_executing: "set[str]" = set()
# Guards the four containers above. Never held while a callback runs or anything is imported.
_lock = _thread.allocate_lock()

sources: "list[str]" = []
"""How the shim was armed in this process ("startup file", "fsdp-shim run"); ``status()`` reports it."""


class _CallbackLoader:
    """Wraps a module's real loader: runs the ``before`` callbacks, the module's code, then the
    ``after`` callbacks (only when the code ran without error, so a failed import keeps them)."""

    def __init__(self, name: str, loader: object, catch_up: bool = False) -> None:
        self.name = name
        self.loader = loader
        self.catch_up = catch_up
        """Also run the callbacks of watched modules that another finder loaded past the watcher."""

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "ModuleType") -> None:
        # The module keeps its real loader, as if nobody had watched (pkg_resources and
        # importlib.resources read it; wrapt's chained loader broke them by leaking itself).
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        with _lock:
            _executing.add(self.name)
        try:
            for callback in _take(_before, self.name):
                callback(module)
            self.loader.exec_module(module)  # type: ignore[attr-defined]
        finally:
            with _lock:
                _executing.discard(self.name)
        once = _take(_after, self.name)
        with _lock:
            every = [callback for callback in _every.get(self.name, ()) if callback not in once]
        for callback in once + every:
            callback(module)
        if self.catch_up:
            _catch_up(self.name)

    def __getattr__(self, attribute: str) -> object:
        return getattr(self.loader, attribute)


class _ImportWatcher:
    """The ``sys.meta_path`` finder for watched names. It finds nothing itself."""

    def find_spec(self, name: str, path: "Sequence[str] | None" = None, target: object = None) -> "ModuleSpec | None":
        if name not in _before and name not in _after and name not in _every:
            if not loaded_past_the_watcher():
                return None
            return _watched_spec(self, name, path, target, catch_up=True)
        return _watched_spec(self, name, path, target)

    def __repr__(self) -> str:
        return "<fsdp-shim import watcher>"


def _watched_spec(
    watcher: object, name: str, path: object, target: object, catch_up: bool = False
) -> "ModuleSpec | None":
    """The spec the finders after ``watcher`` give ``name``, with its loader wrapped.

    Only finders are asked, as the import system itself would ask them; nothing is imported."""
    found = False
    for finder in list(sys.meta_path):
        if finder is watcher:
            found = True
            continue
        if (found or watcher not in sys.meta_path) and not _is_inline_watcher(finder):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
    else:
        return None
    loader = spec.loader
    if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, _CallbackLoader):
        spec.loader = _CallbackLoader(name, loader, catch_up)
    return spec


missed: "dict[str, str]" = {}
"""Watched modules that a finder in front of the shim's watcher loaded itself, so that the shim saw them
only at a later import: name -> who loaded them (for the warning and ``status()``)."""

_STANDARD_FINDERS = ("_frozen_importlib", "_frozen_importlib_external", "importlib._bootstrap", "importlib.machinery")


def _loaded(name: str) -> bool:
    """Whether ``name`` is in ``sys.modules`` and done executing (its spec no longer initializing)."""
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", True) is False


def loaded_past_the_watcher() -> "list[str]":
    """Watched names with callbacks waiting that are imported and done: loaded past the watcher."""
    return [name for name in list(_after) if _after.get(name) and name not in _executing and _loaded(name)]


def finders_in_front(module: "ModuleType | None" = None) -> str:
    """The finders on ``sys.meta_path`` in front of the shim's watchers (the start-up file's
    trampoline or this module's), for messages: what loaded a module the shim did not see."""
    names = []
    for finder in sys.meta_path:
        if finder is _watcher or _is_inline_watcher(finder):
            break
        if (
            type(finder).__module__ not in _STANDARD_FINDERS
            and getattr(finder, "__module__", "") not in _STANDARD_FINDERS
        ):
            names.append(repr(finder))
    if names:
        return "the finder(s) in front of fsdp-shim's import watcher on sys.meta_path (" + ", ".join(names) + ")"
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return f"a finder that loaded it past fsdp-shim's import watcher (loader: {loader!r})"


def _catch_up(trigger: str) -> None:
    """Run the waiting callbacks of watched modules another finder loaded itself (noticed at the
    import of ``trigger``, the first the watcher saw after them)."""
    for name in loaded_past_the_watcher():
        module = sys.modules[name]
        with _lock:
            missed.setdefault(name, finders_in_front(module) + "; noticed at the import of " + trigger)
        for callback in _take(_after, name):
            callback(module)


def _take(callbacks: "dict[str, list[Callback]]", name: str) -> "list[Callback]":
    with _lock:
        return callbacks.pop(name, [])


_watcher = _ImportWatcher()


def _ensure_watcher() -> None:
    # Inserted once and never removed: removing a finder while another thread iterates
    # sys.meta_path can make that thread skip the next finder (and fail its import).
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)


def when_imported(name: str, callback: "Callback") -> None:
    """Call ``callback(module)`` once the module ``name`` has executed; at once if it has.

    A module another thread is still executing outside this watcher is called at once as well (its
    classes may not all exist yet, and the callback must say so); ``fire_pending`` catches a
    registration that raced with an import already past the finders.
    """
    with _lock:
        module = sys.modules.get(name)
        pending = module is None or name in _executing
        if pending:
            _after.setdefault(name, []).append(callback)
            _ensure_watcher()
    if not pending:
        callback(module)  # type: ignore[arg-type]


def whenever_executed(name: str, callback: "Callback") -> None:
    """Also call ``callback(module)`` after every later execution of the module ``name`` (a copy
    imported again after it was removed from ``sys.modules``); ``when_imported`` covers the first."""
    with _lock:
        callbacks = _every.setdefault(name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        _ensure_watcher()


def before_executed(name: str, callback: "Callback") -> None:
    """Call ``callback(module)`` right before the module ``name`` executes (once, next import)."""
    with _lock:
        callbacks = _before.setdefault(name, [])
        if callback not in callbacks:
            callbacks.append(callback)
        _ensure_watcher()


def fire_pending() -> None:
    """Run the callbacks of modules that finished importing without this watcher seeing them."""
    for name in list(_after):
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is not None and name not in _executing and not getattr(spec, "_initializing", False):
            for callback in _take(_after, name):
                callback(module)


def is_imported(name: str) -> bool:
    """Whether ``name`` is in ``sys.modules`` and not executing under this watcher right now."""
    return name in sys.modules and name not in _executing


def pending() -> "list[str]":
    """Names with callbacks still waiting for their import."""
    with _lock:
        return sorted(name for name, callbacks in _after.items() if callbacks)


# ----------------------------------------------------------------------------- loading the shim
def load_shim(module: "ModuleType | None" = None) -> None:
    """Import the shim (which activates itself) unless ``FSDP_SHIM`` is a recognised "off".

    Read here, at the first Lightning import, so a script can still switch the shim off with
    ``os.environ["FSDP_SHIM"] = "0"`` before ``import lightning``. An unrecognised value loads the
    package anyway, which warns about it and stays off. The shim failing to import never passes
    silently: a warning, or in strict mode an ImportError from the user's ``import lightning``.
    """
    if switch_state(os.environ.get(SHIM_VARIABLE)) == "off":
        return
    try:
        import fsdp_shim  # noqa: F401
    except Exception as error:
        message = (
            f"fsdp-shim: the shim could not be loaded ({type(error).__name__}: {error}), "
            "so Lightning runs without its FSDP 'true'-precision fix"
        )
        if strict_switched_on():
            raise ImportError(f"{message}; {STRICT_VARIABLE} is on, so this import fails instead") from error
        import warnings

        warnings.warn(f"{message}. Reinstall fsdp-shim, or set {SHIM_VARIABLE}=0.", FSDPShimWarning, stacklevel=2)


def _record_source(source: str) -> None:
    if source not in sources:
        sources.append(source)


def _arm_lightning_packages() -> None:
    for name in LIGHTNING_PACKAGES:
        before_executed(name, load_shim)


def arm(source: str) -> None:
    """Arm the shim from code already running: the ``fsdp-shim run`` bootstrap, PEP 829's entry point.

    If Lightning was imported first (another start-up hook did it), the shim is loaded at once. The
    start-up files' finders armed earlier, so their sources are recorded first.
    """
    _take_over_inline_watchers()
    _record_source(source)
    if any(name in sys.modules for name in LIGHTNING_PACKAGES):
        load_shim()
    else:
        _arm_lightning_packages()


def arm_from_startup_file() -> None:
    """PEP 829 entry point (``_fsdp_shim_startup:arm_from_startup_file``)."""
    arm("startup file")


def _is_inline_watcher(finder: object) -> bool:
    return getattr(finder, "__name__", None) == "fsdp_shim_watcher"


def _take_over_inline_watchers() -> None:
    """Record how each start-up file's finder armed the shim and make it inert: this module's
    watcher does the work from now on. Inert, not removed (see ``_ensure_watcher``). There can be
    several: ``_fsdp_shim_trampoline`` (``FSDP_SHIM=1``), the copy ``fsdp-shim install`` wrote, and the
    source an earlier version's start-up file carried."""
    for finder in list(sys.meta_path):
        if _is_inline_watcher(finder):
            namespace = finder.__globals__  # type: ignore[attr-defined]
            if namespace.get("WATCHED"):
                _record_source(namespace.get("SOURCE", "startup file"))
                namespace["WATCHED"].clear()


def hand_over(module: "ModuleType", loader: object, source: str) -> None:
    """Called by the start-up file's trampoline when the first Lightning package is about to execute,
    or, when a finder in front of the trampoline loaded Lightning itself, at the first import after."""
    loaded_past = (
        [name for name in LIGHTNING_PACKAGES if _loaded(name)] if module.__name__ not in LIGHTNING_PACKAGES else []
    )
    who = finders_in_front(sys.modules.get(loaded_past[0])) if loaded_past else ""
    _record_source(source)
    _take_over_inline_watchers()
    _arm_lightning_packages()
    real = loader if isinstance(loader, _CallbackLoader) else _CallbackLoader(module.__name__, loader)
    real.exec_module(module)
    if loaded_past:
        for name, _ in LIGHTNING_NAMESPACES:
            if name.partition(".")[0] in loaded_past and name in sys.modules:
                missed.setdefault(name, who + "; noticed at the import of " + module.__name__)
        load_shim()  # it patches what is imported at once
