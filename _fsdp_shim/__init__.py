"""fsdp-shim's implementation, and the start-up module that must exist before Lightning is imported.

Importing ``_fsdp_shim`` or any module in it activates nothing; ``import fsdp_shim`` activates (as
``import ddtrace.auto`` does and ``import ddtrace`` does not). This ``__init__`` is what every armed
interpreter imports, so it imports only ``sys`` and holds only what must exist before Lightning: the
switch parser, the namespace table, the warning class, one finder and one ``arm()``, which every way
of activating calls (``fsdp_shim_env.pth`` where ``FSDP_SHIM`` is set and not blank, or on Python 3.15+ its
PEP 829 companion ``fsdp_shim_env.start`` through ``arm_if_switched_on``; the copy ``fsdp-shim install``
writes, ``fsdp-shim run``'s ``sitecustomize``, ``import fsdp_shim``).

The finder answers for the four Lightning namespaces only. CPython holds its global import lock while
it asks finders, so the finder imports nothing: it returns the spec the finders after it return, with
its very loader, whose ``exec_module`` an instance attribute shadows once, to hand the executed
namespace over to the shim outside that lock. The hand-over is by name (``HAND_OVER``, resolved when it
fires, as wrapt resolves ``"module:function"`` hooks): no import cycle, and a copy that ``pip
uninstall`` left behind finds no shim and lets Lightning import as shipped. ``FSDP_SHIM`` is read again
then, so a script can still switch the shim off before ``import lightning``.
"""

import sys

SHIM_VARIABLE = "FSDP_SHIM"
STRICT_VARIABLE = "FSDP_SHIM_STRICT"
ON_VALUES = ("1", "true", "on", "yes", "y", "enable", "enabled")
OFF_VALUES = ("0", "false", "off", "no", "n", "disable", "disabled")

NAMESPACES = {
    "lightning.fabric": "fabric",
    "lightning.pytorch": "trainer",
    "lightning_fabric": "fabric",
    "pytorch_lightning": "trainer",
}
"""Every importable copy of Lightning's Fabric and Trainer code, and its kind: the one table.

The unified ``lightning`` package and the standalone ``lightning_fabric`` / ``pytorch_lightning``
are generated from one source but hold different class objects, and one environment can hold an
affected ``lightning`` next to a fixed ``pytorch_lightning``: each is gated and patched on its own."""

ENVIRONMENT_SOURCE = "FSDP_SHIM={} (start-up file installed with the package)"
"""How the start-up file pip installs records that it armed, with the value of ``FSDP_SHIM`` it read."""
INSTALLED_SOURCE = "startup file"
"""How the copy of this module that ``fsdp-shim install`` writes records that it armed."""
COPY_NAME = "_fsdp_shim_startup_file"
"""The module name of the copy of this file that ``fsdp-shim install`` writes next to its ``.pth``."""
HAND_OVER = "_fsdp_shim.activation"
"""The module whose ``namespace_executed(module, noticed_at)`` receives each executed namespace;
``noticed_at`` is ``None`` for a namespace the finder saw execute, ``ALREADY_IMPORTED`` for one that
was imported before ``arm()``, else the name of the import at which a namespace that a finder in front
of this one loaded was noticed."""
ALREADY_IMPORTED = "(imported before the shim was armed)"

ARMED_BY = []
"""How this copy of the finder was armed in this process, in order (``fsdp_shim.status().sources``)."""
_handed = {}  # type: dict[str, object]
"""Namespace name -> the module object handed over (a namespace imported again is a new object)."""
_inert = []  # type: list[BaseException]
"""Non-empty once a hand-over found a package it does not match: the finder then stays out of the way."""
_asking = {}
"""Names (keys) the finder is asking the finders after it about: another finder that asks every finder (an
older start-up file's watcher) must not send the question back round."""


def __getattr__(name):
    """``FSDPShimWarning``, made at its first use: creating a class costs an armed start-up more than
    the rest of this module. Here, so that even a shim that fails to import warns with its own
    category; ``fsdp_shim.FSDPShimWarning`` is this class."""
    if name != "FSDPShimWarning":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    class FSDPShimWarning(RuntimeWarning):
        """The shim could not do something it should have, said so, and left Lightning as shipped."""

    FSDPShimWarning.__module__, FSDPShimWarning.__qualname__ = "fsdp_shim", "FSDPShimWarning"
    return globals().setdefault(name, FSDPShimWarning)  # one class, whichever thread came first


def switch_state(raw):
    """``"on"``, ``"off"``, ``"unset"`` (missing or blank) or ``"invalid"``; case and spaces ignored.

    The one parser of ``FSDP_SHIM`` and ``FSDP_SHIM_STRICT``. Both fail closed on an invalid value, in
    opposite directions: ``FSDP_SHIM`` counts it as off (Lightning as shipped), strict mode as on."""
    if raw is None or not raw.strip():
        return "unset"
    value = raw.strip().lower()
    if value in ON_VALUES:
        return "on"
    if value in OFF_VALUES:
        return "off"
    return "invalid"


