"""``fsdp-shim run CMD ...`` (docs/activation.md), two ways in, because launchers lose one or the other: ``FSDP_SHIM=1``
arms any interpreter with fsdp-shim installed, even where a job script overwrites ``PYTHONPATH``; the bootstrap
``sitecustomize`` first on ``PYTHONPATH`` arms one of another environment. A launcher that drops both is warned of."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple, Optional

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


def bootstrap_pythonpath(environ: Mapping[str, str]) -> str:
    """PYTHONPATH with the bootstrap folder first, once, and every other entry as written (an empty one too)."""
    current = environ.get("PYTHONPATH", "")
    entries = [e for e in current.split(os.pathsep) if not (e and os.path.realpath(e) == BOOTSTRAP_DIRECTORY)]
    return os.pathsep.join([BOOTSTRAP_DIRECTORY, *entries]) if current else BOOTSTRAP_DIRECTORY


def bootstrap_on_pythonpath(environ: Mapping[str, str]) -> list[str]:
    """Entries of PYTHONPATH that look like any fsdp-shim's bootstrap folder, existing or not (stale ones too)."""
    entries, owners = environ.get("PYTHONPATH", "").split(os.pathsep), ("_fsdp_shim", "fsdp_shim")
    return [e for e in entries if e and Path(e).name == "bootstrap" and Path(e).parent.name in owners]


def python_command(command: list[str]) -> list[str] | None:
    """The interpreter and its arguments if ``command`` starts Python, directly or by a ``#!`` line."""
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
    words = first_line[2:].split() if first_line.startswith("#!") else []
    if words[:1] and os.path.basename(words[0]) == "env":
        words = words[1:]
        if words[:1] == ["-S"]:  # `#!/usr/bin/env -S python3 -I`: env splits the rest into arguments
            words = words[1:]
    if not words or not _PYTHON_EXECUTABLE.match(os.path.basename(words[0])):
        return None
    return [*words, *command[1:]]


def _has_this_fsdp_shim(python: list[str]) -> bool:
    """Whether ``python`` is this interpreter (links kept: a venv's links to its base) with pip's start-up file."""
    found = shutil.which(python[0])
    this_one = found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)
    return this_one and any((directory / ENVIRONMENT_FILE).is_file() for directory in site_directories())


def flags_skipping_the_bootstrap(python: list[str]) -> list[str]:
    """The options of a python command line that keep the bootstrap from running (``-I``, ``-E``, ``-S``)."""
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


class _Syntax(NamedTuple):
    """The option table of a launcher that `environment_warnings` follows, read as getopt_long with "+" reads it
    (options end at the first word that is not one). Only its own names matter: an unknown one stops the launcher."""

    short_with_value: str  # short options that take the rest of their word, else the next word
    long_without_value: str  # long options (space-separated) that never take the next word; every other one does
    assignments: bool = False  # whether NAME=VALUE words among the options set variables for its command


# SLURM's src/common/slurm_opt.c (SchedMD/slurm 284c3b95): the srun, salloc and sbatch long options whose has_arg is not
# required_argument, less --wait, which takes a value in srun (sbatch's entry adds it back).
_SLURM_LONG_WITHOUT_VALUE = (
    "async bcast bell compress consolidate-segments contiguous debugger-test disable-status exact exclusive "
    "external external-launcher get-user-env help hold ignore-pbs immediate interactive kill-command "
    "kill-on-bad-exit label multi-prog nice no-allocate no-bell no-kill no-requeue no-shell oom-kill-step "
    "overcommit overlap oversubscribe parsable preserve-env propagate pty quiet quit-on-interrupt reboot requeue "
    "resv-ports send-libs spread-job spread-segments stepmgr test-only unbuffered usage use-min-nodes verbose "
    "version wait-for-children whole x11"
)
_SLURM_SHORT_WITH_VALUE = "ABCDFGJLMNSTWabcdeimnopqrtwx"  # -W takes a value in srun only
_LAUNCHERS = {
    "srun": _Syntax(_SLURM_SHORT_WITH_VALUE, _SLURM_LONG_WITHOUT_VALUE),
    "salloc": _Syntax(_SLURM_SHORT_WITH_VALUE, _SLURM_LONG_WITHOUT_VALUE),
    "sbatch": _Syntax(_SLURM_SHORT_WITH_VALUE.replace("W", ""), f"{_SLURM_LONG_WITHOUT_VALUE} wait"),
    # GNU env (coreutils 9.7: "+a:C:iS:u:v0"); a lone "-" is its old spelling of -i.
    "env": _Syntax(
        "aCSu",
        "block-signal debug default-signal help ignore-environment ignore-signal list-signal-handling null version",
        assignments=True,
    ),
    # sudo 1.9 ("+Aa:BbC:c:D:Eeg:Hh::iKklNnPp:R:r:SsT:t:U:u:Vv"; `-h HOST` is read as a value, as sudo
    # does when a plain word follows it): -E takes no value, --preserve-env only `=LIST`.
    "sudo": _Syntax(
        "aCcDghpRrTtUu",
        "askpass background bell edit help list login no-update non-interactive preserve-env preserve-groups "
        "remove-timestamp reset-timestamp set-home shell stdin validate version",
        assignments=True,
    ),
}
# Where srun and sbatch read --export when it is not given, the first one set wins (salloc has neither).
_SLURM_EXPORT_VARIABLES = {"srun": ("SRUN_EXPORT_ENV", "SLURM_EXPORT_ENV"), "sbatch": ("SBATCH_EXPORT",)}
# What `fsdp-shim run` gives its command: either one reaching it counts, except where sudo picks the Python.
_SHIM_VARIABLES = frozenset(("PYTHONPATH", SHIM_VARIABLE))
_Options = list[tuple[str, Optional[str]]]  # a launcher's options as (name, value) pairs


