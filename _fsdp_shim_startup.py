"""fsdp-shim's start-up hook: what the environment-wide start-up file and ``fsdp-shim run`` put in
every Python process.

Start-up code runs in *every* interpreter of an environment (pip, compilers, data-loader workers),
so it must cost nothing measurable. The start-up file therefore carries :data:`WATCHER_CODE` inline
and imports nothing at all: the watcher sits on ``sys.meta_path`` and, when a process first imports
a Lightning package, imports this module, which imports the shim (wrapt and all). This module lives
outside the ``fsdp_shim`` package so that importing it does not run the package's ``__init__``.
"""

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

OFF_VALUES = ("0", "false", "off")
"""Values of ``FSDP_SHIM`` that switch the shim off (the full parser is ``fsdp_shim.toggles``)."""

WATCHER_CODE = """\
def fsdp_shim_watcher(name, path=None, target=None):
    if name in ("lightning", "lightning_fabric", "pytorch_lightning"):
        try:
            import _fsdp_shim_startup
            return _fsdp_shim_startup.on_first_lightning_import(name, SOURCE)
        except Exception:
            return None
fsdp_shim_watcher.find_spec = fsdp_shim_watcher
sys.meta_path.insert(0, fsdp_shim_watcher)
"""
"""The watcher, as source, so the start-up file can run it with ``exec`` and no import. It is
executed in a namespace holding ``sys`` and ``SOURCE`` (how the shim was armed, for ``status()``).

A function that is its own ``find_spec`` attribute is a complete ``sys.meta_path`` finder, and
compiling and creating it costs measurably less at start-up than a class (about 1% of a bare
``python -c pass`` here); so the code is kept to the minimum, and the rest happens in
:func:`on_first_lightning_import`, which takes every watcher off ``sys.meta_path`` (``site`` reads
the start-up file twice in a venv whose ``lib64`` is a symlink to ``lib``, arming two). A watcher
never finds a module itself; if this module or the shim is gone (``pip uninstall`` left the start-up
file behind), the import of Lightning simply proceeds."""

sources = []
"""How the hook was armed in this process ("startup file", "fsdp-shim run"); status() reports it."""


def on_first_lightning_import(name: str, source: str) -> "ModuleSpec | None":
    """Disarm every watcher, load the shim, then repeat the lookup of ``name``: finders the shim
    inserted ahead of the watcher (wrapt's post-import hook finder) were skipped by the search
    already under way and would otherwise miss this very import."""
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__name__", None) != "fsdp_shim_watcher"]
    if not load_shim(source):
        return None
    import importlib.util

    return importlib.util.find_spec(name)


def load_shim(source: str) -> bool:
    """Import the shim (which activates itself) unless ``FSDP_SHIM`` says off; never raises.

    ``FSDP_SHIM`` is read here, not at start-up, so a script can still switch the shim off
    (``os.environ["FSDP_SHIM"] = "0"`` before ``import lightning``).
    """
    if source not in sources:
        sources.append(source)
    if os.environ.get("FSDP_SHIM", "").strip().lower() in OFF_VALUES:
        return False
    try:
        import fsdp_shim  # noqa: F401
    except Exception:  # a broken shim must not stop Lightning from importing
        return False
    return True


def arm(source: str) -> None:
    """Arm the watcher from code that is already running (the ``fsdp-shim run`` bootstrap, PEP 829).

    The source is recorded now: if the start-up file armed a watcher first, this one is not added.
    """
    if source not in sources:
        sources.append(source)
    if any(name in sys.modules for name in ("lightning", "lightning_fabric", "pytorch_lightning")):
        load_shim(source)  # Lightning came first (another start-up hook imported it): patch at once
        return
    if not any(getattr(f, "__name__", None) == "fsdp_shim_watcher" for f in sys.meta_path):
        exec(WATCHER_CODE, {"sys": sys, "SOURCE": source})


def arm_from_startup_file() -> None:
    """PEP 829 entry point (``_fsdp_shim_startup:arm_from_startup_file``)."""
    arm("startup file")
