"""``fsdp-shim run``'s start-up hook, first on ``PYTHONPATH``: arms the shim, then imports the ``sitecustomize``
it shadows, once. Every process the command starts runs it, old Pythons too: it imports nothing heavy."""
# ruff: noqa: ANN001, ANN202, ANN204, UP004, UP031, UP036  (parsed by every Python: no annotations, no f-strings)

import os
import sys


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


if sys.version_info >= (3, 9):
    try:
        import _fsdp_shim

        _fsdp_shim.arm("fsdp-shim run")
    except Exception as _error:  # never stop an interpreter from starting: say so at its first Lightning import
        sys.meta_path.insert(0, _NotArmed(_error))

# The shadowed sitecustomize, if any, with only this folder off sys.path; this module stays if it is the last.
_here, _this_module = os.path.realpath(os.path.dirname(os.path.abspath(__file__))), sys.modules.pop(__name__, None)
sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401
except Exception as _error:  # none to shadow is fine; where the user's fails, say what `site` says
    if not isinstance(_error, ImportError) or getattr(_error, "name", "sitecustomize") != "sitecustomize":
        sys.stderr.write(
            "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(_error).__name__, _error)
        )
if __name__ not in sys.modules and _this_module is not None:
    sys.modules[__name__] = _this_module