def _is_assignment(word: str) -> bool:
    return "=" in word and word[0] not in "=/"  # sudo's test; env takes any word with "="


def _leading_options(words: list[str], syntax: _Syntax) -> tuple[_Options, list[str], list[str]]:
    """A launcher's options, its NAME=VALUE words, and the command it starts, read as the launcher reads them:
    ``sudo -uE python`` is user "E" (no -E), ``sudo -Eu bob python`` is -E and user "bob", ``srun -N 2 python``
    runs python, and in ``sudo -u bob python -E`` the -E is python's."""
    options: _Options = []
    assignments: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word == "--":
            break
        if word.startswith("--"):
            name, equals, value = word[2:].partition("=")
            if equals or name in syntax.long_without_value.split() or index == len(words):
                options.append((name, value if equals else None))
            else:
                options.append((name, words[index]))
                index += 1
        elif word == "-":
            options.append(("-", None))
        elif word.startswith("-"):
            for position, letter in enumerate(word[1:], start=2):
                if letter in syntax.short_with_value:
                    value = word[position:]
                    if not value and index < len(words):
                        value, index = words[index], index + 1
                    options.append((letter, value))
                    break
                options.append((letter, None))
        elif syntax.assignments and _is_assignment(word):
            assignments.append(word)
        else:
            index -= 1
            break
    while syntax.assignments and index < len(words) and _is_assignment(words[index]):
        assignments.append(words[index])  # env reads them after "--" too
        index += 1
    return options, assignments, words[index:]


def _assign(reaching: frozenset[str], assignments: list[str]) -> frozenset[str]:
    """``reaching`` after NAME=VALUE words: ``FSDP_SHIM=`` anything reaches (``=0`` is off on purpose),
    ``PYTHONPATH=VALUE`` only with a bootstrap folder in VALUE (a shell expands ``$PYTHONPATH`` before run adds it)."""
    result = set(reaching)
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        if name == SHIM_VARIABLE or (name == "PYTHONPATH" and bootstrap_on_pythonpath({"PYTHONPATH": value})):
            result.add(name)
        else:
            result.discard(name)
    return frozenset(result)


def _through_slurm(
    program: str, options: _Options, environ: Mapping[str, str], reaching: frozenset[str]
) -> tuple[frozenset[str], str]:
    """What reaches the tasks of srun or sbatch, and the warning if that is nothing. The last --export, else the
    first variable set; neither: ALL. Read as srun's _build_user_env reads it: the list ends at a NONE, an ALL
    before it exports everything, both in any case; otherwise only the names listed and NAME=VALUE pairs reach."""
    given = [f"--export={value}" for name, value in options if name == "export" and value is not None]
    given = given[-1:] or [f"{name}={environ[name]}" for name in _SLURM_EXPORT_VARIABLES[program] if name in environ]
    if not given:
        return reaching, ""
    source = given[0]
    tokens = source.partition("=")[2].split(",")
    keywords = [token.upper() for token in tokens]
    if "NONE" in keywords:
        tokens = tokens[: keywords.index("NONE")]
    if any(token.upper() == "ALL" for token in tokens):
        return reaching | _assign(frozenset(), tokens), ""
    passed = _assign(reaching & frozenset(tokens), [token for token in tokens if "=" in token])
    inside = "`srun ... fsdp-shim run python ...`" if program == "srun" else "in its job script's steps"
    return passed, (
        f"`{program}` with {source} passes neither {SHIM_VARIABLE} nor fsdp-shim's PYTHONPATH to its tasks, so no "
        f"rank will have the shim. Put fsdp-shim run inside it ({inside}), use --export=ALL,..., or name "
        f"{SHIM_VARIABLE} (--export={SHIM_VARIABLE}=1,...) with fsdp-shim installed on every node."
    )


