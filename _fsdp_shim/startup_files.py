"""``fsdp-shim install`` / ``uninstall`` (docs/activation.md). The start-up module is copied, so that what ``pip
uninstall`` leaves behind still imports; ``fsdp_shim.pth`` only imports it (``site`` compiles every ``.pth`` line at
every start: a call after the import cost 0.1 M instructions more). The files change all together or not at all:
a ``.pth`` without its module prints a traceback at every start. A file whose first line is ``MARKER`` is ours."""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import py_compile
import site
import stat
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import _fsdp_shim
from _fsdp_shim import COPY_NAME

MARKER = "# fsdp-shim start-up file"
ENVIRONMENT_FILE = "fsdp_shim_env.pth"  # pip installs it (it arms where FSDP_SHIM is set), not `install`
COPY_FILE = f"{COPY_NAME}.py"
PTH_NAME = "fsdp_shim.pth"
START_NAME = "fsdp_shim.start"
WRITTEN_BY = "written by `fsdp-shim install`, removed by `fsdp-shim uninstall`."


class StartupFileError(Exception):
    """Writing or removing a start-up file failed; the message names the folder and what to do."""


class ForeignFileError(StartupFileError):
    """A file at one of fsdp-shim's names is someone else's; ``--force`` replaces it."""


def file_texts() -> dict[str, str]:
    """What this version writes at each name, in the order it writes them (``remove_files`` goes the other way),
    so a starting interpreter never finds the ``.pth`` without the module it imports."""
    try:  # through the loader, so that a zip import works too
        source = _fsdp_shim.__loader__.get_source("_fsdp_shim")
    except Exception as error:
        raise StartupFileError(f"cannot read the source of _fsdp_shim ({type(error).__name__}: {error})") from error
    if not source or "def fsdp_shim_finder" not in source:
        raise StartupFileError(
            f"this fsdp-shim install has no usable source for _fsdp_shim/__init__.py ({_fsdp_shim.__file__}), "
            "which `fsdp-shim install` copies; reinstall fsdp-shim from a wheel or sdist"
        )
    return {
        COPY_FILE: f"{MARKER}: {WRITTEN_BY}\n# A copy of _fsdp_shim/__init__.py, which {PTH_NAME} imports.\n" + source,
        PTH_NAME: f"{MARKER}: {WRITTEN_BY}\n# Arms a finder that hands Lightning to the shim when a process "
        f"imports it.\nimport {COPY_NAME}\n",
        START_NAME: f"{MARKER} (PEP 829): {WRITTEN_BY}\n{COPY_NAME}:arm\n",
    }


def default_directory(user: bool = False) -> Path:
    return Path(site.getusersitepackages()) if user else Path(sysconfig.get_paths()["purelib"])


def site_directories() -> list[Path]:
    """Directories whose start-up files this interpreter reads, in the order ``site`` reads them."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []  # not in a virtual environment, nor -s
    return [Path(p) for p in [*user, *site.getsitepackages()]]


def read_by_this_interpreter(directory: Path) -> bool:
    return canonical(directory) in {canonical(d) for d in site_directories()}


def canonical(path: Path | str) -> str:
    return os.path.normcase(os.path.realpath(path))


@dataclass(frozen=True)
class Existing:
    """What sits at one start-up file's path, looked at without following a link."""

    path: Path
    kind: str
    """``missing``, ``current``, ``ours`` (marked: old or edited), ``foreign``, ``link``, ``directory``, ``special``"""

    def why_not_ours(self) -> str:
        return {
            "foreign": "its first line is not fsdp-shim's marker (another program's file)",
            "link": "it is a symbolic link",
            "directory": "it is a directory",
            "special": "it is not a regular file",
        }[self.kind]


def inspect(path: Path, text: str | None) -> Existing:
    """Classify what is at ``path``; ``text`` is what this version writes there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Existing(path, "missing")
    except OSError:
        return Existing(path, "special")
    if stat.S_ISLNK(mode):
        return Existing(path, "link")
    if stat.S_ISDIR(mode):
        return Existing(path, "directory")
    if not stat.S_ISREG(mode):
        return Existing(path, "special")
    content = read_bytes(path)
    if content is None:  # unreadable, or removed since the look (a concurrent uninstall)
        return Existing(path, "foreign" if os.path.lexists(path) else "missing")
    if text is not None and content.replace(b"\r\n", b"\n") == text.encode():
        return Existing(path, "current")  # line endings aside: a file that went through an editor still arms
    return Existing(path, "ours" if content.startswith(MARKER.encode()) else "foreign")


def find() -> list[Existing]:
    """fsdp-shim's start-up files, current or not, in the directories this interpreter reads."""
    try:
        texts: dict[str, str | None] = dict(file_texts())
    except StartupFileError:
        texts = dict.fromkeys((COPY_FILE, PTH_NAME, START_NAME))
    found = (inspect(directory / name, text) for directory in site_directories() for name, text in texts.items())
    return [existing for existing in found if existing.kind in ("current", "ours")]


