"""What the start-up files of fsdp-shim 0.2.0 import, kept so that they still arm the shim after an upgrade with
pip alone (docs/removal.md); without this module they would let Lightning load unpatched without a word. A
package, not a module, for the same reason as ``_fsdp_shim``: every uninstaller removes its ``__pycache__``."""

import _fsdp_shim

SOURCE = "fsdp-shim 0.2.0's start-up file (`fsdp-shim install` replaces it)"


def hand_over(module, loader, source):
    """0.2.0's hand-over of a top-level Lightning package its watcher is about to load: arm first, so that the
    namespaces the package imports while it executes are seen executing, then run its own loader."""
    _fsdp_shim.arm(SOURCE)
    module.__loader__ = module.__spec__.loader = loader
    loader.exec_module(module)
    if module.__name__ in _fsdp_shim.NAMESPACES:
        _fsdp_shim._hand_over(module, None)


def arm_from_startup_file():
    """0.2.0's ``fsdp_shim.start`` entry point (PEP 829: Python 3.15+ reads it instead of the ``.pth``)."""
    _fsdp_shim.arm(SOURCE)
