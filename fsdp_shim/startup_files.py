"""The environment-wide start-up files: where they go, what they say, and how to recognise them.

``fsdp-shim install`` writes three files into a site directory:

* ``_fsdp_shim_startup_file.py``, a copy of ``_fsdp_shim_trampoline`` (compiled to a ``.pyc`` at once);
* ``fsdp_shim.pth``, an ``import`` line read by every CPython today, which imports that copy (the copy
  arms its finder when imported under its name);
* ``fsdp_shim.start``, a PEP 829 entry point: Python 3.15+ reads it and then ignores the ``.pth``
  import line, so the shim is armed once either way.

Importing a ``.pyc`` costs every interpreter start less than compiling the same code from a line of
the ``.pth`` would (about 0.2 ms against 0.45 ms, docs/benchmarks.md: a fresh process pays for the
compiler's first use). The copy, rather than the package's own module, keeps a file that
``pip uninstall`` left behind (it does not know about these files) silent: the copy still imports,
finds no shim to hand over to at Lightning's import, and Lightning imports as if it were not there.
A stale ``.start`` file cannot be made silent: Python 3.15+ prints one error line for it.
"""

from __future__ import annotations

import contextlib
import hashlib
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

import _fsdp_shim_trampoline

STEM = "fsdp_shim"
ENVIRONMENT_FILE = "fsdp_shim_env.pth"
"""The start-up file pip installs with the package: it arms the shim where ``FSDP_SHIM`` is on, and
is not one of the files ``fsdp-shim install`` writes or removes."""
MARKER = "# fsdp-shim start-up file"
COPY_MODULE = _fsdp_shim_trampoline.COPY_NAME
"""The name ``fsdp-shim install`` gives its copy of ``_fsdp_shim_trampoline``."""


class StartupFileError(Exception):
    """Writing or removing a start-up file failed; the message names the folder and what to do."""


def _trampoline_source() -> str:
    """The source of ``_fsdp_shim_trampoline``, read through its loader (a zip import works too); an
    install without it cannot write the copy."""
    try:
        source = _fsdp_shim_trampoline.__loader__.get_source("_fsdp_shim_trampoline")  # type: ignore[union-attr]
    except Exception as error:
        message = f"cannot read the source of _fsdp_shim_trampoline ({type(error).__name__}: {error})"
        raise StartupFileError(message) from error
    if not source or "def fsdp_shim_watcher" not in source:
        where = getattr(_fsdp_shim_trampoline, "__file__", "?")
        raise StartupFileError(
            f"this fsdp-shim install has no usable source for _fsdp_shim_trampoline ({where}), which "
            "`fsdp-shim install` copies; reinstall fsdp-shim from a wheel or sdist"
        )
    return source


try:
    TRAMPOLINE_SOURCE = _trampoline_source()
    TRAMPOLINE_PROBLEM: str | None = None
except StartupFileError as problem:  # every other command still works; install says this
    TRAMPOLINE_SOURCE = ""
    TRAMPOLINE_PROBLEM = str(problem)

WRITTEN_BY = "written by `fsdp-shim install`, removed by `fsdp-shim uninstall`."
COPY_TEXT: str | None = (
    None
    if TRAMPOLINE_PROBLEM
    else f"{MARKER}: {WRITTEN_BY}\n# A copy of _fsdp_shim_trampoline.py, which {STEM}.pth imports.\n{TRAMPOLINE_SOURCE}"
)
PTH_TEXT: str | None = (
    None
    if TRAMPOLINE_PROBLEM
    else f"{MARKER}: {WRITTEN_BY}\n"
    f"# Imports {COPY_MODULE}, which install writes next to this file: it arms a finder that loads the shim\n"
    "# when a process imports Lightning.\n"
    f"import {COPY_MODULE}\n"
)
START_TEXT = f"{MARKER} (PEP 829): {WRITTEN_BY}\n_fsdp_shim_startup:arm_from_startup_file\n"
COPY_FILE = f"{COPY_MODULE}.py"
PTH_NAME = f"{STEM}.pth"
FILES: dict[str, str | None] = {COPY_FILE: COPY_TEXT, PTH_NAME: PTH_TEXT, f"{STEM}.start": START_TEXT}
"""What this version writes at each name (``None``: it cannot write that file, see TRAMPOLINE_PROBLEM),
in the order it writes them: the copy before the line that imports it (``uninstall`` goes the other
way), so a starting interpreter never finds the line without the module."""


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