def copy_imported_instead(directory: Path) -> Path | None:
    """The module that ``directory``'s ``.pth`` imports by name in place of a current copy (a missing copy by its
    path), or ``None``. ``site`` reads the ``.pth`` with only the entries before ``directory`` on ``sys.path``, and
    before ``sys.path[0]`` (the script's folder) is added."""
    search_path = sys.path if getattr(sys.flags, "safe_path", False) else sys.path[1:]  # -P: Python 3.11+
    position = [canonical(entry or os.curdir) for entry in search_path]
    own = canonical(directory)
    entries = search_path[: position.index(own) + 1] if own in position else [*search_path, str(directory)]
    spec = importlib.machinery.PathFinder.find_spec(COPY_NAME, entries)
    found = Path(spec.origin) if spec is not None and spec.origin else None
    if found is None:
        return directory / COPY_FILE
    if canonical(found.parent) == own and found.name == COPY_FILE:
        return None  # its own copy: whether that copy is current is reported with the other files
    with contextlib.suppress(StartupFileError):
        if read_bytes(found) == file_texts()[COPY_FILE].encode():
            return None  # another directory's current copy arms the shim just the same
    return found


@dataclass
class Written:
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    replaced_foreign: list[Existing] = field(default_factory=list)
    """Files fsdp-shim did not write that ``replace_foreign`` let it replace (reported, never silent)."""


def write_files(directory: Path, create: bool = False, replace_foreign: bool = False) -> Written:
    """Write every file, or none; idempotent. Each is made by ``mkstemp`` (never through a planted link) and renamed
    over its name: a starting interpreter sees the old file or the new one; concurrent installs all succeed."""
    if not directory.is_dir():
        if directory.exists():
            raise StartupFileError(f"{directory} is not a directory")
        if not create:
            raise StartupFileError(f"{directory} does not exist")
        try:
            directory.mkdir(parents=True)
        except OSError as error:
            raise _cannot_write(directory, error) from error
    result = Written()
    pending: list[tuple[Existing, str]] = []
    for name, text in file_texts().items():
        existing = inspect(directory / name, text)
        if existing.kind in ("directory", "special"):
            raise StartupFileError(f"{existing.path} exists and {existing.why_not_ours()}")
        if existing.kind in ("foreign", "link") and not replace_foreign:
            raise ForeignFileError(f"{existing.path} exists and fsdp-shim did not write it: {existing.why_not_ours()}")
        if existing.kind == "current":
            result.unchanged.append(existing.path)
        else:
            pending.append((existing, text))
    result.replaced_foreign = [existing for existing, _ in pending if existing.kind in ("foreign", "link")]
    temporaries: list[tuple[str, Existing]] = []
    umask = os.umask(0)
    os.umask(umask)
    try:
        for existing, text in pending:
            descriptor, temporary = tempfile.mkstemp(prefix=".fsdp_shim-", suffix=".tmp", dir=directory)
            temporaries.append((temporary, existing))
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                os.fchmod(descriptor, 0o666 & ~umask)  # as a plain write would make it: readable by every user
                handle.write(text)
        for temporary, existing in temporaries:
            os.replace(temporary, existing.path)
            result.written.append(existing.path)
    except OSError as error:
        for existing, _ in pending[: len(result.written)]:  # all or none: take back those that were not there
            if existing.kind == "missing":
                _unlink(existing.path)
        raise _cannot_write(directory, error) from error
    finally:
        for temporary, _ in temporaries:
            _unlink(Path(temporary))
    with contextlib.suppress(OSError, py_compile.PyCompileError):  # now: site-packages may be read-only at start-up
        py_compile.compile(str(directory / COPY_FILE), doraise=True)
    return result


def remove_files(directory: Path) -> tuple[list[Path], list[Existing]]:
    """Remove fsdp-shim's files and the copy's ``.pyc`` files, or none where any is someone else's: (removed, left)."""
    found = (inspect(directory / name, None) for name in reversed(list(file_texts())))
    present = [existing for existing in found if existing.kind != "missing"]
    left = [existing for existing in present if existing.kind not in ("current", "ours")]
    if left:
        return [], left
    removed = []
    for existing in present:
        try:
            existing.path.unlink()
        except FileNotFoundError:
            continue  # a concurrent uninstall got there first
        except OSError as error:
            raise _cannot_write(directory, error) from error
        removed.append(existing.path)
    if any(path.name == COPY_FILE for path in removed):
        cache = directory / "__pycache__"
        with contextlib.suppress(OSError):
            for name in os.listdir(cache):
                if name.startswith(f"{COPY_NAME}.") and name.endswith(".pyc"):
                    _unlink(cache / name)
            cache.rmdir()  # only where nothing else is in it
    return removed, []


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes, or ``None``; a symbolic link is not followed (it is nobody's start-up file)."""
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no link, no wait on a FIFO
    try:
        with open(path, "rb", opener=lambda name, mode: os.open(name, mode | flags)) as handle:
            return handle.read(1 << 20) if stat.S_ISREG(os.fstat(handle.fileno()).st_mode) else None
    except OSError:
        return None


def _cannot_write(directory: Path, error: OSError) -> StartupFileError:
    return StartupFileError(f"cannot write to {directory} ({type(error).__name__}: {error.strerror or error})")
