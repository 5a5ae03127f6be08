"""The environment-wide start-up files: where they go, what they say, and how to recognise them.

Two files with the same stem: ``fsdp_shim.pth`` (an ``import`` line, read by every CPython today)
and ``fsdp_shim.start`` (a PEP 829 entry point; Python 3.15+ reads it and then ignores the ``.pth``
import line, so the shim is armed once either way).

The ``.pth`` line runs :data:`_fsdp_shim_startup.WATCHER_CODE` inline and imports nothing, so it
costs no measurable start-up time, and if the package is removed while the file stays behind
(``pip uninstall`` does not know about it) every interpreter still starts cleanly and Lightning
still imports. A stale ``.start`` file cannot be made silent: Python 3.15+ prints one error line
for it.
"""

from __future__ import annotations

import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from _fsdp_shim_startup import WATCHER_CODE

STEM = "fsdp_shim"
MARKER = "# fsdp-shim start-up file"

PTH_TEXT = (
    f"{MARKER}: written by `fsdp-shim install`, removed by `fsdp-shim uninstall`.\n"
    "# Imports nothing: arms a watcher that loads the shim when a process imports Lightning.\n"
    f"import sys; exec({WATCHER_CODE!r}, {{'sys': sys, 'SOURCE': 'startup file'}})\n"
)
START_TEXT = (
    f"{MARKER} (PEP 829): written by `fsdp-shim install`, removed by `fsdp-shim uninstall`.\n"
    "_fsdp_shim_startup:arm_from_startup_file\n"
)
FILES = {f"{STEM}.pth": PTH_TEXT, f"{STEM}.start": START_TEXT}


def default_directory(user: bool = False) -> Path:
    """Where ``install`` writes without ``--target``: this interpreter's site-packages (or user site)."""
    if user:
        return Path(site.getusersitepackages())
    return Path(sysconfig.get_paths()["purelib"])


def site_directories() -> list[Path]:
    """Directories whose start-up files this interpreter reads, in the order ``site`` reads them."""
    directories = [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        directories.insert(0, Path(site.getusersitepackages()))
    return directories


@dataclass(frozen=True)
class StartupFile:
    path: Path
    current: bool
    """Whether the content is what this version of fsdp-shim writes."""

    @property
    def read_by_this_interpreter(self) -> bool:
        return self.path.parent.resolve() in {d.resolve() for d in site_directories() if d.exists()}


def install(directory: Path) -> tuple[list[Path], list[Path]]:
    """Write both files; returns (written, already current). Idempotent."""
    directory.mkdir(parents=True, exist_ok=True)
    written, unchanged = [], []
    for name, text in FILES.items():
        path = directory / name
        if path.exists() and path.read_text() == text:
            unchanged.append(path)
            continue
        temporary = path.with_name(f".{name}.tmp")
        temporary.write_text(text)
        temporary.replace(path)  # atomic: a concurrently starting interpreter sees old or new, never half
        written.append(path)
    return written, unchanged


def uninstall(directory: Path) -> list[Path]:
    """Remove both files where they are ours; returns what was removed."""
    removed = []
    for name in FILES:
        path = directory / name
        if path.exists() and path.read_text().startswith(MARKER):
            path.unlink()
            removed.append(path)
    return removed


def find(directories: list[Path] | None = None) -> list[StartupFile]:
    """Start-up files of ours in the given (default: this interpreter's site) directories."""
    found = []
    for directory in directories if directories is not None else site_directories():
        for name, text in FILES.items():
            path = directory / name
            if path.is_file():
                content = path.read_text(errors="replace")
                if content.startswith(MARKER):
                    found.append(StartupFile(path, content == text))
    return found