PREVIOUS_DIGESTS = frozenset(
    {
        # SHA-256 of every start-up file text earlier fsdp-shim versions wrote (0.2.0 and the
        # development versions around it), so `install` upgrades them and `uninstall` removes them
        # without asking, while a file with any other content is someone else's.
        "8b08d613d3f4054110b3883c81dbd2ae20cecf241985bda4d437ec054ead13aa",  # 0.2.0
        "f613e3be5cc8d3bcbc15351938b984d40fb978d8dc6ca79f5e4f09ea2b0a0849",
        "44ad4bf1742e8c50dc472ae77b7aefd23dfccf55571728f8276b981f995b5d63",
        "af4661eeab14bc5646e48889b51d51ad2aba0e2a60f30e6c1e3ac9c203e50270",
        "60134e6b1aa147cdc9e63777a12df51b066cf499ea706559eabbd94cba4515b1",
        "e8986c188fc8523ab7ebc214e759e53f1788091a71c3c000f0c0976366d7f098",
        "77cda68d971c2389cfe7f95ec5b1826d2b3a4c9dc2b698f6e82c68320b57fd5e",
        "27630d4bd7548ec9de6f44aee8b9ffdc14c46fa47d0474398ce43227f27af865",
        "ccbfe4ddb1d22604b17211e8202f5f8bfdc8cec63e4e70e162980558a98d304b",
        "10663d3e05c8027aefc8860e93fa1a4a9f3de7a067a8958778cd9ad21fb7e15a",
        "90492aefebd4556bb9867a8b9a8e95c1546552fd9d38c7b16ca3d25ce2bee605",  # the .pth that carried the source
        "f395258f2bced5447c25f89a9d30e30c24501dc4a2c6678b486913ad882c2d46",  # the copy, armed by the .pth's call
        "43c4dd05485c257ff11ba29e209504b90d7511ef02d37d417d0e476d3d70efe1",  # the .pth that called arm()
    }
)


class ForeignFileError(StartupFileError):
    """A file at one of fsdp-shim's names holds content fsdp-shim never wrote; ``--force`` replaces it."""


@dataclass(frozen=True)
class Existing:
    """What sits at one start-up file's path, looked at without following a link."""

    path: Path
    kind: str
    """``missing``, ``current`` (this version's text), ``ours`` (an earlier version's text), ``foreign``
    (a regular file with other content), ``link``, ``directory`` or ``special``."""

    def why_not_ours(self) -> str:
        return {
            "foreign": "its content is not what fsdp-shim wrote (edited, or another program's file)",
            "link": "it is a symbolic link",
            "directory": "it is a directory",
            "special": "it is not a regular file",
        }[self.kind]


def inspect(path: Path, text: str | None) -> Existing:
    """Classify what is at ``path``; ``text`` is what this version writes there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Existing(path, "missing")
    except OSError:
        return Existing(path, "special")
    if stat.S_ISLNK(info.st_mode):
        return Existing(path, "link")
    if stat.S_ISDIR(info.st_mode):
        return Existing(path, "directory")
    if not stat.S_ISREG(info.st_mode):
        return Existing(path, "special")
    content = _read_bytes(path)
    if content is None and not os.path.lexists(path):
        return Existing(path, "missing")  # removed between the look and the read (a concurrent uninstall)
    if text is not None and content == text.encode():
        return Existing(path, "current")
    if content is not None and hashlib.sha256(content).hexdigest() in PREVIOUS_DIGESTS:
        return Existing(path, "ours")
    return Existing(path, "foreign")


@dataclass
class Installed:
    written: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    replaced_foreign: list[Existing] = field(default_factory=list)
    """Files fsdp-shim did not write that ``replace_foreign`` let it replace (reported, never silent)."""


def install(directory: Path, create: bool = False, replace_foreign: bool = False) -> Installed:
    """Write every file, or none. Idempotent.

    ``create`` makes a missing directory first. Each file is written to a new file with an
    unpredictable name (``tempfile.mkstemp``: created exclusively, never through a link another user
    planted in a shared site-packages) and renamed over the final name, which replaces a link there
    rather than writing through it; a starting interpreter sees the old file or the new one, never
    half of one. Concurrent installs into one folder each rename their own file, so all succeed.
    A file at any of the names that fsdp-shim did not write is replaced only with ``replace_foreign``.
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
    if TRAMPOLINE_PROBLEM is not None:
        raise StartupFileError(TRAMPOLINE_PROBLEM)
    result = Installed()
    pending: list[tuple[Existing, str]] = []
    for name, text in FILES.items():
        existing = inspect(directory / name, text)
        if existing.kind in ("directory", "special"):
            raise StartupFileError(f"{existing.path} exists and {existing.why_not_ours()}")
        if existing.kind == "current":
            result.unchanged.append(existing.path)
            continue
        if existing.kind in ("foreign", "link"):
            if not replace_foreign:
                raise ForeignFileError(
                    f"{existing.path} exists and fsdp-shim did not write it: {existing.why_not_ours()}"
                )
            result.replaced_foreign.append(existing)
        pending.append((existing, text or ""))
    temporaries: list[tuple[str, Existing]] = []
    try:
        for existing, text in pending:
            temporaries.append((_write_temporary(directory, text), existing))
        for index, (temporary, existing) in enumerate(temporaries):
            try:
                os.replace(temporary, existing.path)
            except OSError:
                for _, done in temporaries[:index]:  # all or none: take back a file that was not there
                    if done.kind == "missing":
                        _unlink(done.path)
                raise
            result.written.append(existing.path)
    except OSError as error:
        raise _cannot_write(directory, error) from error
    finally:
        for temporary, _ in temporaries:
            _unlink(Path(temporary))
    _compile_copy(directory)
    return result