def _through_env(options: _Options, assignments: list[str], reaching: frozenset[str]) -> tuple[frozenset[str], str]:
    """What ``env`` passes on: everything unless -i (``-``, ``--ignore-environment``), then its NAME=VALUE
    words. ``-u NAME`` is not followed: unsetting a shim variable by name is a choice, not an accident."""
    clears = any(name in ("i", "-", "ignore-environment") for name, _ in options)
    how = " -i" if clears else ""
    return _assign(frozenset() if clears else reaching, assignments), (
        f"`env{how}` starts its command without {SHIM_VARIABLE} or fsdp-shim's PYTHONPATH, so it gets no shim. "
        f"Put fsdp-shim run after it (`env{how} ... fsdp-shim run python ...`) or pass {SHIM_VARIABLE}=1 "
        f"(`env{how} {SHIM_VARIABLE}=1 ...`) with fsdp-shim installed there."
    )


def _through_sudo(
    options: _Options, assignments: list[str], command: list[str], reaching: frozenset[str]
) -> tuple[frozenset[str], str]:
    """What reaches the command ``sudo`` 1.9 runs with the default policy. ``-E`` deletes PYTHONPATH and looks the
    command up on secure_path: FSDP_SHIM alone counts only for a command named by its path (a bare ``python`` is
    typically the system's, which runs unpatched and says nothing)."""
    keeps_all = any(name in ("E", "preserve-env") and value is None for name, value in options)
    by_path = keeps_all and bool(command) and "/" in command[0]  # then FSDP_SHIM reaches the Python named
    listed = {name for option, value in options if option == "preserve-env" and value for name in value.split(",")}
    passed = _assign(reaching & frozenset({*listed, SHIM_VARIABLE} if by_path else listed), assignments)
    keep_both = f"`sudo --preserve-env=PYTHONPATH,{SHIM_VARIABLE} ...`"
    if by_path:
        return passed, (
            f"`sudo -E` deletes PYTHONPATH (as unsafe), and {SHIM_VARIABLE} did not reach sudo: use {keep_both}."
        )
    if keeps_all:
        program = command[0] if command else "python"
        return passed, (
            f"`sudo -E` passes {SHIM_VARIABLE} but not PYTHONPATH (sudo deletes it as unsafe), and looks `{program}` "
            "up on its secure_path, not your PATH: a Python started that way without fsdp-shim installed runs "
            f"without the shim and says nothing. Name it by its full path (`sudo -E /path/to/bin/{program} ...`), or "
            f"keep PYTHONPATH too ({keep_both}), so that any Python arms the shim or says why it cannot."
        )
    return passed, (
        f"`sudo` resets the environment, so its command gets neither {SHIM_VARIABLE} nor PYTHONPATH, and no shim. "
        f"Keep both with {keep_both}, or run fsdp-shim inside it (`sudo ... /path/to/bin/fsdp-shim run python ...`). "
        f"`sudo -E` keeps {SHIM_VARIABLE} but not PYTHONPATH (sudo deletes it as unsafe): enough only for a Python "
        "named by its full path that has fsdp-shim installed."
    )


def environment_warnings(command: list[str], environ: Mapping[str, str]) -> list[str]:
    """A warning naming the launcher in ``command`` at which the shim is lost (every rank would train unpatched
    with exit code 0), else an empty list. Only the launcher chain at the start counts: it ends at the first other
    program, after sbatch (its operand is a job script), or at ``fsdp-shim run``, which checks its own command."""
    reaching = _SHIM_VARIABLES
    warning = ""
    words = command
    while words:
        program = os.path.basename(words[0])
        if program == "fsdp-shim" and words[1:2] == ["run"]:
            return []
        if program not in _LAUNCHERS:
            break
        options, assignments, words = _leading_options(words[1:], _LAUNCHERS[program])
        arriving, message = reaching, ""
        if program in _SLURM_EXPORT_VARIABLES:
            reaching, message = _through_slurm(program, options, environ, reaching)
        elif program == "env":
            reaching, message = _through_env(options, assignments, reaching)
        elif program == "sudo":
            reaching, message = _through_sudo(options, assignments, words, reaching)
        if arriving and not reaching:
            warning = message
        if program == "sbatch":
            break
    return [] if reaching else [warning]


def run(command: list[str]) -> int:
    """Exec ``command``; returns only when it cannot be started (126/127, as a shell does)."""
    if not command:
        print("fsdp-shim run: no command given. Usage: fsdp-shim run CMD [ARGS...]", file=sys.stderr)
        return 2
    python = python_command(command) or []
    skipping = flags_skipping_the_bootstrap(python)
    if skipping and "S" not in skipping and _has_this_fsdp_shim(python):
        skipping = []  # -I/-E drop PYTHONPATH, but this interpreter's fsdp_shim_env.pth reads FSDP_SHIM
    if skipping:
        reasons = "; ".join(SKIPPING_FLAGS[flag] for flag in skipping)
        remedy = "" if "S" in skipping else "an installed start-up file (`fsdp-shim install`) or "
        print(
            f"fsdp-shim run: warning: cannot activate the shim in this Python process ({reasons}); only {remedy}"
            "`import fsdp_shim` in the script can.",
            file=sys.stderr,
        )
    for warning in environment_warnings(command, os.environ):
        print(f"fsdp-shim run: warning: {warning}", file=sys.stderr)
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
