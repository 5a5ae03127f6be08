"""``fsdp-shim run CMD ...``: run a command with the shim armed in every Python process it starts.

Two ways in, because launchers lose one or the other: ``FSDP_SHIM=1`` (set when unset), which arms
the shim in any interpreter that has fsdp-shim installed (its ``fsdp_shim_env.pth``), even where a
job script overwrites ``PYTHONPATH``; and the bootstrap ``sitecustomize`` first on ``PYTHONPATH``,
for interpreters of another environment that has no fsdp-shim. A command that drops the environment
altogether (``srun --export=...``, ``env -i``, ``sudo``) is warned about before it starts.

The command replaces this process (``exec``), so its exit code and the signals sent to it are its
own, exactly as if it had been started directly.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from _fsdp_shim.config import SHIM_VARIABLE, switch_state
from _fsdp_shim.startup_files import ENVIRONMENT_FILE, site_directories

BOOTSTRAP_DIRECTORY = str(Path(__file__).resolve().parent / "bootstrap")

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
        if entry and Path(entry).name == "bootstrap" and Path(entry).parent.name in ("_fsdp_shim", "fsdp_shim"):
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


def _has_this_fsdp_shim(command: list[str]) -> bool:
    """Whether the command's Python is this very interpreter (not resolved through links: a virtual
    environment's python links to its base) and this one has the start-up file pip installs."""
    python = python_command(command)
    if python is None:
        return False
    found = shutil.which(python[0])
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return False
    return any((directory / ENVIRONMENT_FILE).is_file() for directory in site_directories())


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


_SLURM_COMMANDS = ("srun", "sbatch", "salloc")
_SLURM_EXPORT_VARIABLES = {"srun": "SLURM_EXPORT_ENV", "sbatch": "SBATCH_EXPORT", "salloc": "SALLOC_EXPORT"}
_REACHES_THE_SHIM = ("PYTHONPATH", SHIM_VARIABLE)


def _passes_the_shim(names: list[str]) -> bool:
    return any(name.partition("=")[0] in _REACHES_THE_SHIM for name in names)


def _slurm_export(words: list[str], program: str, environ: Mapping[str, str]) -> str | None:
    """The ``--export`` value the SLURM command will use (its option, else its variable), or None."""
    for index, word in enumerate(words):
        if word == "--export" and index + 1 < len(words):
            return words[index + 1]
        if word.startswith("--export="):
            return word.partition("=")[2]
    return environ.get(_SLURM_EXPORT_VARIABLES[program])


def _leading_options(words: list[str], with_value: str) -> list[str]:
    """The options before the command a launcher runs (``with_value``: short options taking a value)."""
    options = []
    arguments = iter(words)
    for word in arguments:
        if word == "--" or not word.startswith("-") or word == "-":
            if word == "-":
                options.append(word)
            break
        options.append(word)
        if not word.startswith("--") and word[-1] in with_value:
            next(arguments, None)
    return options


def _env_options(words: list[str]) -> tuple[bool, list[str]]:
    """Whether ``env`` clears the environment, and the ``NAME=VALUE`` it sets before its command."""
    clears = False
    assignments = []
    arguments = iter(words)
    for word in arguments:
        if word in ("-", "--ignore-environment"):
            clears = True
        elif word.startswith("--"):
            continue
        elif word.startswith("-") and len(word) > 1:
            letters = word[1:]
            for index, letter in enumerate(letters):
                if letter == "i":
                    clears = True
                if letter in "uCS":  # takes a value: the rest of the word, or the next one
                    if index == len(letters) - 1:
                        next(arguments, None)
                    break
        elif "=" in word:
            assignments.append(word)
        else:
            break
    return clears, assignments


def _sudo_options(words: list[str]) -> tuple[bool, list[str]]:
    """Whether ``sudo`` keeps the whole environment, and the names its ``--preserve-env=`` lists."""
    keeps_all = False
    preserved: list[str] = []
    for option in _leading_options(words, with_value="ugCDhprtURT"):
        if option == "--preserve-env":
            keeps_all = True
        elif option.startswith("--preserve-env="):
            preserved += option.partition("=")[2].split(",")
        elif not option.startswith("--") and "E" in option[1:]:
            keeps_all = True
    return keeps_all, preserved


def environment_warnings(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """One warning per launcher in ``command`` that starts its command without this environment.

    Such a launcher drops ``PYTHONPATH`` and ``FSDP_SHIM`` both, so no Python it starts gets the shim,
    and every rank trains unpatched with exit code 0: worth saying before the job starts.
    """
    warnings = []
    for index, word in enumerate(command):
        program = os.path.basename(word)
        rest = command[index + 1 :]
        if program in _SLURM_COMMANDS:
            value = _slurm_export(rest, program, environ)
            if value is None or value == "ALL" or value.startswith("ALL,"):
                continue
            names = [] if value == "NONE" else value.split(",")
            if not _passes_the_shim(names):
                warnings.append(
                    f"`{program} --export={value}` passes neither PYTHONPATH nor {SHIM_VARIABLE} to its tasks, so no "
                    f"rank will have the shim. Put fsdp-shim run inside it (`{program} ... fsdp-shim run python ...`), "
                    f"use --export=ALL,..., or export {SHIM_VARIABLE}=1 (--export={SHIM_VARIABLE}=1,...) with "
                    "fsdp-shim installed on every node."
                )
        elif program == "env":
            clears, assignments = _env_options(rest)
            if clears and not _passes_the_shim(assignments):
                warnings.append(
                    "`env -i` starts its command with an empty environment, so it gets no shim. Put fsdp-shim run "
                    f"after it (`env -i ... fsdp-shim run python ...`) or pass {SHIM_VARIABLE}=1 "
                    f"(`env -i {SHIM_VARIABLE}=1 ...`) with fsdp-shim installed there."
                )
        elif program == "sudo":
            keeps_all, preserved = _sudo_options(rest)
            if not (keeps_all or _passes_the_shim(preserved)):
                warnings.append(
                    "`sudo` resets the environment, so its command gets no shim. Use `sudo -E`, "
                    f"`sudo --preserve-env=PYTHONPATH,{SHIM_VARIABLE}`, or `sudo ... fsdp-shim run python ...`."
                )
    return warnings


def run(command: list[str]) -> int:
    """Exec ``command``; returns only when it cannot be started (126/127, as a shell does)."""
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    skipping = flags_skipping_the_bootstrap(command)
    if "S" not in skipping and _has_this_fsdp_shim(command):
        skipping = []  # -I/-E drop PYTHONPATH, but this interpreter's fsdp_shim_env.pth reads FSDP_SHIM
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
    for warning in environment_warnings(command, os.environ):
        print(f"fsdp-shim run: warning: {warning}", file=sys.stderr)
    environ = dict(os.environ)
    environ["PYTHONPATH"] = bootstrap_pythonpath(environ)
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