def _compile_copy(directory: Path) -> None:
    """Write the copy's ``.pyc`` now, so that no interpreter compiles it at start-up, not even where
    site-packages is read-only for the users who run Python. An interpreter that cannot use this
    one (another Python version) compiles its own, as for any module."""
    with contextlib.suppress(OSError, py_compile.PyCompileError):
        py_compile.compile(str(directory / COPY_FILE), doraise=True)


def _compiled_copies(directory: Path) -> list[Path]:
    """The copy's ``.pyc`` files, of every Python version that imported it (regular files only)."""
    cache = directory / "__pycache__"
    try:
        names = os.listdir(cache)
    except OSError:
        return []
    found = []
    for name in names:
        path = cache / name
        if name.startswith(f"{COPY_MODULE}.") and name.endswith(".pyc"):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    found.append(path)
    return found


def _write_temporary(directory: Path, text: str) -> str:
    descriptor, name = tempfile.mkstemp(prefix=f".{STEM}-", suffix=".tmp", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(descriptor, 0o666 & ~umask)  # as a plain write would make it: readable by every user
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            descriptor = -1
            handle.write(text)
    except BaseException:
        if descriptor != -1:
            os.close(descriptor)
        _unlink(Path(name))
        raise
    return name


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def uninstall(directory: Path) -> tuple[list[Path], list[Existing]]:
    """Remove the files where their whole content is what fsdp-shim wrote (this or an earlier
    version), and the copy's ``.pyc`` files with the copy; returns (removed, left): anything else at
    those names is left and reported."""
    removed, left = [], []
    for name, text in reversed(FILES.items()):
        existing = inspect(directory / name, text)
        if existing.kind == "missing":
            continue
        if existing.kind not in ("current", "ours"):
            left.append(existing)
            continue
        try:
            existing.path.unlink()
        except FileNotFoundError:
            continue  # a concurrent uninstall got there first
        except OSError as error:
            raise _cannot_write(directory, error) from error
        removed.append(existing.path)
        if name == COPY_FILE:
            for compiled in _compiled_copies(directory):
                _unlink(compiled)
            with contextlib.suppress(OSError):
                (directory / "__pycache__").rmdir()  # only where nothing else is in it
    return removed, left


def find(directories: list[Path] | None = None) -> list[StartupFile]:
    """Start-up files of ours in the given (default: this interpreter's site) directories."""
    found = []
    for directory in directories if directories is not None else site_directories():
        for name, text in FILES.items():
            content = _read(directory / name)
            if content.startswith(MARKER):
                found.append(StartupFile(directory / name, content == text))
    return found


def copy_imported_instead(directory: Path) -> Path | None:
    """The module that ``directory``'s ``fsdp_shim.pth`` imports in place of its own copy, where that
    module is not this version's copy; None where the start-up import arms the shim.

    The ``.pth`` imports the copy by name, not by path: a file of that name earlier on ``sys.path``
    (``PYTHONPATH``, a site directory read before this one) is what runs, and anything but the current
    copy arms nothing, which no interpreter would say. ``site`` reads the file before ``sys.path[0]``
    (the script's folder) is added, and with only the entries before ``directory`` in place.
    """
    search_path = sys.path if sys.flags.safe_path else sys.path[1:]
    position = [_canonical(Path(entry or os.curdir)) for entry in search_path]
    own = _canonical(directory)
    entries = search_path[: position.index(own) + 1] if own in position else [*search_path, str(directory)]
    spec = importlib.machinery.PathFinder.find_spec(COPY_MODULE, entries)
    found = Path(spec.origin) if spec is not None and spec.origin else None
    if found is not None and _canonical(found.parent) == own and found.name == COPY_FILE:
        return None  # its own copy: whether that copy is current is reported with the other files
    if found is not None and _read(found) == COPY_TEXT:
        return None  # another directory's current copy arms the shim just the same
    return found or directory / COPY_FILE


def _read(path: Path) -> str:
    content = _read_bytes(path)
    return "" if content is None else content.decode("utf-8", errors="replace")


def _read_bytes(path: Path) -> bytes | None:
    """The file's bytes, or ``None``; a symbolic link is not followed (it is nobody's start-up file)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        with os.fdopen(descriptor, "rb") as handle:
            descriptor = -1
            return handle.read(1 << 20)
    except OSError:
        return None
    finally:
        if descriptor != -1:
            os.close(descriptor)


def _cannot_write(directory: Path, error: OSError) -> StartupFileError:
    return StartupFileError(f"cannot write to {directory} ({type(error).__name__}: {error.strerror or error})")
