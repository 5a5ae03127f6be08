"""fsdp-shim: fixes for FSDP "true"-precision training in Lightning, without upgrading or forking it.

Importing this package activates the shim, like ``import ddtrace.auto`` (the implementation,
``_fsdp_shim``, activates nothing). With ``strategy="fsdp"`` and ``precision="bf16-true"`` or
``"16-true"`` it applies two fixes, each only to the Lightning releases that lack it: **cast**
(2.1.0-2.4.x) casts the model to the precision's dtype before FSDP wraps it, as Lightning 2.5.0 does
(without it, sharded parameters, gradients and optimizer state take twice the memory); **recompute**
(2.1.0 and later) recomputes activation-checkpointed blocks in the forward's default dtype, not float32.

``FSDP_SHIM=0`` switches it off without changing code, ``FSDP_SHIM_DISABLED_FIXES=recompute`` (or
``cast``) one fix. ``python -m fsdp_shim`` is the ``fsdp-shim`` command, which activates nothing.
"""

from __future__ import annotations

import sys
import types

from _fsdp_shim import FSDPShimWarning
from _fsdp_shim._version import __version__
from _fsdp_shim.activation import activate, deactivate, status
from _fsdp_shim.failures import FSDPShimError

__all__ = ["FSDPShimError", "FSDPShimWarning", "__version__", "activate", "deactivate", "status"]


def _runs_the_command() -> bool:
    """Whether this is ``python -m fsdp_shim``, which imports this package before it runs the command: the
    command inspects the environment and must not activate (its console script imports only the CLI).

    While ``-m`` locates its module, ``sys.argv[0]`` is ``"-m"`` (documented on every Python); which module,
    ``sys.orig_argv`` says from 3.10 on (the word before the module's own arguments), and on 3.9 the frame of
    runpy that is locating it (3.9's runpy no longer changes). Another module run with ``-m`` whose package
    imports fsdp_shim activates as usual, also where its arguments hold ``-m fsdp_shim``."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", None)
    if argv is not None:
        before_arguments = argv[: len(argv) - len(sys.argv) + 1]
        return before_arguments[-2:] == ["-m", __name__] or before_arguments[-1:] == [f"-m{__name__}"]
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_run_module_as_main" and frame.f_globals.get("__name__") == "runpy":
            return frame.f_locals.get("mod_name") == __name__
        frame = frame.f_back
    return False


if not _runs_the_command():
    activate()
