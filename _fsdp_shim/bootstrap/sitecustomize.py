"""Start-up hook that ``fsdp-shim run`` puts first on ``PYTHONPATH``: arms the shim, then imports the
``sitecustomize`` it shadows exactly once (docs/activation.md). Where arming fails (another environment's
interpreter), the first Lightning import says so, and fails in strict mode. Every process the command starts
runs this file, ``python2.7`` too: so it imports nothing heavy, and under a Python older than 3.9 only chains."""
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
    """``_fsdp_shim/__init__.py``, which cannot be imported, loaded by its path under a name that runs nothing."""
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
    """Finder that says, once, at the first Lightning import, that the shim could not be armed."""

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
    """Import the next ``sitecustomize``, with only this folder off ``sys.path`` (for good: that module's stay)."""
    here = os.path.realpath(_HERE)
    this_module = sys.modules.pop(__name__, None)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401 - the shadowed one, if there is one
    except Exception as error:  # none to shadow is fine; where the user's fails, do what `site` does
        if not isinstance(error, ImportError) or getattr(error, "name", "sitecustomize") != "sitecustomize":
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(error).__name__, error)
            )
    if __name__ not in sys.modules and this_module is not None:
        sys.modules[__name__] = this_module  # there was none to shadow: the import system expects one


if SUPPORTED:
    _arm_shim()
_run_shadowed_sitecustomize()
