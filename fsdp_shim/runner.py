"""``fsdp-shim run CMD ...``: run a command with the bootstrap ``sitecustomize`` first on PYTHONPATH.

The command replaces this process (``exec``), so its exit code and the signals sent to it are its
own, exactly as if it had been started directly; every Python process it starts inherits
``PYTHONPATH`` and arms the shim at start-up.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import fsdp_shim.bootstrap

BOOTSTRAP_DIRECTORY = str(Path(fsdp_shim.bootstrap.__file__).resolve().parent)

# Options of the python command that take a value (``-W default``), and those that end the options.
_PYTHON_OPTIONS_WITH_VALUE = "WX"
_PYTHON_OPTIONS_ENDING = "cm"
_PYTHON_EXECUTABLE = re.compile(r"^(python|pypy)[0-9.]*[a-z]?(\.exe)?$")
SKIPPING_FLAGS = {
    "I": "-I (isolated mode) ignores PYTHONPATH",
    "E": "-E ignores PYTHONPATH",
    "S": "-S skips site, so no sitecustomize runs",
}


def _same_directory(entry: str, directory: str) -> bool:
    return bool(entry) and os.path.realpath(entry) == directory


def bootstrap_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH with the bootstrap folder first, once, and every other entry kept as written.

    An empty entry means the current directory (``export PYTHONPATH=$PYTHONPATH:/x`` makes one), so
    it is kept; an unset or empty PYTHONPATH adds nothing but the bootstrap folder.
    """
    current = environ.get("PYTHONPATH", "")
    if not current:
        return BOOTSTRAP_DIRECTORY
    entries = [e for e in current.split(os.pathsep) if not _same_directory(e, BOOTSTRAP_DIRECTORY)]
    return os.pathsep.join([BOOTSTRAP_DIRECTORY, *entries])


def bootstrap_on_pythonpath(environ: Mapping[str, str]) -> list[str]:
    """Entries of PYTHONPATH that look like an fsdp-shim bootstrap folder (this one or another)."""
    found = []
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and Path(entry).name == "bootstrap" and Path(entry).parent.name == "fsdp_shim":
            found.append(entry)  # existing or not: a stale entry is worth reporting too
    return found


def python_command(command: list[str]) -> list[str] | None:
    """The interpreter and its arguments if ``command`` starts Python, directly or through a script's
    ``#!`` line; ``None`` otherwise."""
    if _PYTHON_EXECUTABLE.match(os.path.basename(command[0])):
        return command
    path = shutil.which(command[0])
    if path is None:
        return None
    try:
        with open(path, "rb") as script:
            first_line = script.readline(512).decode("utf-8", "replace")
    except OSError:
        return None
    if not first_line.startswith("#!"):
        return None
    words = first_line[2:].split()
    if words[:1] and os.path.basename(words[0]) == "env":
        words = words[1:]
        if words[:1] == ["-S"]:  # `#!/usr/bin/env -S python3 -I`: env splits the rest into arguments
            words = words[1:]
    if not words or not _PYTHON_EXECUTABLE.match(os.path.basename(words[0])):
        return None
    return [*words, *command[1:]]


def flags_skipping_the_bootstrap(command: list[str]) -> list[str]:
    """The python options in ``command`` that keep the bootstrap from running (``-I``, ``-E``, ``-S``)."""
    python = python_command(command)
    if python is None:
        return []
    found = []
    arguments = iter(python[1:])
    for argument in arguments:
        if argument in ("-", "--") or not argument.startswith("-"):
            break
        if argument.startswith("--"):
            if argument == "--check-hash-based-pycs":
                next(arguments, None)
            continue
        letters = argument[1:]
        for index, letter in enumerate(letters):
            if letter in SKIPPING_FLAGS and letter not in found:
                found.append(letter)
            if letter in _PYTHON_OPTIONS_ENDING:
                return found
            if letter in _PYTHON_OPTIONS_WITH_VALUE:
                if index == len(letters) - 1:
                    next(arguments, None)
                break
    return found


def run(command: list[str]) -> int:
    """Exec ``command``; returns only when it cannot be started (126/127, as a shell does)."""
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    skipping = flags_skipping_the_bootstrap(command)
    if skipping:
        reasons = "; ".join(SKIPPING_FLAGS[flag] for flag in skipping)
        remedy = (
            "only `import fsdp_shim` in the script can"
            if "S" in skipping
            else "only an installed start-up file (`fsdp-shim install`) or `import fsdp_shim` in the script can"
        )
        print(
            f"fsdp-shim run: warning: cannot activate the shim in this Python process ({reasons}); {remedy}.",
            file=sys.stderr,
        )
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
