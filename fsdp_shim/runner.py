"""``fsdp-shim run CMD ...``: run a command with the bootstrap ``sitecustomize`` first on PYTHONPATH.

The command replaces this process (``exec``), so its exit code and the signals sent to it are its
own, exactly as if it had been started directly; every Python process it starts inherits
``PYTHONPATH`` and arms the shim at start-up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import fsdp_shim.bootstrap

BOOTSTRAP_DIRECTORY = str(Path(fsdp_shim.bootstrap.__file__).resolve().parent)


def _same_directory(entry: str, directory: str) -> bool:
    return bool(entry) and os.path.realpath(entry) == directory


def bootstrap_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH with the bootstrap folder first, once (a nested ``run`` does not add it again)."""
    entries = [
        e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e and not _same_directory(e, BOOTSTRAP_DIRECTORY)
    ]
    return os.pathsep.join([BOOTSTRAP_DIRECTORY, *entries])


def bootstrap_on_pythonpath(environ: Mapping[str, str]) -> list[str]:
    """Entries of PYTHONPATH that look like an fsdp-shim bootstrap folder (this one or another)."""
    found = []
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and Path(entry).name == "bootstrap" and Path(entry).parent.name == "fsdp_shim":
            found.append(entry)  # existing or not: a stale entry is worth reporting too
    return found


def run(command: list[str]) -> int:
    """Exec ``command``; returns only when it cannot be started (126/127, as a shell does)."""
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    environ["PYTHONPATH"] = bootstrap_pythonpath(environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, environ)
    except FileNotFoundError:
        print(f"fsdp-shim run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"fsdp-shim run: permission denied: {command[0]}", file=sys.stderr)
        return 126
    return 0  # unreachable: exec does not return
