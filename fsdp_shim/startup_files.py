"""The environment-wide start-up files: where they go, what they say, and how to recognise them.

Two files with the same stem: ``fsdp_shim.pth`` (an ``import`` line, read by every CPython today)
and ``fsdp_shim.start`` (a PEP 829 entry point; Python 3.15+ reads it and then ignores the ``.pth``
import line, so the shim is armed once either way).

The ``.pth`` line runs ``_fsdp_shim_startup.WATCHER_CODE`` inline and imports nothing, so it
costs no measurable start-up time, and if the package is removed while the file stays behind
(``pip uninstall`` does not know about it) every interpreter still starts cleanly and Lightning
still imports. A stale ``.start`` file cannot be made silent: Python 3.15+ prints one error line
for it.
"""

from __future__ import annotations

import os
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from _fsdp_shim_startup import HAND_OVER_CODE, LIGHTNING_PACKAGES, WATCHER_CODE

STEM = "fsdp_shim"
ENVIRONMENT_FILE = "fsdp_shim_env.pth"
"""The start-up file pip installs with the package: it arms the shim where ``FSDP_SHIM`` is on, and
is not one of the files ``fsdp-shim install`` writes or removes."""
MARKER = "# fsdp-shim start-up file"

PTH_TEXT = (
    f"{MARKER}: written by `fsdp-shim install`, removed by `fsdp-shim uninstall`.\n"
    "# Imports nothing: arms a watcher that loads the shim when a process imports Lightning.\n"
    f"import sys; exec({WATCHER_CODE!r}, {{'sys': sys, 'SOURCE': 'startup file', "
    f"'WATCHED': {list(LIGHTNING_PACKAGES)!r}, 'HAND_OVER_CODE': {HAND_OVER_CODE!r}}})\n"
)
START_TEXT = (
    f"{MARKER} (PEP 829): written by `fsdp-shim install`, removed by `fsdp-shim uninstall`.\n"
    "_fsdp_shim_startup:arm_from_startup_file\n"
)
FILES = {f"{STEM}.pth": PTH_TEXT, f"{STEM}.start": START_TEXT}


class StartupFileError(Exception):
    """Writing or removing a start-up file failed; the message names the folder and what to do."""


def default_directory(user: bool = False) -> Path:
    """Where ``install`` writes without ``--target``: this interpreter's site-packages (or user site)."""
    if user:
        return Path(site.getusersitepackages())
    return Path(sysconfig.get_paths()["purelib"])


def user_site_is_read() -> bool:
    """Whether this interpreter reads the user site-packages (not inside a virtual environment)."""
    return bool(site.ENABLE_USER_SITE)


def site_directories() -> list[Path]:
    """Directories whose start-up files this interpreter reads, in the order ``site`` reads them."""
    directories = [Path(p) for p in site.getsitepackages()]
    if user_site_is_read():
        directories.insert(0, Path(site.getusersitepackages()))
    return directories


def read_by_this_interpreter(directory: Path) -> bool:
    """Whether ``site`` reads start-up files from ``directory`` when this interpreter starts."""
    return _canonical(directory) in {_canonical(d) for d in site_directories()}


def _canonical(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


@dataclass(frozen=True)
class StartupFile:
    path: Path
    current: bool
    """Whether the content is what this version of fsdp-shim writes."""


def install(directory: Path, create: bool = False) -> tuple[list[Path], list[Path]]:
    """Write both files, or neither; returns (written, already current). Idempotent.

    ``create`` makes a missing directory first. Each file is written to a temporary name and renamed
    into place, so a starting interpreter sees the old file or the new one, never half of one.
    """
    if not directory.is_dir():
        if directory.exists():
            raise StartupFileError(f"{directory} is not a directory")
        if not create:
            raise StartupFileError(f"{directory} does not exist")
        try:
            directory.mkdir(parents=True)
        except OSError as error:
            raise _cannot_write(directory, error) from error
    pending = [(directory / name, text) for name, text in FILES.items()]
    unchanged = [path for path, text in pending if _read(path) == text]
    pending = [(path, text) for path, text in pending if path not in unchanged]
    temporaries: list[tuple[Path, Path]] = []
    try:
        for path, text in pending:
            temporary = path.with_name(f".{path.name}.tmp")
            temporaries.append((temporary, path))
            temporary.write_text(text)
    except OSError as error:
        for temporary, _ in temporaries:
            temporary.unlink(missing_ok=True)
        raise _cannot_write(directory, error) from error
    for temporary, path in temporaries:  # renames within one directory: both succeed once writes did
        temporary.replace(path)
    return [path for _, path in temporaries], unchanged


def uninstall(directory: Path) -> list[Path]:
    """Remove both files where they are ours; returns what was removed."""
    removed = []
    for name in FILES:
        path = directory / name
        if _read(path).startswith(MARKER):
            try:
                path.unlink()
            except OSError as error:
                raise _cannot_write(directory, error) from error
            removed.append(path)
    return removed


def find(directories: list[Path] | None = None) -> list[StartupFile]:
    """Start-up files of ours in the given (default: this interpreter's site) directories."""
    found = []
    for directory in directories if directories is not None else site_directories():
        for name, text in FILES.items():
            content = _read(directory / name)
            if content.startswith(MARKER):
                found.append(StartupFile(directory / name, content == text))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def _cannot_write(directory: Path, error: OSError) -> StartupFileError:
    return StartupFileError(f"cannot write to {directory} ({type(error).__name__}: {error.strerror or error})")
