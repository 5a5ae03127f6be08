"""Start-up hook that ``fsdp-shim run`` puts first on ``PYTHONPATH``.

Python imports one module named ``sitecustomize`` at start-up; this one arms the shim and then
imports the ``sitecustomize`` it shadows (module or package form), exactly once, so that an
environment's own start-up customisation keeps working: its ``sys.path`` changes stay, and
``import sitecustomize`` afterwards gives that module, not this one. Every Python child inherits
``PYTHONPATH`` and so gets the same treatment: torchrun workers, Lightning's launcher re-running the
script, multiprocessing spawn.

If the shim cannot be armed (the interpreter ``run`` started belongs to another environment, without
fsdp-shim), the first import of Lightning says so, and fails in strict mode.

``fsdp-shim run python2.7 ...`` (or any Python older than the shim supports, 3.9) runs this file too,
so it is written to be parsed by every Python (no f-strings, no annotations): under such a Python it
only chains to the shadowed ``sitecustomize`` and says nothing, since the shim cannot run there anyway.

Do not import anything heavy here: it runs in every Python process the command starts.
"""
# ruff: noqa: ANN001, ANN202, ANN204, UP031  (parsed by every Python: no annotations, no f-strings)

import os
import sys

SUPPORTED = sys.version_info >= (3, 9)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm_shim():
    try:
        import _fsdp_shim

        _fsdp_shim.arm("fsdp-shim run")
    except Exception as error:  # never stop an interpreter from starting; say so at Lightning's import
        sys.meta_path.insert(0, _NotArmed(error, _startup_module()))


def _startup_module():
    """The start-up module next to this folder (``_fsdp_shim/__init__.py``), loaded by its path under
    another name: it cannot be imported here, which is why arming failed, and it holds the one table of
    Lightning namespaces and the one parser of the switches. Standard library only; loading it under
    that name runs nothing. ``None`` where it cannot be read either."""
    try:
        import importlib.util

        path = os.path.join(os.path.dirname(_HERE), "__init__.py")
        spec = importlib.util.spec_from_file_location("_fsdp_shim_bootstrap_startup", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:
        return None


class _NotArmed:
    """Finder that reports, once, at the first Lightning import, that the shim could not be armed (at
    the next import of anything where the start-up module cannot be read either)."""

    def __init__(self, error, startup):
        self.error = error
        self.startup = startup

    def find_spec(self, name, path=None, target=None):
        startup = self.startup
        if self.error is None or (startup is not None and name.partition(".")[0] not in _packages(startup)):
            return None
        error, self.error = self.error, None
        message = (
            "fsdp-shim run: the shim could not be armed in %s (%s: %s), so Lightning runs without its fixes."
            " Install fsdp-shim in this interpreter's environment." % (sys.executable, type(error).__name__, error)
        )
        strict = startup.switch_state(os.environ.get(startup.STRICT_VARIABLE)) if startup is not None else "off"
        if strict in ("on", "invalid"):
            raise ImportError(message + " FSDP_SHIM_STRICT is on, so this import fails instead.")
        sys.stderr.write(message + "\n")
        return None


def _packages(startup):
    return set(namespace.partition(".")[0] for namespace in startup.NAMESPACES)


def _run_shadowed_sitecustomize():
    """Import the next ``sitecustomize`` on the path, with this folder (and any alias of it) removed
    from ``sys.path`` for good: only that folder, so entries the other module adds stay."""
    here = os.path.realpath(_HERE)
    this_module = sys.modules.pop(__name__, None)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401 - the shadowed one, if there is one
    except ImportError as error:
        if getattr(error, "name", "sitecustomize") != "sitecustomize":  # the user's sitecustomize failed
            _report(error)
    except Exception as error:
        _report(error)
    if __name__ not in sys.modules and this_module is not None:
        sys.modules[__name__] = this_module  # there was none to shadow: the import system expects one


def _report(error):
    """What ``site`` itself does when a sitecustomize fails: print and carry on."""
    sys.stderr.write(
        "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(error).__name__, error)
    )


if SUPPORTED:
    _arm_shim()
_run_shadowed_sitecustomize()
