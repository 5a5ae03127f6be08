"""``fsdp-shim run``'s start-up hook, first on ``PYTHONPATH``: arms the shim, then imports the ``sitecustomize``
it shadows, once. Every process the command starts runs it, old Pythons too: it imports nothing heavy."""
# ruff: noqa: ANN001, ANN202, ANN204, UP004, UP031, UP036  (parsed by every Python: no annotations, no f-strings)

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm_shim():
    try:
        import _fsdp_shim

        _fsdp_shim.arm("fsdp-shim run")
    except Exception as error:  # never stop an interpreter from starting: say so at its first Lightning import
        sys.meta_path.insert(0, _NotArmed(error))


class _NotArmed(object):
    """A finder that says, once, at the first Lightning import, that the shim could not be armed."""

    def __init__(self, error):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if self.error is None or name.partition(".")[0] not in ("lightning", "lightning_fabric", "pytorch_lightning"):
            return None
        error, self.error = self.error, None
        message = (
            "fsdp-shim run: the shim could not be armed in %s (%s: %s), so Lightning runs without its fixes."
            " Install fsdp-shim in this interpreter's environment." % (sys.executable, type(error).__name__, error)
        )
        strict = os.environ.get("FSDP_SHIM_STRICT", "").strip().lower()
        if strict and strict not in ("0", "false", "off", "no", "n", "disable", "disabled"):  # on, or unreadable
            raise ImportError(message + " FSDP_SHIM_STRICT is on, so this import fails instead.")
        sys.stderr.write(message + "\n")
        return None


def _run_shadowed_sitecustomize():
    """Import the next ``sitecustomize``, with only this folder off ``sys.path``."""
    here = os.path.realpath(_HERE)
    this_module = sys.modules.pop(__name__, None)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401 - the shadowed one, if there is one
    except Exception as error:  # none to shadow is fine; where the user's fails, say what `site` says
        if not isinstance(error, ImportError) or getattr(error, "name", "sitecustomize") != "sitecustomize":
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(error).__name__, error)
            )
    if __name__ not in sys.modules and this_module is not None:
        sys.modules[__name__] = this_module


if sys.version_info >= (3, 9):
    _arm_shim()
_run_shadowed_sitecustomize()
