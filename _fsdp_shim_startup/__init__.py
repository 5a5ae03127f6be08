"""What the start-up files of fsdp-shim 0.2.0 import.

``fsdp-shim install`` of 0.2.0 wrote a ``.pth`` whose watcher runs ``_fsdp_shim_startup.hand_over``
and, where this module is missing, lets Lightning load unpatched without a word. A user who upgrades
and does not run ``fsdp-shim install`` again keeps that file, so this module keeps it working: it arms
this release's finder and hands the package over as that finder would. ``fsdp-shim status`` names the
old file as a problem; ``fsdp-shim install`` replaces it. (A package, not a module, for the same
reason as ``_fsdp_shim``: every uninstaller removes its ``__pycache__``.)
"""

import _fsdp_shim

SOURCE = "fsdp-shim 0.2.0's start-up file (`fsdp-shim install` replaces it)"


def hand_over(module, loader, source):
    """0.2.0's hand-over of a top-level Lightning package (``lightning``, ``lightning_fabric`` or
    ``pytorch_lightning``) that its watcher is about to load: arm first, so that the namespaces the
    package imports while it executes are seen executing, then run its own loader."""
    _fsdp_shim.arm(SOURCE)
    module.__loader__ = module.__spec__.loader = loader
    loader.exec_module(module)
    if module.__name__ in _fsdp_shim.NAMESPACES:
        _fsdp_shim._hand_over(module, None)


def arm_from_startup_file():
    """0.2.0's ``fsdp_shim.start`` entry point (PEP 829: Python 3.15+ reads that file instead of the
    ``.pth``'s import line)."""
    _fsdp_shim.arm(SOURCE)
