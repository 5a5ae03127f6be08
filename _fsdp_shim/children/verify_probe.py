"""``python <this file> REQUEST_JSON``: verify's probe, by its path, so no module of the current folder runs in it.
Lightning's launcher re-runs ``sys.argv`` (this file, the same request) on every other rank."""

import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(HERE))  # site-packages, or a clone's root (uninstalled)

if __name__ == "__main__":
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != HERE]
    # A clone first, so the probe imports the fsdp_shim that started it; by real path, as an environment under a
    # symbolic link is already there, and its site-packages first would shadow the stdlib.
    if PACKAGE_ROOT not in {os.path.realpath(entry or os.curdir) for entry in sys.path}:
        sys.path.insert(0, PACKAGE_ROOT)
    from _fsdp_shim.verify.probe import main

    main(sys.argv[1:])
