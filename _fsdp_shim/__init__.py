"""The start-up module every armed interpreter imports (it imports only ``sys``): the switch parser, the namespace
table and the finder that hands each executed Lightning namespace over (docs/how-it-works.md)."""

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
"""Every importable copy of Lightning's Fabric and Trainer, and its kind: each is gated and patched on its own."""

HAND_OVER = "_fsdp_shim.activation"  # its namespace_executed(module, late) receives each namespace, found by name
ARMED_BY = []  # how the finder was armed in this process, in order (fsdp_shim.status().sources)
_handed = {}  # type: dict[str, object]
_inert = []  # type: list[BaseException]


class FSDPShimWarning(RuntimeWarning):
    """The shim could not do something it should have, said so, and left Lightning as shipped."""

    __module__ = "fsdp_shim"  # where users import it from


def switch_state(raw):
    """``"on"``, ``"off"``, ``"unset"`` (missing or blank) or ``"invalid"``: the one parser of both switches."""
    value = (raw or "").strip().lower()
    return "unset" if not value else "on" if value in ON_VALUES else "off" if value in OFF_VALUES else "invalid"


def arm(source=None):
    """Put the finder first on ``sys.meta_path`` once, record ``source`` and hand over what is imported already."""
    if source is None:
        import os

        source = "FSDP_SHIM={} (start-up file installed with the package)".format(os.environ.get(SHIM_VARIABLE, ""))
    if source not in ARMED_BY:
        ARMED_BY.append(source)
    if not [finder for finder in sys.meta_path if getattr(finder, "__name__", None) == "fsdp_shim_finder"]:
        sys.meta_path.insert(0, fsdp_shim_finder)
    _hand_over_all(not_handed_over())


def arm_if_switched_on():
    """``fsdp_shim_env.start``'s entry point (PEP 829, Python 3.15+): arm where ``FSDP_SHIM`` is set, as the .pth."""
    import os

    if switch_state(os.environ.get(SHIM_VARIABLE)) != "unset":
        arm()


def fsdp_shim_finder(name, path=None, target=None):
    """A finder that is its own ``find_spec``: the spec the finders after it give, with the loader observed. CPython
    holds its import lock while it asks finders, so this imports nothing."""
    if _inert or (name not in NAMESPACES and not not_handed_over()):
        return None
    after_me = False
    for finder in sys.meta_path:
        if getattr(finder, "__name__", None) == "fsdp_shim_finder":
            after_me = True
        elif after_me and hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                _observe(spec.loader, name)
                return spec
    return None


fsdp_shim_finder.find_spec = fsdp_shim_finder  # type: ignore[attr-defined]


def _observe(loader, name):
    """Shadow the loader's ``exec_module`` once, to hand the executed module over outside the import lock."""
    real = getattr(loader, "exec_module", None)
    if real is None:
        return

    def exec_module(module):
        if module.__name__ != name:  # a loader shared by several modules (zipimport)
            return real(module)
        loader.__dict__.pop("exec_module", None)
        real(module)
        if name in NAMESPACES:
            _hand_over(module, False)
        _hand_over_all(not_handed_over())
        return None

    try:  # noqa: SIM105 - this module imports nothing but sys
        loader.exec_module = exec_module
    except (AttributeError, TypeError):
        pass


def not_handed_over():
    """Namespaces that finished executing without a hand-over (imported before arming, or past this finder)."""
    modules = sys.modules
    return [
        name
        for name in NAMESPACES
        if name in modules
        and _handed.get(name) is not modules[name]
        and getattr(getattr(modules[name], "__spec__", None), "_initializing", True) is False
    ]


def _hand_over_all(names):
    """Claim every namespace before the first goes: a hand-over imports, and must not hand the others over twice."""
    modules = [sys.modules[name] for name in names]
    for module in modules:
        _handed[module.__name__] = module
    for module in modules:
        _hand_over(module, True)


def _hand_over(module, late):
    """Give an executed namespace to the shim; only ``FSDP_SHIM=0`` skips it here. A shim that cannot load says so:
    a warning, or in strict mode an ImportError from the user's import."""
    import os

    _handed[module.__name__] = module
    if _inert or switch_state(os.environ.get(SHIM_VARIABLE)) == "off":
        return
    try:
        receive = __import__(HAND_OVER, fromlist=["namespace_executed"]).namespace_executed
    except Exception as error:
        _inert.append(error)
        message = f"fsdp-shim: the shim could not be loaded ({type(error).__name__}: {error}), so Lightning runs "
        message += "without its fixes"
        if switch_state(os.environ.get(STRICT_VARIABLE)) in ("on", "invalid"):
            raise ImportError(f"{message}; {STRICT_VARIABLE} is on, so this import fails instead") from error
        import warnings

        warnings.warn(f"{message}. Reinstall fsdp-shim, or set {SHIM_VARIABLE}=0.", FSDPShimWarning, 2)
        return
    receive(module, late)
