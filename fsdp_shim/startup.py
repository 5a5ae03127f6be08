"""What the environment-wide start-up file runs (``fsdp_shim.pth``, or ``fsdp_shim.start`` on
interpreters that implement PEP 829).

Importing this module has already run ``fsdp_shim/__init__`` and so armed the shim; nothing here may
import anything heavy, because it runs in every Python process of the environment.
"""

from fsdp_shim.activation import record_source

SOURCE = "startup file"


def activate_from_startup_file() -> None:
    """PEP 829 entry point (``fsdp_shim.startup:activate_from_startup_file``)."""
    record_source(SOURCE)


activate_from_startup_file()
