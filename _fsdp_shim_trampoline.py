"""The code start-up files run at every interpreter start: what ``FSDP_SHIM`` means, and a finder that
loads the shim at the first import of Lightning.

Every interpreter of the environment runs the start-up files, so this module is the least that must
be there before Lightning is imported: it imports only ``sys`` at import (``os``, to read the variable, only
where it is set), defines no class, and runs nothing else at import. Both start-up files import it, from its
``.pyc``, which costs less than compiling even a few lines of source in a fresh interpreter (a fresh
process pays for the compiler's first use; docs/benchmarks.md has the figures):

* ``fsdp_shim_env.pth``, which pip installs and removes with the package, calls
  ``arm_from_environment`` where ``FSDP_SHIM`` is set at all;
* ``fsdp_shim.pth``, which ``fsdp-shim install`` writes, imports a copy of this module that it writes
  next to itself (``COPY_NAME``), which arms itself at import (the last lines below): the ``.pth``
  line is a bare ``import``, because ``site`` compiles every ``.pth`` line at every start, and a call
  after the import cost about 0.1 M instructions (0.27 %) more per start. A copy, because ``pip
  uninstall`` does not know about that file: what it left behind still imports, and finds no shim to
  hand over to.

The finder answers only for Lightning's top-level packages (``WATCHED``). It imports nothing inside
``find_spec``, where the import system holds its global lock: it asks the finders after it for the spec
and wraps the loader, whose ``exec_module`` imports ``_fsdp_shim_startup`` outside that lock and hands
the import over to it (``hand_over``), which loads the shim. From then on ``_fsdp_shim_startup``'s own
watcher does the work and this finder is inert (``WATCHED`` emptied, never removed: removing a finder
while another thread iterates ``sys.meta_path`` can make that thread skip one). A Lightning package
that a finder in front of this one loaded itself is handed over at the next import this finder sees.

If ``_fsdp_shim_startup`` is gone (``pip uninstall`` left ``fsdp-shim install``'s files behind),
Lightning imports as if they were not there; if it is from another fsdp-shim version (no
``hand_over``), the same, with a warning.
"""

import sys

SHIM_VARIABLE = "FSDP_SHIM"
ON_VALUES = ("1", "true", "on", "yes", "y", "enable", "enabled")
OFF_VALUES = ("0", "false", "off", "no", "n", "disable", "disabled")
ENVIRONMENT_SOURCE = "FSDP_SHIM=1 (start-up file installed with the package)"

WATCHED = ["lightning", "lightning_fabric", "pytorch_lightning"]
"""Lightning's top-level packages still to hand over (``_fsdp_shim_startup.LIGHTNING_PACKAGES``; a
test keeps the two equal). Emptied when the hand-over has happened or cannot."""
SOURCE = "startup file"
"""How this finder was armed, recorded by ``_fsdp_shim_startup`` at the hand-over."""
COPY_NAME = "_fsdp_shim_startup_file"
"""The module name of the copy ``fsdp-shim install`` writes; imported under it, the copy arms itself."""


def switch_state(raw: "str | None") -> str:
    """``"on"``, ``"off"``, ``"unset"`` (missing or blank) or ``"invalid"``; case and spaces ignored.

    The one parser of ``FSDP_SHIM`` and ``FSDP_SHIM_STRICT``. What an invalid value means is the
    caller's decision, and both decisions fail closed: ``FSDP_SHIM`` counts it as off (Lightning as
    shipped), ``FSDP_SHIM_STRICT`` as on (loud).
    """
    if raw is None or not raw.strip():
        return "unset"
    value = raw.strip().lower()
    if value in ON_VALUES:
        return "on"
    if value in OFF_VALUES:
        return "off"
    return "invalid"


def arm(source: str) -> None:
    """Put the finder first on ``sys.meta_path``, once (site may run a start-up file twice)."""
    global SOURCE
    SOURCE = source
    if fsdp_shim_watcher not in sys.meta_path:
        sys.meta_path.insert(0, fsdp_shim_watcher)


def arm_from_environment() -> None:
    """``fsdp_shim_env.pth``'s call where ``FSDP_SHIM`` is set: "on" arms the shim, so ``FSDP_SHIM=1``
    alone reaches every Python process that inherits it, whatever the launcher did to ``PYTHONPATH``.
    An unreadable value arms it too: the package then loads at Lightning's import, says that the value
    switched the shim off, and stays off. Read again at that import (``load_shim``), so a script can
    still switch the shim off before ``import lightning``."""
    import os  # here, not at the top: measured, every start cost about 0.06 ms more with it there

    if switch_state(os.environ.get(SHIM_VARIABLE)) in ("on", "invalid"):
        arm(ENVIRONMENT_SOURCE)


def fsdp_shim_watcher(name: str, path: object = None, target: object = None) -> object:
    """The finder, a function that is its own ``find_spec``. It answers for a watched package, or for
    any import once a watched package is done executing (another finder in front loaded it itself)."""
    if name not in WATCHED:
        modules = sys.modules
        if not [1 for p in WATCHED if getattr(getattr(modules.get(p), "__spec__", 0), "_initializing", 1) is False]:
            return None
    return _watched_spec(name, path, target)


fsdp_shim_watcher.find_spec = fsdp_shim_watcher  # type: ignore[attr-defined]


def _watched_spec(name: str, path: object, target: object) -> object:
    """The spec the other finders give ``name``, its loader wrapped to hand the import over."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is not None and getattr(finder, "__name__", "") != "fsdp_shim_watcher":
            spec = find(name, path, target)
            if spec is not None:
                break
    else:
        return None
    real = spec.loader
    if real is None or not hasattr(real, "exec_module"):
        return spec

    def exec_module(module: object) -> None:
        try:
            import _fsdp_shim_startup

            hand_over = _fsdp_shim_startup.hand_over
        except Exception as error:
            for finder in sys.meta_path:  # every copy of this finder (a start-up file of another version)
                if getattr(finder, "__name__", "") == "fsdp_shim_watcher":
                    finder.__globals__["WATCHED"].clear()  # inert: one warning, no failed import at each import
            if not isinstance(error, ImportError):
                import warnings

                warnings.warn(
                    f"fsdp-shim: this start-up file does not match the installed fsdp-shim ({error!r}); "
                    "Lightning runs without the shim. Run `fsdp-shim install` again.",
                    stacklevel=2,
                )
            module.__loader__ = module.__spec__.loader = real  # type: ignore[attr-defined]
            real.exec_module(module)
            return
        hand_over(module, real, SOURCE)

    exec_module.create_module = getattr(real, "create_module", lambda spec: None)  # type: ignore[attr-defined]
    exec_module.exec_module = exec_module  # type: ignore[attr-defined]
    spec.loader = exec_module
    return spec


if __name__ == COPY_NAME:
    arm(SOURCE)
