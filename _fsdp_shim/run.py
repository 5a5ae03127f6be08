"""``fsdp-shim run CMD ...``: ``FSDP_SHIM=1`` for every interpreter with fsdp-shim installed, and a bootstrap
``sitecustomize`` first on ``PYTHONPATH`` for one that imports it from elsewhere; then exec ``CMD``."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from _fsdp_shim.config import SHIM_VARIABLE, switch_state

BOOTSTRAP_DIRECTORY = str(Path(__file__).resolve().parent / "bootstrap")


def bootstrap_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH with the bootstrap folder first, once, and every other entry as written (an empty one too)."""
    current = environ.get("PYTHONPATH", "")
    entries = [e for e in current.split(os.pathsep) if not (e and os.path.realpath(e) == BOOTSTRAP_DIRECTORY)]
    return os.pathsep.join([BOOTSTRAP_DIRECTORY, *entries]) if current else BOOTSTRAP_DIRECTORY


def bootstrap_on_pythonpath(environ: Mapping[str, str]) -> list[str]:
    """Entries of PYTHONPATH that look like any fsdp-shim's bootstrap folder, existing or not."""
    entries = environ.get("PYTHONPATH", "").split(os.pathsep)
    return [e for e in entries if e and Path(e).name == "bootstrap" and Path(e).parent.name == "_fsdp_shim"]


def run(command: list[str]) -> int:
    """Exec ``command``; returns only when it cannot be started (126/127, as a shell does)."""
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    environ = {**os.environ, "PYTHONPATH": bootstrap_pythonpath(os.environ)}
    if switch_state(environ.get(SHIM_VARIABLE)) == "unset":
        environ[SHIM_VARIABLE] = "1"
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