def arm(source=None):
    """Put the finder first on ``sys.meta_path`` (once, whichever copy of this module armed first),
    record ``source``, and hand over the namespaces that are already imported. Without ``source``, the
    start-up file that calls it is recorded: ``fsdp-shim install``'s copy of this module (whose PEP 829
    entry point calls this), or the file pip installs, with the value of ``FSDP_SHIM`` it armed on, so that
    status never says ``FSDP_SHIM=1`` where it is ``0``."""
    if source is None:
        import os

        value = os.environ.get(SHIM_VARIABLE, "").strip()
        source = INSTALLED_SOURCE if __name__ == COPY_NAME else ENVIRONMENT_SOURCE.format(value)
    if source not in ARMED_BY:
        ARMED_BY.append(source)
    if not [finder for finder in sys.meta_path if getattr(finder, "__name__", None) == "fsdp_shim_finder"]:
        sys.meta_path.insert(0, fsdp_shim_finder)
    _hand_over_all(not_handed_over(), ALREADY_IMPORTED)


def arm_if_switched_on():
    """``fsdp_shim_env.start``'s entry point, which Python 3.15+ calls at every start in place of the import
    line of ``fsdp_shim_env.pth`` (PEP 829): arm where ``FSDP_SHIM`` is set and not blank, as that line does.
    Set to ``0`` or an unreadable value it arms too: the hand-over reads the switch again at Lightning's
    import, so a script can still switch the shim on or off before it, and an unreadable value is said."""
    import os

    if switch_state(os.environ.get(SHIM_VARIABLE)) != "unset":
        arm()


def fsdp_shim_finder(name, path=None, target=None):
    """The finder, a function that is its own ``find_spec``. It answers for a namespace, and for any
    import once a namespace finished executing without it (a finder in front of it loaded it)."""
    if _inert or name in _asking or (name not in NAMESPACES and not not_handed_over()):
        return None
    _asking[name] = None
    try:
        after_me = False
        for finder in sys.meta_path:
            if getattr(finder, "__name__", None) == "fsdp_shim_finder":
                after_me = True  # the finders in front have already said no
            elif after_me and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    _observe(spec.loader, name)
                    return spec
        return None
    finally:
        _asking.pop(name, None)


fsdp_shim_finder.find_spec = fsdp_shim_finder  # type: ignore[attr-defined]  # a finder that is a function


def _observe(loader, name):
    """Shadow the loader's ``exec_module`` with an instance attribute that removes itself. A loader
    that allows no attribute, or has no ``exec_module``, is caught up with at the next import."""
    real = getattr(loader, "exec_module", None)
    if real is None:
        return

    def exec_module(module):
        if module.__name__ != name:  # another module through a loader shared by several (zipimport)
            return real(module)
        loader.__dict__.pop("exec_module", None)
        real(module)
        if name in NAMESPACES:
            _hand_over(module, None)
        _hand_over_all(not_handed_over(), name)
        return None

    try:  # noqa: SIM105 - not contextlib.suppress: this module imports nothing but sys
        loader.exec_module = exec_module
    except (AttributeError, TypeError):
        pass


def not_handed_over():
    """Namespaces that finished executing and were not handed over (imported before arming, or loaded
    by a finder in front of this one)."""
    modules = sys.modules
    return [
        name
        for name in NAMESPACES
        if name in modules
        and _handed.get(name) is not modules[name]
        and getattr(getattr(modules[name], "__spec__", None), "_initializing", True) is False
    ]


def _hand_over_all(names, noticed_at):
    """Hand several namespaces over, each claimed before the first goes: a hand-over imports the shim
    through this finder, and an import it makes must not hand the others over half-way."""
    modules = [sys.modules[name] for name in names]
    for module in modules:
        _handed[module.__name__] = module
    for module in modules:
        _hand_over(module, noticed_at)


def _hand_over(module, noticed_at):
    """Give an executed namespace to the shim, by name; ``noticed_at`` names the import at which a
    namespace loaded past this finder was noticed. Only ``FSDP_SHIM=0`` skips it here: the package
    itself warns about an unreadable value."""
    import os

    _handed[module.__name__] = module
    if _inert or switch_state(os.environ.get(SHIM_VARIABLE)) == "off":
        return
    try:
        receive = __import__(HAND_OVER, fromlist=["namespace_executed"]).namespace_executed
    except Exception as error:
        if isinstance(error, ImportError) and getattr(error, "name", None) == "_fsdp_shim":
            return  # a copy that `pip uninstall` left behind: there is no shim to hand over to
        _inert.append(error)
        _could_not_load(error)
        return
    receive(module, noticed_at)


def _could_not_load(error):
    """Never silent: a warning, or in strict mode an ImportError from the user's import."""
    import os

    message = (
        f"fsdp-shim: the shim could not be loaded ({type(error).__name__}: {error}), "
        "so Lightning runs without its fixes"
    )
    if switch_state(os.environ.get(STRICT_VARIABLE)) in ("on", "invalid"):
        raise ImportError(f"{message}; {STRICT_VARIABLE} is on, so this import fails instead") from error
    import warnings

    category = __getattr__("FSDPShimWarning")
    warnings.warn(f"{message}. Reinstall fsdp-shim, or set {SHIM_VARIABLE}=0.", category, stacklevel=3)


if __name__ == COPY_NAME:
    arm(INSTALLED_SOURCE)
