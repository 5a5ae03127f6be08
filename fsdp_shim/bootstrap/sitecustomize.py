"""Start-up hook that ``fsdp-shim run`` puts first on ``PYTHONPATH``.

Python imports one module named ``sitecustomize`` at start-up; this one arms the shim and then
runs the ``sitecustomize`` it shadows (module or package form), exactly once, so an environment's
own start-up customisation keeps working. Every Python child inherits ``PYTHONPATH`` and so gets the
same treatment: torchrun workers, Lightning's launcher re-running the script, multiprocessing spawn.

Do not import anything heavy here: it runs in every Python process the command starts.
"""

import os
import sys


def _arm_shim() -> None:
    try:
        import _fsdp_shim_startup

        _fsdp_shim_startup.arm("fsdp-shim run")
    except Exception:  # the shim must never stop an interpreter from starting
        pass


def _run_shadowed_sitecustomize() -> None:
    """Import the next ``sitecustomize`` on the path, with this folder (and any alias of it) hidden."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    this_module = sys.modules.get(__name__)
    saved_path = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    sys.modules.pop(__name__, None)
    try:
        import sitecustomize  # noqa: F401 - the shadowed one, if there is one
    except ImportError as error:
        if error.name != "sitecustomize":  # the user's sitecustomize itself failed to import something
            _report(error)
    except Exception as error:
        _report(error)
    finally:
        shadowed = sys.modules.get(__name__)
        sys.path[:] = saved_path
        if this_module is not None:
            sys.modules[__name__] = this_module
            this_module.shadowed_sitecustomize = shadowed  # type: ignore[attr-defined]


def _report(error: BaseException) -> None:
    """What ``site`` itself does when a sitecustomize fails: print and carry on."""
    sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(error).__name__}: {error}\n")


shadowed_sitecustomize = None
_arm_shim()
_run_shadowed_sitecustomize()
